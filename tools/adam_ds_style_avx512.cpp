// The DeepSpeed-style loop in 16 lanes (AVX-512F): compiled with -mavx512f -mfma, called only
// where strata's AVX-512 kernels may run.
#include <immintrin.h>

#include "adam_ds_style_simd.h"

namespace strata::bench {
namespace {

struct Avx512 {
  using T = __m512;
  static constexpr int kWidth = 16;
  static T set1(float x) { return _mm512_set1_ps(x); }
  static T load(const float* q) { return _mm512_loadu_ps(q); }
  static void store(float* q, T x) { _mm512_storeu_ps(q, x); }
  static T mul(T a, T b) { return _mm512_mul_ps(a, b); }
  static T div(T a, T b) { return _mm512_div_ps(a, b); }
  static T sqrt(T a) { return _mm512_sqrt_ps(a); }
  static T fma(T a, T b, T c) { return _mm512_fmadd_ps(a, b, c); }
};

}  // namespace

void ds_style_adamw_avx512(const DsStyleScalars& k, float* p, const float* g, float* m, float* v,
                           std::size_t lo, std::size_t hi) {
  ds_style_vectors<Avx512>(k, p, g, m, v, lo, hi);
}

}  // namespace strata::bench
