// runtime/engine_select.h on the CUDA kernels: the select of the decode step
// (kernels/cuda/select*.cu) over the engine's summaries, its pages named by
// the engine's page table, and the engine-cache summary rebuild.
#include "runtime/engine_select.h"

#include <algorithm>

#include "runtime/cuda/backend.h"

namespace questkv {
namespace {

using cuda_backend::CudaStatus;
namespace kc = kernels::cuda;

Status CheckDtype(DType d) {
  if (d != DType::kF32 && d != DType::kF16 && d != DType::kBF16)
    return Status::InvalidArgument(std::string("dtype ") + DTypeName(d) + " (supported: f32, f16, bf16)");
  return Status::Ok();
}

struct Planned {
  kc::SelectShape shape;
  kc::SelectPlan plan;
};

Result<Planned> Plan(const DeviceSelectArgs& a) {
  QKV_RETURN_IF_ERROR(CheckDtype(a.dtype));
  Geometry g = a.geometry;
  g.layers = 1;
  QKV_RETURN_IF_ERROR(g.Validate());
  SelectionPolicy p = a.policy;
  p.dense_layers.clear();
  QKV_RETURN_IF_ERROR(p.Validate(g));
  if (a.page_counts.empty()) return Status::InvalidArgument("no sequence to select for");
  for (int32_t n : a.page_counts)
    if (n < 1) return Status::InvalidArgument("a sequence holds no page");
  Planned out;
  kc::SelectShape& s = out.shape;
  s.batch = int(a.page_counts.size());
  s.kv_heads = g.kv_heads;
  s.group = g.group();
  s.head_dim = g.head_dim;
  s.page_size = g.page_size;
  s.page_budget = p.page_budget(0, g.page_size);
  s.sink_pages = p.sink_pages;
  s.local_pages = p.local_pages;
  s.gqa = p.gqa;
  s.chain = false;  // the first kernels on the caller's stream: nothing to chain to
  int device = 0, sms = 0;
  if (const cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) return CudaStatus("cudaGetDevice", e);
  if (const cudaError_t e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device); e != cudaSuccess)
    return CudaStatus("cudaDeviceGetAttribute", e);
  std::string err;
  if (!kc::PlanSelect(s, a.page_counts.data(), sms, &out.plan, &err)) return Status::InvalidArgument(err);
  return out;
}

// Stream-ordered device buffers, freed on the stream when the call returns.
class StreamBuffers {
 public:
  explicit StreamBuffers(cudaStream_t s) : stream_(s) {}
  ~StreamBuffers() {
    for (void* p : held_) cudaFreeAsync(p, stream_);
  }
  template <typename T>
  Result<T*> Get(std::size_t n) {
    void* p = nullptr;
    if (const cudaError_t e = cudaMallocAsync(&p, std::max<std::size_t>(n * sizeof(T), 1), stream_); e != cudaSuccess)
      return CudaStatus("cudaMallocAsync", e);
    held_.push_back(p);
    return static_cast<T*>(p);
  }

 private:
  cudaStream_t stream_;
  std::vector<void*> held_;
};

}  // namespace

Status DeviceUpdateSummaries(const DeviceSummaryArgs& a, void* stream) {
  QKV_RETURN_IF_ERROR(CheckDtype(a.dtype));
  kc::SummariesFromCacheParams p;
  p.dtype = a.dtype;
  p.k_cache = a.k_cache;
  p.summaries = a.summaries;
  p.pages = a.pages;
  p.lens = a.lens;
  p.n = a.n;
  p.kv_heads = a.kv_heads;
  p.head_dim = a.head_dim;
  p.page_size = a.page_size;
  p.nhd = a.nhd;
  QKV_CUDA(kc::LaunchSummariesFromCache(p, static_cast<cudaStream_t>(stream)));
  return Status::Ok();
}

Status DeviceSelectPages(const DeviceSelectArgs& a, const std::function<int32_t*(int width)>& out, void* stream) {
  QKV_ASSIGN_OR_RETURN(Planned pl, Plan(a));
  const std::vector<int32_t>& ip = pl.plan.out_indptr;
  int width = 1;
  for (std::size_t r = 0; r + 1 < ip.size(); ++r) width = std::max(width, ip[r + 1] - ip[r]);
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  const int rows = pl.shape.batch * pl.shape.kv_heads;
  StreamBuffers buf(s);
  QKV_ASSIGN_OR_RETURN(int32_t* sel_indptr, buf.Get<int32_t>(ip.size()));
  QKV_ASSIGN_OR_RETURN(int32_t* sel_pages, buf.Get<int32_t>(std::size_t(ip.back())));
  QKV_ASSIGN_OR_RETURN(int32_t* sel_count, buf.Get<int32_t>(std::size_t(rows)));
  QKV_ASSIGN_OR_RETURN(unsigned char* workspace, buf.Get<unsigned char>(pl.plan.workspace_bytes));
  // From pageable memory: staged before the call returns, so `ip` may go.
  QKV_CUDA(cudaMemcpyAsync(sel_indptr, ip.data(), ip.size() * sizeof(int32_t), cudaMemcpyHostToDevice, s));
  kc::SelectParams sp;
  sp.shape = pl.shape;
  sp.q_dtype = a.dtype;
  sp.summary_dtype = a.dtype;
  sp.q = a.q;
  sp.summaries = a.summaries;
  sp.page_indptr = a.indptr;
  sp.page_ids = reinterpret_cast<const uint32_t*>(a.indices);
  sp.out_indptr = sel_indptr;
  sp.out_pages = sel_pages;
  sp.out_count = sel_count;
  sp.workspace = workspace;
  QKV_CUDA(kc::LaunchSelect(pl.plan, sp, s));
  kc::PaddedPageIdsParams pp;
  pp.sel_indptr = sel_indptr;
  pp.sel_pages = sel_pages;
  pp.sel_count = sel_count;
  pp.indptr = a.indptr;
  pp.indices = a.indices;
  pp.rows = rows;
  pp.kv_heads = pl.shape.kv_heads;
  pp.width = width;
  pp.out = out(width);
  QKV_CUDA(kc::LaunchPaddedPageIds(pp, s));
  return Status::Ok();
}

}  // namespace questkv
