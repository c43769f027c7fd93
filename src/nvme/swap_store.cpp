// The swap store: tensors kept in preallocated files on one or more NVMe paths.
//
// Owns: under each path, <path>/strata-swap/rank<N>/stripe.bin (one file per path) and a
// lock file <path>/strata-swap/rank<N>.lock held with flock for the store's lifetime.
// Layout: one logical address space striped across the files in block_size stripes
// (stripe s lives in file s % F at file offset (s / F) * block_size); each key owns a
// 4 KiB-aligned extent of it, handed out by a bump allocator (training state is reserved
// once and reused every step, so extents are never freed individually).
// Invariants:
//  - Files only grow after statvfs says the bytes are there; growth is fallocate, so a
//    later write cannot hit ENOSPC for lack of blocks (it can still fail for other reasons,
//    and then reports the file and offset).
//  - Every request the store issues is 4 KiB-aligned and within one stripe.
//  - With verify on, each stripe piece's xxh3 is recorded when its write completes and
//    checked when a read completes.
//  - A clean exit deletes the files; a new run deletes a previous run's leftovers of its rank, and
//    rank 0 those of dead ranks beyond the job's (SwapStoreOptions::world_size). The lock file
//    holds "host pid" of its owner.
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <unordered_map>

#include "core/interrupt_files.h"
#include "core/process.h"
#include "core/signal_slots.h"
#include "strata/error.h"
#include "strata/log.h"
#include "strata/nvme.h"

namespace strata {

namespace fs = std::filesystem;

namespace {
constexpr std::size_t kPage = 4096;
// The blocks a rank's store takes beside its swap files (strata-swap/, its rank folder, the lock
// file), with room to spare: counted off the free space it plans with.
constexpr std::uint64_t kStoreOverheadBytes = 16 * kPage;

// A flag (strata-prof's --nvme-path) or a config key, as the messages name it.
std::string key_name(const std::string& config_key) {
  return config_key.rfind("--", 0) == 0 ? config_key : fmt::format("config key '{}'", config_key);
}

// The swap files' directory must take writes: refused when planning as when the run starts.
void require_writable(const std::string& key, const std::string& p) {
  struct statvfs sv {};
  const bool ro = ::statvfs(p.c_str(), &sv) == 0 && (sv.f_flag & ST_RDONLY);
  STRATA_REQUIRE(!ro,
                 "{} = '{}' is on a read-only file system; strata needs to write swap files "
                 "there: choose a writable directory",
                 key, p);
  STRATA_REQUIRE(::access(p.c_str(), W_OK) == 0,
                 "{} = '{}' cannot be written by this user ({}); strata needs to write swap files "
                 "there: choose a directory it may write, or change its permissions",
                 key, p, std::strerror(errno));
}

// The swap files of the live stores, for remove_swap_files_on_interrupt() (the handler only calls
// unlink and rmdir, which are async-signal-safe). A file whose path does not fit is left to the
// next run's clean-up.
constexpr std::size_t kSwapPathMax = 4096;
core::SignalSlots<128, kSwapPathMax> g_swap_files;

// The strata-swap directories (and ranks) this process's stores hold.
struct HeldDir {
  dev_t dev;
  ino_t ino;
  int rank;
  std::string key;
  const void* owner;
};
std::mutex g_held_mu;
std::vector<HeldDir> g_held;

// set_interrupt_note's text: written into the buffer not being shown, then made the shown one.
constexpr std::size_t kNoteMax = 1024;
char g_notes[2][kNoteMax];
std::atomic<int> g_note{-1};

// Async-signal-safe only (unlink, rmdir, the string functions POSIX lists).
void remove_published_swap_files() noexcept {
  g_swap_files.for_each_published([](const char* path, auto) {
    ::unlink(path);
    // And what the store made around it, as a clean exit removes it: <top>/rank<N>/ (now empty),
    // <top>/rank<N>.lock, then <top> itself if no other rank's files are in it.
    char dir[kSwapPathMax];
    std::strcpy(dir, path);
    char* cut = std::strrchr(dir, '/');
    if (cut == nullptr) return true;
    *cut = '\0';
    ::rmdir(dir);
    const std::size_t n = std::strlen(dir);
    if (n + sizeof(".lock") <= sizeof dir) {
      std::memcpy(dir + n, ".lock", sizeof(".lock"));
      ::unlink(dir);
      dir[n] = '\0';
    }
    if ((cut = std::strrchr(dir, '/')) != nullptr) {
      *cut = '\0';
      ::rmdir(dir);
    }
    return true;
  });
}

// Async-signal-safe only (write, and the above).
extern "C" void remove_swap_files_and_reraise(int sig) {
  if (const int i = g_note.load(); i >= 0 && g_notes[i][0] != '\0')
    (void)!::write(2, g_notes[i], std::strlen(g_notes[i]));
  remove_published_swap_files();
  core::remove_interrupt_files();  // and the temporary files being written (a prepared corpus)
  ::signal(sig, SIG_DFL);
  ::raise(sig);
}

// The bytes of the regular files under `dir`.
std::uint64_t bytes_under(const fs::path& dir) {
  std::uint64_t total = 0;
  std::error_code ec;
  for (fs::recursive_directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    struct stat fst {};
    if (::lstat(it->path().c_str(), &fst) == 0 && S_ISREG(fst.st_mode))
      total += std::uint64_t(fst.st_blocks) * 512;
  }
  return total;
}

// The swap folders under `top` (a strata-swap/) of ranks >= world_size that are dead: a lock file
// no process holds, naming a process of this host that is gone (what a rank killed with SIGKILL,
// or a job that ended on MPI_Abort, leaves). Returns their bytes; with `remove`, deletes each
// (under its lock, so no new run takes it meanwhile) and says so.
std::uint64_t dead_ranks_files(const fs::path& top, int world_size, bool remove) {
  std::uint64_t total = 0;
  std::error_code ec;
  for (fs::directory_iterator it(top, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    int r = -1;
    if (std::sscanf(name.c_str(), "rank%d.lock", &r) != 1 || r < world_size ||
        name != fmt::format("rank{}.lock", r))
      continue;
    const int fd = ::open(it->path().c_str(), O_RDWR | O_CLOEXEC);
    if (fd < 0) continue;
    char buf[320] = {};
    const ssize_t n =
        ::flock(fd, LOCK_EX | LOCK_NB) == 0 ? ::pread(fd, buf, sizeof buf - 1, 0) : -1;
    char host[256] = {};
    long pid = 0;
    if (n > 0 && std::sscanf(buf, "%255s %ld", host, &pid) == 2 && this_host() == host &&
        process_gone(pid)) {
      const fs::path dir = top / fmt::format("rank{}", r);
      const std::uint64_t bytes = bytes_under(dir);
      total += bytes;
      if (remove) {
        std::error_code e2;
        fs::remove_all(dir, e2);
        fs::remove(it->path(), e2);
        log::info("removed {} of swap files in '{}': rank {} of a run that died (pid {}) left them",
                  log::human_bytes(double(bytes)), dir.string(), r, pid);
      }
    }
    ::close(fd);
  }
  return total;
}

}  // namespace

struct SwapStore::Impl {
  struct File {
    std::string path;
    int fd = -1;
    std::size_t size = 0;
    int slot = -1;  // its g_swap_files slot
  };
  struct Extent {
    std::uint64_t offset = 0;  // logical
    std::size_t bytes = 0;     // padded
    bool written = false;
    std::size_t written_bytes = 0;    // padded length of the last write
    std::vector<std::uint64_t> sums;  // one per stripe piece
    std::string tag;                  // "swap key 'K'", for messages
  };

  SwapStoreOptions opt;
  std::unique_ptr<IoEngine> own_engine;
  IoEngine* engine = nullptr;
  std::vector<File> files;
  std::vector<std::string> dirs, locks;
  std::vector<int> lock_fds;
  bool direct = false;
  std::size_t stripe = 0;

  mutable std::mutex mu;
  std::uint64_t logical_end = 0;
  std::unordered_map<std::string, Extent> extents;
  std::vector<IoHandle> pending;
  std::uint64_t bytes_written = 0, bytes_read = 0;

  // Logical [off, off + n) as per-stripe pieces.
  template <class Fn>
  void for_pieces(std::uint64_t off, std::size_t n, Fn fn) const {
    const std::size_t F = files.size();
    std::size_t done = 0;
    while (done < n) {
      const std::uint64_t l = off + done;
      const std::uint64_t s = l / stripe;
      const std::size_t in = std::size_t(l % stripe);
      const std::size_t len = std::min(n - done, stripe - in);
      fn(files[s % F], (s / F) * stripe + in, done, len);
      done += len;
    }
  }

  // Grows the files to hold logical [0, end), after checking free space.
  void ensure_capacity(std::uint64_t end) {
    const std::size_t F = files.size();
    const std::uint64_t stripes = (end + stripe - 1) / stripe;
    std::vector<std::size_t> want(F);
    for (std::size_t f = 0; f < F; ++f) want[f] = std::size_t((stripes + F - 1 - f) / F) * stripe;
    // Every file system's free space against all its files' growth, before any grows.
    std::vector<std::pair<dev_t, std::size_t>> need_on;  // file system -> bytes to add
    for (std::size_t f = 0; f < F; ++f) {
      if (want[f] <= files[f].size) continue;
      struct stat st {};
      STRATA_CHECK_ERRNO(::fstat(files[f].fd, &st), "fstat of '{}'", files[f].path);
      auto it = std::find_if(need_on.begin(), need_on.end(),
                             [&](const auto& p) { return p.first == st.st_dev; });
      if (it == need_on.end()) it = need_on.insert(need_on.end(), {st.st_dev, 0});
      it->second += want[f] - files[f].size;
      struct statvfs sv {};
      STRATA_CHECK_ERRNO(::statvfs(files[f].path.c_str(), &sv), "statvfs of '{}'", files[f].path);
      const double avail = double(sv.f_bavail) * double(sv.f_frsize);
      if (double(it->second) > avail)
        STRATA_THROW(kIo,
                     "the swap store needs {} more bytes ({}) on the file system of '{}' but only "
                     "{} bytes ({}) are "
                     "free there; free space, offload less to NVMe, or list directories on other "
                     "drives in {}",
                     it->second, log::human_bytes(double(it->second)), files[f].path,
                     std::uint64_t(avail), log::human_bytes(avail), opt.config_key);
    }
    // Grown in turn; a failure takes back what this call grew, so a refused reserve holds nothing.
    std::vector<std::size_t> before(F);
    for (std::size_t f = 0; f < F; ++f) before[f] = files[f].size;
    try {
      for (std::size_t f = 0; f < F; ++f) {
        if (want[f] <= files[f].size) continue;
        const std::size_t need = want[f] - files[f].size;
        if (::fallocate(files[f].fd, 0, off_t(files[f].size), off_t(need)) != 0) {
          const int err = errno;
          if (err == EOPNOTSUPP) {
            // Some file systems (tmpfs before 3.5, some FUSE) cannot fallocate: extend instead.
            STRATA_CHECK_ERRNO(::ftruncate(files[f].fd, off_t(want[f])), "ftruncate '{}'",
                               files[f].path);
          } else {
            detail::throw_errno(
                __FILE__, __LINE__, "fallocate", err,
                fmt::format("cannot preallocate {} bytes in '{}'{}", need, files[f].path,
                            err == ENOSPC ? ": the disk is full" : ""));
          }
        }
        files[f].size = want[f];
      }
    } catch (...) {
      // Every file this call tried to grow, not only those it finished: a failed fallocate can
      // keep what it allocated (ext4 extends the file up to the ENOSPC) with files[f].size unset.
      for (std::size_t f = 0; f < F; ++f)
        if (want[f] > before[f] && ::ftruncate(files[f].fd, off_t(before[f])) == 0)
          files[f].size = before[f];
      throw;
    }
  }

  // Also what a constructor that throws half-way leaves: every lock, fd and folder taken so far.
  ~Impl() {
    {
      std::lock_guard<std::mutex> g(g_held_mu);
      std::erase_if(g_held, [this](const HeldDir& h) { return h.owner == this; });
    }
    for (auto& h : pending) {
      try {
        h.wait();
      } catch (const std::exception&) {
        // Already reported to whoever waited on it; the files go away regardless.
      }
    }
    if (engine && !own_engine && !files.empty()) {  // a shared engine must not keep our fds' files
      std::vector<int> fds;
      for (const auto& f : files) fds.push_back(f.fd);
      try {
        engine->unregister_files(fds);
      } catch (const std::exception& e) {  // a destructor: say it, close the files regardless
        log::warn("swap store: cannot unregister its files from the I/O engine: {}", e.what());
      }
    }
    own_engine.reset();
    std::error_code ec;
    for (auto& f : files) {
      g_swap_files.unpublish(f.slot);
      ::close(f.fd);
      fs::remove(f.path, ec);
    }
    for (auto& d : dirs) fs::remove_all(d, ec);
    for (std::size_t i = 0; i < lock_fds.size(); ++i) {
      fs::remove(locks[i], ec);
      ::close(lock_fds[i]);
      const fs::path top = fs::path(locks[i]).parent_path();
      if (fs::is_empty(top, ec)) fs::remove(top, ec);
    }
  }

  void prune_pending() {
    std::erase_if(pending, [](const IoHandle& h) { return h.done(); });
  }
};

std::mutex g_note_mu;  // writers only: the handler never takes it

void set_interrupt_note(std::string_view text) noexcept {
  std::lock_guard<std::mutex> lock(g_note_mu);
  const int next = g_note.load() == 0 ? 1 : 0;
  const std::size_t n = std::min(text.size(), kNoteMax - 1);
  std::memcpy(g_notes[next], text.data(), n);
  if (n < text.size()) g_notes[next][n - 1] = '\n';  // cut: still a line
  g_notes[next][n] = '\0';
  g_note.store(next);
}

void remove_swap_files_now() noexcept {
  remove_published_swap_files();
  core::remove_interrupt_files();
}

void remove_swap_files_on_interrupt() {
  // Ctrl-C, a scheduler's stop, a closed terminal, a bus error (a mapped data file cut short
  // under the run, which the data loader names first), and a console pipe closed by its reader
  // (`strata-train | head`).
  for (const int sig : {SIGINT, SIGTERM, SIGHUP, SIGBUS, SIGPIPE}) {
    struct sigaction old {};
    if (::sigaction(sig, nullptr, &old) != 0 || old.sa_handler != SIG_DFL ||
        (old.sa_flags & SA_SIGINFO))
      continue;
    struct sigaction sa {};
    sa.sa_handler = remove_swap_files_and_reraise;
    sigemptyset(&sa.sa_mask);
    ::sigaction(sig, &sa, nullptr);
  }
}

std::size_t SwapStore::padded_bytes(std::size_t bytes) {
  return (bytes + kPage - 1) / kPage * kPage;
}

std::uint64_t SwapStore::free_bytes(const std::vector<std::string>& paths, int rank,
                                    const std::string& config_key, int ranks_sharing,
                                    int world_size) {
  STRATA_REQUIRE(ranks_sharing >= 1, "SwapStore::free_bytes: ranks_sharing {} must be >= 1",
                 ranks_sharing);
  std::uint64_t total = 0;
  std::vector<dev_t> seen;
  for (const std::string& p : paths) {
    struct stat st {};
    STRATA_REQUIRE(::stat(p.c_str(), &st) == 0 && S_ISDIR(st.st_mode),
                   "{} = '{}': not an existing directory; create it, or point {} at an existing "
                   "directory on the NVMe drive",
                   key_name(config_key), p, config_key);
    require_writable(key_name(config_key), p);
    // A previous run's files of this rank: removed when the store starts, so they count as free.
    const fs::path top = fs::path(p) / "strata-swap";
    total += bytes_under(top / fmt::format("rank{}", rank));
    // And a dead run's ranks beyond this job's: rank 0's store removes them, for every rank.
    const std::uint64_t dead = world_size > 0 ? dead_ranks_files(top, world_size, false) : 0;
    if (std::find(seen.begin(), seen.end(), st.st_dev) != seen.end()) continue;
    seen.push_back(st.st_dev);
    struct statvfs sv {};
    STRATA_CHECK_ERRNO(::statvfs(p.c_str(), &sv), "statvfs of '{}' ({})", p, key_name(config_key));
    // Less the store's own folders and lock file, a few blocks a rank: a drive whose free space
    // was the swap files' bytes exactly planned as fitting, and the run then could not place its
    // last stripe.
    const std::uint64_t share = (std::uint64_t(sv.f_bavail) * std::uint64_t(sv.f_frsize) + dead) /
                                std::uint64_t(ranks_sharing);
    total += share > kStoreOverheadBytes ? share - kStoreOverheadBytes : 0;
  }
  return total;
}

SwapStore::SwapStore(const SwapStoreOptions& opts, IoEngine* engine)
    : impl_(std::make_unique<Impl>()) {
  Impl& s = *impl_;
  s.opt = opts;
  const std::string key = key_name(opts.config_key);
  STRATA_REQUIRE(!opts.paths.empty(),
                 "{} is missing: give the directory (on the NVMe drive) "
                 "where strata may keep swap files",
                 key);
  STRATA_REQUIRE(opts.rank >= 0, "SwapStore rank {} must be >= 0", opts.rank);
  s.stripe = opts.aio.block_size;
  STRATA_REQUIRE(s.stripe >= kPage && (s.stripe & (s.stripe - 1)) == 0,
                 "aio.block_size = {}: must be a power of two >= 4096", s.stripe);
  if (engine) {
    s.engine = engine;
  } else {
    s.own_engine = make_io_engine(opts.aio);
    s.engine = s.own_engine.get();
  }
  for (const std::string& p : opts.paths) {
    std::error_code ec;
    STRATA_REQUIRE(fs::exists(p, ec),
                   "{} = '{}': the directory does not exist; create it, or "
                   "point {} at an existing directory on the NVMe drive",
                   key, p, opts.config_key);
    STRATA_REQUIRE(fs::is_directory(p, ec), "{} = '{}' is not a directory", key, p);
    require_writable(key, p);
    const fs::path top = fs::path(p) / "strata-swap";
    fs::create_directories(top, ec);
    STRATA_REQUIRE(!ec, "{} = '{}': cannot create '{}': {}", key, p, top.string(), ec.message());
    const std::string lock = (top / fmt::format("rank{}.lock", opts.rank)).string();
    // A store of this process (another key's list, or this list twice) on the same directory
    // would share rank<N>/ and remove the other's files: refused, naming both.
    {
      std::lock_guard<std::mutex> g(g_held_mu);
      struct stat tst {};
      // `p`, not strata-swap/ under it: a closing run may remove (and another recreate) that.
      STRATA_CHECK_ERRNO(::stat(p.c_str(), &tst), "stat of '{}'", p);
      for (const HeldDir& h : g_held) {
        if (h.owner == &s)  // this store's own list names it twice ("/x" and "/x/", or a link)
          STRATA_REQUIRE(!(h.dev == tst.st_dev && h.ino == tst.st_ino),
                         "{} names the directory '{}' twice (or "
                         "two names of one directory): list each directory once",
                         key, p);
        STRATA_REQUIRE(
            !(h.dev == tst.st_dev && h.ino == tst.st_ino && h.rank == opts.rank),
            "{} = '{}': that directory is already used by this process's swap store of {} "
            "(rank {}); give both the same list of directories or lists with none in common",
            key, p, key_name(h.key), opts.rank);
      }
      g_held.push_back({tst.st_dev, tst.st_ino, opts.rank, opts.config_key, &s});
    }
    // The lock must be on the file now at `lock`: a run that is closing unlinks its lock file
    // (and then removes strata-swap/ if it is empty), and a lock taken on the unlinked file
    // would let this run and the next both own rank<N>/.
    int lfd = -1;
    for (int tries = 0;; ++tries) {
      fs::create_directories(top, ec);
      lfd = ::open(lock.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
      if (lfd < 0 && errno == ENOENT && tries < 100)
        continue;  // strata-swap/ removed by a closing run
      STRATA_CHECK_ERRNO(lfd, "cannot create the lock file '{}'", lock);
      if (::flock(lfd, LOCK_EX | LOCK_NB) != 0) {
        ::close(lfd);
        STRATA_THROW(kInvalidArgument,
                     "'{}' is in use by another running strata process (rank {}); give each "
                     "run its own {}",
                     top.string(), opts.rank, opts.config_key);
      }
      struct stat locked {
      }, now{};
      if (::fstat(lfd, &locked) == 0 && ::stat(lock.c_str(), &now) == 0 &&
          locked.st_dev == now.st_dev && locked.st_ino == now.st_ino)
        break;
      ::close(lfd);  // the closing run's unlinked file: take the new one
    }
    s.lock_fds.push_back(lfd);
    s.locks.push_back(lock);
    // Whose it is, for a later run to tell a dead rank's files (dead_ranks_files) from a live
    // one's.
    const std::string owner = fmt::format("{} {}\n", this_host(), ::getpid());
    if (::ftruncate(lfd, 0) != 0 ||
        ::pwrite(lfd, owner.data(), owner.size(), 0) != ssize_t(owner.size()))
      log::warn("swap store: cannot write the owner into '{}': {}", lock, std::strerror(errno));
    if (opts.rank == 0 && opts.world_size > 0) dead_ranks_files(top, opts.world_size, true);
    const fs::path dir = top / fmt::format("rank{}", opts.rank);
    if (fs::exists(dir, ec)) {
      if (!fs::is_empty(dir, ec))
        log::info("removing swap files of a previous run in '{}'", dir.string());
      fs::remove_all(dir, ec);
      STRATA_REQUIRE(!ec, "cannot remove the previous run's swap files in '{}': {}", dir.string(),
                     ec.message());
    }
    fs::create_directories(dir, ec);
    STRATA_REQUIRE(!ec, "cannot create '{}': {}", dir.string(), ec.message());
    s.dirs.push_back(dir.string());
    Impl::File f;
    f.path = (dir / "stripe.bin").string();
    bool direct = false;
    f.fd = open_for_io(f.path, O_RDWR | O_CREAT | O_TRUNC, opts.aio.direct, &direct);
    f.slot = g_swap_files.publish(f.path);
    s.direct = s.files.empty() ? direct : (s.direct && direct);
    s.files.push_back(f);
  }
  std::vector<int> fds;
  for (auto& f : s.files) fds.push_back(f.fd);
  s.engine->register_files(fds);
}

SwapStore::~SwapStore() = default;  // Impl::~Impl

// SwapStore::reserve with `s.mu` held.
static void reserve_locked(SwapStore::Impl& s, const std::string& key, std::size_t bytes) {
  STRATA_REQUIRE(bytes > 0, "swap key '{}': cannot reserve 0 bytes", key);
  STRATA_REQUIRE(!s.extents.count(key), "swap key '{}' is already reserved", key);
  const std::size_t padded = SwapStore::padded_bytes(bytes);
  s.ensure_capacity(s.logical_end + padded);
  SwapStore::Impl::Extent e;
  e.offset = s.logical_end;
  e.bytes = padded;
  std::size_t pieces = 0;
  s.for_pieces(e.offset, e.bytes, [&](auto&, auto, auto, auto) { ++pieces; });
  e.sums.assign(pieces, 0);
  s.extents.emplace(key, std::move(e));
  s.logical_end += padded;
}

void SwapStore::reserve(const std::string& key, std::size_t bytes) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  reserve_locked(*impl_, key, bytes);
}

bool SwapStore::contains(const std::string& key) const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->extents.count(key) != 0;
}

static IoHandle transfer(SwapStore::Impl& s, IoOp op, const std::string& key, void* buf,
                         std::size_t bytes) {
  STRATA_REQUIRE(buf != nullptr, "swap key '{}': null buffer", key);
  STRATA_REQUIRE(reinterpret_cast<std::uintptr_t>(buf) % kPage == 0,
                 "swap key '{}': buffer {} is not 4096-aligned; use pinned pool memory", key, buf);
  std::vector<IoRequest> reqs;
  std::lock_guard<std::mutex> lock(s.mu);
  auto it = s.extents.find(key);
  STRATA_REQUIRE(it != s.extents.end(), "swap key '{}' was never reserved or written", key);
  auto& e = it->second;
  const std::size_t padded = SwapStore::padded_bytes(bytes);
  STRATA_REQUIRE(padded <= e.bytes, "swap key '{}': {} bytes do not fit its {}-byte extent", key,
                 bytes, e.bytes);
  STRATA_REQUIRE(op == IoOp::kWrite || e.written,
                 "swap key '{}' was reserved but never written; write it first", key);
  const bool verify = s.opt.aio.verify;
  // A read covers what was written: beyond it the bytes are not this key's; and with verify on,
  // exactly it (each stripe piece's checksum is of the piece as written).
  STRATA_REQUIRE(op == IoOp::kWrite || padded <= e.written_bytes,
                 "swap key '{}': reading {} bytes, but its last write was {} bytes", key, padded,
                 e.written_bytes);
  STRATA_REQUIRE(op == IoOp::kWrite || !verify || padded == e.written_bytes,
                 "swap key '{}': reading {} of its {} written bytes; with aio.verify on a read "
                 "must take the whole "
                 "write (the checksums are of what was written)",
                 key, padded, e.written_bytes);
  e.tag = fmt::format("swap key '{}'", key);
  std::size_t piece = 0;
  s.for_pieces(
      e.offset, padded,
      [&](const SwapStore::Impl::File& f, std::uint64_t foff, std::size_t done, std::size_t len) {
        IoRequest r;
        r.op = op;
        r.fd = f.fd;
        r.offset = foff;
        r.buf = static_cast<char*>(buf) + done;
        r.bytes = len;
        r.path = &f.path;
        r.tag = &e.tag;
        if (verify) {
          r.checksum = &e.sums[piece];
          r.verify = op == IoOp::kRead;
        }
        ++piece;
        reqs.push_back(r);
      });
  if (op == IoOp::kWrite) {
    e.written = true;
    e.written_bytes = padded;
    s.bytes_written += padded;
  } else {
    s.bytes_read += padded;
  }
  IoHandle h = s.engine->submit(reqs);
  s.prune_pending();
  s.pending.push_back(h);
  return h;
}

IoHandle SwapStore::write(const std::string& key, const void* buf, std::size_t bytes) {
  {
    // Reserved here when new, under one lock: two threads writing a new key at once took it
    // for absent both, and the second failed "already reserved".
    std::lock_guard<std::mutex> lock(impl_->mu);
    if (!impl_->extents.count(key)) reserve_locked(*impl_, key, bytes);
  }
  return transfer(*impl_, IoOp::kWrite, key, const_cast<void*>(buf), bytes);
}

IoHandle SwapStore::read(const std::string& key, void* buf, std::size_t bytes) {
  return transfer(*impl_, IoOp::kRead, key, buf, bytes);
}

SwapStoreStats SwapStore::stats() const {
  const Impl& s = *impl_;
  std::lock_guard<std::mutex> lock(s.mu);
  SwapStoreStats st;
  st.reserved_bytes = s.logical_end;
  for (auto& f : s.files) st.file_bytes += f.size;
  st.bytes_written = s.bytes_written;
  st.bytes_read = s.bytes_read;
  st.direct = s.direct;
  return st;
}

std::vector<std::string> SwapStore::files() const {
  std::vector<std::string> out;
  for (auto& f : impl_->files) out.push_back(f.path);
  return out;
}

IoEngine& SwapStore::engine() { return *impl_->engine; }

}  // namespace strata
