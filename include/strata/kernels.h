// Kernels a benchmark times directly. A training program never needs this header: the engine
// and the model run these kernels themselves (strata/engine.h, strata/model.h). It exists so that
// strata-prof and strata-bench measure the very code a training step runs, and it holds only
// what they call; the other CPU kernels and model ops stay internal to the library.
#pragma once

#include <cstddef>
#include <cstdint>

#include "strata/device.h"
#include "strata/dtype.h"
#include "strata/model_ops.h"

namespace strata::cpu {

// The host's gradient-norm pass (gradient clipping over host-resident gradients, and the CPU
// kernel of Stream::sum_squares on the emulated device): the sum of squares of `n` values of
// dtype `t` at `x`, accumulated in double, returned as fp32. strata-prof times it as the
// machine's host_norm_bps.
float sum_squares(DType t, const void* x, std::size_t n);

}  // namespace strata::cpu

// The model's kernels as the model calls them: each op is checked, then queued on a Stream
// through its device's kernels (Device::model_kernels(), strata/model_ops.h). Pointers are device
// memory of the stream's device; activations and gradients are fp32, weights (Weight) fp32 or
// bf16. Here, the ops strata-bench gpu compares between the CUDA kernels' variants.
namespace strata::model_ops {

void embedding_backward(Stream& s, const std::int32_t* tokens, const float* dout, float* dwte,
                        float* dwpe, i64 n, i64 t, i64 c);
// dx_bf16 (optional): the updated dx again, rounded to bf16 (the next GEMMs' operand).
void rmsnorm_backward(Stream& s, const float* dout, const float* x, Weight w, const float* rstd,
                      float* dx, float* dw, i64 n, i64 c, void* dx_bf16 = nullptr);
void layernorm_backward(Stream& s, const float* dout, const float* x, Weight w, const float* mean,
                        const float* rstd, float* dx, float* dw, float* db, i64 n, i64 c);
// gemm: the compute dtype; with bf16 the inputs of attention's products are rounded to bf16 as
// for every other GEMM, on the CPU and in both CUDA variants.
// o_bf16 (optional): o also written rounded to bf16, the output projection's operand.
void attention_forward(Stream& s, const float* qkv, float* o, void* o_bf16, float* lse, i64 b,
                       i64 t, i64 nh, i64 nkv, i64 hd, double scale, DType gemm);
void attention_backward(Stream& s, const float* qkv, const float* o, const float* dout,
                        const float* lse, float* dqkv, i64 b, i64 t, i64 nh, i64 nkv, i64 hd,
                        double scale, DType gemm);
void bias_backward(Stream& s, const float* dy, float* db, i64 n, i64 m);

}  // namespace strata::model_ops
