#include "strata/dtype.h"

#include <cmath>

#include "strata/error.h"

namespace strata {

std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::kF32:
      return "fp32";
    case DType::kBF16:
      return "bf16";
    case DType::kF16:
      return "fp16";
    case DType::kF64:
      return "fp64";
  }
  return "?";
}

DType parse_dtype(std::string_view n) {
  if (n == "fp32" || n == "f32" || n == "float32" || n == "float") return DType::kF32;
  if (n == "bf16" || n == "bfloat16") return DType::kBF16;
  if (n == "fp16" || n == "f16" || n == "float16" || n == "half") return DType::kF16;
  if (n == "fp64" || n == "f64" || n == "float64" || n == "double") return DType::kF64;
  STRATA_THROW(kInvalidArgument, "unknown dtype '{}': use one of fp32, bf16, fp16, fp64", n);
}

// IEEE binary16, round to nearest even, subnormals and NaN/Inf preserved.
std::uint16_t f32_to_f16(float f) {
  const std::uint32_t u = f32_bits(f);
  const std::uint16_t sign = static_cast<std::uint16_t>((u >> 16) & 0x8000u);
  const std::uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | 0x7e00u | static_cast<std::uint16_t>((a >> 13) & 0x3ffu);
  if (a >= 0x477ff000u) return sign | 0x7c00u;  // rounds to >= 65520: overflow to Inf
  if (a < 0x38800000u) {                        // below the smallest normal half (2^-14)
    // Subnormal half: value = m * 2^-24. Use float arithmetic for exact RNE.
    const float mag = f32_from_bits(a);
    const float scaled = mag * 16777216.0f;  // 2^24, exact
    const auto m = static_cast<std::uint16_t>(std::nearbyint(scaled));
    return sign | m;
  }
  std::uint32_t r = a - 0x38000000u;  // rebias exponent 127 -> 15
  r += 0xfffu + ((r >> 13) & 1u);
  return sign | static_cast<std::uint16_t>(r >> 13);
}

float f16_to_f32(std::uint16_t h) {
  const std::uint32_t sign = std::uint32_t(h & 0x8000u) << 16;
  const std::uint32_t exp = (h >> 10) & 0x1fu;
  const std::uint32_t man = h & 0x3ffu;
  if (exp == 0) {
    const float v = std::ldexp(static_cast<float>(man), -24);
    return sign ? -v : v;
  }
  if (exp == 31) return f32_from_bits(sign | 0x7f800000u | (man << 13));
  return f32_from_bits(sign | ((exp + 112u) << 23) | (man << 13));
}

}  // namespace strata
