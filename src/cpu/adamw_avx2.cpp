// The AVX2 + FMA + F16C AdamW path, 8 lanes: compiled with -mavx2 -mfma -mf16c and called
// only when cpuid reports all three. bf16 rounding is emulated with integer ops (round to
// nearest even, NaN kept quiet) exactly as strata::f32_to_bf16; fp16 uses vcvtps2ph with
// round-to-nearest-even, which matches strata::f32_to_f16 including NaN payloads. Tails
// (fewer than 8 elements) go through the scalar element step, which performs the same
// operations, so the whole array matches the scalar path bit for bit.
#include <immintrin.h>

#include "cpu/adamw_kernels.h"

namespace strata::cpu::adamw {
namespace {

inline __m256 load_bf16x8(const std::uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

inline __m128i to_bf16x8(__m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i rounded =
      _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
  const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
  const __m256i abs = _mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff));
  // Signed compare is right here: abs <= 0x7fffffff.
  const __m256i is_nan = _mm256_cmpgt_epi32(abs, _mm256_set1_epi32(0x7f800000));
  const __m256i r = _mm256_blendv_epi8(rounded, quiet, is_nan);
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

inline int bad_lanes(__m256 g) {
  const __m256 d = _mm256_sub_ps(g, g);  // NaN exactly where g is NaN or Inf
  return __builtin_popcount(
      static_cast<unsigned>(_mm256_movemask_ps(_mm256_cmp_ps(d, d, _CMP_UNORD_Q))));
}

template <bool G, bool S, CopyKind C>
struct Avx2Impl {
  static std::size_t run(const detail::AdamWScalars& k, const Arrays& a, std::size_t lo,
                         std::size_t hi) {
    const __m256 gs = _mm256_set1_ps(k.grad_scale), decay = _mm256_set1_ps(k.decay);
    const __m256 b1 = _mm256_set1_ps(k.beta1), b2 = _mm256_set1_ps(k.beta2);
    const __m256 omb1 = _mm256_set1_ps(k.one_minus_beta1), omb2 = _mm256_set1_ps(k.one_minus_beta2);
    const __m256 isb2 = _mm256_set1_ps(k.inv_sqrt_bc2), eps = _mm256_set1_ps(k.eps);
    const __m256 neg_step = _mm256_set1_ps(-k.step_size);
    const auto* g16 = static_cast<const std::uint16_t*>(a.g);
    const auto* g32 = static_cast<const float*>(a.g);
    const auto* m16_src = static_cast<const std::uint16_t*>(a.m_src);
    const auto* v16_src = static_cast<const std::uint16_t*>(a.v_src);
    const auto* m32_src = static_cast<const float*>(a.m_src);
    const auto* v32_src = static_cast<const float*>(a.v_src);
    auto* m16 = static_cast<std::uint16_t*>(a.m);
    auto* v16 = static_cast<std::uint16_t*>(a.v);
    auto* m32 = static_cast<float*>(a.m);
    auto* v32 = static_cast<float*>(a.v);
    auto* c16 = static_cast<std::uint16_t*>(a.c);
    std::size_t bad = 0;
    std::size_t i = lo;
    for (; i + 8 <= hi; i += 8) {
      __m256 g = G ? load_bf16x8(g16 + i) : _mm256_loadu_ps(g32 + i);
      g = _mm256_mul_ps(g, gs);
      bad += static_cast<std::size_t>(bad_lanes(g));
      __m256 m = S ? load_bf16x8(m16_src + i) : _mm256_loadu_ps(m32_src + i);
      __m256 v = S ? load_bf16x8(v16_src + i) : _mm256_loadu_ps(v32_src + i);
      __m256 p = _mm256_mul_ps(_mm256_loadu_ps(a.p_src + i), decay);
      m = _mm256_fmadd_ps(b1, m, _mm256_mul_ps(omb1, g));
      v = _mm256_fmadd_ps(b2, v, _mm256_mul_ps(omb2, _mm256_mul_ps(g, g)));
      const __m256 d = _mm256_fmadd_ps(_mm256_sqrt_ps(v), isb2, eps);
      p = _mm256_fmadd_ps(neg_step, _mm256_div_ps(m, d), p);
      _mm256_storeu_ps(a.p + i, p);
      if constexpr (S) {
        _mm_storeu_si128(reinterpret_cast<__m128i*>(m16 + i), to_bf16x8(m));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(v16 + i), to_bf16x8(v));
      } else {
        _mm256_storeu_ps(m32 + i, m);
        _mm256_storeu_ps(v32 + i, v);
      }
      if constexpr (C != CopyKind::kNone) {
        const __m128i c = C == CopyKind::kBF16
                              ? to_bf16x8(p)
                              : _mm256_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(c16 + i), c);
      }
    }
    return bad + update_scalar<G, S, C>(k, a, i, hi);
  }
};

std::size_t update(const detail::AdamWScalars& k, const Arrays& a, std::size_t lo, std::size_t hi) {
  return pick<Avx2Impl>(a)(k, a, lo, hi);
}

std::size_t count(float grad_scale, const void* g, DType t, std::size_t lo, std::size_t hi) {
  const __m256 gs = _mm256_set1_ps(grad_scale);
  std::size_t bad = 0, i = lo;
  for (; i + 8 <= hi; i += 8) {
    const __m256 x = t == DType::kBF16 ? load_bf16x8(static_cast<const std::uint16_t*>(g) + i)
                                       : _mm256_loadu_ps(static_cast<const float*>(g) + i);
    bad += static_cast<std::size_t>(bad_lanes(_mm256_mul_ps(x, gs)));
  }
  return bad + count_scalar(grad_scale, g, t, i, hi);
}

}  // namespace

Kernels avx2_kernels() { return {&update, &count}; }

}  // namespace strata::cpu::adamw
