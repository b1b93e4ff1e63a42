// The C API (questkv.h) over questkv::Runtime: conversion and error capture only.
#include "runtime/questkv.h"

#include <memory>
#include <span>
#include <string>

#include "runtime/runtime.h"

struct qkv_runtime {
  std::unique_ptr<questkv::Runtime> rt;
  std::string last_error;
};

namespace {

thread_local std::string create_error;

constexpr qkv_status kNullHandle = QKV_INVALID_ARGUMENT;

qkv_status Report(qkv_runtime* h, const questkv::Status& s) {
  h->last_error = s.ok() ? std::string() : s.ToString();
  return static_cast<qkv_status>(s.code());
}

template <typename T, typename F>
qkv_status ReportValue(qkv_runtime* h, questkv::Result<T> r, T* out, F&& assign) {
  if (!out) return Report(h, questkv::Status::InvalidArgument("null output pointer"));
  if (r.ok()) assign(*out, *r);
  return Report(h, r.status());
}

questkv::Config ToConfig(const qkv_config& c) {
  questkv::Config cfg;
  cfg.geometry.layers = c.layers;
  cfg.geometry.q_heads = c.q_heads;
  cfg.geometry.kv_heads = c.kv_heads;
  cfg.geometry.head_dim = c.head_dim;
  cfg.geometry.page_size = c.page_size;
  cfg.policy.token_budget = c.token_budget;
  cfg.policy.sink_pages = c.sink_pages;
  cfg.policy.local_pages = c.local_pages;
  cfg.policy.gqa = static_cast<questkv::GqaMode>(c.gqa);
  cfg.policy.dense_layers.assign(c.dense_layers, c.dense_layers + (c.dense_layers ? c.num_dense_layers : 0));
  cfg.max_pages = c.max_pages;
  cfg.hbm_bytes = c.hbm_bytes;
  cfg.host_bytes = c.host_bytes;
  cfg.disk_dir = c.disk_dir ? c.disk_dir : "";
  cfg.disk_bytes = c.disk_bytes;
  cfg.cold_miss = static_cast<questkv::ColdMissPolicy>(c.cold_miss);
  cfg.backend = static_cast<questkv::Backend>(c.backend);
  cfg.geometry.dtype = static_cast<questkv::DType>(c.dtype);
  cfg.geometry.summary_dtype = static_cast<questkv::SummaryDType>(c.summary_dtype);
  return cfg;
}

questkv::Status CheckEnums(const qkv_config& c) {
  if (c.gqa < QKV_GQA_MAX || c.gqa > QKV_GQA_UNION) return questkv::Status::InvalidArgument("unknown gqa mode");
  if (c.cold_miss < QKV_COLD_MISS_STRICT || c.cold_miss > QKV_COLD_MISS_DEADLINE)
    return questkv::Status::InvalidArgument("unknown cold-miss policy");
  if (c.backend < QKV_BACKEND_CPU || c.backend > QKV_BACKEND_CUDA) return questkv::Status::InvalidArgument("unknown backend");
  if (c.dtype < QKV_DTYPE_F32 || c.dtype > QKV_DTYPE_BF16) return questkv::Status::InvalidArgument("unknown dtype");
  if (c.summary_dtype < QKV_SUMMARY_KV || c.summary_dtype > QKV_SUMMARY_E4M3)
    return questkv::Status::InvalidArgument("unknown summary dtype");
  if (c.num_dense_layers < 0 || (c.num_dense_layers > 0 && !c.dense_layers))
    return questkv::Status::InvalidArgument("dense_layers is null or num_dense_layers negative");
  return questkv::Status::Ok();
}

}  // namespace

extern "C" {

void qkv_config_default(qkv_config* c) {
  static const int kDense[] = {0, 1};
  const questkv::Config d;
  *c = qkv_config{};
  c->layers = d.geometry.layers, c->q_heads = d.geometry.q_heads, c->kv_heads = d.geometry.kv_heads;
  c->head_dim = d.geometry.head_dim, c->page_size = d.geometry.page_size;
  c->token_budget = d.policy.token_budget;
  c->sink_pages = d.policy.sink_pages, c->local_pages = d.policy.local_pages;
  c->gqa = QKV_GQA_MAX;
  c->dense_layers = kDense;
  c->num_dense_layers = 2;
  c->max_pages = d.max_pages;
  c->cold_miss = QKV_COLD_MISS_STRICT;
  c->backend = QKV_BACKEND_CPU;
  c->dtype = QKV_DTYPE_F32;
  c->summary_dtype = QKV_SUMMARY_KV;
}

qkv_status qkv_create(const qkv_config* config, qkv_runtime** out) {
  if (!out || !config) {
    create_error = "InvalidArgument: null config or output pointer";
    return QKV_INVALID_ARGUMENT;
  }
  *out = nullptr;
  questkv::Status s = CheckEnums(*config);
  if (s.ok()) {
    auto rt = questkv::Runtime::Create(ToConfig(*config));
    if (rt.ok()) {
      *out = new qkv_runtime{std::move(*rt), {}};
      create_error.clear();
      return QKV_OK;
    }
    s = rt.status();
  }
  create_error = s.ToString();
  return static_cast<qkv_status>(s.code());
}

const char* qkv_create_error(void) { return create_error.c_str(); }
void qkv_destroy(qkv_runtime* rt) { delete rt; }
const char* qkv_last_error(const qkv_runtime* rt) { return rt ? rt->last_error.c_str() : ""; }

qkv_status qkv_sequence_create(qkv_runtime* h, uint64_t* seq) {
  if (!h) return kNullHandle;
  return ReportValue<uint64_t>(h, h->rt->CreateSequence(), seq, [](uint64_t& o, uint64_t v) { o = v; });
}
qkv_status qkv_sequence_fork(qkv_runtime* h, uint64_t parent, uint64_t* child) {
  if (!h) return kNullHandle;
  return ReportValue<uint64_t>(h, h->rt->Fork(parent), child, [](uint64_t& o, uint64_t v) { o = v; });
}
qkv_status qkv_sequence_from_prefix(qkv_runtime* h, uint64_t parent, int64_t pages, uint64_t* child) {
  if (!h) return kNullHandle;
  return ReportValue<uint64_t>(h, h->rt->CreateFromPrefix(parent, pages), child, [](uint64_t& o, uint64_t v) { o = v; });
}
qkv_status qkv_sequence_rollback(qkv_runtime* h, uint64_t seq, int64_t tokens) {
  if (!h) return kNullHandle;
  return Report(h, h->rt->Rollback(seq, tokens));
}
qkv_status qkv_sequence_free(qkv_runtime* h, uint64_t seq) {
  if (!h) return kNullHandle;
  return Report(h, h->rt->Free(seq));
}
qkv_status qkv_sequence_length(qkv_runtime* h, uint64_t seq, int layer, int64_t* tokens) {
  if (!h) return kNullHandle;
  return ReportValue<int64_t>(h, h->rt->Length(seq, layer), tokens, [](int64_t& o, int64_t v) { o = v; });
}
qkv_status qkv_append(qkv_runtime* h, uint64_t seq, int layer, const float* k, const float* v, int64_t n) {
  if (!h) return kNullHandle;
  return Report(h, h->rt->Append(seq, layer, k, v, n));
}
qkv_status qkv_decode_attention(qkv_runtime* h, const uint64_t* seqs, int batch, int layer, const float* q,
                                float* out) {
  if (!h) return kNullHandle;
  if (!seqs || batch < 1) return Report(h, questkv::Status::InvalidArgument("empty or null batch"));
  return Report(h, h->rt->DecodeAttention(std::span<const uint64_t>(seqs, std::size_t(batch)), layer, q, out));
}
qkv_status qkv_append_device(qkv_runtime* h, uint64_t seq, int layer, const void* k, const void* v, int64_t n) {
  if (!h) return kNullHandle;
  return Report(h, h->rt->AppendDevice(seq, layer, k, v, n));
}
qkv_status qkv_decode_attention_device(qkv_runtime* h, const uint64_t* seqs, int batch, int layer, const void* q,
                                       void* out) {
  if (!h) return kNullHandle;
  if (!seqs || batch < 1) return Report(h, questkv::Status::InvalidArgument("empty or null batch"));
  return Report(h, h->rt->DecodeAttentionDevice(std::span<const uint64_t>(seqs, std::size_t(batch)), layer, q, out));
}
qkv_status qkv_synchronize(qkv_runtime* h) {
  if (!h) return kNullHandle;
  return Report(h, h->rt->Synchronize());
}
void* qkv_cuda_stream(qkv_runtime* h) { return h ? h->rt->cuda_stream() : nullptr; }
qkv_status qkv_dense_attention(qkv_runtime* h, const uint64_t* seqs, int batch, int layer, const float* q,
                               float* out) {
  if (!h) return kNullHandle;
  if (!seqs || batch < 1) return Report(h, questkv::Status::InvalidArgument("empty or null batch"));
  return Report(h, h->rt->DenseAttention(std::span<const uint64_t>(seqs, std::size_t(batch)), layer, q, out));
}

}  // extern "C"
