// NcclCommunicator: collectives over NCCL on CUDA device memory, one communicator per
// process and GPU. Built into the CUDA module (libstrata_cuda.so, src/gpu/cuda_module.h);
// make_communicator reaches it through the module's table.
//
// Owns: the ncclComm_t, a 256-byte scratch of the GPU's memory outside the Device's budget
// (barrier's one-element all-reduce; the GPU ordinal of the Device is learnt from a probe
// stream, through cudaStreamGetDevice), and a watchdog. Bootstrap: rank 0 makes the unique
// id and MPI broadcasts it, or without MPI (torchrun, srun without --mpi) the launch's TCP
// rendezvous hands it out (one rank needs neither). The communicator is non-blocking
// (ncclCommInitRankConfig, blocking = 0): NCCL finishes its bootstrap, and any call that returns
// ncclInProgress, in the background, and settle() polls ncclCommGetAsyncError until it has, against
// the timeout, so a rank that died before joining ends the job (ncclCommAbort, then abort_job,
// naming the call) instead of hanging the others in ncclCommInitRank. Invariants:
//  - Collectives are ncclXxx calls on the stream's cudaStream_t (Stream::native_handle),
//    made with this GPU current; coalesced calls are one ncclGroupStart/End.
//  - After each call a cudaEvent is recorded on the stream and handed to the watchdog,
//    which polls it and ncclCommGetAsyncError. A collective still running after the
//    timeout (measured from when it was queued, as the GPU's start is not observable
//    cheaply) or an async NCCL error aborts the communicator (ncclCommAbort, so no kernel
//    spins forever) and then the job, with the collective, the rank and the elapsed time.
// Never: synchronizes the caller's stream, or the device outside making a communicator (its
// scratch) and the destructor.
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "comm/comm_internal.h"
#include "gpu/cuda_check.h"
#include "gpu/cuda_module.h"
#include "gpu/cuda_trace.h"
#include "gpu/nccl_version.h"
#include "strata/error.h"
#include "strata/log.h"

#define STRATA_NCCL_CHECK(expr)                                                                   \
  do {                                                                                            \
    const ncclResult_t strata_nccl_rc_ = (expr);                                                  \
    if (strata_nccl_rc_ != ncclSuccess) [[unlikely]]                                              \
      ::strata::detail::throw_error(                                                              \
          ::strata::ErrorKind::kNccl, __FILE__, __LINE__, #expr, "NCCL call failed",              \
          ::fmt::format("{} (result {}); set NCCL_DEBUG=WARN for more",                           \
                        ncclGetErrorString(strata_nccl_rc_), static_cast<int>(strata_nccl_rc_))); \
  } while (0)

namespace strata::comm {
namespace {

// Waits until a non-blocking communicator has finished the call that returned `rc` (settled
// calls and failures return at once). Past `timeout_s` the communicator is aborted (so no
// kernel waits on dead peers) and the job ends, naming `what`.
void settle(ncclComm_t comm, ncclResult_t rc, const char* what, const char* file, int line,
            int rank, int world_size, double timeout_s) {
  if (rc == ncclInProgress) {
    wait_in_progress(
        [&] {
          ncclResult_t state = ncclInProgress;
          const ncclResult_t q = ncclCommGetAsyncError(comm, &state);
          rc = q != ncclSuccess ? q : state;
          return rc == ncclInProgress ? Progress::kInProgress
                 : rc == ncclSuccess  ? Progress::kDone
                                      : Progress::kFailed;
        },
        timeout_s,
        [&](double waited) {
          (void)ncclCommAbort(comm);  // frees the GPU from kernels waiting on dead peers
          abort_job(Watchdog::timeout_message(what, rank, world_size, waited, timeout_s));
        });
  }
  if (rc != ncclSuccess)
    detail::throw_error(ErrorKind::kNccl, file, line, what, "NCCL call failed",
                        fmt::format("{} (result {}); set NCCL_DEBUG=WARN for more",
                                    ncclGetErrorString(rc), static_cast<int>(rc)));
}

ncclDataType_t nccl_type(DType t) {
  switch (t) {
    case DType::kF32:
      return ncclFloat32;
    case DType::kBF16:
      return ncclBfloat16;
    case DType::kF16:
      return ncclFloat16;
    case DType::kF64:
      return ncclFloat64;
  }
  return ncclFloat32;
}

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return ncclSum;
    case ReduceOp::kAvg:
      return ncclAvg;
    case ReduceOp::kMax:
      return ncclMax;
  }
  return ncclSum;
}

// Makes `ordinal` the calling thread's current GPU and leaves it so (restoring a fresh thread's
// device 0 would create a context on GPU 0 for every rank: see cuda_device.cpp's DeviceGuard).
class GpuGuard {
 public:
  explicit GpuGuard(int ordinal) {
    int current = -1;
    STRATA_CUDA_CHECK(cudaGetDevice(&current));
    if (current != ordinal) STRATA_CUDA_CHECK(cudaSetDevice(ordinal));
  }
};

// 256 bytes of the GPU's memory, zeroed, outside the Device's allocator: the communicator's own,
// as a stream's resources are the backend's (the engine's memory plan counts the buffers it
// allocates; a Buffer here put the device's peak 512 bytes past the plan on an NVIDIA H200).
class Scratch {
 public:
  static constexpr std::size_t kBytes = 256;
  explicit Scratch(int ordinal) : ordinal_(ordinal) {
    GpuGuard guard(ordinal);
    STRATA_CUDA_CHECK(cudaMalloc(&ptr_, kBytes));
    cudaError_t err = cudaMemset(ptr_, 0, kBytes);
    if (err == cudaSuccess) err = cudaDeviceSynchronize();
    if (err != cudaSuccess) {
      (void)cudaFree(ptr_);
      STRATA_CUDA_CHECK(err);
    }
  }
  ~Scratch() {
    if (ptr_ == nullptr) return;
    if (cudaSetDevice(ordinal_) != cudaSuccess || cudaFree(ptr_) != cudaSuccess)
      (void)cudaGetLastError();
  }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  void* data() const { return ptr_; }

 private:
  int ordinal_;
  void* ptr_ = nullptr;
};

// A completion marker of one collective, polled (and possibly destroyed) by the watchdog
// thread, which sets the event's GPU first: a fresh thread's current device is GPU 0.
struct DoneEvent {
  explicit DoneEvent(int ordinal) : ordinal(ordinal) {
    STRATA_CUDA_CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
  }
  ~DoneEvent() {
    (void)cudaSetDevice(ordinal);
    (void)cudaEventDestroy(ev);
  }
  // cudaSuccess, cudaErrorNotReady, or the failure of the work before it (a sticky fault is no
  // reason to wait on until the watchdog's timeout, which would call it "still running"). Read
  // by the watchdog and the enqueuing thread at once: nothing is stored.
  cudaError_t status() const {
    (void)cudaSetDevice(ordinal);
    const cudaError_t q = cudaEventQuery(ev);
    if (q != cudaSuccess) (void)cudaGetLastError();
    return q;
  }
  bool done() const { return status() != cudaErrorNotReady; }
  int ordinal;
  cudaEvent_t ev = nullptr;
};

// A call on the communicator, settled (see settle()).
#define STRATA_NCCL_SETTLE(expr) \
  settle(comm_, (expr), #expr, __FILE__, __LINE__, rank(), world_size(), timeout_s())

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(Device& device, double timeout_s, int rank, int world_size, int ordinal,
                   ncclComm_t comm, std::unique_ptr<Scratch> scratch)
      : Communicator(CommBackend::kNccl, device, rank, world_size, timeout_s),
        ordinal_(ordinal),
        comm_(comm),
        scratch_(std::move(scratch)),
        watchdog_(
            rank, world_size, timeout_s,
            [this](const std::string& msg) {
              abort_comm();  // frees the GPU from kernels waiting on dead peers
              abort_job(msg);
            },
            [this]() -> std::string {
              std::lock_guard<std::mutex> lock(comm_mu_);
              if (aborted_) return {};
              ncclResult_t r = ncclSuccess;
              if (ncclCommGetAsyncError(comm_, &r) != ncclSuccess || r == ncclSuccess ||
                  r == ncclInProgress)
                return {};
              return fmt::format(
                  "NCCL reported an asynchronous error: {} (result {}); ending the job",
                  ncclGetErrorString(r), static_cast<int>(r));
            }) {}

  ~NcclCommunicator() override {
    watchdog_.stop();  // it polls and may abort comm_, which is destroyed below
    std::vector<std::shared_ptr<DoneEvent>> pending;
    {
      std::lock_guard<std::mutex> lock(mu_);
      pending.swap(recent_);
    }
    for (auto& e : pending) (void)cudaEventSynchronize(e->ev);
    if (aborted_) return;  // comm_ is gone
    bool finalized = false;
    try {
      STRATA_NCCL_SETTLE(ncclCommFinalize(comm_));  // non-blocking: flushed in the background
      finalized = true;
    } catch (const std::exception& e) {
      log::warn("rank {}: {}", rank(), e.what());
    }
    // After an error NCCL's rule is to abort: a destroy could wait for work that never ends.
    if (finalized)
      (void)ncclCommDestroy(comm_);
    else
      (void)ncclCommAbort(comm_);
  }

 protected:
  // The NCCL calls of one collective (a group's members when there are several tensors).
  void enqueue_calls(const Collective& c, cudaStream_t s) {
    if (c.kind == Kind::kBarrier) {
      float* one = static_cast<float*>(scratch_->data());
      STRATA_NCCL_SETTLE(ncclAllReduce(one, one, 1, ncclFloat32, ncclSum, comm_, s));
    }
    for (std::size_t i = 0; i < c.inputs.size(); ++i) {
      const TensorRef& in = c.inputs[i];
      const ncclDataType_t t = nccl_type(in.dtype);
      switch (c.kind) {
        case Kind::kBarrier:
          break;
        case Kind::kAllGather:
          STRATA_NCCL_SETTLE(
              ncclAllGather(in.mem.ptr, c.outputs[i].mem.ptr, in.numel, t, comm_, s));
          break;
        case Kind::kReduceScatter:
          STRATA_NCCL_SETTLE(ncclReduceScatter(in.mem.ptr, c.outputs[i].mem.ptr, c.outputs[i].numel,
                                               t, nccl_op(c.op), comm_, s));
          break;
        case Kind::kAllReduce:
          STRATA_NCCL_SETTLE(
              ncclAllReduce(in.mem.ptr, in.mem.ptr, in.numel, t, nccl_op(c.op), comm_, s));
          break;
        case Kind::kBroadcast:
          STRATA_NCCL_SETTLE(ncclBroadcast(in.mem.ptr, in.mem.ptr, in.numel, t, c.root, comm_, s));
          break;
        case Kind::kGather: {
          // Point to point in one group: the root receives block r from rank r and copies its own.
          const std::size_t bytes = in.numel * dtype_size(in.dtype);
          char* out = c.outputs.empty() ? nullptr : static_cast<char*>(c.outputs[i].mem.ptr);
          STRATA_NCCL_CHECK(ncclGroupStart());
          try {
            if (out) {
              for (int r = 0; r < world_size(); ++r)
                if (r != rank())
                  STRATA_NCCL_CHECK(
                      ncclRecv(out + std::size_t(r) * bytes, in.numel, t, r, comm_, s));
            } else {
              STRATA_NCCL_CHECK(ncclSend(in.mem.ptr, in.numel, t, c.root, comm_, s));
            }
          } catch (...) {
            (void)ncclGroupEnd();
            throw;
          }
          STRATA_NCCL_SETTLE(ncclGroupEnd());
          char* mine = out ? out + std::size_t(rank()) * bytes : nullptr;
          if (mine && mine != in.mem.ptr)
            STRATA_CUDA_CHECK(
                cudaMemcpyAsync(mine, in.mem.ptr, bytes, cudaMemcpyDeviceToDevice, s));
          break;
        }
      }
    }
  }

  // ncclCommSplit, non-blocking like the bootstrap: settled within the timeout.
  std::unique_ptr<Communicator> do_split(int color, const std::vector<int>& members) override {
    const int key = int(std::find(members.begin(), members.end(), rank()) - members.begin());
    GpuGuard guard(ordinal_);
    ncclComm_t sub = nullptr;
    {
      std::lock_guard<std::mutex> nccl_lock(comm_mu_);
      STRATA_REQUIRE(!aborted_,
                     "Communicator::split: the NCCL communicator was aborted (a collective timed "
                     "out or failed); the job is ending");
      ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
      config.blocking = 0;
      const ncclResult_t rc = ncclCommSplit(comm_, color, key, &sub, &config);
      try {
        if (rc != ncclSuccess && rc != ncclInProgress) STRATA_NCCL_CHECK(rc);
        // The split is a call on the parent: a non-blocking parent stays in progress until it is
        // polled, NCCL refuses its next call meanwhile ("Attempt to use communicator before the
        // previous operation returned ncclSuccess", ncclInvalidArgument: every collective after
        // a split failed so on an H200), and NCCL's thread writes the child's handle into `sub`
        // before it marks the parent done. So the parent first, whatever the split returned;
        // then the child.
        settle(comm_, ncclInProgress, "ncclCommSplit (every rank of the communicator joins)",
               __FILE__, __LINE__, rank(), world_size(), timeout_s());
        STRATA_REQUIRE(sub != nullptr,
                       "ncclCommSplit gave no communicator for color {} (rank {}); every member "
                       "of a group must pass its color",
                       color, rank());
        settle(sub, ncclInProgress, "ncclCommSplit (the new communicator)", __FILE__, __LINE__,
               rank(), world_size(), timeout_s());
      } catch (...) {
        if (sub) (void)ncclCommAbort(sub);  // read only once the parent settled (above)
        throw;
      }
    }
    std::unique_ptr<Scratch> scratch;
    try {
      scratch = std::make_unique<Scratch>(ordinal_);
    } catch (...) {
      (void)ncclCommAbort(sub);
      throw;
    }
    return std::make_unique<NcclCommunicator>(device(), timeout_s(), key, int(members.size()),
                                              ordinal_, sub, std::move(scratch));
  }

  void do_enqueue(const Collective& c, Stream& stream) override {
    auto s = static_cast<cudaStream_t>(stream.native_handle());
    STRATA_REQUIRE(s != nullptr,
                   "{}: stream '{}' has no CUDA stream; use a stream of the CUDA device",
                   c.describe(), stream.name());
    GpuGuard guard(ordinal_);
    const bool group = c.inputs.size() > 1;
    {
      // No call while the watchdog aborts the communicator (which frees it), and none after.
      std::lock_guard<std::mutex> nccl_lock(comm_mu_);
      STRATA_REQUIRE(
          !aborted_,
          "{}: the NCCL communicator was aborted (a collective timed out or failed); the "
          "job is ending",
          c.describe());
      // While traced: the collective's GPU time, on the stream's lane.
      const gpu::GpuSpan span(c.name(), s, c.bytes());
      if (group) STRATA_NCCL_CHECK(ncclGroupStart());
      try {
        enqueue_calls(c, s);
      } catch (...) {
        if (group) (void)ncclGroupEnd();  // never leave the group open behind an error
        throw;
      }
      if (group) STRATA_NCCL_SETTLE(ncclGroupEnd());
    }
    auto done = std::make_shared<DoneEvent>(ordinal_);
    STRATA_CUDA_CHECK(cudaEventRecord(done->ev, s));
    // The SIGTERM note names the collective (a survivor of a killed peer says what it was in),
    // from when it was queued, as the watchdog measures it; cleared when none is in flight.
    const std::string what = c.describe();
    {
      // One lock for the count and the note: else the watchdog's last decrement can clear the
      // note of a collective queued between its fetch_sub and its note_done().
      std::lock_guard<std::mutex> nl(note_mu_);
      ++in_flight_;
      note_in_flight(what);
    }
    watchdog_.begin(what, [this, done, what] {
      const cudaError_t q = done->status();
      if (q == cudaErrorNotReady) return false;
      if (q != cudaSuccess)  // said now; the stream's next synchronize throws it
        log::error("collective {} on rank {}: the GPU reported {} ({})", what, rank(),
                   cudaGetErrorName(q), cudaGetErrorString(q));
      std::lock_guard<std::mutex> nl(note_mu_);
      if (--in_flight_ == 0) note_done();
      return true;
    });
    std::lock_guard<std::mutex> lock(mu_);
    std::erase_if(recent_, [](const std::shared_ptr<DoneEvent>& e) { return e->done(); });
    recent_.push_back(std::move(done));
  }

 private:
  int ordinal_;
  ncclComm_t comm_;
  std::unique_ptr<Scratch> scratch_;
  std::mutex mu_;
  std::vector<std::shared_ptr<DoneEvent>> recent_;  // not yet seen complete; the destructor waits
  std::mutex note_mu_;
  int in_flight_ = 0;  // collectives the watchdog has not yet seen complete (under note_mu_)
  // Guards comm_ against its abort: NCCL calls and polls take it; abort_comm() frees comm_ once.
  std::mutex comm_mu_;
  bool aborted_ = false;
  void abort_comm() {
    std::lock_guard<std::mutex> lock(comm_mu_);
    if (aborted_) return;
    aborted_ = true;
    (void)ncclCommAbort(comm_);
  }
  Watchdog watchdog_;  // last: its thread polls the members above
};

}  // namespace

std::unique_ptr<Communicator> create_nccl_communicator(Device& device, double timeout_s) {
  int code = 0;
  STRATA_NCCL_CHECK(ncclGetVersion(&code));
  using gpu::decode_nccl_version, gpu::kMinNcclCode, gpu::kMinNcclVersion;
  if (code < kMinNcclCode)
    STRATA_THROW(
        kUnsupported,
        "NCCL {} was loaded, and strata needs NCCL >= {} (bf16 and average reductions); install a "
        "newer one (pip install nvidia-nccl-cu{}, or the libnccl2 package) and put it first on the "
        "library path",
        decode_nccl_version(code).str(), kMinNcclVersion, CUDART_VERSION / 1000);
  const LaunchInfo li = init_launch();  // MPI under an MPI launcher, else the TCP rendezvous
  int ordinal = 0;
  {
    const std::unique_ptr<Stream> probe = device.create_stream("nccl-probe");
    STRATA_CUDA_CHECK(
        cudaStreamGetDevice(static_cast<cudaStream_t>(probe->native_handle()), &ordinal));
  }
  int count = 0;
  STRATA_CUDA_CHECK(cudaGetDeviceCount(&count));
  if (li.world_size > 1 && count > 0 && ordinal != launch_gpu_ordinal(li, count))
    log::warn(
        "rank {} (local rank {}) uses GPU {} but the launch layout suggests GPU {}; create the "
        "device "
        "with strata::launch_gpu_ordinal()",
        li.rank, li.local_rank, ordinal, launch_gpu_ordinal(li, count));
  auto scratch = std::make_unique<Scratch>(ordinal);
  ncclUniqueId id{};
  if (li.rank == 0) STRATA_NCCL_CHECK(ncclGetUniqueId(&id));
  if (li.world_size > 1) bootstrap_broadcast_bytes(&id, sizeof id, timeout_s);
  ncclComm_t comm = nullptr;
  {
    // Every rank joins NCCL's bootstrap: non-blocking, so a rank that died before joining ends
    // the job after the timeout (settle) instead of hanging the rest.
    GpuGuard guard(ordinal);
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    const ncclResult_t rc = ncclCommInitRankConfig(&comm, li.world_size, id, li.rank, &config);
    try {
      if (rc != ncclSuccess && rc != ncclInProgress) STRATA_NCCL_CHECK(rc);
      settle(comm, rc, "ncclCommInitRankConfig (NCCL's bootstrap, which every rank joins)",
             __FILE__, __LINE__, li.rank, li.world_size, timeout_s);
    } catch (...) {
      if (comm) (void)ncclCommAbort(comm);  // its bootstrap and proxy threads, its sockets
      throw;
    }
  }
  // Its buffers are device memory strata's allocator does not see: the default cap is measured
  // again now that they exist (those NCCL connects lazily, at the first collectives, come out of
  // the cap's headroom).
  gpu::backend::remeasure_default_capacity(device);
  if (li.world_size > 1) install_termination_note(li.rank, li.world_size);
  log::debug("nccl communicator: rank {} of {} on GPU {}, timeout {} s", li.rank, li.world_size,
             ordinal, timeout_s);
  return std::make_unique<NcclCommunicator>(device, timeout_s, li.rank, li.world_size, ordinal,
                                            comm, std::move(scratch));
}

}  // namespace strata::comm
