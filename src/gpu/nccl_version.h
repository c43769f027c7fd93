// NCCL's version: the code ncclGetVersion reports, decoded, and the oldest NCCL strata runs on.
// No NCCL header needed, so CPU-only tests can check the decoding.
#pragma once

#include <fmt/format.h>

#include <string>

namespace strata::gpu {

struct NcclVersion {
  int major = 0, minor = 0, patch = 0;
  std::string str() const { return fmt::format("{}.{}.{}", major, minor, patch); }
};

// major * 1000 + minor * 100 + patch up to 2.8; major * 10000 + minor * 100 + patch since 2.9
// (nccl.h's NCCL_VERSION).
inline NcclVersion decode_nccl_version(int code) {
  if (code < 10000) return {code / 1000, (code % 1000) / 100, code % 100};
  return {code / 10000, (code % 10000) / 100, code % 100};
}

// bf16 reductions (ncclBfloat16) and ncclAvg came in NCCL 2.10; the header we compile against
// has them whatever library is found at run time.
inline constexpr int kMinNcclCode = 21000;
inline constexpr const char* kMinNcclVersion = "2.10";

}  // namespace strata::gpu
