// The NVMe tier: an asynchronous I/O engine (io_uring, or a pread/pwrite thread pool where
// io_uring is unavailable) and the swap store that keeps tensors in preallocated files.
//
// The engine moves bytes between files and (pinned) host buffers. A request is split into
// `block_size` chunks; each worker thread owns one ring with at most `queue_depth` chunks in
// flight; short transfers and -EAGAIN are requeued; any other failure completes the request
// with a strata::Error naming the operation, file and offset. Nothing blocks a compute
// stream: completion is an IoHandle to poll, wait on, or attach a callback to.
//
// The swap store maps keys to 4 KiB-aligned extents in files it preallocates (fallocate)
// under <nvme_path>/strata-swap/rank<N>/, striped across several paths in `block_size`
// stripes. It checks free space before it grows, verifies optional per-stripe checksums on
// read, deletes its files on clean exit, and clears a previous run's files on start-up.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace strata {

// What the fault-injecting engine does to chosen chunks. Chunks are numbered 0, 1, 2, ... in
// the order submit() splits requests into chunks; each fault fires once, on its chunk's
// first completion (after the real I/O ran, so data stays consistent).
enum class FaultKind {
  kShort,   // report only part of the transfer: the engine must requeue the rest (O_DIRECT:
            // whole 4 KiB blocks, so a chunk of one block is not shortened)
  kEagain,  // report -EAGAIN: the engine must requeue the chunk
  kEio,     // report -EIO: the batch fails naming file and offset
  kEnospc,  // report -ENOSPC: likewise
  kDelay,   // hold the completion for delay_ms
  // io_uring only; these fire when the chunk is submitted, not when it completes:
  kSubmitEagain,  // the io_uring_submit that carries the chunk takes nothing and says -EAGAIN
                  // (the kernel short of memory): the worker must try again, not spin or stop
  kSubmitEinval,  // ... says -EINVAL: the worker gives the ring up; what it had not submitted
                  // fails naming file and offset, and so does every later chunk (no hang)
};
struct Fault {
  FaultKind kind = FaultKind::kShort;
  std::uint64_t chunk = 0;
  std::uint32_t delay_ms = 0;
  // Completions of the chunk it fires on, in a row (kEagain: a drive that keeps saying it);
  // every other kind fires once, at the chunk's first completion (or submission).
  std::uint32_t times = 1;
};

// ---- configuration: the DeepSpeed-style "aio" block, plus strata's own keys ----
enum class IoBackend { kAuto, kIoUring, kThreads };
enum class DirectIo { kAuto, kOn, kOff };

struct AioConfig {
  std::size_t block_size = std::size_t(1)
                           << 20;  // bytes per request chunk (power of two, 4 KiB - 1 GiB)
  int queue_depth = 8;             // chunks in flight per ring
  int thread_count = 1;            // rings (worker threads); alias intra_op_parallelism
  bool single_submit = false;      // one submit call per chunk instead of batches
  bool overlap_events = true;      // keep the queue full while reaping (false: drain, then refill)
  bool use_hugepages = true;       // staging buffers from huge pages where the machine has them
  bool verify = false;             // per-stripe checksums (xxh3), checked on every read
  // strata additions:
  IoBackend engine = IoBackend::kAuto;  // "auto" | "io_uring" | "threads"
  DirectIo direct =
      DirectIo::kAuto;  // O_DIRECT: "auto" (fall back to buffered where refused) | true | false
  bool register_buffers = true;  // io_uring fixed buffers for pool memory
  // Tests only (not read from JSON): engines built from this config inject these faults.
  std::vector<Fault> inject_faults;
};

// Parses an "aio" object, or a whole ds_config whose "aio" key holds one (absent = defaults).
// Unknown keys warn once; wrong types and impossible values throw strata::Error naming the
// key and the allowed values.
AioConfig parse_aio_config(std::string_view json_text);
// Whether `json_text` holds an aio block as parse_aio_config finds one (a ds_config's "aio", or
// the block itself); without one, parse_aio_config gives the defaults.
bool has_aio_block(std::string_view json_text);
const char* io_backend_name(IoBackend b);

// ---- the engine ----
enum class IoOp : std::uint8_t { kRead, kWrite };

struct IoRequest {
  IoOp op = IoOp::kRead;
  int fd = -1;
  std::uint64_t offset = 0;
  void* buf = nullptr;
  std::size_t bytes = 0;
  // For messages: the file's path and what the bytes are (optional; the store sets both,
  // the tag to "swap key 'K'").
  const std::string* path = nullptr;
  const std::string* tag = nullptr;
  // Checksums (optional): a write stores the xxh3-64 of its bytes in *checksum; a read with
  // `verify` compares the bytes read against *checksum and fails naming file and offset.
  std::uint64_t* checksum = nullptr;
  bool verify = false;
};

namespace detail {
struct IoBatch;
}

// Completion of one submit() call. Cheap to copy.
class IoHandle {
 public:
  IoHandle() = default;
  explicit IoHandle(std::shared_ptr<detail::IoBatch> b) : batch_(std::move(b)) {}
  bool valid() const noexcept { return batch_ != nullptr; }
  bool done() const;
  // Blocks until every chunk completed; throws the first failure (strata::Error).
  void wait() const;
  // As wait(), with a limit: false if not done in time (nothing is cancelled).
  bool wait_for(std::chrono::milliseconds limit) const;
  // Runs `fn` once when the batch completes (at once if it already has), on the thread that
  // completes it; `error` is null on success. Keep it short: it runs on an I/O worker. It has
  // run, and been destroyed, before done() is true and wait() returns — so it must not wait on
  // its own handle, nor on any other I/O of this engine (that I/O may be queued to the very
  // worker running the callback: it would never complete). What it throws is logged, not passed on.
  void on_complete(std::function<void(std::exception_ptr error)> fn) const;

 private:
  std::shared_ptr<detail::IoBatch> batch_;
};

struct IoStats {
  std::uint64_t bytes_read = 0, bytes_written = 0;
  std::uint64_t chunks = 0;
  std::uint64_t requeued_short = 0, requeued_eagain = 0;
  std::uint64_t submits_refused = 0;  // io_uring_submit calls the kernel refused, tried again
  std::uint64_t errors = 0;
  std::uint64_t checksum_ns = 0;  // time spent hashing (write) and verifying (read)
};

class IoEngine {
 public:
  virtual ~IoEngine() = default;
  // "io_uring (2 rings, QD 32, 1 MiB blocks, fixed buffers)" or "threads (...)".
  virtual std::string describe() const = 0;
  virtual IoBackend backend() const = 0;
  // Queues the requests (split into block_size chunks) and returns at once. Requests on
  // O_DIRECT files must have offset, length and buffer address aligned to 4096: otherwise
  // strata::Error at the call, naming the request. Buffers must stay valid until done.
  virtual IoHandle submit(std::span<const IoRequest> requests) = 0;
  // (optional) Registers host memory as fixed buffers (io_uring) so chunks inside it skip
  // the per-I/O page pinning. Call while no I/O is in flight. Returns false when unused.
  virtual bool register_buffers(std::span<const std::pair<void*, std::size_t>> regions) = 0;
  // (optional) Registers files so their chunks use fixed-file slots.
  virtual bool register_files(std::span<const int> fds) = 0;
  // Drops those of `fds` that are registered (before they are closed: a slot keeps its file
  // open, and a later file given the same fd number would be read and written through it).
  // Call while none of their I/O is in flight.
  virtual void unregister_files(std::span<const int> fds) = 0;
  virtual IoStats stats() const = 0;
};

// Builds the engine `config.engine` asks for; "auto" falls back from io_uring to the thread
// pool with one warning when the kernel or a seccomp profile refuses io_uring.
std::unique_ptr<IoEngine> make_io_engine(const AioConfig& config);
// The same engine with `faults` injected into chunk completions (tests).
std::unique_ptr<IoEngine> make_fault_injecting_engine(const AioConfig& config,
                                                      std::vector<Fault> faults);

// Opens `path` for the engine: O_DIRECT per `direct` (kAuto falls back to buffered I/O with
// one warning where the file system refuses it, as tmpfs does). Sets *is_direct.
int open_for_io(const std::string& path, int flags, DirectIo direct, bool* is_direct);

// ---- the swap store ----
struct SwapStoreOptions {
  std::vector<std::string> paths;  // one or more existing, writable directories (striped)
  int rank = 0;
  // The job's ranks. With it, rank 0's store removes (saying so) the swap folders of ranks >= it
  // that a process of this host left when it died (SIGKILL, an MPI_Abort): each rank's lock file
  // names its host and pid, and one whose lock no process holds and whose pid is gone is dead.
  // 0: such folders are left alone.
  int world_size = 0;
  AioConfig aio;
  std::string config_key = "nvme_path";  // named in error messages
};

struct SwapStoreStats {
  std::size_t reserved_bytes = 0;  // sum of extents (4 KiB-rounded)
  std::size_t file_bytes = 0;      // preallocated on disk, all files
  std::uint64_t bytes_written = 0, bytes_read = 0;
  bool direct = false;
};

// Makes SIGINT, SIGTERM and SIGHUP (Ctrl-C, mpirun passing one on, a scheduler's kill, a closed
// terminal or dropped ssh), and SIGBUS (a data file cut short under its mapping), delete the swap
// files of every live SwapStore, and the temporary file of a prepared corpus being written,
// before the process ends by the signal as it would have: an interrupted run's optimizer state
// can fill most of a drive, and otherwise stays until the next run in the same folder. A handler
// the program installed itself is left in place. For tools; a program embedding strata may call
// it too.
void remove_swap_files_on_interrupt();
// Deletes those files now (async-signal-safe: for a process about to end without its
// destructors, e.g. the comm layer's MPI_Abort).
void remove_swap_files_now() noexcept;
// A line that handler writes to stderr first (up to 1 KiB; "" for none), e.g. where to resume
// from: an interrupted run otherwise just stopped. Any thread may replace it at any time.
void set_interrupt_note(std::string_view text) noexcept;

class SwapStore {
 public:
  // Takes the rank's directory under each path (removing a previous run's files), or
  // throws naming the key and path: missing, not a directory, read-only, in use by a
  // live process. `engine` may be shared; null = the store makes its own from opts.aio.
  explicit SwapStore(const SwapStoreOptions& opts, IoEngine* engine = nullptr);
  // Waits for outstanding I/O, then deletes the store's files and directories.
  ~SwapStore();
  SwapStore(const SwapStore&) = delete;
  SwapStore& operator=(const SwapStore&) = delete;

  // Bytes a buffer for a `bytes`-byte tensor must span: I/O moves whole 4 KiB pages.
  static std::size_t padded_bytes(std::size_t bytes);
  // The bytes a store of `rank` could grow into under `paths`: each file system's free bytes
  // (statvfs f_bavail, a file system counted once however many paths are on it) plus what a
  // previous run of the rank left there (a new store removes it). With `ranks_sharing` > 1
  // (ranks of one node under the same paths) each file system's free bytes are split evenly
  // among them. With `world_size` > 0, what dead ranks >= it left there (see
  // SwapStoreOptions::world_size; rank 0's store removes it) counts as free too. Throws naming
  // `config_key` when a path is missing or unreadable. For the memory plan, before any store
  // exists.
  static std::uint64_t free_bytes(const std::vector<std::string>& paths, int rank,
                                  const std::string& config_key, int ranks_sharing = 1,
                                  int world_size = 0);

  // Reserves an extent for `key`, growing the files after checking free space (statvfs):
  // refuses with the bytes needed and available, before anything is written.
  void reserve(const std::string& key, std::size_t bytes);
  bool contains(const std::string& key) const;
  // Writes / reads padded_bytes(bytes) between `buf` (4096-aligned) and key's extent.
  // reserve() first, or write() reserves on first use. read() of a never-written key throws.
  IoHandle write(const std::string& key, const void* buf, std::size_t bytes);
  IoHandle read(const std::string& key, void* buf, std::size_t bytes);

  SwapStoreStats stats() const;
  std::vector<std::string> files() const;
  IoEngine& engine();

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace strata
