// strata-bench nvme: sequential write then read through strata's I/O engine, from pinned
// pool buffers, against fio with the equivalent job on the same file in the same run.
// --sweep tries block size x queue depth x threads x buffer kind within a time bound and
// writes the best "aio" block as JSON.
#include <fcntl.h>
#include <limits.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/statvfs.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <thread>
#include <tuple>
#include <vector>

#include "bench_common.h"
#include "strata/error.h"
#include "strata/log.h"
#include "strata/nvme.h"
#include "strata/paths.h"
#include "strata/pinned_pool.h"
#include "strata/system_info.h"
#include "tool_main.h"

namespace strata::bench {
// This command's own names: the benchmarks compile as one file (tools/CMakeLists.txt).
namespace nvme_cmd {
namespace {

namespace fs = std::filesystem;

struct NvmeArgs {
  std::string path = ".";
  std::string size = "4G";
  std::string block_size = "1M";
  int queue_depth = 32;
  int threads = 1;
  std::string buffers = "both";  // huge | normal | same | both (huge, normal) | all
  std::string engine = "auto";
  bool vs_fio = false;
  bool verify = false;
  bool no_register = false;
  bool sweep = false;
  double sweep_seconds = 60;
  std::string out;
  bool overwrite = false;
  bool json = false;
  int reserve_hugepages = 0;
  int repeat = 3;
};

// A SIGINT, SIGTERM or SIGHUP (Ctrl-C, a job's time limit, a closed terminal) must leave no
// more behind than any other end of the run: the benchmark's file removed, vm.nr_hugepages put
// back. The handler does only async-signal-safe work (unlink, open, write, close, sigaction,
// raise) on text formatted before it can need it, then ends the process by the same signal,
// so the shell still sees 130 / 143 / 129. What it undoes is registered before it is done and stays
// registered until the handlers go: an unlink of a file already removed, or a write of the value
// already there, costs nothing.
constexpr int kCleanupSignals[] = {SIGINT, SIGTERM, SIGHUP};
constexpr int kMaxCleanupFiles = 4;
// Written by the main thread, each entry before it is published through its count; read by
// the handler on whichever thread the signal lands.
struct SignalCleanupState {
  char paths[kMaxCleanupFiles][PATH_MAX];
  std::atomic<int> files{0};
  char hugepages[24];
  std::size_t hugepages_len = 0;
  std::atomic<bool> hugepages_set{false};
  std::atomic<pid_t> child{
      0};  // fio, while it runs: killed first (it would write on, or lay the file out again)
};
static_assert(std::atomic<int>::is_always_lock_free && std::atomic<bool>::is_always_lock_free &&
                  std::atomic<pid_t>::is_always_lock_free,
              "read in a signal handler");
SignalCleanupState g_cleanup;

void cleanup_and_die(int sig) {
  if (const pid_t c = g_cleanup.child.load(); c > 0) ::kill(c, SIGKILL);
  const int n = g_cleanup.files.load();
  for (int i = 0; i < n; ++i) ::unlink(g_cleanup.paths[i]);
  if (g_cleanup.hugepages_set.load()) {
    const int fd = ::open("/proc/sys/vm/nr_hugepages", O_WRONLY);
    if (fd >= 0) {
      const ssize_t unused =
          ::write(fd, g_cleanup.hugepages, g_cleanup.hugepages_len);  // refused: nothing more to do
      (void)unused;
      ::close(fd);
    }
  }
  struct sigaction dfl {};
  dfl.sa_handler = SIG_DFL;
  sigemptyset(&dfl.sa_mask);
  ::sigaction(sig, &dfl, nullptr);
  ::raise(sig);  // delivered, with the default action, when this handler returns
}

class SignalCleanup {
 public:
  SignalCleanup() {
    struct sigaction sa {};
    sa.sa_handler = cleanup_and_die;
    sigemptyset(&sa.sa_mask);
    for (int s : kCleanupSignals) sigaddset(&sa.sa_mask, s);  // one cleanup at a time per thread
    for (std::size_t i = 0; i < std::size(kCleanupSignals); ++i) {
      ::sigaction(kCleanupSignals[i], nullptr, &previous_[i]);
      // An ignored signal stays ignored (a background job of a script: Ctrl-C is not for it).
      if (previous_[i].sa_handler != SIG_IGN) ::sigaction(kCleanupSignals[i], &sa, nullptr);
    }
  }
  ~SignalCleanup() {
    for (std::size_t i = 0; i < std::size(kCleanupSignals); ++i)
      ::sigaction(kCleanupSignals[i], &previous_[i], nullptr);
    g_cleanup.files.store(0);
    g_cleanup.hugepages_set.store(false);
  }
  SignalCleanup(const SignalCleanup&) = delete;
  SignalCleanup& operator=(const SignalCleanup&) = delete;

  // As the file is created (claim_file_with_space), or before.
  static void remove_file(const std::string& path) {
    const int n = g_cleanup.files.load();
    STRATA_CHECK(n < kMaxCleanupFiles,
                 "strata-bench nvme: more than {} files to remove on a signal", kMaxCleanupFiles);
    STRATA_REQUIRE(path.size() < sizeof g_cleanup.paths[n], "--path: {} is longer than PATH_MAX",
                   path);
    std::memcpy(g_cleanup.paths[n], path.c_str(), path.size() + 1);
    g_cleanup.files.store(n + 1);
  }
  // Before vm.nr_hugepages is changed.
  static void restore_hugepages(int pages) {
    const std::string text = std::to_string(pages) + "\n";
    std::memcpy(g_cleanup.hugepages, text.c_str(), text.size());
    g_cleanup.hugepages_len = text.size();
    g_cleanup.hugepages_set.store(true);
  }

 private:
  struct sigaction previous_[std::size(kCleanupSignals)]{};
};

// Sets /proc/sys/vm/nr_hugepages for the benchmark's lifetime (root), restoring it after. One
// run at a time on a host (a lock in /run/lock): two overlapping runs each put back what they
// found, and the second's "before" was the first's reservation, left reserved for good.
class HugepageReservation {
 public:
  explicit HugepageReservation(int pages) {
    if (pages <= 0) return;
    // Every page reserved is taken from the rest of the machine for the run: more than memory
    // can spare is refused, not left to the kernel to squeeze out (one run needs ~2 buffers).
    // Only the pages above those already reserved are taken (those are out of MemAvailable).
    // (Checked before the lock: a count refused takes no lock.)
    std::ifstream("/proc/sys/vm/nr_hugepages") >> before_;
    const std::uint64_t page =
        std::max<std::uint64_t>(cpu::huge_page_info().hugetlb_page_bytes, 2u << 20);
    const std::uint64_t extra = std::uint64_t(std::max(0, pages - before_)) * page;
    const std::uint64_t avail = cpu::mem_available_bytes();
    STRATA_REQUIRE(
        avail == 0 || extra <= avail / 2,
        "--reserve-hugepages {}: {} more in huge pages, and {} is available; a run needs about 2 x "
        "block x queue depth x threads (32 pages of 2 MiB for the defaults): lower it",
        pages, human_bytes(double(extra)), human_bytes(double(avail)));
    // STRATA_TEST_HUGEPAGES_LOCK: another lock file (tests, which run side by side).
    const char* test_lock = std::getenv("STRATA_TEST_HUGEPAGES_LOCK");
    const std::string lock_path = test_lock && *test_lock
                                      ? std::string(test_lock)
                                      : std::string("/run/lock/strata-bench-hugepages.lock");
    lock_ = ::open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    STRATA_REQUIRE(
        lock_ < 0 || strata::lock_unless_held(lock_),
        "--reserve-hugepages {}: another strata-bench run on this host holds a huge-page "
        "reservation ({}); run them one at a time, or reserve the pages beforehand "
        "(sysctl vm.nr_hugepages=N) and drop --reserve-hugepages",
        pages, lock_path);
    std::ifstream("/proc/sys/vm/nr_hugepages") >> before_;  // (under the lock: what to put back)
    SignalCleanup::restore_hugepages(before_);
    std::ofstream("/proc/sys/vm/nr_hugepages") << std::max(pages, before_);
    int now = 0;
    std::ifstream("/proc/sys/vm/nr_hugepages") >> now;
    active_ = true;
    if (now < pages)
      log::warn("asked for {} hugetlbfs pages, the kernel gave {} (needs root and free memory)",
                pages, now);
  }
  ~HugepageReservation() {
    if (active_) std::ofstream("/proc/sys/vm/nr_hugepages") << before_;
    if (lock_ >= 0) ::close(lock_);  // (after: the next run finds the setting put back)
  }

 private:
  int before_ = 0;
  bool active_ = false;
  int lock_ = -1;
};

// The benchmark's file, removed however the run ends (a failed run left gigabytes behind; a
// signal's end is SignalCleanup's).
struct RemovedAtExit {
  std::string path;
  ~RemovedAtExit() {
    std::error_code ec;
    fs::remove(path, ec);
  }
};

// Refuses a run whose file would not fit on the drive (before writing any of it), then makes the
// file, empty. The benchmark's file is removed and replaced: one already there is refused, not
// deleted (a user's file of that name, or another run's file in use by it); made atomically
// (O_EXCL): two runs started at one instant both saw no file, and each removed and wrote the
// other's. Made and registered for removal on a signal (SignalCleanup) with the signals held back
// on this thread in between: a Ctrl-C landing between the two left the file (a run preempted
// there under load). The caller removes it at exit (RemovedAtExit).
void claim_file_with_space(const std::string& dir, const std::string& file, std::size_t size) {
  struct statvfs sv {};
  STRATA_REQUIRE(::statvfs(dir.c_str(), &sv) == 0, "--path {}: cannot read its free space", dir);
  const std::uint64_t free = std::uint64_t(sv.f_bavail) * sv.f_frsize;
  // (a file system that keeps no count, ramfs: no space to check against)
  STRATA_REQUIRE(
      sv.f_blocks == 0 || free >= size + (std::uint64_t(64) << 20),
      "--path {}: {} free, and the benchmark writes a {} file there (and keeps 64 MiB spare); "
      "free space, lower --size, or point --path at another drive",
      dir, human_bytes(double(free)), human_bytes(double(size)));
  struct HeldBack {
    sigset_t was{};
    HeldBack() {
      sigset_t hold;
      sigemptyset(&hold);
      for (int sig : kCleanupSignals) sigaddset(&hold, sig);
      ::pthread_sigmask(SIG_BLOCK, &hold, &was);
    }
    ~HeldBack() { ::pthread_sigmask(SIG_SETMASK, &was, nullptr); }  // (a pending one lands here)
  } held;
  const int made = ::open(file.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  STRATA_REQUIRE(
      made >= 0 || errno != EEXIST,
      "--path {}: {} already exists and the benchmark would replace and then remove it; remove it "
      "(a killed earlier run, or another run using it now, leaves it), or give another --path",
      dir, file);
  STRATA_CHECK_ERRNO(made, "--path {}: cannot create {}", dir, file);
  ::close(made);
  SignalCleanup::remove_file(file);
}

// Where a run's buffers come from. kSame: 4 KiB pages of one shared memory (a memfd) that our
// runs and fio (--mem=mmapshared:FILE) both map, so both read into the very same physical pages:
// with 4 KiB pages how a buffer lies in physical memory decides a virtio disk's read speed
// (physical_runs), and each side's own allocation (kNormal) is a draw from the kernel's free lists.
enum class Buffers { kHuge, kNormal, kSame };
const char* buffers_name(Buffers b) {
  return b == Buffers::kHuge ? "huge" : b == Buffers::kNormal ? "normal" : "same";
}

// The memory behind Buffers::kSame: a memfd (shmem pages, in no file system: nothing is left
// behind however the run ends), inherited by fio, which opens it as /proc/<our pid>/fd/<fd>.
struct SharedPages {
  int fd = -1;
  std::string path;  // what fio opens
  SharedPages() = default;
  SharedPages(const SharedPages&) = delete;
  SharedPages& operator=(const SharedPages&) = delete;
  ~SharedPages() {
    if (fd >= 0) ::close(fd);
  }
};

struct RunResult {
  double write_gbps = 0, read_gbps = 0;
  std::string page_kind;
  std::string engine;
  std::size_t pages = 0;      // 4 KiB pages of the buffer
  std::size_t phys_runs = 0;  // of them physically contiguous in address order; 0: not readable
  double verify_write_gbps = 0, verify_read_gbps = 0;  // with xxh3 checksums, the same buffer
};

// Over [addr, addr + bytes) of the process whose pagemap this is. With `stretch`, over the
// longest stretch of present pages instead, if it is `stretch` pages long or up to 64 more
// (fio's buffer in a mapping it may share with others, whose pages around it are mostly absent);
// 0 where there is none, or where a page is absent (without `stretch`).
std::size_t physical_runs_in(const char* pagemap, std::uintptr_t addr, std::size_t bytes,
                             std::size_t stretch = 0) {
  constexpr std::size_t kPage = 4096;
  const auto first = addr / kPage;
  const std::size_t n = (addr + bytes + kPage - 1) / kPage - first;
  const int fd = ::open(pagemap, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return 0;
  std::vector<std::uint64_t> e(n);
  const ssize_t got = ::pread(fd, e.data(), n * 8, off_t(first * 8));
  ::close(fd);
  if (got != ssize_t(n * 8)) return 0;
  constexpr std::uint64_t kPresent = std::uint64_t(1) << 63, kFrame = (std::uint64_t(1) << 55) - 1;
  std::size_t best_len = 0, best_runs = 0, len = 0, runs = 0;
  for (std::size_t i = 0; i < n; ++i) {
    if (!(e[i] & kPresent)) {
      if (!stretch) return 0;
      len = runs = 0;
      continue;
    }
    if ((e[i] & kFrame) == 0) return 0;  // frame numbers hidden (no CAP_SYS_ADMIN)
    if (len++ == 0 || (e[i] & kFrame) != (e[i - 1] & kFrame) + 1) ++runs;
    if (len > best_len) best_len = len, best_runs = runs;
  }
  if (!stretch) return runs;
  return best_len >= stretch && best_len <= stretch + 64 ? best_runs : 0;
}
// How many runs of physically consecutive, ascending 4 KiB pages make up [p, p + bytes): the
// scatter list a request from this memory becomes (a virtio disk takes each run as one
// segment, and with 4 KiB pages its reads slow down as the runs grow: see docs/nvme.md, "4 KiB
// pages: where they lie physically"). Frame numbers come from /proc/self/pagemap, which shows them
// only to CAP_SYS_ADMIN: 0 without it (or where a page is not present).
std::size_t physical_runs(const void* p, std::size_t bytes) {
  return physical_runs_in("/proc/self/pagemap", reinterpret_cast<std::uintptr_t>(p), bytes);
}

// The same of fio's own buffer (its default, malloc) in process `pid`: the stretch of present
// pages of its size in an anonymous read-write mapping (glibc maps a buffer this large on its
// own, but the kernel may merge that with a neighbour: up to 1 GiB more), once all its pages are
// there (fixed buffers are pinned when registered; others fault in with the first requests); 0
// while there is none, and for buffers under 1 MiB (taken from the heap, among others' pages).
std::size_t fio_buffer_runs(pid_t pid, std::size_t bytes) {
  if (bytes < (std::size_t(1) << 20)) return 0;
  std::ifstream maps(fmt::format("/proc/{}/maps", pid));
  const std::string pagemap = fmt::format("/proc/{}/pagemap", pid);
  for (std::string line; std::getline(maps, line);) {
    unsigned long lo = 0, hi = 0, inode = 0;
    char perms[8] = {};
    int path_at = 0;
    if (std::sscanf(line.c_str(), "%lx-%lx %7s %*s %*s %lu %n", &lo, &hi, perms, &inode, &path_at) <
        4)
      continue;
    if (perms[0] != 'r' || perms[1] != 'w' || inode != 0 || line.size() > std::size_t(path_at))
      continue;
    // A mapping far larger than the buffer is not one it was merged into (a reservation of
    // terabytes would be read page by page).
    if (hi - lo < bytes || hi - lo > bytes + (std::size_t(1) << 30)) continue;
    if (const std::size_t runs = physical_runs_in(pagemap.c_str(), lo, hi - lo, bytes / 4096))
      return runs;
  }
  return 0;
}

// One sequential write then read of `size` bytes with `cfg`, buffers of `kind`; with
// `also_verified`, a second write and read with xxh3 checksums from the same buffer, so the
// checksums' cost is measured on the same pages (with 4 KiB pages, how the buffer lies in
// physical memory moves reads by more than the checksums do: see physical_runs).
// The buffer of one run: the pinned pool's (huge or 4 KiB pages), or a mapping of the shared
// memory.
class RunBuffer {
 public:
  RunBuffer(Buffers kind, std::size_t bytes, const SharedPages* shared) : bytes_(bytes) {
    if (kind == Buffers::kSame) {
      void* m =
          ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, shared->fd, 0);
      if (m == MAP_FAILED)
        detail::throw_errno(__FILE__, __LINE__, "mmap", errno, "--buffers same: the shared pages");
      map_ = static_cast<char*>(m);
      page_kind_ = "shmem";
      return;
    }
    PinnedPoolOptions po;
    po.budget_bytes = bytes + (std::size_t(8) << 20);
    po.huge_pages = kind == Buffers::kHuge;
    po.chunk_bytes = bytes + (std::size_t(4) << 20);
    pool_ = std::make_unique<PinnedPool>(po);
    block_ = pool_->allocate(bytes);
    page_kind_ = page_kind_name(block_.page_kind());
  }
  ~RunBuffer() {
    if (map_) ::munmap(map_, bytes_);
  }
  RunBuffer(const RunBuffer&) = delete;
  RunBuffer& operator=(const RunBuffer&) = delete;
  char* data() { return map_ ? map_ : static_cast<char*>(block_.data()); }
  const char* page_kind() const { return page_kind_; }

 private:
  std::size_t bytes_;
  char* map_ = nullptr;
  std::unique_ptr<PinnedPool> pool_;
  PinnedBlock block_;
  const char* page_kind_ = "";
};

RunResult run_strata(const std::string& file, std::size_t size, const AioConfig& cfg, Buffers kind,
                     const SharedPages* shared, bool also_verified) {
  // As fio does: one block per request in flight (iodepth x bs per job).
  const std::size_t buf_bytes = std::min<std::size_t>(
      size, cfg.block_size * std::size_t(cfg.queue_depth) * std::size_t(cfg.thread_count));
  RunBuffer buf(kind, buf_bytes, shared);
  std::memset(buf.data(), 0x5a, buf_bytes);

  auto eng = make_io_engine(cfg);
  const std::pair<void*, std::size_t> region{buf.data(), buf_bytes};
  eng->register_buffers({&region, 1});

  bool direct = false;
  const int fd = open_for_io(file, O_RDWR | O_CREAT, cfg.direct, &direct);
  std::vector<std::uint64_t> sums(size / cfg.block_size + 1);
  auto requests = [&](IoOp op, bool verify) {
    std::vector<IoRequest> reqs;
    std::size_t i = 0;
    for (std::size_t off = 0; off < size; off += cfg.block_size, ++i) {
      IoRequest r;
      r.op = op;
      r.fd = fd;
      r.offset = off;
      r.bytes = std::min(cfg.block_size, size - off);
      r.buf = buf.data() + (off % buf_bytes);
      r.path = &file;
      if (verify) {
        r.checksum = &sums[i];
        r.verify = op == IoOp::kRead;
      }
      reqs.push_back(r);
    }
    return reqs;
  };
  // GB/s of a write then a read of the whole file.
  auto timed = [&](bool verify) {
    const auto w = requests(IoOp::kWrite, verify);
    Stopwatch sw;
    eng->submit(w).wait();
    const double wr = double(size) / sw.seconds() / 1e9;
    const auto r = requests(IoOp::kRead, verify);
    sw.restart();
    eng->submit(r).wait();
    return std::pair{wr, double(size) / sw.seconds() / 1e9};
  };
  RunResult res;
  res.page_kind = buf.page_kind();
  res.pages = (buf_bytes + 4095) / 4096;
  res.phys_runs = physical_runs(buf.data(), buf_bytes);
  res.engine = eng->describe();
  std::tie(res.write_gbps, res.read_gbps) = timed(false);
  if (also_verified) std::tie(res.verify_write_gbps, res.verify_read_gbps) = timed(true);
  ::close(fd);
  return res;
}

// Runs fio with the job equivalent to run_strata's; returns GB/s (0 when fio is missing).
// `mem`: fio's --mem ("" for its default, malloc). With `buffer_runs`, how fio's own buffer lies
// in physical memory (fio_buffer_runs; 0 where not seen) is written there.
double run_fio(const std::string& file, std::size_t size, const AioConfig& cfg, bool direct,
               const std::string& mem, bool fixedbufs, const char* rw,
               std::size_t* buffer_runs = nullptr) {
  const int jobs = cfg.thread_count;
  const std::size_t per_job = size / std::size_t(jobs) / cfg.block_size * cfg.block_size;
  // fio ends with us: a signal's clean-up kills it first (its pid, through g_cleanup); and a
  // SIGKILL of strata-bench, which runs no clean-up, reaches it through its parent-death signal
  // (setpriv, util-linux). The shell execs it, so the child's pid is fio's.
  static const bool pdeath = std::system("setpriv --help 2>/dev/null | grep -q pdeathsig") == 0;
  std::string cmd = fmt::format(
      "exec {}fio --name=strata-vs-fio --filename='{}' --rw={} --bs={} --iodepth={} --numjobs={} "
      "--size={} "
      "--offset_increment={} --group_reporting --thread --direct={} --ioengine=io_uring "
      "--fallocate=none "
      "--output-format=json{}{} 2>'{}.fio-stderr'",
      pdeath ? "setpriv --pdeathsig KILL " : "", file, rw, cfg.block_size, cfg.queue_depth, jobs,
      per_job, per_job, direct ? 1 : 0, fixedbufs ? " --fixedbufs" : "",
      mem.empty() ? "" : " --mem=" + mem, file);
  const RemovedAtExit err_file{file + ".fio-stderr"};
  int pipe_fd[2];
  STRATA_CHECK_ERRNO(::pipe2(pipe_fd, O_CLOEXEC), "pipe for fio's output");
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::dup2(pipe_fd[1], 1);
    ::execl("/bin/sh", "sh", "-c", cmd.c_str(), static_cast<char*>(nullptr));
    ::_exit(127);
  }
  ::close(pipe_fd[1]);
  if (pid < 0) {
    ::close(pipe_fd[0]);
    STRATA_THROW(kIo, "cannot run fio: fork failed: {}", std::strerror(errno));
  }
  g_cleanup.child.store(pid);
  // Looked at while fio runs (until it is reaped its pid is its own).
  std::jthread sampler;  // stopped and joined on the way out, whatever way that is
  if (buffer_runs) {
    *buffer_runs = 0;
    const std::size_t bytes =
        cfg.block_size * std::size_t(cfg.queue_depth);  // fio's, whatever --size
    sampler = std::jthread([buffer_runs, pid, bytes](std::stop_token stop) {
      for (int wait_ms = 5;
           !stop.stop_requested() && (*buffer_runs = fio_buffer_runs(pid, bytes)) == 0;
           wait_ms = std::min(wait_ms * 2, 20))
        std::this_thread::sleep_for(std::chrono::milliseconds(wait_ms));
    });
  }
  std::string out;
  char chunk[4096];
  for (ssize_t n; (n = ::read(pipe_fd[0], chunk, sizeof chunk)) != 0;) {
    if (n > 0)
      out.append(chunk, std::size_t(n));
    else if (errno != EINTR)
      break;
  }
  ::close(pipe_fd[0]);
  if (sampler.joinable()) {  // before fio is reaped: until then its pid is its own
    sampler.request_stop();
    sampler.join();
  }
  int rc = 0;
  while (::waitpid(pid, &rc, 0) < 0 && errno == EINTR) {
  }
  g_cleanup.child.store(0);
  if (rc != 0) {
    std::string why, line;
    for (std::ifstream e(err_file.path); std::getline(e, line);)
      if (!line.empty()) why = line;  // fio's last word
    const std::string how = WIFSIGNALED(rc) ? fmt::format("killed by signal {} ({})", WTERMSIG(rc),
                                                          strsignal(WTERMSIG(rc)))
                                            : fmt::format("exit {}", WEXITSTATUS(rc));
    STRATA_THROW(kIo, "fio failed ({}{}{}) running: {}{}", how, why.empty() ? "" : ": ", why, cmd,
                 mem == "mmaphuge"
                     ? " (--mem=mmaphuge needs hugetlbfs pages: see --reserve-hugepages)"
                     : "");
  }
  const auto j = nlohmann::json::parse(out.substr(out.find('{')));
  const auto& job = j["jobs"][0][rw == std::string("write") ? "write" : "read"];
  return job["bw_bytes"].get<double>() / 1e9;
}

// Writes the whole file once, untimed, so every timed run (ours and fio's) overwrites
// allocated, written blocks: the swap store's steady state, and no run pays the file
// system's unwritten-extent conversion that whichever ran first would otherwise pay.
// Returns whether the file system took O_DIRECT (fio is then run the same way).
bool lay_down(const std::string& file, std::size_t size, const AioConfig& cfg) {
  const std::size_t unit = std::min<std::size_t>(size, std::size_t(64) << 20);
  void* buf = std::aligned_alloc(4096, unit);
  STRATA_REQUIRE(buf != nullptr, "out of memory preparing {}", file);
  std::memset(buf, 0xa5, unit);
  bool direct = false;
  // (truncated, not removed: the file stays the one this run made; not created again, which after
  // a signal's removal on another thread would leave it behind)
  const int fd = open_for_io(file, O_RDWR | O_TRUNC, cfg.direct, &direct);
  AioConfig c = cfg;
  c.thread_count = 1;
  auto eng = make_io_engine(c);
  std::vector<IoRequest> reqs;
  for (std::size_t off = 0; off < size; off += unit)
    reqs.push_back(IoRequest{IoOp::kWrite, fd, off, buf, std::min(unit, size - off), &file});
  try {
    eng->submit(reqs).wait();
  } catch (...) {
    ::close(fd);
    std::free(buf);
    throw;
  }
  ::fsync(fd);
  ::close(fd);
  std::free(buf);
  return direct;
}

bool have_fio() { return std::system("fio --version >/dev/null 2>&1") == 0; }

// --path: a folder this process can write (a missing one, a file and a read-only one named as
// such; a read-only folder failed at the O_DIRECT open with errno 13, pointing at O_DIRECT).
void require_bench_folder(const std::string& path) {
  std::error_code ec;
  STRATA_REQUIRE(fs::is_directory(path, ec), "--path '{}' {}", path,
                 fs::exists(path, ec)
                     ? "is a file, not a folder: give a folder on the drive to measure"
                     : "is not there: create the folder on the drive to measure");
  STRATA_REQUIRE(
      ::access(path.c_str(), W_OK) == 0,
      "--path '{}' cannot be written ({}): give a folder you may write on the drive to measure",
      path, std::strerror(errno));
}

// The shared pages of --buffers same (fio's buffer size), allocated (written once) so that our
// runs' mappings and fio's (--mem=mmapshared:/proc/<pid>/fd/<fd>) share them.
void make_shared_pages(SharedPages& s, std::size_t bytes) {
  // Shared memory takes RAM: no more than half of what is available (it is never swapped out
  // while mapped and registered, and a run needs room for the rest).
  const std::uint64_t avail = cpu::mem_available_bytes();
  // fio maps its buffers plus up to a page of alignment: the memory holds a block more.
  const std::size_t total = bytes + (std::size_t(1) << 20);
  STRATA_REQUIRE(avail == 0 || total <= avail / 2,
                 "--buffers same: the shared pages are block x queue depth = {}, and {} of memory "
                 "is available (half may be used); "
                 "lower --queue-depth or --block-size, or use --buffers huge, normal or both",
                 human_bytes(double(bytes)), human_bytes(double(avail)));
  // Not close-on-exec: fio, our child, opens it through our /proc entry.
  s.fd = ::memfd_create("strata-bench-nvme-shared", 0);
  STRATA_CHECK_ERRNO(s.fd, "--buffers same: memfd_create");
  s.path = fmt::format("/proc/{}/fd/{}", ::getpid(), s.fd);
  std::vector<char> chunk(std::size_t(1) << 20, char(0x5a));
  for (std::size_t off = 0; off < total; off += chunk.size()) {
    errno = 0;
    if (::pwrite(s.fd, chunk.data(), chunk.size(), off_t(off)) != ssize_t(chunk.size()))
      STRATA_THROW(kIo,
                   "--buffers same: cannot fill {} of shared memory ({}): use --buffers huge, "
                   "normal or both",
                   human_bytes(double(total)),
                   errno ? std::strerror(errno) : "a short write: out of memory");
  }
}

void run_compare(const NvmeArgs& a) {
  AioConfig cfg;
  cfg.block_size = parse_bytes(a.block_size, "--block-size");
  STRATA_REQUIRE(cfg.block_size >= 4096 && (cfg.block_size & (cfg.block_size - 1)) == 0,
                 "--block-size {}: must be a power of two of at least 4K (4K, 64K, 1M, ...)",
                 a.block_size);
  cfg.queue_depth = a.queue_depth;
  cfg.thread_count = a.threads;
  cfg.engine = a.engine == "threads"    ? IoBackend::kThreads
               : a.engine == "io_uring" ? IoBackend::kIoUring
                                        : IoBackend::kAuto;
  cfg.register_buffers = !a.no_register;
  const std::size_t size = parse_bytes(a.size, "--size");
  // Whole blocks only: a size cut down to them (1.5M became 1M) measured something else than asked.
  if (size == 0 || size % cfg.block_size != 0) {
    const std::size_t below = size / cfg.block_size * cfg.block_size,
                      above = below + cfg.block_size;
    STRATA_THROW(kInvalidArgument,
                 "--size {}: must be a whole number of --block-size {} blocks; use {}", a.size,
                 a.block_size,
                 below > 0 ? human_bytes(double(below)) + " or " + human_bytes(double(above))
                           : human_bytes(double(above)));
  }
  require_bench_folder(a.path);
  const std::string file = (fs::path(a.path) / "strata-bench-nvme.bin").string();
  const bool fio = a.vs_fio && have_fio();
  if (a.vs_fio && !fio)
    log::warn("fio is not installed (scripts/setup.sh installs it): no fio comparison");

  std::vector<Buffers> kinds;
  const bool all = a.buffers == "all";
  if (a.buffers == "huge" || a.buffers == "both" || all) kinds.push_back(Buffers::kHuge);
  if (a.buffers == "normal" || a.buffers == "both" || all) kinds.push_back(Buffers::kNormal);
  if (a.buffers == "same" || all) kinds.push_back(Buffers::kSame);
  STRATA_REQUIRE(!kinds.empty(), "--buffers '{}': use huge, normal, same, both or all", a.buffers);
  const bool same = kinds.back() == Buffers::kSame;
  // fio takes its buffers last in, first out: a job of fewer blocks than its queue depth
  // reads into the last of them, where ours would use the first.
  STRATA_REQUIRE(!same || size >= cfg.block_size * std::size_t(cfg.queue_depth),
                 "--buffers {} with --size {}: below block x queue depth ({}), fio reads into "
                 "other pages of the "
                 "shared buffer than ours; use --size {} or more",
                 a.buffers, a.size,
                 human_bytes(double(cfg.block_size * std::size_t(cfg.queue_depth))),
                 human_bytes(double(cfg.block_size * std::size_t(cfg.queue_depth))));
  // fio's jobs would each map the shared memory from its start, sharing one job's pages, where
  // our rings use a buffer each.
  STRATA_REQUIRE(!same || cfg.thread_count == 1,
                 "--buffers {} with --threads {}: the shared pages are one ring's buffer (fio's "
                 "jobs would all map the "
                 "same one); use --threads 1, or --buffers huge, normal or both",
                 a.buffers, cfg.thread_count);
  const cpu::HugePageInfo hp = cpu::huge_page_info();
  claim_file_with_space(a.path, file, size);
  SignalCleanup::remove_file(file + ".fio-stderr");  // run_fio's, before it makes it
  const RemovedAtExit removed{file};
  const bool direct = lay_down(file, size, cfg);
  SharedPages shared;
  if (same) make_shared_pages(shared, cfg.block_size * std::size_t(cfg.queue_depth));

  nlohmann::json js;
  js["path"] = fs::absolute(a.path).string();
  js["size_bytes"] = size;
  js["block_size_bytes"] = cfg.block_size;
  js["queue_depth"] = cfg.queue_depth;
  js["threads"] = cfg.thread_count;
  js["results"] = nlohmann::json::array();
  js["repeat"] = a.repeat;
  js["direct"] = direct;
  if (fio)
    js["reference"] =
        "fio: the same job on the same file (--ioengine=io_uring, --direct as strata's, the same "
        "block size, queue depth, size and jobs, --fixedbufs where strata registers its buffers; "
        "buffers: hugetlb pages with huge, its own malloc'd pages with normal, the very same "
        "pages with same), run in turns with strata's runs, the best of --repeat each; " +
        broken_bound_clause() + " (broken_bound)";
  std::printf("strata-bench nvme: %s, %s, block %s, QD %d, %d thread(s), best of %d%s\n",
              js["path"].get<std::string>().c_str(), human_bytes(double(size)).c_str(),
              human_bytes(double(cfg.block_size)).c_str(), cfg.queue_depth, cfg.thread_count,
              a.repeat,
              direct ? ""
                     : "; BUFFERED I/O (the file system refuses O_DIRECT, e.g. tmpfs): the page "
                       "cache, not the drive");
  std::printf("%-10s %-17s %-6s %12s %10s %7s\n", "buffers", "pages", "op", "strata GB/s",
              "fio GB/s", "ratio");
  bool any_broken = false;  // a row faster than fio by more than 2%
  for (Buffers kind : kinds) {
    const bool huge = kind == Buffers::kHuge;
    const char* name = buffers_name(kind);
    // Best of --repeat runs each, ours and fio's alternating, so both see the same drive
    // state (the virtual disk's host cache, other load) as often.
    RunResult r;
    double fw = 0, fr = 0;
    bool fio_ok = false;
    std::vector<RunResult> each;  // our runs, for the buffers' physical runs beside their reads
    std::vector<std::pair<std::size_t, double>>
        fio_each;  // fio's (kNormal): its buffer's runs, its read
    for (int rep = 0; rep < a.repeat; ++rep) {
      const RunResult once = run_strata(file, size, cfg, kind, same ? &shared : nullptr, a.verify);
      each.push_back(once);
      r.page_kind = once.page_kind;
      r.engine = once.engine;
      r.write_gbps = std::max(r.write_gbps, once.write_gbps);
      r.read_gbps = std::max(r.read_gbps, once.read_gbps);
      // fio's huge-page buffers are hugetlbfs pages only; compare like with like.
      const bool fio_huge = huge && r.page_kind == std::string("hugetlb");
      fio_ok = fio && (!huge || fio_huge);
      if (fio_ok) {
        const bool fixed = !a.no_register && cfg.engine != IoBackend::kThreads;
        const std::string mem = fio_huge                 ? "mmaphuge"
                                : kind == Buffers::kSame ? "mmapshared:" + shared.path
                                                         : "";
        fw = std::max(fw, run_fio(file, size, cfg, direct, mem, fixed, "write"));
        // How fio's own 4 KiB pages lie, beside its read: seen where ours are.
        std::size_t runs = 0;
        const bool look = kind == Buffers::kNormal && once.phys_runs > 0;
        const double read =
            run_fio(file, size, cfg, direct, mem, fixed, "read", look ? &runs : nullptr);
        fr = std::max(fr, read);
        if (look) fio_each.emplace_back(runs, read);
      }
    }
    js["engine"] = r.engine;
    nlohmann::json row{{"buffers", name},
                       {"page_kind", r.page_kind},
                       {"write_gbps", r.write_gbps},
                       {"read_gbps", r.read_gbps}};
    if (fio_ok) {
      row["fio_write_gbps"] = fw;
      row["fio_read_gbps"] = fr;
      row["ratio_vs_fio_write"] = r.write_gbps / fw;
      row["ratio_vs_fio_read"] = r.read_gbps / fr;
      // fio's rate is the bound: faster than it by more than 2% says the bound is wrong there
      // (with normal buffers fio's own pages, which can lie in more physical pieces than ours).
      const bool broken = broken_bound(r.write_gbps / fw) || broken_bound(r.read_gbps / fr);
      row["broken_bound"] = broken;
      any_broken = any_broken || broken;
    } else if (fio && huge) {
      row["fio_note"] =
          "fio has no transparent-huge-page buffers: run with --reserve-hugepages for a hugetlb "
          "comparison";
      std::printf("(huge, %s: no fio figures; %s)\n", r.page_kind.c_str(),
                  row["fio_note"].get<std::string>().c_str());
    }
    if (each.front().phys_runs > 0) {
      nlohmann::json runs = nlohmann::json::array(), reads = nlohmann::json::array();
      std::string line;
      for (const RunResult& o : each) {
        runs.push_back(o.phys_runs);
        reads.push_back(o.read_gbps);
        line += fmt::format("{}{} {:.2f}", line.empty() ? "" : ", ", o.phys_runs, o.read_gbps);
      }
      row["buffer_pages"] = each.front().pages;
      row["buffer_phys_runs"] = runs;
      row["read_gbps_each"] = reads;
      std::printf(
          "(%s buffers, %zu pages; physically contiguous runs and read GB/s of each of our runs: "
          "%s%s)\n",
          name, each.front().pages, line.c_str(),
          kind == Buffers::kSame ? "; fio reads into the same pages" : "");
    }
    if (!fio_each.empty()) {
      nlohmann::json runs = nlohmann::json::array(), reads = nlohmann::json::array();
      std::string line;
      for (const auto& [n, read] : fio_each) {
        runs.push_back(n);
        reads.push_back(read);
        line += fmt::format("{}{} {:.2f}", line.empty() ? "" : ", ",
                            n == 0 ? "?" : std::to_string(n), read);
      }
      row["fio_buffer_phys_runs"] = runs;  // 0: fio's buffer was not seen
      row["fio_read_gbps_each"] = reads;
      std::printf(
          "(fio's own buffers: physically contiguous runs and read GB/s of each fio run: %s)\n",
          line.c_str());
    }
    for (int op = 0; op < 2; ++op) {
      const double ours = op == 0 ? r.write_gbps : r.read_gbps;
      const double theirs = op == 0 ? fw : fr;
      std::printf("%-10s %-17s %-6s %12.2f %10s %7s%s\n", name, r.page_kind.c_str(),
                  op == 0 ? "write" : "read", ours,
                  fio_ok ? fmt::format("{:.2f}", theirs).c_str() : "-",
                  fio_ok ? fmt::format("{:.2f}", ours / theirs).c_str() : "-",
                  fio_ok ? broken_bound_note(ours / theirs) : "");
    }
    if (a.verify) {
      // The checksums' cost: the median over our runs of checked / unchecked GB/s, each pair
      // from one buffer (the best of each would pair different buffers' luck).
      auto median_ratio = [&](double RunResult::*checked, double RunResult::*plain) {
        std::vector<double> q;
        for (const RunResult& o : each) q.push_back(o.*checked / o.*plain);
        std::sort(q.begin(), q.end());
        return q.size() % 2 ? q[q.size() / 2] : (q[q.size() / 2 - 1] + q[q.size() / 2]) / 2;
      };
      double vw = 0, vr = 0;
      for (const RunResult& o : each) {
        vw = std::max(vw, o.verify_write_gbps);
        vr = std::max(vr, o.verify_read_gbps);
      }
      const double qw = median_ratio(&RunResult::verify_write_gbps, &RunResult::write_gbps);
      const double qr = median_ratio(&RunResult::verify_read_gbps, &RunResult::read_gbps);
      row["verify_write_gbps"] = vw;
      row["verify_read_gbps"] = vr;
      row["verify_write_ratio"] = qw;
      row["verify_read_ratio"] = qr;
      for (int op = 0; op < 2; ++op)
        std::printf(
            "%-10s %-17s %-6s %12.2f %10s %7.2f  (xxh3 verify on; ratio: median of checked / "
            "unchecked on "
            "the same buffer)\n",
            "", "", op == 0 ? "write" : "read", op == 0 ? vw : vr, "", op == 0 ? qw : qr);
    }
    js["results"].push_back(row);
  }
  std::printf("engine: %s; hugetlbfs pages free: %zu\n", js["engine"].get<std::string>().c_str(),
              hp.hugetlb_free);
  if (!fio && !a.vs_fio)
    std::printf(
        "no bound measured: --vs-fio runs fio's equivalent job on the same file in the same run "
        "and prints "
        "our/fio ratios\n");
  else if (!fio)
    std::printf("no bound measured: fio is not installed (scripts/setup.sh installs it)\n");
  if (any_broken)
    std::printf(
        "broken bound: fio ran slower than strata by more than 2%% on a row above, so its rate is "
        "no bound there (with normal buffers each side reads into its own 4 KiB pages, which can "
        "lie in more physical pieces on fio's side: the runs above); --buffers same runs both on "
        "the very same pages\n");
  if (a.json) print_json(js);
}

void run_sweep(const NvmeArgs& a) {
  require_bench_folder(a.path);
  const std::string file = (fs::path(a.path) / "strata-bench-nvme.bin").string();
  const std::size_t size =
      std::min<std::size_t>(parse_bytes(a.size, "--size"), std::size_t(512) << 20);
  const std::size_t blocks[] = {std::size_t(256) << 10, std::size_t(1) << 20, std::size_t(4) << 20};
  STRATA_REQUIRE(size >= blocks[2], "--size {} with --sweep: at least 4M (its largest block)",
                 a.size);
  STRATA_REQUIRE(a.sweep_seconds > 0, "--sweep-seconds {}: must be > 0 (the sweep's time bound)",
                 a.sweep_seconds);
  claim_file_with_space(a.path, file, size);
  const RemovedAtExit removed{file};
  const int qds[] = {8, 32, 64};
  const int threads[] = {1, 2};
  const bool hugeness[] = {true, false};
  Stopwatch total;
  nlohmann::json runs = nlohmann::json::array();
  double best = 0;
  AioConfig best_cfg;
  bool best_huge = true;
  bool direct = true;
  std::printf("strata-bench nvme --sweep: %s per run, at most %.0f s\n",
              human_bytes(double(size)).c_str(), a.sweep_seconds);
  std::printf("%-8s %4s %7s %-7s %10s %10s\n", "block", "QD", "threads", "buffers", "write GB/s",
              "read GB/s");
  bool stopped = false;
  for (bool huge : hugeness) {
    for (std::size_t bs : blocks) {
      for (int qd : qds) {
        for (int th : threads) {
          if (total.seconds() > a.sweep_seconds) {
            stopped = true;
            break;
          }
          AioConfig cfg;
          cfg.block_size = bs;
          if (runs.empty()) {
            direct = lay_down(file, size / bs * bs, cfg);
            if (!direct)
              std::printf(
                  "BUFFERED I/O (the file system refuses O_DIRECT, e.g. tmpfs): the page cache, "
                  "not the "
                  "drive; the block below is not the drive's\n");
          }
          cfg.queue_depth = qd;
          cfg.thread_count = th;
          const RunResult r = run_strata(file, size / bs * bs, cfg,
                                         huge ? Buffers::kHuge : Buffers::kNormal, nullptr, false);
          // Both directions matter to a training step: rank by the time to write and read back.
          const double score = 2.0 / (1.0 / r.write_gbps + 1.0 / r.read_gbps);
          std::printf("%-8s %4d %7d %-7s %10.2f %10.2f\n", human_bytes(double(bs)).c_str(), qd, th,
                      huge ? "huge" : "normal", r.write_gbps, r.read_gbps);
          runs.push_back({{"block_size_bytes", bs},
                          {"queue_depth", qd},
                          {"threads", th},
                          {"buffers", huge ? "huge" : "normal"},
                          {"write_gbps", r.write_gbps},
                          {"read_gbps", r.read_gbps}});
          if (score > best) {
            best = score;
            best_cfg = cfg;
            best_huge = huge;
          }
        }
      }
    }
  }
  const nlohmann::json aio{{"block_size", best_cfg.block_size},
                           {"queue_depth", best_cfg.queue_depth},
                           {"thread_count", best_cfg.thread_count},
                           {"single_submit", false},
                           {"overlap_events", true},
                           {"use_hugepages", best_huge}};
  const nlohmann::json block{{"aio", aio}};
  std::printf("%s after %.1f s. best aio block:\n%s\n", stopped ? "time bound reached" : "done",
              total.seconds(), block.dump(2).c_str());
  if (!a.out.empty()) {  // checked before the sweep (require_output_file)
    const int err = write_output(a.out, block.dump(2) + "\n");  // a stream: written into
    STRATA_REQUIRE(err == 0, "--out {}: cannot be written: {}", a.out, std::strerror(err));
    std::printf("written to %s\n", a.out.c_str());
  }
  if (a.json)
    print_json({{"path", fs::absolute(a.path).string()},
                {"size_bytes", size},
                {"direct", direct},
                {"time_bound_reached", stopped},
                {"runs", runs},
                {"best", aio},
                {"sweep_seconds", total.seconds()}});
}

}  // namespace
}  // namespace nvme_cmd

void add_nvme_command(CLI::App& app) {
  using namespace nvme_cmd;
  auto a = std::make_shared<NvmeArgs>();
  CLI::App* c =
      app.add_subcommand("nvme", "sequential NVMe write+read through strata's I/O engine (vs fio)");
  c->add_option("--path", a->path,
                "directory on the drive to test (a file is created and removed)");
  c->add_option(
      "--size", a->size,
      "bytes to write then read, whole blocks (4G, 512M, ...; --sweep: at most 512M a run)");
  c->add_option("--block-size", a->block_size, "bytes per request (aio.block_size)");
  c->add_option("--queue-depth", a->queue_depth, "requests in flight per ring")
      ->check(CLI::Range(1, 4096));
  c->add_option("--threads", a->threads, "rings / worker threads")->check(CLI::Range(1, 64));
  c->add_option("--buffers", a->buffers,
                "huge, normal, same (4 KiB pages of one shared memory, a memfd, that fio reads "
                "into too), both (huge, normal) "
                "or all")
      ->check(CLI::IsMember({"huge", "normal", "same", "both", "all"}));
  c->add_option("--engine", a->engine, "auto, io_uring or threads")
      ->check(CLI::IsMember({"auto", "io_uring", "threads"}));
  c->add_flag("--vs-fio", a->vs_fio,
              "run fio with the same job in the same run and print our/fio ratios");
  c->add_flag("--verify", a->verify, "also run with xxh3 checksums and print their cost");
  c->add_flag("--no-register", a->no_register,
              "do not register fixed buffers (nor use fio --fixedbufs)");
  c->add_flag("--sweep", a->sweep,
              "sweep block size x QD x threads x buffers; print the best aio block");
  c->add_option("--sweep-seconds", a->sweep_seconds, "time bound of the sweep");
  c->add_option("--out", a->out, "with --sweep: write the best aio block to this JSON file");
  c->add_flag("--overwrite", a->overwrite, "with --sweep --out: replace an existing FILE");
  c->add_option("--reserve-hugepages", a->reserve_hugepages,
                "set vm.nr_hugepages to at least this many 2 MiB pages for the run (root), so "
                "strata and fio "
                "both get hugetlbfs buffers; restored afterwards")
      ->check(CLI::Range(0, 1 << 20));
  c->add_option("--repeat", a->repeat,
                "runs of each measurement (ours and fio's alternating); the best is kept")
      ->check(CLI::Range(1, 100));
  c->add_flag("--json", a->json, "print, last, one JSON object of the figures");
  c->callback([a, c] {
    // What --sweep chooses itself, and what only --sweep writes: said, not silently ignored.
    if (a->sweep) {
      for (const char* flag : {"--block-size", "--queue-depth", "--threads", "--buffers",
                               "--engine", "--no-register", "--vs-fio", "--verify", "--repeat"})
        STRATA_REQUIRE(c->count(flag) == 0,
                       "{} with --sweep: the sweep tries block sizes, queue depths, threads and "
                       "buffers itself (one run each, no fio); leave {} out, or drop --sweep",
                       flag, flag);
      STRATA_REQUIRE(!a->overwrite || !a->out.empty(),
                     "--overwrite with --sweep but no --out: nothing is "
                     "written; add --out FILE or drop --overwrite");
      // A file already there (a ds_config.json, say) is not replaced by the aio block unasked.
      strata::require_output_file("--out", a->out, a->overwrite);
    } else {
      STRATA_REQUIRE(c->count("--out") == 0 && c->count("--sweep-seconds") == 0 &&
                         c->count("--overwrite") == 0,
                     "--out, --sweep-seconds and --overwrite belong to --sweep (the best aio block "
                     "it finds); add "
                     "--sweep");
    }
    const SignalCleanup on_signal;  // before anything it undoes is done
    HugepageReservation hp(a->reserve_hugepages);
    a->sweep ? run_sweep(*a) : run_compare(*a);
  });
}

}  // namespace strata::bench
