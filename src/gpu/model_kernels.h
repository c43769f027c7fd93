// Launchers for the transformer's CUDA kernels (model_kernels.cu); the CUDA twin of
// src/cpu/model_kernels.h with the same semantics, layouts and accumulate rules, checked
// against it by tests/model_gpu_test.cpp.
//
// The launchers live in the CUDA module (libstrata_cuda.so, see cuda_module.h); code outside it
// calls them through the table kernels() returns.
//
// This header carries no CUDA types so src/model can include it without the CUDA headers:
// `stream` is the cudaStream_t (Stream::native_handle()), and each launcher returns the
// cudaError_t of its launch as an int (0 = success; error_text() names it). Weights are fp32
// (wbf16 = false) or bf16; everything else is fp32. Weight-gradient reductions over rows use
// a fixed partition and order, so results are deterministic run to run.
//
// Two variants of some kernels sit behind the same launchers (model_kernels.cu says which and
// how they differ): kSimple, the reference and the default, and kTiled, opt-in. The variant is
// module-wide state, read at each launch; STRATA_GPU_KERNELS=simple|tiled sets it when the
// table is first asked for (kernels(), cuda_loader.cpp: make_cuda_device asks, before the first
// device exists), and set_kernel_variant changes it.
#pragma once

#include <cstdint>

#include "strata/gpu_bench.h"
#include "strata/model_ops.h"

namespace strata::gpu::model {

using i64 = std::int64_t;

// kSimple or kTiled (strata/gpu_bench.h, where strata-bench gpu switches it).
using ::strata::gpu::KernelVariant;

const char* error_text(int err);

// The variant the launchers run from now on (for every device of the process), and the
// current one. Safe to switch at any time; a launcher that runs several kernels (attention
// backward) reads it once, so its kernels always agree.
void set_kernel_variant(KernelVariant variant);
KernelVariant kernel_variant();

int embedding_forward(const std::int32_t* tokens, const void* wte, const void* wpe, bool wbf16,
                      float* out, i64 n, i64 t, i64 c, void* stream);
int embedding_backward(const std::int32_t* tokens, const float* dout, float* dwte, float* dwpe,
                       i64 n, i64 t, i64 c, void* stream);
int rmsnorm_forward(const float* x, const void* w, bool wbf16, float* out, float* rstd, i64 n,
                    i64 c, double eps, void* stream);
int rmsnorm_backward(const float* dout, const float* x, const void* w, bool wbf16,
                     const float* rstd, float* dx, float* dw, i64 n, i64 c, void* stream);
int layernorm_forward(const float* x, const void* w, const void* b, bool wbf16, float* out,
                      float* mean, float* rstd, i64 n, i64 c, double eps, void* stream);
int layernorm_backward(const float* dout, const float* x, const void* w, bool wbf16,
                       const float* mean, const float* rstd, float* dx, float* dw, float* db, i64 n,
                       i64 c, void* stream);
int rope(float* x, i64 n, i64 t, i64 stride, i64 col, i64 heads, i64 hd, const float* cos,
         const float* sin, bool inverse, void* stream);
// bf16: round the GEMM operands (q, k, v, dO, P, dS) as the CPU's bf16 attention does.
int attention_forward(const float* qkv, float* o, float* lse, i64 b, i64 t, i64 nh, i64 nkv, i64 hd,
                      double scale, bool bf16, void* stream);
int attention_backward(const float* qkv, const float* o, const float* dout, const float* lse,
                       float* dqkv, i64 b, i64 t, i64 nh, i64 nkv, i64 hd, double scale, bool bf16,
                       void* stream);
// Decoding with a key/value cache (model_ops::Backend::attention_cached); in the module only (the
// device's model_kernels() reaches it), not in the exported table.
int attention_cached(const float* qkv, float* k_cache, float* v_cache, float* o, i64 n, i64 p0,
                     i64 nh, i64 nkv, i64 hd, double scale, bool bf16, void* stream);
int swiglu_forward(const float* gu, float* out, i64 n, i64 inter, void* stream);
int swiglu_backward(const float* dout, const float* gu, float* dgu, i64 n, i64 inter, void* stream);
int gelu_forward(const float* x, float* out, i64 n, void* stream);
int gelu_backward(const float* dout, const float* x, float* dx, i64 n, void* stream);
int bias_add(float* y, const void* b, bool wbf16, i64 n, i64 m, void* stream);
int bias_backward(const float* dy, float* db, i64 n, i64 m, void* stream);
int cross_entropy(float* logits, const std::int32_t* targets, float* losses, i64 rows, i64 vocab,
                  double grad_scale, void* stream);
// The vocabulary-parallel cross-entropy (model_ops::Backend::cross_entropy_stats and _finish; in
// the module only, as attention_cached): the gradient over the logits.
int cross_entropy_stats(const float* logits, const std::int32_t* targets, float* stats, i64 rows,
                        i64 vocab, void* stream);
int cross_entropy_finish(float* logits, const std::int32_t* targets, const float* all, i64 parts,
                         float* losses, i64 rows, i64 vocab, double grad_scale, void* stream);

// Loads the kernels above into the current device's context now (as gpu::preload_kernels does
// the element-wise ones): with lazy module loading, a first launch from a host function while a
// stream spins in wait_host_flag could deadlock. Returns the first error, as an int.
int preload_kernels();

// CudaDevice::model_kernels(): the launchers above on the stream's cudaStream_t, in the module
// (model_ops_cuda.cpp).
const model_ops::Backend& cuda_model_ops();

// The launchers above as the CUDA module exports them (one pointer each, same names).
struct Kernels {
#define STRATA_MODEL_KERNEL(name) decltype(&::strata::gpu::model::name) name
  STRATA_MODEL_KERNEL(error_text);
  STRATA_MODEL_KERNEL(set_kernel_variant);
  STRATA_MODEL_KERNEL(kernel_variant);
  STRATA_MODEL_KERNEL(embedding_forward);
  STRATA_MODEL_KERNEL(embedding_backward);
  STRATA_MODEL_KERNEL(rmsnorm_forward);
  STRATA_MODEL_KERNEL(rmsnorm_backward);
  STRATA_MODEL_KERNEL(layernorm_forward);
  STRATA_MODEL_KERNEL(layernorm_backward);
  STRATA_MODEL_KERNEL(rope);
  STRATA_MODEL_KERNEL(attention_forward);
  STRATA_MODEL_KERNEL(attention_backward);
  STRATA_MODEL_KERNEL(swiglu_forward);
  STRATA_MODEL_KERNEL(swiglu_backward);
  STRATA_MODEL_KERNEL(gelu_forward);
  STRATA_MODEL_KERNEL(gelu_backward);
  STRATA_MODEL_KERNEL(bias_add);
  STRATA_MODEL_KERNEL(bias_backward);
  STRATA_MODEL_KERNEL(cross_entropy);
#undef STRATA_MODEL_KERNEL
};

// The loaded CUDA module's table (loading it if needed); throws kUnsupported with the reason
// when the CUDA backend is unavailable. make_cuda_device and the benchmarks call it (the model
// reaches the launchers through CudaDevice::model_kernels(), inside the module). Its first call
// applies STRATA_GPU_KERNELS (unset or
// empty: the module's default, kSimple); a value other than simple or tiled throws
// kInvalidArgument naming the variable, at that call and at every later one.
const Kernels& kernels();

}  // namespace strata::gpu::model
