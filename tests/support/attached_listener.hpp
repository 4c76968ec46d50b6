// A paging listener attached to an allocator for one scope: declared after the listener
// (a migrator, an offload engine), it detaches before the listener is destroyed.
#pragma once

#include "alloc/caching_allocator.hpp"

namespace zeroalloc::testing {

class attached_listener {
 public:
  attached_listener(caching_allocator& allocator, paging_listener& listener)
      : allocator_(allocator) {
    allocator_.paging().attach(listener);
  }
  ~attached_listener() { allocator_.paging().detach(); }
  attached_listener(const attached_listener&) = delete;
  attached_listener& operator=(const attached_listener&) = delete;

 private:
  caching_allocator& allocator_;
};

}  // namespace zeroalloc::testing
