// The single wrapper layer over every Device backend: argument validation (so both
// backends reject bad input with the same message), buffer ownership, and the
// fallbacks for optional hooks.
#include "strata/device.h"

#include "core/adamw_common.h"
#include "strata/error.h"
#include "strata/log.h"
#include "strata/model_ops.h"

namespace strata {

const char* device_kind_name(DeviceKind kind) { return kind == DeviceKind::kCuda ? "cuda" : "cpu"; }
const char* mem_space_name(MemSpace space) {
  return space == MemSpace::kDevice ? "device" : "host";
}

// ---- Buffer ----
Buffer::Buffer(Buffer&& o) noexcept
    : device_(o.device_), ptr_(o.ptr_), bytes_(o.bytes_), block_(o.block_) {
  o.device_ = nullptr;
  o.ptr_ = nullptr;
  o.bytes_ = 0;
  o.block_ = nullptr;
}

Buffer& Buffer::operator=(Buffer&& o) noexcept {
  if (this != &o) {
    reset();
    std::swap(device_, o.device_);
    std::swap(ptr_, o.ptr_);
    std::swap(bytes_, o.bytes_);
    std::swap(block_, o.block_);
  }
  return *this;
}

Buffer::~Buffer() { reset(); }

void Buffer::reset() {
  if (device_ && block_) device_->do_free(block_);
  device_ = nullptr;
  ptr_ = nullptr;
  bytes_ = 0;
  block_ = nullptr;
}

void Buffer::reset_on(Stream& stream) {
  STRATA_REQUIRE(!device_ || &stream.device() == device_,
                 "Buffer::reset_on: stream '{}' belongs to another device than the buffer",
                 stream.name());
  if (device_ && block_) device_->do_free_on(block_, stream);
  device_ = nullptr;
  ptr_ = nullptr;
  bytes_ = 0;
  block_ = nullptr;
}

void Device::do_free_on(void* block, Stream& stream) noexcept {
  try {
    stream.synchronize();
  } catch (const std::exception& e) {
    log::error("freeing a block after stream '{}': the stream failed ({}); freeing it anyway",
               stream.name(), e.what());
  }
  do_free(block);
}

MemRef Buffer::ref() const {
  STRATA_REQUIRE(ptr_ != nullptr, "ref() of an empty Buffer: allocate it first");
  return MemRef{ptr_, bytes_, MemSpace::kDevice, device_};
}

MemRef Buffer::ref(std::size_t offset, std::size_t bytes) const {
  STRATA_REQUIRE(ptr_ != nullptr, "ref() of an empty Buffer: allocate it first");
  STRATA_REQUIRE(offset <= bytes_ && bytes <= bytes_ - offset,
                 "ref [{}, {}) lies outside the {}-byte buffer", offset, offset + bytes, bytes_);
  return MemRef{static_cast<char*>(ptr_) + offset, bytes, MemSpace::kDevice, device_};
}

TensorRef tensor(const Buffer& buf, DType dtype, std::size_t numel, std::size_t offset_elems) {
  const std::size_t es = dtype_size(dtype);
  STRATA_REQUIRE(numel <= SIZE_MAX / es && offset_elems <= SIZE_MAX / es, "tensor size overflows");
  return TensorRef{buf.ref(offset_elems * es, numel * es), dtype, numel};
}

TensorRef tensor(const Buffer& buf, DType dtype) {
  const std::size_t es = dtype_size(dtype);
  STRATA_REQUIRE(buf.size() % es == 0, "a {}-byte buffer is not a whole number of {} elements",
                 buf.size(), dtype_name(dtype));
  return TensorRef{buf.ref(), dtype, buf.size() / es};
}

// ---- Event ----
bool Event::query() const {
  STRATA_REQUIRE(impl_ != nullptr, "query() of an empty Event: record() one on a stream first");
  return impl_->query();
}

void Event::synchronize() const {
  STRATA_REQUIRE(impl_ != nullptr,
                 "synchronize() of an empty Event: record() one on a stream first");
  impl_->synchronize();
}

// ---- Stream: validation, then the backend ----
void Stream::warn_unreported(std::exception_ptr err, const char* what) const noexcept {
  if (!err) return;
  try {
    std::rethrow_exception(err);
  } catch (const std::exception& e) {
    log::warn("stream '{}' destroyed with an unreported {}: {}", name(), what, e.what());
  } catch (...) {
    log::warn("stream '{}' destroyed with an unreported {}", name(), what);
  }
}

void Stream::require_device_tensor(const TensorRef& t, const char* what) const {
  STRATA_REQUIRE(t.mem.ptr != nullptr, "{} of stream '{}': tensor '{}' has no memory", "kernel",
                 name(), what);
  STRATA_REQUIRE(t.numel > 0, "kernel on stream '{}': tensor '{}' has zero elements", name(), what);
  STRATA_REQUIRE(t.mem.space == MemSpace::kDevice && t.mem.device == device_,
                 "kernel on stream '{}': tensor '{}' is not in this device's memory; copy it "
                 "to a Buffer of this device first",
                 name(), what);
  STRATA_REQUIRE(t.dtype != DType::kF64,
                 "kernel on stream '{}': tensor '{}' is fp64; kernels take "
                 "fp32, bf16 or fp16",
                 name(), what);
  STRATA_REQUIRE(t.mem.bytes >= t.numel * dtype_size(t.dtype),
                 "kernel on stream '{}': tensor '{}' claims {} {} elements but its memory holds "
                 "only {} bytes",
                 name(), what, t.numel, dtype_name(t.dtype), t.mem.bytes);
}

void Stream::copy(MemRef dst, MemRef src) {
  STRATA_REQUIRE(dst.ptr && src.ptr, "copy on stream '{}': null {} pointer", name(),
                 dst.ptr ? "source" : "destination");
  STRATA_REQUIRE(src.bytes > 0, "copy on stream '{}': zero bytes; skip empty copies", name());
  STRATA_REQUIRE(dst.bytes == src.bytes,
                 "copy on stream '{}' between mismatched sizes: destination {} bytes, source {} "
                 "bytes; pass refs of the same size",
                 name(), dst.bytes, src.bytes);
  for (const MemRef* r : {&dst, &src}) {
    STRATA_REQUIRE(r->space == MemSpace::kHost || r->device == device_,
                   "copy on stream '{}': a device ref belongs to another device", name());
  }
  do_copy(dst, src);
}

Event Stream::record() { return do_record(); }

void Stream::wait(const Event& event) {
  STRATA_REQUIRE(event.valid(), "wait on stream '{}': the event is empty; record() it first",
                 name());
  const auto& impl = event.impl();
  STRATA_REQUIRE(impl->device == device_,
                 "wait on stream '{}': the event was recorded on another device", name());
  STRATA_REQUIRE(impl->stream && impl->stream->alive.load(),
                 "wait on stream '{}': event #{} belongs to stream '{}', which was destroyed; "
                 "record events on a stream that outlives their waits",
                 name(), impl->seq, impl->stream ? impl->stream->name : std::string("?"));
  do_wait(event);
}

void Stream::synchronize() { do_synchronize(); }

void Stream::host_fn(std::function<void()> fn, const char* trace_name, std::uint64_t trace_bytes) {
  STRATA_REQUIRE(static_cast<bool>(fn), "host_fn on stream '{}': empty function", name());
  do_host_fn(std::move(fn), trace_name ? trace_name : "host_fn", trace_bytes);
}

void Stream::fill(TensorRef x, float value) {
  require_device_tensor(x, "x");
  do_fill(x, value);
}

void Stream::axpy(float alpha, TensorRef x, TensorRef y) {
  require_device_tensor(x, "x");
  require_device_tensor(y, "y");
  STRATA_REQUIRE(x.numel == y.numel, "axpy on stream '{}': x has {} elements, y has {}", name(),
                 x.numel, y.numel);
  do_axpy(alpha, x, y);
}

void Stream::scale(float alpha, TensorRef x) {
  require_device_tensor(x, "x");
  do_scale(alpha, x);
}

void Stream::add(TensorRef a, TensorRef b, TensorRef out) {
  require_device_tensor(a, "a");
  require_device_tensor(b, "b");
  require_device_tensor(out, "out");
  STRATA_REQUIRE(a.numel == b.numel && a.numel == out.numel,
                 "add on stream '{}': element counts differ (a {}, b {}, out {})", name(), a.numel,
                 b.numel, out.numel);
  do_add(a, b, out);
}

void Stream::cast(TensorRef src, TensorRef dst) {
  require_device_tensor(src, "src");
  require_device_tensor(dst, "dst");
  STRATA_REQUIRE(src.numel == dst.numel, "cast on stream '{}': src has {} elements, dst has {}",
                 name(), src.numel, dst.numel);
  do_cast(src, dst);
}

void Stream::sum_squares(TensorRef x, TensorRef out) {
  require_device_tensor(x, "x");
  require_device_tensor(out, "out");
  STRATA_REQUIRE(out.dtype == DType::kF32, "sum_squares on stream '{}': out must be fp32, got {}",
                 name(), dtype_name(out.dtype));
  do_sum_squares(x, out);
}

void Stream::matmul(const MatmulDesc& d) {
  STRATA_REQUIRE(d.m > 0 && d.n > 0 && d.k > 0,
                 "matmul on stream '{}': m, n, k must be positive (got {}, {}, {})", name(), d.m,
                 d.n, d.k);
  require_device_tensor(d.a, "a");
  require_device_tensor(d.b, "b");
  require_device_tensor(d.c, "c");
  STRATA_REQUIRE(d.a.dtype == d.b.dtype, "matmul on stream '{}': a is {}, b is {}; they must match",
                 name(), dtype_name(d.a.dtype), dtype_name(d.b.dtype));
  STRATA_REQUIRE(d.c.dtype == DType::kF32 || d.c.dtype == DType::kBF16,
                 "matmul on stream '{}': c must be fp32 or bf16, got {}", name(),
                 dtype_name(d.c.dtype));
  const auto need = [](std::int64_t r, std::int64_t c) { return static_cast<std::size_t>(r * c); };
  STRATA_REQUIRE(d.a.numel == need(d.m, d.k), "matmul on stream '{}': a has {} elements, m*k = {}",
                 name(), d.a.numel, need(d.m, d.k));
  STRATA_REQUIRE(d.b.numel == need(d.k, d.n), "matmul on stream '{}': b has {} elements, k*n = {}",
                 name(), d.b.numel, need(d.k, d.n));
  STRATA_REQUIRE(d.c.numel == need(d.m, d.n), "matmul on stream '{}': c has {} elements, m*n = {}",
                 name(), d.c.numel, need(d.m, d.n));
  do_matmul(d);
}

void Stream::adamw(const AdamWDesc& d) {
  detail::validate_adamw_options(d.options);
  STRATA_REQUIRE(!d.shards.empty(), "adamw on stream '{}': no shards; pass at least one", name());
  for (std::size_t i = 0; i < d.shards.size(); ++i) {
    const AdamWShard& sh = d.shards[i];
    detail::validate_adamw_shard(sh, fmt::format("adamw on stream '{}', shard {}", name(), i));
    require_device_tensor(sh.params, "params");
    require_device_tensor(sh.grads, "grads");
    require_device_tensor(sh.m, "m");
    require_device_tensor(sh.v, "v");
    if (sh.copy_out.numel > 0) require_device_tensor(sh.copy_out, "copy_out");
    if (sh.out_of_place()) {
      require_device_tensor(sh.params_src, "params_src");
      require_device_tensor(sh.m_src, "m_src");
      require_device_tensor(sh.v_src, "v_src");
    }
  }
  if (d.non_finite.mem.ptr != nullptr) {
    require_device_tensor(d.non_finite, "non_finite");
    STRATA_REQUIRE(d.non_finite.dtype == DType::kF32,
                   "adamw on stream '{}': non_finite must be fp32, got {}", name(),
                   dtype_name(d.non_finite.dtype));
  }
  do_adamw(d);
}

// ---- Device ----
Buffer Device::alloc(std::size_t bytes, Stream* stream) {
  STRATA_REQUIRE(bytes > 0, "alloc of 0 bytes on {}: request at least one byte", name());
  STRATA_REQUIRE(stream == nullptr || &stream->device() == this,
                 "alloc on {}: the stream '{}' belongs to another device", name(), stream->name());
  void* block = nullptr;
  void* ptr = do_alloc(bytes, stream, &block);
  return Buffer(this, ptr, bytes, block);
}

bool Device::register_host(void*, std::size_t) { return false; }
void Device::unregister_host(void*) {}
int Device::numa_node() const { return -1; }

// ---- model_ops::Backend: the optional op ----
namespace {
[[noreturn]] void no_vocab_parallel(Stream& s) {
  STRATA_THROW(kUnsupported,
               "device {}'s model kernels have no vocabulary-parallel cross-entropy "
               "(model_ops::Backend::cross_entropy_stats / _finish): run without tensor "
               "parallelism, or implement them in the backend",
               s.device().name());
}
}  // namespace

void model_ops::Backend::cross_entropy_stats(Stream& s, const float*, const std::int32_t*, float*,
                                             i64, i64) const {
  no_vocab_parallel(s);
}
void model_ops::Backend::cross_entropy_finish(Stream& s, float*, const std::int32_t*, const float*,
                                              i64, float*, i64, i64, double, Out) const {
  no_vocab_parallel(s);
}

void model_ops::Backend::attention_cached(Stream& s, const float*, float*, float*, float*, void*,
                                          i64, i64, i64, i64, i64, double, bool) const {
  STRATA_THROW(kUnsupported,
               "device {}'s model kernels have no cached attention (model_ops::Backend::"
               "attention_cached): decode without the key/value cache (strata-generate "
               "--no-kv-cache), or implement it in the backend",
               s.device().name());
}

}  // namespace strata
