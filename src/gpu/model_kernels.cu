// CUDA kernels of the transformer: the twins of src/cpu/model_kernels.cpp (same layouts,
// same accumulate rules). First versions, written for correctness and determinism:
//  - row ops (norms, cross-entropy) use one block per row with a fixed-shape tree reduction;
//  - weight-gradient reductions over rows (norm weights, biases, embeddings) give each
//    column to one thread that walks the rows in order: no atomics, bit-reproducible;
//  - attention is one warp per query row (forward, dq) or per key row (dk, dv), the head
//    dimension spread over the lanes, online softmax in registers; nothing of size T^2. With
//    bf16 it rounds what the CPU's tiled attention rounds (cpu/model_attention.cpp): q, k, v and
//    dO as products read them, the probabilities P = softmax(S) (normalised: the forward takes a
//    second pass over the keys once it knows the row's max and sum) and dS; the sums, the
//    softmax itself, the logsumexp and the outputs stay fp32.
// Faster tiled versions (shared-memory K/V tiles, tensor cores) can replace them behind the
// same launchers.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "gpu/model_kernels.h"

namespace strata::gpu::model {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxHdPerLane = 16;  // head_dim <= 512

__device__ __forceinline__ float ld(const void* p, bool bf16, i64 i) {
  return bf16 ? __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]) : static_cast<const float*>(p)[i];
}

// x as a bf16 GEMM operand sees it: rounded to bf16 (to nearest even) when `on`.
__device__ __forceinline__ float rb(float x, bool on) { return on ? __bfloat162float(__float2bfloat16_rn(x)) : x; }

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

__global__ void k_embedding_forward(const std::int32_t* tok, const void* wte, const void* wpe, bool bf16, float* out,
                                    i64 n, i64 t, i64 c) {
  const i64 i = blockIdx.x * i64(blockDim.x) + threadIdx.x;
  if (i >= n * c) return;
  const i64 r = i / c, j = i % c;
  float v = ld(wte, bf16, i64(tok[r]) * c + j);
  if (wpe) v += ld(wpe, bf16, (r % t) * c + j);
  out[i] = v;
}

__global__ void k_embedding_backward(const std::int32_t* tok, const float* dout, float* dwte, float* dwpe, i64 n,
                                     i64 t, i64 c) {
  const i64 j = blockIdx.x * i64(blockDim.x) + threadIdx.x;
  if (j >= c) return;
  for (i64 r = 0; r < n; ++r) {
    const float g = dout[r * c + j];
    dwte[i64(tok[r]) * c + j] += g;
    if (dwpe) dwpe[(r % t) * c + j] += g;
  }
}

__global__ void k_rmsnorm_forward(const float* x, const void* w, bool bf16, float* out, float* rstd, i64 c,
                                  float eps) {
  const float* xr = x + blockIdx.x * c;
  float ss = 0;
  for (i64 i = threadIdx.x; i < c; i += blockDim.x) ss += xr[i] * xr[i];
  const float rs = rsqrtf(block_sum(ss) / float(c) + eps);
  if (threadIdx.x == 0) rstd[blockIdx.x] = rs;
  for (i64 i = threadIdx.x; i < c; i += blockDim.x) out[blockIdx.x * c + i] = xr[i] * rs * ld(w, bf16, i);
}

__global__ void k_rmsnorm_backward_dx(const float* dout, const float* x, const void* w, bool bf16, const float* rstd,
                                      float* dx, i64 c) {
  const i64 r = blockIdx.x;
  const float rs = rstd[r];
  float m = 0;
  for (i64 i = threadIdx.x; i < c; i += blockDim.x) m += dout[r * c + i] * ld(w, bf16, i) * x[r * c + i] * rs;
  m = block_sum(m) / float(c);
  for (i64 i = threadIdx.x; i < c; i += blockDim.x)
    dx[r * c + i] += rs * (dout[r * c + i] * ld(w, bf16, i) - x[r * c + i] * rs * m);
}

__global__ void k_rmsnorm_backward_dw(const float* dout, const float* x, const float* rstd, float* dw, i64 n, i64 c) {
  const i64 j = blockIdx.x * i64(blockDim.x) + threadIdx.x;
  if (j >= c) return;
  float s = 0;
  for (i64 r = 0; r < n; ++r) s += dout[r * c + j] * x[r * c + j] * rstd[r];
  dw[j] += s;
}

__global__ void k_layernorm_forward(const float* x, const void* w, const void* b, bool bf16, float* out, float* mean,
                                    float* rstd, i64 c, float eps) {
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

__global__ void k_layernorm_backward_dwb(const float* dout, const float* x, const float* mean, const float* rstd,
                                         float* dw, float* db, i64 n, i64 c) {
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

__global__ void k_rope(float* x, i64 n, i64 t, i64 stride, i64 col, i64 heads, i64 hd, const float* cosv,
                       const float* sinv, bool inverse) {
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

// One warp per query row (b, h, t).
__global__ void k_attention_forward(const float* qkv, float* o, float* lse, i64 b, i64 t, i64 nh, i64 nkv, i64 hd,
                                    float scale, bool bf16) {
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
    const float* kp = qkv + (bi * t + s) * stride + (nh + kvh) * hd;
    float part = 0;
    for (int j = 0; j < per; ++j) {
      const i64 d = lane + 32 * j;
      if (d < hd) part += q[j] * rb(kp[d], bf16);
    }
    return warp_sum(part) * scale;
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

// dq: one warp per query row.
__global__ void k_attention_backward_dq(const float* qkv, const float* o, const float* dout, const float* lse,
                                        float* dqkv, i64 b, i64 t, i64 nh, i64 nkv, i64 hd, float scale, bool bf16) {
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
__global__ void k_attention_backward_dkv(const float* qkv, const float* o, const float* dout, const float* lse,
                                         float* dqkv, i64 b, i64 t, i64 nh, i64 nkv, i64 hd, float scale, bool bf16) {
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

__global__ void k_swiglu_backward(const float* dout, const float* gu, float* dgu, i64 n, i64 inter) {
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
  dx[i] = dout[i] * (0.5f * (1.0f + th) + 0.5f * v * (1.0f - th * th) * kGeluK * (1.0f + 3.0f * 0.044715f * v * v));
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

__global__ void k_cross_entropy(float* logits, const std::int32_t* targets, float* losses, i64 vocab,
                                float grad_scale) {
  float* l = logits + blockIdx.x * vocab;
  float mx = -INFINITY;
  for (i64 i = threadIdx.x; i < vocab; i += blockDim.x) mx = fmaxf(mx, l[i]);
  mx = block_max(mx);
  float s = 0;
  for (i64 i = threadIdx.x; i < vocab; i += blockDim.x) s += expf(l[i] - mx);
  const float lse = mx + logf(block_sum(s));
  const i64 tgt = targets[blockIdx.x];
  if (threadIdx.x == 0) losses[blockIdx.x] = lse - l[tgt];
  __syncthreads();  // l[tgt] is read above before anyone overwrites it
  if (grad_scale != 0.0f) {
    for (i64 i = threadIdx.x; i < vocab; i += blockDim.x)
      l[i] = expf(l[i] - lse) * grad_scale - (i == tgt ? grad_scale : 0.0f);
  }
}

}  // namespace

const char* error_text(int err) { return cudaGetErrorString(static_cast<cudaError_t>(err)); }

int preload_kernels() {
  cudaError_t first = cudaSuccess;
  auto load = [&](const void* kernel) {
    cudaFuncAttributes attr;
    const cudaError_t err = cudaFuncGetAttributes(&attr, kernel);
    if (first == cudaSuccess) first = err;
  };
  for (const void* k :
       {(const void*)k_embedding_forward, (const void*)k_embedding_backward, (const void*)k_rmsnorm_forward,
        (const void*)k_rmsnorm_backward_dx, (const void*)k_rmsnorm_backward_dw, (const void*)k_layernorm_forward,
        (const void*)k_layernorm_backward_dx, (const void*)k_layernorm_backward_dwb, (const void*)k_rope,
        (const void*)k_attention_forward, (const void*)k_attention_backward_dq, (const void*)k_attention_backward_dkv,
        (const void*)k_swiglu_forward, (const void*)k_swiglu_backward, (const void*)k_gelu_forward,
        (const void*)k_gelu_backward, (const void*)k_bias_add, (const void*)k_bias_backward,
        (const void*)k_cross_entropy})
    load(k);
  return static_cast<int>(first);
}

int embedding_forward(const std::int32_t* tokens, const void* wte, const void* wpe, bool wbf16, float* out, i64 n,
                      i64 t, i64 c, void* stream) {
  k_embedding_forward<<<blocks_for(n * c), kThreads, 0, cs(stream)>>>(tokens, wte, wpe, wbf16, out, n, t, c);
  return launched();
}
int embedding_backward(const std::int32_t* tokens, const float* dout, float* dwte, float* dwpe, i64 n, i64 t, i64 c,
                       void* stream) {
  k_embedding_backward<<<blocks_for(c), kThreads, 0, cs(stream)>>>(tokens, dout, dwte, dwpe, n, t, c);
  return launched();
}
int rmsnorm_forward(const float* x, const void* w, bool wbf16, float* out, float* rstd, i64 n, i64 c, double eps,
                    void* stream) {
  k_rmsnorm_forward<<<unsigned(n), kThreads, 0, cs(stream)>>>(x, w, wbf16, out, rstd, c, float(eps));
  return launched();
}
int rmsnorm_backward(const float* dout, const float* x, const void* w, bool wbf16, const float* rstd, float* dx,
                     float* dw, i64 n, i64 c, void* stream) {
  k_rmsnorm_backward_dx<<<unsigned(n), kThreads, 0, cs(stream)>>>(dout, x, w, wbf16, rstd, dx, c);
  k_rmsnorm_backward_dw<<<blocks_for(c), kThreads, 0, cs(stream)>>>(dout, x, rstd, dw, n, c);
  return launched();
}
int layernorm_forward(const float* x, const void* w, const void* b, bool wbf16, float* out, float* mean, float* rstd,
                      i64 n, i64 c, double eps, void* stream) {
  k_layernorm_forward<<<unsigned(n), kThreads, 0, cs(stream)>>>(x, w, b, wbf16, out, mean, rstd, c, float(eps));
  return launched();
}
int layernorm_backward(const float* dout, const float* x, const void* w, bool wbf16, const float* mean,
                       const float* rstd, float* dx, float* dw, float* db, i64 n, i64 c, void* stream) {
  k_layernorm_backward_dx<<<unsigned(n), kThreads, 0, cs(stream)>>>(dout, x, w, wbf16, mean, rstd, dx, c);
  k_layernorm_backward_dwb<<<blocks_for(c), kThreads, 0, cs(stream)>>>(dout, x, mean, rstd, dw, db, n, c);
  return launched();
}
int rope(float* x, i64 n, i64 t, i64 stride, i64 col, i64 heads, i64 hd, const float* cos, const float* sin,
         bool inverse, void* stream) {
  k_rope<<<blocks_for(n * heads * (hd / 2)), kThreads, 0, cs(stream)>>>(x, n, t, stride, col, heads, hd, cos, sin,
                                                                       inverse);
  return launched();
}
int attention_forward(const float* qkv, float* o, float* lse, i64 b, i64 t, i64 nh, i64 nkv, i64 hd, double scale,
                      bool bf16, void* stream) {
  const i64 rows = b * nh * t, per_block = kThreads / 32;
  k_attention_forward<<<unsigned((rows + per_block - 1) / per_block), kThreads, 0, cs(stream)>>>(
      qkv, o, lse, b, t, nh, nkv, hd, float(scale), bf16);
  return launched();
}
int attention_backward(const float* qkv, const float* o, const float* dout, const float* lse, float* dqkv, i64 b,
                       i64 t, i64 nh, i64 nkv, i64 hd, double scale, bool bf16, void* stream) {
  const i64 per_block = kThreads / 32;
  const i64 qrows = b * nh * t, krows = b * nkv * t;
  k_attention_backward_dq<<<unsigned((qrows + per_block - 1) / per_block), kThreads, 0, cs(stream)>>>(
      qkv, o, dout, lse, dqkv, b, t, nh, nkv, hd, float(scale), bf16);
  if (const cudaError_t err = cudaGetLastError(); err != cudaSuccess) return static_cast<int>(err);
  k_attention_backward_dkv<<<unsigned((krows + per_block - 1) / per_block), kThreads, 0, cs(stream)>>>(
      qkv, o, dout, lse, dqkv, b, t, nh, nkv, hd, float(scale), bf16);
  return launched();
}
int swiglu_forward(const float* gu, float* out, i64 n, i64 inter, void* stream) {
  k_swiglu_forward<<<blocks_for(n * inter), kThreads, 0, cs(stream)>>>(gu, out, n, inter);
  return launched();
}
int swiglu_backward(const float* dout, const float* gu, float* dgu, i64 n, i64 inter, void* stream) {
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
  k_bias_backward<<<blocks_for(m), kThreads, 0, cs(stream)>>>(dy, db, n, m);
  return launched();
}
int cross_entropy(float* logits, const std::int32_t* targets, float* losses, i64 rows, i64 vocab, double grad_scale,
                  void* stream) {
  k_cross_entropy<<<unsigned(rows), kThreads, 0, cs(stream)>>>(logits, targets, losses, vocab, float(grad_scale));
  return launched();
}

}  // namespace strata::gpu::model
