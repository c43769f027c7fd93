// Element types strata moves and computes with, and exact scalar conversions.
// bf16/fp16 conversions round to nearest even, keep NaN a NaN, and handle subnormals;
// SIMD kernels must agree with these bit for bit.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string_view>

namespace strata {

enum class DType : std::uint8_t { kF32, kBF16, kF16, kF64 };

constexpr std::size_t dtype_size(DType t) {
  switch (t) {
    case DType::kF32:
      return 4;
    case DType::kBF16:
      return 2;
    case DType::kF16:
      return 2;
    case DType::kF64:
      return 8;
  }
  return 0;
}

std::string_view dtype_name(DType t);
// Parses "fp32"/"f32"/"float32", "bf16"/"bfloat16", "fp16"/"f16"/"float16", "fp64";
// throws strata::Error naming the allowed values otherwise.
DType parse_dtype(std::string_view name);

inline std::uint32_t f32_bits(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float f32_from_bits(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline std::uint16_t f32_to_bf16(float f) {
  std::uint32_t u = f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u)
    return static_cast<std::uint16_t>((u >> 16) | 0x40u);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<std::uint16_t>(u >> 16);
}
inline float bf16_to_f32(std::uint16_t h) { return f32_from_bits(std::uint32_t(h) << 16); }

std::uint16_t f32_to_f16(float f);
float f16_to_f32(std::uint16_t h);

}  // namespace strata
