// Dispatch of the model's ops to the CPU kernels (queued with host_fn, so they run on the
// HostDevice stream's worker in stream order) or the CUDA launchers (on the native stream).
// Only plain values are captured: the pointers stay valid because every buffer the model
// frees is freed in this stream's order, after the op has run.
#include "model/ops.h"

#include "cpu/model_kernels.h"
#include "strata/error.h"
#ifdef STRATA_HAVE_CUDA
#include "gpu/model_kernels.h"
#endif

namespace strata::model_ops {
namespace {

bool on_cuda(Stream& s) { return s.device().kind() == DeviceKind::kCuda; }

#ifdef STRATA_HAVE_CUDA
void check(int err, const char* op) {
  if (err != 0)
    STRATA_THROW(kCuda, "model kernel {} failed to launch: {} (error {})", op, gpu::model::error_text(err),
                 err);
}
#define STRATA_GPU_OP(name, ...)                                              \
  if (on_cuda(s)) {                                                           \
    check(gpu::model::name(__VA_ARGS__, s.native_handle()), #name);           \
    return;                                                                   \
  }
#else
#define STRATA_GPU_OP(name, ...) \
  STRATA_CHECK(!on_cuda(s), "model op " #name ": a CUDA stream in a build without CUDA");
#endif

void require_w(Weight w, const char* what) {
  STRATA_REQUIRE(w.dtype == DType::kF32 || w.dtype == DType::kBF16,
                 "model op {}: weights must be fp32 or bf16, got {}", what, dtype_name(w.dtype));
}

// Calls fn with the weight pointer(s) typed as float or bf16_t.
template <class Fn>
void with_w(Weight w, Fn fn) {
  if (w.dtype == DType::kBF16)
    fn(static_cast<const cpu::bf16_t*>(w.ptr));
  else
    fn(static_cast<const float*>(w.ptr));
}

}  // namespace

void embedding_forward(Stream& s, const std::int32_t* tokens, Weight wte, Weight wpe, float* out, i64 n,
                       i64 t, i64 c) {
  require_w(wte, "embedding_forward");
  STRATA_GPU_OP(embedding_forward, tokens, wte.ptr, wpe.ptr, wte.dtype == DType::kBF16, out, n, t, c)
  s.host_fn([=] {
    with_w(wte, [&](auto* e) {
      using W = std::remove_const_t<std::remove_pointer_t<decltype(e)>>;
      cpu::embedding_forward<float, W>(tokens, e, static_cast<const W*>(wpe.ptr), out, n, t, c);
    });
  });
}

void embedding_backward(Stream& s, const std::int32_t* tokens, const float* dout, float* dwte, float* dwpe,
                        i64 n, i64 t, i64 c) {
  STRATA_GPU_OP(embedding_backward, tokens, dout, dwte, dwpe, n, t, c)
  s.host_fn([=] { cpu::embedding_backward<float>(tokens, dout, dwte, dwpe, n, t, c); });
}

void rmsnorm_forward(Stream& s, const float* x, Weight w, float* out, float* rstd, i64 n, i64 c, double eps) {
  require_w(w, "rmsnorm_forward");
  STRATA_GPU_OP(rmsnorm_forward, x, w.ptr, w.dtype == DType::kBF16, out, rstd, n, c, eps)
  s.host_fn([=] { with_w(w, [&](auto* wp) { cpu::rmsnorm_forward(x, wp, out, rstd, n, c, eps); }); });
}

void rmsnorm_backward(Stream& s, const float* dout, const float* x, Weight w, const float* rstd, float* dx,
                      float* dw, i64 n, i64 c) {
  require_w(w, "rmsnorm_backward");
  STRATA_GPU_OP(rmsnorm_backward, dout, x, w.ptr, w.dtype == DType::kBF16, rstd, dx, dw, n, c)
  s.host_fn([=] { with_w(w, [&](auto* wp) { cpu::rmsnorm_backward(dout, x, wp, rstd, dx, dw, n, c); }); });
}

void layernorm_forward(Stream& s, const float* x, Weight w, Weight b, float* out, float* mean, float* rstd,
                       i64 n, i64 c, double eps) {
  require_w(w, "layernorm_forward");
  STRATA_REQUIRE(w.dtype == b.dtype, "layernorm_forward: weight and bias dtypes differ");
  STRATA_GPU_OP(layernorm_forward, x, w.ptr, b.ptr, w.dtype == DType::kBF16, out, mean, rstd, n, c, eps)
  s.host_fn([=] {
    with_w(w, [&](auto* wp) {
      using W = std::remove_pointer_t<decltype(wp)>;
      cpu::layernorm_forward(x, wp, static_cast<W*>(b.ptr), out, mean, rstd, n, c, eps);
    });
  });
}

void layernorm_backward(Stream& s, const float* dout, const float* x, Weight w, const float* mean,
                        const float* rstd, float* dx, float* dw, float* db, i64 n, i64 c) {
  require_w(w, "layernorm_backward");
  STRATA_GPU_OP(layernorm_backward, dout, x, w.ptr, w.dtype == DType::kBF16, mean, rstd, dx, dw, db, n, c)
  s.host_fn([=] {
    with_w(w, [&](auto* wp) { cpu::layernorm_backward(dout, x, wp, mean, rstd, dx, dw, db, n, c); });
  });
}

void rope(Stream& s, float* x, i64 n, i64 t, i64 stride, i64 col, i64 heads, i64 hd, const float* cos,
          const float* sin, bool inverse) {
  STRATA_GPU_OP(rope, x, n, t, stride, col, heads, hd, cos, sin, inverse)
  s.host_fn([=] { cpu::rope_apply<float>(x, n, t, stride, col, heads, hd, cos, sin, inverse); });
}

void attention_forward(Stream& s, const float* qkv, float* o, float* lse, i64 b, i64 t, i64 nh, i64 nkv,
                       i64 hd, double scale) {
  STRATA_REQUIRE(hd <= 512 && nh % nkv == 0, "attention: head_dim {} must be <= 512, heads {} a multiple of {}",
                 hd, nh, nkv);
  STRATA_GPU_OP(attention_forward, qkv, o, lse, b, t, nh, nkv, hd, scale)
  s.host_fn([=] { cpu::attention_forward<float>(qkv, o, lse, b, t, nh, nkv, hd, scale); });
}

void attention_backward(Stream& s, const float* qkv, const float* o, const float* dout, const float* lse,
                        float* dqkv, i64 b, i64 t, i64 nh, i64 nkv, i64 hd, double scale) {
  STRATA_GPU_OP(attention_backward, qkv, o, dout, lse, dqkv, b, t, nh, nkv, hd, scale)
  s.host_fn([=] { cpu::attention_backward<float>(qkv, o, dout, lse, dqkv, b, t, nh, nkv, hd, scale); });
}

void swiglu_forward(Stream& s, const float* gu, float* out, i64 n, i64 inter) {
  STRATA_GPU_OP(swiglu_forward, gu, out, n, inter)
  s.host_fn([=] { cpu::swiglu_forward<float>(gu, out, n, inter); });
}

void swiglu_backward(Stream& s, const float* dout, const float* gu, float* dgu, i64 n, i64 inter) {
  STRATA_GPU_OP(swiglu_backward, dout, gu, dgu, n, inter)
  s.host_fn([=] { cpu::swiglu_backward<float>(dout, gu, dgu, n, inter); });
}

void gelu_forward(Stream& s, const float* x, float* out, i64 n) {
  STRATA_GPU_OP(gelu_forward, x, out, n)
  s.host_fn([=] { cpu::gelu_forward<float>(x, out, n); });
}

void gelu_backward(Stream& s, const float* dout, const float* x, float* dx, i64 n) {
  STRATA_GPU_OP(gelu_backward, dout, x, dx, n)
  s.host_fn([=] { cpu::gelu_backward<float>(dout, x, dx, n); });
}

void bias_add(Stream& s, float* y, Weight b, i64 n, i64 m) {
  require_w(b, "bias_add");
  STRATA_GPU_OP(bias_add, y, b.ptr, b.dtype == DType::kBF16, n, m)
  s.host_fn([=] { with_w(b, [&](auto* bp) { cpu::bias_add(y, bp, n, m); }); });
}

void bias_backward(Stream& s, const float* dy, float* db, i64 n, i64 m) {
  STRATA_GPU_OP(bias_backward, dy, db, n, m)
  s.host_fn([=] { cpu::bias_backward<float>(dy, db, n, m); });
}

void cross_entropy(Stream& s, float* logits, const std::int32_t* targets, float* losses, i64 rows, i64 vocab,
                   double grad_scale) {
  STRATA_GPU_OP(cross_entropy, logits, targets, losses, rows, vocab, grad_scale)
  s.host_fn([=] { cpu::cross_entropy<float>(logits, targets, losses, rows, vocab, grad_scale); });
}

}  // namespace strata::model_ops
