// CudaDevice's model kernels (strata/model_ops.h): the launchers of model_kernels.cu on the
// stream's cudaStream_t. The CUDA kernels write fp32; a bf16 Out is written through an fp32
// scratch allocated on the stream, cast into it and freed in stream order.
#include "gpu/cuda_check.h"
#include "gpu/cuda_trace.h"
#include "gpu/model_kernels.h"
#include "strata/device.h"
#include "strata/error.h"
#include "strata/model_ops.h"

namespace strata::gpu::model {
namespace {

using model_ops::Out;
using model_ops::Weight;

void check(int err, const char* op) {
  if (err != 0)
    STRATA_THROW(kCuda, "model kernel {} failed to launch: {} (error {})", op, error_text(err),
                 err);
}

bool is_bf16(Weight w) { return w.dtype == DType::kBF16; }

// fp32 device memory x (numel) cast into bf16 y, on the stream.
void cast_to_bf16(Stream& s, const float* x, void* y, i64 numel) {
  const std::size_t n = std::size_t(numel);
  s.cast(TensorRef{MemRef{const_cast<float*>(x), n * 4, MemSpace::kDevice, &s.device()},
                   DType::kF32, n},
         TensorRef{MemRef{y, n * 2, MemSpace::kDevice, &s.device()}, DType::kBF16, n});
}

// launch(dst) writes numel fp32 values at dst: out itself, or (bf16 out) a scratch on the stream
// that is then cast into out.
template <class Launch>
void to_out(Stream& s, Out out, i64 numel, Launch launch) {
  if (out.dtype == DType::kF32) return launch(static_cast<float*>(out.ptr));
  Buffer tmp = s.device().alloc(std::size_t(numel) * 4, &s);
  launch(static_cast<float*>(tmp.data()));
  cast_to_bf16(s, static_cast<const float*>(tmp.data()), out.ptr, numel);
}

class CudaModelOps final : public model_ops::Backend {
 public:
  // One kernel launch on the stream's GPU (made current: a thread whose current device is another
  // failed the launch), checked; while traced, its GPU time is a span on the stream's lane (the
  // step's GPU time in a trace, and strata-bench gpu's busy share, count the model's kernels).
  template <class F>
  static void launch(Stream& s, const char* op, F f) {
    gpu::detail::use_device_of(h(s));
    const GpuSpan span(op, h(s));
    check(f(), op);
  }

  void embedding_forward(Stream& s, const std::int32_t* tokens, Weight wte, Weight wpe, float* out,
                         i64 n, i64 t, i64 c) const override {
    launch(s, "embedding_forward", [&] {
      return model::embedding_forward(tokens, wte.ptr, wpe.ptr, is_bf16(wte), out, n, t, c, h(s));
    });
  }

  void embedding_backward(Stream& s, const std::int32_t* tokens, const float* dout, float* dwte,
                          float* dwpe, i64 n, i64 t, i64 c) const override {
    launch(s, "embedding_backward",
           [&] { return model::embedding_backward(tokens, dout, dwte, dwpe, n, t, c, h(s)); });
  }

  void rmsnorm_forward(Stream& s, const float* x, Weight w, Out out, float* rstd, i64 n, i64 c,
                       double eps) const override {
    to_out(s, out, n * c, [&](float* dst) {
      launch(s, "rmsnorm_forward", [&] {
        return model::rmsnorm_forward(x, w.ptr, is_bf16(w), dst, rstd, n, c, eps, h(s));
      });
    });
  }

  void rmsnorm_backward(Stream& s, const float* dout, const float* x, Weight w, const float* rstd,
                        float* dx, float* dw, i64 n, i64 c, void* dx_bf16) const override {
    launch(s, "rmsnorm_backward", [&] {
      return model::rmsnorm_backward(dout, x, w.ptr, is_bf16(w), rstd, dx, dw, n, c, h(s));
    });
    if (dx_bf16) cast_to_bf16(s, dx, dx_bf16, n * c);
  }

  void layernorm_forward(Stream& s, const float* x, Weight w, Weight b, Out out, float* mean,
                         float* rstd, i64 n, i64 c, double eps) const override {
    to_out(s, out, n * c, [&](float* dst) {
      launch(s, "layernorm_forward", [&] {
        return model::layernorm_forward(x, w.ptr, b.ptr, is_bf16(w), dst, mean, rstd, n, c, eps,
                                        h(s));
      });
    });
  }

  void layernorm_backward(Stream& s, const float* dout, const float* x, Weight w, const float* mean,
                          const float* rstd, float* dx, float* dw, float* db, i64 n,
                          i64 c) const override {
    launch(s, "layernorm_backward", [&] {
      return model::layernorm_backward(dout, x, w.ptr, is_bf16(w), mean, rstd, dx, dw, db, n, c,
                                       h(s));
    });
  }

  void rope(Stream& s, float* x, i64 n, i64 t, i64 stride, i64 col, i64 heads, i64 hd,
            const float* cos, const float* sin, bool inverse) const override {
    launch(s, "rope",
           [&] { return model::rope(x, n, t, stride, col, heads, hd, cos, sin, inverse, h(s)); });
  }

  void attention_forward(Stream& s, const float* qkv, float* o, void* o_bf16, float* lse, i64 b,
                         i64 t, i64 nh, i64 nkv, i64 hd, double scale, bool bf16) const override {
    launch(s, "attention_forward", [&] {
      return model::attention_forward(qkv, o, lse, b, t, nh, nkv, hd, scale, bf16, h(s));
    });
    if (o_bf16) cast_to_bf16(s, o, o_bf16, b * t * nh * hd);
  }

  void attention_cached(Stream& s, const float* qkv, float* k_cache, float* v_cache, float* o,
                        void* o_bf16, i64 n, i64 p0, i64 nh, i64 nkv, i64 hd, double scale,
                        bool bf16) const override {
    launch(s, "attention_cached", [&] {
      return model::attention_cached(qkv, k_cache, v_cache, o, n, p0, nh, nkv, hd, scale, bf16,
                                     h(s));
    });
    if (o_bf16) cast_to_bf16(s, o, o_bf16, n * nh * hd);
  }

  void attention_backward(Stream& s, const float* qkv, const float* o, const float* dout,
                          const float* lse, float* dqkv, i64 b, i64 t, i64 nh, i64 nkv, i64 hd,
                          double scale, bool bf16) const override {
    launch(s, "attention_backward", [&] {
      return model::attention_backward(qkv, o, dout, lse, dqkv, b, t, nh, nkv, hd, scale, bf16,
                                       h(s));
    });
  }

  void swiglu_forward(Stream& s, const float* gu, Out out, i64 n, i64 inter) const override {
    to_out(s, out, n * inter, [&](float* dst) {
      launch(s, "swiglu_forward", [&] { return model::swiglu_forward(gu, dst, n, inter, h(s)); });
    });
  }

  void swiglu_backward(Stream& s, const float* dout, const float* gu, Out dgu, i64 n,
                       i64 inter) const override {
    to_out(s, dgu, n * 2 * inter, [&](float* dst) {
      launch(s, "swiglu_backward",
             [&] { return model::swiglu_backward(dout, gu, dst, n, inter, h(s)); });
    });
  }

  void gelu_forward(Stream& s, const float* x, Out out, i64 n) const override {
    to_out(s, out, n, [&](float* dst) {
      launch(s, "gelu_forward", [&] { return model::gelu_forward(x, dst, n, h(s)); });
    });
  }

  void gelu_backward(Stream& s, const float* dout, const float* x, float* dx,
                     i64 n) const override {
    launch(s, "gelu_backward", [&] { return model::gelu_backward(dout, x, dx, n, h(s)); });
  }

  void bias_add(Stream& s, float* y, Weight b, i64 n, i64 m) const override {
    launch(s, "bias_add", [&] { return model::bias_add(y, b.ptr, is_bf16(b), n, m, h(s)); });
  }

  void bias_backward(Stream& s, const float* dy, float* db, i64 n, i64 m) const override {
    launch(s, "bias_backward", [&] { return model::bias_backward(dy, db, n, m, h(s)); });
  }

  void cross_entropy(Stream& s, float* logits, const std::int32_t* targets, float* losses, i64 rows,
                     i64 vocab, double grad_scale, Out grad) const override {
    // The kernel writes the gradient over the logits; a bf16 gradient is cast from there.
    launch(s, "cross_entropy", [&] {
      return model::cross_entropy(logits, targets, losses, rows, vocab, grad_scale, h(s));
    });
    if (grad.ptr != logits && grad_scale != 0) cast_to_bf16(s, logits, grad.ptr, rows * vocab);
  }

  void cross_entropy_stats(Stream& s, const float* logits, const std::int32_t* targets,
                           float* stats, i64 rows, i64 vocab) const override {
    launch(s, "cross_entropy_stats",
           [&] { return model::cross_entropy_stats(logits, targets, stats, rows, vocab, h(s)); });
  }

  void cross_entropy_finish(Stream& s, float* logits, const std::int32_t* targets, const float* all,
                            i64 parts, float* losses, i64 rows, i64 vocab, double grad_scale,
                            Out grad) const override {
    launch(s, "cross_entropy_finish", [&] {
      return model::cross_entropy_finish(logits, targets, all, parts, losses, rows, vocab,
                                         grad_scale, h(s));
    });
    if (grad.ptr != logits && grad_scale != 0) cast_to_bf16(s, logits, grad.ptr, rows * vocab);
  }

 private:
  static void* h(Stream& s) { return s.native_handle(); }
};

}  // namespace

const model_ops::Backend& cuda_model_ops() {
  static const CudaModelOps ops;
  return ops;
}

}  // namespace strata::gpu::model
