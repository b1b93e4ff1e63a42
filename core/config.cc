#include "questkv/config.h"

#include <algorithm>

namespace questkv {

namespace {
std::string Field(std::string_view name, long long value, std::string_view rule) {
  return std::string(name) + " = " + std::to_string(value) + ": " + std::string(rule);
}
}  // namespace

const char* DTypeName(DType d) {
  switch (d) {
    case DType::kF32: return "f32";
    case DType::kF16: return "f16";
    case DType::kBF16: return "bf16";
    case DType::kE4M3: return "e4m3";
  }
  return "?";
}

Result<DType> ParseDType(std::string_view s) {
  if (s == "f32" || s == "fp32" || s == "float32") return DType::kF32;
  if (s == "f16" || s == "fp16" || s == "float16") return DType::kF16;
  if (s == "bf16" || s == "bfloat16") return DType::kBF16;
  return Status::InvalidArgument("unknown dtype '" + std::string(s) + "' (f32, f16, bf16)");
}

std::string_view SummaryDTypeName(SummaryDType d) {
  switch (d) {
    case SummaryDType::kKv: return "kv";
    case SummaryDType::kE4M3: return "e4m3";
  }
  return "?";
}

Result<SummaryDType> ParseSummaryDType(std::string_view s) {
  if (s == "kv") return SummaryDType::kKv;
  if (s == "e4m3" || s == "fp8" || s == "f8e4m3") return SummaryDType::kE4M3;
  return Status::InvalidArgument("unknown summary dtype '" + std::string(s) + "' (kv, e4m3)");
}

Status Geometry::Validate() const {
  if (layers < 1 || layers > 1024) return Status::InvalidArgument(Field("layers", layers, "must be in 1..1024"));
  if (kv_heads < 1 || kv_heads > 1024) return Status::InvalidArgument(Field("kv_heads", kv_heads, "must be in 1..1024"));
  if (q_heads < 1 || q_heads > 4096) return Status::InvalidArgument(Field("q_heads", q_heads, "must be in 1..4096"));
  if (q_heads % kv_heads != 0)
    return Status::InvalidArgument("q_heads = " + std::to_string(q_heads) + " is not a multiple of kv_heads = " +
                                   std::to_string(kv_heads));
  if (head_dim < 1 || head_dim > 512) return Status::InvalidArgument(Field("head_dim", head_dim, "must be in 1..512"));
  if (page_size < 1 || page_size > 1024) return Status::InvalidArgument(Field("page_size", page_size, "must be in 1..1024"));
  if (dtype == DType::kE4M3)
    return Status::InvalidArgument("dtype e4m3 is for page summaries only (summary_dtype); K/V are f32, f16 or bf16");
  if (dtype != DType::kF32 && dtype != DType::kF16 && dtype != DType::kBF16)
    return Status::InvalidArgument(Field("dtype", int(dtype), "must be f32, f16 or bf16"));
  if (summary_dtype != SummaryDType::kKv && summary_dtype != SummaryDType::kE4M3)
    return Status::InvalidArgument(Field("summary_dtype", int(summary_dtype), "must be kv or e4m3"));
  return Status::Ok();
}

std::string Geometry::ToString() const {
  return "L" + std::to_string(layers) + " Hq" + std::to_string(q_heads) + " Hkv" + std::to_string(kv_heads) + " D" +
         std::to_string(head_dim) + " S" + std::to_string(page_size) + " " + std::string(DTypeName(dtype)) +
         (summary_dtype == SummaryDType::kKv ? "" : " " + std::string(SummaryDTypeName(summary_dtype)) + " summaries");
}

std::string_view GqaModeName(GqaMode m) {
  switch (m) {
    case GqaMode::kMax: return "max";
    case GqaMode::kMean: return "mean";
    case GqaMode::kUnion: return "union";
  }
  return "?";
}

Result<GqaMode> ParseGqaMode(std::string_view s) {
  if (s == "max") return GqaMode::kMax;
  if (s == "mean") return GqaMode::kMean;
  if (s == "union") return GqaMode::kUnion;
  return Status::InvalidArgument("unknown GQA mode '" + std::string(s) + "' (max, mean, union)");
}

std::string_view BlockSelectionName(BlockSelection b) {
  switch (b) {
    case BlockSelection::kPerPosition: return "per-position";
    case BlockSelection::kShared: return "shared";
  }
  return "?";
}

Result<BlockSelection> ParseBlockSelection(std::string_view s) {
  if (s == "per-position") return BlockSelection::kPerPosition;
  if (s == "shared") return BlockSelection::kShared;
  return Status::InvalidArgument("unknown block selection '" + std::string(s) + "' (per-position, shared)");
}

bool SelectionPolicy::is_dense(int layer) const {
  return std::find(dense_layers.begin(), dense_layers.end(), layer) != dense_layers.end();
}

int64_t SelectionPolicy::token_budget_for(int layer) const {
  if (layer >= 0 && std::size_t(layer) < layer_token_budgets.size() && layer_token_budgets[layer] >= 0)
    return layer_token_budgets[layer];
  return token_budget;
}

int64_t SelectionPolicy::page_budget(int layer, int page_size) const {
  return token_budget_for(layer) / page_size;
}

Status SelectionPolicy::Validate(const Geometry& g) const {
  if (sink_pages < 0) return Status::InvalidArgument(Field("sink_pages", sink_pages, "must be >= 0"));
  if (local_pages < 1)
    return Status::InvalidArgument(Field("local_pages", local_pages, "must be >= 1 (the tail page is always attended)"));
  if (!layer_token_budgets.empty() && layer_token_budgets.size() != std::size_t(g.layers))
    return Status::InvalidArgument("layer_token_budgets has " + std::to_string(layer_token_budgets.size()) +
                                   " entries for " + std::to_string(g.layers) + " layers");
  if (gqa > GqaMode::kUnion) return Status::InvalidArgument(Field("gqa", int(gqa), "is not a GQA mode"));
  if (rerank != 0 && !(rerank >= 1 && rerank <= 1e6))
    return Status::InvalidArgument("rerank = " + std::to_string(rerank) + ": 0 (off) or a factor in 1..1e6");
  if (group_pages != 0 && !(group_pages >= 2 && group_pages <= (1 << 16)))
    return Status::InvalidArgument("group_pages = " + std::to_string(group_pages) + ": 0 (flat scan) or 2..65536");
  if (!(unread_bound_mass >= 0 && unread_bound_mass < 1))
    return Status::InvalidArgument("unread_bound_mass = " + std::to_string(unread_bound_mass) + ": 0 (off) or in (0, 1)");
  if (adaptive_floor < 0) return Status::InvalidArgument(Field("adaptive_floor", adaptive_floor, "must be >= 0"));
  if (unread_bound_mass > 0 && group_pages > 0)
    return Status::InvalidArgument("unread_bound_mass needs every page's bound: it excludes group_pages");
  if (rerank != 0 && gqa == GqaMode::kUnion)
    return Status::InvalidArgument("rerank needs gqa max or mean (union ranks per query head)");
  if (block_selection > BlockSelection::kShared)
    return Status::InvalidArgument(Field("block_selection", int(block_selection), "is not a block selection"));
  for (int layer : dense_layers)
    if (layer < 0 || layer >= g.layers)
      return Status::InvalidArgument(Field("dense layer", layer, "is not a layer of the geometry"));
  for (int layer = 0; layer < g.layers; ++layer) {
    if (is_dense(layer)) continue;
    const int64_t tokens = token_budget_for(layer);
    const int64_t pages = tokens / g.page_size;
    if (pages < int64_t(sink_pages) + int64_t(local_pages))
      return Status::InvalidArgument(
          "token budget " + std::to_string(tokens) + " of layer " + std::to_string(layer) + " gives " +
          std::to_string(pages) + " pages of " + std::to_string(g.page_size) + " tokens, fewer than sink (" +
          std::to_string(sink_pages) + ") + local (" + std::to_string(local_pages) + ") pages");
  }
  return Status::Ok();
}

std::string_view ColdMissPolicyName(ColdMissPolicy p) { return p == ColdMissPolicy::kStrict ? "strict" : "deadline"; }

Result<ColdMissPolicy> ParseColdMissPolicy(std::string_view s) {
  if (s == "strict") return ColdMissPolicy::kStrict;
  if (s == "deadline") return ColdMissPolicy::kDeadline;
  return Status::InvalidArgument("unknown cold-miss policy '" + std::string(s) + "' (strict, deadline)");
}

std::string_view IoBackendKindName(IoBackendKind k) {
  switch (k) {
    case IoBackendKind::kAuto: return "auto";
    case IoBackendKind::kUring: return "uring";
    case IoBackendKind::kPread: return "pread";
    case IoBackendKind::kUringSqpoll: return "uring-sqpoll";
  }
  return "?";
}

Result<IoBackendKind> ParseIoBackendKind(std::string_view s) {
  if (s == "auto") return IoBackendKind::kAuto;
  if (s == "uring") return IoBackendKind::kUring;
  if (s == "pread") return IoBackendKind::kPread;
  if (s == "uring-sqpoll") return IoBackendKind::kUringSqpoll;
  return Status::InvalidArgument("unknown I/O backend '" + std::string(s) + "' (auto, uring, uring-sqpoll, pread)");
}

std::string_view BackendName(Backend b) { return b == Backend::kCuda ? "cuda" : "cpu"; }

Result<Backend> ParseBackend(std::string_view s) {
  if (s == "cpu") return Backend::kCpu;
  if (s == "cuda") return Backend::kCuda;
  return Status::InvalidArgument("unknown backend '" + std::string(s) + "' (cpu, cuda)");
}

Status Config::Validate() const {
  QKV_RETURN_IF_ERROR(geometry.Validate());
  QKV_RETURN_IF_ERROR(policy.Validate(geometry));
  if (max_pages < 1 || max_pages > (1u << 30))
    return Status::InvalidArgument(Field("max_pages", max_pages, "must be in 1..2^30"));
  // Tails are pinned in hbm: it must hold at least one whole page.
  if (hbm_bytes != 0 && hbm_bytes < geometry.page_bytes())
    return Status::InvalidArgument("hbm_bytes = " + std::to_string(hbm_bytes) + " holds no page of " +
                                   std::to_string(geometry.page_bytes()) + " bytes");
  if (host_bytes != 0 && host_bytes < 2 * geometry.page_bytes())
    return Status::InvalidArgument("host_bytes = " + std::to_string(host_bytes) + " holds fewer than two pages of " +
                                   std::to_string(geometry.page_bytes()) + " bytes");
  if (!(host_low_water > 0 && host_low_water <= host_high_water && host_high_water <= 1))
    return Status::InvalidArgument("host water marks must satisfy 0 < low <= high <= 1");
  if (!disk_dir.empty() && disk_bytes == 0)
    return Status::InvalidArgument("a disk tier needs disk_bytes > 0");
  if (prefetch_pages < 0 || prefetch_pages > 4096)
    return Status::InvalidArgument(Field("prefetch_pages", prefetch_pages, "must be in 0..4096"));
  if (!(deadline_skip_limit >= 0 && deadline_skip_limit <= 1))
    return Status::InvalidArgument("deadline_skip_limit = " + std::to_string(deadline_skip_limit) + ": must be in [0, 1]");
  if (io_queue_depth < 1 || io_queue_depth > 4096)
    return Status::InvalidArgument(Field("io_queue_depth", io_queue_depth, "must be in 1..4096"));
  return Status::Ok();
}

}  // namespace questkv
