// The model's row kernels with AVX-512 (16 lanes): compiled with -mavx512f -mavx512bw
// -mavx512vl -mfma and handed out only when cpuid reports avx512f/bw/vl (model_kernels.cpp).
#include <immintrin.h>

#include "cpu/model_simd_impl.h"

namespace strata::cpu::simd {
namespace {

struct V512 {
  using f = __m512;
  static constexpr i64 W = 16;
  static f load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, f x) { _mm512_storeu_ps(p, x); }
  static f set1(float a) { return _mm512_set1_ps(a); }
  static f add(f a, f b) { return _mm512_add_ps(a, b); }
  static f sub(f a, f b) { return _mm512_sub_ps(a, b); }
  static f mul(f a, f b) { return _mm512_mul_ps(a, b); }
  static f div(f a, f b) { return _mm512_div_ps(a, b); }
  static f fmadd(f a, f b, f c) { return _mm512_fmadd_ps(a, b, c); }
  static f fnmadd(f a, f b, f c) { return _mm512_fnmadd_ps(a, b, c); }
  static f max(f a, f b) { return _mm512_max_ps(a, b); }
  static f min(f a, f b) { return _mm512_min_ps(a, b); }
  static f lt_select(f a, f b, f x, f y) {
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, b, _CMP_LT_OQ), y, x);
  }
  static f iota() { return _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }
  static f round(f x) {
    return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  static f scale2(f p, f n) { return _mm512_scalef_ps(p, n); }
  static __m256 high(f x) {
    return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1));
  }
  static float hsum(f x) {
    const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(x), high(x));
    const __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    const __m128 d = _mm_add_ps(q, _mm_movehl_ps(q, q));
    return _mm_cvtss_f32(_mm_add_ss(d, _mm_movehdup_ps(d)));
  }
  static float hmax(f x) {
    const __m256 h = _mm256_max_ps(_mm512_castps512_ps256(x), high(x));
    const __m128 q = _mm_max_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    const __m128 d = _mm_max_ps(q, _mm_movehl_ps(q, q));
    return _mm_cvtss_f32(_mm_max_ss(d, _mm_movehdup_ps(d)));
  }
  static f load_bf16(const std::uint16_t* p) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  static void store_bf16(std::uint16_t* p, f x) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_srli_epi32(
        _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(
        _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                        _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(nan, rounded, quiet)));
  }
};

}  // namespace

const Kernels& avx512_kernels() {
  static const Kernels k = Impl<V512>::table();
  return k;
}

}  // namespace strata::cpu::simd
