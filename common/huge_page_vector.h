// A std::vector whose large buffers sit on transparent huge pages, for
// per-session metadata that a kernel streams from memory (Quest's per-page
// min/max, gqa_block's block sums). On 4 KiB pages the hardware prefetcher
// stops at every page boundary and each page costs a TLB miss, which keeps
// such a stream well below the memory's read bandwidth; on 2 MiB pages it
// streams like the page arena does.
#pragma once

#include <sys/mman.h>

#include <cstddef>
#include <cstdint>
#include <new>
#include <vector>

namespace karat {

// Buffers of at least kHugePageThreshold bytes are mapped directly, rounded
// up to whole 2 MiB pages and advised MADV_HUGEPAGE (a hint: where the
// kernel has no huge page to give, the mapping stays on small pages and
// works the same); smaller ones come from operator new. Stateless, so any
// two instances are interchangeable.
template <typename T>
struct HugePageAllocator {
  using value_type = T;
  static constexpr size_t kHugePage = size_t(2) << 20;
  static constexpr size_t kHugePageThreshold = size_t(1) << 20;

  HugePageAllocator() = default;
  template <typename U>
  HugePageAllocator(const HugePageAllocator<U>&) {}

  T* allocate(size_t n) {
    const size_t bytes = n * sizeof(T);
    if (bytes < kHugePageThreshold) {
      return static_cast<T*>(::operator new(bytes));
    }
    // Mapped with a spare huge page, then trimmed to a 2 MiB-aligned range
    // (huge pages back only aligned ranges).
    const size_t mapped = (bytes + kHugePage - 1) / kHugePage * kHugePage;
    void* raw = mmap(nullptr, mapped + kHugePage, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED) throw std::bad_alloc();
    char* base = static_cast<char*>(raw);
    char* aligned = reinterpret_cast<char*>(
        (reinterpret_cast<uintptr_t>(base) + kHugePage - 1) / kHugePage *
        kHugePage);
    if (aligned > base) munmap(base, size_t(aligned - base));
    char* end = aligned + mapped;
    if (base + mapped + kHugePage > end) {
      munmap(end, size_t(base + mapped + kHugePage - end));
    }
    madvise(aligned, mapped, MADV_HUGEPAGE);
    return reinterpret_cast<T*>(aligned);
  }
  void deallocate(T* p, size_t n) {
    const size_t bytes = n * sizeof(T);
    if (bytes < kHugePageThreshold) {
      ::operator delete(p);
      return;
    }
    munmap(p, (bytes + kHugePage - 1) / kHugePage * kHugePage);
  }
  bool operator==(const HugePageAllocator&) const { return true; }
  bool operator!=(const HugePageAllocator&) const { return false; }
};

template <typename T>
using HugePageVector = std::vector<T, HugePageAllocator<T>>;

}  // namespace karat
