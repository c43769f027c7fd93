// The pinned host pool: page-locked host memory for staging (NVMe I/O buffers, H2D/D2H copies).
//
// What it owns: address-space reservations ("chunks") taken from the OS with mmap, and the
// memory committed inside them. A chunk reserves `chunk_bytes` of address space (or a larger
// request's size) but commits memory only as blocks need it, in 2 MiB steps, so the memory
// held (`reserved_bytes`) follows use, not chunk size. Committed memory is page-locked with
// mlock, or registered with the device (cudaHostRegister) when one is given, bound to a NUMA
// node when asked, and backed by huge pages where the machine has them (MAP_HUGETLB, else
// transparent huge pages, else 4 KiB pages). Blocks are sub-allocated best-fit from free
// ranges with coalescing.
//
// Invariants:
//  - reserved_bytes (memory committed in all chunks) never exceeds budget_bytes; a request
//    that cannot fit after reusing free space and releasing empty chunks throws kOutOfMemory.
//  - Every block starts at a multiple of `alignment` and lies inside one chunk; with device
//    registration, inside one registered range (a copy never spans two registrations).
//  - The statistics are exact: taken under the pool's lock from the live blocks and chunks.
//  - A chunk reports the page kind and lock state it really got; a fallback (no huge pages,
//    no locking, no NUMA binding) warns once per process and never fails the allocation.
//
// What it never does: return memory to the OS while a block in that chunk is live; touch a
// chunk after a failed registration without undoing it; crash when the pool is destroyed
// before its blocks (a bug: it logs an error and leaks those chunks instead).
//
// Freed blocks go back to the free ranges of their chunk; a chunk that becomes empty is
// kept for reuse (staging buffers come and go in waves) until trim(), the pool's
// destruction, or a request that would otherwise exceed the budget releases it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

namespace strata {

class Device;

// How the memory of a chunk is backed.
enum class PageKind {
  kHugeTlb,          // MAP_HUGETLB 2 MiB pages from the hugetlbfs pool
  kTransparentHuge,  // MADV_HUGEPAGE, and the kernel did back it with huge pages
  kNormal,           // 4 KiB pages
};
const char* page_kind_name(PageKind kind);

struct PinnedPoolOptions {
  // Most memory the pool may hold, >= 2 MiB: memory is committed in 2 MiB steps, so a budget's
  // part above its last whole 2 MiB is never used.
  std::size_t budget_bytes = 0;
  bool huge_pages = true;  // try huge pages first; false forces 4 KiB pages
  bool lock = true;        // page-lock (mlock or device registration)
  // NUMA node to bind the memory to; -1: the node nearest `device` where the device knows
  // it (Device::numa_node(), from the GPU's PCI slot), else no binding.
  int numa_node = -1;
  // When set, memory is registered via device->register_host() (cudaHostRegister on CUDA)
  // instead of mlock; where the device declines (HostDevice), mlock is used. The device
  // must outlive the pool.
  Device* device = nullptr;
  // Address space reserved per chunk (>= 2 MiB); memory is committed in 2 MiB steps.
  std::size_t chunk_bytes = std::size_t(64) << 20;
  std::size_t alignment = 4096;  // of every block: a power of two, 4096 .. chunk_bytes
  // Committed (and page-locked or registered) as one piece, the first chunk, at the first
  // allocation (<= budget_bytes; 0: none). A registered pool otherwise grows piece by piece, and
  // a block cannot span two registrations, so each piece's unused tail stays behind: give the
  // bytes the caller knows it will hold (the engine gives its memory plan's host total).
  std::size_t initial_bytes = 0;
};

struct PinnedPoolStats {
  std::size_t budget_bytes = 0;
  std::size_t requested_bytes = 0;  // sum of live requests, as asked
  std::size_t allocated_bytes = 0;  // sum of live blocks, rounded up to the alignment
  std::size_t reserved_bytes = 0;   // memory committed in chunks (free ranges included)
  std::size_t peak_reserved_bytes = 0;
  std::size_t num_blocks = 0;
  std::size_t num_chunks = 0;
  std::size_t huge_chunks = 0;   // chunks backed by huge pages (either kind)
  std::size_t locked_bytes = 0;  // reserved bytes that are page-locked / registered

  // reserved / requested - 1: the memory held beyond what callers asked for.
  double overhead() const {
    if (requested_bytes == 0) return reserved_bytes == 0 ? 0.0 : 1e300;
    return double(reserved_bytes) / double(requested_bytes) - 1.0;
  }
};

namespace detail {
struct PinnedPoolState;
struct PinnedChunk;
}  // namespace detail

// An owning handle to a block of the pool. Move-only; returns the block on destruction.
class PinnedBlock {
 public:
  PinnedBlock() = default;
  PinnedBlock(PinnedBlock&& other) noexcept;
  PinnedBlock& operator=(PinnedBlock&& other) noexcept;
  PinnedBlock(const PinnedBlock&) = delete;
  PinnedBlock& operator=(const PinnedBlock&) = delete;
  ~PinnedBlock();

  void* data() const noexcept { return ptr_; }
  std::size_t size() const noexcept { return bytes_; }  // the requested bytes
  PageKind page_kind() const noexcept { return kind_; }
  bool pinned() const noexcept { return pinned_; }  // page-locked or device-registered
  explicit operator bool() const noexcept { return ptr_ != nullptr; }

  // Returns the block to the pool now and leaves the handle empty.
  void reset() noexcept;

 private:
  friend class PinnedPool;
  std::shared_ptr<detail::PinnedPoolState> state_;
  detail::PinnedChunk* chunk_ = nullptr;
  void* ptr_ = nullptr;
  std::size_t bytes_ = 0;
  std::size_t alloc_bytes_ = 0;
  PageKind kind_ = PageKind::kNormal;
  bool pinned_ = false;
};

class PinnedPool {
 public:
  // Validates `options` (throws kInvalidArgument naming the field and the allowed values).
  // Reserves nothing until the first allocation.
  explicit PinnedPool(const PinnedPoolOptions& options);
  // Releases every chunk. Live blocks are a bug: logged, and their chunks leaked.
  ~PinnedPool();
  PinnedPool(const PinnedPool&) = delete;
  PinnedPool& operator=(const PinnedPool&) = delete;

  // A block of at least `bytes` (> 0) usable bytes, aligned to options().alignment.
  // Throws kOutOfMemory (requested, reserved, budget and the fix) when the budget is spent,
  // kIo when the OS refuses address space. Thread-safe.
  PinnedBlock allocate(std::size_t bytes);

  PinnedPoolStats stats() const;
  // Releases every chunk that holds no live block; returns the bytes released.
  std::size_t trim();
  const PinnedPoolOptions& options() const noexcept;

 private:
  std::shared_ptr<detail::PinnedPoolState> state_;
};

}  // namespace strata
