// The model's ops: each is checked, then queued on a Stream through its device's kernels
// (Device::model_kernels(), strata/model_ops.h: the CPU kernels on HostDevice, the CUDA kernels on
// CudaDevice). Semantics are those of the CPU kernels; pointers are device memory of the stream's
// device. Activations and gradients are fp32; weights (Weight) are fp32 or bf16. The ops a
// benchmark drives directly (attention, the backward reductions) are declared in the public
// strata/kernels.h; the rest here.
#pragma once

#include <cstdint>

#include "strata/device.h"
#include "strata/kernels.h"
#include "strata/model_ops.h"

namespace strata::model_ops {

void embedding_forward(Stream& s, const std::int32_t* tokens, Weight wte, Weight wpe, float* out,
                       i64 n, i64 t, i64 c);
void rmsnorm_forward(Stream& s, const float* x, Weight w, Out out, float* rstd, i64 n, i64 c,
                     double eps);
void layernorm_forward(Stream& s, const float* x, Weight w, Weight b, Out out, float* mean,
                       float* rstd, i64 n, i64 c, double eps);
void rope(Stream& s, float* x, i64 n, i64 t, i64 stride, i64 col, i64 heads, i64 hd,
          const float* cos, const float* sin, bool inverse);
// Backend::attention_cached: checked (head_dim <= 512, heads a multiple of the kv heads).
void attention_cached(Stream& s, const float* qkv, float* k_cache, float* v_cache, float* o,
                      void* o_bf16, i64 n, i64 p0, i64 nh, i64 nkv, i64 hd, double scale,
                      DType gemm);
void swiglu_forward(Stream& s, const float* gu, Out out, i64 n, i64 inter);
void swiglu_backward(Stream& s, const float* dout, const float* gu, Out dgu, i64 n, i64 inter);
void gelu_forward(Stream& s, const float* x, Out out, i64 n);
void gelu_backward(Stream& s, const float* dout, const float* x, float* dx, i64 n);
void bias_add(Stream& s, float* y, Weight b, i64 n, i64 m);
// With grad_scale != 0 the logits' gradient goes to grad: the logits themselves (fp32) or a
// bf16 buffer (the head GEMMs' operand in bf16 compute).
void cross_entropy(Stream& s, float* logits, const std::int32_t* targets, float* losses, i64 rows,
                   i64 vocab, double grad_scale, Out grad);
// The vocabulary-parallel cross-entropy's halves (Backend::cross_entropy_stats / _finish).
void cross_entropy_stats(Stream& s, const float* logits, const std::int32_t* targets, float* stats,
                         i64 rows, i64 vocab);
void cross_entropy_finish(Stream& s, float* logits, const std::int32_t* targets, const float* all,
                          i64 parts, float* losses, i64 rows, i64 vocab, double grad_scale,
                          Out grad);

}  // namespace strata::model_ops
