// The model's kernels as a device backend provides them (Device::model_kernels()): the
// transformer's ops (embedding, norms, rotary embedding, attention, activations, bias, cross
// entropy) queued on a Stream of that device. The model calls them through the device it runs on
// and never names a backend: HostDevice queues the CPU kernels as host functions on the stream's
// worker, CudaDevice launches the CUDA kernels on the stream's cudaStream_t. A backend of one's
// own implements Backend to run the model; one without (model_kernels() returns nullptr) runs the
// engine but not the model.
//
// Semantics are those of the CPU kernels (src/cpu/model_kernels.h). Pointers are device memory of
// the stream's device; activations and gradients are fp32, weights (Weight) fp32 or bf16, and an
// Out fp32 or bf16 (the model checks both before it calls). Every op is asynchronous, in the
// stream's order, like the Stream's own kernels.
#pragma once

#include <cstdint>

#include "strata/dtype.h"

namespace strata {
class Stream;
}

namespace strata::model_ops {

using i64 = std::int64_t;

// A target row that adds no loss and a zero gradient (strata::kIgnoreTarget, Hugging Face's
// ignore_index); cross_entropy's other targets must be in [0, vocab).
inline constexpr std::int32_t kIgnoreTarget = -100;

struct Weight {
  const void* ptr = nullptr;
  DType dtype = DType::kF32;
  explicit operator bool() const { return ptr != nullptr; }
};

// Where an op writes an activation read only as a GEMM operand: fp32, or bf16 in bf16 compute
// (the CPU kernels round as they store, saving the cast pass; the CUDA backend casts an fp32
// result).
struct Out {
  void* ptr = nullptr;
  DType dtype = DType::kF32;
  Out(float* p) : ptr(p) {}  // NOLINT: an fp32 output converts implicitly
  Out(void* p, DType t) : ptr(p), dtype(t) {}
};

// One backend's kernels. Shapes: n rows (tokens) of c channels; t the sequence length, b the
// batch; nh / nkv the query / key-value heads of hd channels; inter the MLP's inner width.
class Backend {
 public:
  virtual ~Backend() = default;

  // A negative token id (a row another tensor-parallel rank holds): a zero row (plus its
  // position's wpe row) in the forward, no embedding gradient in the backward.
  virtual void embedding_forward(Stream& s, const std::int32_t* tokens, Weight wte, Weight wpe,
                                 float* out, i64 n, i64 t, i64 c) const = 0;
  virtual void embedding_backward(Stream& s, const std::int32_t* tokens, const float* dout,
                                  float* dwte, float* dwpe, i64 n, i64 t, i64 c) const = 0;
  virtual void rmsnorm_forward(Stream& s, const float* x, Weight w, Out out, float* rstd, i64 n,
                               i64 c, double eps) const = 0;
  // dx_bf16 (nullable): the updated dx again, rounded to bf16.
  virtual void rmsnorm_backward(Stream& s, const float* dout, const float* x, Weight w,
                                const float* rstd, float* dx, float* dw, i64 n, i64 c,
                                void* dx_bf16) const = 0;
  virtual void layernorm_forward(Stream& s, const float* x, Weight w, Weight b, Out out,
                                 float* mean, float* rstd, i64 n, i64 c, double eps) const = 0;
  virtual void layernorm_backward(Stream& s, const float* dout, const float* x, Weight w,
                                  const float* mean, const float* rstd, float* dx, float* dw,
                                  float* db, i64 n, i64 c) const = 0;
  virtual void rope(Stream& s, float* x, i64 n, i64 t, i64 stride, i64 col, i64 heads, i64 hd,
                    const float* cos, const float* sin, bool inverse) const = 0;
  // bf16: the products' inputs rounded to bf16, as every other GEMM's in bf16 compute.
  // o_bf16 (nullable): o again, rounded to bf16.
  virtual void attention_forward(Stream& s, const float* qkv, float* o, void* o_bf16, float* lse,
                                 i64 b, i64 t, i64 nh, i64 nkv, i64 hd, double scale,
                                 bool bf16) const = 0;
  virtual void attention_backward(Stream& s, const float* qkv, const float* o, const float* dout,
                                  const float* lse, float* dqkv, i64 b, i64 t, i64 nh, i64 nkv,
                                  i64 hd, double scale, bool bf16) const = 0;
  // Inference with a key/value cache, one sequence: qkv holds n new rows at positions
  // [p0, p0 + n) ([n, (nh + 2 nkv) hd], rotary applied); their k and v parts are first copied into
  // rows [p0, p0 + n) of k_cache and v_cache ([max positions, nkv hd] each), then query row i
  // attends causally to cache rows [0, p0 + i], as attention_forward's row p0 + i would over the
  // whole sequence (bf16: the same operands rounded). o [n, nh hd]; o_bf16 as attention_forward's.
  // A backend without it runs training but not cached decoding: the default throws kUnsupported.
  virtual void attention_cached(Stream& s, const float* qkv, float* k_cache, float* v_cache,
                                float* o, void* o_bf16, i64 n, i64 p0, i64 nh, i64 nkv, i64 hd,
                                double scale, bool bf16) const;
  virtual void swiglu_forward(Stream& s, const float* gu, Out out, i64 n, i64 inter) const = 0;
  virtual void swiglu_backward(Stream& s, const float* dout, const float* gu, Out dgu, i64 n,
                               i64 inter) const = 0;
  virtual void gelu_forward(Stream& s, const float* x, Out out, i64 n) const = 0;
  virtual void gelu_backward(Stream& s, const float* dout, const float* x, float* dx,
                             i64 n) const = 0;
  virtual void bias_add(Stream& s, float* y, Weight b, i64 n, i64 m) const = 0;
  virtual void bias_backward(Stream& s, const float* dy, float* db, i64 n, i64 m) const = 0;
  // grad_scale != 0: the logits' gradient (times grad_scale) into grad, which is the logits
  // themselves (fp32) or a bf16 buffer; with a bf16 grad the logits are not to be read after (the
  // CPU's are left as they were, the CUDA backend's hold the fp32 gradient). A row whose target
  // is kIgnoreTarget gets loss 0 and a zero gradient row.
  virtual void cross_entropy(Stream& s, float* logits, const std::int32_t* targets, float* losses,
                             i64 rows, i64 vocab, double grad_scale, Out grad) const = 0;
  // The cross-entropy over a vocabulary split across tensor-parallel ranks, in two halves with a
  // gather of `stats` between them. logits [rows, vocab] are this rank's columns; a target is
  // this rank's column index, -1 when another rank holds it, or kIgnoreTarget.
  //  - cross_entropy_stats: stats [rows, 2] = (log-sum-exp of the row's columns here, the target's
  //    logit when this rank holds it, else 0).
  //  - cross_entropy_finish: all [parts, rows, 2] every rank's stats in rank order; the row's loss
  //    = log-sum-exp over the parts' log-sum-exps - the sum of their target logits, and with
  //    grad_scale != 0 these columns' gradient (softmax - onehot) * grad_scale into grad (the
  //    logits or a bf16 buffer), as cross_entropy (the logits not to be read after with a bf16
  //    grad). kIgnoreTarget: loss 0, a zero gradient row.
  // A backend without them runs the model without tensor parallelism: the defaults throw
  // kUnsupported.
  virtual void cross_entropy_stats(Stream& s, const float* logits, const std::int32_t* targets,
                                   float* stats, i64 rows, i64 vocab) const;
  virtual void cross_entropy_finish(Stream& s, float* logits, const std::int32_t* targets,
                                    const float* all, i64 parts, float* losses, i64 rows, i64 vocab,
                                    double grad_scale, Out grad) const;
};

}  // namespace strata::model_ops
