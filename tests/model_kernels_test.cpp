// The model's fp32 CPU kernels as the model runs them -- the vectorised row kernels of every
// ISA path this CPU can run (src/cpu/model_simd.h: scalar, AVX2, AVX-512) and the tiled oneDNN
// attention (src/cpu/model_attention.cpp) -- against the double-precision reference kernels
// (the code model_ops_test checks against finite differences), at odd sizes, on random
// non-zero inputs. An ISA this CPU lacks is skipped, never passed.
//
// Error measure per tensor: max |got - ref| / max |ref|. fp32 outputs: 2e-6 (a few fp32
// roundings and a 2-ulp exp; attention measured worst 6e-7), 1e-5 for the cross-entropy (sums
// over 1001 logits). bf16 outputs: bf16 keeps 8 significant bits, one rounding is up to 2^-9
// relative; bf16 attention products stack a few of those (1e-2).
#include "cpu/model_kernels.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "cpu/cpu_kernels.h"
#include "cpu/gemm_path.h"
#include "cpu/model_simd.h"
#include "strata/adamw.h"
#include "strata/dtype.h"
#include "strata/error.h"

namespace strata {
namespace {

using cpu::bf16_t;
using i64 = std::int64_t;

std::vector<float> randn(std::size_t n, unsigned seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) {
    x = d(rng);
    if (x == 0.0f) x = 0.5f;
  }
  return v;
}
std::vector<double> wide(const std::vector<float>& v) { return {v.begin(), v.end()}; }
std::vector<bf16_t> to_bf16(const std::vector<float>& v) {
  std::vector<bf16_t> o(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) o[i].bits = f32_to_bf16(v[i]);
  return o;
}
std::vector<float> of_bf16(const std::vector<bf16_t>& v) {
  std::vector<float> o(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) o[i] = bf16_to_f32(v[i].bits);
  return o;
}

template <class A>
double rel_err(const std::vector<A>& got, const std::vector<double>& ref) {
  EXPECT_EQ(got.size(), ref.size());
  double num = 0, den = 0;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    num = std::max(num, std::fabs(double(got[i]) - ref[i]));
    den = std::max(den, std::fabs(ref[i]));
  }
  return num / std::max(den, 1e-300);
}

class ModelKernels : public ::testing::TestWithParam<Isa> {
 protected:
  void SetUp() override {
    if (!isa_supported(GetParam()))
      GTEST_SKIP() << "this CPU cannot run the " << isa_name(GetParam()) << " path";
    cpu::simd::set_model_isa(GetParam());
    ASSERT_EQ(cpu::simd::model_isa(), GetParam());
  }
  void TearDown() override { cpu::simd::set_model_isa(Isa::kAuto); }
};

TEST_P(ModelKernels, Bf16CastsAreExactIncludingSpecialValues) {
  std::vector<float> x = randn(1000, 1, 3.0f);
  const float specials[] = {0.0f,       -0.0f,   INFINITY, -INFINITY,
                            NAN,        -NAN,    1e-40f,   -1e-40f,
                            1e-45f,     3.4e38f, -3.4e38f, 1.00390625f /* a tie: 1 + 2^-8 */,
                            1.01171875f /* tie, odd */};
  for (std::size_t i = 0; i < std::size(specials); ++i) x[i * 7] = specials[i];
  std::uint32_t u = 0x3f808000u;  // more ties, and bit patterns near the rounding boundary
  for (std::size_t i = 500; i < 600; ++i, u += 0x7fffu) std::memcpy(&x[i], &u, 4);
  std::vector<std::uint16_t> b(x.size());
  cpu::cast(DType::kF32, x.data(), DType::kBF16, b.data(), x.size());
  for (std::size_t i = 0; i < x.size(); ++i)
    ASSERT_EQ(b[i], f32_to_bf16(x[i])) << i << ": " << x[i];
  std::vector<float> back(x.size());
  cpu::cast(DType::kBF16, b.data(), DType::kF32, back.data(), x.size());
  for (std::size_t i = 0; i < x.size(); ++i) {
    const float want = bf16_to_f32(b[i]);
    ASSERT_EQ(std::memcmp(&back[i], &want, 4), 0) << i;
  }
}

TEST_P(ModelKernels, RmsNormForwardAndBackward) {
  const i64 n = 7, c = 37;
  const std::vector<float> x = randn(n * c, 2), w = randn(c, 3), dout = randn(n * c, 4);
  const std::vector<bf16_t> wb = to_bf16(w);
  for (bool w_bf16 : {false, true}) {
    const std::vector<float> wv = w_bf16 ? of_bf16(wb) : w;
    std::vector<double> ro(n * c), rr(n), rdx(n * c, 0.5), rdw(c, 0.25);
    const std::vector<double> xd = wide(x), wd = wide(wv), dd = wide(dout);
    cpu::rmsnorm_forward<double, double>(xd.data(), wd.data(), ro.data(), rr.data(), n, c, 1e-5);
    cpu::rmsnorm_backward<double, double>(dd.data(), xd.data(), wd.data(), rr.data(), rdx.data(),
                                          rdw.data(), n, c);

    std::vector<float> o(n * c), r(n), dx(n * c, 0.5f), dw(c, 0.25f);
    std::vector<bf16_t> ob(n * c);
    if (w_bf16) {
      cpu::rmsnorm_forward<float, bf16_t, float>(x.data(), wb.data(), o.data(), r.data(), n, c,
                                                 1e-5);
      cpu::rmsnorm_forward<float, bf16_t, bf16_t>(x.data(), wb.data(), ob.data(), r.data(), n, c,
                                                  1e-5);
      cpu::rmsnorm_backward<float, bf16_t>(dout.data(), x.data(), wb.data(), r.data(), dx.data(),
                                           dw.data(), n, c);
    } else {
      cpu::rmsnorm_forward<float, float, float>(x.data(), w.data(), o.data(), r.data(), n, c, 1e-5);
      cpu::rmsnorm_forward<float, float, bf16_t>(x.data(), w.data(), ob.data(), r.data(), n, c,
                                                 1e-5);
      cpu::rmsnorm_backward<float, float>(dout.data(), x.data(), w.data(), r.data(), dx.data(),
                                          dw.data(), n, c);
    }
    // With a bf16 copy of dx: the same dx, and the copy is dx rounded.
    std::vector<float> dx2(n * c, 0.5f), dw2(c, 0.25f);
    std::vector<bf16_t> dxb(n * c);
    if (w_bf16)
      cpu::rmsnorm_backward<float, bf16_t>(dout.data(), x.data(), wb.data(), r.data(), dx2.data(),
                                           dw2.data(), n, c, dxb.data());
    else
      cpu::rmsnorm_backward<float, float>(dout.data(), x.data(), w.data(), r.data(), dx2.data(),
                                          dw2.data(), n, c, dxb.data());
    EXPECT_EQ(std::memcmp(dx2.data(), dx.data(), dx.size() * 4), 0);
    for (std::size_t i = 0; i < dx.size(); ++i) ASSERT_EQ(dxb[i].bits, f32_to_bf16(dx[i])) << i;
    EXPECT_LT(rel_err(o, ro), 2e-6) << "w_bf16 " << w_bf16;
    EXPECT_LT(rel_err(r, rr), 2e-6);
    EXPECT_LT(rel_err(of_bf16(ob), ro), 1.0 / 256) << "one bf16 rounding";
    EXPECT_LT(rel_err(dx, rdx), 2e-6);
    EXPECT_LT(rel_err(dw, rdw), 2e-6);
  }
}

TEST_P(ModelKernels, LayerNormForwardAndBackward) {
  const i64 n = 6, c = 41;
  const std::vector<float> x = randn(n * c, 12, 2.0f), w = randn(c, 13), b = randn(c, 14),
                           dout = randn(n * c, 15);
  std::vector<double> ro(n * c), rm(n), rr(n), rdx(n * c, 0.5), rdw(c, 0.25), rdb(c, -0.25);
  const std::vector<double> xd = wide(x), wd = wide(w), bd = wide(b), dd = wide(dout);
  cpu::layernorm_forward<double, double>(xd.data(), wd.data(), bd.data(), ro.data(), rm.data(),
                                         rr.data(), n, c, 1e-5);
  cpu::layernorm_backward<double, double>(dd.data(), xd.data(), wd.data(), rm.data(), rr.data(),
                                          rdx.data(), rdw.data(), rdb.data(), n, c);
  std::vector<float> o(n * c), m(n), r(n), dx(n * c, 0.5f), dw(c, 0.25f), db(c, -0.25f);
  std::vector<bf16_t> ob(n * c);
  cpu::layernorm_forward<float, float, float>(x.data(), w.data(), b.data(), o.data(), m.data(),
                                              r.data(), n, c, 1e-5);
  cpu::layernorm_forward<float, float, bf16_t>(x.data(), w.data(), b.data(), ob.data(), m.data(),
                                               r.data(), n, c, 1e-5);
  cpu::layernorm_backward<float, float>(dout.data(), x.data(), w.data(), m.data(), r.data(),
                                        dx.data(), dw.data(), db.data(), n, c);
  EXPECT_LT(rel_err(o, ro), 2e-6);
  EXPECT_LT(rel_err(m, rm), 2e-6);
  EXPECT_LT(rel_err(r, rr), 2e-6);
  EXPECT_LT(rel_err(of_bf16(ob), ro), 1.0 / 256);
  EXPECT_LT(rel_err(dx, rdx), 2e-6);
  EXPECT_LT(rel_err(dw, rdw), 2e-6);
  EXPECT_LT(rel_err(db, rdb), 2e-6);
}

TEST_P(ModelKernels, GeluForwardAndBackward) {
  const i64 n = 9001;  // more than one 4096-element block, and a tail
  std::vector<float> x = randn(n, 16, 3.0f);
  x[0] = 30.0f;  // tanh saturates
  x[1] = -30.0f;
  const std::vector<float> dout = randn(n, 17);
  std::vector<double> ro(n), rdx(n);
  const std::vector<double> xd = wide(x), dd = wide(dout);
  cpu::gelu_forward<double>(xd.data(), ro.data(), n);
  cpu::gelu_backward<double>(dd.data(), xd.data(), rdx.data(), n);
  std::vector<float> o(n), dx(n);
  std::vector<bf16_t> ob(n);
  cpu::gelu_forward<float, float>(x.data(), o.data(), n);
  cpu::gelu_forward<float, bf16_t>(x.data(), ob.data(), n);
  cpu::gelu_backward<float>(dout.data(), x.data(), dx.data(), n);
  EXPECT_LT(rel_err(o, ro), 2e-6);
  EXPECT_LT(rel_err(of_bf16(ob), ro), 1.0 / 256);
  EXPECT_LT(rel_err(dx, rdx), 2e-6);
}

TEST_P(ModelKernels, SwiGluForwardAndBackward) {
  const i64 n = 5, inter = 43;
  const std::vector<float> gu = randn(n * 2 * inter, 5, 2.0f), dout = randn(n * inter, 6);
  std::vector<double> ro(n * inter), rdgu(n * 2 * inter);
  const std::vector<double> gud = wide(gu), dd = wide(dout);
  cpu::swiglu_forward<double>(gud.data(), ro.data(), n, inter);
  cpu::swiglu_backward<double>(dd.data(), gud.data(), rdgu.data(), n, inter);
  std::vector<float> o(n * inter), dgu(n * 2 * inter);
  std::vector<bf16_t> ob(n * inter), dgub(n * 2 * inter);
  cpu::swiglu_forward<float, float>(gu.data(), o.data(), n, inter);
  cpu::swiglu_forward<float, bf16_t>(gu.data(), ob.data(), n, inter);
  cpu::swiglu_backward<float, float>(dout.data(), gu.data(), dgu.data(), n, inter);
  cpu::swiglu_backward<float, bf16_t>(dout.data(), gu.data(), dgub.data(), n, inter);
  EXPECT_LT(rel_err(o, ro), 2e-6);
  EXPECT_LT(rel_err(dgu, rdgu), 2e-6);
  EXPECT_LT(rel_err(of_bf16(ob), ro), 1.0 / 256);
  EXPECT_LT(rel_err(of_bf16(dgub), rdgu), 1.0 / 256);
}

TEST_P(ModelKernels, RopeAndItsInverse) {
  const i64 t = 3, n = 6, heads = 3, hd = 10, stride = 37, col = 2;
  const std::vector<float> x = randn(n * stride, 7), ang = randn(t * hd / 2, 8, 3.0f);
  std::vector<float> cs(ang.size()), sn(ang.size());
  for (std::size_t i = 0; i < ang.size(); ++i) {
    cs[i] = std::cos(ang[i]);
    sn[i] = std::sin(ang[i]);
  }
  const std::vector<double> csd = wide(cs), snd = wide(sn);
  for (bool inverse : {false, true}) {
    std::vector<double> ref = wide(x);
    std::vector<float> got = x;
    cpu::rope_apply<double>(ref.data(), n, t, stride, col, heads, hd, csd.data(), snd.data(),
                            inverse);
    cpu::rope_apply<float>(got.data(), n, t, stride, col, heads, hd, cs.data(), sn.data(), inverse);
    EXPECT_LT(rel_err(got, ref), 2e-6) << "inverse " << inverse;
  }
}

TEST_P(ModelKernels, CrossEntropyLossAndGradient) {
  const i64 rows = 3, vocab = 1001;
  const std::vector<float> logits = randn(rows * vocab, 9, 4.0f);
  const std::vector<std::int32_t> tgt = {0, 500, 1000};
  for (double gs : {0.0, 1.0 / 3}) {
    std::vector<double> rl = wide(logits), rloss(rows);
    std::vector<float> l = logits, loss(rows), loss_b(rows);
    std::vector<bf16_t> gb(rows * vocab);
    cpu::cross_entropy<double>(rl.data(), tgt.data(), rloss.data(), rows, vocab, gs);
    cpu::cross_entropy<float>(l.data(), tgt.data(), loss.data(), rows, vocab, gs);
    std::vector<float> l2 = logits;
    cpu::cross_entropy<float, bf16_t>(l2.data(), tgt.data(), loss_b.data(), rows, vocab, gs,
                                      gb.data());
    // A sum over 1001 exps in fp32 (the portable loop's running sum is the least accurate).
    EXPECT_LT(rel_err(loss, rloss), 1e-5);
    EXPECT_LT(rel_err(loss_b, rloss), 1e-5);
    if (gs == 0) continue;
    EXPECT_LT(rel_err(l, rl), 1e-5) << "grad_scale " << gs;
    EXPECT_LT(rel_err(of_bf16(gb), rl), 1.0 / 256) << "bf16 gradient";
    EXPECT_EQ(std::memcmp(l2.data(), logits.data(), l2.size() * 4), 0)
        << "a bf16 gradient leaves the logits";
  }
}

// A row whose target is kIgnoreTarget: loss 0 and a zero gradient row (fp32 over the logits and
// bf16 into a buffer) on every path; the other rows exactly as without it.
TEST_P(ModelKernels, CrossEntropyIgnoredRowsAddNothing) {
  const i64 rows = 4, vocab = 777;
  const std::vector<float> logits = randn(rows * vocab, 13, 3.0f);
  const std::vector<std::int32_t> all = {5, 100, 776, 0}, some = {5, model_ops::kIgnoreTarget, 776,
                                                                  model_ops::kIgnoreTarget};
  for (double gs : {0.0, 0.25}) {
    std::vector<float> la = logits, ls = logits, lossa(rows), losss(rows, 7.0f);
    cpu::cross_entropy<float>(la.data(), all.data(), lossa.data(), rows, vocab, gs);
    cpu::cross_entropy<float>(ls.data(), some.data(), losss.data(), rows, vocab, gs);
    std::vector<double> rl = wide(logits), rloss(rows, 7.0);
    cpu::cross_entropy<double>(rl.data(), some.data(), rloss.data(), rows, vocab, gs);
    std::vector<float> lb = logits, lossb(rows, 7.0f);
    std::vector<bf16_t> gb(rows * vocab, bf16_t{0x3f80});  // 1.0: the ignored rows must be zeroed
    cpu::cross_entropy<float, bf16_t>(lb.data(), some.data(), lossb.data(), rows, vocab, gs,
                                      gb.data());
    for (i64 r = 0; r < rows; ++r) {
      const bool ignored = some[std::size_t(r)] == model_ops::kIgnoreTarget;
      EXPECT_EQ(losss[std::size_t(r)], ignored ? 0.0f : lossa[std::size_t(r)]) << r;
      if (ignored) {
        EXPECT_EQ(rloss[std::size_t(r)], 0.0) << r;
      }
      EXPECT_EQ(lossb[std::size_t(r)], losss[std::size_t(r)]) << r;
      if (gs == 0) continue;
      for (i64 i = 0; i < vocab; ++i) {
        const std::size_t k = std::size_t(r * vocab + i);
        if (ignored) {
          ASSERT_EQ(ls[k], 0.0f) << r << "," << i;
          ASSERT_EQ(rl[k], 0.0) << r << "," << i;
          ASSERT_EQ(gb[k].bits & 0x7fff, 0) << r << "," << i;
        } else {
          ASSERT_EQ(ls[k], la[k]) << r << "," << i;
        }
      }
    }
    if (gs != 0) {
      EXPECT_GT(std::fabs(la[std::size_t(vocab)]), 0.0f) << "a counted row's gradient";
    }
  }
}

struct AttnShape {
  i64 b, t, nh, nkv, hd;
};

// The attention the model runs (fp32 or bf16 products) against the double reference: o, lse and
// every element of dqkv. Shapes cross the query-block size (128 / group positions) and use
// grouped-query heads.
TEST_P(ModelKernels, TiledAttentionMatchesTheReference) {
  for (const AttnShape sh : {AttnShape{2, 37, 6, 2, 10}, AttnShape{1, 150, 4, 4, 16},
                             AttnShape{1, 200, 6, 2, 24}, AttnShape{3, 1, 2, 1, 8}}) {
    const i64 n = sh.b * sh.t, qkvd = (sh.nh + 2 * sh.nkv) * sh.hd, qd = sh.nh * sh.hd;
    const double scale = 1.0 / std::sqrt(double(sh.hd));
    const std::vector<float> qkv = randn(n * qkvd, 10), dout = randn(n * qd, 11);
    const std::vector<double> qkvd_ = wide(qkv), doutd = wide(dout);
    std::vector<double> ro(n * qd), rlse(sh.b * sh.nh * sh.t), rdqkv(n * qkvd);
    cpu::attention_forward<double>(qkvd_.data(), ro.data(), rlse.data(), sh.b, sh.t, sh.nh, sh.nkv,
                                   sh.hd, scale);
    cpu::attention_backward<double>(qkvd_.data(), ro.data(), doutd.data(), rlse.data(),
                                    rdqkv.data(), sh.b, sh.t, sh.nh, sh.nkv, sh.hd, scale);
    // bf16 on every route this host has: widened to oneDNN's fp32 GEMM, and oneDNN's own bf16.
    std::vector<std::pair<bool, cpu::GemmRoute>> runs{{false, cpu::GemmRoute::kNative},
                                                      {true, cpu::GemmRoute::kWidened}};
    if (cpu::gemm_native_available(DType::kBF16)) runs.emplace_back(true, cpu::GemmRoute::kNative);
    for (const auto& [bf16, route] : runs) {
      const cpu::GemmRoute was = cpu::gemm_route(DType::kBF16);
      if (bf16) cpu::set_gemm_route(DType::kBF16, route);
      struct Restore {
        cpu::GemmRoute r;
        ~Restore() { cpu::set_gemm_route(DType::kBF16, r); }
      } restore{was};
      std::vector<float> o(n * qd), lse(rlse.size()), dqkv(n * qkvd, NAN);
      std::vector<bf16_t> ob(n * qd);
      cpu::attention_forward_fast(qkv.data(), o.data(), ob.data(), lse.data(), sh.b, sh.t, sh.nh,
                                  sh.nkv, sh.hd, scale, bf16);
      cpu::attention_backward_fast(qkv.data(), o.data(), dout.data(), lse.data(), dqkv.data(), sh.b,
                                   sh.t, sh.nh, sh.nkv, sh.hd, scale, bf16);
      const std::string what =
          "b" + std::to_string(sh.b) + " t" + std::to_string(sh.t) + " nh" + std::to_string(sh.nh) +
          "/" + std::to_string(sh.nkv) +
          (bf16 ? std::string(" bf16 ") + cpu::gemm_route_name(route) : " fp32");
      // bf16: q, k, v, P, dO and dS are each rounded once (2^-9); the errors of S feed exp and
      // those of P and dS feed sums over keys. Measured worst 4.4e-3 (o), 4.1e-3 (dqkv).
      std::printf("[ attention] %s: o %.1e lse %.1e dqkv %.1e\n", what.c_str(), rel_err(o, ro),
                  rel_err(lse, rlse), rel_err(dqkv, rdqkv));
      EXPECT_LT(rel_err(o, ro), bf16 ? 1e-2 : 2e-6) << what;
      EXPECT_LT(rel_err(lse, rlse), bf16 ? 1e-2 : 2e-6) << what;
      EXPECT_LT(rel_err(dqkv, rdqkv), bf16 ? 1e-2 : 2e-6) << what;
      EXPECT_LT(rel_err(of_bf16(ob), wide(o)), 1.0 / 256) << what << ": o's bf16 copy";
      // Deterministic: the same call gives the same bits.
      std::vector<float> dqkv2(n * qkvd);
      cpu::attention_backward_fast(qkv.data(), o.data(), dout.data(), lse.data(), dqkv2.data(),
                                   sh.b, sh.t, sh.nh, sh.nkv, sh.hd, scale, bf16);
      EXPECT_EQ(std::memcmp(dqkv.data(), dqkv2.data(), dqkv.size() * 4), 0) << what;
    }
  }
}

// A oneDNN primitive that fails inside the attention's OpenMP team (here a failure injected into
// every product) comes out of the call as a strata::Error naming the product, not as
// std::terminate; the next call, with nothing injected, runs and is right.
TEST_P(ModelKernels, AFailingPrimitiveInTheAttentionIsAClearError) {
  // 4 tasks of enough work for the OpenMP team to take them in parallel.
  const i64 b = 2, t = 97, nh = 4, nkv = 2, hd = 13, n = b * t, qkvd = (nh + 2 * nkv) * hd;
  const double scale = 1.0 / std::sqrt(double(hd));
  const std::vector<float> qkv = randn(n * qkvd, 21);
  std::vector<float> o(n * nh * hd), lse(b * nh * t);
  for (bool bf16 : {false, true}) {
    cpu::fail_attention_gemms_for_testing(1000);
    try {
      cpu::attention_forward_fast(qkv.data(), o.data(), nullptr, lse.data(), b, t, nh, nkv, hd,
                                  scale, bf16);
      ADD_FAILURE() << "the injected failure did not come out";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kInternal);
      EXPECT_NE(std::string(e.what()).find("attention: oneDNN matmul"), std::string::npos)
          << e.what();
      EXPECT_NE(std::string(e.what()).find("a failure injected by a test"), std::string::npos)
          << e.what();
    }
    cpu::fail_attention_gemms_for_testing(0);
  }
  const std::vector<double> qkvd_ = wide(qkv);
  std::vector<double> ro(o.size()), rlse(lse.size());
  cpu::attention_forward<double>(qkvd_.data(), ro.data(), rlse.data(), b, t, nh, nkv, hd, scale);
  cpu::attention_forward_fast(qkv.data(), o.data(), nullptr, lse.data(), b, t, nh, nkv, hd, scale,
                              false);
  EXPECT_LT(rel_err(o, ro), 2e-6);
  EXPECT_LT(rel_err(lse, rlse), 2e-6);
}

// cpu::sum_squares (the gradient norm, hence clipping) has one order of additions on every
// path: 16 fp64 lanes (element i to lane i % 16) per 65536-element chunk, lanes combined
// pairwise, chunks in order. Written out here and compared bit for bit, every dtype the
// norm reads, at sizes with tails.
TEST_P(ModelKernels, SumOfSquaresHasOneOrderOnEveryPath) {
  for (std::size_t n : {1u, 15u, 16u, 17u, 2049u, 65536u, 65537u, 300001u}) {
    const auto x = randn(n, unsigned(n) + 3, 3.0f);
    for (DType t : {DType::kF32, DType::kBF16}) {
      std::vector<float> v = x;  // as stored
      std::vector<std::uint16_t> h(n);
      for (std::size_t i = 0; i < n; ++i) {
        h[i] = f32_to_bf16(x[i]);
        if (t == DType::kBF16) v[i] = bf16_to_f32(h[i]);
      }
      double total = 0;
      for (std::size_t lo = 0; lo < n; lo += 65536) {
        double lane[16] = {};
        for (std::size_t i = lo; i < std::min(n, lo + 65536); ++i)
          lane[(i - lo) % 16] += double(v[i]) * double(v[i]);
        for (std::size_t w = 8; w > 0; w /= 2)
          for (std::size_t j = 0; j < w; ++j) lane[j] += lane[j + w];
        total += lane[0];
      }
      const void* data = t == DType::kF32 ? static_cast<const void*>(x.data()) : h.data();
      const float got = cpu::sum_squares(t, data, n);
      EXPECT_EQ(std::bit_cast<std::uint32_t>(got), std::bit_cast<std::uint32_t>(float(total)))
          << "n=" << n << " " << dtype_name(t) << ": " << got << " vs " << float(total);
    }
  }
}

// cpu::SumSquares (the norm's part of a gradient on NVMe, taken a piece at a time as it is
// written): its runs, of any lengths — whole pages, or odd ones that leave a lane part-way —
// give sum_squares of the whole bit for bit.
TEST_P(ModelKernels, SumOfSquaresInRunsIsTheWholeSumBitForBit) {
  const std::size_t n = 300001;
  const auto x = randn(n, 9, 3.0f);
  const float whole = cpu::sum_squares(DType::kF32, x.data(), n);
  for (std::vector<std::size_t> runs : std::vector<std::vector<std::size_t>>{
           {n},
           {2048, 2048, 4096, n - 8192},
           {65536, 65536, n - 131072},
           {1, 15, 17, 65535, 3, n - 65571},
           {40000, 40000, 40000, 40000, 40000, 40000, 40000, n - 280000}}) {
    cpu::SumSquares s;
    std::size_t at = 0;
    for (std::size_t len : runs) {
      s.add(x.data() + at, len);
      at += len;
    }
    ASSERT_EQ(at, n);
    EXPECT_EQ(std::bit_cast<std::uint32_t>(s.result()), std::bit_cast<std::uint32_t>(whole))
        << runs.size() << " runs, the first " << runs[0];
  }
  for (std::size_t m : {std::size_t(0), std::size_t(5),
                        std::size_t(65536)}) {  // one run of at most a chunk, or none
    cpu::SumSquares s;
    s.add(x.data(), m);
    EXPECT_EQ(std::bit_cast<std::uint32_t>(s.result()),
              std::bit_cast<std::uint32_t>(cpu::sum_squares(DType::kF32, x.data(), m)))
        << m;
  }
}

INSTANTIATE_TEST_SUITE_P(Isas, ModelKernels,
                         ::testing::Values(Isa::kScalar, Isa::kAvx2, Isa::kAvx512),
                         [](const auto& info) { return std::string(isa_name(info.param)); });

TEST(ModelKernelsIsa, ForcingAPathThisCpuLacksIsAnError) {
  if (isa_supported(Isa::kAvx512)) GTEST_SKIP() << "this CPU runs every path";
  EXPECT_THROW(cpu::simd::set_model_isa(Isa::kAvx512), Error);
}

}  // namespace
}  // namespace strata
