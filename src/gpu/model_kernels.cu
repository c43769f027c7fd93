// CUDA kernels of the transformer: the twins of src/cpu/model_kernels.cpp (same layouts,
// same accumulate rules), in two variants behind the same launchers (KernelVariant,
// model_kernels.h).
//
// kSimple, the default and the reference the other variant is checked against (tests/
// model_gpu_test.cpp, strata-bench gpu's kernels part), written for correctness and
// determinism:
//  - row ops (norms, cross-entropy) use one block per row with a fixed-shape tree reduction;
//  - weight-gradient reductions over rows (norm weights, biases, embeddings) give each
//    column to one thread that walks the rows in order: no atomics, bit-reproducible;
//  - attention is one warp per query row (forward, dq) or per key row (dk, dv), the head
//    dimension spread over the lanes, online softmax in registers; nothing of size T^2. With
//    bf16 it rounds what the CPU's tiled attention rounds (cpu/model_attention.cpp): q, k, v and
//    dO as products read them, the probabilities P = softmax(S) (normalised: the forward takes a
//    second pass over the keys once it knows the row's max and sum) and dS; the sums, the
//    softmax itself, the logsumexp and the outputs stay fp32.
//
// kTiled, opt-in (STRATA_GPU_KERNELS=tiled when the table is first used, or
// set_kernel_variant); the same arithmetic, in another summation order where it sums:
//  - column reductions (rmsnorm dw, layernorm dw and db, bias backward): blocks of 32 columns x
//    16 row groups, so C/32 blocks instead of C/256 (128 at C = 4096, on 132 SMs); a lane is a
//    column (a warp reads 128 contiguous bytes of a row), row group g sums the rows r = g
//    (mod 16) in order, then one thread per column adds the 16 partials in order and adds that
//    to the gradient. A fixed partition and order and no atomics: bit-reproducible run to run,
//    though not bit-equal to kSimple (the order differs);
//  - embedding backward (a scatter by token id): the same blocks, but row group g owns the
//    vocabulary rows id = g (mod 16) of dwte and the positions p = g (mod 16) of dwpe, and walks
//    every row in order adding what it owns. Each element of dwte and dwpe gets the same
//    additions in the same order as in kSimple: bit-equal to it, with 16x the threads;
//  - attention in bf16 with head_dim a multiple of 16, at most 128: flash-style 64 x 64 tiles
//    on the tensor cores (see "Tiled attention" below). fp32 attention stays on the simple
//    kernels (tensor cores would need TF32 operands, which would change fp32 results), as do
//    other head dims.
// Row ops, RoPE and the element-wise kernels have one variant.
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <mma.h>

#include <atomic>
#include <type_traits>

#include "gpu/model_kernels.h"

namespace strata::gpu::model {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxHdPerLane = 16;  // head_dim <= 512

__device__ __forceinline__ float ld(const void* p, bool bf16, i64 i) {
  return bf16 ? __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i])
              : static_cast<const float*>(p)[i];
}

// x as a bf16 GEMM operand sees it: rounded to bf16 (to nearest even) when `on`.
__device__ __forceinline__ float rb(float x, bool on) {
  return on ? __bfloat162float(__float2bfloat16_rn(x)) : x;
}

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Sum over the block (blockDim.x == kThreads), the same on every thread.
__device__ float block_sum(float v) {
  __shared__ float part[kThreads / 32];
  __shared__ float total;
  v = warp_sum(v);
  if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = v;
  __syncthreads();
  if (threadIdx.x < 32) {
    float w = threadIdx.x < kThreads / 32 ? part[threadIdx.x] : 0.0f;
    w = warp_sum(w);
    if (threadIdx.x == 0) total = w;
  }
  __syncthreads();
  const float r = total;
  __syncthreads();
  return r;
}

__device__ float block_max(float v) {
  __shared__ float part[kThreads / 32];
  __shared__ float total;
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = v;
  __syncthreads();
  if (threadIdx.x < 32) {
    float w = threadIdx.x < kThreads / 32 ? part[threadIdx.x] : -INFINITY;
    for (int o = 16; o > 0; o >>= 1) w = fmaxf(w, __shfl_xor_sync(0xffffffffu, w, o));
    if (threadIdx.x == 0) total = w;
  }
  __syncthreads();
  const float r = total;
  __syncthreads();
  return r;
}

unsigned blocks_for(i64 n) { return static_cast<unsigned>((n + kThreads - 1) / kThreads); }
cudaStream_t cs(void* s) { return static_cast<cudaStream_t>(s); }
int launched() { return static_cast<int>(cudaGetLastError()); }

__global__ void k_embedding_forward(const std::int32_t* tok, const void* wte, const void* wpe,
                                    bool bf16, float* out, i64 n, i64 t, i64 c) {
  const i64 i = blockIdx.x * i64(blockDim.x) + threadIdx.x;
  if (i >= n * c) return;
  const i64 r = i / c, j = i % c;
  // A negative id: another tensor-parallel rank's vocabulary row, zero here.
  float v = tok[r] >= 0 ? ld(wte, bf16, i64(tok[r]) * c + j) : 0.0f;
  if (wpe) v += ld(wpe, bf16, (r % t) * c + j);
  out[i] = v;
}

__global__ void k_embedding_backward(const std::int32_t* tok, const float* dout, float* dwte,
                                     float* dwpe, i64 n, i64 t, i64 c) {
  const i64 j = blockIdx.x * i64(blockDim.x) + threadIdx.x;
  if (j >= c) return;
  for (i64 r = 0; r < n; ++r) {
    const float g = dout[r * c + j];
    if (tok[r] >= 0) dwte[i64(tok[r]) * c + j] += g;
    if (dwpe) dwpe[(r % t) * c + j] += g;
  }
}

__global__ void k_rmsnorm_forward(const float* x, const void* w, bool bf16, float* out, float* rstd,
                                  i64 c, float eps) {
  const float* xr = x + blockIdx.x * c;
  float ss = 0;
  for (i64 i = threadIdx.x; i < c; i += blockDim.x) ss += xr[i] * xr[i];
  const float rs = rsqrtf(block_sum(ss) / float(c) + eps);
  if (threadIdx.x == 0) rstd[blockIdx.x] = rs;
  for (i64 i = threadIdx.x; i < c; i += blockDim.x)
    out[blockIdx.x * c + i] = xr[i] * rs * ld(w, bf16, i);
}

__global__ void k_rmsnorm_backward_dx(const float* dout, const float* x, const void* w, bool bf16,
                                      const float* rstd, float* dx, i64 c) {
  const i64 r = blockIdx.x;
  const float rs = rstd[r];
  float m = 0;
  for (i64 i = threadIdx.x; i < c; i += blockDim.x)
    m += dout[r * c + i] * ld(w, bf16, i) * x[r * c + i] * rs;
  m = block_sum(m) / float(c);
  for (i64 i = threadIdx.x; i < c; i += blockDim.x)
    dx[r * c + i] += rs * (dout[r * c + i] * ld(w, bf16, i) - x[r * c + i] * rs * m);
}

__global__ void k_rmsnorm_backward_dw(const float* dout, const float* x, const float* rstd,
                                      float* dw, i64 n, i64 c) {
  const i64 j = blockIdx.x * i64(blockDim.x) + threadIdx.x;
  if (j >= c) return;
  float s = 0;
  for (i64 r = 0; r < n; ++r) s += dout[r * c + j] * x[r * c + j] * rstd[r];
  dw[j] += s;
}

__global__ void k_layernorm_forward(const float* x, const void* w, const void* b, bool bf16,
                                    float* out, float* mean, float* rstd, i64 c, float eps) {
  const float* xr = x + blockIdx.x * c;
  float s = 0;
  for (i64 i = threadIdx.x; i < c; i += blockDim.x) s += xr[i];
  const float mu = block_sum(s) / float(c);
  float v = 0;
  for (i64 i = threadIdx.x; i < c; i += blockDim.x) v += (xr[i] - mu) * (xr[i] - mu);
  const float rs = rsqrtf(block_sum(v) / float(c) + eps);
  if (threadIdx.x == 0) {
    mean[blockIdx.x] = mu;
    rstd[blockIdx.x] = rs;
  }
  for (i64 i = threadIdx.x; i < c; i += blockDim.x)
    out[blockIdx.x * c + i] = (xr[i] - mu) * rs * ld(w, bf16, i) + ld(b, bf16, i);
}

__global__ void k_layernorm_backward_dx(const float* dout, const float* x, const void* w, bool bf16,
                                        const float* mean, const float* rstd, float* dx, i64 c) {
  const i64 r = blockIdx.x;
  const float mu = mean[r], rs = rstd[r];
  float m1 = 0, m2 = 0;
  for (i64 i = threadIdx.x; i < c; i += blockDim.x) {
    const float d = dout[r * c + i] * ld(w, bf16, i);
    m1 += d;
    m2 += d * (x[r * c + i] - mu) * rs;
  }
  m1 = block_sum(m1) / float(c);
  m2 = block_sum(m2) / float(c);
  for (i64 i = threadIdx.x; i < c; i += blockDim.x)
    dx[r * c + i] += rs * (dout[r * c + i] * ld(w, bf16, i) - m1 - (x[r * c + i] - mu) * rs * m2);
}

__global__ void k_layernorm_backward_dwb(const float* dout, const float* x, const float* mean,
                                         const float* rstd, float* dw, float* db, i64 n, i64 c) {
  const i64 j = blockIdx.x * i64(blockDim.x) + threadIdx.x;
  if (j >= c) return;
  float sw = 0, sb = 0;
  for (i64 r = 0; r < n; ++r) {
    sw += dout[r * c + j] * (x[r * c + j] - mean[r]) * rstd[r];
    sb += dout[r * c + j];
  }
  dw[j] += sw;
  db[j] += sb;
}

__global__ void k_rope(float* x, i64 n, i64 t, i64 stride, i64 col, i64 heads, i64 hd,
                       const float* cosv, const float* sinv, bool inverse) {
  const i64 half = hd / 2;
  const i64 idx = blockIdx.x * i64(blockDim.x) + threadIdx.x;
  if (idx >= n * heads * half) return;
  const i64 i = idx % half, h = (idx / half) % heads, r = idx / (half * heads);
  float* v = x + r * stride + col + h * hd;
  const float c = cosv[(r % t) * half + i], s = (inverse ? -1.0f : 1.0f) * sinv[(r % t) * half + i];
  const float a = v[i], b = v[i + half];
  v[i] = a * c - b * s;
  v[i + half] = b * c + a * s;
}

// The warp's dot product of a query row (q: this lane's elements lane, lane + 32, ...) with the
// key row kp, the key's elements rounded as the products read them.
__device__ __forceinline__ float warp_dot(const float* q, const float* kp, i64 hd, int per,
                                          int lane, bool bf16) {
  float part = 0;
  for (int j = 0; j < per; ++j) {
    const i64 d = lane + 32 * j;
    if (d < hd) part += q[j] * rb(kp[d], bf16);
  }
  return warp_sum(part);
}

// One warp per query row (b, h, t).
__global__ void k_attention_forward(const float* qkv, float* o, float* lse, i64 b, i64 t, i64 nh,
                                    i64 nkv, i64 hd, float scale, bool bf16) {
  const i64 row = blockIdx.x * i64(blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x & 31;
  if (row >= b * nh * t) return;
  const i64 qi = row % t, h = (row / t) % nh, bi = row / (t * nh), kvh = h / (nh / nkv);
  const i64 stride = (nh + 2 * nkv) * hd;
  const int per = int((hd + 31) / 32);
  float q[kMaxHdPerLane], acc[kMaxHdPerLane];
  const float* qp = qkv + (bi * t + qi) * stride + h * hd;
  for (int j = 0; j < per; ++j) {
    const i64 d = lane + 32 * j;
    q[j] = d < hd ? rb(qp[d], bf16) : 0.0f;
    acc[j] = 0.0f;
  }
  auto score = [&](i64 s) {
    return warp_dot(q, qkv + (bi * t + s) * stride + (nh + kvh) * hd, hd, per, lane, bf16) * scale;
  };
  float m = -INFINITY, l = 0.0f;
  for (i64 s = 0; s <= qi; ++s) {
    const float* vp = qkv + (bi * t + s) * stride + (nh + nkv + kvh) * hd;
    const float sc = score(s);
    const float mn = fmaxf(m, sc);
    const float corr = __expf(m - mn), p = __expf(sc - mn);
    l = l * corr + p;
    if (!bf16)
      for (int j = 0; j < per; ++j) {
        const i64 d = lane + 32 * j;
        acc[j] = acc[j] * corr + (d < hd ? p * vp[d] : 0.0f);
      }
    m = mn;
  }
  if (bf16) {  // O = round(P) round(V), P normalised with the row's final max and sum
    for (i64 s = 0; s <= qi; ++s) {
      const float* vp = qkv + (bi * t + s) * stride + (nh + nkv + kvh) * hd;
      const float p = rb(__expf(score(s) - m) / l, true);
      for (int j = 0; j < per; ++j) {
        const i64 d = lane + 32 * j;
        if (d < hd) acc[j] += p * rb(vp[d], true);
      }
    }
  }
  float* op = o + (bi * t + qi) * nh * hd + h * hd;
  for (int j = 0; j < per; ++j) {
    const i64 d = lane + 32 * j;
    if (d < hd) op[d] = bf16 ? acc[j] : acc[j] / l;
  }
  if (lane == 0) lse[(bi * nh + h) * t + qi] = m + __logf(l);
}

// Decoding with a key/value cache: the new rows' k and v into the cache, then one warp per (new
// row, head) over cache rows [0, p0 + row], as k_attention_forward's row p0 + row (bf16: P
// normalised with the row's final max and sum, then rounded, as there).
__global__ void k_kv_append(const float* qkv, float* kc, float* vc, i64 n, i64 p0, i64 nh, i64 nkv,
                            i64 hd) {
  const i64 kvd = nkv * hd, stride = (nh + 2 * nkv) * hd;
  const i64 idx = blockIdx.x * i64(blockDim.x) + threadIdx.x;
  if (idx >= n * kvd) return;
  const i64 r = idx / kvd, c = idx % kvd;
  kc[(p0 + r) * kvd + c] = qkv[r * stride + nh * hd + c];
  vc[(p0 + r) * kvd + c] = qkv[r * stride + (nh + nkv) * hd + c];
}

__global__ void k_attention_cached(const float* qkv, const float* kc, const float* vc, float* o,
                                   i64 n, i64 p0, i64 nh, i64 nkv, i64 hd, float scale, bool bf16) {
  const i64 row = blockIdx.x * i64(blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x & 31;
  if (row >= n * nh) return;
  const i64 r = row / nh, h = row % nh, kvh = h / (nh / nkv), keys = p0 + r + 1;
  const i64 stride = (nh + 2 * nkv) * hd, kvd = nkv * hd;
  const int per = int((hd + 31) / 32);
  float q[kMaxHdPerLane], acc[kMaxHdPerLane];
  const float* qp = qkv + r * stride + h * hd;
  for (int j = 0; j < per; ++j) {
    const i64 d = lane + 32 * j;
    q[j] = d < hd ? rb(qp[d], bf16) : 0.0f;
    acc[j] = 0.0f;
  }
  auto score = [&](i64 s) {
    return warp_dot(q, kc + s * kvd + kvh * hd, hd, per, lane, bf16) * scale;
  };
  float m = -INFINITY, l = 0.0f;
  for (i64 s = 0; s < keys; ++s) {
    const float sc = score(s);
    const float mn = fmaxf(m, sc);
    l = l * __expf(m - mn) + __expf(sc - mn);
    m = mn;
  }
  for (i64 s = 0; s < keys; ++s) {
    const float* vp = vc + s * kvd + kvh * hd;
    const float p = rb(__expf(score(s) - m) / l, bf16);
    for (int j = 0; j < per; ++j) {
      const i64 d = lane + 32 * j;
      if (d < hd) acc[j] += p * rb(vp[d], bf16);
    }
  }
  float* op = o + r * nh * hd + h * hd;
  for (int j = 0; j < per; ++j) {
    const i64 d = lane + 32 * j;
    if (d < hd) op[d] = acc[j];
  }
}

// dq: one warp per query row.
__global__ void k_attention_backward_dq(const float* qkv, const float* o, const float* dout,
                                        const float* lse, float* dqkv, i64 b, i64 t, i64 nh,
                                        i64 nkv, i64 hd, float scale, bool bf16) {
  const i64 row = blockIdx.x * i64(blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x & 31;
  if (row >= b * nh * t) return;
  const i64 qi = row % t, h = (row / t) % nh, bi = row / (t * nh), kvh = h / (nh / nkv);
  const i64 stride = (nh + 2 * nkv) * hd;
  const int per = int((hd + 31) / 32);
  const float* qp = qkv + (bi * t + qi) * stride + h * hd;
  const float* gp = dout + (bi * t + qi) * nh * hd + h * hd;
  const float* op = o + (bi * t + qi) * nh * hd + h * hd;
  float q[kMaxHdPerLane], g[kMaxHdPerLane], dq[kMaxHdPerLane];
  float dpart = 0;
  for (int j = 0; j < per; ++j) {
    const i64 d = lane + 32 * j;
    q[j] = d < hd ? rb(qp[d], bf16) : 0.0f;
    g[j] = d < hd ? gp[d] : 0.0f;
    dpart += d < hd ? g[j] * op[d] : 0.0f;  // sum(dO o): fp32, as the CPU's
    g[j] = rb(g[j], bf16);
    dq[j] = 0.0f;
  }
  const float dsum = warp_sum(dpart);
  const float L = lse[(bi * nh + h) * t + qi];
  for (i64 s = 0; s <= qi; ++s) {
    const float* kp = qkv + (bi * t + s) * stride + (nh + kvh) * hd;
    const float* vp = qkv + (bi * t + s) * stride + (nh + nkv + kvh) * hd;
    float a = 0, c = 0;
    for (int j = 0; j < per; ++j) {
      const i64 d = lane + 32 * j;
      if (d < hd) {
        a += q[j] * rb(kp[d], bf16);
        c += g[j] * rb(vp[d], bf16);
      }
    }
    const float p = __expf(warp_sum(a) * scale - L);
    const float ds = rb(p * (warp_sum(c) - dsum) * scale, bf16);
    for (int j = 0; j < per; ++j) {
      const i64 d = lane + 32 * j;
      if (d < hd) dq[j] += ds * rb(kp[d], bf16);
    }
  }
  float* dqp = dqkv + (bi * t + qi) * stride + h * hd;
  for (int j = 0; j < per; ++j) {
    const i64 d = lane + 32 * j;
    if (d < hd) dqp[d] = dq[j];
  }
}

// dk, dv: one warp per key row (b, kv head, s), over the heads of its group and queries >= s.
__global__ void k_attention_backward_dkv(const float* qkv, const float* o, const float* dout,
                                         const float* lse, float* dqkv, i64 b, i64 t, i64 nh,
                                         i64 nkv, i64 hd, float scale, bool bf16) {
  const i64 row = blockIdx.x * i64(blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x & 31;
  if (row >= b * nkv * t) return;
  const i64 s = row % t, kvh = (row / t) % nkv, bi = row / (t * nkv);
  const i64 stride = (nh + 2 * nkv) * hd, group = nh / nkv;
  const int per = int((hd + 31) / 32);
  const float* kp = qkv + (bi * t + s) * stride + (nh + kvh) * hd;
  const float* vp = qkv + (bi * t + s) * stride + (nh + nkv + kvh) * hd;
  float k[kMaxHdPerLane], v[kMaxHdPerLane], dk[kMaxHdPerLane], dv[kMaxHdPerLane];
  for (int j = 0; j < per; ++j) {
    const i64 d = lane + 32 * j;
    k[j] = d < hd ? rb(kp[d], bf16) : 0.0f;
    v[j] = d < hd ? rb(vp[d], bf16) : 0.0f;
    dk[j] = dv[j] = 0.0f;
  }
  for (i64 h = kvh * group; h < (kvh + 1) * group; ++h) {
    for (i64 qi = s; qi < t; ++qi) {
      const float* qp = qkv + (bi * t + qi) * stride + h * hd;
      const float* gp = dout + (bi * t + qi) * nh * hd + h * hd;
      const float* op = o + (bi * t + qi) * nh * hd + h * hd;
      float a = 0, c = 0, e = 0;
      for (int j = 0; j < per; ++j) {
        const i64 d = lane + 32 * j;
        if (d < hd) {
          a += rb(qp[d], bf16) * k[j];
          c += rb(gp[d], bf16) * v[j];
          e += gp[d] * op[d];  // sum(dO o): fp32, as the CPU's
        }
      }
      const float p = __expf(warp_sum(a) * scale - lse[(bi * nh + h) * t + qi]);
      const float ds = rb(p * (warp_sum(c) - warp_sum(e)) * scale, bf16), pb = rb(p, bf16);
      for (int j = 0; j < per; ++j) {
        const i64 d = lane + 32 * j;
        if (d < hd) {
          dk[j] += ds * rb(qp[d], bf16);
          dv[j] += pb * rb(gp[d], bf16);
        }
      }
    }
  }
  float* dkp = dqkv + (bi * t + s) * stride + (nh + kvh) * hd;
  float* dvp = dqkv + (bi * t + s) * stride + (nh + nkv + kvh) * hd;
  for (int j = 0; j < per; ++j) {
    const i64 d = lane + 32 * j;
    if (d < hd) {
      dkp[d] = dk[j];
      dvp[d] = dv[j];
    }
  }
}

__global__ void k_swiglu_forward(const float* gu, float* out, i64 n, i64 inter) {
  const i64 i = blockIdx.x * i64(blockDim.x) + threadIdx.x;
  if (i >= n * inter) return;
  const i64 r = i / inter, j = i % inter;
  const float g = gu[r * 2 * inter + j], u = gu[r * 2 * inter + inter + j];
  out[i] = g / (1.0f + expf(-g)) * u;
}

__global__ void k_swiglu_backward(const float* dout, const float* gu, float* dgu, i64 n,
                                  i64 inter) {
  const i64 i = blockIdx.x * i64(blockDim.x) + threadIdx.x;
  if (i >= n * inter) return;
  const i64 r = i / inter, j = i % inter;
  const float g = gu[r * 2 * inter + j], u = gu[r * 2 * inter + inter + j];
  const float sig = 1.0f / (1.0f + expf(-g));
  dgu[r * 2 * inter + inter + j] = dout[i] * g * sig;
  dgu[r * 2 * inter + j] = dout[i] * u * sig * (1.0f + g * (1.0f - sig));
}

constexpr float kGeluK = 0.7978845608028654f;

__global__ void k_gelu_forward(const float* x, float* out, i64 n) {
  const i64 i = blockIdx.x * i64(blockDim.x) + threadIdx.x;
  if (i >= n) return;
  const float v = x[i];
  out[i] = 0.5f * v * (1.0f + tanhf(kGeluK * (v + 0.044715f * v * v * v)));
}

__global__ void k_gelu_backward(const float* dout, const float* x, float* dx, i64 n) {
  const i64 i = blockIdx.x * i64(blockDim.x) + threadIdx.x;
  if (i >= n) return;
  const float v = x[i];
  const float th = tanhf(kGeluK * (v + 0.044715f * v * v * v));
  dx[i] = dout[i] * (0.5f * (1.0f + th) +
                     0.5f * v * (1.0f - th * th) * kGeluK * (1.0f + 3.0f * 0.044715f * v * v));
}

__global__ void k_bias_add(float* y, const void* b, bool bf16, i64 n, i64 m) {
  const i64 i = blockIdx.x * i64(blockDim.x) + threadIdx.x;
  if (i >= n * m) return;
  y[i] += ld(b, bf16, i % m);
}

__global__ void k_bias_backward(const float* dy, float* db, i64 n, i64 m) {
  const i64 j = blockIdx.x * i64(blockDim.x) + threadIdx.x;
  if (j >= m) return;
  float s = 0;
  for (i64 r = 0; r < n; ++r) s += dy[r * m + j];
  db[j] += s;
}

// The log-sum-exp of a row of `vocab` logits (the block's threads together; every thread gets it).
__device__ float row_lse(const float* l, i64 vocab) {
  float mx = -INFINITY;
  for (i64 i = threadIdx.x; i < vocab; i += blockDim.x) mx = fmaxf(mx, l[i]);
  mx = block_max(mx);
  float s = 0;
  for (i64 i = threadIdx.x; i < vocab; i += blockDim.x) s += expf(l[i] - mx);
  return mx + logf(block_sum(s));
}

__global__ void k_cross_entropy(float* logits, const std::int32_t* targets, float* losses,
                                i64 vocab, float grad_scale) {
  float* l = logits + blockIdx.x * vocab;
  const i64 tgt = targets[blockIdx.x];
  if (tgt == model_ops::kIgnoreTarget) {  // the whole block leaves: no loss, a zero gradient row
    if (threadIdx.x == 0) losses[blockIdx.x] = 0.0f;
    if (grad_scale != 0.0f)
      for (i64 i = threadIdx.x; i < vocab; i += blockDim.x) l[i] = 0.0f;
    return;
  }
  const float lse = row_lse(l, vocab);
  if (threadIdx.x == 0) losses[blockIdx.x] = lse - l[tgt];
  __syncthreads();  // l[tgt] is read above before anyone overwrites it
  if (grad_scale != 0.0f) {
    for (i64 i = threadIdx.x; i < vocab; i += blockDim.x)
      l[i] = expf(l[i] - lse) * grad_scale - (i == tgt ? grad_scale : 0.0f);
  }
}

// The vocabulary-parallel cross-entropy's halves (model_ops::Backend::cross_entropy_stats and
// _finish), a block per row; targets are local column indices, -1 (another rank's) or ignored.
__global__ void k_cross_entropy_stats(const float* logits, const std::int32_t* targets,
                                      float* stats, i64 vocab) {
  const float* l = logits + blockIdx.x * vocab;
  const float lse = row_lse(l, vocab);
  if (threadIdx.x == 0) {
    const std::int32_t tgt = targets[blockIdx.x];
    stats[2 * blockIdx.x] = lse;
    stats[2 * blockIdx.x + 1] = tgt >= 0 ? l[tgt] : 0.0f;
  }
}

__global__ void k_cross_entropy_finish(float* logits, const std::int32_t* targets, const float* all,
                                       i64 parts, float* losses, i64 rows, i64 vocab,
                                       float grad_scale) {
  const i64 r = blockIdx.x;
  float* l = logits + r * vocab;
  const i64 tgt = targets[r];
  if (tgt == model_ops::kIgnoreTarget) {
    if (threadIdx.x == 0) losses[r] = 0.0f;
    if (grad_scale != 0.0f)
      for (i64 i = threadIdx.x; i < vocab; i += blockDim.x) l[i] = 0.0f;
    return;
  }
  // Every thread combines the parts in rank order (a few values): the same loss on every rank.
  float mx = all[2 * r];
  for (i64 p = 1; p < parts; ++p) mx = fmaxf(mx, all[(p * rows + r) * 2]);
  float sum = 0, tl = 0;
  for (i64 p = 0; p < parts; ++p) {
    sum += expf(all[(p * rows + r) * 2] - mx);
    tl += all[(p * rows + r) * 2 + 1];
  }
  const float lse = mx + logf(sum);
  if (threadIdx.x == 0) losses[r] = lse - tl;
  if (grad_scale != 0.0f)
    for (i64 i = threadIdx.x; i < vocab; i += blockDim.x)
      l[i] = expf(l[i] - lse) * grad_scale - (i == tgt ? grad_scale : 0.0f);
}

std::atomic<KernelVariant> g_variant{KernelVariant::kSimple};
KernelVariant variant() { return g_variant.load(std::memory_order_relaxed); }

// Column reductions, tiled: blocks of kColTile columns (threadIdx.x, a warp's lanes) by
// kRowGroups row groups (threadIdx.y).
constexpr int kColTile = 32;
constexpr int kRowGroups = 16;
constexpr int kColThreads = kColTile * kRowGroups;

dim3 col_grid(i64 c) { return dim3(unsigned((c + kColTile - 1) / kColTile)); }
dim3 col_block() { return dim3(kColTile, kRowGroups); }

// The 16 row groups' partials of this thread's column, added in group order (row group 0 uses
// the result). Every thread of the block calls it.
__device__ __forceinline__ float sum_row_groups(float (&part)[kRowGroups][kColTile], float v) {
  part[threadIdx.y][threadIdx.x] = v;
  __syncthreads();
  float s = part[0][threadIdx.x];
  for (int g = 1; g < kRowGroups; ++g) s += part[g][threadIdx.x];
  return s;
}

__global__ void __launch_bounds__(kColThreads)
    k_rmsnorm_backward_dw_tiled(const float* dout, const float* x, const float* rstd, float* dw,
                                i64 n, i64 c) {
  __shared__ float part[kRowGroups][kColTile];
  const i64 j = blockIdx.x * i64(kColTile) + threadIdx.x;
  float s = 0;
  if (j < c) {
#pragma unroll 4
    for (i64 r = threadIdx.y; r < n; r += kRowGroups) s += dout[r * c + j] * x[r * c + j] * rstd[r];
  }
  s = sum_row_groups(part, s);
  if (threadIdx.y == 0 && j < c) dw[j] += s;
}

__global__ void __launch_bounds__(kColThreads)
    k_layernorm_backward_dwb_tiled(const float* dout, const float* x, const float* mean,
                                   const float* rstd, float* dw, float* db, i64 n, i64 c) {
  __shared__ float part_w[kRowGroups][kColTile], part_b[kRowGroups][kColTile];
  const i64 j = blockIdx.x * i64(kColTile) + threadIdx.x;
  float sw = 0, sb = 0;
  if (j < c) {
#pragma unroll 4
    for (i64 r = threadIdx.y; r < n; r += kRowGroups) {
      sw += dout[r * c + j] * (x[r * c + j] - mean[r]) * rstd[r];
      sb += dout[r * c + j];
    }
  }
  sw = sum_row_groups(part_w, sw);
  sb = sum_row_groups(part_b, sb);
  if (threadIdx.y == 0 && j < c) {
    dw[j] += sw;
    db[j] += sb;
  }
}

__global__ void __launch_bounds__(kColThreads)
    k_bias_backward_tiled(const float* dy, float* db, i64 n, i64 m) {
  __shared__ float part[kRowGroups][kColTile];
  const i64 j = blockIdx.x * i64(kColTile) + threadIdx.x;
  float s = 0;
  if (j < m) {
#pragma unroll 4
    for (i64 r = threadIdx.y; r < n; r += kRowGroups) s += dy[r * m + j];
  }
  s = sum_row_groups(part, s);
  if (threadIdx.y == 0 && j < m) db[j] += s;
}

// Embedding backward, tiled: row group g owns dwte's rows id = g (mod 16) and dwpe's positions
// p = g (mod 16); every group walks all rows in order (their tokens staged in shared memory a
// chunk at a time) and adds the rows it owns. A warp's lanes share the row, so the branches are
// uniform and the reads of dout coalesced.
__global__ void __launch_bounds__(kColThreads)
    k_embedding_backward_tiled(const std::int32_t* tok, const float* dout, float* dwte, float* dwpe,
                               i64 n, i64 t, i64 c) {
  __shared__ std::int32_t chunk[kColThreads];
  const i64 j = blockIdx.x * i64(kColTile) + threadIdx.x;
  const unsigned g = threadIdx.y;
  const int tid = int(threadIdx.y) * kColTile + int(threadIdx.x);
  i64 pos = 0;  // r % t
  for (i64 r0 = 0; r0 < n; r0 += kColThreads) {
    __syncthreads();  // everyone is done with the previous chunk
    if (r0 + tid < n) chunk[tid] = tok[r0 + tid];
    __syncthreads();
    const int count = int(min(i64(kColThreads), n - r0));
    for (int i = 0; i < count; ++i) {
      const std::int32_t id = chunk[i];
      const bool te = id >= 0 && (unsigned(id) % kRowGroups) == g;
      const bool pe = dwpe != nullptr && unsigned(pos % kRowGroups) == g;
      if (j < c && (te || pe)) {
        const float v = dout[(r0 + i) * c + j];
        if (te) dwte[i64(id) * c + j] += v;
        if (pe) dwpe[pos * c + j] += v;
      }
      if (++pos == t) pos = 0;
    }
  }
}

// Tiled attention (kTiled; bf16 only, head_dim HD a multiple of 16 up to 128, one instantiation
// per HD so that every per-thread array is indexed by constants and stays in registers).
//
// Tiles of kTile = 64 queries and 64 keys, a block per tile. The forward's block is 4 warps, each
// owning 16 query rows; the backward's is 8, a pair per 16 rows (query rows in dq, key rows in
// dk/dv) sharing the scores' work and splitting the accumulators, so that no kernel needs more
// than 255 registers per thread (dk and dv of 16 rows at HD = 128 are 128 per lane alone). The
// products run on the tensor cores through WMMA (bf16 16x16x16, fp32 accumulators); their
// operands are staged in shared memory as bf16, rounded from the fp32 rows with
// __float2bfloat16_rn (what rb() does), in rows of HD + 8 elements (the pad spreads a
// fragment's rows over the banks). Rows of a tile past t are zero-filled and masked. Scores are
// combined element by element in the accumulator fragments: which (row, column) an element
// holds is the architecture's choice, so each warp reads it once from a fragment loaded from a
// matrix of indices (fragment_index).
//  - forward: a block per (batch, head, query tile), the tiles with the most keys first. Pass 1
//    walks the key tiles up to the diagonal: S = Q K^T (fp32) is staged in shared memory and two
//    lanes per row fold the tile's masked, scaled scores into the row's running max m and sum l,
//    as the simple kernel does key by key. Pass 2 recomputes S tile by tile, writes
//    P = round_bf16(exp(S scale - m) / l) (zero where masked) to shared memory and accumulates
//    O += P V in fragments. O is written fp32, lse = m + log(l).
//  - backward, dq: a block per (batch, head, query tile); per key tile S = Q K^T,
//    dP = round(dO) V^T, P = exp(S scale - lse), dS = round(P (dP - D) scale) (each warp of a
//    pair half of the key columns), then dQ += dS K (each warp half of dQ's columns).
//  - backward, dk and dv: a block per (batch, kv head, key tile), the tiles with the most
//    queries first, over the heads of its group and the query tiles from the diagonal on:
//    S^T = K Q^T, dP^T = V round(dO)^T (each warp of a pair half of the query columns), then
//    one warp of the pair dK += dS^T Q, the other dV += round(P)^T round(dO).
// D = sum(dO o) per query row is fp32, summed by one warp per row in a fixed order (tile_dsum),
// the same in both backward kernels. Nothing is atomic, so results are bit-reproducible; they
// equal the simple kernels' up to the order of the sums (which can move a rounded P or dS by
// one bf16 step). Shared memory (HD = 128): forward 60.5 KiB, dq 43.5 KiB, dk/dv 86.5 KiB,
// dynamic, the limit raised per kernel at launch.
namespace wmma = nvcuda::wmma;
using bf16_t = __nv_bfloat16;
using FragA = wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16_t, wmma::row_major>;
using FragB = wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16_t, wmma::row_major>;
using FragBt =
    wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16_t, wmma::col_major>;  // B read transposed
using FragC = wmma::fragment<wmma::accumulator, 16, 16, 16, float>;

constexpr int kTile = 64;
constexpr int kChunks = kTile / 16;     // 16-wide chunks of a tile
constexpr int kAttnWarps = kTile / 16;  // forward: a warp per 16 rows
constexpr int kAttnThreads = 32 * kAttnWarps;
constexpr int kBwdThreads = 2 * kAttnThreads;  // backward: a pair of warps per 16 rows
constexpr int kSLd = kTile + 4;                // floats per row of a staged fp32 score tile
constexpr int kPLd = kTile + 8;                // elements per row of a bf16 P or dS tile
constexpr int kFragElems = FragC::num_elements;
constexpr int kMaxTiledHd = 128;

// Dynamic shared memory of each kernel; every region a multiple of 32 bytes (WMMA's alignment).
template <int HD>
constexpr std::size_t tile_bytes() {
  return std::size_t(kTile) * (HD + 8) * sizeof(bf16_t);
}
constexpr std::size_t kPBytes = std::size_t(kTile) * kPLd * sizeof(bf16_t);
constexpr std::size_t kSBytes = std::size_t(kTile) * kSLd * sizeof(float);
constexpr std::size_t kRowBytes = kTile * sizeof(float);
template <int HD>
constexpr std::size_t forward_smem() {
  return 2 * tile_bytes<HD>() + kSBytes + kPBytes + 2 * kRowBytes;
}
template <int HD>
constexpr std::size_t dq_smem() {
  return 2 * tile_bytes<HD>() + kPBytes + 2 * kRowBytes;
}
template <int HD>
constexpr std::size_t dkv_smem() {
  return 4 * tile_bytes<HD>() + 2 * kPBytes + 2 * kRowBytes;
}

__device__ __forceinline__ unsigned char* dynamic_smem() {
  extern __shared__ __align__(128) unsigned char smem_bytes[];
  return smem_bytes;
}

// f(std::integral_constant<int, HD>) for each head dim the tiled kernels take.
template <class F>
void for_each_tiled_head_dim(F&& f) {
  [&]<int... I>(std::integer_sequence<int, I...>) {
    (f(std::integral_constant<int, 16 * (I + 1)>{}), ...);
  }
  (std::make_integer_sequence<int, kMaxTiledHd / 16>{});
}

// Rows [0, rows) of a head's slice (row r at src + r * ld, HD values), rounded to bf16, into the
// tile dst ([kTile][HD + 8]); the rows from `rows` on are zeros. Every thread of the block.
template <int HD>
__device__ void load_tile(bf16_t* dst, const float* src, i64 ld, int rows) {
  for (int e = threadIdx.x; e < kTile * HD; e += blockDim.x) {
    const int r = e / HD, d = e - r * HD;
    dst[r * (HD + 8) + d] = __float2bfloat16_rn(r < rows ? src[r * ld + d] : 0.0f);
  }
}

// Where each element of a 16x16 fp32 accumulator fragment sits (the same for every one): byte
// i is row * 16 + column of element i. Four to a register: a kernel holds it all its run.
struct FragIndex {
  unsigned packed[kFragElems / 4];
  __device__ int at(int i) const { return int((packed[i / 4] >> (8 * (i % 4))) & 0xffu); }
  __device__ int row(int i) const { return at(i) >> 4; }
  __device__ int col(int i) const { return at(i) & 15; }
};
static_assert(kFragElems % 4 == 0, "a 16x16 fp32 fragment holds 8 elements per lane");

// The index, read back from a fragment loaded from a matrix of indices. `scratch`: 256 floats of
// the calling warp's, 32-byte aligned, free until this returns. Every lane of the warp.
__device__ FragIndex fragment_index(float* scratch) {
  const int lane = threadIdx.x & 31;
  for (int e = lane; e < 256; e += 32) scratch[e] = float(e);
  __syncwarp();
  FragC f;
  wmma::load_matrix_sync(f, scratch, 16, wmma::mem_row_major);
  __syncwarp();
  FragIndex idx{};
#pragma unroll
  for (int i = 0; i < kFragElems; ++i) idx.packed[i / 4] |= unsigned(f.x[i]) << (8 * (i % 4));
  return idx;
}

// d[r] = sum(dO o) of the query rows [0, rows) of a tile (row r at dout + r * ld and o + r * ld,
// HD values), zero from `rows` on: one warp per row, each lane its columns in order, then
// warp_sum's butterfly. Every thread of the block.
template <int HD>
__device__ void tile_dsum(float* d, const float* dout, const float* o, i64 ld, int rows) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  for (int r = warp; r < kTile; r += warps) {
    float part = 0;
    if (r < rows)
      for (int c = lane; c < HD; c += 32) part += dout[r * ld + c] * o[r * ld + c];
    part = warp_sum(part);
    if (lane == 0) d[r] = part;
  }
}

// WMMA on bf16 needs sm_80; the module is built for sm_90 (CMAKE_CUDA_ARCHITECTURES). A build
// for an older GPU compiles the kernels below to a trap.

// S for 16 keys (chunk n of the staged K tile ks, rows of LD elements) against the warp's 16
// query rows qf (NF fragments of 16 head dims): sf = Q K^T, fp32.
template <int NF, int LD>
__device__ __forceinline__ void score_chunk(FragC& sf, const FragA (&qf)[NF], const bf16_t* ks,
                                            int n) {
  wmma::fill_fragment(sf, 0.0f);
#pragma unroll
  for (int kk = 0; kk < NF; ++kk) {
    FragBt kb;
    wmma::load_matrix_sync(kb, ks + n * 16 * LD + kk * 16, LD);
    wmma::mma_sync(sf, qf[kk], kb, sf);
  }
}

template <int HD>
__global__ void __launch_bounds__(kAttnThreads)
    k_attention_forward_tiled(const float* qkv, float* o, float* lse, int b, int t, int nh, int nkv,
                              float scale) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  __trap();
#else
  constexpr int NF = HD / 16, LD = HD + 8;
  bf16_t* ks = reinterpret_cast<bf16_t*>(dynamic_smem());
  bf16_t* vs = ks + kTile * LD;  // stages Q before the first V tile
  float* ss = reinterpret_cast<float*>(vs + kTile * LD);
  bf16_t* ps = reinterpret_cast<bf16_t*>(ss + kTile * kSLd);
  float* row_m = reinterpret_cast<float*>(ps + kTile * kPLd);
  float* row_l = row_m + kTile;

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int heads = b * nh, tiles = (t + kTile - 1) / kTile;
  const int qt = tiles - 1 - int(blockIdx.x / unsigned(heads));
  const int bh = int(blockIdx.x % unsigned(heads)), bi = bh / nh, h = bh % nh, kvh = h / (nh / nkv);
  const i64 stride = i64(nh + 2 * nkv) * HD;
  const float* rows = qkv + i64(bi) * t * stride;  // this batch's row 0
  const int q0 = qt * kTile, w0 = warp * 16;  // the tile's first query, the warp's first row in it
  bf16_t* pw = ps + w0 * kPLd;                // the warp's 16 rows of P

  const FragIndex idx = fragment_index(reinterpret_cast<float*>(pw));
  load_tile<HD>(vs, rows + i64(q0) * stride + i64(h) * HD, stride, min(kTile, t - q0));
  __syncthreads();
  FragA qf[NF];
#pragma unroll
  for (int kk = 0; kk < NF; ++kk) wmma::load_matrix_sync(qf[kk], vs + w0 * LD + kk * 16, LD);

  // Pass 1: lanes 2i and 2i + 1 keep the running max and sum of the warp's row i (query pq).
  const int pr = lane >> 1, half = lane & 1, pq = q0 + w0 + pr;
  float m = -INFINITY, l = 0.0f;
  for (int kt = 0; kt <= qt; ++kt) {
    const int k0 = kt * kTile;
    __syncthreads();  // the previous K tile is read by all
    load_tile<HD>(ks, rows + i64(k0) * stride + i64(nh + kvh) * HD, stride, min(kTile, t - k0));
    __syncthreads();
#pragma unroll 1
    for (int n = 0; n < kChunks; ++n) {
      FragC sf;
      score_chunk<NF, LD>(sf, qf, ks, n);
      wmma::store_matrix_sync(ss + w0 * kSLd + n * 16, sf, kSLd, wmma::mem_row_major);
    }
    __syncwarp();
    const float* srow = ss + (w0 + pr) * kSLd;
    float mt = -INFINITY;
    for (int j = half; j < kTile; j += 2)
      if (k0 + j <= pq && k0 + j < t) mt = fmaxf(mt, srow[j] * scale);
    mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, 1));
    const float mn = fmaxf(m, mt);
    float sum = 0.0f;
    for (int j = half; j < kTile; j += 2)
      if (k0 + j <= pq && k0 + j < t) sum += __expf(srow[j] * scale - mn);
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    if (mn != -INFINITY) {  // no key yet: nothing to fold (and -inf - -inf would be NaN)
      l = l * __expf(m - mn) + sum;
      m = mn;
    }
    __syncwarp();  // ss is read before the next tile overwrites it
  }
  if (half == 0) {
    row_m[w0 + pr] = m;
    row_l[w0 + pr] = l;
  }
  __syncwarp();

  // Pass 2: O = round(P) round(V), P normalised with the row's final max and sum.
  FragC acc[NF];
#pragma unroll
  for (int f = 0; f < NF; ++f) wmma::fill_fragment(acc[f], 0.0f);
  for (int kt = 0; kt <= qt; ++kt) {
    const int k0 = kt * kTile;
    __syncthreads();  // the previous K and V tiles are read by all (and Q, staged in V's place)
    load_tile<HD>(ks, rows + i64(k0) * stride + i64(nh + kvh) * HD, stride, min(kTile, t - k0));
    load_tile<HD>(vs, rows + i64(k0) * stride + i64(nh + nkv + kvh) * HD, stride,
                  min(kTile, t - k0));
    __syncthreads();
#pragma unroll 1
    for (int n = 0; n < kChunks; ++n) {
      FragC sf;
      score_chunk<NF, LD>(sf, qf, ks, n);
#pragma unroll
      for (int i = 0; i < kFragElems; ++i) {
        const int r = idx.row(i), c = idx.col(i), s = k0 + n * 16 + c;
        float p = 0.0f;
        if (s <= q0 + w0 + r && s < t) p = __expf(sf.x[i] * scale - row_m[w0 + r]) / row_l[w0 + r];
        pw[r * kPLd + n * 16 + c] = __float2bfloat16_rn(p);
      }
    }
    __syncwarp();
#pragma unroll 1
    for (int kk = 0; kk < kChunks; ++kk) {
      FragA pa;
      wmma::load_matrix_sync(pa, pw + kk * 16, kPLd);
#pragma unroll
      for (int f = 0; f < NF; ++f) {
        FragB vb;
        wmma::load_matrix_sync(vb, vs + kk * 16 * LD + f * 16, LD);
        wmma::mma_sync(acc[f], pa, vb, acc[f]);
      }
    }
    __syncwarp();  // P is read before the next tile overwrites it
  }

  const i64 ldo = i64(nh) * HD;
#pragma unroll
  for (int f = 0; f < NF; ++f)
#pragma unroll
    for (int i = 0; i < kFragElems; ++i) {
      const int r = idx.row(i), c = idx.col(i), q = q0 + w0 + r;
      if (q < t) o[(i64(bi) * t + q) * ldo + i64(h) * HD + f * 16 + c] = acc[f].x[i];
    }
  if (half == 0 && pq < t) lse[(i64(bi) * nh + h) * t + pq] = m + __logf(l);
#endif
}

template <int HD>
__global__ void __launch_bounds__(kBwdThreads)
    k_attention_backward_dq_tiled(const float* qkv, const float* o, const float* dout,
                                  const float* lse, float* dqkv, int b, int t, int nh, int nkv,
                                  float scale) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  __trap();
#else
  constexpr int NF = HD / 16, LD = HD + 8, NH = (NF + 1) / 2;
  bf16_t* ks = reinterpret_cast<bf16_t*>(dynamic_smem());  // stages Q before the first K tile
  bf16_t* vs = ks + kTile * LD;                            // stages dO before the first V tile
  bf16_t* dss = vs + kTile * LD;
  float* row_lse = reinterpret_cast<float*>(dss + kTile * kPLd);
  float* row_d = row_lse + kTile;

  // Warps w and w + 4 share the query rows w0..w0 + 15: each computes half of their dS (key
  // chunks 2 half, 2 half + 1) and accumulates half of their dQ columns (chunks NH half on).
  const int warp = threadIdx.x >> 5, half = warp / kAttnWarps, w0 = (warp % kAttnWarps) * 16;
  const int heads = b * nh, tiles = (t + kTile - 1) / kTile;
  const int qt = tiles - 1 - int(blockIdx.x / unsigned(heads));
  const int bh = int(blockIdx.x % unsigned(heads)), bi = bh / nh, h = bh % nh, kvh = h / (nh / nkv);
  const i64 stride = i64(nh + 2 * nkv) * HD, ldo = i64(nh) * HD;
  const float* rows = qkv + i64(bi) * t * stride;
  const int q0 = qt * kTile, qn = min(kTile, t - q0);
  const i64 orow = (i64(bi) * t + q0) * ldo + i64(h) * HD;  // the tile's first row of o and dout
  bf16_t* dsw = dss + w0 * kPLd;                            // the pair's 16 rows of dS

  const FragIndex idx = fragment_index(reinterpret_cast<float*>(dsw) + half * 256);
  load_tile<HD>(ks, rows + i64(q0) * stride + i64(h) * HD, stride, qn);
  load_tile<HD>(vs, dout + orow, ldo, qn);
  tile_dsum<HD>(row_d, dout + orow, o + orow, ldo, qn);
  if (threadIdx.x < kTile)
    row_lse[threadIdx.x] =
        int(threadIdx.x) < qn ? lse[(i64(bi) * nh + h) * t + q0 + threadIdx.x] : 0.0f;
  __syncthreads();
  FragA qf[NF], gf[NF];
#pragma unroll
  for (int kk = 0; kk < NF; ++kk) {
    wmma::load_matrix_sync(qf[kk], ks + w0 * LD + kk * 16, LD);
    wmma::load_matrix_sync(gf[kk], vs + w0 * LD + kk * 16, LD);
  }

  FragC acc[NH];
#pragma unroll
  for (int f = 0; f < NH; ++f) wmma::fill_fragment(acc[f], 0.0f);
  for (int kt = 0; kt <= qt; ++kt) {
    const int k0 = kt * kTile;
    __syncthreads();  // the previous tiles (first: the Q and dO staging) and dS are read by all
    load_tile<HD>(ks, rows + i64(k0) * stride + i64(nh + kvh) * HD, stride, min(kTile, t - k0));
    load_tile<HD>(vs, rows + i64(k0) * stride + i64(nh + nkv + kvh) * HD, stride,
                  min(kTile, t - k0));
    __syncthreads();
#pragma unroll 1
    for (int nn = 0; nn < kChunks / 2; ++nn) {
      const int n = half * (kChunks / 2) + nn;
      FragC sf, dpf;
      wmma::fill_fragment(sf, 0.0f);
      wmma::fill_fragment(dpf, 0.0f);
#pragma unroll
      for (int kk = 0; kk < NF; ++kk) {
        FragBt kb, vb;
        wmma::load_matrix_sync(kb, ks + n * 16 * LD + kk * 16, LD);
        wmma::mma_sync(sf, qf[kk], kb, sf);
        wmma::load_matrix_sync(vb, vs + n * 16 * LD + kk * 16, LD);
        wmma::mma_sync(dpf, gf[kk], vb, dpf);
      }
#pragma unroll
      for (int i = 0; i < kFragElems; ++i) {
        const int r = idx.row(i), c = idx.col(i), q = q0 + w0 + r, s = k0 + n * 16 + c;
        float ds = 0.0f;
        if (s <= q && q < t) {
          const float p = __expf(sf.x[i] * scale - row_lse[w0 + r]);
          ds = p * (dpf.x[i] - row_d[w0 + r]) * scale;
        }
        dsw[r * kPLd + n * 16 + c] = __float2bfloat16_rn(ds);
      }
    }
    __syncthreads();  // both halves of dS are written
#pragma unroll 1
    for (int kk = 0; kk < kChunks; ++kk) {
      FragA da;
      wmma::load_matrix_sync(da, dsw + kk * 16, kPLd);
#pragma unroll
      for (int f = 0; f < NH; ++f) {
        const int fg = half * NH + f;
        if (fg < NF) {
          FragB kb;
          wmma::load_matrix_sync(kb, ks + kk * 16 * LD + fg * 16, LD);
          wmma::mma_sync(acc[f], da, kb, acc[f]);
        }
      }
    }
  }

#pragma unroll
  for (int f = 0; f < NH; ++f) {
    const int fg = half * NH + f;
    if (fg < NF)
#pragma unroll
      for (int i = 0; i < kFragElems; ++i) {
        const int r = idx.row(i), c = idx.col(i), q = q0 + w0 + r;
        if (q < t) dqkv[(i64(bi) * t + q) * stride + i64(h) * HD + fg * 16 + c] = acc[f].x[i];
      }
  }
#endif
}

template <int HD>
__global__ void __launch_bounds__(kBwdThreads)
    k_attention_backward_dkv_tiled(const float* qkv, const float* o, const float* dout,
                                   const float* lse, float* dqkv, int b, int t, int nh, int nkv,
                                   float scale) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  __trap();
#else
  constexpr int NF = HD / 16, LD = HD + 8;
  bf16_t* ks = reinterpret_cast<bf16_t*>(dynamic_smem());  // the block's keys and values
  bf16_t* vs = ks + kTile * LD;
  bf16_t* qs = vs + kTile * LD;  // a query tile's q and dO
  bf16_t* gs = qs + kTile * LD;
  bf16_t* pts = gs + kTile * LD;  // P^T and dS^T: key rows, query columns
  bf16_t* dsts = pts + kTile * kPLd;
  float* col_lse = reinterpret_cast<float*>(dsts + kTile * kPLd);
  float* col_d = col_lse + kTile;

  // Warps w and w + 4 share the key rows w0..w0 + 15: each computes half of their P^T and dS^T
  // (query chunks 2 half, 2 half + 1); then warp w accumulates their dK += dS^T Q and warp w + 4
  // their dV += P^T dO.
  const int warp = threadIdx.x >> 5, half = warp / kAttnWarps, w0 = (warp % kAttnWarps) * 16;
  const int heads = b * nkv, tiles = (t + kTile - 1) / kTile, group = nh / nkv;
  const int kt = int(blockIdx.x / unsigned(heads));  // tile 0 sees the most queries: first
  const int bh = int(blockIdx.x % unsigned(heads)), bi = bh / nkv, kvh = bh % nkv;
  const i64 stride = i64(nh + 2 * nkv) * HD, ldo = i64(nh) * HD;
  const float* rows = qkv + i64(bi) * t * stride;
  const int k0 = kt * kTile, kn = min(kTile, t - k0);
  bf16_t* pw = pts + w0 * kPLd;  // the pair's 16 key rows of P^T and dS^T
  bf16_t* dsw = dsts + w0 * kPLd;
  const bf16_t* acc_a = half == 0 ? dsw : pw;  // dK += dS^T Q; dV += P^T dO
  const bf16_t* acc_b = half == 0 ? qs : gs;

  const FragIndex idx = fragment_index(reinterpret_cast<float*>(pw) + half * 256);
  load_tile<HD>(ks, rows + i64(k0) * stride + i64(nh + kvh) * HD, stride, kn);
  load_tile<HD>(vs, rows + i64(k0) * stride + i64(nh + nkv + kvh) * HD, stride, kn);

  FragC acc[NF];
#pragma unroll
  for (int f = 0; f < NF; ++f) wmma::fill_fragment(acc[f], 0.0f);
  for (int h = kvh * group; h < (kvh + 1) * group; ++h) {
    for (int qt = kt; qt < tiles; ++qt) {
      const int q0 = qt * kTile, qn = min(kTile, t - q0);
      const i64 orow = (i64(bi) * t + q0) * ldo + i64(h) * HD;
      __syncthreads();  // the previous query tile, P^T and dS^T are read by all
      load_tile<HD>(qs, rows + i64(q0) * stride + i64(h) * HD, stride, qn);
      load_tile<HD>(gs, dout + orow, ldo, qn);
      tile_dsum<HD>(col_d, dout + orow, o + orow, ldo, qn);
      if (threadIdx.x < kTile)
        col_lse[threadIdx.x] =
            int(threadIdx.x) < qn ? lse[(i64(bi) * nh + h) * t + q0 + threadIdx.x] : 0.0f;
      __syncthreads();
#pragma unroll 1
      for (int nn = 0; nn < kChunks / 2; ++nn) {
        const int n = half * (kChunks / 2) + nn;
        FragC sf, dpf;
        wmma::fill_fragment(sf, 0.0f);
        wmma::fill_fragment(dpf, 0.0f);
#pragma unroll
        for (int kk = 0; kk < NF; ++kk) {
          FragA a;
          FragBt bt;
          wmma::load_matrix_sync(a, ks + w0 * LD + kk * 16, LD);
          wmma::load_matrix_sync(bt, qs + n * 16 * LD + kk * 16, LD);
          wmma::mma_sync(sf, a, bt, sf);
          wmma::load_matrix_sync(a, vs + w0 * LD + kk * 16, LD);
          wmma::load_matrix_sync(bt, gs + n * 16 * LD + kk * 16, LD);
          wmma::mma_sync(dpf, a, bt, dpf);
        }
#pragma unroll
        for (int i = 0; i < kFragElems; ++i) {
          const int r = idx.row(i), c = idx.col(i), s = k0 + w0 + r, q = q0 + n * 16 + c;
          float p = 0.0f, ds = 0.0f;
          if (q >= s && q < t) {
            p = __expf(sf.x[i] * scale - col_lse[n * 16 + c]);
            ds = p * (dpf.x[i] - col_d[n * 16 + c]) * scale;
          }
          pw[r * kPLd + n * 16 + c] = __float2bfloat16_rn(p);
          dsw[r * kPLd + n * 16 + c] = __float2bfloat16_rn(ds);
        }
      }
      __syncthreads();  // both halves of P^T and dS^T are written
#pragma unroll 1
      for (int kk = 0; kk < kChunks; ++kk) {
        FragA a;
        wmma::load_matrix_sync(a, acc_a + kk * 16, kPLd);
#pragma unroll
        for (int f = 0; f < NF; ++f) {
          FragB bm;
          wmma::load_matrix_sync(bm, acc_b + kk * 16 * LD + f * 16, LD);
          wmma::mma_sync(acc[f], a, bm, acc[f]);
        }
      }
    }
  }

  const i64 col = i64(half == 0 ? nh + kvh : nh + nkv + kvh) * HD;  // dk or dv of this kv head
#pragma unroll
  for (int f = 0; f < NF; ++f)
#pragma unroll
    for (int i = 0; i < kFragElems; ++i) {
      const int r = idx.row(i), c = idx.col(i), s = k0 + w0 + r;
      if (s < t) dqkv[(i64(bi) * t + s) * stride + col + f * 16 + c] = acc[f].x[i];
    }
#endif
}

// The tiled attention applies: the variant, bf16 operands, a head dim it was instantiated for.
bool tiled_attention(KernelVariant v, i64 hd, bool bf16) {
  return v == KernelVariant::kTiled && bf16 && hd % 16 == 0 && hd >= 16 && hd <= kMaxTiledHd;
}

// f(std::integral_constant<int, hd>)'s result; hd must be one of for_each_tiled_head_dim's.
template <class F>
int with_head_dim(i64 hd, F&& f) {
  int result = static_cast<int>(cudaErrorInvalidValue);
  for_each_tiled_head_dim([&](auto c) {
    if (hd == decltype(c)::value) result = f(c);
  });
  return result;
}

// Launches `kernel` with `smem` bytes of dynamic shared memory, first raising its limit (above
// the default 48 KiB).
template <class... Params, class... Args>
int launch_tiled(void (*kernel)(Params...), i64 blocks, int threads, std::size_t smem, void* stream,
                 Args... args) {
  if (const cudaError_t err = cudaFuncSetAttribute(
          kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
      err != cudaSuccess)
    return static_cast<int>(err);
  kernel<<<unsigned(blocks), threads, smem, cs(stream)>>>(args...);
  return launched();
}

}  // namespace

const char* error_text(int err) { return cudaGetErrorString(static_cast<cudaError_t>(err)); }

void set_kernel_variant(KernelVariant v) { g_variant.store(v, std::memory_order_relaxed); }
KernelVariant kernel_variant() { return variant(); }

int preload_kernels() {
  cudaError_t first = cudaSuccess;
  auto load = [&](const void* kernel) {
    cudaFuncAttributes attr;
    const cudaError_t err = cudaFuncGetAttributes(&attr, kernel);
    if (first == cudaSuccess) first = err;
  };
  for (const void* k : {(const void*)k_embedding_forward,
                        (const void*)k_embedding_backward,
                        (const void*)k_rmsnorm_forward,
                        (const void*)k_rmsnorm_backward_dx,
                        (const void*)k_rmsnorm_backward_dw,
                        (const void*)k_layernorm_forward,
                        (const void*)k_layernorm_backward_dx,
                        (const void*)k_layernorm_backward_dwb,
                        (const void*)k_rope,
                        (const void*)k_attention_forward,
                        (const void*)k_attention_backward_dq,
                        (const void*)k_attention_backward_dkv,
                        (const void*)k_swiglu_forward,
                        (const void*)k_swiglu_backward,
                        (const void*)k_gelu_forward,
                        (const void*)k_gelu_backward,
                        (const void*)k_bias_add,
                        (const void*)k_bias_backward,
                        (const void*)k_cross_entropy,
                        (const void*)k_cross_entropy_stats,
                        (const void*)k_cross_entropy_finish,
                        (const void*)k_kv_append,
                        (const void*)k_attention_cached,
                        (const void*)k_rmsnorm_backward_dw_tiled,
                        (const void*)k_layernorm_backward_dwb_tiled,
                        (const void*)k_bias_backward_tiled,
                        (const void*)k_embedding_backward_tiled})
    load(k);
  for_each_tiled_head_dim([&](auto c) {
    constexpr int hd = decltype(c)::value;
    load((const void*)k_attention_forward_tiled<hd>);
    load((const void*)k_attention_backward_dq_tiled<hd>);
    load((const void*)k_attention_backward_dkv_tiled<hd>);
  });
  return static_cast<int>(first);
}

int embedding_forward(const std::int32_t* tokens, const void* wte, const void* wpe, bool wbf16,
                      float* out, i64 n, i64 t, i64 c, void* stream) {
  k_embedding_forward<<<blocks_for(n * c), kThreads, 0, cs(stream)>>>(tokens, wte, wpe, wbf16, out,
                                                                      n, t, c);
  return launched();
}
int embedding_backward(const std::int32_t* tokens, const float* dout, float* dwte, float* dwpe,
                       i64 n, i64 t, i64 c, void* stream) {
  if (variant() == KernelVariant::kTiled)
    k_embedding_backward_tiled<<<col_grid(c), col_block(), 0, cs(stream)>>>(tokens, dout, dwte,
                                                                            dwpe, n, t, c);
  else
    k_embedding_backward<<<blocks_for(c), kThreads, 0, cs(stream)>>>(tokens, dout, dwte, dwpe, n, t,
                                                                     c);
  return launched();
}
int rmsnorm_forward(const float* x, const void* w, bool wbf16, float* out, float* rstd, i64 n,
                    i64 c, double eps, void* stream) {
  if (n == 0) return 0;  // (a grid of 0 blocks is a launch error; the CPU does nothing)
  k_rmsnorm_forward<<<unsigned(n), kThreads, 0, cs(stream)>>>(x, w, wbf16, out, rstd, c,
                                                              float(eps));
  return launched();
}
int rmsnorm_backward(const float* dout, const float* x, const void* w, bool wbf16,
                     const float* rstd, float* dx, float* dw, i64 n, i64 c, void* stream) {
  if (n == 0) return 0;  // (a grid of 0 blocks is a launch error; the CPU does nothing)
  k_rmsnorm_backward_dx<<<unsigned(n), kThreads, 0, cs(stream)>>>(dout, x, w, wbf16, rstd, dx, c);
  if (const cudaError_t err = cudaGetLastError(); err != cudaSuccess) return static_cast<int>(err);
  if (variant() == KernelVariant::kTiled)
    k_rmsnorm_backward_dw_tiled<<<col_grid(c), col_block(), 0, cs(stream)>>>(dout, x, rstd, dw, n,
                                                                             c);
  else
    k_rmsnorm_backward_dw<<<blocks_for(c), kThreads, 0, cs(stream)>>>(dout, x, rstd, dw, n, c);
  return launched();
}
int layernorm_forward(const float* x, const void* w, const void* b, bool wbf16, float* out,
                      float* mean, float* rstd, i64 n, i64 c, double eps, void* stream) {
  if (n == 0) return 0;  // (a grid of 0 blocks is a launch error; the CPU does nothing)
  k_layernorm_forward<<<unsigned(n), kThreads, 0, cs(stream)>>>(x, w, b, wbf16, out, mean, rstd, c,
                                                                float(eps));
  return launched();
}
int layernorm_backward(const float* dout, const float* x, const void* w, bool wbf16,
                       const float* mean, const float* rstd, float* dx, float* dw, float* db, i64 n,
                       i64 c, void* stream) {
  if (n == 0) return 0;  // (a grid of 0 blocks is a launch error; the CPU does nothing)
  k_layernorm_backward_dx<<<unsigned(n), kThreads, 0, cs(stream)>>>(dout, x, w, wbf16, mean, rstd,
                                                                    dx, c);
  if (const cudaError_t err = cudaGetLastError(); err != cudaSuccess) return static_cast<int>(err);
  if (variant() == KernelVariant::kTiled)
    k_layernorm_backward_dwb_tiled<<<col_grid(c), col_block(), 0, cs(stream)>>>(dout, x, mean, rstd,
                                                                                dw, db, n, c);
  else
    k_layernorm_backward_dwb<<<blocks_for(c), kThreads, 0, cs(stream)>>>(dout, x, mean, rstd, dw,
                                                                         db, n, c);
  return launched();
}
int rope(float* x, i64 n, i64 t, i64 stride, i64 col, i64 heads, i64 hd, const float* cos,
         const float* sin, bool inverse, void* stream) {
  k_rope<<<blocks_for(n * heads * (hd / 2)), kThreads, 0, cs(stream)>>>(x, n, t, stride, col, heads,
                                                                        hd, cos, sin, inverse);
  return launched();
}
int attention_forward(const float* qkv, float* o, float* lse, i64 b, i64 t, i64 nh, i64 nkv, i64 hd,
                      double scale, bool bf16, void* stream) {
  if (tiled_attention(variant(), hd, bf16))
    return with_head_dim(hd, [&](auto c) {
      constexpr int HD = decltype(c)::value;
      return launch_tiled(k_attention_forward_tiled<HD>, (t + kTile - 1) / kTile * b * nh,
                          kAttnThreads, forward_smem<HD>(), stream, qkv, o, lse, int(b), int(t),
                          int(nh), int(nkv), float(scale));
    });
  const i64 rows = b * nh * t, per_block = kThreads / 32;
  k_attention_forward<<<unsigned((rows + per_block - 1) / per_block), kThreads, 0, cs(stream)>>>(
      qkv, o, lse, b, t, nh, nkv, hd, float(scale), bf16);
  return launched();
}
int attention_backward(const float* qkv, const float* o, const float* dout, const float* lse,
                       float* dqkv, i64 b, i64 t, i64 nh, i64 nkv, i64 hd, double scale, bool bf16,
                       void* stream) {
  if (tiled_attention(variant(), hd, bf16))  // the variant read once: both kernels agree
    return with_head_dim(hd, [&](auto c) {
      constexpr int HD = decltype(c)::value;
      const i64 tiles = (t + kTile - 1) / kTile;
      const int err = launch_tiled(k_attention_backward_dq_tiled<HD>, tiles * b * nh, kBwdThreads,
                                   dq_smem<HD>(), stream, qkv, o, dout, lse, dqkv, int(b), int(t),
                                   int(nh), int(nkv), float(scale));
      if (err != 0) return err;
      return launch_tiled(k_attention_backward_dkv_tiled<HD>, tiles * b * nkv, kBwdThreads,
                          dkv_smem<HD>(), stream, qkv, o, dout, lse, dqkv, int(b), int(t), int(nh),
                          int(nkv), float(scale));
    });
  const i64 per_block = kThreads / 32;
  const i64 qrows = b * nh * t, krows = b * nkv * t;
  k_attention_backward_dq<<<unsigned((qrows + per_block - 1) / per_block), kThreads, 0,
                            cs(stream)>>>(qkv, o, dout, lse, dqkv, b, t, nh, nkv, hd, float(scale),
                                          bf16);
  if (const cudaError_t err = cudaGetLastError(); err != cudaSuccess) return static_cast<int>(err);
  k_attention_backward_dkv<<<unsigned((krows + per_block - 1) / per_block), kThreads, 0,
                             cs(stream)>>>(qkv, o, dout, lse, dqkv, b, t, nh, nkv, hd, float(scale),
                                           bf16);
  return launched();
}
int swiglu_forward(const float* gu, float* out, i64 n, i64 inter, void* stream) {
  k_swiglu_forward<<<blocks_for(n * inter), kThreads, 0, cs(stream)>>>(gu, out, n, inter);
  return launched();
}
int swiglu_backward(const float* dout, const float* gu, float* dgu, i64 n, i64 inter,
                    void* stream) {
  k_swiglu_backward<<<blocks_for(n * inter), kThreads, 0, cs(stream)>>>(dout, gu, dgu, n, inter);
  return launched();
}
int gelu_forward(const float* x, float* out, i64 n, void* stream) {
  k_gelu_forward<<<blocks_for(n), kThreads, 0, cs(stream)>>>(x, out, n);
  return launched();
}
int gelu_backward(const float* dout, const float* x, float* dx, i64 n, void* stream) {
  k_gelu_backward<<<blocks_for(n), kThreads, 0, cs(stream)>>>(dout, x, dx, n);
  return launched();
}
int bias_add(float* y, const void* b, bool wbf16, i64 n, i64 m, void* stream) {
  k_bias_add<<<blocks_for(n * m), kThreads, 0, cs(stream)>>>(y, b, wbf16, n, m);
  return launched();
}
int bias_backward(const float* dy, float* db, i64 n, i64 m, void* stream) {
  if (variant() == KernelVariant::kTiled)
    k_bias_backward_tiled<<<col_grid(m), col_block(), 0, cs(stream)>>>(dy, db, n, m);
  else
    k_bias_backward<<<blocks_for(m), kThreads, 0, cs(stream)>>>(dy, db, n, m);
  return launched();
}
int attention_cached(const float* qkv, float* k_cache, float* v_cache, float* o, i64 n, i64 p0,
                     i64 nh, i64 nkv, i64 hd, double scale, bool bf16, void* stream) {
  k_kv_append<<<blocks_for(n * nkv * hd), kThreads, 0, cs(stream)>>>(qkv, k_cache, v_cache, n, p0,
                                                                     nh, nkv, hd);
  if (const cudaError_t err = cudaGetLastError(); err != cudaSuccess) return static_cast<int>(err);
  const i64 rows = n * nh, per_block = kThreads / 32;
  k_attention_cached<<<unsigned((rows + per_block - 1) / per_block), kThreads, 0, cs(stream)>>>(
      qkv, k_cache, v_cache, o, n, p0, nh, nkv, hd, float(scale), bf16);
  return launched();
}
int cross_entropy(float* logits, const std::int32_t* targets, float* losses, i64 rows, i64 vocab,
                  double grad_scale, void* stream) {
  if (rows == 0) return 0;  // (a grid of 0 blocks is a launch error; the CPU does nothing)
  k_cross_entropy<<<unsigned(rows), kThreads, 0, cs(stream)>>>(logits, targets, losses, vocab,
                                                               float(grad_scale));
  return launched();
}

int cross_entropy_stats(const float* logits, const std::int32_t* targets, float* stats, i64 rows,
                        i64 vocab, void* stream) {
  if (rows == 0) return 0;  // (a grid of 0 blocks is a launch error; the CPU does nothing)
  k_cross_entropy_stats<<<unsigned(rows), kThreads, 0, cs(stream)>>>(logits, targets, stats, vocab);
  return launched();
}
int cross_entropy_finish(float* logits, const std::int32_t* targets, const float* all, i64 parts,
                         float* losses, i64 rows, i64 vocab, double grad_scale, void* stream) {
  if (rows == 0) return 0;  // (a grid of 0 blocks is a launch error; the CPU does nothing)
  k_cross_entropy_finish<<<unsigned(rows), kThreads, 0, cs(stream)>>>(
      logits, targets, all, parts, losses, rows, vocab, float(grad_scale));
  return launched();
}

}  // namespace strata::gpu::model
