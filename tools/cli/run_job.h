// The main job of `questkv run`: prefill a long context into every layer of a
// batch of sequences from a synthetic workload, then decode N steps (append
// one token's K/V per layer, Quest-select, sparse-attend), measuring step
// latency, traffic and — on sampled steps — recall against dense attention.
// Callable in-process (tests compare digests of runs with different settings).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "questkv/config.h"
#include "questkv/runtime.h"
#include "questkv/status.h"
#include "tools/workload.h"

namespace questkv::cli {

struct RunOptions {
  Config config;                 // geometry, policy, capacities
  WorkloadKind workload = WorkloadKind::kStructured;
  uint64_t seed = 1;
  int64_t context_tokens = 32768;
  int64_t decode_steps = 64;
  int batch = 1;                 // sequences; sequence b holds context_tokens - 7*b tokens
  int recall_every = 8;          // diagnose every N-th step (0: never)
  int top_r = 16;                // R of the page-recall and exact top-R diagnostics
  // The sparse layers a diagnosed step diagnoses (empty: every sparse layer);
  // at 1M tokens one layer's diagnostics cost seconds of every core.
  std::vector<int> recall_layers;
  bool progress = true;
  // CUDA backend: generate the prefill's K/V on the GPU (the same values as
  // the host generator) and append them from device memory.
  bool gpu_workload = false;
  // CUDA backend: decode through the device-pointer calls, as an engine
  // does — each step's queries and K/V rows uploaded before the step, then
  // every layer's append and decode enqueued back to back and the step timed
  // to its end on the GPU. Off: the host-f32 calls, each waiting for its
  // output. A diagnosed step stays on the device calls; its diagnosed layers'
  // calls wait for the calls before them (to count their own skips) and for
  // their selections, so the step is summarised as instrumented.
  bool device_decode = false;
  // Serve Prometheus metrics on 127.0.0.1:metrics_port while running (-1: off;
  // 0: any free port, printed on stderr), and keep serving metrics_linger_ms
  // after the run so a scraper can read the final values.
  int metrics_port = -1;
  int metrics_linger_ms = 0;
  // Speculative decoding, simulated (CPU backend): each step appends a block
  // of `draft` tokens per sequence and layer, verifies it with one
  // DecodeBlock call, accepts each draft with probability accept_rate until
  // the first rejection (seeded by `seed`) and rolls back the rest. 0: one
  // token a step, the ordinary decode.
  int draft = 0;
  double accept_rate = 0.7;
};

struct Percentiles {
  double p50 = 0, p99 = 0, mean = 0;
};

struct RunReport {
  RunOptions options;
  std::string topology;
  double prefill_seconds = 0;
  // Append + select + attend, all layers, whole batch. CUDA backend: over
  // the steps replayed as a production engine runs them; the steps launched
  // directly with events between the phases (for step_breakdown_us) pay
  // launch costs a graph does not (~1 ms at 32 layers) and are summarised
  // apart in step_latency_instrumented_us, with the diagnosed steps (whose
  // diagnosed layers wait for their selections). CPU backend: every step.
  Percentiles step_latency_us;
  Percentiles step_latency_instrumented_us;
  struct Breakdown {
    double append = 0, select = 0, resolve = 0, attend = 0;
  } step_breakdown_us;             // means per step: append over every step; select/resolve/attend over
                                   // the timed steps (CUDA: steps 1, 5, 9, ..., launched directly to be
                                   // timed, the others replay graphs; the first step is a warm-up)
  // Device-pointer decode (RunOptions::device_decode): host time to enqueue a
  // step's calls, against step_latency_us, which runs to the end of its GPU work.
  Percentiles enqueue_us;
  // On sampled sparse (step, layer)s of an all-in-memory run through the host
  // calls: the runtime's dense attention over the same K/V, timed beside the
  // Quest call (device-pointer runs time no such pair).
  int compared_layers = 0;
  double compared_quest_us = 0, compared_dense_us = 0;  // sums
  int64_t comparison_hits = 0, comparison_misses = 0;   // cache lookups of those dense calls (not in `tiers`)
  int64_t head_pages_selected = 0;
  int64_t head_pages_total = 0;
  int64_t kv_bytes_read = 0;       // K/V bytes sparse attention read
  int64_t summary_bytes_read = 0;  // summary bytes scoring read
  int64_t rerank_key_bytes = 0;    // key bytes the re-rank read
  // Adaptive budgets (--unread-bound-mass): rankings the rule sized and the
  // pages they chose beyond sink and local (mean = pages / rankings).
  struct Adaptive {
    int64_t rankings = 0, pages = 0, pages_p95 = 0, pages_max = 0, cap_hits = 0;
  } adaptive;
  int64_t dense_kv_bytes = 0;      // K/V bytes dense attention would read
  // Streaming every page of every layer (K/V, all heads, at the geometry's
  // dtype) over the host link each step.
  int64_t dense_offload_bytes = 0;
  // CUDA backend: the time to stream one layer's pages of the batch from
  // pinned host memory, measured on `offload_layers` sparse layers at step 0
  // (mean); times the layer count, a dense-offload step's transfer alone.
  int offload_layers = 0;
  double offload_us_per_layer = 0;
  struct Links {
    int64_t host_to_hbm = 0, hbm_to_host = 0, host_to_disk = 0, disk_to_host = 0;
  };
  Links bytes_moved;               // decode steps, diagnostics' own reads excluded
  Links bytes_moved_prefill;
  Links bytes_moved_diagnostics;   // what the recall diagnostics pulled in
  TierStats tiers;                 // at the end of the run
  uint32_t pages_peak = 0;
  // Means over sampled steps, sparse layers and sequences.
  int diagnosed = 0;               // (step, layer, sequence) triples diagnosed
  double page_recall = 0, attention_mass_recall = 0, output_rel_error = 0;
  // The output error of exact attention over the selected pages (what the
  // selection costs), and the output's error against it (what attending
  // without `deadline`'s skipped pages, and rounding, cost).
  double selection_rel_error = 0, attended_rel_error = 0;
  double slack_mean = 0;
  double exact_pages_read_fraction = 0;  // branch-and-bound pages read / pages
  // Every diagnosed (step, layer) call, in step and layer order: what it
  // selected and skipped (`deadline`: selected head-pages attended without,
  // counted from the tier counters around that call alone) and its errors,
  // means over the batch. Where skips happen, what they cost.
  struct DiagnosedCall {
    int64_t step = 0;
    int layer = 0;
    int64_t head_pages_selected = 0, head_pages_skipped = 0;
    double selection_rel_error = 0, attended_rel_error = 0;
  };
  std::vector<DiagnosedCall> diagnosed_calls;
  uint64_t output_digest = 0;      // FNV-1a over every decode output, in order
  // Every decode step, in order: where a run's time and traffic go step by
  // step (a structured workload's topic and needle steps miss far more than
  // its recent ones).
  struct StepRecord {
    double us = 0;                        // as step_latency_us
    bool instrumented = false;            // in step_latency_instrumented_us, not step_latency_us
    QueryKind query = QueryKind::kRandom;  // what sequence 0's queries aim at
    int64_t hits = 0, misses = 0;         // HBM cache lookups (dense comparisons excluded)
    int64_t cold_misses = 0;              // selected head-pages whose home was disk
    int64_t cold_stalls = 0, pages_skipped = 0;  // ... waited for (strict) / attended without (deadline)
    int64_t host_link_bytes = 0;          // host->hbm + hbm->host (diagnostics' reads excluded)
    int64_t graphs_captured = 0;          // CUDA: layer-step graphs captured in this step (each costs ms)
  };
  std::vector<StepRecord> steps;
  // RunOptions::draft > 0: what the verify steps drafted and kept, their
  // wall time (append + verify + rollback, all layers), split by call
  // (AppendDraft, DecodeBlock, Rollback + Accept), and selections.
  struct Speculative {
    int64_t drafted = 0, accepted = 0;
    int64_t tokens = 0;  // kept: a block's first and its accepted drafts
    double seconds = 0;
    double tokens_per_s = 0;  // over the blocks the latency counts, past the first
    double append_seconds = 0, verify_seconds = 0, settle_seconds = 0;
    int64_t head_pages_selected = 0;
  } speculative;
};

// Tokens of the shortest sequence at the first diagnosed step (its context
// and that step's token): the largest top_r every diagnosis can take.
int64_t DiagnosedTokensMin(const RunOptions& options);
// Tokens the decode may append past the context: a token a step, or a
// block (a token and its drafts) a step when speculating.
inline int64_t DecodeTokens(const RunOptions& o) { return o.decode_steps * (o.draft + 1); }

// InvalidArgument, said with the flags of `questkv run` that set them, when
// the options cannot run (RunJob checks them first).
Status CheckRunOptions(const RunOptions& options);

// `finished`, when given, gets the report as soon as it is complete, before
// the runtime is torn down (at 1M tokens, unpinning the host tier and closing
// the disk tier take long enough that a time limit can fall in between).
Result<RunReport> RunJob(const RunOptions& options,
                         const std::function<void(const RunReport&)>& finished = nullptr);

// Human-readable report and the one-object JSON report.
std::string FormatReport(const RunReport& r);
std::string ReportJson(const RunReport& r);

}  // namespace questkv::cli
