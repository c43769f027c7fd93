// CudaDevice: the Device contract (strata/device.h) on one CUDA GPU, plus the CUDA probe and
// the version / device reports: the CUDA module's side of cuda_module.h (built into
// libstrata_cuda.so, which the loader, cuda_loader.cpp, loads once the CUDA libraries are found).
//
// What it owns:
//  - A caching allocator over cudaMalloc with the emulated device's placement rule
//    (core/range_pool.h): requests are rounded (512 B up to 1 MiB, 64 KiB above, as on the
//    emulated device), placed best-fit in segments (each one cudaMalloc: 2 MiB for small
//    blocks, the block rounded up to 2 MiB for large ones), split, and merged with their free
//    neighbours when freed; bytes_in_use is the sum of live rounded sizes and of the blocks freed
//    on a stream that may still use them (until their event completes or that stream takes
//    them again), as HostDevice counts a free its stream has not reached: the memory the GPU
//    may still touch, which the memory plan bounds.
//  - Stream-ordered reuse, as cudaFreeAsync does it: a block freed by a buffer allocated on
//    stream S gets an event recorded on S at free time and waits beside the pool. S may reuse
//    it at once (its later work runs after the earlier work that used it); it joins the pool
//    (and so any other stream, or an allocation without a stream) once that event has
//    completed. A buffer allocated without a stream (or whose stream is gone) joins the pool
//    after cudaDeviceSynchronize.
//  - The budget: bytes_reserved (every segment held from cudaMalloc) never exceeds
//    capacity_bytes. An allocation that fits no free range and whose new segment would cross
//    it first waits for the pending frees' events (num_alloc_waits; with the allocator's lock
//    released: a host function may need it to free what those events wait for), then returns
//    wholly free segments to CUDA; if it still does not fit it throws kOutOfMemory. Inside a
//    host function (its stream held until it returns) the allocator never waits for the GPU,
//    which would be waiting for itself: such an allocation takes what is free now or fails,
//    and a streamless free there joins the pool at the next device-wide wait (synchronize, or
//    an allocation short of room), as on HostDevice.
//  - CudaStream: a non-blocking cudaStream_t with its own cuBLAS handle, sum_squares and AdamW
//    scratch and host-function flag (StreamResources: made on first use, outside the
//    budget, as they are the backend's and not the caller's). A destroyed stream hands them
//    back to the device for the next stream, and only the device's destructor frees them:
//    cudaFree / cudaFreeHost / cublasDestroy synchronize the whole device, which must not
//    happen behind the caller's back while another stream waits for a host function.
//  - Host functions run on the stream's own worker thread, never on CUDA's callback thread:
//    a short cudaLaunchHostFunc hands the function to the worker and a one-thread kernel
//    holds the stream until the worker advances a pinned flag. CUDA forbids host functions
//    that block on anything not ordered before them (and may run all streams' callbacks on
//    one thread); ours may block, may call strata (but not synchronize their own stream),
//    and block only their own stream, as on HostDevice. An exception they throw is kept and
//    rethrown by the next synchronize().
//  - Copies never block the caller. CUDA copies to or from pageable host memory
//    synchronously, so those go through pinned staging chunks in stream order (host memcpy on
//    the stream's host worker, DMA from or to the chunk); host-to-host copies run on the worker
//    too. Never a memcpy on CUDA's callback thread: CUDA may run every stream's callbacks on
//    that one thread, so one stream's copy would hold up the others' host steps.
//  - While the tracer is on, every op is a GPU-timed span of its stream's lane (cuda_trace.h),
//    recorded at the next synchronize.
//
// Invariants: every CUDA / cuBLAS call and kernel launch is checked; the calling thread's
// current device is set to this GPU for the duration of every call (DeviceGuard), so
// several CudaDevices can live in one process; the allocator's state changes only under
// mu_. Never link or call the driver API: binaries must start on machines without a driver.
#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <climits>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <exception>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#if defined(STRATA_HAVE_NCCL)
#include <nccl.h>

#include "gpu/nccl_version.h"
#endif

#include "core/range_pool.h"
#include "gpu/adamw.h"
#include "gpu/cuda_check.h"
#include "gpu/cuda_kernels.h"
#include "gpu/cuda_module.h"
#include "gpu/cuda_trace.h"
#include "gpu/model_kernels.h"
#include "strata/device.h"
#include "strata/error.h"
#include "strata/log.h"
#include "strata/trace.h"

namespace strata {
namespace {

using gpu::detail::throw_cuda;

constexpr std::size_t kSmallLimit = std::size_t(1) << 20;  // rounded to kSmallUnit up to here
constexpr std::size_t kSmallUnit = 512;
constexpr std::size_t kLargeUnit = std::size_t(64) << 10;   // the emulated device's large step
constexpr std::size_t kSegmentUnit = std::size_t(2) << 20;  // segments: multiples of 2 MiB

std::size_t round_block(std::size_t bytes) {
  const std::size_t unit = bytes <= kSmallLimit ? kSmallUnit : kLargeUnit;
  return (bytes + unit - 1) / unit * unit;
}

std::string gib(std::size_t bytes) {
  return fmt::format("{:.2f} GiB", double(bytes) / double(1u << 30));
}

// "13.0" from 13000; CUDA encodes versions as 1000 * major + 10 * minor.
std::string cuda_version_string(int v) { return fmt::format("{}.{}", v / 1000, (v % 1000) / 10); }

// Makes `ordinal` the calling thread's current device, and leaves it so. Restoring the previous
// one would, on a thread that never chose (current device 0), make every rank of a multi-GPU
// node create a context on GPU 0 (CUDA 12+: cudaSetDevice initializes the device's primary
// context), ~0.5 GiB of rank 0's memory each; and calls that launch into the current device
// (the model's kernels, cuBLASLt) want the rank's GPU current anyway. Every strata call that
// touches a device sets its own, so a thread serving several GPUs is still right.
class DeviceGuard {
 public:
  explicit DeviceGuard(int ordinal) {
    int current = -1;
    STRATA_CUDA_CHECK(cudaGetDevice(&current));
    if (current != ordinal) STRATA_CUDA_CHECK(cudaSetDevice(ordinal));
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;
};

// True when `ev` has completed; false while pending. Other results are failures of the
// work before it and throw.
bool event_done(cudaEvent_t ev) {
  const cudaError_t err = cudaEventQuery(ev);
  if (err == cudaSuccess) return true;
  if (err == cudaErrorNotReady) {
    (void)cudaGetLastError();  // not a failure; keep it out of the next check
    return false;
  }
  throw_cuda(err, "cudaEventQuery(ev)", __FILE__, __LINE__);
}

// True for host memory CUDA cannot DMA from directly (not pinned, not registered).
bool is_pageable(const void* p) {
  cudaPointerAttributes attr{};
  if (cudaPointerGetAttributes(&attr, p) != cudaSuccess) {
    (void)cudaGetLastError();
    return true;
  }
  return attr.type == cudaMemoryTypeUnregistered;
}

// Runs a short function (no CUDA calls, no blocking) on CUDA's callback thread in stream order.
void launch_host_step(cudaStream_t stream, std::function<void()> fn) {
  auto f = std::make_unique<std::function<void()>>(std::move(fn));
  cudaHostFn_t run = [](void* p) {
    std::unique_ptr<std::function<void()>> g(static_cast<std::function<void()>*>(p));
    (*g)();
  };
  STRATA_CUDA_CHECK(cudaLaunchHostFunc(stream, run, f.get()));
  f.release();  // owned by `run` now
}

// Pinned bounce buffers for copies from or to pageable host memory. put() makes no CUDA
// call, so host steps can return chunks.
class StagingPool {
 public:
  static constexpr std::size_t kChunk = std::size_t(8) << 20;
  // Past this, copies fall back to CUDA's own (host-blocking) pageable path.
  static constexpr std::size_t kMaxBytes = std::size_t(512) << 20;

  // A free chunk, a new one, or nullptr when the pool is at kMaxBytes and all are in use.
  void* get() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!free_.empty()) {
        void* p = free_.back();
        free_.pop_back();
        return p;
      }
      if (all_.size() * kChunk + kChunk > kMaxBytes) return nullptr;
    }
    void* p = nullptr;
    STRATA_CUDA_CHECK(cudaHostAlloc(&p, kChunk, cudaHostAllocPortable));
    std::lock_guard<std::mutex> lock(mu_);
    all_.push_back(p);
    return p;
  }
  void put(void* p) {
    std::lock_guard<std::mutex> lock(mu_);
    free_.push_back(p);
  }
  // Only once no queued work can touch a chunk (the device is idle).
  void release() noexcept {
    std::lock_guard<std::mutex> lock(mu_);
    for (void* p : all_)
      if (cudaFreeHost(p) != cudaSuccess) (void)cudaGetLastError();
    all_.clear();
    free_.clear();
  }

 private:
  std::mutex mu_;
  std::vector<void*> free_;
  std::vector<void*> all_;
};

// True on a HostWorker's thread: its stream is held by a kernel until the function returns, so
// nothing there may wait for the GPU (a device-wide wait, cudaFree, an event behind the held
// stream would wait for itself). The allocator does not, there.
thread_local bool t_in_host_worker = false;

// Runs one stream's host functions, in order, on a thread of ours, whose current device is the
// stream's (a host function may queue work; a fresh thread's would be GPU 0).
struct HostWorker {
  explicit HostWorker(int ordinal)
      : thread([this, ordinal] {
          t_in_host_worker = true;
          if (cudaSetDevice(ordinal) != cudaSuccess) (void)cudaGetLastError();
          run();
        }) {}
  ~HostWorker() {
    {
      std::lock_guard<std::mutex> lock(mu);
      stopping = true;
    }
    cv.notify_one();
    thread.join();
  }
  void post(std::function<void()> task) {
    {
      std::lock_guard<std::mutex> lock(mu);
      queue.push_back(std::move(task));
    }
    cv.notify_one();
  }
  void run() {
    for (;;) {
      std::function<void()> task;
      {
        std::unique_lock<std::mutex> lock(mu);
        cv.wait(lock, [&] { return stopping || !queue.empty(); });
        if (queue.empty()) return;  // stopping and drained
        task = std::move(queue.front());
        queue.pop_front();
      }
      task();
    }
  }
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::function<void()>> queue;
  bool stopping = false;
  std::thread thread;  // last: starts after the members it uses exist
};

CudaProbe run_probe() {
  CudaProbe p;
  p.compiled = true;
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  (void)cudaGetLastError();  // a failed probe must not poison the caller's next check
  if (err == cudaSuccess) {
    p.device_count = count;
    if (count == 0) p.reason = "no CUDA device";
    return p;
  }
  if (err == cudaErrorInsufficientDriver) {
    int driver = 0;
    if (cudaDriverGetVersion(&driver) != cudaSuccess) (void)cudaGetLastError();
    int runtime = 0;
    if (cudaRuntimeGetVersion(&runtime) != cudaSuccess) (void)cudaGetLastError();
    p.reason = driver == 0 ? "no CUDA driver (cudaErrorInsufficientDriver, error 35)"
                           : fmt::format(
                                 "the CUDA driver (CUDA {}) is older than the runtime "
                                 "(CUDA {}); update the driver "
                                 "(cudaErrorInsufficientDriver, error 35)",
                                 cuda_version_string(driver), cuda_version_string(runtime));
  } else if (err == cudaErrorNoDevice) {
    p.reason = "no CUDA device";
  } else {
    p.reason = fmt::format("cudaGetDeviceCount failed: {}: {} (error {})", cudaGetErrorName(err),
                           cudaGetErrorString(err), static_cast<int>(err));
  }
  return p;
}

class CudaDevice;

// What a stream creates on first use and a later stream may inherit. Idle when pooled.
struct StreamResources {
  cublasHandle_t blas = nullptr;
  void* scratch = nullptr;                      // gpu::kSumSquaresScratchBytes of device memory
  unsigned long long* adamw_counter = nullptr;  // AdamW's non-finite count (device memory)
  unsigned long long* host_done = nullptr;      // pinned, mapped; 0 when pooled
  unsigned long long* host_done_dev = nullptr;
};

// A cudaEvent recorded on a CudaStream; it outlives the stream (CUDA events are independent
// of the stream they were recorded on).
class CudaEvent final : public detail::EventImpl {
 public:
  CudaEvent() { STRATA_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming)); }
  ~CudaEvent() override {
    try {
      DeviceGuard guard(ordinal);  // the last Event may go on any thread (see query)
    } catch (...) {
    }
    if (cudaEventDestroy(event) != cudaSuccess) (void)cudaGetLastError();
  }
  // Asked from any thread (the engine's optimizer and I/O threads): the event's GPU first, or a
  // thread that never chose one would make a context on GPU 0 (every rank of a node, ~0.5 GiB).
  bool query() override {
    DeviceGuard guard(ordinal);
    return event_done(event);
  }
  void synchronize() override {
    DeviceGuard guard(ordinal);
    STRATA_CUDA_CHECK(cudaEventSynchronize(event));
  }
  cudaEvent_t event = nullptr;
  int ordinal = 0;
};

// The allocator's record of one block: a range of a segment.
struct Block {
  void* ptr = nullptr;
  std::size_t offset = 0;       // in the RangePool
  std::size_t size = 0;         // rounded
  std::uint64_t stream_id = 0;  // in use: allocated on; pending: freed on; 0 = no stream
  cudaStream_t stream = nullptr;
  cudaEvent_t event = nullptr;  // pending: recorded on its stream at free time
};

class CudaStream final : public Stream {
 public:
  CudaStream(CudaDevice* dev, std::string name, std::uint64_t id);
  ~CudaStream() override;

  cudaStream_t handle() const noexcept { return stream_; }
  void* native_handle() const noexcept override { return stream_; }
  std::uint64_t id() const noexcept { return id_; }
  // The first exception thrown by a host function since the last call, cleared.
  std::exception_ptr take_host_error() {
    std::lock_guard<std::mutex> lock(host_error_mu_);
    return std::exchange(host_error_, nullptr);
  }

 protected:
  void do_copy(MemRef dst, MemRef src) override;
  Event do_record() override;
  void do_wait(const Event& event) override;
  void do_synchronize() override;
  void do_host_fn(std::function<void()> fn, const char* trace_name,
                  std::uint64_t trace_bytes) override;
  void do_fill(TensorRef x, float value) override;
  void do_axpy(float alpha, TensorRef x, TensorRef y) override;
  void do_scale(float alpha, TensorRef x) override;
  void do_add(TensorRef a, TensorRef b, TensorRef out) override;
  void do_cast(TensorRef src, TensorRef dst) override;
  void do_sum_squares(TensorRef x, TensorRef out) override;
  void do_matmul(const MatmulDesc& desc) override;
  void do_adamw(const AdamWDesc& desc) override;

 private:
  void start_host_worker();  // with host_mu_ held
  void gemm(const MatmulDesc& d, void* c, DType c_type);
  cublasHandle_t blas();                // with lazy_mu_ held
  void* sum_scratch();                  // with lazy_mu_ held
  unsigned long long* adamw_counter();  // with lazy_mu_ held
  int ordinal() const noexcept;

  CudaDevice* dev_;
  std::uint64_t id_;
  cudaStream_t stream_ = nullptr;
  std::atomic<std::uint64_t> next_seq_{0};
  // cuBLAS handles are not thread-safe, and the scratch serves one launch at a time.
  std::mutex lazy_mu_;
  std::unique_ptr<StreamResources> res_;
  bool blas_bound_ = false;  // res_->blas set to this stream
  std::mutex host_error_mu_;
  std::exception_ptr host_error_;
  // Host functions: submissions are serialized so that flag values follow stream order.
  std::mutex host_mu_;
  std::unique_ptr<HostWorker> worker_;
  std::uint64_t host_submitted_ = 0;
};

// The NUMA node the kernel reports for the GPU's PCI device (-1 when it has none).
int pci_numa_node(int ordinal) {
  char bus_id[32] = {};
  if (cudaDeviceGetPCIBusId(bus_id, sizeof bus_id, ordinal) != cudaSuccess) {
    cudaGetLastError();
    return -1;
  }
  std::string id(bus_id);
  for (char& c : id) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  std::ifstream f("/sys/bus/pci/devices/" + id + "/numa_node");
  int node = -1;
  if (!(f >> node)) return -1;
  return node;
}

class CudaDevice final : public Device {
 public:
  CudaDevice(int ordinal, std::size_t capacity_bytes);
  ~CudaDevice() override;

  DeviceKind kind() const override { return DeviceKind::kCuda; }
  std::string name() const override { return fmt::format("{} (cuda:{})", gpu_name_, ordinal_); }
  std::unique_ptr<Stream> create_stream(std::string name) override;
  DeviceStats stats() const override;
  void reset_peak_stats() override;
  void synchronize() override;
  bool register_host(void* ptr, std::size_t bytes) override;
  void unregister_host(void* ptr) override;
  int numa_node() const override { return numa_node_; }
  const model_ops::Backend* model_kernels() const override { return &gpu::model::cuda_model_ops(); }

  int ordinal() const noexcept { return ordinal_; }
  StagingPool& staging() noexcept { return staging_; }
  // backend::remeasure_default_capacity.
  void remeasure_default_capacity() {
    if (!default_capacity_) return;
    DeviceGuard guard(ordinal_);
    std::size_t free_bytes = 0, total_bytes = 0;
    STRATA_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
    std::lock_guard<std::mutex> lock(mu_);
    const std::size_t cap = default_cuda_capacity(free_bytes + stats_.bytes_reserved, total_bytes) /
                            kSmallUnit * kSmallUnit;
    if (cap >= capacity_) return;
    log::debug(
        "{}: the device memory cap is {} after memory outside strata's allocator was taken (was "
        "{})",
        name(), gib(cap), gib(capacity_));
    capacity_ = std::max(cap, stats_.bytes_reserved);
  }
  std::unique_ptr<StreamResources> take_resources();
  void give_back_resources(std::unique_ptr<StreamResources> res) noexcept;
  void add_stream(CudaStream* s);
  // Called by a stream's destructor after it synchronized: its cached blocks become
  // reusable by anyone, and later frees of buffers allocated on it synchronize the device.
  void remove_stream(std::uint64_t id) noexcept;

 protected:
  void* do_alloc(std::size_t bytes, Stream* stream, void** block) override;
  void do_free(void* block) noexcept override;
  void do_free_on(void* block, Stream& stream) noexcept override;

 private:
  // A pending block freed on `stream_id` that fits `size` closely, taken; or null.
  Block* take_pending(std::size_t size, std::uint64_t stream_id);
  // Moves the pending blocks whose events have completed into the pool.
  void collect_pending();
  // A new block from the pool: a free range, else a new segment, else after the waits the
  // budget calls for (with `lock` released while waiting).
  Block* place(std::size_t size, std::size_t requested, std::unique_lock<std::mutex>& lock);
  std::size_t place_new_segment(std::size_t size);  // kNone: not under the cap, or CUDA refused
  // Returns the wholly free segments to CUDA (cudaFree with `lock` released).
  void release_free_segments(std::unique_lock<std::mutex>& lock);
  void to_pool(Block* b);  // with mu_ held; deletes b
  void* ptr_at(std::size_t offset) const;
  // Pools the deferred blocks freed before deferral number `upto` (taken before a device-wide
  // wait that has ended since), with mu_ held.
  void adopt_deferred(std::uint64_t upto);
  cudaEvent_t acquire_event();
  void release_event(cudaEvent_t ev) { event_pool_.push_back(ev); }
  void warm_up_gemms();
  [[noreturn]] void throw_oom(std::size_t requested, std::size_t rounded, std::string detail = {});

  const int ordinal_;
  std::string gpu_name_;
  int numa_node_ = -1;
  std::size_t capacity_ = 0;
  bool default_capacity_ = false;  // capacity_ measured from the free memory (no cap was given)
  std::atomic<std::uint64_t> next_stream_id_{1};
  StagingPool staging_;

  mutable std::mutex mu_;  // guards everything below
  DeviceStats stats_;
  detail::RangePool pool_{kSmallLimit};
  std::map<std::size_t, void*> segment_ptrs_;  // a segment's base offset -> its cudaMalloc
  // Freed on a live stream, their events not yet seen complete.
  std::vector<Block*> pending_;
  // Freed in a host function, no stream to order on: (the number of deferrals before it, block).
  // They stay here (visible to other allocations) until a device-wide wait that began after them.
  std::vector<std::pair<std::uint64_t, Block*>> deferred_;
  std::uint64_t deferrals_ = 0;
  std::size_t releasing_ = 0;            // segments being returned with mu_ released
  std::size_t awaited_ = 0;              // pending blocks place() waits for with mu_ released
  std::condition_variable released_cv_;  // signalled when releasing_ falls
  std::vector<cudaEvent_t> event_pool_;
  std::unordered_map<std::uint64_t, CudaStream*> streams_;
  std::vector<std::unique_ptr<StreamResources>> spare_resources_;
};

// ---- CudaDevice ----

CudaDevice::CudaDevice(int ordinal, std::size_t capacity_bytes) : ordinal_(ordinal) {
  DeviceGuard guard(ordinal_);
  cudaDeviceProp prop{};
  STRATA_CUDA_CHECK(cudaGetDeviceProperties(&prop, ordinal_));
  gpu_name_ = prop.name;
  numa_node_ = pci_numa_node(ordinal_);
  STRATA_CUDA_CHECK(gpu::preload_kernels());
  STRATA_CUDA_CHECK(gpu::preload_adamw_kernels());
  STRATA_CUDA_CHECK(static_cast<cudaError_t>(gpu::model::preload_kernels()));
  warm_up_gemms();
  std::size_t free_bytes = 0, total_bytes = 0;
  STRATA_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  default_capacity_ = capacity_bytes == 0;
  capacity_ = capacity_bytes == 0 ? default_cuda_capacity(free_bytes, total_bytes) : capacity_bytes;
  // Whole 512-byte units: the last segment below the cap is what is left of it, and a block
  // carved from the top of a segment of an odd size would start misaligned.
  capacity_ = capacity_ / kSmallUnit * kSmallUnit;
  if (capacity_ > free_bytes) {
    log::warn(
        "{}: the device memory cap {} is more than the {} free now; allocations may fail "
        "before reaching it",
        name(), gib(capacity_), gib(free_bytes));
  }
}

// A first stream's cuBLAS handle and one GEMM of each operand / output type the engine uses,
// before the free memory is measured: the handle's workspace and the kernels cuBLAS loads on
// first use (CUDA_MODULE_LOADING=EAGER aside) are then outside the cap, not inside the plan,
// and no later GEMM loads a module while a host function's spinning wait holds a stream.
// The handle is kept for the first stream (spare_resources_).
void CudaDevice::warm_up_gemms() {
  cublasHandle_t h = nullptr;
  STRATA_CUBLAS_CHECK(cublasCreate(&h));
  cudaStream_t s = nullptr;
  void* buf = nullptr;
  constexpr int kN = 64;
  std::exception_ptr failure;
  try {
    // A stream of its own: a device-wide wait would wait for other CudaDevices' work too.
    STRATA_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    STRATA_CUBLAS_CHECK(cublasSetStream(h, s));
    STRATA_CUDA_CHECK(cudaMalloc(&buf, 3 * kN * kN * sizeof(float)));
    STRATA_CUDA_CHECK(cudaMemsetAsync(buf, 0, 3 * kN * kN * sizeof(float), s));
    char* a = static_cast<char*>(buf);
    char* b = a + kN * kN * sizeof(float);
    char* c = b + kN * kN * sizeof(float);
    const float one = 1.0f, zero = 0.0f;
    const std::pair<cudaDataType_t, cudaDataType_t> types[] = {{CUDA_R_32F, CUDA_R_32F},
                                                               {CUDA_R_16BF, CUDA_R_16BF},
                                                               {CUDA_R_16BF, CUDA_R_32F},
                                                               {CUDA_R_16F, CUDA_R_16F},
                                                               {CUDA_R_16F, CUDA_R_32F}};
    for (const auto& [ab, ct] : types)
      for (const cublasOperation_t op : {CUBLAS_OP_N, CUBLAS_OP_T})
        STRATA_CUBLAS_CHECK(cublasGemmEx(h, op, CUBLAS_OP_N, kN, kN, kN, &one, a, ab, kN, b, ab, kN,
                                         &zero, c, ct, kN, CUBLAS_COMPUTE_32F,
                                         CUBLAS_GEMM_DEFAULT));
    STRATA_CUDA_CHECK(cudaStreamSynchronize(s));
  } catch (...) {
    failure = std::current_exception();
  }
  if (buf && cudaFree(buf) != cudaSuccess) (void)cudaGetLastError();
  if (s && cudaStreamDestroy(s) != cudaSuccess) (void)cudaGetLastError();
  if (failure) {
    if (cublasDestroy(h) != CUBLAS_STATUS_SUCCESS) (void)cudaGetLastError();
    std::rethrow_exception(failure);
  }
  // Kept for the first stream, which binds it to itself (its stream here is gone).
  auto res = std::make_unique<StreamResources>();
  res->blas = h;
  spare_resources_.push_back(std::move(res));
}

CudaDevice::~CudaDevice() {
  try {
    DeviceGuard guard(ordinal_);
    STRATA_CUDA_CHECK(cudaDeviceSynchronize());
    std::unique_lock<std::mutex> lock(mu_);
    adopt_deferred(UINT64_MAX);  // the device is idle (synchronized above) and its streams gone
    for (Block* b : std::exchange(pending_, {})) to_pool(b);  // their events are complete
    if (!streams_.empty())
      log::warn("{} destroyed while {} of its streams still exist", name(), streams_.size());
    if (stats_.bytes_in_use != 0)
      log::warn(
          "{} destroyed while {} bytes of its buffers are alive; free buffers before their "
          "device",
          name(), stats_.bytes_in_use);
    release_free_segments(lock);
    for (cudaEvent_t ev : event_pool_) (void)cudaEventDestroy(ev);
    event_pool_.clear();
    staging_.release();
    for (auto& r : spare_resources_) {
      if (r->blas && cublasDestroy(r->blas) != CUBLAS_STATUS_SUCCESS) (void)cudaGetLastError();
      if (r->scratch && cudaFree(r->scratch) != cudaSuccess) (void)cudaGetLastError();
      if (r->adamw_counter && cudaFree(r->adamw_counter) != cudaSuccess) (void)cudaGetLastError();
      if (r->host_done && cudaFreeHost(r->host_done) != cudaSuccess) (void)cudaGetLastError();
    }
    spare_resources_.clear();
  } catch (const std::exception& e) {
    log::error("{}: cleanup failed: {}", name(), e.what());
  }
}

std::unique_ptr<Stream> CudaDevice::create_stream(std::string name) {
  auto s = std::make_unique<CudaStream>(this, std::move(name), next_stream_id_++);
  add_stream(s.get());
  return s;
}

std::unique_ptr<StreamResources> CudaDevice::take_resources() {
  std::lock_guard<std::mutex> lock(mu_);
  if (spare_resources_.empty()) return std::make_unique<StreamResources>();
  auto r = std::move(spare_resources_.back());
  spare_resources_.pop_back();
  return r;
}

void CudaDevice::give_back_resources(std::unique_ptr<StreamResources> res) noexcept {
  if (res->host_done) *res->host_done = 0;  // the next stream counts its host functions from 1
  std::lock_guard<std::mutex> lock(mu_);
  spare_resources_.push_back(std::move(res));
}

void CudaDevice::add_stream(CudaStream* s) {
  std::lock_guard<std::mutex> lock(mu_);
  streams_.emplace(s->id(), s);
}

void CudaDevice::remove_stream(std::uint64_t id) noexcept {
  std::lock_guard<std::mutex> lock(mu_);
  streams_.erase(id);
  std::erase_if(pending_, [&](Block* b) {
    if (b->stream_id != id) return false;
    to_pool(b);  // its event is complete: the stream was synchronized
    return true;
  });
}

DeviceStats CudaDevice::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  DeviceStats s = stats_;
  s.capacity_bytes = capacity_;
  // The pending frees their streams have reached are out of use, though not yet collected (the
  // next allocation does that): a stream synchronized, its frees are not counted.
  if (pending_.empty()) return s;
  try {
    DeviceGuard guard(ordinal_);
    for (const Block* b : pending_) {
      const cudaError_t q = cudaEventQuery(b->event);
      if (q == cudaSuccess)
        s.bytes_in_use -= b->size;
      else
        (void)cudaGetLastError();  // not ready, or a failure the next synchronize reports
    }
  } catch (const std::exception&) {  // no GPU to ask: the pending frees stay counted
  }
  return s;
}

void CudaDevice::reset_peak_stats() {
  DeviceGuard guard(ordinal_);
  std::lock_guard<std::mutex> lock(mu_);
  collect_pending();  // the frees their streams have reached are not part of the new peak
  stats_.peak_bytes_in_use = stats_.bytes_in_use;
}

void CudaDevice::synchronize() {
  // Only the blocks deferred before the wait began are past their use after it (a host function
  // may defer another meanwhile).
  std::uint64_t upto = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    upto = deferrals_;
  }
  {
    DeviceGuard guard(ordinal_);
    STRATA_CUDA_CHECK(cudaDeviceSynchronize());
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    adopt_deferred(upto);
  }
  gpu::flush_gpu_spans();
  // The first failed stream's host-function error, taken under mu_ (a stream destroyed on another
  // thread leaves streams_ under it: a pointer kept past the lock could be freed); host_error_mu_
  // is a leaf lock. The other streams keep theirs for their own synchronize.
  std::exception_ptr err;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [id, s] : streams_)
      if ((err = s->take_host_error())) break;
  }
  if (err) std::rethrow_exception(err);
}

bool CudaDevice::register_host(void* ptr, std::size_t bytes) {
  DeviceGuard guard(ordinal_);
  const cudaError_t err = cudaHostRegister(ptr, bytes, cudaHostRegisterDefault);
  if (err == cudaSuccess) return true;
  (void)cudaGetLastError();
  log::warn(
      "cudaHostRegister of {} bytes at {} failed ({}: {}); copies from that memory will be "
      "staged through pageable buffers (slower, and not truly asynchronous)",
      bytes, ptr, cudaGetErrorName(err), cudaGetErrorString(err));
  return false;
}

void CudaDevice::unregister_host(void* ptr) {
  DeviceGuard guard(ordinal_);
  const cudaError_t err = cudaHostUnregister(ptr);
  if (err == cudaSuccess) return;
  (void)cudaGetLastError();
  log::warn("cudaHostUnregister of {} failed ({}: {})", ptr, cudaGetErrorName(err),
            cudaGetErrorString(err));
}

void CudaDevice::throw_oom(std::size_t requested, std::size_t rounded, std::string detail) {
  ++stats_.num_alloc_failures;
  detail::throw_error(ErrorKind::kOutOfMemory, __FILE__, __LINE__, "CudaDevice::alloc",
                      fmt::format("{} cannot allocate {} bytes ({} rounded): {} bytes in use, "
                                  "{} reserved, of a {}-byte cap; free buffers, lower the request "
                                  "or raise the device memory cap",
                                  name(), requested, rounded, stats_.bytes_in_use,
                                  stats_.bytes_reserved, capacity_),
                      std::move(detail));
}

void* CudaDevice::do_alloc(std::size_t bytes, Stream* stream, void** block) {
  DeviceGuard guard(ordinal_);
  auto* cs = static_cast<CudaStream*>(stream);
  const std::uint64_t sid = cs ? cs->id() : 0;
  std::unique_lock<std::mutex> lock(mu_);
  if (bytes > capacity_ || bytes > SIZE_MAX - kSegmentUnit) throw_oom(bytes, bytes);
  const std::size_t size = round_block(bytes);
  collect_pending();  // the frees their streams have reached leave bytes_in_use first
  Block* b = sid != 0 ? take_pending(size, sid) : nullptr;
  if (b != nullptr)
    ++stats_.num_reused;
  else
    b = place(size, bytes, lock);
  b->stream_id = sid;
  b->stream = cs ? cs->handle() : nullptr;
  stats_.bytes_in_use += b->size;
  stats_.peak_bytes_in_use = std::max(stats_.peak_bytes_in_use, stats_.bytes_in_use);
  ++stats_.num_allocs;
  *block = b;
  return b->ptr;
}

// Same stream: reusable at once, stream order protects the earlier work. Taken whole, so only a
// close fit (at most an eighth larger): a large pending block would otherwise be held by a
// small request until its stream frees that one.
Block* CudaDevice::take_pending(std::size_t size, std::uint64_t stream_id) {
  auto best = pending_.end();
  for (auto it = pending_.begin(); it != pending_.end(); ++it) {
    const Block* b = *it;
    if (b->stream_id != stream_id || b->size < size || b->size > size + size / 8) continue;
    if (best == pending_.end() || b->size < (*best)->size) best = it;
  }
  if (best == pending_.end()) return nullptr;
  Block* b = *best;
  pending_.erase(best);
  release_event(b->event);
  b->event = nullptr;
  stats_.bytes_in_use -= b->size;  // counted again by the allocation that takes it
  return b;
}

void CudaDevice::collect_pending() {
  // The completed ones are taken out first: event_done throws on a sticky error, and pending_
  // must then still hold every block it held (none freed behind it).
  std::vector<Block*> done;
  for (Block* b : pending_)
    if (event_done(b->event)) done.push_back(b);
  std::erase_if(pending_,
                [&](Block* b) { return std::find(done.begin(), done.end(), b) != done.end(); });
  for (Block* b : done) to_pool(b);
}

void CudaDevice::to_pool(Block* b) {
  if (b->event) {  // a pending free: counted in use until now
    release_event(b->event);
    stats_.bytes_in_use -= b->size;
  }
  pool_.free(b->offset, b->size);
  delete b;
}

void* CudaDevice::ptr_at(std::size_t offset) const {
  const auto [base, bytes] = pool_.segment_of(offset);
  return static_cast<char*>(segment_ptrs_.at(base)) + (offset - base);
}

Block* CudaDevice::place(std::size_t size, std::size_t requested,
                         std::unique_lock<std::mutex>& lock) {
  // In a host function nothing may wait for the GPU (it would wait for the held stream, i.e. for
  // itself): what is free now serves it, or the request fails now, as on the emulated device.
  const char* in_host_fn =
      "inside a stream's host function the allocator does not wait for the GPU to take back freed "
      "blocks (the function holds its stream): allocate before queuing it";
  auto make = [&](std::size_t off) {
    return new Block{ptr_at(off), off, size, 0, nullptr, nullptr};
  };
  // (do_alloc has collected the pending frees their streams have reached)
  std::size_t off = pool_.alloc(size);
  if (off == detail::RangePool::kNone) off = place_new_segment(size);
  if (off != detail::RangePool::kNone) return make(off);
  if (t_in_host_worker) throw_oom(requested, size, in_host_fn);

  // Short of room: wait for what the streams are still to free, then give back whole segments.
  ++stats_.num_alloc_waits;
  TraceScope span("alloc_wait", "engine", size);  // the calling thread stalls: show it
  if (!pending_.empty()) {
    std::vector<Block*> waiting = std::exchange(pending_, {});
    awaited_ += waiting.size();  // another allocation short of room waits for them (below)
    lock.unlock();
    std::exception_ptr failure;
    for (Block* b : waiting) {
      const cudaError_t err = cudaEventSynchronize(b->event);
      if (err != cudaSuccess && !failure) {
        try {
          throw_cuda(err, "cudaEventSynchronize(b->event)", __FILE__, __LINE__);
        } catch (...) {
          failure = std::current_exception();
        }
      }
    }
    lock.lock();
    awaited_ -= waiting.size();
    released_cv_.notify_all();
    if (failure) {
      pending_.insert(pending_.end(), waiting.begin(), waiting.end());
      std::rethrow_exception(failure);
    }
    for (Block* b : waiting) to_pool(b);
    if ((off = pool_.alloc(size)) != detail::RangePool::kNone) return make(off);
  }
  // Freed inside host functions: poolable once the device is idle (those deferred before the
  // wait began; a host function may defer another meanwhile).
  if (!deferred_.empty()) {
    const std::uint64_t upto = deferrals_;
    lock.unlock();
    const cudaError_t err = cudaDeviceSynchronize();
    lock.lock();
    if (err != cudaSuccess) throw_cuda(err, "cudaDeviceSynchronize()", __FILE__, __LINE__);
    adopt_deferred(upto);
    collect_pending();
    if ((off = pool_.alloc(size)) != detail::RangePool::kNone) return make(off);
  }
  // Bytes another thread is returning to CUDA have left bytes_reserved before their cudaFree:
  // wait for them rather than fail while they are on their way. Bounded: should a free wait on
  // this thread (it never does in strata), the request fails as out of memory, not a hang.
  // And for the pending blocks another allocation took out to wait for: they come back to the
  // pool (it waited with mu_ released), not lost to this one, which would say out of memory.
  released_cv_.wait_for(lock, std::chrono::seconds(30),
                        [&] { return releasing_ == 0 && awaited_ == 0; });
  release_free_segments(lock);
  if ((off = pool_.alloc(size)) != detail::RangePool::kNone) return make(off);
  if ((off = place_new_segment(size)) != detail::RangePool::kNone) return make(off);
  std::size_t free_bytes = 0, total_bytes = 0;
  if (cudaMemGetInfo(&free_bytes, &total_bytes) != cudaSuccess) (void)cudaGetLastError();
  throw_oom(
      requested, size,
      fmt::format("largest free range {} bytes in {} segments; the GPU has {} bytes free of {}",
                  pool_.largest_free(), pool_.segments(), free_bytes, total_bytes));
}

std::size_t CudaDevice::place_new_segment(std::size_t size) {
  if (stats_.bytes_reserved + size > capacity_) return detail::RangePool::kNone;
  // 2 MiB multiples (small blocks share one), less when only that much of the cap is left.
  const std::size_t seg = std::min((size + kSegmentUnit - 1) / kSegmentUnit * kSegmentUnit,
                                   capacity_ - stats_.bytes_reserved);
  void* p = nullptr;
  const cudaError_t err = cudaMalloc(&p, seg);
  if (err == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError();
    return detail::RangePool::kNone;
  }
  if (err != cudaSuccess) throw_cuda(err, "cudaMalloc(&p, seg)", __FILE__, __LINE__);
  stats_.bytes_reserved += seg;
  segment_ptrs_[pool_.add_segment(seg)] = p;
  return pool_.alloc(size);
}

// The wholly free segments go back to CUDA. Their bytes leave bytes_reserved first, so another
// allocation may be granted them while their cudaFree (a device-wide wait) is on its way, run
// with the lock released: a host function freeing a buffer meanwhile needs it.
void CudaDevice::release_free_segments(std::unique_lock<std::mutex>& lock) {
  std::vector<void*> ptrs;
  for (const auto& [base, bytes] : pool_.take_free_segments()) {
    ptrs.push_back(segment_ptrs_.at(base));
    segment_ptrs_.erase(base);
    stats_.bytes_reserved -= bytes;
  }
  if (ptrs.empty()) return;
  releasing_ += ptrs.size();
  lock.unlock();
  std::exception_ptr failure;
  for (void* p : ptrs) {
    try {
      STRATA_CUDA_CHECK(cudaFree(p));
    } catch (...) {
      if (!failure) failure = std::current_exception();
    }
  }
  lock.lock();
  releasing_ -= ptrs.size();
  released_cv_.notify_all();
  if (failure) std::rethrow_exception(failure);
}

void CudaDevice::adopt_deferred(std::uint64_t upto) {
  std::erase_if(deferred_, [&](const std::pair<std::uint64_t, Block*>& d) {
    if (d.first >= upto) return false;
    to_pool(d.second);
    return true;
  });
}

cudaEvent_t CudaDevice::acquire_event() {
  if (!event_pool_.empty()) {
    cudaEvent_t ev = event_pool_.back();
    event_pool_.pop_back();
    return ev;
  }
  cudaEvent_t ev = nullptr;
  STRATA_CUDA_CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
  return ev;
}

void CudaDevice::do_free_on(void* block, Stream& stream) noexcept {
  auto* b = static_cast<Block*>(block);
  auto& cs = static_cast<CudaStream&>(stream);
  {
    std::lock_guard<std::mutex> lock(mu_);
    b->stream_id = cs.id();
    b->stream = cs.handle();
  }
  do_free(block);
}

void CudaDevice::do_free(void* block) noexcept {
  auto* b = static_cast<Block*>(block);
  try {
    DeviceGuard guard(ordinal_);
    std::unique_lock<std::mutex> lock(mu_);
    ++stats_.num_frees;
    if (b->stream_id != 0 && streams_.count(b->stream_id) != 0) {
      // The stream cannot be destroyed meanwhile: its destructor needs mu_ to unregister.
      cudaEvent_t ev = acquire_event();
      const cudaError_t err = cudaEventRecord(ev, b->stream);
      if (err != cudaSuccess) {
        release_event(ev);
        stats_.bytes_in_use -= b->size;  // the block stays reserved, out of use (below)
        throw_cuda(err, "cudaEventRecord(ev, b->stream)", __FILE__, __LINE__);
      }
      b->event = ev;
      pending_.push_back(b);  // in use until its event completes (to_pool) or S takes it again
      return;
    }
    stats_.bytes_in_use -= b->size;
    // No stream to order the free on: wait until no work can still use the block. Inside a host
    // function that wait would be for itself: the block waits for the next device-wide wait.
    if (t_in_host_worker) {
      deferred_.emplace_back(deferrals_++, b);
      return;
    }
    lock.unlock();
    STRATA_CUDA_CHECK(cudaDeviceSynchronize());
    lock.lock();
    to_pool(b);
  } catch (const std::exception& e) {
    log::error("{}: freeing a {}-byte block failed; it stays reserved and unused: {}", name(),
               b->size, e.what());
  }
}

// ---- CudaStream ----

CudaStream::CudaStream(CudaDevice* dev, std::string name, std::uint64_t id)
    : Stream(dev, std::move(name)), dev_(dev), id_(id) {
  DeviceGuard guard(dev->ordinal());
  STRATA_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  gpu::name_gpu_stream(stream_, this->name());
  res_ = dev->take_resources();
}

CudaStream::~CudaStream() {
  std::optional<DeviceGuard> guard;  // held to the end: the stream is destroyed below
  try {
    guard.emplace(ordinal());
    STRATA_CUDA_CHECK(cudaStreamSynchronize(stream_));
  } catch (const std::exception& e) {
    log::error("stream '{}' failed while draining at destruction: {}", name(), e.what());
  }
  mark_destroyed();
  dev_->remove_stream(id_);
  worker_.reset();  // idle: the stream drained
  warn_unreported(take_host_error(), "host function failure");
  dev_->give_back_resources(std::move(res_));
  gpu::flush_gpu_spans();
  gpu::forget_gpu_stream(stream_);
  if (cudaStreamDestroy(stream_) != cudaSuccess) (void)cudaGetLastError();
}

int CudaStream::ordinal() const noexcept { return dev_->ordinal(); }

void CudaStream::do_copy(MemRef dst, MemRef src) {
  DeviceGuard guard(ordinal());
  const bool from_host = src.space == MemSpace::kHost, to_host = dst.space == MemSpace::kHost;
  const gpu::GpuSpan span(
      from_host ? (to_host ? "copy_h2h" : "copy_h2d") : (to_host ? "copy_d2h" : "copy_d2d"),
      stream_, src.bytes);
  if (dst.space == MemSpace::kHost && src.space == MemSpace::kHost) {
    do_host_fn([d = dst.ptr, s = src.ptr, n = src.bytes] { std::memmove(d, s, n); }, "copy_h2h",
               src.bytes);
    return;
  }
  const bool src_pageable = src.space == MemSpace::kHost && is_pageable(src.ptr);
  const bool dst_pageable = dst.space == MemSpace::kHost && is_pageable(dst.ptr);
  if (!src_pageable && !dst_pageable) {
    STRATA_CUDA_CHECK(cudaMemcpyAsync(dst.ptr, src.ptr, src.bytes, cudaMemcpyDefault, stream_));
    return;
  }
  StagingPool* pool = &dev_->staging();
  auto* d = static_cast<char*>(dst.ptr);
  const auto* s = static_cast<const char*>(src.ptr);
  for (std::size_t off = 0; off < src.bytes; off += StagingPool::kChunk) {
    const std::size_t len = std::min(StagingPool::kChunk, src.bytes - off);
    void* chunk = pool->get();
    if (chunk == nullptr) {
      log::warn_once("cuda-staging-full",
                     "pinned staging for pageable host memory is exhausted; copies block the "
                     "caller until they finish. Copy from pinned memory (PinnedPool)");
      // CUDA reads a pageable source when the call is made, not when the stream reaches it:
      // the work queued before it (a host function or a copy that writes the source) runs first.
      if (src_pageable) STRATA_CUDA_CHECK(cudaStreamSynchronize(stream_));
      STRATA_CUDA_CHECK(cudaMemcpyAsync(d + off, s + off, len, cudaMemcpyDefault, stream_));
      continue;
    }
    if (src_pageable) {
      do_host_fn([chunk, from = s + off, len] { std::memcpy(chunk, from, len); }, "stage_h2d", len);
      STRATA_CUDA_CHECK(cudaMemcpyAsync(d + off, chunk, len, cudaMemcpyHostToDevice, stream_));
      launch_host_step(stream_,
                       [pool, chunk] { pool->put(chunk); });  // short: no copy, no CUDA call
    } else {
      STRATA_CUDA_CHECK(cudaMemcpyAsync(chunk, s + off, len, cudaMemcpyDeviceToHost, stream_));
      do_host_fn(
          [pool, chunk, to = d + off, len] {
            std::memcpy(to, chunk, len);
            pool->put(chunk);
          },
          "stage_d2h", len);
    }
  }
}

Event CudaStream::do_record() {
  DeviceGuard guard(ordinal());
  auto e = std::make_shared<CudaEvent>();
  e->ordinal = ordinal();
  STRATA_CUDA_CHECK(cudaEventRecord(e->event, stream_));
  e->device = dev_;
  e->stream = life();
  e->seq = ++next_seq_;
  return Event(std::move(e));
}

void CudaStream::do_wait(const Event& event) {
  auto* ce = dynamic_cast<CudaEvent*>(event.impl().get());
  STRATA_CHECK(ce != nullptr, "event of another backend passed to CUDA stream '{}'", name());
  DeviceGuard guard(ordinal());
  STRATA_CUDA_CHECK(cudaStreamWaitEvent(stream_, ce->event, 0));
}

void CudaStream::do_synchronize() {
  const cudaError_t err = cudaStreamSynchronize(stream_);
  if (err != cudaSuccess)
    throw_cuda(err, "cudaStreamSynchronize(stream_)", __FILE__, __LINE__,
               fmt::format("work queued on CUDA stream '{}' failed", name()));
  if (auto host_err = take_host_error()) std::rethrow_exception(host_err);
  gpu::flush_gpu_spans();
}

void CudaStream::start_host_worker() {
  if (res_->host_done == nullptr) {
    void* flag = nullptr;
    STRATA_CUDA_CHECK(cudaHostAlloc(&flag, sizeof(unsigned long long),
                                    cudaHostAllocMapped | cudaHostAllocPortable));
    *static_cast<unsigned long long*>(flag) = 0;
    void* dev_flag = nullptr;
    const cudaError_t err = cudaHostGetDevicePointer(&dev_flag, flag, 0);
    if (err != cudaSuccess) {
      (void)cudaFreeHost(flag);
      throw_cuda(err, "cudaHostGetDevicePointer(&dev_flag, flag, 0)", __FILE__, __LINE__);
    }
    res_->host_done = static_cast<unsigned long long*>(flag);
    res_->host_done_dev = static_cast<unsigned long long*>(dev_flag);
  }
  worker_ = std::make_unique<HostWorker>(ordinal());
}

// Stream order: earlier work -> a host step posts `fn` to the worker -> a kernel waits for
// the worker to publish seq -> later work. The worker runs functions in the order posted,
// which is stream order, so the flag only grows.
void CudaStream::do_host_fn(std::function<void()> fn, const char* /*trace_name*/,
                            std::uint64_t /*trace_bytes*/) {
  DeviceGuard guard(ordinal());
  std::lock_guard<std::mutex> lock(host_mu_);
  if (!worker_) start_host_worker();
  const std::uint64_t seq = host_submitted_ + 1;
  auto task = [this, seq, fn = std::move(fn)]() mutable {
    try {
      fn();
    } catch (...) {
      std::lock_guard<std::mutex> error_lock(host_error_mu_);
      if (!host_error_) host_error_ = std::current_exception();
    }
    // What `fn` captured (a pinned block, say) is released before the stream moves on, as on the
    // emulated device: whoever waits for this point may count on it being back.
    fn = nullptr;
    std::atomic_ref<unsigned long long>(*res_->host_done).store(seq, std::memory_order_release);
  };
  // Moved, not copied, to the worker: the copy would stay with CUDA's callback thread and, if
  // the worker ran first, drop the last reference to what `fn` captured there (a Buffer's free
  // makes CUDA calls, which that thread must not).
  launch_host_step(
      stream_, [w = worker_.get(), task = std::move(task)]() mutable { w->post(std::move(task)); });
  host_submitted_ = seq;
  STRATA_CUDA_CHECK(gpu::launch_wait_host_flag(res_->host_done_dev, seq, stream_));
}

void CudaStream::do_fill(TensorRef x, float value) {
  DeviceGuard guard(ordinal());
  const gpu::GpuSpan span("fill", stream_);
  STRATA_CUDA_CHECK(gpu::launch_fill(x.mem.ptr, x.dtype, x.numel, value, stream_));
}

void CudaStream::do_axpy(float alpha, TensorRef x, TensorRef y) {
  DeviceGuard guard(ordinal());
  const gpu::GpuSpan span("axpy", stream_);
  STRATA_CUDA_CHECK(
      gpu::launch_axpy(alpha, x.mem.ptr, x.dtype, y.mem.ptr, y.dtype, x.numel, stream_));
}

void CudaStream::do_scale(float alpha, TensorRef x) {
  DeviceGuard guard(ordinal());
  const gpu::GpuSpan span("scale", stream_);
  STRATA_CUDA_CHECK(gpu::launch_scale(alpha, x.mem.ptr, x.dtype, x.numel, stream_));
}

void CudaStream::do_add(TensorRef a, TensorRef b, TensorRef out) {
  DeviceGuard guard(ordinal());
  const gpu::GpuSpan span("add", stream_);
  STRATA_CUDA_CHECK(gpu::launch_add(a.mem.ptr, a.dtype, b.mem.ptr, b.dtype, out.mem.ptr, out.dtype,
                                    a.numel, stream_));
}

void CudaStream::do_cast(TensorRef src, TensorRef dst) {
  DeviceGuard guard(ordinal());
  const gpu::GpuSpan span("cast", stream_);
  STRATA_CUDA_CHECK(
      gpu::launch_cast(src.mem.ptr, src.dtype, dst.mem.ptr, dst.dtype, src.numel, stream_));
}

void* CudaStream::sum_scratch() {
  if (res_->scratch == nullptr)
    STRATA_CUDA_CHECK(cudaMalloc(&res_->scratch, gpu::kSumSquaresScratchBytes));
  return res_->scratch;
}

unsigned long long* CudaStream::adamw_counter() {
  if (res_->adamw_counter == nullptr)
    STRATA_CUDA_CHECK(cudaMalloc(&res_->adamw_counter, sizeof(unsigned long long)));
  return res_->adamw_counter;
}

void CudaStream::do_sum_squares(TensorRef x, TensorRef out) {
  DeviceGuard guard(ordinal());
  const gpu::GpuSpan span("sum_squares", stream_);
  std::lock_guard<std::mutex> lock(lazy_mu_);
  STRATA_CUDA_CHECK(gpu::launch_sum_squares(
      x.mem.ptr, x.dtype, x.numel, static_cast<float*>(out.mem.ptr), sum_scratch(), stream_));
}

cublasHandle_t CudaStream::blas() {
  if (res_->blas == nullptr) STRATA_CUBLAS_CHECK(cublasCreate(&res_->blas));
  if (!blas_bound_) {
    STRATA_CUBLAS_CHECK(cublasSetStream(res_->blas, stream_));
    blas_bound_ = true;
  }
  return res_->blas;
}

// Row-major C[m,n] = op(A) op(B) is column-major C^T[n,m] = op(B)^T op(A)^T, and a row-major
// matrix is its own transpose read column-major: so cuBLAS gets B first, then A, each with
// its own transpose flag, and the leading dimension of each operand's row-major storage.
void CudaStream::gemm(const MatmulDesc& d, void* c, DType c_type) {
  const cublasOperation_t op_b = d.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t op_a = d.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  const std::int64_t ldb = d.trans_b ? d.k : d.n;  // B stored [n,k] or [k,n]
  const std::int64_t lda = d.trans_a ? d.m : d.k;  // A stored [k,m] or [m,k]
  const std::int64_t ldc = d.n;
  const cudaDataType_t ab = gpu::detail::cuda_data_type(d.a.dtype);
  const cudaDataType_t ct = gpu::detail::cuda_data_type(c_type);
  cublasHandle_t h = blas();
  if (std::max({d.m, d.n, d.k}) <= INT_MAX) {
    STRATA_CUBLAS_CHECK(cublasGemmEx(h, op_b, op_a, int(d.n), int(d.m), int(d.k), &d.alpha,
                                     d.b.mem.ptr, ab, int(ldb), d.a.mem.ptr, ab, int(lda), &d.beta,
                                     c, ct, int(ldc), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  } else {
    STRATA_CUBLAS_CHECK(cublasGemmEx_64(h, op_b, op_a, d.n, d.m, d.k, &d.alpha, d.b.mem.ptr, ab,
                                        ldb, d.a.mem.ptr, ab, lda, &d.beta, c, ct, ldc,
                                        CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  }
}

void CudaStream::do_matmul(const MatmulDesc& d) {
  DeviceGuard guard(ordinal());
  const gpu::GpuSpan span("matmul", stream_);
  // cuBLAS writes bf16 C only from bf16 A/B; fp32 or fp16 inputs with a bf16 C compute
  // into an fp32 temporary that is rounded once at the end, as a bf16-out GEMM would.
  const bool direct = d.c.dtype == DType::kF32 || d.a.dtype == DType::kBF16;
  // The temporary is allocated before lazy_mu_ is taken: an allocation may wait for queued frees
  // or return the cache to CUDA (a device-wide synchronize), with the stream's launches held up.
  Buffer tmp = direct
                   ? Buffer()
                   : dev_->alloc(d.c.numel * sizeof(float), this);  // freed in this stream's order
  std::lock_guard<std::mutex> lock(lazy_mu_);
  if (direct) {
    gemm(d, d.c.mem.ptr, d.c.dtype);
    return;
  }
  if (d.beta != 0.0f) {
    STRATA_CUDA_CHECK(
        gpu::launch_cast(d.c.mem.ptr, d.c.dtype, tmp.data(), DType::kF32, d.c.numel, stream_));
  }
  gemm(d, tmp.data(), DType::kF32);
  STRATA_CUDA_CHECK(
      gpu::launch_cast(tmp.data(), DType::kF32, d.c.mem.ptr, d.c.dtype, d.c.numel, stream_));
}

// Count launches (skip mode) for every batch of shards first, then the updates, then the
// report: all on this stream, so the host never waits. The counter is the stream's own (a
// resource outside the budget, as the sum_squares scratch: the engine's memory plan counts the
// caller's buffers, not the backend's), zeroed in stream order.
void CudaStream::do_adamw(const AdamWDesc& d) {
  DeviceGuard guard(ordinal());
  const gpu::GpuSpan span("adamw", stream_);
  const detail::AdamWScalars k = detail::adamw_scalars(d.options);
  std::vector<gpu::AdamWGpuShard> shards;
  shards.reserve(d.shards.size());
  for (const AdamWShard& s : d.shards) {
    const bool copy = s.copy_out.numel > 0;
    shards.push_back({static_cast<float*>(s.params.mem.ptr), s.m.mem.ptr, s.v.mem.ptr,
                      static_cast<const float*>(s.params_in().mem.ptr), s.m_in().mem.ptr,
                      s.v_in().mem.ptr, s.grads.mem.ptr, copy ? s.copy_out.mem.ptr : nullptr,
                      s.params.numel, s.grads.dtype, s.m.dtype,
                      copy ? s.copy_out.dtype : DType::kBF16, s.decay ? k.decay : 1.0f});
  }
  // The counter serves one call at a time: held from its zeroing to the report (two threads
  // queuing AdamW on this stream would otherwise count into each other's).
  std::lock_guard<std::mutex> lock(lazy_mu_);
  unsigned long long* counter = adamw_counter();
  STRATA_CUDA_CHECK(cudaMemsetAsync(counter, 0, sizeof(unsigned long long), stream_));
  const bool skip = d.policy == NonFinitePolicy::kSkipStep;
  const int per = gpu::kAdamWShardsPerLaunch;
  const int count = static_cast<int>(shards.size());
  if (skip) {
    for (int i = 0; i < count; i += per)
      STRATA_CUDA_CHECK(gpu::launch_adamw_count(shards.data() + i, std::min(per, count - i),
                                                k.grad_scale, counter, stream_));
  }
  for (int i = 0; i < count; i += per)
    STRATA_CUDA_CHECK(gpu::launch_adamw_update(shards.data() + i, std::min(per, count - i), k, skip,
                                               counter, stream_));
  if (d.non_finite.mem.ptr != nullptr)
    STRATA_CUDA_CHECK(
        gpu::launch_adamw_report(counter, static_cast<float*>(d.non_finite.mem.ptr), stream_));
}

}  // namespace

// ---- the module's entry points (cuda_module.h) ----

namespace gpu::backend {

CudaProbe probe() {
  static const CudaProbe probe = run_probe();  // thread-safe once: the answer cannot change
  return probe;
}

std::unique_ptr<Device> make_device(const CudaDeviceOptions& options) {
  const CudaProbe p = probe();
  if (p.device_count == 0)
    STRATA_THROW(kUnsupported, "no usable CUDA GPU ({}); use the CPU-emulated device", p.reason);
  const int ordinal = options.ordinal < 0 ? 0 : options.ordinal;
  STRATA_REQUIRE(ordinal < p.device_count,
                 "CUDA device ordinal {} out of range: this machine has {} GPU(s), cuda:0..cuda:{}",
                 ordinal, p.device_count, p.device_count - 1);
  return std::make_unique<CudaDevice>(ordinal, options.capacity_bytes);
}

void remeasure_default_capacity(Device& device) {
  if (device.kind() != DeviceKind::kCuda) return;
  static_cast<CudaDevice&>(device).remeasure_default_capacity();
}

std::vector<ComponentVersion> component_versions() {
  std::vector<ComponentVersion> out;
  int runtime = 0;
  if (cudaRuntimeGetVersion(&runtime) != cudaSuccess) (void)cudaGetLastError();
  out.push_back({"cuda", runtime ? cuda_version_string(runtime) : "unknown"});
  int driver = 0;
  if (cudaDriverGetVersion(&driver) != cudaSuccess) (void)cudaGetLastError();
  out.push_back({"cuda driver", driver ? cuda_version_string(driver) : "no driver"});
  int major = 0, minor = 0, patch = 0;
  if (cublasGetProperty(MAJOR_VERSION, &major) == CUBLAS_STATUS_SUCCESS &&
      cublasGetProperty(MINOR_VERSION, &minor) == CUBLAS_STATUS_SUCCESS &&
      cublasGetProperty(PATCH_LEVEL, &patch) == CUBLAS_STATUS_SUCCESS) {
    out.push_back({"cublas", fmt::format("{}.{}.{}", major, minor, patch)});
  } else {
    out.push_back({"cublas", "unknown"});
  }
#if defined(STRATA_HAVE_NCCL)
  int nccl = 0;
  if (ncclGetVersion(&nccl) == ncclSuccess) {
    out.push_back({"nccl", decode_nccl_version(nccl).str()});
  } else {
    out.push_back({"nccl", "unknown"});
  }
#else
  out.push_back({"nccl", "not found"});
#endif
  return out;
}

std::vector<std::string> device_descriptions() {
  std::vector<std::string> out;
  const int count = probe().device_count;
  for (int i = 0; i < count; ++i) {
    cudaDeviceProp prop{};
    cudaError_t err = cudaGetDeviceProperties(&prop, i);
    if (err != cudaSuccess) {
      (void)cudaGetLastError();
      out.push_back(
          fmt::format("cuda:{} (cudaGetDeviceProperties failed: {})", i, cudaGetErrorName(err)));
      continue;
    }
    char pci[32] = "?";
    if (cudaDeviceGetPCIBusId(pci, sizeof pci, i) != cudaSuccess) (void)cudaGetLastError();
    out.push_back(fmt::format("cuda:{} {}, {:.1f} GiB, sm_{}{}, PCI {}", i, prop.name,
                              double(prop.totalGlobalMem) / double(1u << 30), prop.major,
                              prop.minor, pci));
  }
  return out;
}

}  // namespace gpu::backend
}  // namespace strata
