// Counters a Runtime reports: per decode call (AttendStats) and for its
// tiers since creation (TierStats). Plain values.
#pragma once

#include <cstdint>

namespace questkv {

// Per-call counters of a decode attention call, summed over the batch and KV heads.
struct AttendStats {
  int64_t head_pages_selected = 0;  // head-pages attended
  int64_t head_pages_total = 0;     // head-pages that dense attention would read
  int64_t kv_bytes_read = 0;        // K/V bytes the sparse attention read
  int64_t summary_bytes_read = 0;   // summary bytes the scoring read
  int64_t rerank_key_bytes = 0;     // key bytes the re-rank read (SelectionPolicy::rerank)
  // Adaptive budgets (SelectionPolicy::unread_bound_mass): rankings whose
  // page count the rule set, the pages they chose beyond sink and local
  // (in all, the largest, how many stopped at the cap), and how many chose
  // p pages: adaptive_hist[min(p, kAdaptiveHistPages)]. On the CUDA backend
  // a call that returns before the device is done (device pointers) counts
  // none: the next call that waits counts every call's since the last.
  static constexpr int kAdaptiveHistPages = 256;
  int64_t adaptive_rankings = 0, adaptive_pages = 0, adaptive_pages_max = 0, adaptive_cap_hits = 0;
  int64_t adaptive_hist[kAdaptiveHistPages + 1] = {};
  // The smallest page count p with at least `percent`% of the adaptive
  // rankings choosing <= p pages (counts past kAdaptiveHistPages read as it); 0 with none.
  int64_t AdaptivePagesPercentile(int percent) const {
    int64_t seen = 0;
    for (int i = 0; i <= kAdaptiveHistPages; ++i)
      if ((seen += adaptive_hist[i]) * 100 >= adaptive_rankings * percent && seen > 0) return i;
    return 0;
  }
  // Wall time of the phases, microseconds: selection (scores + top-K),
  // resolve (finding or fetching every selected head-page), attention.
  double select_us = 0, resolve_us = 0, attend_us = 0;
  // CUDA backend: decode-step graphs captured (a step whose shape, list
  // sizes or buffers changed is captured again before it is replayed).
  int64_t graphs_captured = 0;
  // Input: time the phases of this call. On the CUDA backend a timed step is
  // launched directly instead of replayed from a graph, so callers may time
  // a sample of the steps only; the counters above are kept either way.
  bool time_phases = true;
};

// Tier state and traffic since creation.
struct TierStats {
  int64_t bytes_host_to_hbm = 0, bytes_hbm_to_host = 0, bytes_host_to_disk = 0, bytes_disk_to_host = 0;
  int64_t hbm_hits = 0, hbm_misses = 0, hbm_evictions = 0, hbm_bypasses = 0;
  int64_t cold_misses = 0, cold_stalls = 0, pages_skipped = 0;
  // Decode calls (a sequence at a layer) that waited for their cold misses
  // because they passed Config::deadline_skip_limit.
  int64_t deadline_waits = 0;
  int64_t demotions = 0, promotions = 0, clean_drops = 0, prefetches = 0, deferred_seals = 0;
  int64_t demotion_orders = 0;  // coldest-first orders built (each scans every host page)
  int64_t io_errors = 0, corruptions = 0;
  uint64_t hbm_capacity_bytes = 0, hbm_peak_bytes = 0, hbm_used_bytes = 0;
  uint64_t host_capacity_bytes = 0, host_peak_bytes = 0, host_used_bytes = 0;
  uint64_t disk_capacity_bytes = 0, disk_peak_bytes = 0, disk_used_bytes = 0;
  uint64_t summary_bytes = 0;  // resident summaries of live pages
};

}  // namespace questkv
