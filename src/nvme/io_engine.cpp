// The I/O engines behind strata::IoEngine.
//
// Owns: worker threads (one io_uring ring each, or a pool of pread/pwrite threads), the
// chunks in flight, and the completion state of each submit() batch.
// Invariants:
//  - A request is split into chunks of at most block_size bytes; chunk numbers follow the
//    order of submit() (the fault plan names chunks by number).
//  - A ring never has more than queue_depth chunks in flight; every CQE is marked seen;
//    a worker drains its ring before it exits, so no buffer is written after shutdown.
//  - -EAGAIN / -EINTR requeue the chunk (paced, for up to kRetryWindow); a short transfer requeues
//  the
//    remainder; anything else fails the batch with the operation, file, offset and errno,
//    while the batch's other chunks still complete: a batch always ends, never hangs.
//  - A ring's prepared SQEs are all submitted: a submit the kernel refuses for a while
//    (-EAGAIN, -EBUSY, -ENOMEM) or takes in part is tried again, after a completion or a
//    back-off; one that fails otherwise, or is refused for kSubmitGiveUp, gives the ring up:
//    the chunks it never took fail (their SQEs are never submitted), those in the kernel
//    complete as usual, and every later chunk fails with the same error.
//  - Checksums are computed (writes) and verified (reads) once a request's last chunk is
//    done, on the worker that completed it, so hashing runs in parallel across rings.
// It never reorders chunks of one request in a way a reader could see: a read's bytes are
// only reported once all of its chunks completed.
#include <fcntl.h>
#include <liburing.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/uio.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <future>
#include <map>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <utility>

#include "strata/error.h"
#include "strata/log.h"
#include "strata/nvme.h"
#include "strata/system_info.h"
#include "strata/trace.h"

namespace strata {
namespace detail {

struct IoBatch {
  std::mutex mu;
  std::condition_variable cv;
  std::size_t remaining = 0;  // chunks not completed yet
  bool done = false;
  std::exception_ptr error;
  std::vector<std::function<void(std::exception_ptr)>> callbacks;
  std::vector<IoRequest> reqs;
  std::vector<std::string>
      paths;  // copies of the requests' paths and tags (the pointers may dangle)
  std::vector<std::string> tags;
  std::unique_ptr<std::atomic<std::uint32_t>[]> req_chunks_left;
};

}  // namespace detail

bool IoHandle::done() const {
  if (!batch_) return true;
  std::lock_guard<std::mutex> lock(batch_->mu);
  return batch_->done;
}

void IoHandle::wait() const {
  if (!batch_) return;
  std::unique_lock<std::mutex> lock(batch_->mu);
  batch_->cv.wait(lock, [&] { return batch_->done; });
  if (batch_->error) std::rethrow_exception(batch_->error);
}

bool IoHandle::wait_for(std::chrono::milliseconds limit) const {
  if (!batch_) return true;
  std::unique_lock<std::mutex> lock(batch_->mu);
  if (!batch_->cv.wait_for(lock, limit, [&] { return batch_->done; })) return false;
  if (batch_->error) std::rethrow_exception(batch_->error);
  return true;
}

void IoHandle::on_complete(std::function<void(std::exception_ptr)> fn) const {
  STRATA_REQUIRE(static_cast<bool>(fn), "IoHandle::on_complete: empty function");
  if (!batch_) {
    fn(nullptr);
    return;
  }
  std::unique_lock<std::mutex> lock(batch_->mu);
  if (!batch_->done) {
    batch_->callbacks.push_back(std::move(fn));
    return;
  }
  auto err = batch_->error;
  lock.unlock();
  fn(err);
}

namespace {

using detail::IoBatch;

// A chunk's -EAGAIN / -EINTR: kQuickRetries at once, then paced, until kRetryWindow has passed.
constexpr int kQuickRetries = 8;
constexpr std::chrono::seconds kRetryWindow{30};
constexpr std::size_t kDirectAlign = 4096;

struct Chunk {
  std::shared_ptr<IoBatch> batch;
  std::uint32_t req = 0;
  IoOp op = IoOp::kRead;
  int fd = -1;
  std::uint64_t offset = 0;
  char* buf = nullptr;
  std::size_t bytes = 0;
  std::uint64_t id = 0;
  int retries = 0;
  std::chrono::steady_clock::time_point first_retry{};  // of the -EAGAIN / -EINTR run
  bool fault_checked = false;
  bool direct = false;         // its file is open with O_DIRECT
  std::int64_t issued_ns = 0;  // when it entered the ring (tracer clock; 0 = not traced)
};

std::string errno_text(int err) {
  char b[128];
  return strerror_r(err, b, sizeof b);
}

const char* op_name(IoOp op) { return op == IoOp::kRead ? "read" : "write"; }

std::string describe_file(const IoBatch& b, std::uint32_t req) {
  const std::string& p = b.paths[req];
  std::string s = p.empty() ? fmt::format("fd {}", b.reqs[req].fd) : fmt::format("'{}'", p);
  if (!b.tags[req].empty()) s += fmt::format(" ({})", b.tags[req]);
  return s;
}

// The shared part of both engines: splitting, fault injection, completion.
class EngineBase : public IoEngine {
 public:
  EngineBase(const AioConfig& cfg, std::vector<Fault> faults)
      : cfg_(cfg), faults_(std::move(faults)), left_(faults_.size()) {
    for (std::size_t i = 0; i < faults_.size(); ++i)
      left_[i] =
          faults_[i].kind == FaultKind::kEagain ? std::max<std::uint32_t>(faults_[i].times, 1) : 1;
  }

  IoHandle submit(std::span<const IoRequest> requests) override {
    auto batch = std::make_shared<IoBatch>();
    if (requests.empty()) {
      batch->done = true;
      return IoHandle(batch);
    }
    std::unordered_map<int, bool> direct;  // fd -> O_DIRECT, one fcntl per file
    std::size_t nchunks = 0;
    for (std::size_t i = 0; i < requests.size(); ++i) {
      const IoRequest& r = requests[i];
      STRATA_REQUIRE(r.fd >= 0, "I/O request {}: no file (fd {})", i, r.fd);
      STRATA_REQUIRE(r.buf != nullptr, "I/O request {} ({} of {} bytes): null buffer", i,
                     op_name(r.op), r.bytes);
      STRATA_REQUIRE(r.bytes > 0, "I/O request {}: zero bytes; skip empty requests", i);
      STRATA_REQUIRE(!r.verify || r.checksum,
                     "I/O request {}: verify needs a checksum to compare with", i);
      auto [it, fresh] = direct.try_emplace(r.fd, false);
      if (fresh) {
        const int fl = ::fcntl(r.fd, F_GETFL);
        STRATA_CHECK_ERRNO(fl, "I/O request {}: fd {} is not an open file", i, r.fd);
        it->second = (fl & O_DIRECT) != 0;
      }
      if (it->second) {
        STRATA_REQUIRE(
            r.offset % kDirectAlign == 0 && r.bytes % kDirectAlign == 0 &&
                reinterpret_cast<std::uintptr_t>(r.buf) % kDirectAlign == 0,
            "unaligned O_DIRECT {} of {}: offset {}, {} bytes, buffer {}; offset, length and "
            "buffer address must be multiples of 4096 (use SwapStore::padded_bytes and "
            "pool memory)",
            op_name(r.op), r.path ? *r.path : fmt::format("fd {}", r.fd), r.offset, r.bytes, r.buf);
      }
      nchunks += (r.bytes + cfg_.block_size - 1) / cfg_.block_size;
    }
    batch->reqs.assign(requests.begin(), requests.end());
    batch->paths.reserve(requests.size());
    batch->tags.reserve(requests.size());
    for (const auto& r : requests) {
      batch->paths.push_back(r.path ? *r.path : std::string());
      batch->tags.push_back(r.tag ? *r.tag : std::string());
    }
    batch->req_chunks_left = std::make_unique<std::atomic<std::uint32_t>[]>(requests.size());
    batch->remaining = nchunks;

    std::vector<Chunk*> chunks;
    chunks.reserve(nchunks);
    std::uint64_t id = next_chunk_.fetch_add(nchunks);
    for (std::uint32_t i = 0; i < requests.size(); ++i) {
      const IoRequest& r = requests[i];
      std::uint32_t n = 0;
      for (std::size_t off = 0; off < r.bytes; off += cfg_.block_size, ++n) {
        auto* c = new Chunk;
        c->batch = batch;
        c->req = i;
        c->op = r.op;
        c->fd = r.fd;
        c->direct = direct[r.fd];
        c->offset = r.offset + off;
        c->buf = static_cast<char*>(r.buf) + off;
        c->bytes = std::min(cfg_.block_size, r.bytes - off);
        c->id = id++;
        chunks.push_back(c);
      }
      batch->req_chunks_left[i].store(n, std::memory_order_relaxed);
    }
    enqueue(std::move(chunks));
    return IoHandle(batch);
  }

  IoStats stats() const override {
    IoStats s;
    s.bytes_read = bytes_read_.load();
    s.bytes_written = bytes_written_.load();
    s.chunks = chunks_done_.load();
    s.requeued_short = requeued_short_.load();
    s.requeued_eagain = requeued_eagain_.load();
    s.submits_refused = submits_refused_.load();
    s.errors = errors_.load();
    s.checksum_ns = checksum_ns_.load();
    return s;
  }

 protected:
  virtual void enqueue(std::vector<Chunk*>&& chunks) = 0;

  static bool at_submit(FaultKind k) {
    return k == FaultKind::kSubmitEagain || k == FaultKind::kSubmitEinval;
  }

 public:
  // The fault plan's error for an io_uring_submit carrying `chunks` (fired once), or 0.
  int submit_fault(const std::deque<Chunk*>& chunks) {
    if (faults_.empty()) return 0;
    std::lock_guard<std::mutex> lock(fault_mu_);
    for (const Chunk* c : chunks)
      for (std::size_t i = 0; i < faults_.size(); ++i) {
        if (left_[i] == 0 || faults_[i].chunk != c->id || !at_submit(faults_[i].kind)) continue;
        left_[i] = 0;
        return faults_[i].kind == FaultKind::kSubmitEagain ? -EAGAIN : -EINVAL;
      }
    return 0;
  }
  void note_submit_refused() { ++submits_refused_; }
  // Ends a chunk that never reached the drive with the error `why`.
  void fail_unsent(Chunk* c, const std::string& why, int err) {
    fail(c, why, err);
    ++chunks_done_;
    complete(c);
  }

 protected:
  // Applies the fault plan to a chunk's first completion.
  long inject(Chunk* c, long res) {
    if (faults_.empty()) return res;
    const bool first = !c->fault_checked;  // one-shot faults fire at the first completion only
    c->fault_checked = true;
    std::uint32_t delay = 0;
    {
      std::lock_guard<std::mutex> lock(fault_mu_);
      for (std::size_t i = 0; i < faults_.size(); ++i) {
        if (left_[i] == 0 || faults_[i].chunk != c->id || at_submit(faults_[i].kind)) continue;
        if (!first && faults_[i].kind != FaultKind::kEagain) continue;
        --left_[i];
        switch (faults_[i].kind) {
          case FaultKind::kShort:
            // As a real one: with O_DIRECT a whole number of 4 KiB blocks (drives with 4 KiB
            // sectors refuse less), so a one-block chunk comes back whole.
            if (!c->direct && res > 1)
              res /= 2;
            else if (res >= 2 * long(kDirectAlign))
              res = (res / 2) / long(kDirectAlign) * long(kDirectAlign);
            break;
          case FaultKind::kEagain:
            res = -EAGAIN;
            break;
          case FaultKind::kEio:
            res = -EIO;
            break;
          case FaultKind::kEnospc:
            res = -ENOSPC;
            break;
          case FaultKind::kDelay:
            delay = faults_[i].delay_ms;
            break;
          case FaultKind::kSubmitEagain:
          case FaultKind::kSubmitEinval:
            break;  // (skipped above)
        }
      }
    }
    if (delay) std::this_thread::sleep_for(std::chrono::milliseconds(delay));
    return res;
  }

  // Handles a chunk's result. Returns true when the chunk must be issued again (then the
  // caller keeps it); false when it is finished (the chunk has been deleted).
  bool finish_chunk(Chunk* c, long res) {
    res = inject(c, res);
    if (res == -EAGAIN || res == -EINTR) {
      // Tried again at once a few times, then after a pause growing to 0.8 ms (the kernel short of
      // something: retrying at once only spins), for up to kRetryWindow; it was 1,000 retries
      // back to back, a few milliseconds, before the chunk failed.
      const auto now = std::chrono::steady_clock::now();
      if (c->retries++ == 0) c->first_retry = now;
      if (now - c->first_retry < kRetryWindow) {
        ++requeued_eagain_;
        if (c->retries > kQuickRetries)
          std::this_thread::sleep_for(
              std::chrono::microseconds(50 << std::min(c->retries - kQuickRetries, 4)));
        return true;
      }
      fail(c,
           fmt::format("still -EAGAIN after {} tries over {} s", c->retries,
                       std::chrono::duration_cast<std::chrono::seconds>(kRetryWindow).count()),
           EAGAIN);
    } else if (res < 0) {
      fail(c, errno_text(int(-res)), int(-res));
    } else if (res == 0) {
      fail(c,
           c->op == IoOp::kRead ? "end of file (the file is shorter than the request)"
                                : "no progress (0 bytes written)",
           0);
    } else if (std::size_t(res) < c->bytes) {
      c->offset += std::size_t(res);
      c->buf += res;
      c->bytes -= std::size_t(res);
      (c->op == IoOp::kRead ? bytes_read_ : bytes_written_) += std::uint64_t(res);
      ++requeued_short_;
      return true;
    } else {
      (c->op == IoOp::kRead ? bytes_read_ : bytes_written_) += c->bytes;
    }
    ++chunks_done_;
    complete(c);
    return false;
  }

 private:
  void fail(Chunk* c, const std::string& why, int err) {
    ++errors_;
    IoBatch& b = *c->batch;
    const IoRequest& r = b.reqs[c->req];
    const ErrorKind kind = ErrorKind::kIo;
    auto e = std::make_exception_ptr(Error(
        kind,
        fmt::format("{} of {} bytes at offset {} of {} failed: {}{}", op_name(c->op), c->bytes,
                    c->offset, describe_file(b, c->req), why,
                    err == ENOSPC
                        ? " — the disk is full: free space or point nvme_path at a larger drive"
                        : ""),
        op_name(r.op), __FILE__, __LINE__, err ? fmt::format("errno {}", err) : std::string()));
    std::lock_guard<std::mutex> lock(b.mu);
    if (!b.error) b.error = e;
  }

  void complete(Chunk* c) {
    std::shared_ptr<IoBatch> bp = std::move(c->batch);
    IoBatch& b = *bp;
    const std::uint32_t req = c->req;
    delete c;
    if (b.req_chunks_left[req].fetch_sub(1) == 1) finish_request(b, req);
    std::unique_lock<std::mutex> lock(b.mu);
    if (--b.remaining != 0) return;
    // The callbacks run, and are destroyed (what they hold, a pinned block say, released),
    // before the batch is done: whoever wait()s may count on that. One registered meanwhile
    // (not done yet) is run by this loop too.
    const std::exception_ptr err = b.error;
    while (!b.callbacks.empty()) {
      std::vector<std::function<void(std::exception_ptr)>> callbacks;
      callbacks.swap(b.callbacks);
      lock.unlock();
      for (auto& fn : callbacks) {
        try {
          fn(err);
        } catch (const std::exception& e) {  // the batch must still finish: waiters depend on it
          log::error("an I/O completion callback threw: {}", e.what());
        } catch (...) {
          log::error("an I/O completion callback threw something that is not a std::exception");
        }
      }
      callbacks.clear();
      lock.lock();
    }
    b.done = true;
    lock.unlock();
    b.cv.notify_all();
  }

  // Checksums of a whole request, once all its chunks are done.
  void finish_request(IoBatch& b, std::uint32_t req) {
    const IoRequest& r = b.reqs[req];
    if (!r.checksum) return;
    {
      std::lock_guard<std::mutex> lock(b.mu);
      if (b.error) return;  // the bytes are not trustworthy; the batch already failed
    }
    const auto t0 = std::chrono::steady_clock::now();
    const std::uint64_t h = XXH3_64bits(r.buf, r.bytes);
    checksum_ns_ += std::uint64_t(
        std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0)
            .count());
    if (r.op == IoOp::kWrite) {
      *r.checksum = h;
    } else if (r.verify && h != *r.checksum) {
      ++errors_;
      auto e = std::make_exception_ptr(
          Error(ErrorKind::kIo,
                fmt::format(
                    "checksum mismatch reading {} bytes at offset {} of {}: expected {:016x}, got "
                    "{:016x}; "
                    "the file was changed behind strata's back or the drive returned corrupt data",
                    r.bytes, r.offset, describe_file(b, req), *r.checksum, h),
                "verify", __FILE__, __LINE__));
      std::lock_guard<std::mutex> lock(b.mu);
      if (!b.error) b.error = e;
    }
  }

 protected:
  AioConfig cfg_;

 private:
  std::vector<Fault> faults_;
  std::vector<std::uint32_t> left_;  // firings left of each fault
  std::mutex fault_mu_;
  std::atomic<std::uint64_t> next_chunk_{0};
  std::atomic<std::uint64_t> bytes_read_{0}, bytes_written_{0}, chunks_done_{0}, requeued_short_{0},
      requeued_eagain_{0}, submits_refused_{0}, errors_{0}, checksum_ns_{0};
};

// ---- io_uring ----

class UringEngine;

class UringWorker {
 public:
  UringWorker(UringEngine* eng, int index, const AioConfig& cfg);
  ~UringWorker();
  void push(std::vector<Chunk*>& chunks, std::size_t begin, std::size_t step);
  // Runs `cmd` on the worker thread once its ring is idle, and waits for it.
  void run_idle(std::function<void(io_uring&)> cmd);
  bool fixed_buffers() const { return !fixed_.empty(); }

  struct Fixed {
    char* base;
    std::size_t len;
  };
  std::vector<Fixed> fixed_;                  // sorted by base; index = buffer index
  std::unordered_map<int, int> fixed_files_;  // fd -> slot

 private:
  void run();
  void prep(Chunk* c);
  // Submits what is prepared (unsent_); on a refusal leaves it for the next try, and gives
  // the ring up (broken_) on an error or a refusal that lasted kSubmitGiveUp.
  void submit(std::size_t& inflight);
  std::chrono::milliseconds backoff() const;
  void give_up(int err, const std::string& why, std::size_t& inflight);
  // A poll of wake_fd_ in the ring, so that push() ends the worker's wait for a completion: a
  // chunk queued while others are in flight goes into the ring at once, not after the next
  // completion (which serialized a write-behind behind a read-ahead). False when it could not be
  // armed: the worker then takes new chunks at the next completion, as before.
  bool arm_wake();
  // Takes the wake poll out of an idle ring: fires it through wake_fd_ and reaps its completion.
  void disarm_wake();

  UringEngine* eng_;
  const AioConfig cfg_;
  // One io_uring_enter per chunk instead of one per batch. A batch of more than two SQEs is
  // submitted under a block plug, and the plug merges the chunks of consecutive offsets into
  // requests of up to max_sectors_kb: QD 32 x 1 MiB reached this virtio disk as 8 x 4 MiB,
  // 0.82-0.89x the throughput of the same bytes as 32 requests (fio submits one at a time).
  // Chunks of kSoloSubmitBytes are already large requests and few enough per second that a
  // syscall each costs nothing; smaller chunks keep batching, where merging pays.
  static constexpr std::size_t kSoloSubmitBytes = std::size_t(128) << 10;
  const bool solo_submit_ = cfg_.single_submit || cfg_.block_size >= kSoloSubmitBytes;
  int index_;
  io_uring ring_{};
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Chunk*> queue_;
  std::deque<std::packaged_task<void()>> commands_;
  bool stop_ = false;
  // The worker waits in the ring (for a completion, with its wake poll armed): push() then writes
  // wake_fd_ (an eventfd) to end that wait. (Under mu_.)
  bool waiting_in_ring_ = false;
  int wake_fd_ = -1;
  // Worker thread only: the poll is in the kernel; its SQE is prepared but the kernel refused it
  // (the next submit carries it first: submit() counts it out); the poll failed (not used again).
  bool wake_armed_ = false, wake_sqe_pending_ = false, wake_failed_ = false;
  // Worker thread only: chunks prepared in the SQ that the kernel has not taken yet, in
  // order; the refusals of submit in a row, since when; and, once the ring is given up, why.
  std::deque<Chunk*> unsent_;
  int refusals_ = 0;
  std::chrono::steady_clock::time_point refused_since_;
  std::string broken_;
  int broken_err_ = 0;
  std::thread thread_;
};

class UringEngine final : public EngineBase {
 public:
  UringEngine(const AioConfig& cfg, std::vector<Fault> faults)
      : EngineBase(cfg, std::move(faults)) {
    for (int i = 0; i < cfg.thread_count; ++i)
      workers_.push_back(std::make_unique<UringWorker>(this, i, cfg));
  }
  ~UringEngine() override { workers_.clear(); }

  std::string describe() const override {
    return fmt::format("io_uring ({} ring{}, QD {}, {} KiB blocks{}{})", workers_.size(),
                       workers_.size() == 1 ? "" : "s", cfg_.queue_depth, cfg_.block_size / 1024,
                       workers_[0]->fixed_buffers() ? ", fixed buffers" : "",
                       workers_[0]->fixed_files_.empty() ? "" : ", fixed files");
  }
  IoBackend backend() const override { return IoBackend::kIoUring; }

  bool register_buffers(std::span<const std::pair<void*, std::size_t>> regions) override {
    if (!cfg_.register_buffers || regions.empty()) return false;
    // The kernel takes at most 1 GiB per buffer: split larger regions.
    std::vector<UringWorker::Fixed> fixed;
    for (auto [p, n] : regions) {
      STRATA_REQUIRE(p != nullptr && n > 0, "register_buffers: empty region");
      for (std::size_t off = 0; off < n; off += std::size_t(1) << 30)
        fixed.push_back({static_cast<char*>(p) + off, std::min(n - off, std::size_t(1) << 30)});
    }
    std::sort(fixed.begin(), fixed.end(), [](auto& a, auto& b) { return a.base < b.base; });
    std::vector<iovec> iov;
    for (auto& f : fixed) iov.push_back({f.base, f.len});
    bool ok = true;
    for (auto& w : workers_) {
      w->run_idle([&](io_uring& ring) {
        if (!w->fixed_.empty()) io_uring_unregister_buffers(&ring);
        w->fixed_.clear();
        const int rc =
            io_uring_register_buffers(&ring, iov.data(), static_cast<unsigned>(iov.size()));
        if (rc < 0) {
          ok = false;
          log::warn_once(
              "nvme.fixed_buffers",
              fmt::format("io_uring cannot register {} fixed buffers ({}); using plain reads and "
                          "writes (slower)",
                          iov.size(), errno_text(-rc)));
          return;
        }
        w->fixed_ = fixed;
      });
    }
    return ok;
  }

  bool register_files(std::span<const int> fds) override {
    if (fds.empty()) return false;
    bool ok = true;
    for (auto& w : workers_) {
      w->run_idle([&](io_uring& ring) {
        if (!w->fixed_files_.empty()) io_uring_unregister_files(&ring);
        w->fixed_files_.clear();
        const int rc =
            io_uring_register_files(&ring, fds.data(), static_cast<unsigned>(fds.size()));
        if (rc < 0) {
          ok = false;
          log::warn_once("nvme.fixed_files",
                         fmt::format("io_uring cannot register files ({})", errno_text(-rc)));
          return;
        }
        for (std::size_t i = 0; i < fds.size(); ++i) w->fixed_files_[fds[i]] = static_cast<int>(i);
      });
    }
    return ok;
  }

  void unregister_files(std::span<const int> fds) override {
    for (auto& w : workers_) {
      w->run_idle([&](io_uring& ring) {
        for (const int fd : fds) {
          const auto it = w->fixed_files_.find(fd);
          if (it == w->fixed_files_.end()) continue;
          int none = -1;  // an empty slot: the kernel lets go of the file
          io_uring_register_files_update(&ring, unsigned(it->second), &none, 1);
          w->fixed_files_.erase(it);
        }
      });
    }
  }

  bool on_cqe(Chunk* c, long res) { return finish_chunk(c, res); }

 protected:
  void enqueue(std::vector<Chunk*>&& chunks) override {
    // Consecutive chunks go to different rings so one large request uses all of them.
    const std::size_t n = workers_.size();
    const std::size_t first = next_worker_.fetch_add(1) % n;
    for (std::size_t w = 0; w < n; ++w) workers_[(first + w) % n]->push(chunks, w, n);
  }

 private:
  std::vector<std::unique_ptr<UringWorker>> workers_;
  std::atomic<std::size_t> next_worker_{0};
};

UringWorker::UringWorker(UringEngine* eng, int index, const AioConfig& cfg)
    : eng_(eng), cfg_(cfg), index_(index) {
  // The ring is created by its worker thread, its only user. Plain setup flags: measured
  // here against fio (strata-bench nvme --vs-fio), SINGLE_ISSUER|DEFER_TASKRUN made reads
  // slower (completion work then waits for the worker's next wait) and COOP_TASKRUN did not
  // help measurably.
  std::promise<int> ready;
  auto init = ready.get_future();
  thread_ = std::thread([this, &ready] {
    // (One SQE more than the queue depth: the wake poll's.)
    const int rc = io_uring_queue_init(static_cast<unsigned>(cfg_.queue_depth) + 1, &ring_, 0);
    ready.set_value(rc);
    if (rc == 0) run();
  });
  const int rc = init.get();
  if (rc < 0) {
    thread_.join();
    detail::throw_errno(
        __FILE__, __LINE__, "io_uring_queue_init", -rc,
        "cannot create an io_uring ring; set aio.engine to \"threads\" to use the thread pool");
  }
}

UringWorker::~UringWorker() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_one();
  thread_.join();
  io_uring_queue_exit(&ring_);
  if (wake_fd_ >= 0) ::close(wake_fd_);
}

void UringWorker::push(std::vector<Chunk*>& chunks, std::size_t begin, std::size_t step) {
  bool in_ring = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (std::size_t i = begin; i < chunks.size(); i += step) queue_.push_back(chunks[i]);
    in_ring = waiting_in_ring_;
  }
  if (in_ring) {
    const std::uint64_t one = 1;
    (void)!::write(wake_fd_, &one, sizeof one);  // (a full counter is still readable: a wake)
  } else {
    cv_.notify_one();
  }
}

bool UringWorker::arm_wake() {
  if (wake_fd_ < 0 || wake_failed_) return false;
  if (!wake_sqe_pending_) {
    io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
    if (!sqe) return false;
    io_uring_prep_poll_add(sqe, wake_fd_, POLLIN);
    io_uring_sqe_set_data(sqe, this);  // (a chunk's is the Chunk)
    wake_sqe_pending_ = true;
  }
  int rc;  // (called with no chunk unsent: the poll's is the only SQE)
  do rc = io_uring_submit(&ring_);
  while (rc == -EINTR);
  if (rc < 1) return false;  // refused: it stays pending, for the next submit
  wake_sqe_pending_ = false;
  return true;
}

void UringWorker::disarm_wake() {
  if (!wake_armed_) return;
  // Fired, not removed: a removal is an SQE, and a submit would also hand the kernel any SQE a
  // given-up ring left behind. The ring is idle: the poll's is the only completion to come.
  const std::uint64_t one = 1;
  (void)!::write(wake_fd_, &one, sizeof one);
  for (;;) {
    io_uring_cqe* cqe = nullptr;
    const int rc = io_uring_wait_cqe(&ring_, &cqe);
    if (rc == -EINTR) continue;
    STRATA_CHECK(rc == 0, "io_uring_wait_cqe failed: {}", errno_text(-rc));
    const bool wake = io_uring_cqe_get_data(cqe) == this;
    // (Idle: no chunk is in the kernel, so the poll's is the only completion there can be.)
    STRATA_CHECK(wake, "nvme ring {}: a chunk's completion on an idle ring", index_);
    io_uring_cqe_seen(&ring_, cqe);
    break;
  }
  std::uint64_t n = 0;
  (void)!::read(wake_fd_, &n, sizeof n);
  wake_armed_ = false;
}

void UringWorker::run_idle(std::function<void(io_uring&)> cmd) {
  std::packaged_task<void()> task([this, &cmd] { cmd(ring_); });
  auto fut = task.get_future();
  {
    std::lock_guard<std::mutex> lock(mu_);
    commands_.push_back(std::move(task));
  }
  cv_.notify_one();
  fut.get();
}

void UringWorker::prep(Chunk* c) {
  io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
  int fd = c->fd;
  unsigned flags = 0;
  if (auto it = fixed_files_.find(fd); it != fixed_files_.end()) {
    fd = it->second;
    flags |= IOSQE_FIXED_FILE;
  }
  int buf_index = -1;
  if (!fixed_.empty()) {
    auto it = std::upper_bound(fixed_.begin(), fixed_.end(), c->buf,
                               [](const char* p, const Fixed& f) { return p < f.base; });
    if (it != fixed_.begin()) {
      --it;
      if (c->buf >= it->base && c->buf + c->bytes <= it->base + it->len)
        buf_index = int(it - fixed_.begin());
    }
  }
  const auto n = static_cast<unsigned>(c->bytes);
  if (c->op == IoOp::kRead) {
    if (buf_index >= 0)
      io_uring_prep_read_fixed(sqe, fd, c->buf, n, c->offset, buf_index);
    else
      io_uring_prep_read(sqe, fd, c->buf, n, c->offset);
  } else {
    if (buf_index >= 0)
      io_uring_prep_write_fixed(sqe, fd, c->buf, n, c->offset, buf_index);
    else
      io_uring_prep_write(sqe, fd, c->buf, n, c->offset);
  }
  sqe->flags |= flags;
  io_uring_sqe_set_data(sqe, c);
  Tracer& tracer = Tracer::global();
  c->issued_ns = tracer.enabled() ? tracer.now_ns() : 0;
}

// How long io_uring_submit may refuse (-EAGAIN, -EBUSY, -ENOMEM: the kernel short of
// memory or of request slots) before the ring is given up.
constexpr std::chrono::seconds kSubmitGiveUp{30};

void UringWorker::submit(std::size_t& inflight) {
  int rc = eng_->submit_fault(unsent_);
  if (rc == 0) {
    do rc = io_uring_submit(&ring_);
    while (rc == -EINTR);
  }
  if (rc == 0 && !unsent_.empty()) rc = -EAGAIN;  // took nothing, said nothing: a refusal
  if (rc > 0 && wake_sqe_pending_) {  // a refused wake poll went first: in the kernel now
    wake_sqe_pending_ = false;
    wake_armed_ = true;
    --rc;
    if (rc == 0 && !unsent_.empty()) rc = -EAGAIN;  // (none of the chunks taken: a refusal)
  }
  if (rc > 0) {
    for (int i = 0; i < rc && !unsent_.empty(); ++i) unsent_.pop_front();
    refusals_ = 0;
    return;
  }
  const auto now = std::chrono::steady_clock::now();
  if (refusals_++ == 0) refused_since_ = now;
  const bool transient = rc == -EAGAIN || rc == -EBUSY || rc == -ENOMEM;
  if (transient && now - refused_since_ < kSubmitGiveUp) {
    eng_->note_submit_refused();
    return;
  }
  if (transient) {
    give_up(-rc,
            fmt::format(
                "io_uring_submit refused it for {} s ({}): the kernel is short of memory or of I/O "
                "slots; free host memory (a smaller pinned budget), lower aio.queue_depth or "
                "aio.thread_count, or set aio.engine to \"threads\"",
                kSubmitGiveUp.count(), errno_text(-rc)),
            inflight);
  } else {
    give_up(
        -rc,
        fmt::format(
            "io_uring_submit failed ({}); this ring is given up: set aio.engine to \"threads\" to "
            "use the thread pool",
            errno_text(-rc)),
        inflight);
  }
}

std::chrono::milliseconds UringWorker::backoff() const {
  return std::chrono::milliseconds(std::min(50, 1 << std::min(refusals_, 6)));
}

void UringWorker::give_up(int err, const std::string& why, std::size_t& inflight) {
  log::error("nvme ring {}: {}", index_, why);
  broken_ = why;
  broken_err_ = err;
  // Their SQEs stay in the ring untaken: nothing submits again, and the ring's exit drops them.
  for (Chunk* c : std::exchange(unsent_, {})) {
    eng_->fail_unsent(c, why, err);
    --inflight;
  }
}

void UringWorker::run() {
  std::deque<Chunk*> local;  // taken from the queue, or requeued, not yet in the ring
  std::size_t inflight = 0;
  wake_fd_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  const std::size_t qd = static_cast<std::size_t>(cfg_.queue_depth);
  const std::string lane = fmt::format("nvme{}", index_);
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      if (local.empty() && inflight == 0)
        cv_.wait(lock, [&] { return stop_ || !queue_.empty() || !commands_.empty(); });
      while (inflight == 0 && !commands_.empty()) {
        auto task = std::move(commands_.front());
        commands_.pop_front();
        lock.unlock();
        disarm_wake();  // an idle ring: kernels before 5.18 quiesce it to register buffers or files
        task();
        lock.lock();
      }
      while (!queue_.empty()) {
        local.push_back(queue_.front());
        queue_.pop_front();
      }
      if (stop_ && local.empty() && inflight == 0) return;
    }
    std::size_t room = qd - inflight;
    if (!cfg_.overlap_events && inflight > 0) room = 0;
    // Once the ring is given up nothing is prepared or submitted again: io_uring_submit would
    // hand the kernel the SQEs of the chunks give_up() failed (it submits from head to tail).
    while (broken_.empty() && room > 0 && !local.empty() && io_uring_sq_space_left(&ring_) > 0) {
      prep(local.front());
      unsent_.push_back(local.front());
      local.pop_front();
      ++inflight;
      --room;
      if (solo_submit_) submit(inflight);
    }
    if (!unsent_.empty()) submit(inflight);
    if (!broken_.empty()) {  // the ring was given up (now or before): what was not prepared fails
                             // the same way
      for (Chunk* c : local) eng_->fail_unsent(c, broken_, broken_err_);
      local.clear();
    }
    if (inflight == 0) continue;
    if (inflight == unsent_.size()) {  // refused, and no completion to wait for: back off
      std::this_thread::sleep_for(backoff());
      continue;
    }
    if (!wake_armed_ && unsent_.empty() && broken_.empty()) wake_armed_ = arm_wake();
    {
      std::lock_guard<std::mutex> lock(mu_);
      // Chunks queued since the top that there is room for: taken there, not after a wait (and
      // with no room, a wake would take nothing).
      const bool room_now = inflight < qd && (cfg_.overlap_events || inflight == 0) &&
                            unsent_.empty() && broken_.empty();
      if (!queue_.empty() && room_now) continue;
      waiting_in_ring_ = wake_armed_ && room_now;
    }
    io_uring_cqe* cqe = nullptr;
    int rc = io_uring_wait_cqe(&ring_, &cqe);
    {
      std::lock_guard<std::mutex> lock(mu_);
      waiting_in_ring_ = false;
    }
    if (rc == -EINTR) continue;
    // Its chunks are in the kernel, writing into their buffers: the only safe ends are their
    // completions or the process's.
    STRATA_CHECK(rc == 0, "io_uring_wait_cqe failed: {}", errno_text(-rc));
    Tracer& tracer = Tracer::global();
    do {
      if (io_uring_cqe_get_data(cqe) == this) {  // the wake poll fired: new chunks are queued
        if (cqe->res < 0) wake_failed_ = true;   // refused by this kernel: chunks wait, as before
        io_uring_cqe_seen(&ring_, cqe);
        std::uint64_t n = 0;
        (void)!::read(wake_fd_, &n, sizeof n);
        wake_armed_ = false;  // (a one-shot poll: armed again before the next wait)
        continue;
      }
      auto* c = static_cast<Chunk*>(io_uring_cqe_get_data(cqe));
      const long res = cqe->res;
      io_uring_cqe_seen(&ring_, cqe);
      --inflight;
      const IoOp op = c->op;
      const std::size_t bytes = c->bytes;
      // The span is the chunk's time in the drive (submission to completion), so the union
      // of a lane's spans is the time the drive had work: its busy time in a step.
      // Recorded before the completion is handed on: a waiter released by it may stop the
      // tracer, and the request's span belongs to what it waited for.
      const std::int64_t t0 = c->issued_ns;
      if (t0 && tracer.enabled())
        tracer.record(op == IoOp::kRead ? "nvme_read" : "nvme_write", lane, t0, tracer.now_ns(),
                      bytes);
      if (eng_->on_cqe(c, res)) local.push_front(c);
    } while (io_uring_peek_cqe(&ring_, &cqe) == 0);
  }
}

// ---- pread/pwrite thread pool ----

class ThreadEngine final : public EngineBase {
 public:
  ThreadEngine(const AioConfig& cfg, std::vector<Fault> faults)
      : EngineBase(cfg, std::move(faults)) {
    const int n = std::clamp(cfg.thread_count * cfg.queue_depth, 1, 256);
    for (int i = 0; i < n; ++i) threads_.emplace_back([this] { run(); });
  }
  ~ThreadEngine() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& t : threads_) t.join();
  }
  std::string describe() const override {
    return fmt::format("threads ({} pread/pwrite threads, {} KiB blocks)", threads_.size(),
                       cfg_.block_size / 1024);
  }
  IoBackend backend() const override { return IoBackend::kThreads; }
  bool register_buffers(std::span<const std::pair<void*, std::size_t>>) override { return false; }
  bool register_files(std::span<const int>) override { return false; }
  void unregister_files(std::span<const int>) override {}

 protected:
  void enqueue(std::vector<Chunk*>&& chunks) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (Chunk* c : chunks) queue_.push_back(c);
    }
    cv_.notify_all();
  }

 private:
  void run() {
    for (;;) {
      Chunk* c;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;
        c = queue_.front();
        queue_.pop_front();
      }
      Tracer& tracer = Tracer::global();
      for (;;) {
        const IoOp op = c->op;
        const std::size_t bytes = c->bytes;
        const std::int64_t t0 = tracer.enabled() ? tracer.now_ns() : 0;
        const ssize_t r = op == IoOp::kRead ? ::pread(c->fd, c->buf, bytes, off_t(c->offset))
                                            : ::pwrite(c->fd, c->buf, bytes, off_t(c->offset));
        if (t0)
          tracer.record(op == IoOp::kRead ? "nvme_read" : "nvme_write", "nvme-threads", t0,
                        tracer.now_ns(), bytes);
        if (!finish_chunk(c, r < 0 ? -long(errno) : long(r))) break;
      }
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Chunk*> queue_;
  bool stop_ = false;
  std::vector<std::thread> threads_;
};

std::unique_ptr<IoEngine> build(const AioConfig& cfg, std::vector<Fault> faults) {
  // <= 1 GiB as the aio parser says: an io_uring SQE carries a 32-bit length.
  STRATA_REQUIRE(cfg.block_size >= 4096 && (cfg.block_size & (cfg.block_size - 1)) == 0 &&
                     cfg.block_size <= (std::size_t(1) << 30),
                 "aio.block_size = {}: must be a power of two from 4096 to 1073741824 (1 GiB)",
                 cfg.block_size);
  STRATA_REQUIRE(cfg.queue_depth >= 1, "aio.queue_depth = {}: must be >= 1", cfg.queue_depth);
  STRATA_REQUIRE(cfg.thread_count >= 1, "aio.thread_count = {}: must be >= 1", cfg.thread_count);
  if (cfg.engine == IoBackend::kThreads)
    return std::make_unique<ThreadEngine>(cfg, std::move(faults));
  const nvme::UringProbe probe = nvme::probe_io_uring();
  if (!probe.available) {
    STRATA_REQUIRE(cfg.engine != IoBackend::kIoUring,
                   "aio.engine = \"io_uring\" but io_uring is unavailable here ({}); use \"auto\" "
                   "or \"threads\"",
                   probe.reason);
    log::warn_once("nvme.no_uring",
                   fmt::format("io_uring is unavailable ({}); NVMe I/O uses a pread/pwrite "
                               "thread pool instead (slower)",
                               probe.reason));
    return std::make_unique<ThreadEngine>(cfg, std::move(faults));
  }
  return std::make_unique<UringEngine>(cfg, std::move(faults));
}

}  // namespace

std::unique_ptr<IoEngine> make_io_engine(const AioConfig& config) {
  return build(config, config.inject_faults);
}

std::unique_ptr<IoEngine> make_fault_injecting_engine(const AioConfig& config,
                                                      std::vector<Fault> faults) {
  return build(config, std::move(faults));
}

int open_for_io(const std::string& path, int flags, DirectIo direct, bool* is_direct) {
  flags |= O_CLOEXEC;
  if (direct != DirectIo::kOff) {
    const int fd = ::open(path.c_str(), flags | O_DIRECT, 0644);
    if (fd >= 0) {
      if (is_direct) *is_direct = true;
      return fd;
    }
    const int err = errno;
    if (err != EINVAL || direct == DirectIo::kOn)
      detail::throw_errno(
          __FILE__, __LINE__, "open", err,
          fmt::format("cannot open '{}' for O_DIRECT I/O{}", path,
                      err == EINVAL ? " (the file system refuses O_DIRECT; set aio.direct to "
                                      "\"auto\" or false)"
                                    : ""));
    log::warn_once("nvme.no_direct",
                   fmt::format("the file system of '{}' refuses O_DIRECT (tmpfs does); using "
                               "buffered I/O through the page cache",
                               path));
  }
  const int fd = ::open(path.c_str(), flags, 0644);
  if (fd < 0)
    detail::throw_errno(__FILE__, __LINE__, "open", errno, fmt::format("cannot open '{}'", path));
  if (is_direct) *is_direct = false;
  return fd;
}

}  // namespace strata
