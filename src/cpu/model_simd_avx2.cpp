// The model's row kernels with AVX2 + FMA (8 lanes): compiled with -mavx2 -mfma and handed
// out only when cpuid reports avx2 and fma (model_kernels.cpp).
#include <immintrin.h>

#include "cpu/model_simd_impl.h"

namespace strata::cpu::simd {
namespace {

struct V256 {
  using f = __m256;
  static constexpr i64 W = 8;
  static f load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, f x) { _mm256_storeu_ps(p, x); }
  static f set1(float a) { return _mm256_set1_ps(a); }
  static f add(f a, f b) { return _mm256_add_ps(a, b); }
  static f sub(f a, f b) { return _mm256_sub_ps(a, b); }
  static f mul(f a, f b) { return _mm256_mul_ps(a, b); }
  static f div(f a, f b) { return _mm256_div_ps(a, b); }
  static f fmadd(f a, f b, f c) { return _mm256_fmadd_ps(a, b, c); }
  static f fnmadd(f a, f b, f c) { return _mm256_fnmadd_ps(a, b, c); }
  static f max(f a, f b) { return _mm256_max_ps(a, b); }
  static f min(f a, f b) { return _mm256_min_ps(a, b); }
  static f lt_select(f a, f b, f x, f y) {
    return _mm256_blendv_ps(y, x, _mm256_cmp_ps(a, b, _CMP_LT_OQ));
  }
  static f iota() { return _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7); }
  static f round(f x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  // p * 2^n for integral n in [-151, 129], in two exact steps (2^n alone may not be a normal
  // float).
  static f scale2(f p, f n) {
    const f n1 = _mm256_max_ps(_mm256_set1_ps(-126.0f), _mm256_min_ps(_mm256_set1_ps(127.0f), n));
    const f n2 = _mm256_sub_ps(n, n1);
    auto pow2 = [](f e) {
      return _mm256_castsi256_ps(
          _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(e), _mm256_set1_epi32(127)), 23));
    };
    return _mm256_mul_ps(_mm256_mul_ps(p, pow2(n1)), pow2(n2));
  }
  static float hsum(f x) {
    const __m128 q = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    const __m128 d = _mm_add_ps(q, _mm_movehl_ps(q, q));
    return _mm_cvtss_f32(_mm_add_ss(d, _mm_movehdup_ps(d)));
  }
  static float hmax(f x) {
    const __m128 q = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    const __m128 d = _mm_max_ps(q, _mm_movehl_ps(q, q));
    return _mm_cvtss_f32(_mm_max_ss(d, _mm_movehdup_ps(d)));
  }
  static f load_bf16(const std::uint16_t* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  static void store_bf16(std::uint16_t* p, f x) {
    const __m256i u = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_srli_epi32(
        _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
    const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    // |u| > 0x7f800000 as signed compare: both sides are non-negative.
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                           _mm256_set1_epi32(0x7f800000));
    const __m256i r = _mm256_blendv_epi8(rounded, quiet, nan);
    // 32-bit lanes hold values <= 0xffff: pack to 16 bits and gather the two halves.
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
  }
};

}  // namespace

const Kernels& avx2_kernels() {
  static const Kernels k = Impl<V256>::table();
  return k;
}

}  // namespace strata::cpu::simd
