// MakeFaultInjectingBackend: wraps any IoBackend and damages what it reports.
//
// Every request passes to the inner backend (so queue accounting and real
// transfers stay the inner's); its fate is drawn at Submit from a seeded
// generator, a fixed number of draws per request, so a seed reproduces the
// same faults for the same request sequence whatever the completion timing.
// The damage is done when the completion comes back:
//   read EIO / short read  the result says so, and the bytes the read did not
//                          deliver are overwritten with a poison pattern, so
//                          a caller that uses them anyway sees wrong bytes;
//   corrupt read           one bit of a good read is flipped;
//   write EIO / ENOSPC /   the result says so (the bytes may still land, as a
//   short write            failed write may have written any part);
//   misdirected write      the request goes to the neighbouring page-sized
//                          offset of the same file and reports success;
//   delay                  the completion is held back for 1-3 Reap calls,
//                          which reorders it behind later ones.
#include <algorithm>
#include <cerrno>
#include <cstring>
#include <unordered_map>

#include "tiers/io_backend_common.h"

namespace questkv {
namespace {

constexpr unsigned char kPoisonByte = 0xdb;

enum class Fault : uint8_t { kNone, kEio, kEnospc, kShort, kCorrupt, kMisdirect };

struct Planned {
  IoRequest request;   // as the caller gave it
  Fault fault = Fault::kNone;
  uint64_t entropy = 0;  // picks the short count, the flipped bit, the misdirection
  int delay_reaps = 0;   // 0: not delayed
};

struct Held {
  IoCompletion completion;
  int reaps_left;
};

class FaultBackend final : public IoBackend {
 public:
  FaultBackend(std::unique_ptr<IoBackend> inner, const FaultPlan& plan)
      : inner_(std::move(inner)), plan_(plan), rng_(plan.seed), name_("fault(" + std::string(inner_->name()) + ")") {}

  std::string_view name() const override { return name_; }
  int queue_depth() const override { return inner_->queue_depth(); }
  // Held completions still count: the caller has not seen them yet.
  int in_flight() const override { return inner_->in_flight() + int(held_.size()); }

  Status OpenFiles(std::span<const std::string> paths) override { return inner_->OpenFiles(paths); }
  Status RegisterRegion(void* base, std::size_t bytes) override { return inner_->RegisterRegion(base, bytes); }

  Status Submit(const IoRequest& request) override {
    if (in_flight() >= queue_depth()) return Status::ResourceExhausted("io: queue full");
    const Planned planned = Plan(request);
    IoRequest inner = request;
    inner.tag = next_tag_;
    if (planned.fault == Fault::kMisdirect) inner.offset = Misdirect(request, planned.entropy);
    QKV_RETURN_IF_ERROR(inner_->Submit(inner));
    planned_.emplace(next_tag_++, planned);
    return Status::Ok();
  }

  Status Reap(std::vector<IoCompletion>* out, int min_complete) override {
    if (min_complete < 0 || min_complete > in_flight())
      return Status::InvalidArgument("io: min_complete " + std::to_string(min_complete) + " with " +
                                     std::to_string(in_flight()) + " in flight");
    const std::size_t start = out->size();
    ReleaseAged(out);
    std::vector<IoCompletion> got;
    QKV_RETURN_IF_ERROR(inner_->Reap(&got, 0));
    Process(got, out);
    while (int(out->size() - start) < min_complete) {
      if (inner_->in_flight() == 0) {  // only held ones are left: release the oldest
        out->push_back(held_.front().completion);
        held_.erase(held_.begin());
        continue;
      }
      got.clear();
      QKV_RETURN_IF_ERROR(inner_->Reap(&got, 1));
      Process(got, out);
    }
    return Status::Ok();
  }

 private:
  bool Draw(double p) { return rng_.Uniform() < p; }

  // Always the same number of draws, whatever the outcome.
  Planned Plan(const IoRequest& r) {
    const bool read = r.op == IoRequest::Op::kRead;
    const bool eio = Draw(read ? plan_.read_eio : plan_.write_eio);
    const bool enospc = Draw(read ? 0.0 : plan_.write_enospc);
    const bool shortened = Draw(read ? plan_.short_read : plan_.short_write);
    const bool corrupt = Draw(read ? plan_.corrupt_read : 0.0);
    const bool misdirect = Draw(read ? 0.0 : plan_.misdirected_write);
    const bool delay = Draw(plan_.delay);
    const uint64_t entropy = rng_.Next();
    const int delay_reaps = 1 + int(rng_.Below(3));
    Planned p{r, Fault::kNone, entropy, delay ? delay_reaps : 0};
    if (misdirect) p.fault = Fault::kMisdirect;
    if (corrupt) p.fault = Fault::kCorrupt;
    if (shortened) p.fault = Fault::kShort;
    if (enospc) p.fault = Fault::kEnospc;
    if (eio) p.fault = Fault::kEio;
    return p;
  }

  // The page-sized slot before or after the intended one.
  static uint64_t Misdirect(const IoRequest& r, uint64_t entropy) {
    const uint64_t step = r.len;
    return (entropy & 1) && r.offset >= step ? r.offset - step : r.offset + step;
  }

  void ReleaseAged(std::vector<IoCompletion>* out) {
    for (Held& h : held_) --h.reaps_left;
    for (const Held& h : held_)
      if (h.reaps_left <= 0) out->push_back(h.completion);
    std::erase_if(held_, [](const Held& h) { return h.reaps_left <= 0; });
  }

  void Process(const std::vector<IoCompletion>& got, std::vector<IoCompletion>* out) {
    for (const IoCompletion& c : got) {
      auto it = planned_.find(c.tag);
      const Planned p = it->second;
      planned_.erase(it);
      const IoCompletion damaged{p.request.tag, Damage(p, c.result)};
      if (p.delay_reaps > 0) {
        held_.push_back({damaged, p.delay_reaps});
      } else {
        out->push_back(damaged);
      }
    }
  }

  static int64_t Damage(const Planned& p, int64_t result) {
    if (result < 0) return result;  // a real error stays as it is
    auto* bytes = static_cast<unsigned char*>(p.request.buf);
    const bool read = p.request.op == IoRequest::Op::kRead;
    switch (p.fault) {
      case Fault::kNone:
      case Fault::kMisdirect:
        return result;
      case Fault::kEio:
        if (read) std::memset(bytes, kPoisonByte, p.request.len);
        return -EIO;
      case Fault::kEnospc:
        return -ENOSPC;
      case Fault::kShort: {
        const int64_t count = int64_t(p.entropy % uint64_t(std::max<int64_t>(result, 1)));
        if (read) std::memset(bytes + count, kPoisonByte, p.request.len - count);
        return count;
      }
      case Fault::kCorrupt:
        if (result > 0) bytes[(p.entropy >> 3) % uint64_t(result)] ^= uint8_t(1u << (p.entropy & 7));
        return result;
    }
    return result;
  }

  std::unique_ptr<IoBackend> inner_;
  const FaultPlan plan_;
  SeededRng rng_;
  const std::string name_;
  uint64_t next_tag_ = 0;
  std::unordered_map<uint64_t, Planned> planned_;  // by inner tag; at most queue_depth()
  std::vector<Held> held_;                         // at most queue_depth()
};

}  // namespace

std::unique_ptr<IoBackend> MakeFaultInjectingBackend(std::unique_ptr<IoBackend> inner, const FaultPlan& plan) {
  return std::make_unique<FaultBackend>(std::move(inner), plan);
}

}  // namespace questkv
