// The Device interface: memory, streams, events, copies and kernels of one accelerator.
//
// Two backends implement it: CudaDevice (src/gpu) and HostDevice (src/cpu), a GPU emulated
// on the CPU for tests and GPU-less machines. The scheduler talks to this interface only.
//
// Contract, the same on every backend:
//  - Buffer is an owning, move-only handle to device memory that knows its device, size
//    and memory space. Freeing is stream-ordered when the buffer was allocated on a stream
//    (like cudaFreeAsync): work queued on that stream before the free still sees the bytes.
//    Work on *other* streams that touches the buffer must be ordered before the free with
//    an event, exactly as on CUDA. A buffer allocated without a stream is freed only after
//    the whole device is idle.
//  - Every Stream operation is asynchronous: it returns before the work is done. Work on
//    one stream runs in order; across streams only events order it.
//  - Kernels read and write device memory only. Copies move bytes between host memory
//    (MemSpace::kHost) and device memory in any direction.
//  - Argument errors (zero sizes, mismatched sizes, refs outside a buffer, a wait on an
//    event whose stream was destroyed) throw strata::Error at the call, before anything
//    is queued. Failures inside queued work surface at the next synchronize().
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "strata/dtype.h"

namespace strata {

namespace model_ops {
class Backend;  // strata/model_ops.h
}

enum class DeviceKind { kCpu, kCuda };
enum class MemSpace : std::uint8_t { kHost, kDevice };

const char* device_kind_name(DeviceKind kind);
const char* mem_space_name(MemSpace space);

class Device;
class Stream;

// Statistics of a device's memory; exact, taken under the allocator's lock.
struct DeviceStats {
  std::size_t capacity_bytes = 0;  // the budget allocations may not exceed
  std::size_t bytes_in_use = 0;    // live allocations, rounded to the allocator's unit
  std::size_t peak_bytes_in_use = 0;
  std::size_t bytes_reserved = 0;  // held from the system (cached blocks included)
  std::uint64_t num_allocs = 0;
  std::uint64_t num_frees = 0;
  std::uint64_t num_alloc_failures = 0;  // requests refused for lack of memory
  // Requests that found the device full and first waited for memory freed but still queued
  // on streams (a stall of the calling thread).
  std::uint64_t num_alloc_waits = 0;
  // Requests served at once by a block whose free was still queued on the same stream
  // (both devices count them).
  std::uint64_t num_reused = 0;
};

// A non-owning view of bytes, in host memory or in one device's memory.
struct MemRef {
  void* ptr = nullptr;
  std::size_t bytes = 0;
  MemSpace space = MemSpace::kHost;
  const Device* device = nullptr;  // set for kDevice refs
};

// Host memory as a copy endpoint (pinned memory from PinnedPool copies fastest).
inline MemRef host_ref(void* ptr, std::size_t bytes) {
  return MemRef{ptr, bytes, MemSpace::kHost, nullptr};
}
inline MemRef host_ref(const void* ptr, std::size_t bytes) {
  return host_ref(const_cast<void*>(ptr), bytes);
}

// An owning handle to device memory. Move-only; frees on destruction (see contract above).
class Buffer {
 public:
  Buffer() = default;
  Buffer(Buffer&& other) noexcept;
  Buffer& operator=(Buffer&& other) noexcept;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer();

  void* data() const noexcept { return ptr_; }
  std::size_t size() const noexcept { return bytes_; }
  MemSpace space() const noexcept { return MemSpace::kDevice; }
  Device* device() const noexcept { return device_; }
  explicit operator bool() const noexcept { return ptr_ != nullptr; }

  // The whole buffer, or [offset, offset + bytes) of it; throws if outside the buffer.
  MemRef ref() const;
  MemRef ref(std::size_t offset, std::size_t bytes) const;

  // Frees now (stream-ordered, as the destructor does) and leaves the handle empty.
  void reset();
  // Frees in `stream`'s order instead of the allocating stream's (cudaFreeAsync on the
  // stream that uses it last): for a buffer whose last user is `stream`, which must already
  // be ordered after every other use (by events). Leaves the handle empty.
  void reset_on(Stream& stream);

 private:
  friend class Device;
  Buffer(Device* device, void* ptr, std::size_t bytes, void* block)
      : device_(device), ptr_(ptr), bytes_(bytes), block_(block) {}
  Device* device_ = nullptr;
  void* ptr_ = nullptr;
  std::size_t bytes_ = 0;
  void* block_ = nullptr;  // the backend's record of this allocation
};

// A typed, contiguous run of elements in device memory (or host memory for copies).
struct TensorRef {
  MemRef mem;
  DType dtype = DType::kF32;
  std::size_t numel = 0;
};

// `numel` elements of `dtype` starting `offset_elems` elements into `buf`.
TensorRef tensor(const Buffer& buf, DType dtype, std::size_t numel, std::size_t offset_elems = 0);
// The whole buffer as elements of `dtype` (its size must be a multiple of the element size).
TensorRef tensor(const Buffer& buf, DType dtype);

// Host memory as a typed tensor (for CpuAdamW and other host-side kernels).
inline TensorRef host_tensor(const void* ptr, DType dtype, std::size_t numel) {
  return TensorRef{host_ref(ptr, numel * dtype_size(dtype)), dtype, numel};
}

// Hyper-parameters of one AdamW step (torch.optim.AdamW semantics; see docs/adamw.md, "Semantics").
struct AdamWOptions {
  float lr = 1e-3f;           // >= 0, finite; the rate of this step (schedules set it per step)
  float beta1 = 0.9f;         // in [0, 1)
  float beta2 = 0.999f;       // in [0, 1)
  float eps = 1e-8f;          // >= 0
  float weight_decay = 0.0f;  // decoupled: p *= 1 - lr * weight_decay, before the Adam update
  bool bias_correction = true;
  // Every gradient is multiplied by this first: folds 1 / loss_scale and the clip coefficient.
  float grad_scale = 1.0f;  // finite, >= 0
  std::int64_t step = 1;    // t of this step, 1-based (the bias corrections use it)
};

// What to do about non-finite (NaN / Inf) gradients.
enum class NonFinitePolicy {
  // A read-only pre-check pass over every gradient first; if any is non-finite nothing at all
  // is written (fp16 dynamic loss scaling skips the step). Costs one more read of the grads.
  kSkipStep,
  // Detection fused into the update pass, reported after it; non-finite values propagate
  // into the updated state as in PyTorch (bf16/fp32, where the engine checked the norm).
  kReportOnly,
};

// One shard of a fused AdamW step. params fp32 (master weights); grads fp32 or bf16;
// m and v both fp32 or both bf16; copy_out (optional: numel 0 = none) bf16 or fp16 receives
// the updated params rounded to nearest even. All have the same numel and do not overlap.
//
// (optional) Out-of-place step: with params_src, m_src and v_src set (all three or none), the
// old master weights and moments are read from them and the new ones written to params, m and
// v; the sources are left untouched, so a step can be tried on a second copy of the state
// while the first stays valid. Each source has its destination's dtype and length, and may be
// the very memory of its destination (an in-place step) but must not otherwise overlap
// params, m, v or copy_out. The results are bit-identical to the in-place step's.
//
// `decay` false: weight decay skips this shard (norm weights and biases, as the Hugging Face
// Trainer's AdamW leaves them), which then steps as with weight_decay 0, bit for bit.
struct AdamWShard {
  TensorRef params, grads, m, v, copy_out;
  TensorRef params_src = {}, m_src = {}, v_src = {};
  bool decay = true;
  // What the step reads: the sources when set (validated: all three or none), else what it
  // overwrites.
  bool out_of_place() const { return params_src.mem.ptr != nullptr; }
  const TensorRef& params_in() const { return out_of_place() ? params_src : params; }
  const TensorRef& m_in() const { return out_of_place() ? m_src : m; }
  const TensorRef& v_in() const { return out_of_place() ? v_src : v; }
};

// A multi-tensor AdamW step over `shards` (one launch on CUDA).
struct AdamWDesc {
  AdamWOptions options;
  std::vector<AdamWShard> shards;
  NonFinitePolicy policy = NonFinitePolicy::kSkipStep;
  // (optional) fp32, >= 1 element: receives the count of non-finite gradients (after
  // grad_scale) as a float, exact below 2^24. Lets the host decide later without a sync.
  TensorRef non_finite;
};

// C[m,n] = alpha * op(A)[m,k] * op(B)[k,n] + beta * C, all row-major and contiguous.
// op(A) = A, or A^T when trans_a (then A is stored [k,m]); likewise B ([n,k] when trans_b).
// A and B: both fp32 or both bf16 (fp16 also on CUDA); accumulation is fp32; C is fp32 or bf16.
struct MatmulDesc {
  std::int64_t m = 0, n = 0, k = 0;
  bool trans_a = false, trans_b = false;
  float alpha = 1.0f, beta = 0.0f;
  TensorRef a, b, c;
};

namespace detail {
// Shared by the backends: the life of a stream, which events outlive.
struct StreamLife {
  explicit StreamLife(std::string n) : name(std::move(n)) {}
  std::string name;
  std::atomic<bool> alive{true};  // cleared when the stream is destroyed
};
struct EventImpl {
  virtual ~EventImpl() = default;
  virtual bool query() = 0;
  virtual void synchronize() = 0;
  const Device* device = nullptr;
  std::shared_ptr<StreamLife> stream;
  std::uint64_t seq = 0;  // position in its stream; for messages and HostDevice ordering
};
}  // namespace detail

// A marker recorded in a stream's order. Cheap to copy; outlives its stream.
class Event {
 public:
  Event() = default;
  explicit Event(std::shared_ptr<detail::EventImpl> impl) : impl_(std::move(impl)) {}
  bool valid() const noexcept { return impl_ != nullptr; }
  // True once all work queued before record() has finished.
  bool query() const;
  // Blocks the calling host thread until query() is true.
  void synchronize() const;
  const std::shared_ptr<detail::EventImpl>& impl() const noexcept { return impl_; }

 private:
  std::shared_ptr<detail::EventImpl> impl_;
};

// An in-order queue of device work. The public methods validate their arguments, then
// hand the work to the backend (do_*). Destroying a stream waits for its work to finish.
class Stream {
 public:
  virtual ~Stream() = default;
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;

  const std::string& name() const noexcept { return life_->name; }
  Device& device() const noexcept { return *device_; }
  // (optional) The backend's own queue (cudaStream_t on CUDA) for backend code outside
  // this interface, such as NCCL or fused optimizer kernels; nullptr on HostDevice.
  virtual void* native_handle() const noexcept { return nullptr; }

  // Asynchronous copy of src.bytes bytes (sizes must match) between any two spaces.
  // Host endpoints must stay valid until the copy completes.
  void copy(MemRef dst, MemRef src);
  // Records the current end of this stream.
  Event record();
  // Later work on this stream waits for `event` (recorded on any live stream of this device).
  void wait(const Event& event);
  // Blocks the host until all queued work finished; rethrows the first failure inside it.
  void synchronize();
  // Runs `fn` on a host thread in stream order (after earlier work, before later work).
  // `fn` may queue work and may block on other streams' events or host state, but must
  // not synchronize its own stream or the whole device (that would wait on itself). It may
  // drop the last reference to a Buffer: one freed on a stream is freed in that stream's order;
  // one allocated without a stream returns to the device at its next device-wide wait (the
  // emulated device; on CUDA such a free inside a host function is cudaFree, which must not be
  // called there: free on a stream instead).
  // `trace_name` (a string with static lifetime) names its span on the emulated device, where
  // host functions are also how CPU kernels outside this interface run; `trace_bytes` is the
  // span's bytes (a collective's, say).
  void host_fn(std::function<void()> fn, const char* trace_name = "host_fn",
               std::uint64_t trace_bytes = 0);

  // Kernels (device memory only). Element-wise kernels compute in fp32 whatever the dtype.
  void fill(TensorRef x, float value);
  void axpy(float alpha, TensorRef x, TensorRef y);   // y += alpha * x
  void scale(float alpha, TensorRef x);               // x *= alpha
  void add(TensorRef a, TensorRef b, TensorRef out);  // out = a + b
  void cast(TensorRef src, TensorRef dst);            // dst = src converted (RNE)
  void sum_squares(TensorRef x, TensorRef out);       // out[0] (fp32) = sum(x^2)
  void matmul(const MatmulDesc& desc);
  // Fused AdamW over every shard (all device tensors of this device); see AdamWDesc.
  void adamw(const AdamWDesc& desc);

 protected:
  Stream(Device* device, std::string name)
      : device_(device), life_(std::make_shared<detail::StreamLife>(std::move(name))) {}
  // Backends call this first thing in their destructor, after draining their queue.
  void mark_destroyed() noexcept { life_->alive = false; }
  const std::shared_ptr<detail::StreamLife>& life() const noexcept { return life_; }
  // At destruction: a failure of the stream's work nothing asked about is said, not dropped.
  void warn_unreported(std::exception_ptr err, const char* what) const noexcept;

  virtual void do_copy(MemRef dst, MemRef src) = 0;
  virtual Event do_record() = 0;
  virtual void do_wait(const Event& event) = 0;
  virtual void do_synchronize() = 0;
  virtual void do_host_fn(std::function<void()> fn, const char* trace_name,
                          std::uint64_t trace_bytes) = 0;
  virtual void do_fill(TensorRef x, float value) = 0;
  virtual void do_axpy(float alpha, TensorRef x, TensorRef y) = 0;
  virtual void do_scale(float alpha, TensorRef x) = 0;
  virtual void do_add(TensorRef a, TensorRef b, TensorRef out) = 0;
  virtual void do_cast(TensorRef src, TensorRef dst) = 0;
  virtual void do_sum_squares(TensorRef x, TensorRef out) = 0;
  virtual void do_matmul(const MatmulDesc& desc) = 0;
  virtual void do_adamw(const AdamWDesc& desc) = 0;

 private:
  void require_device_tensor(const TensorRef& t, const char* what) const;
  Device* device_;
  std::shared_ptr<detail::StreamLife> life_;
};

class Device {
 public:
  virtual ~Device() = default;
  Device(const Device&) = delete;
  Device& operator=(const Device&) = delete;

  virtual DeviceKind kind() const = 0;
  // Human-readable, e.g. "cpu-emulated (cap 2.00 GiB)" or "NVIDIA H200 (cuda:0)".
  virtual std::string name() const = 0;

  // Allocates `bytes` (> 0) of device memory. With a stream, the buffer's free is ordered
  // on that stream. Throws ErrorKind::kOutOfMemory naming requested, in-use and cap bytes.
  Buffer alloc(std::size_t bytes, Stream* stream = nullptr);
  virtual std::unique_ptr<Stream> create_stream(std::string name) = 0;
  virtual DeviceStats stats() const = 0;
  // Restarts peak_bytes_in_use from the bytes in use now (the peak of what comes next).
  virtual void reset_peak_stats() = 0;
  // Blocks until every stream of this device is idle.
  virtual void synchronize() = 0;

  // (optional) Page-locks host memory for fast, truly asynchronous copies; returns false
  // where the backend has nothing to do (HostDevice) or cannot.
  virtual bool register_host(void* ptr, std::size_t bytes);
  virtual void unregister_host(void* ptr);
  // (optional) The NUMA node nearest this device (host memory for it is best placed there),
  // or -1 where unknown.
  virtual int numa_node() const;
  // (optional) The model's kernels on this device (strata/model_ops.h), which the model calls
  // through it; nullptr (the default) where the backend has none: the engine runs, the model
  // does not.
  virtual const model_ops::Backend* model_kernels() const { return nullptr; }

 protected:
  Device() = default;
  friend class Buffer;
  // Returns the pointer and sets `block` to the backend's record of the allocation.
  virtual void* do_alloc(std::size_t bytes, Stream* stream, void** block) = 0;
  virtual void do_free(void* block) noexcept = 0;
  // do_free in `stream`'s order. The default waits for `stream` on the host, then frees.
  virtual void do_free_on(void* block, Stream& stream) noexcept;
};

// ---- the CPU-emulated device (src/cpu) ----
struct HostDeviceOptions {
  std::size_t capacity_bytes = std::size_t(4) << 30;  // the emulated HBM budget
  double h2d_gbps = 0;  // throttle host->device copies to this rate; 0 = as fast as memcpy
  double d2h_gbps = 0;
  double d2d_gbps = 0;
  // Throttle matmuls to this rate: one then takes at least 2*m*n*k / (compute_gflops * 1e9)
  // seconds, so a scheduler can be tested against a device slower (or, relative to the
  // links, faster) than the host's cores. 0 = as fast as the CPU kernels run.
  double compute_gflops = 0;
  // OpenMP threads each stream's kernels use (0 = every core). Fewer leave cores to the
  // host's own work (the CPU AdamW), as a GPU's kernels do not compete with the CPU.
  int compute_threads = 0;
  // Sleep a seeded-random 0..random_delay_us before each queued operation, to expose
  // missing waits. 0 = off.
  std::uint32_t random_delay_us = 0;
  std::uint64_t seed = 1;
  bool poison = true;  // fill fresh and freed memory with a NaN pattern (0x7fc0 per 16 bits)
};
std::unique_ptr<Device> make_host_device(const HostDeviceOptions& options = {});

// The emulated device's kernels run on OpenMP teams (libgomp, which oneDNN uses too). By
// default libgomp spins a team's threads after each parallel region; with the streams, the
// host thread and the CPU optimizer sharing a few cores, those spins starve the thread that
// issues the next kernel (measured on 2 cores: a 0.9 ms layer took 2.1 ms inside a step,
// the strata-prof regimes ran 10-20% slower and predictions missed by up to 41%). libgomp
// reads OMP_WAIT_POLICY once, when it loads, so it must be in the environment the program
// starts with. Call first thing in main(): when OMP_WAIT_POLICY is unset it sets it to
// PASSIVE and re-executes the program (same arguments and pid; /proc/self/exe) and does not
// return; a value the user set is kept, and if the re-execution fails the program goes on
// with libgomp's default. The strata tools call it; a program embedding strata may instead
// be started with OMP_WAIT_POLICY=PASSIVE.
void reexec_with_passive_openmp(char** argv);

// ---- CUDA (src/gpu) ----
struct CudaProbe {
  bool compiled = false;  // built with the CUDA backend
  int device_count = 0;
  std::string reason;  // why there is no usable device, e.g. "no CUDA driver
                       // (cudaErrorInsufficientDriver, error 35)"
};
CudaProbe probe_cuda();

struct CudaDeviceOptions {
  // -1: make_device picks the launcher's local rank modulo the visible GPUs (0 without a
  // launcher); make_cuda_device takes it as 0.
  int ordinal = -1;
  // 0 = what the device has free at creation less a headroom (default_cuda_capacity).
  std::size_t capacity_bytes = 0;
};
std::unique_ptr<Device> make_cuda_device(const CudaDeviceOptions& options = {});

// The default CUDA device cap: the free bytes at creation less max(3 GiB, 5% of the total),
// room for what comes later and is not strata's to plan (NCCL's communicator and the buffers
// it connects lazily, cuBLAS workspaces, the context's own growth); half the free bytes when
// that leaves nothing.
constexpr std::size_t default_cuda_capacity(std::size_t free_bytes, std::size_t total_bytes) {
  const std::size_t headroom = std::max(std::size_t(3) << 30, total_bytes / 20);
  return free_bytes > headroom ? free_bytes - headroom : free_bytes / 2;
}

// "auto" picks CUDA when a GPU is usable, else the CPU-emulated device; "cpu" and "cuda"
// force a backend (cuda throws with probe_cuda().reason when none is usable).
std::unique_ptr<Device> make_device(std::string_view which, const HostDeviceOptions& host = {},
                                    const CudaDeviceOptions& cuda = {});

// The pattern poisoned memory holds: 0x7fc0 repeated, a quiet NaN as fp32, bf16 and fp16.
inline constexpr std::uint16_t kPoison16 = 0x7fc0;

}  // namespace strata
