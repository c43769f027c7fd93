// Dispatch of the model's ops to the CPU kernels (queued with host_fn, so they run on the
// HostDevice stream's worker in stream order) or the CUDA launchers (on the native stream).
// Only plain values are captured: the pointers stay valid because every buffer the model
// frees is freed in this stream's order, after the op has run.
#include "model/ops.h"

#include "cpu/model_kernels.h"
#include "gpu/model_kernels.h"
#include "strata/error.h"

namespace strata::model_ops {
namespace {

bool on_cuda(Stream& s) { return s.device().kind() == DeviceKind::kCuda; }

void check(int err, const char* op) {
  if (err != 0)
    STRATA_THROW(kCuda, "model kernel {} failed to launch: {} (error {})", op,
                 gpu::model::kernels().error_text(err), err);
}
// The launchers are in the CUDA module, which is loaded whenever a CUDA stream exists.
#define STRATA_GPU_OP(name, ...)                                              \
  if (on_cuda(s)) {                                                           \
    check(gpu::model::kernels().name(__VA_ARGS__, s.native_handle()), #name); \
    return;                                                                   \
  }

void require_w(Weight w, const char* what) {
  STRATA_REQUIRE(w.dtype == DType::kF32 || w.dtype == DType::kBF16,
                 "model op {}: weights must be fp32 or bf16, got {}", what, dtype_name(w.dtype));
}

void require_out(Out out, const char* what) {
  STRATA_REQUIRE(out.dtype == DType::kF32 || out.dtype == DType::kBF16,
                 "model op {}: outputs must be fp32 or bf16, got {}", what, dtype_name(out.dtype));
}

// fp32 device memory x (numel) cast into bf16 y, on the stream.
void cast_to_bf16(Stream& s, const float* x, void* y, i64 numel) {
  const std::size_t n = std::size_t(numel);
  s.cast(TensorRef{MemRef{const_cast<float*>(x), n * 4, MemSpace::kDevice, &s.device()},
                   DType::kF32, n},
         TensorRef{MemRef{y, n * 2, MemSpace::kDevice, &s.device()}, DType::kBF16, n});
}

// The CUDA kernels write fp32: launch(dst) writes into out itself, or (bf16 out) into an fp32
// scratch allocated on the stream, which is then cast into out and freed in stream order.
template <class Launch>
void cuda_out(Stream& s, Out out, i64 numel, Launch launch) {
  if (out.dtype == DType::kF32) return launch(static_cast<float*>(out.ptr));
  Device& dev = s.device();
  Buffer tmp = dev.alloc(std::size_t(numel) * 4, &s);
  launch(static_cast<float*>(tmp.data()));
  cast_to_bf16(s, static_cast<const float*>(tmp.data()), out.ptr, numel);
}

// Calls fn with the output pointer typed as float or bf16_t.
template <class Fn>
void with_out(Out out, Fn fn) {
  if (out.dtype == DType::kBF16)
    fn(static_cast<cpu::bf16_t*>(out.ptr));
  else
    fn(static_cast<float*>(out.ptr));
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

void embedding_forward(Stream& s, const std::int32_t* tokens, Weight wte, Weight wpe, float* out,
                       i64 n, i64 t, i64 c) {
  require_w(wte, "embedding_forward");
  STRATA_GPU_OP(embedding_forward, tokens, wte.ptr, wpe.ptr, wte.dtype == DType::kBF16, out, n, t,
                c)
  s.host_fn(
      [=] {
        with_w(wte, [&](auto* e) {
          using W = std::remove_const_t<std::remove_pointer_t<decltype(e)>>;
          cpu::embedding_forward<float, W>(tokens, e, static_cast<const W*>(wpe.ptr), out, n, t, c);
        });
      },
      "embedding_forward");
}

void embedding_backward(Stream& s, const std::int32_t* tokens, const float* dout, float* dwte,
                        float* dwpe, i64 n, i64 t, i64 c) {
  STRATA_GPU_OP(embedding_backward, tokens, dout, dwte, dwpe, n, t, c)
  s.host_fn([=] { cpu::embedding_backward<float>(tokens, dout, dwte, dwpe, n, t, c); },
            "embedding_backward");
}

void rmsnorm_forward(Stream& s, const float* x, Weight w, Out out, float* rstd, i64 n, i64 c,
                     double eps) {
  require_w(w, "rmsnorm_forward");
  require_out(out, "rmsnorm_forward");
  if (on_cuda(s))
    return cuda_out(s, out, n * c, [&](float* dst) {
      STRATA_GPU_OP(rmsnorm_forward, x, w.ptr, w.dtype == DType::kBF16, dst, rstd, n, c, eps)
    });
  s.host_fn(
      [=] {
        with_w(w, [&](auto* wp) {
          with_out(out, [&](auto* op) { cpu::rmsnorm_forward(x, wp, op, rstd, n, c, eps); });
        });
      },
      "rmsnorm_forward");
}

void rmsnorm_backward(Stream& s, const float* dout, const float* x, Weight w, const float* rstd,
                      float* dx, float* dw, i64 n, i64 c, void* dx_bf16) {
  require_w(w, "rmsnorm_backward");
  if (on_cuda(s)) {
    [&] {
      STRATA_GPU_OP(rmsnorm_backward, dout, x, w.ptr, w.dtype == DType::kBF16, rstd, dx, dw, n, c)
    }();
    if (dx_bf16) cast_to_bf16(s, dx, dx_bf16, n * c);
    return;
  }
  auto* db = static_cast<cpu::bf16_t*>(dx_bf16);
  s.host_fn(
      [=] {
        with_w(w, [&](auto* wp) { cpu::rmsnorm_backward(dout, x, wp, rstd, dx, dw, n, c, db); });
      },
      "rmsnorm_backward");
}

void layernorm_forward(Stream& s, const float* x, Weight w, Weight b, Out out, float* mean,
                       float* rstd, i64 n, i64 c, double eps) {
  require_w(w, "layernorm_forward");
  require_out(out, "layernorm_forward");
  STRATA_REQUIRE(w.dtype == b.dtype, "layernorm_forward: weight and bias dtypes differ");
  if (on_cuda(s))
    return cuda_out(s, out, n * c, [&](float* dst) {
      STRATA_GPU_OP(layernorm_forward, x, w.ptr, b.ptr, w.dtype == DType::kBF16, dst, mean, rstd, n,
                    c, eps)
    });
  s.host_fn(
      [=] {
        with_w(w, [&](auto* wp) {
          using W = std::remove_pointer_t<decltype(wp)>;
          with_out(out, [&](auto* op) {
            cpu::layernorm_forward(x, wp, static_cast<W*>(b.ptr), op, mean, rstd, n, c, eps);
          });
        });
      },
      "layernorm_forward");
}

void layernorm_backward(Stream& s, const float* dout, const float* x, Weight w, const float* mean,
                        const float* rstd, float* dx, float* dw, float* db, i64 n, i64 c) {
  require_w(w, "layernorm_backward");
  STRATA_GPU_OP(layernorm_backward, dout, x, w.ptr, w.dtype == DType::kBF16, mean, rstd, dx, dw, db,
                n, c)
  s.host_fn(
      [=] {
        with_w(w, [&](auto* wp) {
          cpu::layernorm_backward(dout, x, wp, mean, rstd, dx, dw, db, n, c);
        });
      },
      "layernorm_backward");
}

void rope(Stream& s, float* x, i64 n, i64 t, i64 stride, i64 col, i64 heads, i64 hd,
          const float* cos, const float* sin, bool inverse) {
  STRATA_GPU_OP(rope, x, n, t, stride, col, heads, hd, cos, sin, inverse)
  s.host_fn([=] { cpu::rope_apply<float>(x, n, t, stride, col, heads, hd, cos, sin, inverse); },
            "rope");
}

void attention_forward(Stream& s, const float* qkv, float* o, void* o_bf16, float* lse, i64 b,
                       i64 t, i64 nh, i64 nkv, i64 hd, double scale, DType gemm) {
  STRATA_REQUIRE(hd <= 512 && nh % nkv == 0,
                 "attention: head_dim {} must be <= 512, heads {} a multiple of {}", hd, nh, nkv);
  const bool bf16 = gemm == DType::kBF16;
  if (on_cuda(s)) {
    [&] { STRATA_GPU_OP(attention_forward, qkv, o, lse, b, t, nh, nkv, hd, scale, bf16) }();
    if (o_bf16) cast_to_bf16(s, o, o_bf16, b * t * nh * hd);
    return;
  }
  auto* ob = static_cast<cpu::bf16_t*>(o_bf16);
  s.host_fn([=] { cpu::attention_forward_fast(qkv, o, ob, lse, b, t, nh, nkv, hd, scale, bf16); },
            "attention_forward");
}

void attention_backward(Stream& s, const float* qkv, const float* o, const float* dout,
                        const float* lse, float* dqkv, i64 b, i64 t, i64 nh, i64 nkv, i64 hd,
                        double scale, DType gemm) {
  const bool bf16 = gemm == DType::kBF16;
  STRATA_GPU_OP(attention_backward, qkv, o, dout, lse, dqkv, b, t, nh, nkv, hd, scale, bf16)
  s.host_fn(
      [=] {
        cpu::attention_backward_fast(qkv, o, dout, lse, dqkv, b, t, nh, nkv, hd, scale, bf16);
      },
      "attention_backward");
}

void swiglu_forward(Stream& s, const float* gu, Out out, i64 n, i64 inter) {
  require_out(out, "swiglu_forward");
  if (on_cuda(s))
    return cuda_out(s, out, n * inter,
                    [&](float* dst) { STRATA_GPU_OP(swiglu_forward, gu, dst, n, inter) });
  s.host_fn([=] { with_out(out, [&](auto* op) { cpu::swiglu_forward<float>(gu, op, n, inter); }); },
            "swiglu_forward");
}

void swiglu_backward(Stream& s, const float* dout, const float* gu, Out dgu, i64 n, i64 inter) {
  require_out(dgu, "swiglu_backward");
  if (on_cuda(s))
    return cuda_out(s, dgu, n * 2 * inter,
                    [&](float* dst) { STRATA_GPU_OP(swiglu_backward, dout, gu, dst, n, inter) });
  s.host_fn(
      [=] {
        with_out(dgu, [&](auto* op) { cpu::swiglu_backward<float>(dout, gu, op, n, inter); });
      },
      "swiglu_backward");
}

void gelu_forward(Stream& s, const float* x, Out out, i64 n) {
  require_out(out, "gelu_forward");
  if (on_cuda(s))
    return cuda_out(s, out, n, [&](float* dst) { STRATA_GPU_OP(gelu_forward, x, dst, n) });
  s.host_fn([=] { with_out(out, [&](auto* op) { cpu::gelu_forward<float>(x, op, n); }); },
            "gelu_forward");
}

void gelu_backward(Stream& s, const float* dout, const float* x, float* dx, i64 n) {
  STRATA_GPU_OP(gelu_backward, dout, x, dx, n)
  s.host_fn([=] { cpu::gelu_backward<float>(dout, x, dx, n); }, "gelu_backward");
}

void bias_add(Stream& s, float* y, Weight b, i64 n, i64 m) {
  require_w(b, "bias_add");
  STRATA_GPU_OP(bias_add, y, b.ptr, b.dtype == DType::kBF16, n, m)
  s.host_fn([=] { with_w(b, [&](auto* bp) { cpu::bias_add(y, bp, n, m); }); }, "bias_add");
}

void bias_backward(Stream& s, const float* dy, float* db, i64 n, i64 m) {
  STRATA_GPU_OP(bias_backward, dy, db, n, m)
  s.host_fn([=] { cpu::bias_backward<float>(dy, db, n, m); }, "bias_backward");
}

void cross_entropy(Stream& s, float* logits, const std::int32_t* targets, float* losses, i64 rows,
                   i64 vocab, double grad_scale, Out grad) {
  require_out(grad, "cross_entropy");
  const bool to_logits = grad.ptr == logits;
  STRATA_REQUIRE(to_logits || grad.dtype == DType::kBF16 || grad_scale == 0,
                 "cross_entropy: an fp32 gradient is written over the logits");
  if (on_cuda(s)) {  // the CUDA kernel writes the gradient over the logits
    [&] { STRATA_GPU_OP(cross_entropy, logits, targets, losses, rows, vocab, grad_scale) }();
    if (!to_logits && grad_scale != 0) cast_to_bf16(s, logits, grad.ptr, rows * vocab);
    return;
  }
  auto* gb = to_logits ? nullptr : static_cast<cpu::bf16_t*>(grad.ptr);
  s.host_fn(
      [=] {
        cpu::cross_entropy<float, cpu::bf16_t>(logits, targets, losses, rows, vocab, grad_scale,
                                               gb);
      },
      "cross_entropy");
}

}  // namespace strata::model_ops
