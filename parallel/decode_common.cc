#include "parallel/decode_common.h"

#include <cmath>
#include <cstring>
#include <string>

namespace questkv {

namespace {

constexpr const char* kHeaderFields[] = {"message", "num_pages", "layer",     "tail_len", "q_heads",
                                         "kv_heads", "head_dim", "page_size", "top_k",    "gqa mode"};
constexpr int kHeaderInts = sizeof(StepHeader) / sizeof(int32_t);
static_assert(sizeof(kHeaderFields) / sizeof(kHeaderFields[0]) == kHeaderInts);

// "" when the headers agree, else the first field that differs.
std::string HeaderMismatch(const StepHeader& mine, const StepHeader& theirs, int rank, int their_rank) {
  int32_t a[kHeaderInts], b[kHeaderInts];
  std::memcpy(a, &mine, sizeof(mine));
  std::memcpy(b, &theirs, sizeof(theirs));
  for (int i = 0; i < kHeaderInts; ++i)
    if (a[i] != b[i])
      return "ranks disagree on the step's " + std::string(kHeaderFields[i]) + ": rank " + std::to_string(rank) +
             " has " + std::to_string(a[i]) + ", rank " + std::to_string(their_rank) + " " + std::to_string(b[i]);
  return "";
}

}  // namespace

Status StepExchange::Gather(Communicator& comm, const StepHeader& header, const void* payload, std::size_t bytes) {
  const std::size_t message = sizeof(StepHeader) + bytes;
  bytes_ = bytes;
  send_.resize(message);
  recv_.resize(message * std::size_t(comm.size()));
  std::memcpy(send_.data(), &header, sizeof(header));
  if (bytes > 0) std::memcpy(send_.data() + sizeof(header), payload, bytes);
  QKV_RETURN_IF_ERROR(comm.AllGather(send_.data(), message, recv_.data()));
  for (int r = 0; r < comm.size(); ++r) {
    StepHeader theirs;
    std::memcpy(&theirs, recv_.data() + r * message, sizeof(theirs));
    const std::string why = HeaderMismatch(header, theirs, comm.rank(), r);
    if (!why.empty()) return AbortIfError(comm, Status::InvalidArgument(why));
  }
  return Status::Ok();
}

void StepExchange::CopyPayload(int rank, void* out) const {
  if (bytes_ == 0) return;
  const std::size_t message = sizeof(StepHeader) + bytes_;
  std::memcpy(out, recv_.data() + rank * message + sizeof(StepHeader), bytes_);
}

void AttendHeldPages(const HeldPages& held, int kv_head, std::span<const int32_t> idx, const float* q, int group,
                     float scale, std::vector<kernels::HeadPageRef>* refs, float* o, float* m, float* d) {
  const std::size_t head_page = std::size_t(held.page_size) * held.head_dim;
  refs->clear();
  for (int32_t i : idx) {
    const float* page = held.data[i];
    refs->push_back({page + kv_head * head_page, page + (held.kv_heads + kv_head) * head_page,
                     i == held.tail_index ? held.tail_len : held.page_size});
  }
  kernels::AttendPagesCpu(q, group, held.head_dim, refs->data(), int(refs->size()), scale, o, m, d);
}

Status ValidateStep(const Geometry& g, const float* q, float scale, int num_pages, int tail_len, int layer) {
  if (q == nullptr) return Status::InvalidArgument("parallel decode: q is null");
  if (!(scale > 0.f) || !std::isfinite(scale))
    return Status::InvalidArgument("parallel decode: scale = " + std::to_string(scale) + ", must be positive");
  if (num_pages < 1)
    return Status::InvalidArgument("parallel decode: num_pages = " + std::to_string(num_pages) + ", must be >= 1");
  if (tail_len < 1 || tail_len > g.page_size)
    return Status::InvalidArgument("parallel decode: tail_len = " + std::to_string(tail_len) + ", must be in 1.." +
                                   std::to_string(g.page_size));
  if (layer < 0 || layer >= g.layers)
    return Status::InvalidArgument("parallel decode: layer = " + std::to_string(layer) + " is not a layer of " +
                                   g.ToString());
  return Status::Ok();
}

}  // namespace questkv
