// The vector body of the DeepSpeed-style loop (adam_ds_style.h), over a lane type `V` given by
// one ISA's file (adam_ds_style_avx2.cpp, adam_ds_style_avx512.cpp). Everything here has internal
// linkage: each file compiles it for its own ISA, and a shared copy the linker picked could run
// AVX-512 instructions on an AVX2 CPU.
#pragma once

#include <cstddef>

#include "adam_ds_style.h"

namespace strata::bench {
namespace {

// Elements [lo, lo + n) one at a time, the same operations as the vectors.
inline void ds_style_scalar(const DsStyleScalars& k, float* p, const float* g, float* m, float* v,
                            std::size_t lo, std::size_t hi) {
  for (std::size_t i = lo; i < hi; ++i) {
    const float gi = g[i];
    float mi = m[i] * k.beta1;
    mi = __builtin_fmaf(gi, k.one_minus_beta1, mi);
    float vi = v[i] * k.beta2;
    vi = __builtin_fmaf(gi * gi, k.one_minus_beta2, vi);
    const float d = __builtin_fmaf(__builtin_sqrtf(vi), k.inv_sqrt_bc2, k.eps);
    float pi = __builtin_fmaf(p[i], k.w_decay, p[i]);
    pi = __builtin_fmaf(mi / d, k.step_size, pi);
    p[i] = pi;
    m[i] = mi;
    v[i] = vi;
  }
}

// kSpan vectors per iteration, each operation applied to all of them before the next, as
// cpu_adam's unrolled step does. Returns where it stopped (a multiple of kSpan vectors past lo).
template <class V, int kSpan>
[[gnu::always_inline]] inline std::size_t ds_style_span(const DsStyleScalars& k, float* p,
                                                        const float* g, float* m, float* v,
                                                        std::size_t lo, std::size_t hi) {
  using T = typename V::T;
  constexpr std::size_t kStep = std::size_t(V::kWidth) * kSpan;
  const T b1 = V::set1(k.beta1), b2 = V::set1(k.beta2);
  const T omb1 = V::set1(k.one_minus_beta1), omb2 = V::set1(k.one_minus_beta2);
  const T step = V::set1(k.step_size), wd = V::set1(k.w_decay);
  const T isb2 = V::set1(k.inv_sqrt_bc2), eps = V::set1(k.eps);
  std::size_t i = lo;
  for (; i + kStep <= hi; i += kStep) {
    T gr[kSpan], mo[kSpan], va[kSpan], pa[kSpan];
    for (int s = 0; s < kSpan; ++s) gr[s] = V::load(g + i + s * V::kWidth);
    for (int s = 0; s < kSpan; ++s) mo[s] = V::load(m + i + s * V::kWidth);
    for (int s = 0; s < kSpan; ++s) va[s] = V::load(v + i + s * V::kWidth);
    for (int s = 0; s < kSpan; ++s) pa[s] = V::load(p + i + s * V::kWidth);
    for (int s = 0; s < kSpan; ++s) mo[s] = V::mul(mo[s], b1);
    for (int s = 0; s < kSpan; ++s) mo[s] = V::fma(gr[s], omb1, mo[s]);
    for (int s = 0; s < kSpan; ++s) va[s] = V::mul(va[s], b2);
    for (int s = 0; s < kSpan; ++s) gr[s] = V::mul(gr[s], gr[s]);
    for (int s = 0; s < kSpan; ++s) va[s] = V::fma(gr[s], omb2, va[s]);
    for (int s = 0; s < kSpan; ++s) gr[s] = V::sqrt(va[s]);
    for (int s = 0; s < kSpan; ++s) gr[s] = V::fma(gr[s], isb2, eps);
    for (int s = 0; s < kSpan; ++s) gr[s] = V::div(mo[s], gr[s]);
    for (int s = 0; s < kSpan; ++s) pa[s] = V::fma(pa[s], wd, pa[s]);
    for (int s = 0; s < kSpan; ++s) pa[s] = V::fma(gr[s], step, pa[s]);
    for (int s = 0; s < kSpan; ++s) V::store(p + i + s * V::kWidth, pa[s]);
    for (int s = 0; s < kSpan; ++s) V::store(m + i + s * V::kWidth, mo[s]);
    for (int s = 0; s < kSpan; ++s) V::store(v + i + s * V::kWidth, va[s]);
  }
  return i;
}

// The whole range: 8 vectors at a time, then 4, then 1, then the last elements one by one.
template <class V>
void ds_style_vectors(const DsStyleScalars& k, float* p, const float* g, float* m, float* v,
                      std::size_t lo, std::size_t hi) {
  std::size_t i = ds_style_span<V, 8>(k, p, g, m, v, lo, hi);
  i = ds_style_span<V, 4>(k, p, g, m, v, i, hi);
  i = ds_style_span<V, 1>(k, p, g, m, v, i, hi);
  ds_style_scalar(k, p, g, m, v, i, hi);
}

}  // namespace
}  // namespace strata::bench

// Defines `fn` (the loop at one ISA, declared in adam_ds_style.cpp) over a lane type of `width`
// floats in `type`, whose intrinsics are named `prefix`_*_ps (_mm256, _mm512): the body of each
// ISA's file.
#define STRATA_DS_STYLE_ISA(fn, type, width, prefix)                                             \
  namespace strata::bench {                                                                      \
  namespace {                                                                                    \
  struct Lanes {                                                                                 \
    using T = type;                                                                              \
    static constexpr int kWidth = width;                                                         \
    static T set1(float x) { return prefix##_set1_ps(x); }                                       \
    static T load(const float* q) { return prefix##_loadu_ps(q); }                               \
    static void store(float* q, T x) { prefix##_storeu_ps(q, x); }                               \
    static T mul(T a, T b) { return prefix##_mul_ps(a, b); }                                     \
    static T div(T a, T b) { return prefix##_div_ps(a, b); }                                     \
    static T sqrt(T a) { return prefix##_sqrt_ps(a); }                                           \
    static T fma(T a, T b, T c) { return prefix##_fmadd_ps(a, b, c); }                           \
  };                                                                                             \
  }                                                                                              \
  void fn(const DsStyleScalars& k, float* p, const float* g, float* m, float* v, std::size_t lo, \
          std::size_t hi) {                                                                      \
    ds_style_vectors<Lanes>(k, p, g, m, v, lo, hi);                                              \
  }                                                                                              \
  }
