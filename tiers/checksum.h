// The one checksum routine for page bytes. Keyed by (PageId, generation), so
// a page's bytes read back from the wrong place, or a stale generation of the
// same id, do not match. Kept outside the page (DESIGN.md §9).
#pragma once

#include <cstddef>
#include <cstdint>

namespace questkv {

uint64_t PageChecksum(const void* data, std::size_t bytes, uint32_t page_id, uint32_t generation);

}  // namespace questkv
