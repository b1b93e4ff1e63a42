// Geometry, selection policy and runtime configuration, with validation.
//
// Plain value types. Validate() returns OK or InvalidArgument naming the
// offending field and value; nothing is clamped silently.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "questkv/status.h"

namespace questkv {

// Element types. K/V and queries are f32, f16 or bf16; kE4M3 (8-bit FP8
// codes rounded outward, core/e4m3.h) is for page summaries only.
enum class DType : uint8_t { kF32, kF16, kBF16, kE4M3 };
const char* DTypeName(DType d);
Result<DType> ParseDType(std::string_view s);
inline std::size_t DTypeBytes(DType d) { return d == DType::kF32 ? 4 : d == DType::kE4M3 ? 1 : 2; }

// How page summaries are stored. kKv: in the K/V dtype (f32 on the CPU
// backend), exact for keys stored in it. kE4M3: 8-bit codes rounded outward
// (core/e4m3.h), a quarter of f32's bytes and half of f16's for the
// select to scan; scores stay upper bounds, only looser. The CPU backend
// keeps those values as f32 (same selections, not the smaller footprint).
enum class SummaryDType : uint8_t { kKv, kE4M3 };
std::string_view SummaryDTypeName(SummaryDType d);
Result<SummaryDType> ParseSummaryDType(std::string_view s);

// Shape of the KV cache of one model.
struct Geometry {
  int layers = 4;
  int q_heads = 8;
  int kv_heads = 2;
  int head_dim = 64;
  int page_size = 16;  // S, tokens per page
  DType dtype = DType::kF32;
  SummaryDType summary_dtype = SummaryDType::kKv;

  int group() const { return q_heads / kv_heads; }  // G query heads per KV head
  // Elements of one head-page's K (or V): S*D.
  std::size_t head_page_elems() const { return std::size_t(page_size) * head_dim; }
  // Elements of one whole page, layout [2 (K,V)][Hkv][S][D].
  std::size_t page_elems() const { return 2 * std::size_t(kv_heads) * head_page_elems(); }
  std::size_t page_bytes() const { return page_elems() * DTypeBytes(dtype); }
  // Elements of one page's summaries, layout [Hkv][2 (min,max)][D].
  std::size_t summary_elems() const { return 2 * std::size_t(kv_heads) * head_dim; }
  bool e4m3_summaries() const { return summary_dtype == SummaryDType::kE4M3; }
  // Bytes of one summary element as the CUDA backend stores it (the CPU
  // backend keeps f32 values).
  std::size_t summary_elem_bytes() const { return e4m3_summaries() ? 1 : DTypeBytes(dtype); }

  Status Validate() const;
  std::string ToString() const;  // "L4 Hq8 Hkv2 D64 S16 f32", then " e4m3 summaries" if so
};

enum class GqaMode : uint8_t { kMax, kMean, kUnion };
std::string_view GqaModeName(GqaMode m);
Result<GqaMode> ParseGqaMode(std::string_view s);

// Pages for a block of new tokens of one sequence (Runtime::DecodeBlock).
//   kPerPosition: each position ranks pages with its own query, exactly as a
//     single-token call made right after its append would.
//   kShared: one page set for the block per KV head, chosen once over the
//     whole list (sink and local pages of the last position) by the block's
//     aggregate score: GqaMode's max or mean over every position and query
//     head of the group, or with kUnion the union of each (position, head)'s
//     top-K. Each position attends the shared pages within its causal view
//     and its own local window (so always its own token's page): an
//     approximation (a position may miss pages its own query ranks high, and
//     a later position's tail pages count against the budget of all).
enum class BlockSelection : uint8_t { kPerPosition, kShared };
std::string_view BlockSelectionName(BlockSelection b);
Result<BlockSelection> ParseBlockSelection(std::string_view s);

// Which pages each (sequence, layer, KV head) attends per decode step.
// Selected set = sink pages (first `sink_pages`) ∪ local window (last
// `local_pages`, so always the tail) ∪ top-K of the remaining pages by score,
// where the page budget floor(token_budget / S) counts sink and local inside
// it. A budget that covers every page selects every page.
struct SelectionPolicy {
  int64_t token_budget = 1024;
  int sink_pages = 1;
  int local_pages = 8;
  GqaMode gqa = GqaMode::kMax;
  // Layers that attend every page (the seed's "first two layers dense").
  std::vector<int> dense_layers = {0, 1};
  // Optional per-layer token budgets; empty, or one entry per layer, where a
  // negative entry means "use token_budget".
  std::vector<int64_t> layer_token_budgets;
  BlockSelection block_selection = BlockSelection::kPerPosition;
  // Two-stage re-rank (0: off, plain Quest): the top ceil(rerank * K) pages
  // by the bound are candidates, each ranked again by its exact maximum
  // logit (max over its keys of q·k, aggregated over the group as `gqa`
  // says: max or mean), and the best K kept. Reads the candidates' keys
  // (the CUDA backend from HBM or the host home; a candidate on disk keeps
  // its bound there). >= 1; needs gqa max or mean.
  double rerank = 0;
  // Exact hierarchical scan (0: off, the flat scan): a box over each run of
  // `group_pages` consecutive pages bounds every page score inside it, so the
  // score reads a group's pages only while its bound can reach the K-th best
  // score found so far. Selections are exactly the flat scan's; what it saves
  // in summary bytes depends on how far group bounds fall below the K-th
  // score. Runners-up for prefetch come from the groups read. >= 2.
  int group_pages = 0;
  // Adaptive budgets (0: off, a fixed K). Each ranking (a KV head's, or a
  // query head's under kUnion) takes the fewest top pages beyond sink and
  // local whose bound mass exp(U_p/sqrt(D)) leaves at most this share of the
  // ranked pages' bound mass unread, between `adaptive_floor` tokens' worth
  // and the layer's token budget (the cap): few pages where a handful of
  // bounds stand out, the cap where they are flat. A heuristic on the bounds,
  // not a certificate on the true softmax mass. In [0, 1); needs the flat scan.
  double unread_bound_mass = 0;
  int64_t adaptive_floor = 0;

  bool is_dense(int layer) const;
  int64_t token_budget_for(int layer) const;
  // floor(token_budget_for(layer) / S).
  int64_t page_budget(int layer, int page_size) const;
  Status Validate(const Geometry& g) const;
};

// What a decode step does when a selected page's home is on disk.
enum class ColdMissPolicy : uint8_t {
  kStrict,    // wait for the promotion: outputs equal the all-in-memory run
  kDeadline,  // attend without the page this step, promote in the background
};
std::string_view ColdMissPolicyName(ColdMissPolicy p);
Result<ColdMissPolicy> ParseColdMissPolicy(std::string_view s);

// The disk tier's I/O: kUring (io_uring), kUringSqpoll (io_uring whose
// entries a kernel thread submits: the decode thread makes no system call
// per request, and that thread spins on a core while requests keep coming),
// kPread (a thread pool), kAuto (io_uring where it works here, else the pool).
enum class IoBackendKind : uint8_t { kAuto, kUring, kPread, kUringSqpoll };
std::string_view IoBackendKindName(IoBackendKind k);
Result<IoBackendKind> ParseIoBackendKind(std::string_view s);

// Where the data plane runs. kCpu: host kernels, a bounded host arena stands
// in for hbm (CI, tests). kCuda: the decode step on the GPU (kernels/cuda),
// hbm in device memory, host homes in pinned mapped memory.
enum class Backend : uint8_t { kCpu, kCuda };
std::string_view BackendName(Backend b);
Result<Backend> ParseBackend(std::string_view s);

// Everything a Runtime is built from.
struct Config {
  Backend backend = Backend::kCpu;
  Geometry geometry;
  SelectionPolicy policy;
  // Bound on pages alive at once across all sequences and layers: sizes the
  // summary slab and the page-id space. Running out is ResourceExhausted.
  uint32_t max_pages = 1u << 16;

  // Tier budgets (DESIGN.md §1). Summaries are always resident and not
  // counted here. hbm: head-page slots for tail pages and cached sealed
  // head-pages (the CPU backend's bounded host arena); 0 = room for every
  // page. host: homes of sealed pages, whole pages rounded up to 4096 bytes;
  // 0 = room for every page. Past host_high_water (fraction of host) the
  // coldest pages are demoted to disk until host_low_water.
  std::size_t hbm_bytes = 0;
  std::size_t host_bytes = 0;
  double host_high_water = 0.90;
  double host_low_water = 0.75;
  // disk: page files in disk_dir (empty: no disk tier), at most disk_bytes.
  std::string disk_dir;
  uint64_t disk_bytes = 0;
  IoBackendKind io_backend = IoBackendKind::kAuto;
  int io_queue_depth = 64;
  // A demotion write re-checks its page's checksum before it goes to disk:
  // on the thread that decodes (false), or on the disk tier's own (true:
  // the write then goes to the backend at the tier's next call, so room on
  // the host comes later; on the 2-core development VM `deadline` skipped
  // ~50% more, bench/results/2026-12-07-cpu-io-submission-off-the-decode-thread.md).
  bool io_checks_off_thread = false;
  ColdMissPolicy cold_miss = ColdMissPolicy::kStrict;
  // Under deadline: the largest share of a sequence's selected head-pages at
  // a layer that its call may attend without. A call whose cold misses pass
  // it waits for them, as under strict (a query that jumps to a region on
  // disk would otherwise lose most of its layer's attention). In [0, 1];
  // 1: never waits.
  double deadline_skip_limit = 1.0;
  // Per (sequence, layer, KV head) and step, the best-ranked pages just
  // outside the selection are promoted from disk ahead of need.
  int prefetch_pages = 4;
  // CUDA backend tuning. The defaults are the measured best; each switch
  // exists to measure the alternative with the same binary.
  // A decode step whose shape repeats is replayed from a captured CUDA graph
  // (one launch) instead of ~20 launches; steps that wait for the host (cold
  // misses under strict) always launch directly.
  bool cuda_graphs = true;
  // A step's kernels chained by programmatic dependent launch (each may start
  // while its predecessor drains).
  bool cuda_chain_kernels = true;
  // The first 16 MiB of a call's misses staged into HBM by the resolve while
  // it chooses victims.
  bool cuda_stage_misses = true;
  // Misses past the staging fetched by the attention kernel itself (their
  // PCIe round trips overlap its reads of the hits); false: by the
  // resolve's own gather kernel before the attention.
  bool cuda_fill_in_attention = true;
  // Long rows' top-K in one launch when the grid is resident; true: always
  // split into launches (the one-launch kernel's blocks wait for each other,
  // which another stream holding SMs could stall).
  bool cuda_split_long_rows = false;
  // The select's scores on the tensor cores (f16 queries with f16 or E4M3
  // summaries, bf16 with bf16; one position a row): the same bound summed
  // in another order, so scores differ from the CPU backend's in their last
  // bits and a selection may where two scores are that close.
  bool cuda_mma_scores = false;
  // Host-side time of each decode step's and append's phases, and the
  // stream's time between the calls' marks (events between their work),
  // printed to stderr when the runtime is destroyed.
  bool cuda_profile_host = false;

  Status Validate() const;
};

}  // namespace questkv
