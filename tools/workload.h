// Synthetic long-context decode workloads for `questkv run`.
//
// A Workload generates the K/V a model appends to every layer during prefill
// and decode, and the queries each decode step issues at every layer. Every
// float is a pure function of (seed, layer, head, token position or step),
// drawn from a counter-based generator: tokens [a, b) generated in one call
// or in chunks, and layers generated in any order, give bit-identical values,
// so two runs that differ only in memory settings see the same inputs and
// must produce the same outputs. bench/WORKLOADS.md describes both workloads.
//
// Thread safety: immutable after Create; const methods may run concurrently.
#pragma once

#include <cstdint>
#include <memory>
#include <string_view>
#include <vector>

#include "questkv/config.h"
#include "questkv/status.h"

namespace questkv {

enum class WorkloadKind : uint8_t {
  kStructured,  // topics, sinks, needles, relevance reversal
  kGaussian,    // i.i.d. N(0,1) keys, values and queries: no locality at all
};
std::string_view WorkloadKindName(WorkloadKind kind);
// "structured" or "gaussian"; InvalidArgument naming the choices otherwise.
Result<WorkloadKind> ParseWorkloadKind(std::string_view s);

struct WorkloadSpec {
  WorkloadKind kind = WorkloadKind::kStructured;
  uint64_t seed = 1;
  int64_t context_tokens = 32768;  // prefilled into every layer
  int64_t decode_steps = 256;      // each appends one token and queries every layer
};

// What the query of a decode step aims at; the same for every layer and head.
enum class QueryKind : uint8_t {
  kRecent,    // the current topic, whose closest keys are recent (temporal locality)
  kTopic,     // an older span that suddenly matters again (seed §1)
  kEntity,    // entity A, introduced early and mentioned over and over mid-context
  kReversal,  // entity B, similar to A but introduced once, early (seed §2.2)
  kNeedle,    // a needle: a few tokens on a direction no topic uses (recall)
  kRandom,    // gaussian workload: a random query with no target
};
std::string_view QueryKindName(QueryKind kind);

struct QueryTarget {
  QueryKind kind = QueryKind::kRandom;
  // Tokens [begin, end) the query aims at; empty for kRandom. For kEntity the
  // introduction of A (its mid-context mentions match as well).
  int64_t begin = 0;
  int64_t end = 0;
};

struct WorkloadState;  // defined in workload.cc

// How Tokens() computes its values, as read-only copies of the workload's
// tables and constants, for generators that reproduce them elsewhere
// (tools/workload_cuda.h). Reading it changes nothing Tokens() generates.
//
// Token at position pos, KV head h of layer l, D = head_dim, P = ceil(D/2):
// K starts as FillNormal(key_noise[l * Hkv + h], pos * P) (workload.cc), V
// likewise from value_noise. A structured workload then adds, by pos's role:
//   pos < sink_tokens:      K += sink_key_scale * key_dir(sink_dir); V *= sink_value_scale
//   inside a run r:         K += key_scale * key_dir(r.dir); V += value_scale * value_dir(r.dir)
//   else topic t of pos's span:
//                           K += key_scale * centroid(t, pos); V += value_scale * value_dir(topic_dir0 + t)
// where centroid(t, pos) is the normalised linear blend of the anchors of
// knots pos / drift_tokens and the next, and anchor(t, knot) is
// FillNormal(anchor_keys[(l * Hkv + h) * topics + t], knot * P) with the
// first basis_dirs key directions projected out, normalised, then
// anchor_fixed * key_dir(topic_dir0 + t) + anchor_drift * it.
struct WorkloadTokenTables {
  struct Run {
    int64_t begin;
    int64_t end;
    int dir;  // key and value direction index
  };
  // The structured workload's constants (zero for gaussian).
  struct Constants {
    int topics = 0;
    int dirs = 0;        // directions per head in key_dirs / value_dirs
    int basis_dirs = 0;  // the first basis_dirs are orthonormal
    int sink_dir = 0;
    int topic_dir0 = 0;
    int64_t sink_tokens = 0;
    int64_t drift_tokens = 0;
    float key_scale = 0, sink_key_scale = 0, value_scale = 0, sink_value_scale = 0;
    float anchor_fixed = 0, anchor_drift = 0;
  };
  bool structured = false;
  Constants constants;
  std::vector<uint64_t> key_noise;    // [L][Hkv] stream keys
  std::vector<uint64_t> value_noise;  // [L][Hkv]
  // Structured only (empty otherwise).
  std::vector<uint64_t> anchor_keys;  // [L][Hkv][topics]
  std::vector<int64_t> span_begins;  // spans + 1 entries, the last total_tokens
  std::vector<int> span_topics;      // [spans]
  std::vector<Run> runs;             // sorted, disjoint
  std::vector<float> key_dirs;       // [L][Hkv][dirs][D]
  std::vector<float> value_dirs;     // [L][Hkv][dirs][D]
};

class Workload {
 public:
  // Bound on context_tokens + decode_steps: the structured layout is held in
  // memory (one entry per ~300 tokens).
  static constexpr int64_t kMaxTokens = int64_t{1} << 30;

  // InvalidArgument when the geometry does not validate, context_tokens < 1,
  // decode_steps < 0, context_tokens + decode_steps > kMaxTokens, or the
  // workload is structured and head_dim < 16 (it needs 15 orthogonal
  // directions per head).
  static Result<Workload> Create(const Geometry& geometry, const WorkloadSpec& spec);

  const Geometry& geometry() const;
  const WorkloadSpec& spec() const;
  // context_tokens + decode_steps: the positions Tokens() can generate.
  int64_t total_tokens() const;
  // Leading tokens with sink keys (0 for gaussian).
  int64_t sink_tokens() const;

  // K and V of tokens [begin, begin + n) of a layer, token-major [n][Hkv][D]
  // each: the layout Runtime::Append takes. Decode step s appends position
  // context_tokens + s. Requires 0 <= layer < L, begin >= 0, n >= 0 and
  // begin + n <= total_tokens() (asserted).
  void Tokens(int layer, int64_t begin, int64_t n, float* k, float* v) const;

  // Queries [Hq][D] of decode step `step` at a layer: the query of the token
  // at position context_tokens + step, which attends positions
  // [0, context_tokens + step]. Requires 0 <= step < decode_steps (asserted).
  void Query(int layer, int64_t step, float* q) const;

  // What the queries of decode step `step` aim at (reports, tests).
  QueryTarget Target(int64_t step) const;

  // Copies of what Tokens() is computed from (see WorkloadTokenTables).
  WorkloadTokenTables TokenTables() const;

 private:
  explicit Workload(std::shared_ptr<const WorkloadState> state);
  std::shared_ptr<const WorkloadState> state_;
};

}  // namespace questkv
