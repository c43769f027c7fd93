// The DeepSpeed-style loop in 8 lanes (AVX2 + FMA): compiled with -mavx2 -mfma, called only
// where strata's AVX2 kernels may run.
#include <immintrin.h>

#include "adam_ds_style_simd.h"

namespace strata::bench {
namespace {

struct Avx2 {
  using T = __m256;
  static constexpr int kWidth = 8;
  static T set1(float x) { return _mm256_set1_ps(x); }
  static T load(const float* q) { return _mm256_loadu_ps(q); }
  static void store(float* q, T x) { _mm256_storeu_ps(q, x); }
  static T mul(T a, T b) { return _mm256_mul_ps(a, b); }
  static T div(T a, T b) { return _mm256_div_ps(a, b); }
  static T sqrt(T a) { return _mm256_sqrt_ps(a); }
  static T fma(T a, T b, T c) { return _mm256_fmadd_ps(a, b, c); }
};

}  // namespace

void ds_style_adamw_avx2(const DsStyleScalars& k, float* p, const float* g, float* m, float* v,
                         std::size_t lo, std::size_t hi) {
  ds_style_vectors<Avx2>(k, p, g, m, v, lo, hi);
}

}  // namespace strata::bench
