// CpuAdamW against a double-precision scalar reference of torch.optim.AdamW, on every ISA
// path this CPU has (each forced in turn), at odd sizes and unaligned pointers, with fp32 and
// bf16 gradients, fp32 and bf16 states, bf16/fp16 copy-out, with and without weight decay and
// bias correction, after 1 and after 100 steps. Also: every path equals the scalar path bit
// for bit, bf16/fp16 rounding equals strata/dtype.h on special values, non-finite gradients
// are counted and (kSkipStep) leave every byte untouched, and bad input is a clear error.
// The out-of-place step (params_src, m_src, v_src) equals the in-place step bit for bit on
// every path and leaves its sources byte for byte as they were.
//
// Tolerances (per element, after t steps; ulp = 2^-23):
//  - fp32 states: |p - p_ref| <= t * 2 ulp * (|p_ref| + 4 lr), |m - m_ref| <= 8 ulp * (|m_ref| +
//  gmax),
//    |v - v_ref| <= 8 ulp * (|v_ref| + gmax^2), where gmax bounds |grad * grad_scale|.
//  - bf16 states: the reference rounds m and v to bf16 after each step too, and continues
//    from the kernel's m and v each step (a bf16 EMA turns one near-tie rounded the other way
//    into a lasting, growing difference, so the map is checked step by step while p is
//    compared over the whole trajectory): the fp32 bounds for m and v plus one bf16 ulp
//    (2^-7 |m_ref|, 2^-7 |v_ref|), and |p - p_ref| <= t * (2 ulp |p_ref| + 2^-5 lr).
//  - copy_out equals the rounding of the kernel's own p exactly.
#include "strata/adamw.h"

#include <gtest/gtest.h>
#include <sched.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "strata/error.h"

namespace strata {
namespace {

constexpr double kUlp = 1.0 / (1 << 23);

std::vector<Isa> supported_isas() {
  std::vector<Isa> out;
  for (Isa i : {Isa::kScalar, Isa::kAvx2, Isa::kAvx512})
    if (isa_supported(i)) out.push_back(i);
  return out;
}

// Host arrays with a deliberate misalignment of `offset` elements from a 64-byte boundary.
template <class T>
struct Array {
  Array(std::size_t n, std::size_t offset) : store((n + offset + 64) * sizeof(T) + 64), n(n) {
    auto base = reinterpret_cast<std::uintptr_t>(store.data());
    base = (base + 63) / 64 * 64 + offset * sizeof(T);
    ptr = reinterpret_cast<T*>(base);
  }
  T* data() { return ptr; }
  T& operator[](std::size_t i) { return ptr[i]; }
  std::vector<unsigned char> store;
  std::size_t n;
  T* ptr;
};

struct Mode {
  DType grad = DType::kF32;
  DType state = DType::kF32;
  DType copy = DType::kBF16;  // kF32 here = no copy-out
  double weight_decay = 0.0;
  bool bias_correction = true;
};

std::string describe(const Mode& m, std::size_t n, Isa isa) {
  return fmt::format("isa {} n {} grads {} states {} copy {} wd {} bc {}", isa_name(isa), n,
                     dtype_name(m.grad), dtype_name(m.state),
                     m.copy == DType::kF32 ? "none" : dtype_name(m.copy), m.weight_decay,
                     m.bias_correction);
}

// One engine's state for one shard, in the dtypes of `mode`.
struct State {
  State(std::size_t n, const Mode& mode, std::size_t offset)
      : p(n, offset),
        m32(n, offset),
        v32(n, offset),
        m16(n, offset),
        v16(n, offset),
        g32(n, offset),
        g16(n, offset),
        c16(n, offset),
        mode(mode),
        n(n) {}
  Array<float> p, m32, v32;
  Array<std::uint16_t> m16, v16;
  Array<float> g32;
  Array<std::uint16_t> g16, c16;
  Mode mode;
  std::size_t n;

  AdamWShard shard() {
    const bool sb = mode.state == DType::kBF16;
    AdamWShard s;
    s.params = host_tensor(p.data(), DType::kF32, n);
    s.grads = mode.grad == DType::kBF16 ? host_tensor(g16.data(), DType::kBF16, n)
                                        : host_tensor(g32.data(), DType::kF32, n);
    s.m = sb ? host_tensor(m16.data(), DType::kBF16, n) : host_tensor(m32.data(), DType::kF32, n);
    s.v = sb ? host_tensor(v16.data(), DType::kBF16, n) : host_tensor(v32.data(), DType::kF32, n);
    if (mode.copy != DType::kF32) s.copy_out = host_tensor(c16.data(), mode.copy, n);
    return s;
  }
  float m(std::size_t i) { return mode.state == DType::kBF16 ? bf16_to_f32(m16[i]) : m32[i]; }
  float v(std::size_t i) { return mode.state == DType::kBF16 ? bf16_to_f32(v16[i]) : v32[i]; }
  // The gradient as the kernel reads it (bf16 grads are rounded from the fp32 draw).
  float g(std::size_t i) { return mode.grad == DType::kBF16 ? bf16_to_f32(g16[i]) : g32[i]; }
};

// torch.optim.AdamW's single-tensor step, in double (states optionally rounded to bf16).
struct Reference {
  std::vector<double> p, m, v;
  void step(const AdamWOptions& o, const std::vector<double>& g, bool bf16_states) {
    const double t = double(o.step);
    const double bc1 = o.bias_correction ? 1 - std::pow(o.beta1, t) : 1;
    const double bc2 = o.bias_correction ? 1 - std::pow(o.beta2, t) : 1;
    for (std::size_t i = 0; i < p.size(); ++i) {
      const double gi = g[i] * o.grad_scale;
      p[i] *= 1 - o.lr * o.weight_decay;
      m[i] = o.beta1 * m[i] + (1 - o.beta1) * gi;
      v[i] = o.beta2 * v[i] + (1 - o.beta2) * gi * gi;
      const double denom = std::sqrt(v[i]) / std::sqrt(bc2) + o.eps;
      p[i] -= o.lr / bc1 * m[i] / denom;
      if (bf16_states) {
        m[i] = bf16_to_f32(f32_to_bf16(static_cast<float>(m[i])));
        v[i] = bf16_to_f32(f32_to_bf16(static_cast<float>(v[i])));
      }
    }
  }
};

// Runs `steps` steps of every supported ISA and the reference on the same random data; checks
// each ISA against the reference after step 1 and the last step, and against the scalar path
// bit for bit after every step.
void run_case(std::size_t n, const Mode& mode, int steps, std::size_t offset, int threads,
              std::uint64_t seed) {
  const std::vector<Isa> isas = supported_isas();
  std::vector<std::unique_ptr<State>> st;
  std::vector<std::unique_ptr<CpuAdamW>> eng;
  for (Isa isa : isas) {
    st.push_back(std::make_unique<State>(n, mode, offset));
    eng.push_back(
        std::make_unique<CpuAdamW>(CpuAdamWConfig{threads, isa, NonFinitePolicy::kSkipStep}));
    ASSERT_EQ(eng.back()->isa(), isa);
  }
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> pd(-2, 2), md(-0.05f, 0.05f), vd(1e-4f, 1e-2f), gd(-1, 1);
  Reference ref;
  ref.p.resize(n), ref.m.resize(n), ref.v.resize(n);
  // Random, never-zero initial state (as after earlier steps), identical in every engine.
  for (std::size_t i = 0; i < n; ++i) {
    float p0 = pd(rng), m0 = md(rng), v0 = vd(rng);
    if (mode.state == DType::kBF16) {
      m0 = bf16_to_f32(f32_to_bf16(m0));
      v0 = bf16_to_f32(f32_to_bf16(v0));
    }
    ref.p[i] = p0, ref.m[i] = m0, ref.v[i] = v0;
    for (auto& s : st) {
      s->p[i] = p0;
      s->m32[i] = m0, s->v32[i] = v0;
      s->m16[i] = f32_to_bf16(m0), s->v16[i] = f32_to_bf16(v0);
    }
  }
  // A pool of gradients; step t uses a cheap, deterministic rotation of it.
  std::vector<float> pool(n + 97);
  for (auto& x : pool) do
      x = gd(rng);
    while (std::fabs(x) < 1e-3f);
  std::vector<double> g(n);
  // 0.75 on odd steps, 1 on even ones (the SIMD paths skip the multiply by 1).
  const double gmax = 1.0;

  AdamWOptions o;
  o.lr = 1e-2;
  o.weight_decay = mode.weight_decay;
  o.bias_correction = mode.bias_correction;
  const bool sb = mode.state == DType::kBF16;
  for (int t = 1; t <= steps; ++t) {
    o.step = t;
    o.grad_scale = t % 2 == 1 ? 0.75f : 1.0f;
    o.lr = 1e-2 * (1.0 - 0.005 * t);  // a schedule: lr changes every step
    const std::size_t shift = std::size_t(t) * 13 % pool.size();
    for (std::size_t i = 0; i < n; ++i) {
      const std::size_t j = i + shift;
      const float gi = pool[j < pool.size() ? j : j - pool.size()];
      const std::uint16_t gb = f32_to_bf16(gi);
      for (auto& s : st) {
        s->g32[i] = gi;
        s->g16[i] = gb;
      }
      g[i] = mode.grad == DType::kBF16 ? bf16_to_f32(gb) : gi;
    }
    if (sb) {
      // A bf16 EMA turns one tie rounded the other way into a lasting difference, so with
      // bf16 states the reference continues from the kernel's m and v: each step is checked
      // against the exact map, p over the whole trajectory.
      for (std::size_t i = 0; i < n; ++i) ref.m[i] = st[0]->m(i), ref.v[i] = st[0]->v(i);
    }
    ref.step(o, g, sb);
    for (std::size_t e = 0; e < eng.size(); ++e) {
      const AdamWResult r = eng[e]->step(o, st[e]->shard());
      ASSERT_EQ(r.non_finite, 0u);
      ASSERT_FALSE(r.skipped);
    }
    // Every path equals the scalar one (st[0]) bit for bit (checked at the first and at
    // every 10th step: a difference persists in p).
    for (std::size_t e = 1; e < eng.size() && (t == 1 || t % 10 == 0 || t == steps); ++e) {
      for (std::size_t i = 0; i < n; ++i) {
        ASSERT_EQ(f32_bits(st[e]->p[i]), f32_bits(st[0]->p[i]))
            << describe(mode, n, isas[e]) << " step " << t << " element " << i;
        ASSERT_EQ(f32_bits(st[e]->m(i)), f32_bits(st[0]->m(i)))
            << describe(mode, n, isas[e]) << " element " << i;
        ASSERT_EQ(f32_bits(st[e]->v(i)), f32_bits(st[0]->v(i)))
            << describe(mode, n, isas[e]) << " element " << i;
        if (mode.copy != DType::kF32) {
          ASSERT_EQ(st[e]->c16[i], st[0]->c16[i])
              << describe(mode, n, isas[e]) << " copy element " << i;
        }
      }
    }
    if (t != 1 && t != steps) continue;
    State& s = *st[0];
    for (std::size_t i = 0; i < n; ++i) {
      const double tp = sb ? t * (2 * kUlp * std::fabs(ref.p[i]) + std::ldexp(o.lr, -5))
                           : t * 2 * kUlp * (std::fabs(ref.p[i]) + 4 * o.lr);
      const double tm =
          (sb ? std::ldexp(std::fabs(ref.m[i]), -7) : 0) + 8 * kUlp * (std::fabs(ref.m[i]) + gmax);
      const double tv = (sb ? std::ldexp(std::fabs(ref.v[i]), -7) : 0) +
                        8 * kUlp * (std::fabs(ref.v[i]) + gmax * gmax);
      ASSERT_NEAR(s.p[i], ref.p[i], tp)
          << describe(mode, n, Isa::kScalar) << " step " << t << " element " << i;
      ASSERT_NEAR(s.m(i), ref.m[i], tm)
          << describe(mode, n, Isa::kScalar) << " step " << t << " element " << i;
      ASSERT_NEAR(s.v(i), ref.v[i], tv)
          << describe(mode, n, Isa::kScalar) << " step " << t << " element " << i;
      if (mode.copy == DType::kBF16) {
        ASSERT_EQ(s.c16[i], f32_to_bf16(s.p[i]));
      } else if (mode.copy == DType::kF16) {
        ASSERT_EQ(s.c16[i], f32_to_f16(s.p[i]));
      }
    }
  }
}

TEST(AdamW, IsaSelection) {
  const Isa auto_isa = CpuAdamW().isa();
  EXPECT_NE(auto_isa, Isa::kAuto);
  EXPECT_TRUE(isa_supported(auto_isa));
  EXPECT_TRUE(isa_supported(Isa::kScalar));
  EXPECT_EQ(parse_isa("avx2"), Isa::kAvx2);
  EXPECT_THROW(parse_isa("sse9"), Error);
  ASSERT_EQ(setenv("STRATA_ADAMW_ISA", "scalar", 1), 0);
  EXPECT_EQ(CpuAdamW().isa(), Isa::kScalar);
  EXPECT_EQ(adamw_selected_isa(), Isa::kScalar);
  // An explicit option wins over the environment.
  EXPECT_EQ(CpuAdamW(CpuAdamWConfig{1, auto_isa}).isa(), auto_isa);
  ASSERT_EQ(setenv("STRATA_ADAMW_ISA", "bogus", 1), 0);
  try {  // named as the variable it came from (the user typed no ISA)
    CpuAdamW a;
    ADD_FAILURE() << "STRATA_ADAMW_ISA=bogus was taken";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(
                  "STRATA_ADAMW_ISA='bogus' is not one of auto, avx512, avx2, scalar"),
              std::string::npos)
        << e.what();
  }
  unsetenv("STRATA_ADAMW_ISA");
  // isa_from_env: unset or empty is kAuto (the model kernels' STRATA_MODEL_ISA is read by it too:
  // Runtime.StrataCpuIsaCapsEveryPathStrataInfoReports).
  EXPECT_EQ(isa_from_env("STRATA_ADAMW_ISA"), Isa::kAuto);
  for (Isa i : {Isa::kAvx2, Isa::kAvx512}) {
    if (isa_supported(i)) continue;
    try {
      CpuAdamW a(CpuAdamWConfig{1, i});
      ADD_FAILURE() << "forcing " << isa_name(i) << " on a CPU without it did not throw";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kUnsupported);
    }
  }
  std::printf("auto ISA here: %s (AVX512_BF16 conversion: %s)\n", isa_name(auto_isa),
              adamw_native_bf16() ? "yes" : "no");
}

// lr = 0 leaves p exactly as it was, so copy_out must be strata's rounding of any bit
// pattern: every bf16 upper half with tie / near-tie / random low halves, subnormals, NaNs.
TEST(AdamW, CopyOutRoundingMatchesDtypeBitForBit) {
  std::vector<float> pats;
  std::mt19937 rng(7);
  for (std::uint32_t hi = 0; hi < 0x10000; ++hi) {
    for (std::uint32_t lo :
         {0x0000u, 0x7fffu, 0x8000u, 0x8001u, 0xffffu, static_cast<std::uint32_t>(rng() & 0xffffu)})
      pats.push_back(f32_from_bits(hi << 16 | lo));
  }
  const std::size_t n = pats.size();
  for (Isa isa : supported_isas()) {
    for (DType copy : {DType::kBF16, DType::kF16}) {
      Mode mode;
      mode.copy = copy;
      State s(n, mode, 3);
      for (std::size_t i = 0; i < n; ++i) {
        s.p[i] = pats[i];
        s.g32[i] = 1.0f;
        s.m32[i] = 0.5f;
        s.v32[i] = 0.25f;
      }
      AdamWOptions o;
      o.lr = 0;
      CpuAdamW eng(CpuAdamWConfig{2, isa});
      eng.step(o, s.shard());
      for (std::size_t i = 0; i < n; ++i) {
        const std::uint16_t want =
            copy == DType::kBF16 ? f32_to_bf16(pats[i]) : f32_to_f16(pats[i]);
        ASSERT_EQ(s.c16[i], want) << isa_name(isa) << " " << dtype_name(copy) << " of bits 0x"
                                  << std::hex << f32_bits(pats[i]);
      }
    }
  }
}

TEST(AdamW, StatesAsBf16RoundLikeDtype) {
  // bf16 states: m and v written back must be the RNE rounding of their fp32 values; with
  // beta = 0 and (1 - beta) * g exact, m = g and v = g^2 (rounded once in fp32).
  const std::size_t n = 4099;
  std::mt19937 rng(11);
  for (Isa isa : supported_isas()) {
    Mode mode;
    mode.state = DType::kBF16;
    State s(n, mode, 1);
    std::vector<float> g(n);
    for (std::size_t i = 0; i < n; ++i) {
      g[i] = f32_from_bits((rng() & 0x807fffffu) | (std::uint32_t(100 + i % 50) << 23));
      s.g32[i] = g[i], s.p[i] = 1, s.m16[i] = 0, s.v16[i] = 0;
    }
    AdamWOptions o;
    o.beta1 = 0, o.beta2 = 0, o.lr = 0;
    CpuAdamW(CpuAdamWConfig{1, isa}).step(o, s.shard());
    for (std::size_t i = 0; i < n; ++i) {
      ASSERT_EQ(s.m16[i], f32_to_bf16(g[i])) << isa_name(isa) << " element " << i;
      ASSERT_EQ(s.v16[i], f32_to_bf16(g[i] * g[i])) << isa_name(isa) << " element " << i;
    }
  }
}

TEST(AdamW, OddSizesAllModesAgainstReference) {
  for (std::size_t n : {1, 15, 16, 17, 31, 1000}) {
    for (DType grad : {DType::kF32, DType::kBF16}) {
      for (DType state : {DType::kF32, DType::kBF16}) {
        for (DType copy : {DType::kF32, DType::kBF16, DType::kF16}) {
          for (double wd : {0.0, 0.1}) {
            for (bool bc : {true, false}) {
              const Mode mode{grad, state, copy, wd, bc};
              SCOPED_TRACE(describe(mode, n, Isa::kAuto));
              run_case(n, mode, 100, (n % 3) + 1, 1, n * 31 + unsigned(wd * 10) + bc);
              if (::testing::Test::HasFatalFailure()) return;
            }
          }
        }
      }
    }
  }
}

TEST(AdamW, MillionElementsAgainstReference) {
  // Under AddressSanitizer 10 steps, not 100: the same paths (every ISA, mode and tail), where
  // the 100 took 124 s of the sanitized suite's 12 minutes (AMD EPYC Zen 3 VM, 2026-12-07).
#ifdef __SANITIZE_ADDRESS__
  constexpr int kSteps = 10;
#else
  constexpr int kSteps = 100;
#endif
  for (DType grad : {DType::kF32, DType::kBF16}) {
    for (DType state : {DType::kF32, DType::kBF16}) {
      const Mode mode{grad, state, DType::kBF16, 0.01, true};
      SCOPED_TRACE(describe(mode, 1000003, Isa::kAuto));
      // Offset 0: copy_out is 64-byte aligned, so the AVX-512 path streams it (non-temporal).
      run_case(1000003, mode, kSteps, 0, 2, 5 + unsigned(grad) * 2 + unsigned(state));
      if (::testing::Test::HasFatalFailure()) return;
    }
  }
  // Unaligned pointers at the large size too.
  run_case(1000003, Mode{DType::kBF16, DType::kF32, DType::kF16, 0.0, false}, 1, 1, 2, 99);
}

// More threads than the process may run on are refused, naming the cores (a CpuAdamW of 99 threads
// said it had 99 and ran on 2, oneTBB saying so at exit).
TEST(AdamW, MoreThreadsThanCoresIsAClearError) {
  const int cores = CpuAdamW().threads();
  try {
    CpuAdamW a(CpuAdamWConfig{cores + 1, Isa::kAuto});
    ADD_FAILURE() << "a CpuAdamW of " << cores + 1 << " threads on " << cores << " cores was made";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find(fmt::format(
                  "CpuAdamW threads = {}: oneTBB runs at most {} thread", cores + 1, cores)),
              std::string::npos)
        << e.what();
  }
  EXPECT_EQ(CpuAdamW(CpuAdamWConfig{cores, Isa::kAuto}).threads(), cores);
}

TEST(AdamW, ThreadCountAndBindingDoNotChangeBits) {
  const std::size_t n = 300007;
  const Mode mode{DType::kF32, DType::kF32, DType::kBF16, 0.01, true};
  std::vector<std::unique_ptr<State>> st;
  const CpuAdamWConfig configs[] = {
      {1, Isa::kAuto},
      {2, Isa::kAuto},
      {2, Isa::kAuto, NonFinitePolicy::kSkipStep, ThreadBinding::kCores},
      {2, Isa::kAuto, NonFinitePolicy::kSkipStep, ThreadBinding::kNumaNode, 0}};
  cpu_set_t before;
  ASSERT_EQ(sched_getaffinity(0, sizeof before, &before), 0);
  for (const auto& c : configs) {
    auto s = std::make_unique<State>(n, mode, 0);
    for (std::size_t i = 0; i < n; ++i) {
      s->p[i] = float(i % 1000) / 500 - 1, s->m32[i] = 0.01f, s->v32[i] = 0.001f;
      s->g32[i] = float(i % 77) / 77 - 0.5f + 1e-3f;
    }
    CpuAdamW eng(c);
    AdamWOptions o;
    for (int t = 1; t <= 3; ++t) {
      o.step = t;
      eng.step(o, s->shard());
    }
    st.push_back(std::move(s));
  }
  cpu_set_t after;
  ASSERT_EQ(sched_getaffinity(0, sizeof after, &after), 0);
  EXPECT_TRUE(CPU_EQUAL(&before, &after)) << "binding leaked into the calling thread";
  for (std::size_t k = 1; k < st.size(); ++k)
    for (std::size_t i = 0; i < n; ++i)
      ASSERT_EQ(f32_bits(st[k]->p[i]), f32_bits(st[0]->p[i])) << "config " << k;
  EXPECT_THROW(CpuAdamW(CpuAdamWConfig{1, Isa::kAuto, NonFinitePolicy::kSkipStep,
                                       ThreadBinding::kCores, 4096}),
               Error);
}

TEST(AdamW, MultiShardStepEqualsOneStepPerShard) {
  const Mode mode{DType::kBF16, DType::kF32, DType::kBF16, 0.0, true};
  std::vector<std::size_t> sizes = {17, 70000, 1, 33};
  std::vector<std::unique_ptr<State>> a, b;
  for (std::size_t n : sizes) {
    for (auto* v : {&a, &b}) {
      auto s = std::make_unique<State>(n, mode, 2);
      for (std::size_t i = 0; i < n; ++i) {
        s->p[i] = 0.5f + float(i % 13), s->m32[i] = 0.01f, s->v32[i] = 0.02f;
        s->g16[i] = f32_to_bf16(float(i % 7) - 3.5f);
      }
      v->push_back(std::move(s));
    }
  }
  CpuAdamW eng(CpuAdamWConfig{2});
  std::vector<AdamWShard> shards;
  for (auto& s : a) shards.push_back(s->shard());
  AdamWOptions o;
  eng.step(o, shards);
  for (auto& s : b) eng.step(o, s->shard());
  for (std::size_t k = 0; k < sizes.size(); ++k)
    for (std::size_t i = 0; i < sizes[k]; ++i)
      ASSERT_EQ(f32_bits(a[k]->p[i]), f32_bits(b[k]->p[i]));
}

// A shard weight decay skips (AdamWShard::decay false, what the engine gives norm weights and
// biases) steps as with weight_decay 0, bit for bit, beside decayed shards in the same step; a
// decayed one as when stepped alone. On every path this CPU has.
TEST(AdamW, ShardsWithoutDecayStepAsWithWeightDecayZero) {
  const Mode mode{DType::kF32, DType::kF32, DType::kBF16, 0.0, true};
  const std::size_t sizes[] = {70000, 33, 1, 4099};
  for (Isa isa : supported_isas()) {
    SCOPED_TRACE(isa_name(isa));
    CpuAdamW eng(CpuAdamWConfig{2, isa});
    // together: one step over every shard, odd ones without decay; alone: one step per shard,
    // with weight_decay 0 for the odd ones.
    std::vector<std::unique_ptr<State>> together, alone;
    for (std::size_t k = 0; k < std::size(sizes); ++k)
      for (auto* v : {&together, &alone}) {
        auto st = std::make_unique<State>(sizes[k], mode, k);
        for (std::size_t i = 0; i < sizes[k]; ++i) {
          st->p[i] = 0.5f + float(i % 13), st->m32[i] = 0.01f, st->v32[i] = 0.02f;
          st->g32[i] = float(i % 7) - 3.5f;
        }
        v->push_back(std::move(st));
      }
    AdamWOptions o;
    o.lr = 1e-2f;
    o.weight_decay = 0.1f;
    for (int t = 1; t <= 2; ++t) {
      o.step = t;
      std::vector<AdamWShard> shards;
      for (std::size_t k = 0; k < together.size(); ++k) {
        shards.push_back(together[k]->shard());
        shards.back().decay = k % 2 == 0;
      }
      eng.step(o, shards);
      for (std::size_t k = 0; k < alone.size(); ++k) {
        AdamWOptions ok = o;
        if (k % 2 == 1) ok.weight_decay = 0;
        eng.step(ok, alone[k]->shard());
      }
    }
    for (std::size_t k = 0; k < std::size(sizes); ++k) {
      for (std::size_t i = 0; i < sizes[k]; ++i) {
        ASSERT_EQ(f32_bits(together[k]->p[i]), f32_bits(alone[k]->p[i])) << "shard " << k;
        ASSERT_EQ(together[k]->c16[i], alone[k]->c16[i]) << "shard " << k;
      }
    }
    // The decay is there to skip: a shard that decays ends elsewhere (0.5 + ... shrinks by lr * wd
    // a step, 1e-3 of it, far above the last bit).
    EXPECT_NE(together[0]->p[12], together[3]->p[12]);
  }
}

// With grad_scale 4 the third gradient (3e38) overflows to Inf; with 1 (which the SIMD paths do
// not multiply by) it stays finite. Either way every path writes the scalar path's bits, NaNs
// included.
TEST(AdamW, NonFiniteGradientsAreReportedAndSkipWritesNothing) {
  const std::size_t n = 100003;
  for (const float grad_scale : {4.0f, 1.0f}) {
    const std::size_t expected = grad_scale == 1.0f ? 3 : 4;
    for (DType grad : {DType::kF32, DType::kBF16}) {
      std::unique_ptr<State> first;  // the scalar path's p, m, v and copy after the fused step
      for (Isa isa : supported_isas()) {
        SCOPED_TRACE(
            fmt::format("{} grads {} grad_scale {}", isa_name(isa), dtype_name(grad), grad_scale));
        const Mode mode{grad, DType::kF32, DType::kBF16, 0.01, true};
        State s(n, mode, 1);
        for (std::size_t i = 0; i < n; ++i) {
          s.p[i] = 1.0f + float(i % 5), s.m32[i] = 0.1f, s.v32[i] = 0.2f, s.c16[i] = 0x1234;
          s.g32[i] = 0.25f;
        }
        s.g32[7] = std::nanf("");
        s.g32[n - 1] = -INFINITY;
        s.g32[50000] = 3e38f;  // finite, but grad_scale 4 makes it Inf
        // An Inf whose lane meets a zero gradient in the vector it is paired with (the SIMD
        // paths' check multiplies pairs of vectors: Inf * 0 is NaN, still found).
        s.g32[17] = INFINITY;
        s.g32[25] = 0.0f, s.g32[1] = 0.0f;  // element 17's partner lane in AVX2, in AVX-512
        for (std::size_t i = 0; i < n; ++i) s.g16[i] = f32_to_bf16(s.g32[i]);
        const std::vector<unsigned char> p0(s.p.store), m0(s.m32.store), v0(s.v32.store),
            c0(s.c16.store);
        AdamWOptions o;
        o.grad_scale = grad_scale;
        CpuAdamW eng(CpuAdamWConfig{2, isa, NonFinitePolicy::kSkipStep});
        const AdamWResult r = eng.step(o, s.shard());
        EXPECT_EQ(r.non_finite, expected);
        EXPECT_TRUE(r.skipped);
        EXPECT_FALSE(r.all_finite());
        EXPECT_EQ(s.p.store, p0);
        EXPECT_EQ(s.m32.store, m0);
        EXPECT_EQ(s.v32.store, v0);
        EXPECT_EQ(s.c16.store, c0);
        // The fused mode updates and reports; the bad elements become NaN, the rest are updated.
        const AdamWResult f = eng.step(o, s.shard(), NonFinitePolicy::kReportOnly);
        EXPECT_EQ(f.non_finite, expected);
        EXPECT_FALSE(f.skipped);
        EXPECT_TRUE(std::isnan(s.p[7]));
        EXPECT_TRUE(std::isnan(s.p[n - 1]));
        EXPECT_TRUE(std::isfinite(s.p[8]));
        EXPECT_NE(s.p[8], 4.0f);
        // The same numbers as the scalar path, NaN where it has NaN (a NaN's payload may differ:
        // the scalar path's fmaf is a library call there).
        if (!first) {
          first = std::make_unique<State>(n, mode, 1);
          std::memcpy(first->p.data(), s.p.data(), n * sizeof(float));
          std::memcpy(first->m32.data(), s.m32.data(), n * sizeof(float));
          std::memcpy(first->v32.data(), s.v32.data(), n * sizeof(float));
          std::memcpy(first->c16.data(), s.c16.data(), n * sizeof(std::uint16_t));
        }
        const auto same = [](float a, float b) {
          return (std::isnan(a) && std::isnan(b)) || f32_bits(a) == f32_bits(b);
        };
        for (std::size_t i = 0; i < n; ++i) {
          ASSERT_TRUE(same(s.p[i], first->p[i])) << i << ": " << s.p[i] << " " << first->p[i];
          ASSERT_TRUE(same(s.m32[i], first->m32[i])) << i;
          ASSERT_TRUE(same(s.v32[i], first->v32[i])) << i;
          ASSERT_TRUE(same(bf16_to_f32(s.c16[i]), bf16_to_f32(first->c16[i]))) << i;
        }
        // Finite gradients: nothing to report.
        for (std::size_t i = 0; i < n; ++i) s.g32[i] = 0.5f, s.g16[i] = f32_to_bf16(0.5f);
        o.step = 2;
        const AdamWResult ok = eng.step(o, s.shard());
        EXPECT_TRUE(ok.all_finite());
        EXPECT_FALSE(ok.skipped);
      }
    }
  }
}

void expect_error(const std::function<void()>& fn, const std::string& needle) {
  try {
    fn();
    ADD_FAILURE() << "no error; expected one mentioning '" << needle << "'";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(AdamW, BadInputIsAClearError) {
  const std::size_t n = 64;
  State s(n, Mode{}, 0);
  for (std::size_t i = 0; i < n; ++i) s.p[i] = 1, s.m32[i] = 0, s.v32[i] = 0, s.g32[i] = 1;
  CpuAdamW eng(CpuAdamWConfig{1});
  const AdamWOptions good;
  auto with = [&](auto change) {
    return [&, change] {
      AdamWShard sh = s.shard();
      AdamWOptions o = good;
      change(sh, o);
      eng.step(o, sh);
    };
  };
  expect_error(with([](AdamWShard& sh, AdamWOptions&) { sh.grads.numel = 63; }), "same length");
  expect_error(with([](AdamWShard& sh, AdamWOptions&) { sh.copy_out.numel = 65; }), "same length");
  expect_error(with([](AdamWShard& sh, AdamWOptions&) { sh.m.mem.ptr = nullptr; }), "null buffer");
  expect_error(with([](AdamWShard& sh, AdamWOptions&) { sh.params.numel = 0; }), "zero elements");
  expect_error(with([](AdamWShard&, AdamWOptions& o) { o.lr = -1e-3; }), "lr");
  expect_error(with([](AdamWShard&, AdamWOptions& o) { o.lr = NAN; }), "lr");
  expect_error(with([](AdamWShard&, AdamWOptions& o) { o.beta1 = 1.0; }), "beta1");
  expect_error(with([](AdamWShard&, AdamWOptions& o) { o.beta2 = -0.1; }), "beta2");
  expect_error(with([](AdamWShard&, AdamWOptions& o) { o.eps = -1; }), "eps");
  expect_error(with([](AdamWShard&, AdamWOptions& o) { o.weight_decay = -1; }), "weight_decay");
  expect_error(with([](AdamWShard&, AdamWOptions& o) { o.grad_scale = INFINITY; }), "grad_scale");
  expect_error(with([](AdamWShard&, AdamWOptions& o) { o.step = 0; }), "step");
  expect_error(with([](AdamWShard& sh, AdamWOptions&) { sh.params.dtype = DType::kBF16; }), "fp32");
  expect_error(with([](AdamWShard& sh, AdamWOptions&) { sh.m.dtype = DType::kBF16; }), "both");
  expect_error(with([](AdamWShard& sh, AdamWOptions&) { sh.copy_out.dtype = DType::kF32; }),
               "copy_out");
  expect_error(with([&](AdamWShard& sh, AdamWOptions&) {
                 sh.grads.mem.ptr = reinterpret_cast<char*>(s.g32.data()) + 1;
               }),
               "aligned");
  expect_error(with([&](AdamWShard& sh, AdamWOptions&) { sh.v = sh.m; }), "overlap");
  expect_error(
      with([&](AdamWShard& sh, AdamWOptions&) { sh.params.mem.space = MemSpace::kDevice; }),
      "host memory");
  // Nothing was written by any of the rejected calls.
  for (std::size_t i = 0; i < n; ++i) ASSERT_EQ(s.p[i], 1.0f);
  EXPECT_THROW(CpuAdamW(CpuAdamWConfig{-1}), Error);
}

// Random, never-zero p, m, v, gradients and copy-out in every width a State holds.
void fill_random(State& s, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> pd(-2, 2), md(-0.05f, 0.05f), vd(1e-4f, 1e-2f), gd(-1, 1);
  for (std::size_t i = 0; i < s.n; ++i) {
    s.p[i] = pd(rng), s.m32[i] = md(rng), s.v32[i] = vd(rng), s.g32[i] = gd(rng) + 1.5f;
    s.m16[i] = f32_to_bf16(s.m32[i]), s.v16[i] = f32_to_bf16(s.v32[i]);
    s.g16[i] = f32_to_bf16(s.g32[i]), s.c16[i] = f32_to_bf16(s.p[i]);
  }
}

// Every byte a State owns, padding included.
std::vector<std::vector<unsigned char>> snapshot(const State& s) {
  return {s.p.store,   s.m32.store, s.v32.store, s.m16.store,
          s.v16.store, s.g32.store, s.g16.store, s.c16.store};
}

// dst's shard, stepping from src's p, m, v with src's gradients.
AdamWShard out_of_place(State& src, State& dst) {
  const AdamWShard from = src.shard();
  AdamWShard sh = dst.shard();
  sh.grads = from.grads;
  sh.params_src = from.params;
  sh.m_src = from.m;
  sh.v_src = from.v;
  return sh;
}

// Whether elements [0, n) of everything a step writes are the same bits in a and b.
void expect_same_result(State& a, State& b, const std::string& what) {
  const std::size_t n = a.n;
  const bool sb = a.mode.state == DType::kBF16;
  EXPECT_EQ(std::memcmp(a.p.data(), b.p.data(), n * 4), 0) << what << ": params differ";
  EXPECT_EQ(sb ? std::memcmp(a.m16.data(), b.m16.data(), n * 2)
               : std::memcmp(a.m32.data(), b.m32.data(), n * 4),
            0)
      << what << ": m differs";
  EXPECT_EQ(sb ? std::memcmp(a.v16.data(), b.v16.data(), n * 2)
               : std::memcmp(a.v32.data(), b.v32.data(), n * 4),
            0)
      << what << ": v differs";
  if (a.mode.copy != DType::kF32) {
    EXPECT_EQ(std::memcmp(a.c16.data(), b.c16.data(), n * 2), 0) << what << ": copy_out differs";
  }
}

AdamWOptions out_of_place_options() {
  AdamWOptions o;
  o.lr = 1e-2;
  o.weight_decay = 0.01;
  o.grad_scale = 0.75;
  o.step = 3;
  return o;
}

// The speculative step: from one copy of the state into another, the first left untouched.
TEST(AdamW, OutOfPlaceEqualsInPlaceBitForBitAndLeavesSourcesUntouched) {
  const AdamWOptions o = out_of_place_options();
  for (Isa isa : supported_isas()) {
    CpuAdamW eng(CpuAdamWConfig{2, isa});
    for (std::size_t n : {1, 15, 17, 1000003}) {
      for (DType grad : {DType::kF32, DType::kBF16}) {
        for (DType state : {DType::kF32, DType::kBF16}) {
          for (DType copy : {DType::kF32, DType::kBF16}) {
            const Mode mode{grad, state, copy, o.weight_decay, true};
            const std::string what = describe(mode, n, isa);
            // Offset 0 for the destination: at the large size the AVX-512 path streams
            // copy_out; the source is misaligned.
            State in_place(n, mode, 0), src(n, mode, 1), dst(n, mode, 0);
            fill_random(in_place, n + 7);
            fill_random(src, n + 7);
            for (auto* a : {&dst.p.store, &dst.m32.store, &dst.v32.store, &dst.m16.store,
                            &dst.v16.store, &dst.c16.store})
              std::fill(a->begin(), a->end(), 0xa5);
            const auto before = snapshot(src);
            ASSERT_TRUE(eng.step(o, in_place.shard()).all_finite()) << what;
            ASSERT_TRUE(eng.step(o, out_of_place(src, dst)).all_finite()) << what;
            expect_same_result(in_place, dst, what);
            EXPECT_TRUE(snapshot(src) == before) << what << ": a source was written";
            if (HasFailure()) return;
          }
        }
      }
    }
  }
}

TEST(AdamW, SourcesThatAreTheDestinationsStepInPlace) {
  const AdamWOptions o = out_of_place_options();
  const std::size_t n = 1017;
  for (Isa isa : supported_isas()) {
    CpuAdamW eng(CpuAdamWConfig{1, isa});
    for (const Mode& mode : {Mode{DType::kF32, DType::kF32, DType::kBF16},
                             Mode{DType::kBF16, DType::kBF16, DType::kF32}}) {
      const std::string what = describe(mode, n, isa);
      State plain(n, mode, 2), via_src(n, mode, 2);
      fill_random(plain, 3);
      fill_random(via_src, 3);
      eng.step(o, plain.shard());
      eng.step(o, out_of_place(via_src, via_src));
      expect_same_result(plain, via_src, what);
    }
  }
}

TEST(AdamW, BadSourcesAreAClearError) {
  const std::size_t n = 64;
  const Mode mode{DType::kF32, DType::kF32, DType::kBF16};
  State src(n, mode, 0), dst(n, mode, 0);
  fill_random(src, 5);
  fill_random(dst, 6);
  const auto src_before = snapshot(src), dst_before = snapshot(dst);
  CpuAdamW eng(CpuAdamWConfig{1});
  auto with = [&](auto change) {
    return [&, change] {
      AdamWShard sh = out_of_place(src, dst);
      change(sh);
      eng.step(out_of_place_options(), sh);
    };
  };
  expect_error(with([](AdamWShard& sh) {
                 sh.m_src = {};
                 sh.v_src = {};
               }),
               "not set: m_src v_src");
  expect_error(with([](AdamWShard& sh) { sh.params_src = {}; }), "not set: params_src");
  expect_error(
      with([&](AdamWShard& sh) { sh.params_src = host_tensor(dst.p.data() + 1, DType::kF32, n); }),
      "params_src overlaps params");
  expect_error(with([](AdamWShard& sh) { sh.m_src = sh.v; }), "m_src overlaps v");
  // copy_out is bytes [4n, 6n) of `other`, v_src bytes [5n, 9n).
  Array<float> other(3 * n, 0);
  expect_error(with([&](AdamWShard& sh) {
                 sh.copy_out = host_tensor(other.data() + n, DType::kBF16, n);
                 sh.v_src = host_tensor(other.data() + n + n / 4, DType::kF32, n);
               }),
               "v_src overlaps copy_out");
  expect_error(
      with([&](AdamWShard& sh) { sh.m_src = host_tensor(src.m16.data(), DType::kBF16, n); }),
      "m_src is bf16 but m is fp32");
  expect_error(with([](AdamWShard& sh) { sh.v_src.numel = n - 1; }), "same length");
  expect_error(with([](AdamWShard& sh) { sh.v_src.mem.ptr = nullptr; }), "v_src is a null buffer");
  expect_error(with([](AdamWShard& sh) {
                 sh.params_src.mem.ptr = static_cast<char*>(sh.params_src.mem.ptr) + 2;
               }),
               "aligned");
  expect_error(with([](AdamWShard& sh) { sh.m_src.mem.space = MemSpace::kDevice; }), "host memory");
  // Nothing was written by any of the rejected calls.
  EXPECT_TRUE(snapshot(src) == src_before);
  EXPECT_TRUE(snapshot(dst) == dst_before);
}

}  // namespace
}  // namespace strata
