#include "tiers/page_table.h"

namespace questkv {

void PageTableCsr::Assign(const std::vector<const PageList*>& lists, int page_size) {
  indptr.assign(1, 0);
  indices.clear();
  last_page_len.clear();
  for (const PageList* list : lists) {
    indices.insert(indices.end(), list->pages.begin(), list->pages.end());
    indptr.push_back(int32_t(indices.size()));
    last_page_len.push_back(list->last_page_len(page_size));
  }
}

}  // namespace questkv
