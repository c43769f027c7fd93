// The pinned host pool (see include/strata/pinned_pool.h for the contract).
//
// Layout of a chunk: one mmap of [guard page | chunk address space], the address space
// aligned to max(2 MiB, alignment). Everything starts PROT_NONE (reserved, not committed).
// Memory is committed from the start of the chunk upwards in 2 MiB steps ("pieces"): made
// readable and writable (or remapped with MAP_HUGETLB), bound to the NUMA node, page-locked
// or registered, and faulted in. The guard page keeps the kernel from merging the first
// piece's VMA with a neighbour's, so /proc/self/smaps describes this chunk alone when we
// check whether transparent huge pages were really granted.
//
// Invariants, all under State::mu:
//  - chunk.free holds the committed bytes not in a live block, as disjoint ranges that are
//    coalesced except across a registration boundary (chunk.barriers): cudaHostRegister'd
//    ranges are registered piece by piece, and a block must not span two of them.
//  - A chunk's page kind, pinned and registered flags hold for every piece: a later piece
//    that cannot get the same treatment is undone and the chunk stops growing.
//  - state.reserved == sum of chunk.committed <= budget.
// Never: munmap a chunk with live blocks, or call the device after the pool is destroyed.
#include "strata/pinned_pool.h"

#include <hwloc.h>
#include <linux/io_uring.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "strata/device.h"
#include "strata/error.h"
#include "strata/log.h"
#include "strata/system_info.h"

namespace strata {

const char* page_kind_name(PageKind kind) {
  switch (kind) {
    case PageKind::kHugeTlb:
      return "hugetlb";
    case PageKind::kTransparentHuge:
      return "transparent-huge";
    case PageKind::kNormal:
      return "normal";
  }
  return "unknown";
}

namespace {

constexpr std::size_t kHugePage = std::size_t(2) << 20;
constexpr std::size_t kPage = 4096;

std::size_t round_up(std::size_t x, std::size_t a) { return (x + a - 1) / a * a; }
bool is_pow2(std::size_t x) { return x != 0 && (x & (x - 1)) == 0; }

std::string errno_text(int err) {
  char buf[256];
  return strerror_r(err, buf, sizeof buf);
}

std::string thp_mode() {
  std::ifstream f("/sys/kernel/mm/transparent_hugepage/enabled");
  std::string line;
  if (!std::getline(f, line)) return "unavailable";
  const auto open = line.find('['), close = line.find(']');
  if (open == std::string::npos || close == std::string::npos || close < open) return "unavailable";
  return line.substr(open + 1, close - open - 1);
}

// AnonHugePages of the VMA containing `addr`, from /proc/self/smaps.
std::size_t anon_huge_bytes_at(const void* addr) {
  std::ifstream f("/proc/self/smaps");
  const auto a = reinterpret_cast<std::uintptr_t>(addr);
  std::string line;
  bool in_vma = false;
  while (std::getline(f, line)) {
    unsigned long lo = 0, hi = 0;
    if (std::sscanf(line.c_str(), "%lx-%lx ", &lo, &hi) == 2) {
      if (in_vma) return 0;
      in_vma = a >= lo && a < hi;
      continue;
    }
    if (in_vma && line.rfind("AnonHugePages:", 0) == 0) {
      std::size_t kb = 0;
      std::sscanf(line.c_str() + 14, "%zu", &kb);
      return kb * 1024;
    }
  }
  return 0;
}

// Faults 4 KiB pages in as the kernel faults memory pinned for the long term: through an
// io_uring buffer registration, dropped at once (the pages stay, mapped). Such pins allocate
// outside the movable page lists (memalloc_pin_save), from pageblocks that hand out 4 KiB
// pages physically in a row more often than the movable lists a touch or mlock draws from,
// and a disk's scatter list is one segment per physically contiguous run (docs/nvme.md, "4 KiB
// pages: where they lie physically": the benchmark's 32 MiB buffers came out at 584-6,341 runs in
// 8,192 pages against 2,363-8,189). False where io_uring is refused (old kernel, seccomp,
// io_uring_disabled, RLIMIT_MEMLOCK): the caller faults the pages in the ordinary way.
// A range committed in steps of this many bytes, a system call each (mlock, the pinning fault,
// the populating): one call over a plan's 7 GiB took up to 34 s, through which Ctrl-C or a
// scheduler's SIGTERM waited (a signal is taken when a call returns): past a 10 s grace period,
// SIGKILL came before the swap files were removed.
constexpr std::size_t kCommitStep = std::size_t(256) << 20;

// fn(start, bytes) over [addr, addr + bytes) in kCommitStep pieces; false at the first that
// returns false.
template <class Fn>
bool in_steps(void* addr, std::size_t bytes, Fn&& fn) {
  for (std::size_t off = 0; off < bytes; off += kCommitStep)
    if (!fn(static_cast<char*>(addr) + off, std::min(kCommitStep, bytes - off))) return false;
  return true;
}

bool fault_in_as_pinned(void* addr, std::size_t bytes) {
  io_uring_params params{};
  const int fd = int(syscall(SYS_io_uring_setup, 1, &params));
  if (fd < 0) return false;
  // (io_uring's limit per registered buffer is 1 GiB, above the step)
  const bool ok = in_steps(addr, bytes, [fd](char* p, std::size_t n) {
    iovec iov{p, n};
    if (syscall(SYS_io_uring_register, fd, IORING_REGISTER_BUFFERS, &iov, 1u) != 0) return false;
    syscall(SYS_io_uring_register, fd, IORING_UNREGISTER_BUFFERS, nullptr, 0);
    return true;
  });
  ::close(fd);
  return ok;
}

// Faults the range in so that page kind, NUMA placement and the memory held are real now.
void prefault(void* addr, std::size_t bytes) {
  if (in_steps(addr, bytes,
               [](char* p, std::size_t n) { return madvise(p, n, MADV_POPULATE_WRITE) == 0; }))
    return;
  auto* p = static_cast<volatile char*>(addr);
  for (std::size_t off = 0; off < bytes; off += kPage) p[off] = 0;
}

}  // namespace

namespace detail {

struct PinnedChunk {
  char* map_base = nullptr;  // the whole mapping: guard page + address space
  std::size_t map_bytes = 0;
  char* base = nullptr;  // start of the address space blocks come from
  std::size_t va_bytes = 0;
  std::size_t committed = 0;  // [0, committed) is committed
  PageKind kind = PageKind::kNormal;
  bool pinned = false;
  bool registered = false;  // pieces registered through the device
  bool mlocked = false;
  bool growable = true;
  std::vector<std::pair<std::size_t, std::size_t>> pieces;  // (offset, bytes) committed
  std::map<std::size_t, std::size_t> free;                  // offset -> bytes
  std::set<std::size_t> barriers;                           // no coalescing across these
  std::size_t live_blocks = 0;
};

struct PinnedPoolState {
  PinnedPoolOptions opt;
  mutable std::mutex mu;
  std::vector<std::unique_ptr<PinnedChunk>> chunks;
  std::size_t requested = 0, allocated = 0, reserved = 0, peak = 0, blocks = 0;
  bool initial_made = false;  // opt.initial_bytes' chunk (made once, at the first allocation)
  bool orphaned = false;      // the pool was destroyed with live blocks
  hwloc_topology_t topo = nullptr;
  hwloc_bitmap_t nodeset = nullptr;

  ~PinnedPoolState() {
    if (nodeset) hwloc_bitmap_free(nodeset);
    if (topo) hwloc_topology_destroy(topo);
    // Chunks still here belong to an orphaned pool: leaked on purpose (see ~PinnedPool).
  }

  void insert_free(PinnedChunk& c, std::size_t off, std::size_t len) {
    auto next = c.free.lower_bound(off);
    if (next != c.free.end() && next->first == off + len && !c.barriers.count(off + len)) {
      len += next->second;
      next = c.free.erase(next);
    }
    if (next != c.free.begin()) {
      auto prev = std::prev(next);
      if (prev->first + prev->second == off && !c.barriers.count(off)) {
        prev->second += len;
        return;
      }
    }
    c.free.emplace(off, len);
  }

  // Takes [at, at + size) out of the free range starting at `range`.
  void carve(PinnedChunk& c, std::map<std::size_t, std::size_t>::iterator range, std::size_t at,
             std::size_t size) {
    const std::size_t off = range->first, len = range->second;
    c.free.erase(range);
    if (at > off) c.free.emplace(off, at - off);
    if (at + size < off + len) c.free.emplace(at + size, off + len - at - size);
  }

  void undo_piece(PinnedChunk& c, std::size_t off, std::size_t len, bool registered, bool mlocked) {
    char* p = c.base + off;
    if (registered) opt.device->unregister_host(p);
    if (mlocked) syscall(SYS_munlock, p, len);
    // Replacing our own range with MAP_FIXED is safe: nobody else can own it.
    if (mmap(p, len, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0) ==
        MAP_FAILED)
      log::error("pinned pool: could not return {} bytes at {} to PROT_NONE ({})", len,
                 static_cast<void*>(p), errno_text(errno));
  }

  // Makes [c.committed, c.committed + len) usable memory. Returns false (with the range
  // undone and the chunk closed for growth) when this piece cannot get the chunk's kind or
  // lock state; throws when the first piece cannot be committed at all.
  bool commit(PinnedChunk& c, std::size_t len) {
    const std::size_t off = c.committed;
    char* p = c.base + off;
    const bool first = c.pieces.empty();

    if (c.kind == PageKind::kHugeTlb) {
      // MAP_FIXED over a reservation may leave a hole when the huge-page mmap fails, so
      // unmap first and map with NOREPLACE; on failure put the reservation back.
      STRATA_CHECK_ERRNO(munmap(p, len), "pinned pool: munmap of {} reserved bytes", len);
      void* m = mmap(p, len, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_HUGETLB | MAP_FIXED_NOREPLACE, -1, 0);
      if (m != p) {
        if (m != MAP_FAILED) munmap(m, len);
        void* r = mmap(p, len, PROT_NONE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED_NOREPLACE, -1, 0);
        if (r != p) {
          // Another mapping took the hole: the address space above it is no longer ours to
          // grow into. Give back our part above the hole and stop growing.
          if (r != MAP_FAILED) munmap(r, len);
          const std::size_t tail = c.va_bytes - off - len;
          if (tail) munmap(p + len, tail);
          c.map_bytes = static_cast<std::size_t>(p - c.map_base);
          c.va_bytes = off;
        }
        c.growable = false;
        return false;
      }
    } else {
      STRATA_CHECK_ERRNO(mprotect(p, len, PROT_READ | PROT_WRITE),
                         "pinned pool: cannot commit {} bytes of host memory", len);
    }

    if (nodeset && hwloc_set_area_membind(topo, p, len, nodeset, HWLOC_MEMBIND_BIND,
                                          HWLOC_MEMBIND_BYNODESET) != 0)
      log::warn_once("pinned_pool.numa",
                     fmt::format("pinned pool: cannot bind host memory to NUMA node {} ({}); "
                                 "continuing without binding",
                                 opt.numa_node, errno_text(errno)));

    // 4 KiB pages are faulted in as pinned memory first (a device registration or mlock below
    // then finds them present): where they lie physically decides O_DIRECT speed.
    if (c.kind == PageKind::kNormal && opt.lock && !fault_in_as_pinned(p, len))
      log::debug(
          "pinned pool: io_uring refused the pinning fault; 4 KiB pages faulted in the ordinary "
          "way");
    bool registered = false, mlocked = false;
    if (opt.lock && opt.device) {
      try {
        registered = opt.device->register_host(p, len);
      } catch (const Error& e) {
        log::warn_once(
            "pinned_pool.register",
            fmt::format("pinned pool: device registration failed ({}); using mlock", e.what()));
      }
    }
    if (opt.lock && !registered) {
      // The raw syscall: sanitizer runtimes intercept mlock() as a no-op that reports
      // success, which would make pinned() lie.
      if (in_steps(p, len, [](char* q, std::size_t n) { return syscall(SYS_mlock, q, n) == 0; })) {
        mlocked = true;
      } else {
        const int err = errno;
        syscall(SYS_munlock, p, len);  // the steps that took
        errno = err;
        log::warn_once("pinned_pool.mlock",
                       fmt::format("pinned pool: cannot page-lock host memory ({}); using pageable "
                                   "memory, copies and O_DIRECT I/O will be slower. Raise "
                                   "RLIMIT_MEMLOCK (ulimit -l) or run with CAP_IPC_LOCK",
                                   errno_text(errno)));
      }
    }
    // mlock and registration usually fault the range in, but not by contract; populating
    // present pages is cheap.
    prefault(p, len);

    const bool pinned = registered || mlocked;
    if (first) {
      c.pinned = pinned;
      c.registered = registered;
      c.mlocked = mlocked;
      if (c.kind == PageKind::kTransparentHuge && anon_huge_bytes_at(p) == 0) {
        c.kind = PageKind::kNormal;
        log::debug("pinned pool: the kernel gave 4 KiB pages despite MADV_HUGEPAGE");
      }
    } else if (pinned != c.pinned || registered != c.registered) {
      undo_piece(c, off, len, registered, mlocked);
      c.growable = false;
      return false;
    }
    if (c.registered && !first) c.barriers.insert(off);
    c.pieces.emplace_back(off, len);
    c.committed += len;
    reserved += len;
    peak = std::max(peak, reserved);
    insert_free(c, off, len);
    return true;
  }

  // Reserves address space for a new chunk and picks its page kind; commits nothing.
  std::unique_ptr<PinnedChunk> reserve_chunk(std::size_t va_bytes) {
    auto c = std::make_unique<PinnedChunk>();
    const std::size_t base_align = std::max(kHugePage, opt.alignment);
    const std::size_t map_bytes = kPage + va_bytes + base_align;
    void* m =
        mmap(nullptr, map_bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (m == MAP_FAILED)
      detail::throw_errno(__FILE__, __LINE__, "mmap", errno,
                          fmt::format("pinned pool: cannot reserve {} bytes of address space{}",
                                      map_bytes, address_space_note()));
    auto* raw = static_cast<char*>(m);
    auto* base = reinterpret_cast<char*>(
        round_up(reinterpret_cast<std::uintptr_t>(raw) + kPage, base_align));
    char* start = base - kPage;
    if (start > raw) munmap(raw, static_cast<std::size_t>(start - raw));
    char* end = base + va_bytes;
    if (end < raw + map_bytes) munmap(end, static_cast<std::size_t>(raw + map_bytes - end));
    c->map_base = start;
    c->map_bytes = kPage + va_bytes;
    c->base = base;
    c->va_bytes = va_bytes;

    if (!opt.huge_pages) {
      // Honest kNormal even where THP is "always".
      madvise(base, va_bytes, MADV_NOHUGEPAGE);
      c->kind = PageKind::kNormal;
    } else {
      c->kind = PageKind::kHugeTlb;  // commit() falls back from here
    }
    return c;
  }

  void release_chunk(PinnedChunk& c) {
    if (c.registered)
      for (const auto& [off, len] : c.pieces) opt.device->unregister_host(c.base + off);
    if (munmap(c.map_base, c.map_bytes) != 0)
      log::error("pinned pool: munmap of a chunk failed ({})", errno_text(errno));
    reserved -= c.committed;
  }

  // A new chunk with its first piece committed, the page kind chosen by falling back.
  PinnedChunk& new_chunk(std::size_t va_bytes, std::size_t first_len) {
    auto c = reserve_chunk(va_bytes);
    try {
      if (c->kind == PageKind::kHugeTlb && !commit(*c, first_len)) {
        // No hugetlbfs pages: the reservation is intact unless a hole appeared.
        if (c->va_bytes < va_bytes) {
          munmap(c->map_base, c->map_bytes);
          c = reserve_chunk(va_bytes);
        }
        c->growable = true;
        c->kind = PageKind::kTransparentHuge;
        const std::string mode = thp_mode();
        if (mode == "never" || mode == "unavailable" ||
            madvise(c->base, c->va_bytes, MADV_HUGEPAGE) != 0)
          c->kind = PageKind::kNormal;
      }
      if (c->pieces.empty() && !commit(*c, first_len))
        STRATA_THROW(kInternal, "pinned pool: the first piece of a chunk could not be committed");
    } catch (...) {
      if (c->registered)
        for (const auto& [off, len] : c->pieces) opt.device->unregister_host(c->base + off);
      munmap(c->map_base, c->map_bytes);
      reserved -= c->committed;
      throw;
    }
    if (opt.huge_pages && c->kind == PageKind::kNormal)
      log::warn_once(
          "pinned_pool.huge_pages",
          fmt::format("pinned pool: huge pages requested but unavailable (no free "
                      "hugetlbfs pages; transparent huge pages '{}'{}); using 4 KiB "
                      "pages, O_DIRECT staging will be slower. Reserve huge pages "
                      "(sysctl vm.nr_hugepages){}",
                      thp_mode(),
                      thp_mode() == "never" || thp_mode() == "unavailable"
                          ? ""
                          : ", none granted: memory too fragmented",
                      thp_mode() == "never" ? " or set transparent_hugepage to madvise" : ""));
    chunks.push_back(std::move(c));
    return *chunks.back();
  }

  std::size_t release_empty_chunks() {
    std::size_t released = 0;
    std::erase_if(chunks, [&](const std::unique_ptr<PinnedChunk>& c) {
      if (c->live_blocks != 0) return false;
      released += c->committed;
      release_chunk(*c);
      return true;
    });
    return released;
  }

  struct Placement {
    PinnedChunk* chunk = nullptr;
    std::size_t offset = 0;
  };

  // Best fit among committed free ranges.
  Placement place_in_free(std::size_t size) {
    Placement best;
    std::size_t best_len = SIZE_MAX;
    for (auto& c : chunks) {
      for (auto it = c->free.begin(); it != c->free.end(); ++it) {
        const std::size_t at = round_up(it->first, opt.alignment);
        if (at + size > it->first + it->second || it->second >= best_len) continue;
        best = {c.get(), at};
        best_len = it->second;
      }
    }
    if (best.chunk) {
      auto it = std::prev(best.chunk->free.upper_bound(best.offset));
      carve(*best.chunk, it, best.offset, size);
    }
    return best;
  }

  Placement try_place(std::size_t size) {
    if (!initial_made && opt.initial_bytes > 0) {
      // Once: a released initial chunk (trim, or room made for a failed request) is not made
      // again; the pool grows piece by piece from then on.
      initial_made = true;
      const std::size_t first = std::min(round_up(opt.initial_bytes, kHugePage),
                                         opt.budget_bytes / kHugePage * kHugePage);
      try {
        if (reserved + first <= opt.budget_bytes)
          new_chunk(std::max(round_up(opt.chunk_bytes, kHugePage), first), first);
      } catch (const Error& e) {  // piece by piece may still fit what this request needs
        log::warn(
            "pinned pool: the initial {} bytes could not be committed as one piece ({}); "
            "growing piece by piece",
            first, e.what());
      }
    }
    if (Placement p = place_in_free(size); p.chunk) return p;

    // Grow the chunk that needs the fewest new bytes, or open a new chunk. (Padding
    // registered pieces to larger steps was tried: it left more unused, not less.)
    PinnedChunk* grow = nullptr;
    std::size_t grow_add = SIZE_MAX;
    for (auto& c : chunks) {
      if (!c->growable) continue;
      std::size_t start = c->committed;
      if (!c->registered && !c->free.empty()) {
        const auto& last = *c->free.rbegin();
        if (last.first + last.second == c->committed) start = last.first;
      }
      const std::size_t new_committed = round_up(round_up(start, opt.alignment) + size, kHugePage);
      if (new_committed > c->va_bytes) continue;
      if (new_committed - c->committed < grow_add) {
        grow = c.get();
        grow_add = new_committed - c->committed;
      }
    }
    const std::size_t fresh = round_up(size, kHugePage);
    if (grow && grow_add <= fresh) {
      if (reserved + grow_add > opt.budget_bytes) return {};
      if (!commit(*grow, grow_add)) return try_place(size);
      return place_in_free(size);
    }
    if (reserved + fresh > opt.budget_bytes) return {};
    new_chunk(std::max(round_up(opt.chunk_bytes, kHugePage), fresh), fresh);
    return place_in_free(size);
  }

  void free_block(PinnedChunk* c, void* ptr, std::size_t alloc_bytes, std::size_t bytes) noexcept {
    std::lock_guard<std::mutex> lock(mu);
    insert_free(*c, static_cast<std::size_t>(static_cast<char*>(ptr) - c->base), alloc_bytes);
    c->live_blocks -= 1;
    requested -= bytes;
    allocated -= alloc_bytes;
    blocks -= 1;
  }
};

}  // namespace detail

PinnedBlock::PinnedBlock(PinnedBlock&& o) noexcept { *this = std::move(o); }

PinnedBlock& PinnedBlock::operator=(PinnedBlock&& o) noexcept {
  if (this != &o) {
    reset();
    state_ = std::move(o.state_);
    chunk_ = std::exchange(o.chunk_, nullptr);
    ptr_ = std::exchange(o.ptr_, nullptr);
    bytes_ = std::exchange(o.bytes_, 0);
    alloc_bytes_ = std::exchange(o.alloc_bytes_, 0);
    kind_ = o.kind_;
    pinned_ = std::exchange(o.pinned_, false);
  }
  return *this;
}

PinnedBlock::~PinnedBlock() { reset(); }

void PinnedBlock::reset() noexcept {
  if (!ptr_) return;
  state_->free_block(chunk_, ptr_, alloc_bytes_, bytes_);
  state_.reset();
  chunk_ = nullptr;
  ptr_ = nullptr;
  bytes_ = alloc_bytes_ = 0;
  pinned_ = false;
}

PinnedPool::PinnedPool(const PinnedPoolOptions& o)
    : state_(std::make_shared<detail::PinnedPoolState>()) {
  STRATA_REQUIRE(o.budget_bytes >= kHugePage,
                 "PinnedPoolOptions.budget_bytes = {}: must be at least 2 MiB (2097152; the most "
                 "host memory the "
                 "pool may pin, committed in 2 MiB steps: a smaller budget could hold nothing)",
                 o.budget_bytes);
  STRATA_REQUIRE(is_pow2(o.alignment) && o.alignment >= kPage,
                 "PinnedPoolOptions.alignment = {}: must be a power of two >= 4096 (O_DIRECT and "
                 "page locking work on whole pages)",
                 o.alignment);
  STRATA_REQUIRE(o.chunk_bytes >= kHugePage && o.chunk_bytes % kPage == 0,
                 "PinnedPoolOptions.chunk_bytes = {}: must be a multiple of 4096 and >= 2 MiB "
                 "(2097152, one huge page)",
                 o.chunk_bytes);
  STRATA_REQUIRE(o.alignment <= o.chunk_bytes,
                 "PinnedPoolOptions.alignment = {}: must be <= chunk_bytes ({})", o.alignment,
                 o.chunk_bytes);
  STRATA_REQUIRE(o.initial_bytes <= o.budget_bytes,
                 "PinnedPoolOptions.initial_bytes = {}: must be <= budget_bytes ({}); lower it or "
                 "raise the budget",
                 o.initial_bytes, o.budget_bytes);
  STRATA_REQUIRE(o.numa_node >= -1,
                 "PinnedPoolOptions.numa_node = {}: use -1 (no binding) or a NUMA node index",
                 o.numa_node);
  auto& s = *state_;
  s.opt = o;
  // Unset: the node nearest the device, where the device knows it.
  if (s.opt.numa_node < 0 && o.device) s.opt.numa_node = o.device->numa_node();
  if (s.opt.numa_node >= 0) {
    if (hwloc_topology_init(&s.topo) != 0 || hwloc_topology_load(s.topo) != 0) {
      if (s.topo) hwloc_topology_destroy(s.topo);
      s.topo = nullptr;
      log::warn_once("pinned_pool.numa", fmt::format("pinned pool: hwloc cannot read the topology; "
                                                     "NUMA node {} not bound",
                                                     s.opt.numa_node));
      return;
    }
    if (!hwloc_get_numanode_obj_by_os_index(s.topo, static_cast<unsigned>(s.opt.numa_node))) {
      std::string nodes;
      for (hwloc_obj_t n = hwloc_get_next_obj_by_type(s.topo, HWLOC_OBJ_NUMANODE, nullptr); n;
           n = hwloc_get_next_obj_by_type(s.topo, HWLOC_OBJ_NUMANODE, n))
        nodes += fmt::format("{}{}", nodes.empty() ? "" : ", ", n->os_index);
      STRATA_THROW(kInvalidArgument,
                   "PinnedPoolOptions.numa_node = {}: no such NUMA node; use -1 or one of: {}",
                   s.opt.numa_node, nodes);
    }
    s.nodeset = hwloc_bitmap_alloc();
    hwloc_bitmap_only(s.nodeset, static_cast<unsigned>(s.opt.numa_node));
  }
}

PinnedPool::~PinnedPool() {
  auto& s = *state_;
  std::lock_guard<std::mutex> lock(s.mu);
  s.release_empty_chunks();
  if (!s.chunks.empty()) {
    log::error(
        "pinned pool destroyed with {} live block(s) ({} bytes) still in use: a bug in the "
        "caller (blocks must not outlive their pool); leaking {} chunk(s) instead of freeing "
        "memory that may still be read",
        s.blocks, s.requested, s.chunks.size());
    s.orphaned = true;
  }
}

PinnedBlock PinnedPool::allocate(std::size_t bytes) {
  STRATA_REQUIRE(bytes > 0, "pinned pool: cannot allocate 0 bytes");
  auto& s = *state_;
  const std::size_t size = round_up(bytes, s.opt.alignment);
  std::lock_guard<std::mutex> lock(s.mu);
  if (size < bytes || size > s.opt.budget_bytes)
    STRATA_THROW(kOutOfMemory,
                 "pinned pool: cannot allocate {} bytes: more than the whole budget of {} bytes "
                 "({} reserved); raise the pinned budget or split the request",
                 bytes, s.opt.budget_bytes, s.reserved);
  auto p = s.try_place(size);
  if (!p.chunk && s.release_empty_chunks() > 0) p = s.try_place(size);
  if (!p.chunk)
    STRATA_THROW(kOutOfMemory,
                 "pinned pool: cannot allocate {} bytes ({} with alignment): {} bytes reserved, "
                 "{} in live blocks, budget {} bytes; raise the pinned budget or free blocks",
                 bytes, size, s.reserved, s.allocated, s.opt.budget_bytes);
  p.chunk->live_blocks += 1;
  s.requested += bytes;
  s.allocated += size;
  s.blocks += 1;

  PinnedBlock b;
  b.state_ = state_;
  b.chunk_ = p.chunk;
  b.ptr_ = p.chunk->base + p.offset;
  b.bytes_ = bytes;
  b.alloc_bytes_ = size;
  b.kind_ = p.chunk->kind;
  b.pinned_ = p.chunk->pinned;
  return b;
}

PinnedPoolStats PinnedPool::stats() const {
  const auto& s = *state_;
  std::lock_guard<std::mutex> lock(s.mu);
  PinnedPoolStats st;
  st.budget_bytes = s.opt.budget_bytes;
  st.requested_bytes = s.requested;
  st.allocated_bytes = s.allocated;
  st.reserved_bytes = s.reserved;
  st.peak_reserved_bytes = s.peak;
  st.num_blocks = s.blocks;
  st.num_chunks = s.chunks.size();
  for (const auto& c : s.chunks) {
    if (c->kind != PageKind::kNormal) st.huge_chunks += 1;
    if (c->pinned) st.locked_bytes += c->committed;
  }
  return st;
}

std::size_t PinnedPool::trim() {
  auto& s = *state_;
  std::lock_guard<std::mutex> lock(s.mu);
  return s.release_empty_chunks();
}

const PinnedPoolOptions& PinnedPool::options() const noexcept { return state_->opt; }

}  // namespace strata
