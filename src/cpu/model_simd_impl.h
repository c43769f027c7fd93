// The row kernels of model_simd.h, written once over a vector type V and included by one
// translation unit per ISA (model_simd_avx512.cpp, model_simd_avx2.cpp) after it defines V:
//
//   using f = <vector of W floats>;  static constexpr i64 W;
//   load/store (unaligned), set1, add, sub, mul, div, fmadd(a, b, c) = a * b + c,
//   fnmadd(a, b, c) = c - a * b, max/min(a, b) (b when either is NaN), lt_select(a, b, x, y)
//   = a < b ? x : y, iota() = {0, 1, ...}, round (to nearest even), scale2(p, n) = p * 2^n,
//   hsum/hmax (a fixed order), load_bf16/store_bf16 (W values; store rounds exactly as
//   strata::f32_to_bf16).
//
// Everything here has internal linkage (see model_simd.h). Tails shorter than W go through a
// padded stack copy, so every element takes the same vector operations.
#pragma once

#include <cstdint>

#include "cpu/model_simd.h"

namespace strata::cpu::simd {
namespace {

inline std::uint32_t bits_of(float x) {
  std::uint32_t u;
  __builtin_memcpy(&u, &x, 4);
  return u;
}

// strata::f32_to_bf16, privately (an inline function from a shared header must not be
// instantiated in an ISA translation unit).
inline std::uint16_t round_bf16(float x) {
  std::uint32_t u = bits_of(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<std::uint16_t>(u >> 16);
}

inline float widen_bf16(std::uint16_t h) {
  const std::uint32_t u = std::uint32_t(h) << 16;
  float x;
  __builtin_memcpy(&x, &u, 4);
  return x;
}

template <class V>
struct Impl {
  using f = typename V::f;
  static constexpr i64 W = V::W;

  // Loads cnt (<= W) floats, the rest of the vector `fill`.
  static f loadp(const float* p, i64 cnt, float fill) {
    if (cnt == W) return V::load(p);
    alignas(64) float t[W];
    for (i64 i = 0; i < W; ++i) t[i] = i < cnt ? p[i] : fill;
    return V::load(t);
  }
  static void storep(float* p, f x, i64 cnt) {
    if (cnt == W) return V::store(p, x);
    alignas(64) float t[W];
    V::store(t, x);
    for (i64 i = 0; i < cnt; ++i) p[i] = t[i];
  }
  static f loadp_bf16(const std::uint16_t* p, i64 cnt) {
    if (cnt == W) return V::load_bf16(p);
    alignas(64) std::uint16_t t[W] = {};
    for (i64 i = 0; i < cnt; ++i) t[i] = p[i];
    return V::load_bf16(t);
  }
  static void storep_bf16(std::uint16_t* p, f x, i64 cnt) {
    if (cnt == W) return V::store_bf16(p, x);
    alignas(64) std::uint16_t t[W];
    V::store_bf16(t, x);
    for (i64 i = 0; i < cnt; ++i) p[i] = t[i];
  }
  static f loadw(const void* w, bool w_bf16, i64 i, i64 cnt) {
    return w_bf16 ? loadp_bf16(static_cast<const std::uint16_t*>(w) + i, cnt)
                  : loadp(static_cast<const float*>(w) + i, cnt, 0.0f);
  }
  static void store_out(void* p, bool bf16, i64 i, f x, i64 cnt) {
    if (bf16)
      storep_bf16(static_cast<std::uint16_t*>(p) + i, x, cnt);
    else
      storep(static_cast<float*>(p) + i, x, cnt);
  }
  static i64 count(i64 n, i64 i) { return n - i < W ? n - i : W; }

  // exp(x) within 2 ulp (Cephes' expf polynomial on [-ln2/2, ln2/2], then scaled by 2^n);
  // exactly 0 below -104, +inf above 88.7, NaN stays NaN.
  static f exp(f x) {
    x = V::max(V::set1(-104.0f), x);
    x = V::min(V::set1(88.7f), x);
    const f n = V::round(V::mul(x, V::set1(1.44269504088896341f)));
    f r = V::fnmadd(n, V::set1(0.693359375f), x);
    r = V::fnmadd(n, V::set1(-2.12194440e-4f), r);
    f p = V::set1(1.9875691500e-4f);
    p = V::fmadd(p, r, V::set1(1.3981999507e-3f));
    p = V::fmadd(p, r, V::set1(8.3334519073e-3f));
    p = V::fmadd(p, r, V::set1(4.1665795894e-2f));
    p = V::fmadd(p, r, V::set1(1.6666665459e-1f));
    p = V::fmadd(p, r, V::set1(5.0000001201e-1f));
    p = V::fmadd(p, V::mul(r, r), V::add(r, V::set1(1.0f)));
    return V::scale2(p, n);
  }

  static void f32_to_bf16(const float* x, std::uint16_t* y, i64 n) {
    i64 i = 0;
    for (; i + W <= n; i += W) V::store_bf16(y + i, V::load(x + i));
    for (; i < n; ++i) y[i] = round_bf16(x[i]);
  }
  static void bf16_to_f32(const std::uint16_t* x, float* y, i64 n) {
    i64 i = 0;
    for (; i + W <= n; i += W) V::store(y + i, V::load_bf16(x + i));
    for (; i < n; ++i) y[i] = widen_bf16(x[i]);
  }

  static void swiglu_fwd(const float* g, const float* u, void* o, bool o_bf16, i64 n) {
    const f one = V::set1(1.0f);
    for (i64 i = 0; i < n; i += W) {
      const i64 k = count(n, i);
      const f gv = loadp(g + i, k, 0.0f), uv = loadp(u + i, k, 0.0f);
      const f e = exp(V::sub(V::set1(0.0f), gv));
      store_out(o, o_bf16, i, V::mul(V::div(gv, V::add(one, e)), uv), k);
    }
  }
  static void swiglu_bwd(const float* d, const float* g, const float* u, void* dg, void* du,
                         bool out_bf16, i64 n) {
    const f one = V::set1(1.0f);
    for (i64 i = 0; i < n; i += W) {
      const i64 k = count(n, i);
      const f dv = loadp(d + i, k, 0.0f), gv = loadp(g + i, k, 0.0f), uv = loadp(u + i, k, 0.0f);
      const f sig = V::div(one, V::add(one, exp(V::sub(V::set1(0.0f), gv))));
      store_out(du, out_bf16, i, V::mul(V::mul(dv, gv), sig), k);
      const f dsilu = V::add(one, V::mul(gv, V::sub(one, sig)));
      store_out(dg, out_bf16, i, V::mul(V::mul(V::mul(dv, uv), sig), dsilu), k);
    }
  }

  static float rms_fwd(const float* x, const void* w, bool w_bf16, void* o, bool o_bf16, i64 c,
                       float eps) {
    f ss = V::set1(0.0f);
    for (i64 i = 0; i < c; i += W) {
      const f xv = loadp(x + i, count(c, i), 0.0f);
      ss = V::fmadd(xv, xv, ss);
    }
    const float rs = 1.0f / __builtin_sqrtf(V::hsum(ss) / float(c) + eps);
    const f rv = V::set1(rs);
    for (i64 i = 0; i < c; i += W) {
      const i64 k = count(c, i);
      store_out(o, o_bf16, i, V::mul(V::mul(loadp(x + i, k, 0.0f), rv), loadw(w, w_bf16, i, k)), k);
    }
    return rs;
  }
  static void rms_bwd(const float* d, const float* x, const void* w, bool w_bf16, float rs,
                      float* dx, std::uint16_t* dx_bf16, i64 c) {
    const f rv = V::set1(rs);
    f acc = V::set1(0.0f);
    for (i64 i = 0; i < c; i += W) {
      const i64 k = count(c, i);
      const f dw = V::mul(loadp(d + i, k, 0.0f), loadw(w, w_bf16, i, k));
      acc = V::fmadd(dw, V::mul(loadp(x + i, k, 0.0f), rv), acc);
    }
    const f m = V::set1(V::hsum(acc) / float(c));
    for (i64 i = 0; i < c; i += W) {
      const i64 k = count(c, i);
      const f dw = V::mul(loadp(d + i, k, 0.0f), loadw(w, w_bf16, i, k));
      const f xh = V::mul(loadp(x + i, k, 0.0f), rv);
      const f nd = V::fmadd(rv, V::fnmadd(xh, m, dw), loadp(dx + i, k, 0.0f));
      storep(dx + i, nd, k);
      if (dx_bf16) storep_bf16(dx_bf16 + i, nd, k);
    }
  }
  static void mul_acc(const float* a, const float* b, float s, float* acc, i64 n) {
    const f sv = V::set1(s);
    for (i64 i = 0; i < n; i += W) {
      const i64 k = count(n, i);
      storep(acc + i,
             V::fmadd(V::mul(loadp(a + i, k, 0.0f), loadp(b + i, k, 0.0f)), sv,
                      loadp(acc + i, k, 0.0f)),
             k);
    }
  }

  static float ln_fwd(const float* x, const void* w, const void* bias, bool w_bf16, void* o,
                      bool o_bf16, i64 c, float eps, float* mean) {
    f sv = V::set1(0.0f);
    for (i64 i = 0; i < c; i += W) sv = V::add(sv, loadp(x + i, count(c, i), 0.0f));
    const float mu = V::hsum(sv) / float(c);
    const f mv = V::set1(mu);
    f vv = V::set1(0.0f);
    for (i64 i = 0; i < c; i += W) {
      const i64 k = count(c, i);
      // padding lanes hold mu, so they add nothing
      const f dx = V::sub(loadp(x + i, k, mu), mv);
      vv = V::fmadd(dx, dx, vv);
    }
    const float rs = 1.0f / __builtin_sqrtf(V::hsum(vv) / float(c) + eps);
    const f rv = V::set1(rs);
    for (i64 i = 0; i < c; i += W) {
      const i64 k = count(c, i);
      const f xh = V::mul(V::sub(loadp(x + i, k, 0.0f), mv), rv);
      store_out(o, o_bf16, i, V::fmadd(xh, loadw(w, w_bf16, i, k), loadw(bias, w_bf16, i, k)), k);
    }
    *mean = mu;
    return rs;
  }
  static void ln_bwd(const float* d, const float* x, const void* w, bool w_bf16, float mu, float rs,
                     float* dx, i64 c) {
    const f mv = V::set1(mu), rv = V::set1(rs);
    f a1 = V::set1(0.0f), a2 = V::set1(0.0f);
    for (i64 i = 0; i < c; i += W) {
      const i64 k = count(c, i);
      const f dxh = V::mul(loadp(d + i, k, 0.0f), loadw(w, w_bf16, i, k));
      a1 = V::add(a1, dxh);
      a2 = V::fmadd(dxh, V::mul(V::sub(loadp(x + i, k, mu), mv), rv), a2);
    }
    const f m1 = V::set1(V::hsum(a1) / float(c)), m2 = V::set1(V::hsum(a2) / float(c));
    for (i64 i = 0; i < c; i += W) {
      const i64 k = count(c, i);
      const f dxh = V::mul(loadp(d + i, k, 0.0f), loadw(w, w_bf16, i, k));
      const f xh = V::mul(V::sub(loadp(x + i, k, 0.0f), mv), rv);
      const f t = V::fnmadd(xh, m2, V::sub(dxh, m1));
      storep(dx + i, V::fmadd(rv, t, loadp(dx + i, k, 0.0f)), k);
    }
  }
  static void ln_acc(const float* d, const float* x, float mu, float rs, float* dw, float* db,
                     i64 c) {
    const f mv = V::set1(mu), rv = V::set1(rs);
    for (i64 i = 0; i < c; i += W) {
      const i64 k = count(c, i);
      const f dv = loadp(d + i, k, 0.0f);
      storep(dw + i,
             V::fmadd(dv, V::mul(V::sub(loadp(x + i, k, 0.0f), mv), rv), loadp(dw + i, k, 0.0f)),
             k);
      storep(db + i, V::add(loadp(db + i, k, 0.0f), dv), k);
    }
  }

  // tanh(y) = 1 - 2 / (exp(2y) + 1): exact limits at +-inf, absolute error a few 1e-8.
  static f tanh(f y) {
    const f one = V::set1(1.0f);
    return V::sub(one, V::div(V::set1(2.0f), V::add(exp(V::add(y, y)), one)));
  }
  static f gelu_inner(f v) {  // sqrt(2/pi) * (v + 0.044715 v^3)
    return V::mul(V::set1(0.7978845608028654f),
                  V::fmadd(V::mul(V::set1(0.044715f), V::mul(v, v)), v, v));
  }
  static void gelu_fwd(const float* x, void* o, bool o_bf16, i64 n) {
    for (i64 i = 0; i < n; i += W) {
      const i64 k = count(n, i);
      const f v = loadp(x + i, k, 0.0f);
      store_out(o, o_bf16, i,
                V::mul(V::mul(V::set1(0.5f), v), V::add(V::set1(1.0f), tanh(gelu_inner(v)))), k);
    }
  }
  static void gelu_bwd(const float* d, const float* x, float* dx, i64 n) {
    const f half = V::set1(0.5f), one = V::set1(1.0f);
    for (i64 i = 0; i < n; i += W) {
      const i64 k = count(n, i);
      const f v = loadp(x + i, k, 0.0f);
      const f th = tanh(gelu_inner(v));
      const f dinner = V::mul(V::set1(0.7978845608028654f),
                              V::fmadd(V::mul(V::set1(3 * 0.044715f), v), v, one));  // d inner / dv
      const f g = V::fmadd(V::mul(V::mul(half, v), V::fnmadd(th, th, one)), dinner,
                           V::mul(half, V::add(one, th)));
      storep(dx + i, V::mul(loadp(d + i, k, 0.0f), g), k);
    }
  }

  static void rope_head(float* v, const float* cos, const float* sin, i64 half, float sgn) {
    const f sg = V::set1(sgn);
    for (i64 i = 0; i < half; i += W) {
      const i64 k = count(half, i);
      const f a = loadp(v + i, k, 0.0f), b = loadp(v + half + i, k, 0.0f);
      const f c = loadp(cos + i, k, 0.0f), s = V::mul(sg, loadp(sin + i, k, 0.0f));
      storep(v + i, V::fnmadd(b, s, V::mul(a, c)), k);
      storep(v + half + i, V::fmadd(a, s, V::mul(b, c)), k);
    }
  }

  static float xent_row(const float* l, i64 v, i64 tgt, void* g, bool g_bf16, float gs) {
    const float ninf = -__builtin_inff();
    f mv = V::set1(ninf);
    for (i64 i = 0; i < v; i += W) mv = V::max(mv, loadp(l + i, count(v, i), ninf));
    const float mx = V::hmax(mv);
    const f mxv = V::set1(mx);
    f sv = V::set1(0.0f);
    for (i64 i = 0; i < v; i += W) {
      const i64 k = count(v, i);
      sv = V::add(sv, exp(V::sub(loadp(l + i, k, ninf), mxv)));
    }
    const float lse = mx + __builtin_logf(V::hsum(sv));
    const float loss = lse - l[tgt];
    if (g) {
      const f lv = V::set1(lse), gv = V::set1(gs);
      for (i64 i = 0; i < v; i += W) {
        const i64 k = count(v, i);
        const f p = V::mul(exp(V::sub(loadp(l + i, k, 0.0f), lv)), gv);
        if (tgt < i || tgt >= i + k) {
          store_out(g, g_bf16, i, p, k);
          continue;
        }
        alignas(64) float t[W];  // the target's vector: subtract grad_scale before any rounding
        V::store(t, p);
        t[tgt - i] -= gs;
        store_out(g, g_bf16, i, V::load(t), k);
      }
    }
    return loss;
  }

  // x * scale where the key index is visible (< valid), else -inf.
  static f masked_scores(const float* s, i64 j, i64 kn, i64 valid, f scale) {
    const f idx = V::add(V::iota(), V::set1(float(j)));
    return V::lt_select(idx, V::set1(float(valid)), V::mul(loadp(s + j, count(kn, j), 0.0f), scale),
                        V::set1(-__builtin_inff()));
  }

  static void zero_out(void* p, bool bf16, i64 from, i64 to) {
    for (i64 j = from; j < to; j += W) store_out(p, bf16, j, V::set1(0.0f), count(to, j));
  }

  // Visible keys are [0, valid): the tail of the vector that holds key valid - 1 is masked, the
  // vectors past it are only zeroed.
  static float attn_fwd_row(float* s, i64 kn, i64 valid, float scale, void* p, bool p_bf16) {
    const f sc = V::set1(scale);
    f mv = V::set1(-__builtin_inff());
    for (i64 j = 0; j < valid; j += W) mv = V::max(mv, masked_scores(s, j, kn, valid, sc));
    const float mx = V::hmax(mv);
    const f mxv = V::set1(mx);
    f sv = V::set1(0.0f);
    for (i64 j = 0; j < valid; j += W) {
      const i64 k = count(kn, j);
      const f e = exp(V::sub(masked_scores(s, j, kn, valid, sc), mxv));
      sv = V::add(sv, e);
      storep(s + j, e, k);
    }
    const float sum = V::hsum(sv);
    const f inv = V::set1(1.0f / sum);
    i64 j = 0;
    for (; j < valid; j += W) {
      const i64 k = count(kn, j);
      store_out(p, p_bf16, j, V::mul(loadp(s + j, k, 0.0f), inv), k);
    }
    zero_out(p, p_bf16, j, kn);
    return mx + __builtin_logf(sum);
  }

  static void attn_bwd_row(const float* s, const float* dp, i64 kn, i64 valid, float scale,
                           float lse, float dsum, void* p, void* ds, bool out_bf16) {
    const f sc = V::set1(scale), lv = V::set1(lse), dv = V::set1(dsum);
    i64 j = 0;
    for (; j < valid; j += W) {
      const i64 k = count(kn, j);
      const f pv = exp(V::sub(masked_scores(s, j, kn, valid, sc), lv));
      store_out(p, out_bf16, j, pv, k);
      store_out(ds, out_bf16, j, V::mul(V::mul(pv, V::sub(loadp(dp + j, k, 0.0f), dv)), sc), k);
    }
    zero_out(p, out_bf16, j, kn);
    zero_out(ds, out_bf16, j, kn);
  }

  static float dot(const float* a, const float* b, i64 n) {
    f acc = V::set1(0.0f);
    for (i64 i = 0; i < n; i += W) {
      const i64 k = count(n, i);
      acc = V::fmadd(loadp(a + i, k, 0.0f), loadp(b + i, k, 0.0f), acc);
    }
    return V::hsum(acc);
  }

  static void pack_2d(const float* src, i64 src_stride, void* dst, bool dst_bf16, i64 dst_stride,
                      i64 rows, i64 cols) {
    for (i64 r = 0; r < rows; ++r) {
      const float* sr = src + r * src_stride;
      if (dst_bf16) {
        std::uint16_t* dr = static_cast<std::uint16_t*>(dst) + r * dst_stride;
        for (i64 i = 0; i < cols; i += W)
          storep_bf16(dr + i, loadp(sr + i, count(cols, i), 0.0f), count(cols, i));
      } else {
        float* dr = static_cast<float*>(dst) + r * dst_stride;
        for (i64 i = 0; i < cols; i += W)
          storep(dr + i, loadp(sr + i, count(cols, i), 0.0f), count(cols, i));
      }
    }
  }
  static void rowdot_2d(const float* a, i64 a_stride, const float* b, i64 b_stride, float* out,
                        i64 out_stride, i64 rows, i64 cols) {
    for (i64 r = 0; r < rows; ++r)
      out[r * out_stride] = dot(a + r * a_stride, b + r * b_stride, cols);
  }

  // Written as scalar code on purpose: the compiler vectorises the 16 independent chains with
  // this ISA's registers, and the bits cannot depend on how (see model_simd.h).
  static void sum_squares_16(const float* a, i64 n, double* acc) {
    i64 i = 0;
    for (; i + 16 <= n; i += 16)
      for (i64 j = 0; j < 16; ++j) acc[j] += double(a[i + j]) * double(a[i + j]);
    for (i64 j = 0; i < n; ++i, ++j) acc[j] += double(a[i]) * double(a[i]);
  }

  static Kernels table() {
    Kernels t{};
    t.f32_to_bf16 = &f32_to_bf16;
    t.bf16_to_f32 = &bf16_to_f32;
    t.swiglu_fwd = &swiglu_fwd;
    t.swiglu_bwd = &swiglu_bwd;
    t.rms_fwd = &rms_fwd;
    t.rms_bwd = &rms_bwd;
    t.mul_acc = &mul_acc;
    t.ln_fwd = &ln_fwd;
    t.ln_bwd = &ln_bwd;
    t.ln_acc = &ln_acc;
    t.gelu_fwd = &gelu_fwd;
    t.gelu_bwd = &gelu_bwd;
    t.rope_head = &rope_head;
    t.xent_row = &xent_row;
    t.attn_fwd_row = &attn_fwd_row;
    t.attn_bwd_row = &attn_bwd_row;
    t.dot = &dot;
    t.pack_2d = &pack_2d;
    t.rowdot_2d = &rowdot_2d;
    t.sum_squares_16 = &sum_squares_16;
    return t;
  }
};

}  // namespace
}  // namespace strata::cpu::simd
