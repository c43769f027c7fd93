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

// -1 in each lane where g is NaN or Inf, 0 elsewhere: subtracted from a per-lane count, it
// counts them without leaving the vector unit.
inline __m256i bad_lane_mask(__m256 g) {
  const __m256 d = _mm256_sub_ps(g, g);  // NaN exactly where g is NaN or Inf
  return _mm256_castps_si256(_mm256_cmp_ps(d, d, _CMP_UNORD_Q));
}

inline std::size_t lane_sum(__m256i x) {
  alignas(32) std::uint32_t lanes[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), x);
  std::size_t sum = 0;
  for (std::uint32_t n : lanes) sum += n;
  return sum;
}

std::size_t count(float grad_scale, const void* g, DType t, std::size_t lo, std::size_t hi) {
  const __m256 gs = _mm256_set1_ps(grad_scale);
  __m256i lanes = _mm256_setzero_si256();
  std::size_t i = lo;
  for (; i + 8 <= hi; i += 8) {
    const __m256 x = t == DType::kBF16 ? load_bf16x8(static_cast<const std::uint16_t*>(g) + i)
                                       : _mm256_loadu_ps(static_cast<const float*>(g) + i);
    lanes = _mm256_sub_epi32(lanes, bad_lane_mask(_mm256_mul_ps(x, gs)));
  }
  return lane_sum(lanes) + count_scalar(grad_scale, g, t, i, hi);
}

// The scalars of a step, broadcast.
struct Consts {
  explicit Consts(const detail::AdamWScalars& k)
      : gs(_mm256_set1_ps(k.grad_scale)),
        decay(_mm256_set1_ps(k.decay)),
        b1(_mm256_set1_ps(k.beta1)),
        b2(_mm256_set1_ps(k.beta2)),
        omb1(_mm256_set1_ps(k.one_minus_beta1)),
        omb2(_mm256_set1_ps(k.one_minus_beta2)),
        isb2(_mm256_set1_ps(k.inv_sqrt_bc2)),
        eps(_mm256_set1_ps(k.eps)),
        neg_step(_mm256_set1_ps(-k.step_size)) {}
  __m256 gs, decay, b1, b2, omb1, omb2, isb2, eps, neg_step;
};

template <bool G, bool S, CopyKind C>
struct Avx2Impl {
  // kU vectors from element i, each the scalar element step lane-wise: the gradients' kU vectors
  // loaded together first, the stores grouped by array (p's kU vectors, then m's, v's and the
  // copy's). Without kScaled the gradients are not multiplied by grad_scale, which is 1 then:
  // g * 1 is g, bit for bit (a NaN's payload and quietness aside, which the next operation on it
  // gives every path alike), so the arithmetic stays the scalar path's.
  template <bool kScaled, int kU>
  [[gnu::always_inline]] static inline void vectors(const Consts& c, const Arrays& a, std::size_t i,
                                                    __m256& seen) {
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
    __m256 g[kU], m[kU], v[kU], p[kU];
    for (int u = 0; u < kU; ++u) {
      const std::size_t j = i + 8 * std::size_t(u);
      g[u] = G ? load_bf16x8(g16 + j) : _mm256_loadu_ps(g32 + j);
      if constexpr (kScaled) g[u] = _mm256_mul_ps(g[u], c.gs);
    }
    for (int u = 0; u < kU; u += 2) seen = _mm256_fmadd_ps(g[u], g[u + 1 < kU ? u + 1 : u], seen);
    for (int u = 0; u < kU; ++u) {
      const std::size_t j = i + 8 * std::size_t(u);
      m[u] = S ? load_bf16x8(m16_src + j) : _mm256_loadu_ps(m32_src + j);
      v[u] = S ? load_bf16x8(v16_src + j) : _mm256_loadu_ps(v32_src + j);
      p[u] = _mm256_mul_ps(_mm256_loadu_ps(a.p_src + j), c.decay);
      m[u] = _mm256_fmadd_ps(c.b1, m[u], _mm256_mul_ps(c.omb1, g[u]));
      v[u] = _mm256_fmadd_ps(c.b2, v[u], _mm256_mul_ps(c.omb2, _mm256_mul_ps(g[u], g[u])));
      const __m256 d = _mm256_fmadd_ps(_mm256_sqrt_ps(v[u]), c.isb2, c.eps);
      p[u] = _mm256_fmadd_ps(c.neg_step, _mm256_div_ps(m[u], d), p[u]);
    }
    for (int u = 0; u < kU; ++u) _mm256_storeu_ps(a.p + i + 8 * std::size_t(u), p[u]);
    // m's kU vectors, then v's (`s32`, `s16`: the state's fp32 and bf16 views).
    const auto store_state = [&](float* s32, std::uint16_t* s16, const __m256* x) {
      for (int u = 0; u < kU; ++u) {
        const std::size_t j = i + 8 * std::size_t(u);
        if constexpr (S)
          _mm_storeu_si128(reinterpret_cast<__m128i*>(s16 + j), to_bf16x8(x[u]));
        else
          _mm256_storeu_ps(s32 + j, x[u]);
      }
    };
    store_state(m32, m16, m);
    store_state(v32, v16, v);
    if constexpr (C != CopyKind::kNone) {
      for (int u = 0; u < kU; ++u) {
        const __m128i h =
            C == CopyKind::kBF16
                ? to_bf16x8(p[u])
                : _mm256_cvtps_ph(p[u], _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(c16 + i + 8 * std::size_t(u)), h);
      }
    }
  }

  // Elements [lo, hi) but the last (hi - lo) % 8; returns where it stopped.
  template <bool kScaled>
  static std::size_t loop(const Consts& c, const Arrays& a, std::size_t lo, std::size_t hi,
                          __m256& seen) {
    // 8 vectors an iteration (256 bytes of each fp32 array, four cache lines): one vector at a
    // time with interleaved stores ran at 0.6 of it on an AMD EPYC, memory-bound.
    constexpr int kUnroll = 8;
    std::size_t i = lo;
    for (; i + 8 * kUnroll <= hi; i += 8 * kUnroll) vectors<kScaled, kUnroll>(c, a, i, seen);
    for (; i + 8 <= hi; i += 8) vectors<kScaled, 1>(c, a, i, seen);
    return i;
  }

  static std::size_t run(const detail::AdamWScalars& k, const Arrays& arrays, std::size_t lo,
                         std::size_t hi) {
    // A local copy: the stores cannot change its pointers, so they stay in registers (read
    // through `arrays`, they were reloaded after every store).
    const Arrays a = arrays;
    const Consts c(k);
    // seen + g0 * g1 over pairs of gradient vectors stays finite while they are (a sum that
    // overflows only costs the count below) and is NaN or Inf for good from the first NaN or Inf
    // on (Inf * 0 is NaN): one fused multiply-add for two vectors, where a count per vector cost
    // five instructions. Only then are they counted, by a second read of the gradients.
    __m256 seen = _mm256_setzero_ps();
    const std::size_t i =
        k.grad_scale == 1.0f ? loop<false>(c, a, lo, hi, seen) : loop<true>(c, a, lo, hi, seen);
    const __m256 d = _mm256_sub_ps(seen, seen);  // NaN exactly where seen is NaN or Inf
    const bool any = _mm256_movemask_ps(_mm256_cmp_ps(d, d, _CMP_UNORD_Q)) != 0;
    return (any ? count(k.grad_scale, a.g, a.grad_dtype, lo, i) : 0) +
           update_scalar<G, S, C>(k, a, i, hi);
  }
};

std::size_t update(const detail::AdamWScalars& k, const Arrays& a, std::size_t lo, std::size_t hi) {
  return pick<Avx2Impl>(a)(k, a, lo, hi);
}

}  // namespace

Kernels avx2_kernels() { return {&update, &count}; }

}  // namespace strata::cpu::adamw
