// The AdamW arithmetic every backend shares (CPU paths, the CUDA kernel, the device wrapper's
// checks): the per-step scalars and the validation of options and shards. Internal: the public
// face of AdamW is include/strata/adamw.h.
#pragma once

#include <string_view>

#include "strata/adamw.h"

namespace strata {

namespace detail {
// The per-step fp32 scalars, computed once in double from the options and rounded once:
// the CPU paths and the CUDA kernel use exactly these.
struct AdamWScalars {
  float decay;  // 1 - lr * weight_decay
  float beta1, beta2;
  float one_minus_beta1, one_minus_beta2;
  float step_size;     // lr / (1 - beta1^t), or lr without bias correction
  float inv_sqrt_bc2;  // 1 / sqrt(1 - beta2^t), or 1
  float eps;
  float grad_scale;
};
// Throws kInvalidArgument naming the bad hyper-parameter and its allowed range.
void validate_adamw_options(const AdamWOptions& o);
AdamWScalars adamw_scalars(const AdamWOptions& o);
// Validates one shard's dtypes, lengths, pointers (non-null, element-aligned) and overlap,
// of the optional sources too (strata/device.h AdamWShard); `where` prefixes the messages
// (e.g. "CpuAdamW::step shard 3").
void validate_adamw_shard(const AdamWShard& s, std::string_view where);
}  // namespace detail

}  // namespace strata
