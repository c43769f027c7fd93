// A DeepSpeed-style AdamW loop: strata's own rendering of what DeepSpeed's cpu_adam runs in its
// AVX step (Step_AVX), written from the algorithm, for strata-bench adam to time beside strata's
// step. It is not DeepSpeed: no DeepSpeed code is used or called.
//
// What it does, as cpu_adam does in AdamW mode with fp32 params, grads and states, in place:
//   m = m * beta1;  m = fma(g, 1 - beta1, m)
//   v = v * beta2;  v = fma(g * g, 1 - beta2, v)
//   d = fma(sqrt(v), 1 / sqrt(1 - beta2^t), eps)
//   p = fma(p, w_decay, p)                        (w_decay = -lr * weight_decay)
//   p = fma(m / d, step_size, p)                  (step_size = -lr / (1 - beta1^t))
// in vectors of 8 (AVX2 + FMA) or 16 (AVX-512) lanes, unrolled over 8 vectors, then 4, then 1
// (cpu_adam's Step_8, Step_4, Step_1), the last elements one at a time. No gradient scale and
// no non-finite detection: cpu_adam has neither. The vector widths follow the same run-time
// choice as strata's kernels (STRATA_CPU_ISA caps both); each lives in its own file compiled
// for its ISA (tools/CMakeLists.txt), as src/cpu's kernels do.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "strata/adamw.h"

namespace strata::bench {

// One step's fp32 scalars, computed in double and rounded once.
struct DsStyleScalars {
  float beta1, beta2;
  float one_minus_beta1, one_minus_beta2;
  float step_size;     // -lr / (1 - beta1^t), or -lr without bias correction
  float w_decay;       // -lr * weight_decay
  float inv_sqrt_bc2;  // 1 / sqrt(1 - beta2^t), or 1
  float eps;
};
// From strata's options (grad_scale is not used: cpu_adam takes unscaled gradients).
DsStyleScalars ds_style_scalars(const AdamWOptions& o);

// Steps fp32 p, m, v in place over elements [lo, hi) with the fp32 gradient g, in vectors of
// `isa`'s width (kScalar: one element at a time). `isa` must be supported here (kAuto: the
// width strata's AdamW kernels take).
void ds_style_adamw(Isa isa, const DsStyleScalars& k, float* p, const float* g, float* m, float* v,
                    std::size_t lo, std::size_t hi);

// The loop held to AdamW before it is timed, so that the comparison is with a correct AdamW:
// `steps` steps over `elements` elements (an odd count that every unrolled width and the
// one-at-a-time end see) at each width this host may run up to `widest`, against
// torch.optim.AdamW's update in double from the same random start.
struct DsStyleCheck {
  std::vector<std::string> isas;  // the widths checked
  std::size_t elements = 0;
  int steps = 0;
  // The largest error of p, m or v as a share of its tolerance (kDsStyleTolerance): <= 1 passes.
  double worst_of_tolerance = 0;
};
inline constexpr const char* kDsStyleTolerance =
    "per element after t steps, |p - p_ref| <= t * 2^-22 * (|p_ref| + 4 lr), |m - m_ref| <= 2^-20 "
    "* (|m_ref| + g_max), |v - v_ref| <= 2^-20 * (|v_ref| + g_max^2), p_ref, m_ref, v_ref from "
    "AdamW in double";
DsStyleCheck check_ds_style(Isa widest);

}  // namespace strata::bench
