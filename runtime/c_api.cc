// The C API (questkv.h) over questkv::Runtime: conversion and error capture only.
#include "questkv/questkv.h"

#include <cstring>
#include <exception>
#include <memory>
#include <new>
#include <span>
#include <string>
#include <type_traits>

#include "questkv/runtime.h"

struct qkv_runtime {
  std::unique_ptr<questkv::Runtime> rt;
  std::string last_error;
};

namespace {

thread_local std::string create_error;

constexpr qkv_status kNullHandle = QKV_INVALID_ARGUMENT;

qkv_status Report(qkv_runtime* h, const questkv::Status& s) {
  try {
    h->last_error = s.ok() ? std::string() : s.ToString();
  } catch (const std::bad_alloc&) {
    h->last_error.clear();  // the code still says what happened
  }
  return static_cast<qkv_status>(s.code());
}

// Runs one call on a live handle: no C++ exception reaches the C caller. An
// allocation that fails inside the runtime is ResourceExhausted.
template <typename F>
qkv_status Guarded(qkv_runtime* h, F&& call) {
  if (!h) return kNullHandle;
  try {
    return Report(h, call());
  } catch (const std::bad_alloc&) {
    return Report(h, questkv::Status::ResourceExhausted("out of memory"));
  } catch (const std::exception& e) {
    return Report(h, questkv::Status::Internal(std::string("unexpected exception: ") + e.what()));
  }
}

// A new sequence from `make`, stored in *out; with a null out nothing is made.
template <typename F>
qkv_status NewSequence(qkv_runtime* h, uint64_t* out, F&& make) {
  return Guarded(h, [&]() -> questkv::Status {
    if (!out) return questkv::Status::InvalidArgument("null output pointer");
    QKV_ASSIGN_OR_RETURN(*out, make());
    return questkv::Status::Ok();
  });
}

questkv::Status CheckBatch(const uint64_t* seqs, int batch) {
  if (!seqs || batch < 1) return questkv::Status::InvalidArgument("empty or null batch");
  return questkv::Status::Ok();
}

// A block call's sequences and their block sizes, one each.
questkv::Status CheckBlockBatch(const uint64_t* seqs, const int* block, int batch) {
  QKV_RETURN_IF_ERROR(CheckBatch(seqs, batch));
  if (!block) return questkv::Status::InvalidArgument("null block sizes");
  return questkv::Status::Ok();
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
  cfg.prefetch_pages = c.prefetch_pages;
  cfg.cuda_graphs = c.cuda_graphs != 0;
  cfg.policy.block_selection = static_cast<questkv::BlockSelection>(c.block_selection);
  cfg.policy.rerank = c.rerank;
  cfg.policy.group_pages = c.group_pages;
  cfg.policy.unread_bound_mass = c.unread_bound_mass;
  cfg.policy.adaptive_floor = c.adaptive_floor;
  cfg.deadline_skip_limit = c.deadline_skip_limit;
  return cfg;
}

// A C caller may store any int in an enum field; in C++ loading a value
// outside the enumerators' range is undefined, so the field's bytes are
// read as its underlying integer.
template <class E>
bool InRange(const E& field, E lo, E hi) {
  std::underlying_type_t<E> v;
  std::memcpy(&v, &field, sizeof v);
  return v >= std::underlying_type_t<E>(lo) && v <= std::underlying_type_t<E>(hi);
}

questkv::Status CheckEnums(const qkv_config& c) {
  if (!InRange(c.gqa, QKV_GQA_MAX, QKV_GQA_UNION)) return questkv::Status::InvalidArgument("unknown gqa mode");
  if (!InRange(c.cold_miss, QKV_COLD_MISS_STRICT, QKV_COLD_MISS_DEADLINE))
    return questkv::Status::InvalidArgument("unknown cold-miss policy");
  if (!InRange(c.block_selection, QKV_BLOCK_PER_POSITION, QKV_BLOCK_SHARED))
    return questkv::Status::InvalidArgument("unknown block selection");
  if (!InRange(c.backend, QKV_BACKEND_CPU, QKV_BACKEND_CUDA)) return questkv::Status::InvalidArgument("unknown backend");
  if (!InRange(c.dtype, QKV_DTYPE_F32, QKV_DTYPE_BF16)) return questkv::Status::InvalidArgument("unknown dtype");
  if (!InRange(c.summary_dtype, QKV_SUMMARY_KV, QKV_SUMMARY_E4M3))
    return questkv::Status::InvalidArgument("unknown summary dtype");
  if (c.num_dense_layers < 0 || (c.num_dense_layers > 0 && !c.dense_layers))
    return questkv::Status::InvalidArgument("dense_layers is null or num_dense_layers negative");
  return questkv::Status::Ok();
}

}  // namespace

extern "C" {

void qkv_config_default(qkv_config* c) {
  if (!c) return;
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
  c->prefetch_pages = d.prefetch_pages;
  c->cuda_graphs = d.cuda_graphs ? 1 : 0;
  c->block_selection = static_cast<qkv_block_selection>(d.policy.block_selection);
  c->rerank = d.policy.rerank;
  c->group_pages = d.policy.group_pages;
  c->unread_bound_mass = d.policy.unread_bound_mass;
  c->adaptive_floor = d.policy.adaptive_floor;
  c->deadline_skip_limit = d.deadline_skip_limit;
}

qkv_status qkv_create(const qkv_config* config, qkv_runtime** out) {
  if (!out || !config) {
    create_error = "InvalidArgument: null config or output pointer";
    return QKV_INVALID_ARGUMENT;
  }
  *out = nullptr;
  questkv::Status s;
  try {
    s = CheckEnums(*config);
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
  } catch (const std::bad_alloc&) {
    s = questkv::Status::ResourceExhausted("out of memory creating the runtime");
    create_error.clear();
  }
  return static_cast<qkv_status>(s.code());
}

const char* qkv_create_error(void) { return create_error.c_str(); }
void qkv_destroy(qkv_runtime* rt) { delete rt; }
const char* qkv_last_error(const qkv_runtime* rt) { return rt ? rt->last_error.c_str() : ""; }

qkv_status qkv_sequence_create(qkv_runtime* h, uint64_t* seq) {
  return NewSequence(h, seq, [&] { return h->rt->CreateSequence(); });
}
qkv_status qkv_sequence_fork(qkv_runtime* h, uint64_t parent, uint64_t* child) {
  return NewSequence(h, child, [&] { return h->rt->Fork(parent); });
}
qkv_status qkv_sequence_from_prefix(qkv_runtime* h, uint64_t parent, int64_t pages, uint64_t* child) {
  return NewSequence(h, child, [&] { return h->rt->CreateFromPrefix(parent, pages); });
}
qkv_status qkv_sequence_rollback(qkv_runtime* h, uint64_t seq, int64_t tokens) {
  return Guarded(h, [&] { return h->rt->Rollback(seq, tokens); });
}
qkv_status qkv_sequence_free(qkv_runtime* h, uint64_t seq) {
  return Guarded(h, [&] { return h->rt->Free(seq); });
}
qkv_status qkv_sequence_length(qkv_runtime* h, uint64_t seq, int layer, int64_t* tokens) {
  return Guarded(h, [&]() -> questkv::Status {
    if (!tokens) return questkv::Status::InvalidArgument("null output pointer");
    QKV_ASSIGN_OR_RETURN(*tokens, h->rt->Length(seq, layer));
    return questkv::Status::Ok();
  });
}
qkv_status qkv_append(qkv_runtime* h, uint64_t seq, int layer, const float* k, const float* v, int64_t n) {
  return Guarded(h, [&] { return h->rt->Append(seq, layer, k, v, n); });
}
qkv_status qkv_append_draft(qkv_runtime* h, uint64_t seq, int layer, const float* k, const float* v, int64_t n) {
  return Guarded(h, [&] { return h->rt->AppendDraft(seq, layer, k, v, n); });
}
qkv_status qkv_sequence_accept(qkv_runtime* h, uint64_t seq) {
  return Guarded(h, [&] { return h->rt->Accept(seq); });
}
qkv_status qkv_decode_attention(qkv_runtime* h, const uint64_t* seqs, int batch, int layer, const float* q,
                                float* out) {
  return Guarded(h, [&]() -> questkv::Status {
    QKV_RETURN_IF_ERROR(CheckBatch(seqs, batch));
    return h->rt->DecodeAttention(std::span<const uint64_t>(seqs, std::size_t(batch)), layer, q, out);
  });
}
qkv_status qkv_decode_block(qkv_runtime* h, const uint64_t* seqs, const int* block, int batch, int layer,
                            const float* q, float* out) {
  return Guarded(h, [&]() -> questkv::Status {
    QKV_RETURN_IF_ERROR(CheckBlockBatch(seqs, block, batch));
    return h->rt->DecodeBlock(std::span<const uint64_t>(seqs, std::size_t(batch)),
                              std::span<const int>(block, std::size_t(batch)), layer, q, out);
  });
}
qkv_status qkv_append_device(qkv_runtime* h, uint64_t seq, int layer, const void* k, const void* v, int64_t n) {
  return Guarded(h, [&] { return h->rt->AppendDevice(seq, layer, k, v, n); });
}
qkv_status qkv_decode_attention_device(qkv_runtime* h, const uint64_t* seqs, int batch, int layer, const void* q,
                                       void* out) {
  return Guarded(h, [&]() -> questkv::Status {
    QKV_RETURN_IF_ERROR(CheckBatch(seqs, batch));
    return h->rt->DecodeAttentionDevice(std::span<const uint64_t>(seqs, std::size_t(batch)), layer, q, out);
  });
}
qkv_status qkv_append_draft_device(qkv_runtime* h, uint64_t seq, int layer, const void* k, const void* v,
                                   int64_t n) {
  return Guarded(h, [&] { return h->rt->AppendDraftDevice(seq, layer, k, v, n); });
}
qkv_status qkv_decode_block_device(qkv_runtime* h, const uint64_t* seqs, const int* block, int batch, int layer,
                                   const void* q, void* out) {
  return Guarded(h, [&]() -> questkv::Status {
    QKV_RETURN_IF_ERROR(CheckBlockBatch(seqs, block, batch));
    return h->rt->DecodeBlockDevice(std::span<const uint64_t>(seqs, std::size_t(batch)),
                                    std::span<const int>(block, std::size_t(batch)), layer, q, out);
  });
}
qkv_status qkv_synchronize(qkv_runtime* h) {
  return Guarded(h, [&] { return h->rt->Synchronize(); });
}
void* qkv_cuda_stream(qkv_runtime* h) { return h ? h->rt->cuda_stream() : nullptr; }
qkv_status qkv_dense_attention(qkv_runtime* h, const uint64_t* seqs, int batch, int layer, const float* q,
                               float* out) {
  return Guarded(h, [&]() -> questkv::Status {
    QKV_RETURN_IF_ERROR(CheckBatch(seqs, batch));
    return h->rt->DenseAttention(std::span<const uint64_t>(seqs, std::size_t(batch)), layer, q, out);
  });
}

}  // extern "C"
