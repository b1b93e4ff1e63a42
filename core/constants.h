// Constants shared by every layer, host and device code alike.
#pragma once

#include <cmath>
#include <cstdint>

namespace questkv {

// slot_page of a free hbm slot (no page holds it).
inline constexpr uint32_t kEmptySlot = 0xFFFFFFFFu;

// The two-stage re-rank's candidates for a ranking that keeps k pages beyond
// the sink and local ones: ceil(rerank * k), at most `others` (the pages
// beyond them). The one count the CPU selector ranks, the CUDA widened
// select keeps and the backends report keys read for.
inline int64_t RerankCandidates(double rerank, int64_t k, int64_t others) {
  if (rerank <= 0 || k <= 0 || others <= 0) return 0;
  const auto c = int64_t(std::ceil(rerank * double(k)));
  return c < others ? c : others;
}

}  // namespace questkv
