// What every AdamW backend shares: validation of hyper-parameters and shards (so the CPU
// engine and Stream::adamw reject bad input with the same messages) and the per-step fp32
// scalars. The scalars are computed here once, in double, and rounded once; the CPU paths
// and the CUDA kernel receive these exact floats, which is half of why they agree bit for bit
// (the other half: the same fp32 operations in the same order, docs/adamw.md, "Semantics").
#include "core/adamw_common.h"

#include <cmath>
#include <string>

#include "strata/error.h"

namespace strata::detail {

void validate_adamw_options(const AdamWOptions& o) {
  STRATA_REQUIRE(std::isfinite(o.lr) && o.lr >= 0, "AdamW lr must be finite and >= 0, got {}",
                 o.lr);
  STRATA_REQUIRE(o.beta1 >= 0 && o.beta1 < 1, "AdamW beta1 must lie in [0, 1), got {}", o.beta1);
  STRATA_REQUIRE(o.beta2 >= 0 && o.beta2 < 1, "AdamW beta2 must lie in [0, 1), got {}", o.beta2);
  STRATA_REQUIRE(std::isfinite(o.eps) && o.eps >= 0, "AdamW eps must be finite and >= 0, got {}",
                 o.eps);
  STRATA_REQUIRE(std::isfinite(o.weight_decay) && o.weight_decay >= 0,
                 "AdamW weight_decay must be finite and >= 0, got {}", o.weight_decay);
  STRATA_REQUIRE(std::isfinite(o.grad_scale) && o.grad_scale >= 0,
                 "AdamW grad_scale must be finite and >= 0, got {} (pass 1/loss_scale * clip_coef)",
                 o.grad_scale);
  STRATA_REQUIRE(o.step >= 1, "AdamW step must be >= 1 (the first step is 1), got {}", o.step);
  // 1 - beta1^t must not round to 0, or the step size is infinite.
  STRATA_REQUIRE(!o.bias_correction || o.beta1 == 0 || 1.0 - std::pow(o.beta1, double(o.step)) > 0,
                 "AdamW bias correction 1 - beta1^t is 0 for beta1 {} at step {}", o.beta1, o.step);
}

AdamWScalars adamw_scalars(const AdamWOptions& o) {
  validate_adamw_options(o);
  AdamWScalars k{};
  const double t = double(o.step);
  const double bc1 = o.bias_correction ? 1.0 - std::pow(o.beta1, t) : 1.0;
  const double bc2 = o.bias_correction ? 1.0 - std::pow(o.beta2, t) : 1.0;
  k.decay = static_cast<float>(1.0 - o.lr * o.weight_decay);
  k.beta1 = static_cast<float>(o.beta1);
  k.beta2 = static_cast<float>(o.beta2);
  k.one_minus_beta1 = static_cast<float>(1.0 - o.beta1);
  k.one_minus_beta2 = static_cast<float>(1.0 - o.beta2);
  k.step_size = static_cast<float>(o.lr / bc1);
  k.inv_sqrt_bc2 = static_cast<float>(1.0 / std::sqrt(bc2));
  k.eps = static_cast<float>(o.eps);
  k.grad_scale = static_cast<float>(o.grad_scale);
  return k;
}

void validate_adamw_shard(const AdamWShard& s, std::string_view where) {
  struct Part {
    const TensorRef* t;
    const char* name;
  };
  const bool has_copy = s.copy_out.numel > 0 || s.copy_out.mem.ptr != nullptr;
  const Part parts[] = {{&s.params, "params"},
                        {&s.grads, "grads"},
                        {&s.m, "m"},
                        {&s.v, "v"},
                        {&s.copy_out, "copy_out"}};
  const std::size_t n = s.params.numel;
  STRATA_REQUIRE(n > 0, "{}: params has zero elements; leave empty shards out", where);
  auto check_memory = [&](const Part& p) {
    STRATA_REQUIRE(p.t->mem.ptr != nullptr, "{}: {} is a null buffer; pass its memory", where,
                   p.name);
    STRATA_REQUIRE(p.t->numel == n,
                   "{}: {} has {} elements but params has {}; every tensor of a shard must have "
                   "the same length",
                   where, p.name, p.t->numel, n);
    const std::size_t es = dtype_size(p.t->dtype);
    STRATA_REQUIRE(p.t->mem.bytes / es >= n,
                   "{}: {} claims {} elements but its memory holds {} bytes", where, p.name, n,
                   p.t->mem.bytes);
    STRATA_REQUIRE(reinterpret_cast<std::uintptr_t>(p.t->mem.ptr) % es == 0,
                   "{}: {} at {} is not aligned to its {}-byte elements", where, p.name,
                   p.t->mem.ptr, es);
  };
  for (const Part& p : parts) {
    if (p.t == &s.copy_out && !has_copy) continue;
    check_memory(p);
  }
  STRATA_REQUIRE(s.params.dtype == DType::kF32, "{}: params (master weights) must be fp32, got {}",
                 where, dtype_name(s.params.dtype));
  STRATA_REQUIRE(s.grads.dtype == DType::kF32 || s.grads.dtype == DType::kBF16,
                 "{}: grads must be fp32 or bf16, got {}", where, dtype_name(s.grads.dtype));
  STRATA_REQUIRE(s.m.dtype == s.v.dtype && (s.m.dtype == DType::kF32 || s.m.dtype == DType::kBF16),
                 "{}: m and v must both be fp32 or both bf16, got {} and {}", where,
                 dtype_name(s.m.dtype), dtype_name(s.v.dtype));
  STRATA_REQUIRE(!has_copy || s.copy_out.dtype == DType::kBF16 || s.copy_out.dtype == DType::kF16,
                 "{}: copy_out must be bf16 or fp16, got {}", where, dtype_name(s.copy_out.dtype));
  auto apart = [n](const TensorRef& x, const TensorRef& y) {
    const auto* a = static_cast<const char*>(x.mem.ptr);
    const auto* b = static_cast<const char*>(y.mem.ptr);
    return a + n * dtype_size(x.dtype) <= b || b + n * dtype_size(y.dtype) <= a;
  };
  // In-place aliasing would make the result depend on the order of loads and stores.
  for (std::size_t i = 0; i < std::size(parts); ++i) {
    for (std::size_t j = i + 1; j < std::size(parts); ++j) {
      if ((parts[i].t == &s.copy_out || parts[j].t == &s.copy_out) && !has_copy) continue;
      STRATA_REQUIRE(apart(*parts[i].t, *parts[j].t),
                     "{}: {} and {} overlap; give each its own memory", where, parts[i].name,
                     parts[j].name);
    }
  }

  // The out-of-place step's sources: every kernel loads element i of a source before it
  // stores element i of the destinations, so a source may be its own destination exactly
  // (the in-place step) but any other overlap would read values the step already wrote.
  const Part sources[] = {{&s.params_src, "params_src"}, {&s.m_src, "m_src"}, {&s.v_src, "v_src"}};
  const Part dests[] = {{&s.params, "params"}, {&s.m, "m"}, {&s.v, "v"}};
  std::string unset;
  std::size_t set = 0;
  for (const Part& p : sources) {
    if (p.t->numel > 0 || p.t->mem.ptr != nullptr)
      ++set;
    else
      unset += fmt::format(" {}", p.name);
  }
  if (set == 0) return;
  STRATA_REQUIRE(set == std::size(sources),
                 "{}: an out-of-place step needs params_src, m_src and v_src all set (or none "
                 "of them); not set:{}",
                 where, unset);
  for (std::size_t i = 0; i < std::size(sources); ++i) {
    const Part& src = sources[i];
    check_memory(src);
    STRATA_REQUIRE(src.t->dtype == dests[i].t->dtype,
                   "{}: {} is {} but {} is {}; a source has its destination's dtype", where,
                   src.name, dtype_name(src.t->dtype), dests[i].name,
                   dtype_name(dests[i].t->dtype));
    for (const Part& d : parts) {
      if (d.t == &s.grads || (d.t == &s.copy_out && !has_copy)) continue;
      if (d.t == dests[i].t && src.t->mem.ptr == d.t->mem.ptr) continue;
      STRATA_REQUIRE(apart(*src.t, *d.t),
                     "{}: {} overlaps {}; a source must be exactly its destination's memory (an "
                     "in-place step) or lie apart from params, m, v and copy_out",
                     where, src.name, d.name);
    }
  }
}

}  // namespace strata::detail
