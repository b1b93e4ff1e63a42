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

#include "runtime/config.h"
#include "runtime/status.h"

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

 private:
  explicit Workload(std::shared_ptr<const WorkloadState> state);
  std::shared_ptr<const WorkloadState> state_;
};

}  // namespace questkv
