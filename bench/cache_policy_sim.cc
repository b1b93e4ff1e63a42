// Replays one layer's Quest selections through HBM cache policies: how many
// head-page misses each would take at a given capacity. The selections come
// from the real selector (CPU backend) on a `questkv run` workload, so the
// question "would a better eviction rule save PCIe bytes?" is answered on
// the same inputs the runtime sees, with Belady's optimum as the ceiling.
//
//   questkv_cache_policy_sim [--context 131072] [--steps 64] [--layer 5]
//       [--head-dim 128] [--kv-heads 8] [--q-heads 32] [--budget 2048]
//       [--capacities 3072,4096,6144] [--workload structured|gaussian]
//
// One cache of head-pages (page, KV head) per layer, as questkv keeps one
// list per (sequence, layer); a step's selection must all be resident (never
// a victim that step). Policies:
//   lru   least recently used first (the CUDA backend's rule)
//   slru  segmented LRU: the CPU backend's HBM cache itself (tiers/hbm_cache.h;
//         head-pages hit since filled are protected, up to 3/4 of the slots;
//         unprotected ones go first, by age), a step's hits touched before
//         its misses are placed
//   opt   Belady: the head-page used furthest in the future goes first
// Prints hit rates over all steps and over the `recent` query steps after
// the first cycle (16 steps), and misses per step.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <list>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "questkv/runtime.h"
#include "tools/workload.h"
#include "tiers/hbm_cache.h"

namespace questkv {
namespace {

using Key = int64_t;  // (KV head << 32) | page index
Key KeyOf(int h, int p) { return int64_t(h) << 32 | uint32_t(p); }

struct Trace {
  std::vector<std::vector<Key>> steps;  // distinct head-pages selected at each step
  std::vector<QueryKind> kinds;
  uint32_t pages = 0;  // page indices are below this
  int kv_heads = 0;
};

struct Options {
  int64_t context = 131072;
  int steps = 64, layer = 5, head_dim = 128, kv_heads = 8, q_heads = 32;
  int64_t budget = 2048;
  std::vector<int> capacities = {3072, 4096, 6144};
  WorkloadKind workload = WorkloadKind::kStructured;
};

Result<Trace> Record(const Options& o) {
  Config c;
  c.geometry = {.layers = o.layer + 1, .q_heads = o.q_heads, .kv_heads = o.kv_heads, .head_dim = o.head_dim,
                .page_size = 16};
  c.policy.token_budget = o.budget;
  c.policy.dense_layers = {};
  c.max_pages = uint32_t((o.context + o.steps) / 16 + 64);
  QKV_ASSIGN_OR_RETURN(std::unique_ptr<Runtime> rt, Runtime::Create(c));
  QKV_ASSIGN_OR_RETURN(Workload w, Workload::Create(c.geometry, {o.workload, 1, o.context, o.steps}));
  QKV_ASSIGN_OR_RETURN(SeqId s, rt->CreateSequence());
  const std::size_t row = std::size_t(o.kv_heads) * o.head_dim;
  std::vector<float> k(1024 * row), v(1024 * row);
  for (int64_t t = 0; t < o.context; t += 1024) {  // only the traced layer
    const int64_t n = std::min<int64_t>(1024, o.context - t);
    w.Tokens(o.layer, t, n, k.data(), v.data());
    QKV_RETURN_IF_ERROR(rt->Append(s, o.layer, k.data(), v.data(), n));
  }
  Trace trace;
  trace.pages = uint32_t((o.context + o.steps) / 16 + 1);
  trace.kv_heads = o.kv_heads;
  std::vector<float> q(std::size_t(o.q_heads) * o.head_dim), out(q.size());
  for (int step = 0; step < o.steps; ++step) {
    w.Tokens(o.layer, o.context + step, 1, k.data(), v.data());
    QKV_RETURN_IF_ERROR(rt->Append(s, o.layer, k.data(), v.data(), 1));
    w.Query(o.layer, step, q.data());
    std::vector<PageSelection> sel;
    QKV_RETURN_IF_ERROR(rt->DecodeAttention({&s, 1}, o.layer, q.data(), out.data(), &sel));
    std::vector<Key> keys;
    for (int h = 0; h < o.kv_heads; ++h)
      for (int i = 0; i < sel[0].count(h); ++i) keys.push_back(KeyOf(h, sel[0].row(h)[i]));
    std::sort(keys.begin(), keys.end());
    keys.erase(std::unique(keys.begin(), keys.end()), keys.end());
    trace.steps.push_back(std::move(keys));
    trace.kinds.push_back(w.Target(step).kind);
  }
  return trace;
}

struct Tally {
  int64_t hits = 0, misses = 0, recent_hits = 0, recent_misses = 0;
  void Add(bool hit, bool recent) {
    (hit ? hits : misses) += 1;
    if (recent) (hit ? recent_hits : recent_misses) += 1;
  }
};

// LRU (the CUDA backend's rule): one recency list, front = oldest.
Tally RunLru(const Trace& t, int capacity) {
  std::list<Key> order;
  std::unordered_map<Key, std::list<Key>::iterator> where;
  Tally tally;
  for (std::size_t step = 0; step < t.steps.size(); ++step) {
    const bool recent = t.kinds[step] == QueryKind::kRecent && step >= 16;
    for (Key key : t.steps[step]) {
      auto found = where.find(key);
      tally.Add(found != where.end(), recent);
      if (found != where.end()) order.erase(found->second);
      order.push_back(key);
      where[key] = std::prev(order.end());
    }
    // The oldest go; this step's selection is the newest, so it stays.
    while (where.size() > std::max(std::size_t(capacity), t.steps[step].size())) {
      where.erase(order.front());
      order.pop_front();
    }
  }
  return tally;
}

// Segmented LRU: one HbmCache partition of `capacity` slots. A step's hits
// are touched before its misses are placed (as the CUDA resolve classifies
// before it assigns), so nothing selected this step is a victim.
Result<Tally> RunSegmented(const Trace& t, int capacity) {
  QKV_ASSIGN_OR_RETURN(std::unique_ptr<HbmCache> cache, HbmCache::Create(uint32_t(capacity), 1, t.pages, t.kv_heads));
  const uint32_t part = cache->AddPartition();
  Tally tally;
  std::vector<Key> missed;
  for (std::size_t step = 0; step < t.steps.size(); ++step) {
    const bool recent = t.kinds[step] == QueryKind::kRecent && step >= 16;
    missed.clear();
    for (Key key : t.steps[step]) {
      const int32_t slot = cache->Lookup(uint32_t(key), int(key >> 32));
      tally.Add(slot != HbmCache::kNone, recent);
      if (slot != HbmCache::kNone) cache->Touch(slot, int64_t(step));
      else missed.push_back(key);
    }
    for (Key key : missed)
      QKV_RETURN_IF_ERROR(cache->Insert(uint32_t(key), int(key >> 32), part, int64_t(step), false).status());
  }
  return tally;
}

// Belady: evict the head-pages whose next use is furthest away.
Tally RunOpt(const Trace& t, int capacity) {
  std::unordered_map<Key, std::vector<int>> uses;  // steps using each key, ascending
  for (int s = 0; s < int(t.steps.size()); ++s)
    for (Key key : t.steps[s]) uses[key].push_back(s);
  auto next_use = [&](Key key, int after) {
    const std::vector<int>& u = uses[key];
    const auto it = std::upper_bound(u.begin(), u.end(), after);
    return it == u.end() ? int(t.steps.size()) : *it;
  };
  std::unordered_set<Key> cache;
  Tally tally;
  for (int step = 0; step < int(t.steps.size()); ++step) {
    const bool recent = t.kinds[step] == QueryKind::kRecent && step >= 16;
    for (Key key : t.steps[step]) tally.Add(!cache.insert(key).second, recent);
    if (cache.size() <= std::size_t(capacity)) continue;
    const std::unordered_set<Key> now(t.steps[step].begin(), t.steps[step].end());
    std::vector<std::pair<int, Key>> order;
    for (Key key : cache)
      if (!now.count(key)) order.push_back({-next_use(key, step), key});
    std::sort(order.begin(), order.end());
    for (std::size_t i = 0; i < order.size() && cache.size() > std::size_t(capacity); ++i) cache.erase(order[i].second);
  }
  return tally;
}

std::vector<int> ParseList(const char* s) {
  std::vector<int> out;
  for (const char* p = s; *p;) {
    out.push_back(std::atoi(p));
    while (*p && *p != ',') ++p;
    if (*p == ',') ++p;
  }
  return out;
}

int Main(int argc, char** argv) {
  Options o;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    const char* v = argv[i + 1];
    if (flag == "--context") o.context = std::atoll(v);
    else if (flag == "--steps") o.steps = std::atoi(v);
    else if (flag == "--layer") o.layer = std::atoi(v);
    else if (flag == "--head-dim") o.head_dim = std::atoi(v);
    else if (flag == "--kv-heads") o.kv_heads = std::atoi(v);
    else if (flag == "--q-heads") o.q_heads = std::atoi(v);
    else if (flag == "--budget") o.budget = std::atoll(v);
    else if (flag == "--capacities") o.capacities = ParseList(v);
    else if (flag == "--workload")
      o.workload = std::strcmp(v, "gaussian") ? WorkloadKind::kStructured : WorkloadKind::kGaussian;
    else {
      std::fprintf(stderr, "unknown flag %s\n", flag.c_str());
      return 2;
    }
  }
  Result<Trace> trace = Record(o);
  if (!trace.ok()) {
    std::fprintf(stderr, "%s\n", trace.status().ToString().c_str());
    return 1;
  }
  std::size_t selected = 0;
  for (const auto& s : trace->steps) selected += s.size();
  std::printf("layer %d, %lld tokens, %d steps, %.0f head-pages selected a step\n", o.layer,
              static_cast<long long>(o.context), o.steps, double(selected) / o.steps);
  std::printf("%9s %-5s %9s %13s %15s\n", "capacity", "rule", "hit rate", "recent steps", "misses a step");
  int status = 0;
  for (int cap : o.capacities) {
    Result<Tally> segmented = RunSegmented(*trace, cap);
    if (!segmented.ok()) {
      std::fprintf(stderr, "capacity %d: %s\n", cap, segmented.status().ToString().c_str());
      return 1;
    }
    const Tally tallies[] = {RunLru(*trace, cap), *segmented, RunOpt(*trace, cap)};
    const char* rules[] = {"lru", "slru", "opt"};
    for (int r = 0; r < 3; ++r) {
      const Tally& t = tallies[r];
      std::printf("%9d %-5s %9.4f %13.4f %15.1f\n", cap, rules[r], double(t.hits) / double(t.hits + t.misses),
                  double(t.recent_hits) / double(std::max<int64_t>(1, t.recent_hits + t.recent_misses)),
                  double(t.misses) / o.steps);
    }
    // Belady's rule is optimal for demand caching: anything missing less is a bug here.
    if (tallies[2].misses > std::min(tallies[0].misses, tallies[1].misses)) {
      std::fprintf(stderr, "capacity %d: opt misses more than lru or slru\n", cap);
      status = 1;
    }
  }
  return status;
}

}  // namespace
}  // namespace questkv

int main(int argc, char** argv) { return questkv::Main(argc, argv); }
