// strata's own CUDA kernels: element-wise fill / axpy / scale / add / cast and the
// deterministic sum of squares. Matmul is cuBLAS (cuda_device.cpp).
//
// Invariants:
//  - Results match the CPU kernels (src/cpu/cpu_kernels.cpp) bit for bit on finite inputs:
//    inputs are widened to fp32 exactly, each arithmetic step is one IEEE fp32 operation
//    with no FMA contraction (__fmul_rn / __fadd_rn, because the CPU rounds a*x and then
//    the sum), and results are rounded to bf16 / fp16 to nearest even. NaNs keep their
//    payload as strata/dtype.h does (the CUDA intrinsics would canonicalise them).
//  - No kernel uses atomics or depends on the grid size chosen for the GPU model, so every
//    run on every GPU gives the same bits.
//  - Launchers never throw; they return cudaGetLastError() for the caller to check.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <cub/block/block_reduce.cuh>
#include <cuda/atomic>

#include "gpu/cuda_kernels.h"

namespace strata::gpu {
namespace {

constexpr unsigned kThreads = 256;
// Grid-stride loops cover larger arrays; more blocks than this only adds scheduling.
constexpr std::size_t kMaxBlocks = 65536;

unsigned blocks_for(std::size_t n) {
  return static_cast<unsigned>(std::min<std::size_t>((n + kThreads - 1) / kThreads, kMaxBlocks));
}

// ---- loads (exact widening to fp32) ----
__device__ __forceinline__ float to_f32(float v) { return v; }
__device__ __forceinline__ float to_f32(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_f32(__half v) {
  const std::uint16_t h = __half_as_ushort(v);
  if ((h & 0x7c00u) == 0x7c00u && (h & 0x3ffu) != 0) {  // NaN: keep the payload
    return __uint_as_float((std::uint32_t(h & 0x8000u) << 16) | 0x7f800000u |
                           (std::uint32_t(h & 0x3ffu) << 13));
  }
  return __half2float(v);
}

// ---- stores (round to nearest even) ----
template <class T>
__device__ __forceinline__ T from_f32(float v);

template <>
__device__ __forceinline__ float from_f32<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float v) {
  if (isnan(v)) {  // quiet NaN with the top payload bits, as f32_to_bf16
    return __ushort_as_bfloat16(static_cast<unsigned short>((__float_as_uint(v) >> 16) | 0x40u));
  }
  return __float2bfloat16_rn(v);
}
template <>
__device__ __forceinline__ __half from_f32<__half>(float v) {
  if (isnan(v)) {  // quiet NaN with the top payload bits, as f32_to_f16
    const std::uint32_t u = __float_as_uint(v);
    return __ushort_as_half(
        static_cast<unsigned short>(((u >> 16) & 0x8000u) | 0x7e00u | ((u >> 13) & 0x3ffu)));
  }
  return __float2half_rn(v);
}

// ---- dtype dispatch ----
template <class T>
struct Tag {
  using type = T;
};

template <class F>
cudaError_t with_type(DType t, F&& f) {
  switch (t) {
    case DType::kF32:
      return f(Tag<float>{});
    case DType::kBF16:
      return f(Tag<__nv_bfloat16>{});
    case DType::kF16:
      return f(Tag<__half>{});
    case DType::kF64:
      break;
  }
  return cudaErrorInvalidValue;
}

__device__ __forceinline__ std::size_t first_index() {
  return std::size_t(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ std::size_t grid_stride() { return std::size_t(gridDim.x) * blockDim.x; }

// ---- element-wise kernels ----
template <class T>
__global__ void fill_kernel(T* x, std::size_t n, float value) {
  const T v = from_f32<T>(value);
  for (std::size_t i = first_index(); i < n; i += grid_stride()) x[i] = v;
}

// No __restrict__ here or in add_kernel: outputs may alias inputs (axpy(a, y, y) is valid).
template <class X, class Y>
__global__ void axpy_kernel(float alpha, const X* x, Y* y, std::size_t n) {
  for (std::size_t i = first_index(); i < n; i += grid_stride())
    y[i] = from_f32<Y>(__fadd_rn(to_f32(y[i]), __fmul_rn(alpha, to_f32(x[i]))));
}

template <class T>
__global__ void scale_kernel(float alpha, T* x, std::size_t n) {
  for (std::size_t i = first_index(); i < n; i += grid_stride())
    x[i] = from_f32<T>(__fmul_rn(to_f32(x[i]), alpha));
}

template <class A, class B, class O>
__global__ void add_kernel(const A* a, const B* b, O* out, std::size_t n) {
  for (std::size_t i = first_index(); i < n; i += grid_stride())
    out[i] = from_f32<O>(__fadd_rn(to_f32(a[i]), to_f32(b[i])));
}

template <class S, class D>
__global__ void cast_kernel(const S* src, D* dst, std::size_t n) {
  for (std::size_t i = first_index(); i < n; i += grid_stride())
    dst[i] = from_f32<D>(to_f32(src[i]));
}

// ---- sum of squares ----
using BlockSum = cub::BlockReduce<double, kThreads>;

template <class T>
__global__ void __launch_bounds__(kThreads)
    sum_squares_pass1(const T* __restrict__ x, std::size_t n, double* __restrict__ partials) {
  __shared__ typename BlockSum::TempStorage tmp;
  double acc = 0;
  for (std::size_t i = first_index(); i < n; i += grid_stride()) {
    const double v = to_f32(x[i]);
    acc = __dadd_rn(acc, __dmul_rn(v, v));
  }
  const double block_sum = BlockSum(tmp).Sum(acc);
  if (threadIdx.x == 0) partials[blockIdx.x] = block_sum;
}

__global__ void __launch_bounds__(kThreads)
    sum_squares_pass2(const double* __restrict__ partials, unsigned count, float* out) {
  __shared__ typename BlockSum::TempStorage tmp;
  double acc = 0;
  for (unsigned i = threadIdx.x; i < count; i += kThreads) acc = __dadd_rn(acc, partials[i]);
  const double total = BlockSum(tmp).Sum(acc);
  if (threadIdx.x == 0) *out = static_cast<float>(total);
}

// ---- waiting for the host ----
__global__ void wait_host_flag_kernel(unsigned long long* flag, unsigned long long target) {
  cuda::atomic_ref<unsigned long long, cuda::thread_scope_system> f(*flag);
  while (f.load(cuda::memory_order_acquire) < target) __nanosleep(2000);
}

template <class K>
cudaError_t load_kernel(K* kernel) {
  cudaFuncAttributes attr;
  return cudaFuncGetAttributes(&attr, kernel);
}

}  // namespace

cudaError_t launch_fill(void* x, DType xt, std::size_t n, float value, cudaStream_t stream) {
  return with_type(xt, [&](auto t) {
    using T = typename decltype(t)::type;
    fill_kernel<T><<<blocks_for(n), kThreads, 0, stream>>>(static_cast<T*>(x), n, value);
    return cudaGetLastError();
  });
}

cudaError_t launch_axpy(float alpha, const void* x, DType xt, void* y, DType yt, std::size_t n,
                        cudaStream_t stream) {
  return with_type(xt, [&](auto tx) {
    return with_type(yt, [&](auto ty) {
      using X = typename decltype(tx)::type;
      using Y = typename decltype(ty)::type;
      axpy_kernel<X, Y><<<blocks_for(n), kThreads, 0, stream>>>(alpha, static_cast<const X*>(x),
                                                                static_cast<Y*>(y), n);
      return cudaGetLastError();
    });
  });
}

cudaError_t launch_scale(float alpha, void* x, DType xt, std::size_t n, cudaStream_t stream) {
  return with_type(xt, [&](auto t) {
    using T = typename decltype(t)::type;
    scale_kernel<T><<<blocks_for(n), kThreads, 0, stream>>>(alpha, static_cast<T*>(x), n);
    return cudaGetLastError();
  });
}

cudaError_t launch_add(const void* a, DType at, const void* b, DType bt, void* out, DType ot,
                       std::size_t n, cudaStream_t stream) {
  return with_type(at, [&](auto ta) {
    return with_type(bt, [&](auto tb) {
      return with_type(ot, [&](auto to) {
        using A = typename decltype(ta)::type;
        using B = typename decltype(tb)::type;
        using O = typename decltype(to)::type;
        add_kernel<A, B, O><<<blocks_for(n), kThreads, 0, stream>>>(
            static_cast<const A*>(a), static_cast<const B*>(b), static_cast<O*>(out), n);
        return cudaGetLastError();
      });
    });
  });
}

cudaError_t launch_cast(const void* src, DType st, void* dst, DType dt, std::size_t n,
                        cudaStream_t stream) {
  return with_type(st, [&](auto ts) {
    return with_type(dt, [&](auto td) {
      using S = typename decltype(ts)::type;
      using D = typename decltype(td)::type;
      cast_kernel<S, D><<<blocks_for(n), kThreads, 0, stream>>>(static_cast<const S*>(src),
                                                                static_cast<D*>(dst), n);
      return cudaGetLastError();
    });
  });
}

cudaError_t launch_sum_squares(const void* x, DType xt, std::size_t n, float* out, void* scratch,
                               cudaStream_t stream) {
  const unsigned blocks = static_cast<unsigned>(
      std::min<std::size_t>((n + kThreads - 1) / kThreads, kSumSquaresBlocks));
  auto* partials = static_cast<double*>(scratch);
  return with_type(xt, [&](auto t) {
    using T = typename decltype(t)::type;
    sum_squares_pass1<T><<<blocks, kThreads, 0, stream>>>(static_cast<const T*>(x), n, partials);
    if (const cudaError_t err = cudaGetLastError(); err != cudaSuccess) return err;
    sum_squares_pass2<<<1, kThreads, 0, stream>>>(partials, blocks, out);
    return cudaGetLastError();
  });
}

cudaError_t launch_wait_host_flag(unsigned long long* flag, unsigned long long target,
                                  cudaStream_t stream) {
  wait_host_flag_kernel<<<1, 1, 0, stream>>>(flag, target);
  return cudaGetLastError();
}

cudaError_t preload_kernels() {
  cudaError_t first = cudaSuccess;
  auto keep = [&](cudaError_t err) {
    if (first == cudaSuccess) first = err;
    return cudaSuccess;
  };
  const DType types[] = {DType::kF32, DType::kBF16, DType::kF16};
  for (DType a : types) {
    keep(with_type(a, [&](auto ta) {
      using A = typename decltype(ta)::type;
      keep(load_kernel(fill_kernel<A>));
      keep(load_kernel(scale_kernel<A>));
      keep(load_kernel(sum_squares_pass1<A>));
      for (DType b : types) {
        keep(with_type(b, [&](auto tb) {
          using B = typename decltype(tb)::type;
          keep(load_kernel(axpy_kernel<A, B>));
          keep(load_kernel(cast_kernel<A, B>));
          for (DType o : types) {
            keep(with_type(o, [&](auto to) {
              using O = typename decltype(to)::type;
              return keep(load_kernel(add_kernel<A, B, O>));
            }));
          }
          return cudaSuccess;
        }));
      }
      return cudaSuccess;
    }));
  }
  keep(load_kernel(sum_squares_pass2));
  keep(load_kernel(wait_host_flag_kernel));
  return first;
}

}  // namespace strata::gpu
