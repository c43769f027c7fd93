// CPU transformer kernels. Row-parallel work goes to OpenMP (oneDNN's runtime); anything that sums
// over rows into a weight gradient is a serial loop over rows (vectorised along the row) so the
// order of additions, and hence the bits, never depend on scheduling. Instantiated for float (the
// model) and double (the finite-difference tests).
#include "cpu/model_kernels.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu/model_simd.h"
#include "cpu/parallel_rows.h"
#include "strata/adamw.h"
#include "strata/error.h"

namespace strata::cpu {

namespace simd {
namespace {

struct Choice {
  const Kernels* k = nullptr;
  Isa isa = Isa::kScalar;
};

Choice choose(Isa want) {
  if (want == Isa::kAuto) want = isa_from_env("STRATA_MODEL_ISA");
  if (want == Isa::kAuto)
    want = isa_supported(Isa::kAvx512) ? Isa::kAvx512
           : isa_supported(Isa::kAvx2) ? Isa::kAvx2
                                       : Isa::kScalar;
  STRATA_REQUIRE(isa_supported(want), "set_model_isa({}): {}", isa_name(want),
                 isa_unavailable(want));
  switch (want) {
    case Isa::kAvx512:
      return {&avx512_kernels(), want};
    case Isa::kAvx2:
      return {&avx2_kernels(), want};
    default:
      return {nullptr, Isa::kScalar};
  }
}

Choice& chosen() {
  static Choice c = choose(Isa::kAuto);
  return c;
}

}  // namespace

const Kernels* kernels() { return chosen().k; }
Isa model_isa() { return chosen().isa; }
void set_model_isa(Isa isa) { chosen() = choose(isa); }

}  // namespace simd

namespace {

template <class W>
constexpr bool is_bf16 = std::is_same_v<W, bf16_t>;

// Stores v as O: T itself, or rounded to bf16.
template <class O, class T>
inline void put(O* p, i64 i, T v) {
  if constexpr (is_bf16<O>)
    p[i].bits = f32_to_bf16(static_cast<float>(v));
  else
    p[i] = v;
}

// Eight independent partial sums: without -ffast-math a single running sum cannot be
// vectorised (it would reorder additions); this fixed order can, and is deterministic.
template <class T>
T dot(const T* a, const T* b, i64 n) {
  T acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  i64 i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) acc[j] += a[i + j] * b[i + j];
  T s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

}  // namespace

template <class T, class W>
void embedding_forward(const std::int32_t* tokens, const W* wte, const W* wpe, T* out, i64 n, i64 t,
                       i64 c) {
  parallel_rows(n, c, [&](i64 r) {
    T* o = out + r * c;
    if (tokens[r] < 0) {  // another tensor-parallel rank's vocabulary row: zero (plus position)
      for (i64 i = 0; i < c; ++i) o[i] = wpe ? T(to_float(wpe[(r % t) * c + i])) : T(0);
      return;
    }
    const W* e = wte + i64(tokens[r]) * c;
    if (wpe) {
      const W* p = wpe + (r % t) * c;
      for (i64 i = 0; i < c; ++i) o[i] = T(to_float(e[i])) + T(to_float(p[i]));
    } else {
      for (i64 i = 0; i < c; ++i) o[i] = T(to_float(e[i]));
    }
  });
}

template <class T>
void embedding_backward(const std::int32_t* tokens, const T* dout, T* dwte, T* dwpe, i64 n, i64 t,
                        i64 c) {
  for (i64 r = 0; r < n; ++r) {
    const T* g = dout + r * c;
    if (tokens[r] >= 0) {  // not another tensor-parallel rank's row
      T* e = dwte + i64(tokens[r]) * c;
      for (i64 i = 0; i < c; ++i) e[i] += g[i];
    }
    if (dwpe) {
      T* p = dwpe + (r % t) * c;
      for (i64 i = 0; i < c; ++i) p[i] += g[i];
    }
  }
}

template <class T, class W, class O>
void rmsnorm_forward(const T* x, const W* w, O* out, T* rstd, i64 n, i64 c, double eps) {
  if constexpr (std::is_same_v<T, float>) {
    if (const simd::Kernels* k = simd::kernels()) {
      parallel_rows(n, c, [&](i64 r) {
        rstd[r] = k->rms_fwd(x + r * c, w, is_bf16<W>, out + r * c, is_bf16<O>, c,
                             static_cast<float>(eps));
      });
      return;
    }
  }
  parallel_rows(n, c, [&](i64 r) {
    const T* xr = x + r * c;
    T ss = 0;
    for (i64 i = 0; i < c; ++i) ss += xr[i] * xr[i];
    const T rs = T(1) / std::sqrt(ss / T(c) + T(eps));
    rstd[r] = rs;
    O* o = out + r * c;
    for (i64 i = 0; i < c; ++i) put(o, i, xr[i] * rs * T(to_float(w[i])));
  });
}

template <class T, class W>
void rmsnorm_backward(const T* dout, const T* x, const W* w, const T* rstd, T* dx, T* dw, i64 n,
                      i64 c, bf16_t* dx_bf16) {
  if constexpr (std::is_same_v<T, float>) {
    if (const simd::Kernels* k = simd::kernels()) {
      parallel_rows(n, 3 * c, [&](i64 r) {
        k->rms_bwd(dout + r * c, x + r * c, w, is_bf16<W>, rstd[r], dx + r * c,
                   dx_bf16 ? &dx_bf16[r * c].bits : nullptr, c);
      });
      for (i64 r = 0; r < n; ++r) k->mul_acc(dout + r * c, x + r * c, rstd[r], dw, c);
      return;
    }
  }
  parallel_rows(n, 3 * c, [&](i64 r) {
    const T* g = dout + r * c;
    const T* xr = x + r * c;
    const T rs = rstd[r];
    T m = 0;  // mean(dxhat * xhat)
    for (i64 i = 0; i < c; ++i) m += g[i] * T(to_float(w[i])) * xr[i] * rs;
    m /= T(c);
    T* d = dx + r * c;
    for (i64 i = 0; i < c; ++i) {
      d[i] += rs * (g[i] * T(to_float(w[i])) - xr[i] * rs * m);
      if (dx_bf16) dx_bf16[r * c + i].bits = f32_to_bf16(static_cast<float>(d[i]));
    }
  });
  for (i64 r = 0; r < n; ++r) {
    const T* g = dout + r * c;
    const T* xr = x + r * c;
    const T rs = rstd[r];
    for (i64 i = 0; i < c; ++i) dw[i] += g[i] * xr[i] * rs;
  }
}

template <class T, class W, class O>
void layernorm_forward(const T* x, const W* w, const W* b, O* out, T* mean, T* rstd, i64 n, i64 c,
                       double eps) {
  if constexpr (std::is_same_v<T, float>) {
    if (const simd::Kernels* k = simd::kernels()) {
      parallel_rows(n, 3 * c, [&](i64 r) {
        rstd[r] = k->ln_fwd(x + r * c, w, b, is_bf16<W>, out + r * c, is_bf16<O>, c,
                            static_cast<float>(eps), mean + r);
      });
      return;
    }
  }
  parallel_rows(n, 3 * c, [&](i64 r) {
    const T* xr = x + r * c;
    T mu = 0;
    for (i64 i = 0; i < c; ++i) mu += xr[i];
    mu /= T(c);
    T var = 0;
    for (i64 i = 0; i < c; ++i) var += (xr[i] - mu) * (xr[i] - mu);
    var /= T(c);
    const T rs = T(1) / std::sqrt(var + T(eps));
    mean[r] = mu;
    rstd[r] = rs;
    O* o = out + r * c;
    for (i64 i = 0; i < c; ++i)
      put(o, i, (xr[i] - mu) * rs * T(to_float(w[i])) + T(to_float(b[i])));
  });
}

template <class T, class W>
void layernorm_backward(const T* dout, const T* x, const W* w, const T* mean, const T* rstd, T* dx,
                        T* dw, T* db, i64 n, i64 c) {
  if constexpr (std::is_same_v<T, float>) {
    if (const simd::Kernels* k = simd::kernels()) {
      parallel_rows(n, 4 * c, [&](i64 r) {
        k->ln_bwd(dout + r * c, x + r * c, w, is_bf16<W>, mean[r], rstd[r], dx + r * c, c);
      });
      for (i64 r = 0; r < n; ++r) k->ln_acc(dout + r * c, x + r * c, mean[r], rstd[r], dw, db, c);
      return;
    }
  }
  parallel_rows(n, 4 * c, [&](i64 r) {
    const T* g = dout + r * c;
    const T* xr = x + r * c;
    const T mu = mean[r], rs = rstd[r];
    T m1 = 0, m2 = 0;  // mean(dxhat), mean(dxhat * xhat)
    for (i64 i = 0; i < c; ++i) {
      const T dxh = g[i] * T(to_float(w[i]));
      m1 += dxh;
      m2 += dxh * (xr[i] - mu) * rs;
    }
    m1 /= T(c);
    m2 /= T(c);
    T* d = dx + r * c;
    for (i64 i = 0; i < c; ++i)
      d[i] += rs * (g[i] * T(to_float(w[i])) - m1 - (xr[i] - mu) * rs * m2);
  });
  for (i64 r = 0; r < n; ++r) {
    const T* g = dout + r * c;
    const T* xr = x + r * c;
    const T mu = mean[r], rs = rstd[r];
    for (i64 i = 0; i < c; ++i) {
      dw[i] += g[i] * (xr[i] - mu) * rs;
      db[i] += g[i];
    }
  }
}

template <class T>
void rope_apply(T* x, i64 n, i64 t, i64 stride, i64 col, i64 heads, i64 hd, const T* cos,
                const T* sin, bool inverse) {
  const i64 half = hd / 2;
  const T sgn = inverse ? T(-1) : T(1);
  if constexpr (std::is_same_v<T, float>) {
    if (const simd::Kernels* k = simd::kernels()) {
      parallel_rows(n, heads * hd, [&](i64 r) {
        for (i64 h = 0; h < heads; ++h)
          k->rope_head(x + r * stride + col + h * hd, cos + (r % t) * half, sin + (r % t) * half,
                       half, sgn);
      });
      return;
    }
  }
  parallel_rows(n, heads * hd, [&](i64 r) {
    const T* cr = cos + (r % t) * half;
    const T* sr = sin + (r % t) * half;
    for (i64 h = 0; h < heads; ++h) {
      T* v = x + r * stride + col + h * hd;
      for (i64 i = 0; i < half; ++i) {
        const T a = v[i], b = v[i + half];
        const T s = sgn * sr[i];
        v[i] = a * cr[i] - b * s;
        v[i + half] = b * cr[i] + a * s;
      }
    }
  });
}

template <class T>
void attention_forward(const T* qkv, T* o, T* lse, i64 b, i64 t, i64 nh, i64 nkv, i64 hd,
                       double scale) {
  const i64 stride = (nh + 2 * nkv) * hd;
  const i64 group = nh / nkv;
  constexpr i64 kBlock = 64;
  parallel_rows(b * nh * t, (hd * t) / 2 + 1, [&](i64 idx) {
    const i64 qi = idx % t;
    const i64 h = (idx / t) % nh;
    const i64 bi = idx / (t * nh);
    const i64 kvh = h / group;
    const T* q = qkv + (bi * t + qi) * stride + h * hd;
    T acc[512];
    T s[kBlock];
    for (i64 i = 0; i < hd; ++i) acc[i] = 0;
    T m = -std::numeric_limits<T>::infinity(), l = 0;
    for (i64 k0 = 0; k0 <= qi; k0 += kBlock) {
      const i64 kn = std::min(kBlock, qi + 1 - k0);
      T bm = m;
      for (i64 j = 0; j < kn; ++j) {
        const T* k = qkv + (bi * t + k0 + j) * stride + (nh + kvh) * hd;
        s[j] = dot(q, k, hd) * T(scale);
        bm = std::max(bm, s[j]);
      }
      const T corr = std::exp(m - bm);  // 0 on the first block (m = -inf)
      l *= corr;
      for (i64 i = 0; i < hd; ++i) acc[i] *= corr;
      for (i64 j = 0; j < kn; ++j) {
        const T p = std::exp(s[j] - bm);
        l += p;
        const T* v = qkv + (bi * t + k0 + j) * stride + (nh + nkv + kvh) * hd;
        for (i64 i = 0; i < hd; ++i) acc[i] += p * v[i];
      }
      m = bm;
    }
    T* out = o + (bi * t + qi) * nh * hd + h * hd;
    for (i64 i = 0; i < hd; ++i) out[i] = acc[i] / l;
    lse[(bi * nh + h) * t + qi] = m + std::log(l);
  });
}

void attention_cached(const float* qkv, float* k_cache, float* v_cache, float* o, bf16_t* o_bf16,
                      i64 n, i64 p0, i64 nh, i64 nkv, i64 hd, double scale, bool bf16_gemm) {
  const i64 stride = (nh + 2 * nkv) * hd, kvd = nkv * hd, group = nh / nkv;
  for (i64 r = 0; r < n; ++r) {
    std::memcpy(k_cache + (p0 + r) * kvd, qkv + r * stride + nh * hd, std::size_t(kvd) * 4);
    std::memcpy(v_cache + (p0 + r) * kvd, qkv + r * stride + (nh + nkv) * hd, std::size_t(kvd) * 4);
  }
  auto rd = [bf16_gemm](float x) { return bf16_gemm ? bf16_to_f32(f32_to_bf16(x)) : x; };
  parallel_rows(n * nh, (p0 + n) * hd * 2, [&](i64 idx) {
    const i64 r = idx / nh, h = idx % nh, kvh = h / group, keys = p0 + r + 1;
    float q[512], acc[512];
    for (i64 i = 0; i < hd; ++i) {
      q[i] = rd(qkv[r * stride + h * hd + i]);
      acc[i] = 0;
    }
    std::vector<float> p(static_cast<std::size_t>(keys));
    float mx = -std::numeric_limits<float>::infinity();
    for (i64 j = 0; j < keys; ++j) {
      const float* k = k_cache + j * kvd + kvh * hd;
      float sc = 0;
      for (i64 i = 0; i < hd; ++i) sc += q[i] * rd(k[i]);
      p[j] = sc * float(scale);
      mx = std::max(mx, p[j]);
    }
    float sum = 0;
    for (i64 j = 0; j < keys; ++j) {
      p[j] = std::exp(p[j] - mx);
      sum += p[j];
    }
    const float inv = 1.0f / sum;
    for (i64 j = 0; j < keys; ++j) {
      const float pj = rd(p[j] * inv);
      const float* v = v_cache + j * kvd + kvh * hd;
      for (i64 i = 0; i < hd; ++i) acc[i] += pj * rd(v[i]);
    }
    float* out = o + r * nh * hd + h * hd;
    for (i64 i = 0; i < hd; ++i) out[i] = acc[i];
    if (o_bf16)
      for (i64 i = 0; i < hd; ++i) o_bf16[r * nh * hd + h * hd + i].bits = f32_to_bf16(acc[i]);
  });
}

template <class T>
void attention_backward(const T* qkv, const T* o, const T* dout, const T* lse, T* dqkv, i64 b,
                        i64 t, i64 nh, i64 nkv, i64 hd, double scale) {
  const i64 stride = (nh + 2 * nkv) * hd;
  const i64 group = nh / nkv;
  // One task per (batch, kv head): it owns dk/dv of that kv head and dq of its query heads.
  parallel_rows(b * nkv, hd * t * t * group + 1, [&](i64 idx) {
    const i64 kvh = idx % nkv;
    const i64 bi = idx / nkv;
    for (i64 s = 0; s < t; ++s) {
      T* row = dqkv + (bi * t + s) * stride;
      for (i64 h = kvh * group; h < (kvh + 1) * group; ++h)
        for (i64 i = 0; i < hd; ++i) row[h * hd + i] = 0;
      for (i64 i = 0; i < hd; ++i) {
        row[(nh + kvh) * hd + i] = 0;
        row[(nh + nkv + kvh) * hd + i] = 0;
      }
    }
    for (i64 h = kvh * group; h < (kvh + 1) * group; ++h) {
      for (i64 qi = 0; qi < t; ++qi) {
        const T* q = qkv + (bi * t + qi) * stride + h * hd;
        const T* orow = o + (bi * t + qi) * nh * hd + h * hd;
        const T* g = dout + (bi * t + qi) * nh * hd + h * hd;
        const T L = lse[(bi * nh + h) * t + qi];
        const T dsum = dot(g, orow, hd);
        T* dq = dqkv + (bi * t + qi) * stride + h * hd;
        for (i64 s = 0; s <= qi; ++s) {
          const T* k = qkv + (bi * t + s) * stride + (nh + kvh) * hd;
          const T* v = qkv + (bi * t + s) * stride + (nh + nkv + kvh) * hd;
          const T p = std::exp(dot(q, k, hd) * T(scale) - L);
          const T ds = p * (dot(g, v, hd) - dsum) * T(scale);
          T* dk = dqkv + (bi * t + s) * stride + (nh + kvh) * hd;
          T* dv = dqkv + (bi * t + s) * stride + (nh + nkv + kvh) * hd;
          for (i64 i = 0; i < hd; ++i) {
            dq[i] += ds * k[i];
            dk[i] += ds * q[i];
            dv[i] += p * g[i];
          }
        }
      }
    }
  });
}

template <class T, class O>
void swiglu_forward(const T* gu, O* out, i64 n, i64 inter) {
  if constexpr (std::is_same_v<T, float>) {
    if (const simd::Kernels* k = simd::kernels()) {
      parallel_rows(n, inter, [&](i64 r) {
        k->swiglu_fwd(gu + r * 2 * inter, gu + r * 2 * inter + inter, out + r * inter, is_bf16<O>,
                      inter);
      });
      return;
    }
  }
  parallel_rows(n, inter, [&](i64 r) {
    const T* g = gu + r * 2 * inter;
    const T* u = g + inter;
    O* o = out + r * inter;
    for (i64 i = 0; i < inter; ++i) put(o, i, g[i] / (T(1) + std::exp(-g[i])) * u[i]);
  });
}

template <class T, class O>
void swiglu_backward(const T* dout, const T* gu, O* dgu, i64 n, i64 inter) {
  if constexpr (std::is_same_v<T, float>) {
    if (const simd::Kernels* k = simd::kernels()) {
      parallel_rows(n, inter, [&](i64 r) {
        const T* g = gu + r * 2 * inter;
        O* dg = dgu + r * 2 * inter;
        k->swiglu_bwd(dout + r * inter, g, g + inter, dg, dg + inter, is_bf16<O>, inter);
      });
      return;
    }
  }
  parallel_rows(n, inter, [&](i64 r) {
    const T* g = gu + r * 2 * inter;
    const T* u = g + inter;
    const T* d = dout + r * inter;
    O* dg = dgu + r * 2 * inter;
    O* du = dg + inter;
    for (i64 i = 0; i < inter; ++i) {
      const T sig = T(1) / (T(1) + std::exp(-g[i]));
      put(du, i, d[i] * g[i] * sig);
      put(dg, i, d[i] * u[i] * sig * (T(1) + g[i] * (T(1) - sig)));
    }
  });
}

namespace {
constexpr double kGeluK = 0.7978845608028654;  // sqrt(2 / pi)
}

template <class T, class O>
void gelu_forward(const T* x, O* out, i64 n) {
  if constexpr (std::is_same_v<T, float>) {
    if (const simd::Kernels* k = simd::kernels()) {
      parallel_rows((n + 4095) / 4096, 4096, [&](i64 blk) {
        k->gelu_fwd(x + blk * 4096, out + blk * 4096, is_bf16<O>,
                    std::min<i64>(4096, n - blk * 4096));
      });
      return;
    }
  }
  parallel_rows((n + 4095) / 4096, 4096, [&](i64 blk) {
    for (i64 i = blk * 4096; i < std::min(n, (blk + 1) * 4096); ++i) {
      const T v = x[i];
      put(out, i, T(0.5) * v * (T(1) + std::tanh(T(kGeluK) * (v + T(0.044715) * v * v * v))));
    }
  });
}

template <class T>
void gelu_backward(const T* dout, const T* x, T* dx, i64 n) {
  if constexpr (std::is_same_v<T, float>) {
    if (const simd::Kernels* k = simd::kernels()) {
      parallel_rows((n + 4095) / 4096, 4096, [&](i64 blk) {
        k->gelu_bwd(dout + blk * 4096, x + blk * 4096, dx + blk * 4096,
                    std::min<i64>(4096, n - blk * 4096));
      });
      return;
    }
  }
  parallel_rows((n + 4095) / 4096, 4096, [&](i64 blk) {
    for (i64 i = blk * 4096; i < std::min(n, (blk + 1) * 4096); ++i) {
      const T v = x[i];
      const T th = std::tanh(T(kGeluK) * (v + T(0.044715) * v * v * v));
      const T d = T(0.5) * (T(1) + th) +
                  T(0.5) * v * (T(1) - th * th) * T(kGeluK) * (T(1) + T(3 * 0.044715) * v * v);
      dx[i] = dout[i] * d;
    }
  });
}

template <class T, class W>
void bias_add(T* y, const W* b, i64 n, i64 m) {
  parallel_rows(n, m, [&](i64 r) {
    T* row = y + r * m;
    for (i64 i = 0; i < m; ++i) row[i] += T(to_float(b[i]));
  });
}

template <class T>
void bias_backward(const T* dy, T* db, i64 n, i64 m) {
  for (i64 r = 0; r < n; ++r)
    for (i64 i = 0; i < m; ++i) db[i] += dy[r * m + i];
}

namespace {

// A row whose target is kIgnoreTarget: no loss, and a zero gradient row.
template <class T, class O>
void ignored_row(T* logits, T* losses, i64 r, i64 vocab, double grad_scale, O* grad) {
  losses[r] = T(0);
  if (grad_scale == 0) return;
  if (grad) {
    O* g = grad + r * vocab;
    for (i64 i = 0; i < vocab; ++i) put(g, i, T(0));
  } else {
    std::fill(logits + r * vocab, logits + (r + 1) * vocab, T(0));
  }
}

}  // namespace

template <class T, class O>
void cross_entropy(T* logits, const std::int32_t* targets, T* losses, i64 rows, i64 vocab,
                   double grad_scale, O* grad) {
  if constexpr (std::is_same_v<T, float>) {
    if (const simd::Kernels* k = simd::kernels()) {
      parallel_rows(rows, vocab, [&](i64 r) {
        if (targets[r] == model_ops::kIgnoreTarget)
          return ignored_row(logits, losses, r, vocab, grad_scale, grad);
        void* g = grad_scale == 0 ? nullptr
                  : grad          ? static_cast<void*>(grad + r * vocab)
                                  : logits + r * vocab;
        losses[r] = k->xent_row(logits + r * vocab, vocab, targets[r], g, grad && is_bf16<O>,
                                static_cast<float>(grad_scale));
      });
      return;
    }
  }
  parallel_rows(rows, vocab, [&](i64 r) {
    if (targets[r] == model_ops::kIgnoreTarget)
      return ignored_row(logits, losses, r, vocab, grad_scale, grad);
    T* l = logits + r * vocab;
    T mx = l[0];
    for (i64 i = 1; i < vocab; ++i) mx = std::max(mx, l[i]);
    T sum = 0;
    for (i64 i = 0; i < vocab; ++i) sum += std::exp(l[i] - mx);
    const T lse = mx + std::log(sum);
    const i64 tgt = targets[r];
    losses[r] = lse - l[tgt];
    if (grad_scale != 0) {
      const T gs = T(grad_scale);
      if (grad) {
        O* g = grad + r * vocab;
        for (i64 i = 0; i < vocab; ++i)
          put(g, i, std::exp(l[i] - lse) * gs - (i == tgt ? gs : T(0)));
      } else {
        for (i64 i = 0; i < vocab; ++i) l[i] = std::exp(l[i] - lse) * gs;
        l[tgt] -= gs;
      }
    }
  });
}

template <class T>
void cross_entropy_stats(const T* logits, const std::int32_t* targets, T* stats, i64 rows,
                         i64 vocab) {
  parallel_rows(rows, vocab, [&](i64 r) {
    const T* l = logits + r * vocab;
    T mx = l[0];
    for (i64 i = 1; i < vocab; ++i) mx = std::max(mx, l[i]);
    T sum = 0;
    for (i64 i = 0; i < vocab; ++i) sum += std::exp(l[i] - mx);
    stats[2 * r] = mx + std::log(sum);
    const std::int32_t tgt = targets[r];
    stats[2 * r + 1] = tgt >= 0 ? l[tgt] : T(0);
  });
}

template <class T, class O>
void cross_entropy_finish(T* logits, const std::int32_t* targets, const T* all, i64 parts,
                          T* losses, i64 rows, i64 vocab, double grad_scale, O* grad) {
  parallel_rows(rows, vocab, [&](i64 r) {
    if (targets[r] == model_ops::kIgnoreTarget)
      return ignored_row(logits, losses, r, vocab, grad_scale, grad);
    // Every rank combines the parts in rank order: the same loss on each.
    T mx = all[2 * r];
    for (i64 p = 1; p < parts; ++p) mx = std::max(mx, all[(p * rows + r) * 2]);
    T sum = 0, tl = 0;
    for (i64 p = 0; p < parts; ++p) {
      sum += std::exp(all[(p * rows + r) * 2] - mx);
      tl += all[(p * rows + r) * 2 + 1];
    }
    const T lse = mx + std::log(sum);
    losses[r] = lse - tl;
    if (grad_scale == 0) return;
    const T gs = T(grad_scale);
    const i64 tgt = targets[r];  // -1: another rank's column
    T* l = logits + r * vocab;
    if (grad) {
      O* g = grad + r * vocab;
      for (i64 i = 0; i < vocab; ++i) put(g, i, std::exp(l[i] - lse) * gs - (i == tgt ? gs : T(0)));
    } else {
      for (i64 i = 0; i < vocab; ++i) l[i] = std::exp(l[i] - lse) * gs;
      if (tgt >= 0) l[tgt] -= gs;
    }
  });
}

#define STRATA_MK_T(T)                                                                           \
  template void embedding_backward<T>(const std::int32_t*, const T*, T*, T*, i64, i64, i64);     \
  template void rope_apply<T>(T*, i64, i64, i64, i64, i64, i64, const T*, const T*, bool);       \
  template void attention_forward<T>(const T*, T*, T*, i64, i64, i64, i64, i64, double);         \
  template void attention_backward<T>(const T*, const T*, const T*, const T*, T*, i64, i64, i64, \
                                      i64, i64, double);                                         \
  template void gelu_backward<T>(const T*, const T*, T*, i64);                                   \
  template void bias_backward<T>(const T*, T*, i64, i64);                                        \
  template void cross_entropy_stats<T>(const T*, const std::int32_t*, T*, i64, i64);

// Kernels with an output of type O.
#define STRATA_MK_TO(T, O)                                                                       \
  template void swiglu_forward<T, O>(const T*, O*, i64, i64);                                    \
  template void swiglu_backward<T, O>(const T*, const T*, O*, i64, i64);                         \
  template void gelu_forward<T, O>(const T*, O*, i64);                                           \
  template void cross_entropy<T, O>(T*, const std::int32_t*, T*, i64, i64, double, O*);          \
  template void cross_entropy_finish<T, O>(T*, const std::int32_t*, const T*, i64, T*, i64, i64, \
                                           double, O*);

#define STRATA_MK_TW(T, W)                                                                         \
  template void embedding_forward<T, W>(const std::int32_t*, const W*, const W*, T*, i64, i64,     \
                                        i64);                                                      \
  template void rmsnorm_backward<T, W>(const T*, const T*, const W*, const T*, T*, T*, i64, i64,   \
                                       bf16_t*);                                                   \
  template void layernorm_backward<T, W>(const T*, const T*, const W*, const T*, const T*, T*, T*, \
                                         T*, i64, i64);                                            \
  template void bias_add<T, W>(T*, const W*, i64, i64);

#define STRATA_MK_TWO(T, W, O)                                                                 \
  template void rmsnorm_forward<T, W, O>(const T*, const W*, O*, T*, i64, i64, double);        \
  template void layernorm_forward<T, W, O>(const T*, const W*, const W*, O*, T*, T*, i64, i64, \
                                           double);

STRATA_MK_T(float)
STRATA_MK_T(double)
STRATA_MK_TO(float, float)
STRATA_MK_TO(float, bf16_t)
STRATA_MK_TO(double, double)
STRATA_MK_TW(float, float)
STRATA_MK_TW(float, bf16_t)
STRATA_MK_TW(double, double)
STRATA_MK_TWO(float, float, float)
STRATA_MK_TWO(float, float, bf16_t)
STRATA_MK_TWO(float, bf16_t, float)
STRATA_MK_TWO(float, bf16_t, bf16_t)
STRATA_MK_TWO(double, double, double)

}  // namespace strata::cpu
