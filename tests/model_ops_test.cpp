// Every transformer op's backward against central finite differences, in double precision
// (the CPU kernels instantiated for double), at small odd shapes, on random non-zero inputs.
// The scalar checked is L = sum(out * R) for a random R, so dout = R.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <random>
#include <vector>

#include "cpu/model_kernels.h"

namespace strata {
namespace {

using V = std::vector<double>;
using cpu::i64;

V rnd(std::size_t n, std::uint64_t seed, double lo = -1.5, double hi = 1.5) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> d(lo, hi);
  V v(n);
  for (auto& x : v) {
    do x = d(rng);
    while (std::fabs(x) < 1e-2);
  }
  return v;
}

double dotv(const V& a, const V& b) {
  double s = 0;
  for (std::size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

// Compares `analytic` with the central difference of loss() with respect to *x.
void expect_grad(const char* what, V* x, const V& analytic, const std::function<double()>& loss,
                 double tol = 1e-7) {
  ASSERT_EQ(x->size(), analytic.size()) << what;
  const double h = 1e-6;
  double worst = 0;
  for (std::size_t i = 0; i < x->size(); ++i) {
    const double keep = (*x)[i];
    (*x)[i] = keep + h;
    const double lp = loss();
    (*x)[i] = keep - h;
    const double lm = loss();
    (*x)[i] = keep;
    const double num = (lp - lm) / (2 * h);
    const double err = std::fabs(num - analytic[i]) / std::max(1.0, std::fabs(num));
    worst = std::max(worst, err);
    EXPECT_LT(err, tol) << what << "[" << i << "]: numeric " << num << ", analytic " << analytic[i];
  }
  EXPECT_GT(worst, 0.0) << what << ": suspiciously exact";
}

TEST(ModelOpsFd, RmsNorm) {
  const i64 n = 5, c = 7;
  V x = rnd(n * c, 1), w = rnd(c, 2), R = rnd(n * c, 3);
  auto loss = [&] {
    V out(n * c), rstd(n);
    cpu::rmsnorm_forward<double, double>(x.data(), w.data(), out.data(), rstd.data(), n, c, 1e-5);
    return dotv(out, R);
  };
  V out(n * c), rstd(n), dx(n * c, 0.0), dw(c, 0.0);
  cpu::rmsnorm_forward<double, double>(x.data(), w.data(), out.data(), rstd.data(), n, c, 1e-5);
  cpu::rmsnorm_backward<double, double>(R.data(), x.data(), w.data(), rstd.data(), dx.data(),
                                        dw.data(), n, c);
  expect_grad("rmsnorm dx", &x, dx, loss);
  expect_grad("rmsnorm dw", &w, dw, loss);
}

TEST(ModelOpsFd, LayerNorm) {
  const i64 n = 3, c = 9;
  V x = rnd(n * c, 4), w = rnd(c, 5), b = rnd(c, 6), R = rnd(n * c, 7);
  auto fwd = [&](V& out, V& mean, V& rstd) {
    cpu::layernorm_forward<double, double>(x.data(), w.data(), b.data(), out.data(), mean.data(),
                                           rstd.data(), n, c, 1e-5);
  };
  auto loss = [&] {
    V out(n * c), mean(n), rstd(n);
    fwd(out, mean, rstd);
    return dotv(out, R);
  };
  V out(n * c), mean(n), rstd(n), dx(n * c, 0.0), dw(c, 0.0), db(c, 0.0);
  fwd(out, mean, rstd);
  cpu::layernorm_backward<double, double>(R.data(), x.data(), w.data(), mean.data(), rstd.data(),
                                          dx.data(), dw.data(), db.data(), n, c);
  expect_grad("layernorm dx", &x, dx, loss);
  expect_grad("layernorm dw", &w, dw, loss);
  expect_grad("layernorm db", &b, db, loss);
}

TEST(ModelOpsFd, RopeIsARotationAndItsBackwardTheTranspose) {
  const i64 t = 5, n = 2 * t, heads = 3, hd = 6, stride = 23, col = 2;
  const V cs = [&] {
    V v(t * hd / 2);
    for (i64 p = 0; p < t; ++p)
      for (i64 i = 0; i < hd / 2; ++i)
        v[p * hd / 2 + i] = std::cos(p * std::pow(100.0, -2.0 * i / hd));
    return v;
  }();
  const V sn = [&] {
    V v(t * hd / 2);
    for (i64 p = 0; p < t; ++p)
      for (i64 i = 0; i < hd / 2; ++i)
        v[p * hd / 2 + i] = std::sin(p * std::pow(100.0, -2.0 * i / hd));
    return v;
  }();
  V x = rnd(n * stride, 8), R = rnd(n * stride, 9);
  auto loss = [&] {
    V y = x;
    cpu::rope_apply<double>(y.data(), n, t, stride, col, heads, hd, cs.data(), sn.data(), false);
    return dotv(y, R);
  };
  V dx = R;
  cpu::rope_apply<double>(dx.data(), n, t, stride, col, heads, hd, cs.data(), sn.data(), true);
  expect_grad("rope dx", &x, dx, loss);
  V y = x;  // forward then inverse is the identity
  cpu::rope_apply<double>(y.data(), n, t, stride, col, heads, hd, cs.data(), sn.data(), false);
  cpu::rope_apply<double>(y.data(), n, t, stride, col, heads, hd, cs.data(), sn.data(), true);
  for (std::size_t i = 0; i < y.size(); ++i) EXPECT_NEAR(y[i], x[i], 1e-12);
}

class AttentionFd : public ::testing::TestWithParam<std::array<i64, 3>> {};

TEST_P(AttentionFd, CausalGqa) {
  const auto [nh, nkv, hd] = GetParam();
  const i64 b = 2, t = 7, stride = (nh + 2 * nkv) * hd;
  const double scale = 1.0 / std::sqrt(double(hd));
  V qkv = rnd(b * t * stride, 10), R = rnd(b * t * nh * hd, 11);
  auto loss = [&] {
    V o(b * t * nh * hd), lse(b * nh * t);
    cpu::attention_forward<double>(qkv.data(), o.data(), lse.data(), b, t, nh, nkv, hd, scale);
    return dotv(o, R);
  };
  V o(b * t * nh * hd), lse(b * nh * t), dqkv(qkv.size(), 123.0);
  cpu::attention_forward<double>(qkv.data(), o.data(), lse.data(), b, t, nh, nkv, hd, scale);
  cpu::attention_backward<double>(qkv.data(), o.data(), R.data(), lse.data(), dqkv.data(), b, t, nh,
                                  nkv, hd, scale);
  expect_grad("attention dqkv", &qkv, dqkv, loss);
  // Causality: the first query row attends only to itself, so o = v of position 0.
  for (i64 h = 0; h < nh; ++h)
    for (i64 i = 0; i < hd; ++i)
      EXPECT_NEAR(o[h * hd + i], qkv[(nh + nkv + h / (nh / nkv)) * hd + i], 1e-12);
}

INSTANTIATE_TEST_SUITE_P(Shapes, AttentionFd,
                         ::testing::Values(std::array<i64, 3>{3, 3, 4}, std::array<i64, 3>{4, 2, 6},
                                           std::array<i64, 3>{6, 1, 2}));

TEST(ModelOpsFd, SwiGlu) {
  const i64 n = 3, inter = 5;
  V gu = rnd(n * 2 * inter, 12), R = rnd(n * inter, 13);
  auto loss = [&] {
    V out(n * inter);
    cpu::swiglu_forward<double>(gu.data(), out.data(), n, inter);
    return dotv(out, R);
  };
  V dgu(gu.size());
  cpu::swiglu_backward<double>(R.data(), gu.data(), dgu.data(), n, inter);
  expect_grad("swiglu dgu", &gu, dgu, loss);
}

TEST(ModelOpsFd, GeluTanh) {
  const i64 n = 17;
  V x = rnd(n, 14, -3, 3), R = rnd(n, 15);
  auto loss = [&] {
    V out(n);
    cpu::gelu_forward<double>(x.data(), out.data(), n);
    return dotv(out, R);
  };
  V dx(n);
  cpu::gelu_backward<double>(R.data(), x.data(), dx.data(), n);
  expect_grad("gelu dx", &x, dx, loss);
}

TEST(ModelOpsFd, BiasAndEmbedding) {
  const i64 n = 6, t = 3, c = 5, vocab = 4;
  V bias = rnd(c, 16), R = rnd(n * c, 17), y0 = rnd(n * c, 18);
  auto bloss = [&] {
    V y = y0;
    cpu::bias_add<double, double>(y.data(), bias.data(), n, c);
    return dotv(y, R);
  };
  V db(c, 0.0);
  cpu::bias_backward<double>(R.data(), db.data(), n, c);
  expect_grad("bias db", &bias, db, bloss);

  const std::vector<std::int32_t> tok = {3, 1, 3, 0, 2, 3};
  V wte = rnd(vocab * c, 19), wpe = rnd(t * c, 20);
  auto eloss = [&] {
    V out(n * c);
    cpu::embedding_forward<double, double>(tok.data(), wte.data(), wpe.data(), out.data(), n, t, c);
    return dotv(out, R);
  };
  V dwte(wte.size(), 0.0), dwpe(wpe.size(), 0.0);
  cpu::embedding_backward<double>(tok.data(), R.data(), dwte.data(), dwpe.data(), n, t, c);
  expect_grad("embedding dwte", &wte, dwte, eloss);
  expect_grad("embedding dwpe", &wpe, dwpe, eloss);
}

TEST(ModelOpsFd, CrossEntropy) {
  const i64 rows = 3, vocab = 11;
  V logits = rnd(rows * vocab, 21, -4, 4);
  const std::vector<std::int32_t> tgt = {4, 0, 10};
  const double scale = 1.0 / rows;
  auto loss = [&] {
    V l = logits, losses(rows);
    cpu::cross_entropy<double>(l.data(), tgt.data(), losses.data(), rows, vocab, 0.0);
    double s = 0;
    for (double v : losses) s += v;
    return s * scale;
  };
  V g = logits, losses(rows);
  cpu::cross_entropy<double>(g.data(), tgt.data(), losses.data(), rows, vocab, scale);
  expect_grad("cross_entropy dlogits", &logits, g, loss);
  // The loss itself against a direct log-softmax.
  for (i64 r = 0; r < rows; ++r) {
    double mx = -1e300, s = 0;
    for (i64 i = 0; i < vocab; ++i) mx = std::max(mx, logits[r * vocab + i]);
    for (i64 i = 0; i < vocab; ++i) s += std::exp(logits[r * vocab + i] - mx);
    EXPECT_NEAR(losses[r], mx + std::log(s) - logits[r * vocab + tgt[r]], 1e-12);
  }
}

}  // namespace
}  // namespace strata
