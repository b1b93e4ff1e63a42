// Constants shared by every layer, host and device code alike.
#pragma once

#include <cstdint>

namespace questkv {

// slot_page of a free hbm slot (no page holds it).
inline constexpr uint32_t kEmptySlot = 0xFFFFFFFFu;

}  // namespace questkv
