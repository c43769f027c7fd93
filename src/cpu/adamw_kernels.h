// The per-ISA AdamW kernels behind CpuAdamW, and the scalar element step they all mirror.
//
// Each ISA lives in its own translation unit compiled with that ISA's target flags
// (src/cpu/CMakeLists.txt) and is only called after cpuid said the CPU has it. Everything
// in this header has internal linkage (the anonymous namespace): an inline function with
// external linkage instantiated in the AVX-512 file could otherwise be the copy the linker
// keeps for the scalar file, and crash a CPU without AVX-512. For the same reason the
// conversions below are private copies of strata/dtype.h's (bit-identical: the tests check)
// and the arithmetic uses compiler builtins, not <cmath>.
//
// The element step, in fp32, each operation rounded once (SIMD paths do the same, lane-wise):
//   g  = grad * grad_scale
//   p  = p * decay                                (decay = 1 - lr * weight_decay)
//   m  = fma(beta1, m, (1 - beta1) * g)
//   v  = fma(beta2, v, (1 - beta2) * (g * g))
//   d  = fma(sqrt(v), 1 / sqrt(bc2), eps)
//   p  = fma(-step_size, m / d, p)                (step_size = lr / bc1)
//   m, v stored (rounded to bf16 when the states are bf16), p stored, copy_out = round(p).
// p, m and v are loaded from p_src, m_src, v_src and stored to p, m, v: the same arrays for an
// in-place step, disjoint ones for an out-of-place step (element i is loaded before it is
// stored, so either way the bits are the same).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "core/adamw_common.h"

namespace strata::cpu::adamw {

enum class CopyKind { kNone, kBF16, kF16 };

// One shard's arrays, typed by the dispatcher.
struct Arrays {
  float* p;
  void* m;
  void* v;
  const float* p_src;  // p, m, v themselves when the shard has no sources
  const void* m_src;
  const void* v_src;
  const void* g;
  void* c;  // nullptr when there is no copy-out
  DType grad_dtype, state_dtype, copy_dtype;
  bool stream_copy;  // non-temporal stores for copy_out where the ISA path supports them
};

// Updates elements [lo, hi); returns how many scaled gradients were NaN or Inf.
using UpdateFn = std::size_t (*)(const detail::AdamWScalars& k, const Arrays& a, std::size_t lo,
                                 std::size_t hi);
// Counts NaN/Inf among grad[i] * grad_scale for i in [lo, hi); writes nothing.
using CountFn = std::size_t (*)(float grad_scale, const void* g, DType grad_dtype, std::size_t lo,
                                std::size_t hi);

struct Kernels {
  UpdateFn update;
  CountFn count_non_finite;
};

Kernels scalar_kernels();
Kernels avx2_kernels();
Kernels avx512_kernels(bool native_bf16);

namespace {

inline std::uint32_t bits_of(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float float_of(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline float load_bf16(std::uint16_t h) { return float_of(std::uint32_t(h) << 16); }
// Round to nearest even; NaN stays a quiet NaN with its top payload bits (as f32_to_bf16).
inline std::uint16_t store_bf16(float f) {
  std::uint32_t u = bits_of(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<std::uint16_t>(u >> 16);
}

inline bool finite(float x) { return __builtin_isfinite(x); }

// Elements [lo, hi) one at a time: the scalar path, and the tails of the AVX2 path.
template <bool kGradBf16, bool kStateBf16, CopyKind kCopy>
std::size_t update_scalar(const detail::AdamWScalars& k, const Arrays& a, std::size_t lo,
                          std::size_t hi) {
  std::size_t bad = 0;
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
  for (std::size_t i = lo; i < hi; ++i) {
    float g = kGradBf16 ? load_bf16(g16[i]) : g32[i];
    g = g * k.grad_scale;
    bad += finite(g) ? 0 : 1;
    float m = kStateBf16 ? load_bf16(m16_src[i]) : m32_src[i];
    float v = kStateBf16 ? load_bf16(v16_src[i]) : v32_src[i];
    float p = a.p_src[i] * k.decay;
    m = __builtin_fmaf(k.beta1, m, k.one_minus_beta1 * g);
    v = __builtin_fmaf(k.beta2, v, k.one_minus_beta2 * (g * g));
    const float d = __builtin_fmaf(__builtin_sqrtf(v), k.inv_sqrt_bc2, k.eps);
    p = __builtin_fmaf(-k.step_size, m / d, p);
    a.p[i] = p;
    if constexpr (kStateBf16) {
      m16[i] = store_bf16(m);
      v16[i] = store_bf16(v);
    } else {
      m32[i] = m;
      v32[i] = v;
    }
    if constexpr (kCopy == CopyKind::kBF16) c16[i] = store_bf16(p);
    if constexpr (kCopy == CopyKind::kF16) c16[i] = f32_to_f16(p);
  }
  return bad;
}

inline std::size_t count_scalar(float grad_scale, const void* g, DType t, std::size_t lo,
                                std::size_t hi) {
  std::size_t bad = 0;
  if (t == DType::kBF16) {
    const auto* g16 = static_cast<const std::uint16_t*>(g);
    for (std::size_t i = lo; i < hi; ++i) bad += finite(load_bf16(g16[i]) * grad_scale) ? 0 : 1;
  } else {
    const auto* g32 = static_cast<const float*>(g);
    for (std::size_t i = lo; i < hi; ++i) bad += finite(g32[i] * grad_scale) ? 0 : 1;
  }
  return bad;
}

// Picks the instantiation of `Impl<kGradBf16, kStateBf16, kCopy>::run` for a shard's dtypes.
template <template <bool, bool, CopyKind> class Impl>
UpdateFn pick(const Arrays& a) {
  const bool gb = a.grad_dtype == DType::kBF16, sb = a.state_dtype == DType::kBF16;
  const CopyKind ck = a.c == nullptr                 ? CopyKind::kNone
                      : a.copy_dtype == DType::kBF16 ? CopyKind::kBF16
                                                     : CopyKind::kF16;
  auto by_copy = [&]<bool G, bool S>() -> UpdateFn {
    switch (ck) {
      case CopyKind::kNone:
        return &Impl<G, S, CopyKind::kNone>::run;
      case CopyKind::kBF16:
        return &Impl<G, S, CopyKind::kBF16>::run;
      case CopyKind::kF16:
        return &Impl<G, S, CopyKind::kF16>::run;
    }
    return nullptr;
  };
  if (gb)
    return sb ? by_copy.template operator()<true, true>()
              : by_copy.template operator()<true, false>();
  return sb ? by_copy.template operator()<false, true>()
            : by_copy.template operator()<false, false>();
}

}  // namespace
}  // namespace strata::cpu::adamw
