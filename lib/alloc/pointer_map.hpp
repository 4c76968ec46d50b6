// An open-addressing hash map from an allocation's address to its block: the lookup on
// every free. std::unordered_map allocates a node per insert, which alone would cost a
// third of the fast path's budget; this table allocates only when it grows.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace zeroalloc {

template <typename Value>
class pointer_map {
 public:
  pointer_map() : slots_(kInitialCapacity) {}

  /// Inserts or replaces. `key` is never 0.
  void insert(std::uintptr_t key, Value* value) {
    if ((size_ + 1) * 2 > slots_.size()) grow();
    std::size_t index = home(key);
    while (slots_[index].key != 0 && slots_[index].key != key) index = (index + 1) & mask();
    if (slots_[index].key == 0) ++size_;
    slots_[index] = {key, value};
  }

  [[nodiscard]] Value* find(std::uintptr_t key) const {
    for (std::size_t index = home(key);; index = (index + 1) & mask()) {
      if (slots_[index].key == key) return slots_[index].value;
      if (slots_[index].key == 0) return nullptr;
    }
  }

  /// Removes `key` if present (backward-shift deletion: no tombstones).
  void erase(std::uintptr_t key) {
    std::size_t index = home(key);
    while (slots_[index].key != key) {
      if (slots_[index].key == 0) return;
      index = (index + 1) & mask();
    }
    std::size_t hole = index;
    for (std::size_t next = (hole + 1) & mask(); slots_[next].key != 0;
         next = (next + 1) & mask()) {
      const std::size_t wanted = home(slots_[next].key);
      // Move the entry back if its home is not in the cyclic range (hole, next].
      const bool stays =
          hole <= next ? (wanted > hole && wanted <= next) : (wanted > hole || wanted <= next);
      if (!stays) {
        slots_[hole] = slots_[next];
        hole = next;
      }
    }
    slots_[hole] = {};
    --size_;
  }

  [[nodiscard]] std::size_t size() const { return size_; }

 private:
  struct slot {
    std::uintptr_t key = 0;
    Value* value = nullptr;
  };
  static constexpr std::size_t kInitialCapacity = 1024;

  [[nodiscard]] std::size_t mask() const { return slots_.size() - 1; }
  [[nodiscard]] std::size_t home(std::uintptr_t key) const {
    // Allocations are 512-byte aligned: drop those bits, then mix (Fibonacci hashing).
    return static_cast<std::size_t>(((key >> 9) * 0x9E3779B97F4A7C15ull) >> 20) & mask();
  }
  void grow() {
    std::vector<slot> old(slots_.size() * 2);
    old.swap(slots_);
    size_ = 0;
    for (const slot& entry : old) {
      if (entry.key != 0) insert(entry.key, entry.value);
    }
  }

  std::vector<slot> slots_;
  std::size_t size_ = 0;
};

}  // namespace zeroalloc
