// Plan/run of the sparse decode attention (one launch; the split merge runs
// in each row's last block, see attention.cuh).
#include <algorithm>
#include <array>
#include <mutex>
#include <string>
#include <vector>

#include "kernels/cuda/attention.cuh"
#include "kernels/cuda/dispatch.cuh"

namespace questkv::kernels::cuda {
namespace {

bool Supported(int v, std::initializer_list<int> ok) { return std::find(ok.begin(), ok.end(), v) != ok.end(); }

}  // namespace

// At most four: the splits were tuned for four, and kernels of fewer
// registers would otherwise get more, shorter splits than measured. Cached:
// the runtime plans every layer's call.
int AttendBlocksPerSm(const AttendShape& s) {
  constexpr int kMaxBlocksPerSm = 4;
  using Key = std::array<int, 5>;  // device, dtype, head_dim, page_size, group
  static std::mutex mu;
  static std::vector<std::pair<Key, int>> cache;
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) {
    (void)cudaGetLastError();
    return kMaxBlocksPerSm;
  }
  const Key key{device, int(s.dtype), s.head_dim, s.page_size, s.group};
  std::lock_guard<std::mutex> lock(mu);
  for (const auto& [k, blocks] : cache)
    if (k == key) return blocks;
  int blocks = 0;
  const cudaError_t e = [&]() -> cudaError_t {
    QKV_DISPATCH_DTYPE(s.dtype, T, { return AttendBlocksPerSmTyped<T>(s, &blocks); })
    return cudaSuccess;
  }();
  if (e != cudaSuccess || blocks < 1) {
    (void)cudaGetLastError();
    return kMaxBlocksPerSm;  // not cached: a later call may find the device
  }
  cache.emplace_back(key, std::min(blocks, kMaxBlocksPerSm));
  return cache.back().second;
}

bool PlanAttend(const AttendShape& s, int max_pages, int num_sms, AttendPlan* plan, std::string* error) {
  auto fail = [&](std::string m) {
    if (error) *error = "PlanAttend: " + std::move(m);
    return false;
  };
  if (s.rows < 1) return fail("rows = " + std::to_string(s.rows) + ", must be >= 1");
  if (s.kv_heads < 1 || s.rows % s.kv_heads != 0)
    return fail("rows = " + std::to_string(s.rows) + " is not a multiple of kv_heads = " + std::to_string(s.kv_heads));
  if (!Supported(s.group, {1, 2, 4, 8})) return fail("GQA group = " + std::to_string(s.group) + " (supported: 1, 2, 4, 8)");
  if (!Supported(s.head_dim, {64, 128, 256}))
    return fail("head_dim = " + std::to_string(s.head_dim) + " (supported: 64, 128, 256)");
  if (!Supported(s.page_size, {8, 16, 32, 64}))
    return fail("page_size = " + std::to_string(s.page_size) + " (supported: 8, 16, 32, 64)");
  if (max_pages < 0) return fail("max_pages = " + std::to_string(max_pages));
  plan->shape = s;
  plan->max_pages = max_pages;
  // As many blocks a multiprocessor as the kernel fits, four at most
  // (AttendBlocksPerSm); a row is split only when the rows
  // alone cannot fill the chip, into as many splits as still fit in that one
  // wave (rounding up spilled a second, short wave: Llama-3-8B at batch 16,
  // 128 rows x 5 splits, took 68 us against 52 with 4 splits on the H200), but
  // into two at least (Llama-2-7B at batch 16, 512 rows: one split left the
  // attention alone as fast, yet the chained select + attend step took 312 us
  // against 239 with two; not understood yet), and a split keeps at least
  // kMinPagesPerSplit pages so the merge (in the row's last block) stays short
  // (Llama-3-8B at batch 1, budget 2048, 8 rows: 32 splits of 4-5 pages took
  // 14.0 us, 16 splits 15.1, 64 splits 15.3; with 8 pages a split, the former
  // floor, budgets up to 1024 got 4-8 splits and ran 10-25% slower).
  constexpr int kMinPagesPerSplit = 4;
  const long long target = (long long)AttendBlocksPerSm(s) * std::max(1, num_sms);
  int splits = s.rows >= target ? 1 : int(std::max<long long>(2, target / s.rows));
  splits = std::max(1, std::min({splits, std::max(1, max_pages), kMaxSplits}));
  int pps = std::max(1, (max_pages + splits - 1) / splits);
  if (splits > 1) pps = std::max(pps, std::min(kMinPagesPerSplit, max_pages));
  splits = std::max(1, (max_pages + pps - 1) / pps);
  if (std::size_t(splits) * s.group * 4 > 40 * 1024) return fail("too many splits: " + std::to_string(splits));
  plan->splits = splits;
  plan->pages_per_split = pps;
  plan->counter_bytes = splits > 1 ? CounterBytes(s.rows) : 0;
  plan->workspace_bytes =
      splits > 1 ? plan->counter_bytes + std::size_t(s.rows) * splits * s.group * (s.head_dim + 2) * sizeof(float)
                 : 0;
  return true;
}

cudaError_t RunAttend(const AttendPlan& plan, const AttendParams& p, cudaStream_t stream) {
  const AttendShape& s = plan.shape;
  cudaError_t e = cudaSuccess;
  QKV_DISPATCH_DTYPE(s.dtype, T, { e = LaunchAttendTyped<T>(plan, p, stream); })
  return e;
}

}  // namespace questkv::kernels::cuda
