// CPU kernels of the transformer (src/model runs them on a HostDevice stream's worker).
//
// Every kernel takes raw pointers into (emulated) device memory, already validated by the
// caller (src/model/ops.cpp). Activations and gradients are T (float in the model, double in
// the finite-difference tests); weights are W (float, bf16_t or double) and are read as T.
// The float instantiations of the hot kernels run the vectorised row kernels of
// src/cpu/model_simd.h when the CPU has AVX-512 or AVX2 (picked at run time); the portable
// loops here are their fallback and, in double, the reference the tests check them against.
// Reductions over rows that feed a weight gradient run in a fixed order, so results are
// deterministic for any thread count; that is what makes activation checkpointing on and off give
// identical gradients.
//
// Layout conventions (row-major, N = B*T rows, position t = row % T):
//  - qkv rows are [q (nh*hd) | k (nkv*hd) | v (nkv*hd)]: one fused projection.
//  - gu rows (SwiGLU) are [gate (I) | up (I)].
//  - Weight-gradient outputs (dw, db, dwte) are accumulated (+=); dx outputs are written,
//    except the norms' dx, which is accumulated so a residual gradient can be updated in place.
//  - Outputs typed O (the norms', the activations' and SwiGLU's dgu) are T or bf16_t: a bf16
//    output is a GEMM operand of bf16 compute, rounded (to nearest even) as it is stored.
#pragma once

#include <cstddef>
#include <cstdint>

#include "strata/dtype.h"
#include "strata/model_ops.h"

namespace strata::cpu {

// A bf16 value as stored; read with to_t().
struct bf16_t {
  std::uint16_t bits;
};
inline float to_float(bf16_t v) { return bf16_to_f32(v.bits); }
inline float to_float(float v) { return v; }
inline double to_float(double v) { return v; }

using i64 = std::int64_t;

// out[n,:] = wte[tokens[n],:] (+ wpe[n % T,:] when wpe is non-null); a negative token id (another
// tensor-parallel rank's row) gives a zero row, and no gradient in embedding_backward.
template <class T, class W>
void embedding_forward(const std::int32_t* tokens, const W* wte, const W* wpe, T* out, i64 n, i64 t,
                       i64 c);
// dwte[tokens[n],:] += dout[n,:]; dwpe[n % T,:] += dout[n,:] (when dwpe is non-null).
template <class T>
void embedding_backward(const std::int32_t* tokens, const T* dout, T* dwte, T* dwpe, i64 n, i64 t,
                        i64 c);

// Hugging Face LlamaRMSNorm: out = x / sqrt(mean(x^2) + eps) * w; rstd[n] saved for backward.
template <class T, class W, class O = T>
void rmsnorm_forward(const T* x, const W* w, O* out, T* rstd, i64 n, i64 c, double eps);
// dx += ..., dw += ...; with dx_bf16 (T = float), the updated dx also rounded to bf16 there.
template <class T, class W>
void rmsnorm_backward(const T* dout, const T* x, const W* w, const T* rstd, T* dx, T* dw, i64 n,
                      i64 c, bf16_t* dx_bf16 = nullptr);

// torch.nn.LayerNorm (biased variance): out = (x - mean) * rstd * w + b.
template <class T, class W, class O = T>
void layernorm_forward(const T* x, const W* w, const W* b, O* out, T* mean, T* rstd, i64 n, i64 c,
                       double eps);
// dx += ..., dw += ..., db += ...
template <class T, class W>
void layernorm_backward(const T* dout, const T* x, const W* w, const T* mean, const T* rstd, T* dx,
                        T* dw, T* db, i64 n, i64 c);

// Rotary embedding as Hugging Face's Llama applies it (rotate_half: pairs i and i + hd/2), in
// place on `heads` heads of head_dim hd starting at column `col` of rows of `stride` elements.
// cos/sin are [T, hd/2]. inverse = true applies the transpose rotation (the backward).
template <class T>
void rope_apply(T* x, i64 n, i64 t, i64 stride, i64 col, i64 heads, i64 hd, const T* cos,
                const T* sin, bool inverse);

// Causal grouped-query attention with an online softmax (flash-style): o [N, nh*hd] and the
// logsumexp of each query row's scores, lse [B, nh, T]; nothing of size T^2 is stored.
template <class T>
void attention_forward(const T* qkv, T* o, T* lse, i64 b, i64 t, i64 nh, i64 nkv, i64 hd,
                       double scale);
// Writes dqkv (every element) from do, recomputing the probabilities from lse.
template <class T>
void attention_backward(const T* qkv, const T* o, const T* dout, const T* lse, T* dqkv, i64 b,
                        i64 t, i64 nh, i64 nkv, i64 hd, double scale);
// The same two in fp32 through oneDNN batched matmuls over query blocks (model_attention.cpp),
// what the model runs; the templates above are the portable reference the tests hold them to.
// With bf16_gemm the matmul inputs (q, k, v, do and the probabilities and their gradients) are
// rounded to bf16, as every GEMM input is in the model's bf16 compute; accumulation, softmax,
// lse and the outputs stay fp32.
// o_bf16 (optional): o again, rounded to bf16 (the output projection's operand).
void attention_forward_fast(const float* qkv, float* o, bf16_t* o_bf16, float* lse, i64 b, i64 t,
                            i64 nh, i64 nkv, i64 hd, double scale, bool bf16_gemm);
void attention_backward_fast(const float* qkv, const float* o, const float* dout, const float* lse,
                             float* dqkv, i64 b, i64 t, i64 nh, i64 nkv, i64 hd, double scale,
                             bool bf16_gemm);
// Decoding with a key/value cache (model_ops::Backend::attention_cached): the n new rows' k and v
// copied into k_cache / v_cache rows [p0, p0 + n), then query row i over cache rows [0, p0 + i],
// one task per (row, head): an exact softmax over the row (max, then the sum), P normalised, and
// with bf16_gemm q, k, v and P rounded to bf16 as attention_forward_fast rounds them.
void attention_cached(const float* qkv, float* k_cache, float* v_cache, float* o, bf16_t* o_bf16,
                      i64 n, i64 p0, i64 nh, i64 nkv, i64 hd, double scale, bool bf16_gemm);
// For tests: the next `count` products the attention runs fail as a oneDNN primitive that
// cannot run does (a strata::Error naming the product comes out of the call).
void fail_attention_gemms_for_testing(int count);

// out[n,i] = silu(gate[n,i]) * up[n,i]; dgu written.
template <class T, class O = T>
void swiglu_forward(const T* gu, O* out, i64 n, i64 inter);
template <class T, class O = T>
void swiglu_backward(const T* dout, const T* gu, O* dgu, i64 n, i64 inter);

// GPT-2's tanh-approximated GELU; dx written.
template <class T, class O = T>
void gelu_forward(const T* x, O* out, i64 n);
template <class T>
void gelu_backward(const T* dout, const T* x, T* dx, i64 n);

// y[n,:] += b; db += column sums of dy.
template <class T, class W>
void bias_add(T* y, const W* b, i64 n, i64 m);
template <class T>
void bias_backward(const T* dy, T* db, i64 n, i64 m);

// One chunk of rows of the fused LM-head cross-entropy. logits [rows, V] in; losses[r] =
// logsumexp(logits[r]) - logits[r, targets[r]]. With grad_scale != 0, d(loss)/d(logits) *
// grad_scale = (softmax - onehot) * grad_scale is written to grad (O = T or bf16_t), or over
// logits when grad is null. A row whose target is model_ops::kIgnoreTarget: loss 0, gradient 0.
template <class T, class O = T>
void cross_entropy(T* logits, const std::int32_t* targets, T* losses, i64 rows, i64 vocab,
                   double grad_scale, O* grad = nullptr);

// The vocabulary-parallel cross-entropy's halves (model_ops::Backend::cross_entropy_stats and
// _finish): logits [rows, vocab] one tensor-parallel rank's columns, targets local column
// indices, -1 (another rank's) or kIgnoreTarget; stats [rows, 2], all [parts, rows, 2].
template <class T>
void cross_entropy_stats(const T* logits, const std::int32_t* targets, T* stats, i64 rows,
                         i64 vocab);
template <class T, class O = T>
void cross_entropy_finish(T* logits, const std::int32_t* targets, const T* all, i64 parts,
                          T* losses, i64 rows, i64 vocab, double grad_scale, O* grad = nullptr);

// HostDevice::model_kernels(): the kernels above, each queued with host_fn on the stream it is
// called for (model_ops_host.cpp).
const model_ops::Backend& host_model_ops();

}  // namespace strata::cpu
