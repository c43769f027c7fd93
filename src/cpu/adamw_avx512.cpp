// The AVX-512 AdamW path, 16 lanes: compiled with -mavx512f -mavx512bw -mavx512vl
// -mavx512bf16 and called only when cpuid reports avx512f/bw/vl; the AVX512_BF16 conversion
// (vcvtneps2bf16) is used only where cpuid also reports avx512_bf16, else bf16 rounding is
// emulated with integer ops. Tails use masked loads and stores, so every element takes the
// same vector operations.
//
// vcvtneps2bf16 rounds to nearest even and quiets NaNs exactly as strata::f32_to_bf16, but
// it flushes fp32 subnormal inputs to zero where f32_to_bf16 rounds them; lanes holding a
// subnormal are redone with the integer emulation (a branch that practically never runs).
//
// With `stream_copy`, the copy-out is written with non-temporal stores where its address is
// 32-byte aligned: it is write-only, so ordinary stores would first read every line
// (read-for-ownership), 2 bytes per parameter that the step does not need. The caller only
// asks for it when the step is far larger than the caches. An out-of-place step (the early
// optimizer step's second copy) streams p, m and v the same way where they are aligned: 12
// bytes per parameter of fp32 state that ordinary stores would read first.
#include <immintrin.h>

#include "cpu/adamw_kernels.h"

namespace strata::cpu::adamw {
namespace {

inline __m512 load_bf16x16(const std::uint16_t* p, __mmask16 mk) {
  const __m256i h = mk == 0xffff ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))
                                 : _mm256_maskz_loadu_epi16(mk, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

inline __m256i emulate_bf16x16(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i rounded =
      _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
  const __mmask16 is_nan = _mm512_cmpgt_epu32_mask(
      _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
  return _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(is_nan, rounded, quiet));
}

template <bool kNative>
inline __m256i to_bf16x16(__m512 x) {
  if constexpr (kNative) {
    __m256i r = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(x));
    const __m512i u = _mm512_castps_si512(x);
    const __mmask16 subnormal = _mm512_testn_epi32_mask(u, _mm512_set1_epi32(0x7f800000)) &
                                _mm512_test_epi32_mask(u, _mm512_set1_epi32(0x007fffff));
    if (subnormal) [[unlikely]]
      r = _mm256_mask_blend_epi16(subnormal, r, emulate_bf16x16(x));
    return r;
  } else {
    return emulate_bf16x16(x);
  }
}

inline unsigned bad_lanes(__m512 g, __mmask16 mk) {
  const __m512 d = _mm512_sub_ps(g, g);  // NaN exactly where g is NaN or Inf
  return static_cast<unsigned>(__builtin_popcount(_mm512_mask_cmp_ps_mask(mk, d, d, _CMP_UNORD_Q)));
}

std::size_t count(float grad_scale, const void* g, DType t, std::size_t lo, std::size_t hi) {
  const __m512 gs = _mm512_set1_ps(grad_scale);
  std::size_t bad = 0;
  for (std::size_t i = lo; i < hi; i += 16) {
    const __mmask16 mk =
        hi - i >= 16 ? __mmask16(0xffff) : static_cast<__mmask16>((1u << (hi - i)) - 1);
    const __m512 x = t == DType::kBF16
                         ? load_bf16x16(static_cast<const std::uint16_t*>(g) + i, mk)
                         : _mm512_maskz_loadu_ps(mk, static_cast<const float*>(g) + i);
    bad += bad_lanes(_mm512_mul_ps(x, gs), mk);
  }
  return bad;
}

template <bool kNative>
struct Isa512 {
  template <bool G, bool S, CopyKind C>
  struct Impl {
    static std::size_t run(const detail::AdamWScalars& k, const Arrays& a, std::size_t lo,
                           std::size_t hi) {
      const auto aligned = [](const void* q, std::size_t to) {
        return reinterpret_cast<std::uintptr_t>(q) % to == 0;
      };
      const std::size_t ssz = S ? 2 : 4;  // bytes per m / v element
      const bool nt = C != CopyKind::kNone && a.stream_copy &&
                      aligned(static_cast<const char*>(a.c) + 2 * lo, 32);
      // Out of place, p, m and v are write-only too (their sources are other arrays).
      const bool nt_state = a.stream_copy && a.p != a.p_src && aligned(a.p + lo, 64) &&
                            aligned(static_cast<const char*>(a.m) + ssz * lo, 16 * ssz) &&
                            aligned(static_cast<const char*>(a.v) + ssz * lo, 16 * ssz);
      // Without kScaled the gradients are not multiplied by grad_scale, which is 1 then: g * 1
      // is g, bit for bit (a NaN's payload and quietness aside, which the next operation on it
      // gives every path alike).
      const bool scaled = k.grad_scale != 1.0f;
      const bool any = nt_state ? (nt ? loop2<true, true>(scaled, k, a, lo, hi)
                                      : loop2<false, true>(scaled, k, a, lo, hi))
                                : (nt ? loop2<true, false>(scaled, k, a, lo, hi)
                                      : loop2<false, false>(scaled, k, a, lo, hi));
      if (nt || nt_state)
        _mm_sfence();  // order the streaming stores before whoever reads them next
      // Non-finite gradients are counted by a second read, only when the step found some.
      return any ? count(k.grad_scale, a.g, a.grad_dtype, lo, hi) : 0;
    }

    template <bool kStream, bool kStreamState>
    static bool loop2(bool scaled, const detail::AdamWScalars& k, const Arrays& a, std::size_t lo,
                      std::size_t hi) {
      return scaled ? loop<kStream, kStreamState, true>(k, a, lo, hi)
                    : loop<kStream, kStreamState, false>(k, a, lo, hi);
    }

    // Whether a scaled gradient of [lo, hi) was NaN or Inf.
    template <bool kStream, bool kStreamState, bool kScaled>
    static bool loop(const detail::AdamWScalars& k, const Arrays& arrays, std::size_t lo,
                     std::size_t hi) {
      // A local copy: the stores cannot change its pointers, so they stay in registers.
      const Arrays a = arrays;
      const __m512 gs = _mm512_set1_ps(k.grad_scale), decay = _mm512_set1_ps(k.decay);
      const __m512 b1 = _mm512_set1_ps(k.beta1), b2 = _mm512_set1_ps(k.beta2);
      const __m512 omb1 = _mm512_set1_ps(k.one_minus_beta1),
                   omb2 = _mm512_set1_ps(k.one_minus_beta2);
      const __m512 isb2 = _mm512_set1_ps(k.inv_sqrt_bc2), eps = _mm512_set1_ps(k.eps);
      const __m512 neg_step = _mm512_set1_ps(-k.step_size);
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
      // seen + g0 * g1 over pairs of gradient vectors stays finite while they are (masked-off
      // lanes load 0; a sum that overflows only costs the caller's count) and is NaN or Inf for
      // good from the first NaN or Inf on (Inf * 0 is NaN): one fused multiply-add for two.
      __m512 seen = _mm512_setzero_ps();
      auto load_g = [&](std::size_t i, __mmask16 mk) __attribute__((always_inline)) {
        return G ? load_bf16x16(g16 + i, mk) : _mm512_maskz_loadu_ps(mk, g32 + i);
      };
      // The element step, lane-wise, on the vector from i whose scaled gradients are g.
      auto step = [&](__m512 g, std::size_t i, __mmask16 mk, __m512 & m, __m512 & v, __m512 & p)
          __attribute__((always_inline)) {
        m = S ? load_bf16x16(m16_src + i, mk) : _mm512_maskz_loadu_ps(mk, m32_src + i);
        v = S ? load_bf16x16(v16_src + i, mk) : _mm512_maskz_loadu_ps(mk, v32_src + i);
        p = _mm512_mul_ps(_mm512_maskz_loadu_ps(mk, a.p_src + i), decay);
        m = _mm512_fmadd_ps(b1, m, _mm512_mul_ps(omb1, g));
        v = _mm512_fmadd_ps(b2, v, _mm512_mul_ps(omb2, _mm512_mul_ps(g, g)));
        const __m512 d = _mm512_fmadd_ps(_mm512_sqrt_ps(v), isb2, eps);
        p = _mm512_fmadd_ps(neg_step, _mm512_div_ps(m, d), p);
      };
      auto store_p = [&](std::size_t i, __mmask16 mk, bool full, __m512 p)
          __attribute__((always_inline)) {
        if (kStreamState && full)
          _mm512_stream_ps(a.p + i, p);
        else
          _mm512_mask_storeu_ps(a.p + i, mk, p);
      };
      // m or v (`s32`, `s16`: its fp32 and bf16 views).
      auto store_state = [&](float* s32, std::uint16_t* s16, std::size_t i, __mmask16 mk, bool full,
                             __m512 x) __attribute__((always_inline)) {
        if constexpr (S) {
          if (kStreamState && full)
            _mm256_stream_si256(reinterpret_cast<__m256i*>(s16 + i), to_bf16x16<kNative>(x));
          else if (full)
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(s16 + i), to_bf16x16<kNative>(x));
          else
            _mm256_mask_storeu_epi16(s16 + i, mk, to_bf16x16<kNative>(x));
        } else if (kStreamState && full) {
          _mm512_stream_ps(s32 + i, x);
        } else {
          _mm512_mask_storeu_ps(s32 + i, mk, x);
        }
      };
      auto store_copy = [&](std::size_t i, __mmask16 mk, bool full, __m512 p)
          __attribute__((always_inline)) {
        if constexpr (C != CopyKind::kNone) {
          const __m256i c = C == CopyKind::kBF16
                                ? to_bf16x16<kNative>(p)
                                : _mm512_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
          if (kStream && full)
            _mm256_stream_si256(reinterpret_cast<__m256i*>(c16 + i), c);
          else
            _mm256_mask_storeu_epi16(c16 + i, mk, c);
        }
      };
      // kU vectors from i: their gradients loaded together, the stores grouped by array.
      auto block = [&]<int kU>(std::size_t i, __mmask16 mk, bool full)
          __attribute__((always_inline)) {
        __m512 g[kU], m[kU], v[kU], p[kU];
        for (int u = 0; u < kU; ++u) {
          g[u] = load_g(i + 16 * u, mk);
          if constexpr (kScaled) g[u] = _mm512_mul_ps(g[u], gs);
        }
        for (int u = 0; u < kU; u += 2)
          seen = _mm512_fmadd_ps(g[u], g[u + 1 < kU ? u + 1 : u], seen);
        for (int u = 0; u < kU; ++u) step(g[u], i + 16 * u, mk, m[u], v[u], p[u]);
        for (int u = 0; u < kU; ++u) store_p(i + 16 * u, mk, full, p[u]);
        for (int u = 0; u < kU; ++u) store_state(m32, m16, i + 16 * u, mk, full, m[u]);
        for (int u = 0; u < kU; ++u) store_state(v32, v16, i + 16 * u, mk, full, v[u]);
        for (int u = 0; u < kU; ++u) store_copy(i + 16 * u, mk, full, p[u]);
      };
      std::size_t i = lo;
      constexpr int kUnroll = 4;  // 4 cache lines of each fp32 array an iteration
      for (; i + 16 * kUnroll <= hi; i += 16 * kUnroll)
        block.template operator()<kUnroll>(i, 0xffff, true);
      for (; i + 16 <= hi; i += 16) block.template operator()<1>(i, 0xffff, true);
      if (i < hi)
        block.template operator()<1>(i, static_cast<__mmask16>((1u << (hi - i)) - 1), false);
      const __m512 d = _mm512_sub_ps(seen, seen);  // NaN exactly where seen is NaN or Inf
      return _mm512_cmp_ps_mask(d, d, _CMP_UNORD_Q) != 0;
    }
  };
};

template <bool kNative>
std::size_t update(const detail::AdamWScalars& k, const Arrays& a, std::size_t lo, std::size_t hi) {
  return pick<Isa512<kNative>::template Impl>(a)(k, a, lo, hi);
}

}  // namespace

Kernels avx512_kernels(bool native_bf16) {
  return native_bf16 ? Kernels{&update<true>, &count} : Kernels{&update<false>, &count};
}

}  // namespace strata::cpu::adamw
