// The DeepSpeed-style loop's scalars and its dispatch to the width strata's kernels take (see
// adam_ds_style.h); the one-element-at-a-time path for CPUs (or STRATA_CPU_ISA caps) without
// AVX2.
#include "adam_ds_style.h"

#include <algorithm>
#include <cmath>
#include <random>

#include "adam_ds_style_simd.h"
#include "strata/error.h"

namespace strata::bench {

void ds_style_adamw_avx2(const DsStyleScalars& k, float* p, const float* g, float* m, float* v,
                         std::size_t lo, std::size_t hi);
void ds_style_adamw_avx512(const DsStyleScalars& k, float* p, const float* g, float* m, float* v,
                           std::size_t lo, std::size_t hi);

DsStyleScalars ds_style_scalars(const AdamWOptions& o) {
  const double t = double(o.step), lr = o.lr;
  const double bc1 = o.bias_correction ? 1 - std::pow(double(o.beta1), t) : 1;
  const double bc2 = o.bias_correction ? 1 - std::pow(double(o.beta2), t) : 1;
  DsStyleScalars k;
  k.beta1 = o.beta1;
  k.beta2 = o.beta2;
  k.one_minus_beta1 = float(1 - double(o.beta1));
  k.one_minus_beta2 = float(1 - double(o.beta2));
  k.step_size = float(-lr / bc1);
  k.w_decay = float(-lr * double(o.weight_decay));
  k.inv_sqrt_bc2 = float(1 / std::sqrt(bc2));
  k.eps = o.eps;
  return k;
}

void ds_style_adamw(Isa isa, const DsStyleScalars& k, float* p, const float* g, float* m, float* v,
                    std::size_t lo, std::size_t hi) {
  if (isa == Isa::kAuto) isa = adamw_selected_isa();
  STRATA_REQUIRE(isa_supported(isa), "the DeepSpeed-style loop cannot run {} here: {}",
                 isa_name(isa), isa_unavailable(isa));
  switch (isa) {
    case Isa::kAvx512:
      return ds_style_adamw_avx512(k, p, g, m, v, lo, hi);
    case Isa::kAvx2:
      return ds_style_adamw_avx2(k, p, g, m, v, lo, hi);
    default:
      return ds_style_scalar(k, p, g, m, v, lo, hi);
  }
}

namespace {

// torch.optim.AdamW's single-tensor step in double: decoupled decay, then the Adam update.
void reference_step(const AdamWOptions& o, const std::vector<double>& g, std::vector<double>& p,
                    std::vector<double>& m, std::vector<double>& v) {
  const double t = double(o.step), lr = o.lr;
  const double bc1 = 1 - std::pow(double(o.beta1), t), bc2 = 1 - std::pow(double(o.beta2), t);
  for (std::size_t i = 0; i < p.size(); ++i) {
    p[i] *= 1 - lr * double(o.weight_decay);
    m[i] = double(o.beta1) * m[i] + (1 - double(o.beta1)) * g[i];
    v[i] = double(o.beta2) * v[i] + (1 - double(o.beta2)) * g[i] * g[i];
    p[i] -= lr / bc1 * m[i] / (std::sqrt(v[i]) / std::sqrt(bc2) + double(o.eps));
  }
}

// The worst share of the tolerance (kDsStyleTolerance) of `steps` steps of the loop at `isa`.
double worst_of_tolerance(Isa isa, std::size_t n, int steps) {
  std::mt19937 rng(35);
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
  constexpr float kGradMax = 1e-2f;
  std::vector<float> p(n), m(n, 0.0f), v(n, 0.0f), g(n);
  std::vector<double> pr(n), mr(n, 0.0), vr(n, 0.0), gr(n);
  for (std::size_t i = 0; i < n; ++i) pr[i] = p[i] = unit(rng);
  AdamWOptions o;
  o.weight_decay = 0.01f;
  const double ulp = std::ldexp(1.0, -23), gmax = kGradMax;
  double worst = 0;
  for (int t = 1; t <= steps; ++t) {
    for (std::size_t i = 0; i < n; ++i) gr[i] = g[i] = kGradMax * unit(rng);
    o.step = t;
    ds_style_adamw(isa, ds_style_scalars(o), p.data(), g.data(), m.data(), v.data(), 0, n);
    reference_step(o, gr, pr, mr, vr);
    for (std::size_t i = 0; i < n; ++i) {
      const double ep = std::abs(p[i] - pr[i]) / (t * 2 * ulp * (std::abs(pr[i]) + 4 * o.lr));
      const double em = std::abs(m[i] - mr[i]) / (8 * ulp * (std::abs(mr[i]) + gmax));
      const double ev = std::abs(v[i] - vr[i]) / (8 * ulp * (std::abs(vr[i]) + gmax * gmax));
      worst = std::max({worst, ep, em, ev});
    }
  }
  return worst;
}

}  // namespace

DsStyleCheck check_ds_style(Isa widest) {
  DsStyleCheck c;
  // 3 passes of 8 AVX-512 vectors, then 4, 1 and 7 elements: every width sees each of its parts.
  c.elements = 16 * 8 * 3 + 16 * 4 + 16 + 7;
  c.steps = 10;
  for (Isa isa : {Isa::kScalar, Isa::kAvx2, Isa::kAvx512}) {
    const int rank = isa == Isa::kAvx512 ? 2 : isa == Isa::kAvx2 ? 1 : 0;
    const int top = widest == Isa::kAvx512 ? 2 : widest == Isa::kAvx2 ? 1 : 0;
    if (rank > top || !isa_supported(isa)) continue;
    c.isas.emplace_back(isa_name(isa));
    c.worst_of_tolerance =
        std::max(c.worst_of_tolerance, worst_of_tolerance(isa, c.elements, c.steps));
  }
  return c;
}

}  // namespace strata::bench
