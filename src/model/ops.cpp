// The model's ops: each checks its arguments, then hands the op to the kernels of the stream's
// device (Device::model_kernels(), strata/model_ops.h). No backend is named here: HostDevice
// queues the CPU kernels on the stream's worker, CudaDevice launches the CUDA kernels.
#include "model/ops.h"

#include "strata/error.h"

namespace strata::model_ops {
namespace {

const Backend& kernels(Stream& s) {
  const Backend* k = s.device().model_kernels();
  if (k == nullptr)
    STRATA_THROW(kUnsupported,
                 "device {} has no model kernels (Device::model_kernels() is null): the model "
                 "runs on a device whose backend provides them, the emulated device (--device "
                 "cpu) or CUDA",
                 s.device().name());
  return *k;
}

void require_w(Weight w, const char* what) {
  STRATA_REQUIRE(w.dtype == DType::kF32 || w.dtype == DType::kBF16,
                 "model op {}: weights must be fp32 or bf16, got {}", what, dtype_name(w.dtype));
}

void require_out(Out out, const char* what) {
  STRATA_REQUIRE(out.dtype == DType::kF32 || out.dtype == DType::kBF16,
                 "model op {}: outputs must be fp32 or bf16, got {}", what, dtype_name(out.dtype));
}

}  // namespace

void embedding_forward(Stream& s, const std::int32_t* tokens, Weight wte, Weight wpe, float* out,
                       i64 n, i64 t, i64 c) {
  require_w(wte, "embedding_forward");
  kernels(s).embedding_forward(s, tokens, wte, wpe, out, n, t, c);
}

void embedding_backward(Stream& s, const std::int32_t* tokens, const float* dout, float* dwte,
                        float* dwpe, i64 n, i64 t, i64 c) {
  kernels(s).embedding_backward(s, tokens, dout, dwte, dwpe, n, t, c);
}

void rmsnorm_forward(Stream& s, const float* x, Weight w, Out out, float* rstd, i64 n, i64 c,
                     double eps) {
  require_w(w, "rmsnorm_forward");
  require_out(out, "rmsnorm_forward");
  kernels(s).rmsnorm_forward(s, x, w, out, rstd, n, c, eps);
}

void rmsnorm_backward(Stream& s, const float* dout, const float* x, Weight w, const float* rstd,
                      float* dx, float* dw, i64 n, i64 c, void* dx_bf16) {
  require_w(w, "rmsnorm_backward");
  kernels(s).rmsnorm_backward(s, dout, x, w, rstd, dx, dw, n, c, dx_bf16);
}

void layernorm_forward(Stream& s, const float* x, Weight w, Weight b, Out out, float* mean,
                       float* rstd, i64 n, i64 c, double eps) {
  require_w(w, "layernorm_forward");
  require_out(out, "layernorm_forward");
  STRATA_REQUIRE(w.dtype == b.dtype, "layernorm_forward: weight and bias dtypes differ");
  kernels(s).layernorm_forward(s, x, w, b, out, mean, rstd, n, c, eps);
}

void layernorm_backward(Stream& s, const float* dout, const float* x, Weight w, const float* mean,
                        const float* rstd, float* dx, float* dw, float* db, i64 n, i64 c) {
  require_w(w, "layernorm_backward");
  kernels(s).layernorm_backward(s, dout, x, w, mean, rstd, dx, dw, db, n, c);
}

void rope(Stream& s, float* x, i64 n, i64 t, i64 stride, i64 col, i64 heads, i64 hd,
          const float* cos, const float* sin, bool inverse) {
  kernels(s).rope(s, x, n, t, stride, col, heads, hd, cos, sin, inverse);
}

void attention_forward(Stream& s, const float* qkv, float* o, void* o_bf16, float* lse, i64 b,
                       i64 t, i64 nh, i64 nkv, i64 hd, double scale, DType gemm) {
  STRATA_REQUIRE(hd <= 512 && nh % nkv == 0,
                 "attention: head_dim {} must be <= 512, heads {} a multiple of {}", hd, nh, nkv);
  kernels(s).attention_forward(s, qkv, o, o_bf16, lse, b, t, nh, nkv, hd, scale,
                               gemm == DType::kBF16);
}

void attention_cached(Stream& s, const float* qkv, float* k_cache, float* v_cache, float* o,
                      void* o_bf16, i64 n, i64 p0, i64 nh, i64 nkv, i64 hd, double scale,
                      DType gemm) {
  STRATA_REQUIRE(hd <= 512 && nh % nkv == 0 && n > 0 && p0 >= 0,
                 "attention_cached: head_dim {} must be <= 512, heads {} a multiple of {}, rows {} "
                 "> 0 at position {} >= 0",
                 hd, nh, nkv, n, p0);
  kernels(s).attention_cached(s, qkv, k_cache, v_cache, o, o_bf16, n, p0, nh, nkv, hd, scale,
                              gemm == DType::kBF16);
}

void attention_backward(Stream& s, const float* qkv, const float* o, const float* dout,
                        const float* lse, float* dqkv, i64 b, i64 t, i64 nh, i64 nkv, i64 hd,
                        double scale, DType gemm) {
  STRATA_REQUIRE(hd <= 512 && nkv > 0 && nh % nkv == 0,
                 "attention_backward: head_dim {} must be <= 512, heads {} a multiple of {}", hd,
                 nh, nkv);
  kernels(s).attention_backward(s, qkv, o, dout, lse, dqkv, b, t, nh, nkv, hd, scale,
                                gemm == DType::kBF16);
}

void swiglu_forward(Stream& s, const float* gu, Out out, i64 n, i64 inter) {
  require_out(out, "swiglu_forward");
  kernels(s).swiglu_forward(s, gu, out, n, inter);
}

void swiglu_backward(Stream& s, const float* dout, const float* gu, Out dgu, i64 n, i64 inter) {
  require_out(dgu, "swiglu_backward");
  kernels(s).swiglu_backward(s, dout, gu, dgu, n, inter);
}

void gelu_forward(Stream& s, const float* x, Out out, i64 n) {
  require_out(out, "gelu_forward");
  kernels(s).gelu_forward(s, x, out, n);
}

void gelu_backward(Stream& s, const float* dout, const float* x, float* dx, i64 n) {
  kernels(s).gelu_backward(s, dout, x, dx, n);
}

void bias_add(Stream& s, float* y, Weight b, i64 n, i64 m) {
  require_w(b, "bias_add");
  kernels(s).bias_add(s, y, b, n, m);
}

void bias_backward(Stream& s, const float* dy, float* db, i64 n, i64 m) {
  kernels(s).bias_backward(s, dy, db, n, m);
}

void cross_entropy(Stream& s, float* logits, const std::int32_t* targets, float* losses, i64 rows,
                   i64 vocab, double grad_scale, Out grad) {
  require_out(grad, "cross_entropy");
  STRATA_REQUIRE(grad.ptr == logits || grad.dtype == DType::kBF16 || grad_scale == 0,
                 "cross_entropy: an fp32 gradient is written over the logits");
  kernels(s).cross_entropy(s, logits, targets, losses, rows, vocab, grad_scale, grad);
}

void cross_entropy_stats(Stream& s, const float* logits, const std::int32_t* targets, float* stats,
                         i64 rows, i64 vocab) {
  STRATA_REQUIRE(rows > 0 && vocab > 0, "cross_entropy_stats: {} rows of {} columns", rows, vocab);
  kernels(s).cross_entropy_stats(s, logits, targets, stats, rows, vocab);
}

void cross_entropy_finish(Stream& s, float* logits, const std::int32_t* targets, const float* all,
                          i64 parts, float* losses, i64 rows, i64 vocab, double grad_scale,
                          Out grad) {
  require_out(grad, "cross_entropy_finish");
  STRATA_REQUIRE(grad.ptr == logits || grad.dtype == DType::kBF16 || grad_scale == 0,
                 "cross_entropy_finish: an fp32 gradient is written over the logits");
  STRATA_REQUIRE(parts > 0 && rows > 0 && vocab > 0,
                 "cross_entropy_finish: {} parts of {} rows of {} columns", parts, rows, vocab);
  kernels(s).cross_entropy_finish(s, logits, targets, all, parts, losses, rows, vocab, grad_scale,
                                  grad);
}

}  // namespace strata::model_ops
