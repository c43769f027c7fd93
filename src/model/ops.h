// The model's kernel dispatch: each op is queued on a Stream and runs the CPU kernel
// (src/cpu/model_kernels.h, on the HostDevice stream's worker through host_fn) or the CUDA
// kernel (src/gpu/model_kernels.h, on the stream's cudaStream_t), picked by the device kind.
// Semantics are those of the CPU kernels; pointers are device memory of the stream's device.
// Activations and gradients are fp32; weights (Weight) are fp32 or bf16. The ops a benchmark
// drives directly (attention, the backward reductions) and Weight are declared in the public
// strata/kernels.h; the rest here.
#pragma once

#include <cstdint>

#include "strata/device.h"
#include "strata/kernels.h"

namespace strata::model_ops {

// Where an op writes an activation read only as a GEMM operand: fp32, or bf16 in bf16 compute
// (the CPU kernels round as they store, saving the cast pass; on CUDA, ops.cpp casts an fp32
// result).
struct Out {
  void* ptr = nullptr;
  DType dtype = DType::kF32;
  Out(float* p) : ptr(p) {}  // NOLINT: an fp32 output converts implicitly
  Out(void* p, DType t) : ptr(p), dtype(t) {}
};

void embedding_forward(Stream& s, const std::int32_t* tokens, Weight wte, Weight wpe, float* out,
                       i64 n, i64 t, i64 c);
void rmsnorm_forward(Stream& s, const float* x, Weight w, Out out, float* rstd, i64 n, i64 c,
                     double eps);
void layernorm_forward(Stream& s, const float* x, Weight w, Weight b, Out out, float* mean,
                       float* rstd, i64 n, i64 c, double eps);
void rope(Stream& s, float* x, i64 n, i64 t, i64 stride, i64 col, i64 heads, i64 hd,
          const float* cos, const float* sin, bool inverse);
void swiglu_forward(Stream& s, const float* gu, Out out, i64 n, i64 inter);
void swiglu_backward(Stream& s, const float* dout, const float* gu, Out dgu, i64 n, i64 inter);
void gelu_forward(Stream& s, const float* x, Out out, i64 n);
void gelu_backward(Stream& s, const float* dout, const float* x, float* dx, i64 n);
void bias_add(Stream& s, float* y, Weight b, i64 n, i64 m);
// With grad_scale != 0 the logits' gradient goes to grad: the logits themselves (fp32) or a
// bf16 buffer (the head GEMMs' operand in bf16 compute).
void cross_entropy(Stream& s, float* logits, const std::int32_t* targets, float* losses, i64 rows,
                   i64 vocab, double grad_scale, Out grad);

}  // namespace strata::model_ops
