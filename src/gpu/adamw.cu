// The fused multi-tensor AdamW on CUDA: for the placement where optimizer state fits in HBM.
//
// One launch covers up to kAdamWShardsPerLaunch shards: their table is a kernel argument,
// each block owns a kChunk-element chunk of one shard (a block finds its shard by scanning
// the table's block offsets), and each thread walks its chunk with a stride of the block size.
// Invariants:
//  - The element step is the CPU AdamW's, operation for operation, in IEEE fp32 with explicit
//    rounding intrinsics (__fmul_rn, __fmaf_rn, __fsqrt_rn, __fdiv_rn: no contraction, no
//    fast-math), and the fp32 scalars come from detail::adamw_scalars: the bits equal the CPU's.
//  - Element i of params_src, m_src, v_src is loaded by the thread that then stores element i
//    of params, m, v: a source may be its own destination (in-place) or apart from it.
//  - bf16 / fp16 stores round to nearest even and keep NaN payloads as strata/dtype.h does.
//  - Non-finite gradients are counted into a device counter (atomics, only where found); the
//    skip-step mode runs the count kernels first and the update kernel returns at once when
//    the counter is non-zero, so the host never waits.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "gpu/adamw.h"

namespace strata::gpu {
namespace {

constexpr unsigned kThreads = 256;
constexpr std::size_t kChunk = 8192;  // elements per block

struct Table {
  AdamWGpuShard s[kAdamWShardsPerLaunch];
  unsigned long long first_block[kAdamWShardsPerLaunch + 1];
  int count;
};

__device__ __forceinline__ float load_elem(const void* p, DType t, std::size_t i) {
  if (t == DType::kBF16)
    return __uint_as_float(std::uint32_t(static_cast<const std::uint16_t*>(p)[i]) << 16);
  return static_cast<const float*>(p)[i];
}

__device__ __forceinline__ std::uint16_t bf16_bits(float v) {
  const std::uint32_t u = __float_as_uint(v);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((u >> 16) | 0x40u);
  return __bfloat16_as_ushort(__float2bfloat16_rn(v));
}

__device__ __forceinline__ std::uint16_t f16_bits(float v) {
  const std::uint32_t u = __float_as_uint(v);
  if ((u & 0x7fffffffu) > 0x7f800000u)
    return static_cast<std::uint16_t>(((u >> 16) & 0x8000u) | 0x7e00u | ((u >> 13) & 0x3ffu));
  return __half_as_ushort(__float2half_rn(v));
}

__device__ __forceinline__ int find_shard(const Table& t, unsigned long long block) {
  int i = 0;
  while (i + 1 < t.count && t.first_block[i + 1] <= block) ++i;
  return i;
}

__global__ void adamw_count_kernel(const Table t, float grad_scale, unsigned long long* counter) {
  const int si = find_shard(t, blockIdx.x);
  const AdamWGpuShard& s = t.s[si];
  const std::size_t lo = (blockIdx.x - t.first_block[si]) * kChunk;
  const std::size_t hi = lo + kChunk < s.n ? lo + kChunk : s.n;
  unsigned long long bad = 0;
  for (std::size_t i = lo + threadIdx.x; i < hi; i += blockDim.x)
    bad += isfinite(__fmul_rn(load_elem(s.grads, s.grad_dtype, i), grad_scale)) ? 0 : 1;
  if (bad) atomicAdd(counter, bad);
}

__global__ void adamw_update_kernel(const Table t, const detail::AdamWScalars k,
                                    bool skip_if_counted, unsigned long long* counter) {
  if (skip_if_counted && *counter != 0) return;
  const int si = find_shard(t, blockIdx.x);
  const AdamWGpuShard& s = t.s[si];
  const std::size_t lo = (blockIdx.x - t.first_block[si]) * kChunk;
  const std::size_t hi = lo + kChunk < s.n ? lo + kChunk : s.n;
  const bool state_bf16 = s.state_dtype == DType::kBF16;
  unsigned long long bad = 0;
  for (std::size_t i = lo + threadIdx.x; i < hi; i += blockDim.x) {
    const float g = __fmul_rn(load_elem(s.grads, s.grad_dtype, i), k.grad_scale);
    bad += isfinite(g) ? 0 : 1;
    float m = load_elem(s.m_src, s.state_dtype, i);
    float v = load_elem(s.v_src, s.state_dtype, i);
    float p = __fmul_rn(s.params_src[i], s.decay);
    m = __fmaf_rn(k.beta1, m, __fmul_rn(k.one_minus_beta1, g));
    v = __fmaf_rn(k.beta2, v, __fmul_rn(k.one_minus_beta2, __fmul_rn(g, g)));
    const float d = __fmaf_rn(__fsqrt_rn(v), k.inv_sqrt_bc2, k.eps);
    p = __fmaf_rn(-k.step_size, __fdiv_rn(m, d), p);
    s.params[i] = p;
    if (state_bf16) {
      static_cast<std::uint16_t*>(s.m)[i] = bf16_bits(m);
      static_cast<std::uint16_t*>(s.v)[i] = bf16_bits(v);
    } else {
      static_cast<float*>(s.m)[i] = m;
      static_cast<float*>(s.v)[i] = v;
    }
    if (s.copy_out != nullptr)
      static_cast<std::uint16_t*>(s.copy_out)[i] =
          s.copy_dtype == DType::kBF16 ? bf16_bits(p) : f16_bits(p);
  }
  if (!skip_if_counted && bad) atomicAdd(counter, bad);
}

__global__ void adamw_report_kernel(const unsigned long long* counter, float* out) {
  *out = static_cast<float>(*counter);
}

cudaError_t make_table(const AdamWGpuShard* shards, int count, Table* t, unsigned* blocks) {
  if (count <= 0 || count > kAdamWShardsPerLaunch) return cudaErrorInvalidValue;
  unsigned long long total = 0;
  t->count = count;
  for (int i = 0; i < count; ++i) {
    t->s[i] = shards[i];
    t->first_block[i] = total;
    total += (shards[i].n + kChunk - 1) / kChunk;
  }
  t->first_block[count] = total;
  if (total == 0 || total > 0x7fffffffull) return cudaErrorInvalidValue;
  *blocks = static_cast<unsigned>(total);
  return cudaSuccess;
}

}  // namespace

cudaError_t launch_adamw_count(const AdamWGpuShard* shards, int count, float grad_scale,
                               unsigned long long* counter, cudaStream_t stream) {
  Table t;
  unsigned blocks = 0;
  if (const cudaError_t e = make_table(shards, count, &t, &blocks); e != cudaSuccess) return e;
  adamw_count_kernel<<<blocks, kThreads, 0, stream>>>(t, grad_scale, counter);
  return cudaGetLastError();
}

cudaError_t launch_adamw_update(const AdamWGpuShard* shards, int count,
                                const detail::AdamWScalars& k, bool skip_if_counted,
                                unsigned long long* counter, cudaStream_t stream) {
  Table t;
  unsigned blocks = 0;
  if (const cudaError_t e = make_table(shards, count, &t, &blocks); e != cudaSuccess) return e;
  adamw_update_kernel<<<blocks, kThreads, 0, stream>>>(t, k, skip_if_counted, counter);
  return cudaGetLastError();
}

cudaError_t launch_adamw_report(const unsigned long long* counter, float* out,
                                cudaStream_t stream) {
  adamw_report_kernel<<<1, 1, 0, stream>>>(counter, out);
  return cudaGetLastError();
}

cudaError_t preload_adamw_kernels() {
  cudaFuncAttributes attr;
  cudaError_t e = cudaFuncGetAttributes(&attr, adamw_count_kernel);
  if (e == cudaSuccess) e = cudaFuncGetAttributes(&attr, adamw_update_kernel);
  if (e == cudaSuccess) e = cudaFuncGetAttributes(&attr, adamw_report_kernel);
  return e;
}

}  // namespace strata::gpu
