// strata-bench adam: the CPU AdamW step against the memory bandwidth of this machine.
//
// For each mode (fp32/bf16 grads, fp32/bf16 states, bf16 copy-out on/off) and thread count,
// it times CpuAdamW steps (best of --reps) over --params parameters and reports G params/s,
// GB/s counting the bytes the mode must move (reads of p, g, m, v; writes of p, m, v and the
// copy), and ratios:
//  - to a bandwidth bound measured in the same run over the same footprint, with the same
//    threads, the best of its probes, each compiled for the AdamW kernels' own ISA (the same
//    run-time choice, STRATA_CPU_ISA included): a STREAM triad (a = b + s*c over three arrays
//    holding the mode's bytes) counted as the hardware moves it, 16 bytes an element (its
//    store reads the line first: write-allocate); the same triad with non-temporal stores, 12
//    bytes; and a "same pattern" loop that reads and writes exactly the mode's arrays with one
//    add each, its copy-out stored as the step stores it (non-temporal where the AVX-512 step
//    streams it) (and the DeepSpeed-style loop below where it runs). A step faster than that bound
//    by more than 2% is reported as a broken bound (the word in the table, `broken_bound` in the
//    JSON), never as a ratio above 1 passed off as speed;
//  - to the scalar path (Isa::kScalar: a plain one-element-at-a-time loop) with the same threads;
//  - on the fp32 grads / fp32 states / no copy-out mode (the only one DeepSpeed's cpu_adam has),
//    to a DeepSpeed-style loop: strata's rendering of cpu_adam's AVX step (adam_ds_style.h), not
//    DeepSpeed itself, compiled for the kernels' ISA, held to AdamW in double before it is timed,
//    and timed in rounds alternating with the step over the same arrays and threads. It moves
//    the same 28 bytes a parameter, so its rate is one more probe of the bound.
// The step runs with NonFinitePolicy::kReportOnly (detection fused); --skip-check adds the
// kSkipStep pre-check pass to show its cost.
#include <immintrin.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "adam_ds_style.h"
#include "bench_common.h"
#include "strata/adamw.h"
#include "strata/error.h"
#include "strata/system_info.h"
#include "tool_main.h"

namespace strata::bench {
namespace {

struct Mode {
  DType grad, state;
  bool copy;
  std::string name() const {
    return fmt::format("g:{} s:{} copy:{}", dtype_name(grad), dtype_name(state),
                       copy ? "bf16" : "none");
  }
  double bytes_per_param() const {
    const double g = double(dtype_size(grad)), s = double(dtype_size(state));
    return 4 + g + 2 * s /* reads */ + 4 + 2 * s + (copy ? 2 : 0) /* writes */;
  }
};

constexpr std::size_t kArrayAlign = std::size_t(2) << 20;

// An array that starts `slot` * 64 KiB past a 2 MiB boundary (64-byte aligned, as AVX-512 wants);
// the arrays one loop streams together take different slots. Each is its own allocation and glibc
// maps them side by side, so at one offset they would lie multiples of 2 MiB apart (100M fp32:
// 384 MiB, 3 * 2^27), and on the AMD EPYC Zen 5 VM (2026-12-06) the fp32 step so placed ran
// 0.84-1.21 G params/s on one thread and the DeepSpeed-style loop 0.55-1.15, their ratio 0.90-1.52
// from run to run, where with the offsets they ran 1.46-1.67 and 1.47-1.61, 0.99-1.04
// (docs/benchmarks.md#cpu-adamw; over all modes the layouts' means differ less, either way).
// Streams that far apart likely meet in one L3 set or one memory channel or bank at every step.
template <class T>
class Aligned {
 public:
  Aligned(std::size_t n, int slot)
      : n_(n), offset_(offset_of(slot)), base_(allocate(n * sizeof(T) + offset_)) {
    p_ = reinterpret_cast<T*>(base_ + offset_);
  }
  ~Aligned() { std::free(base_); }
  Aligned(const Aligned&) = delete;
  Aligned& operator=(const Aligned&) = delete;
  T* data() { return p_; }
  T& operator[](std::size_t i) { return p_[i]; }
  std::size_t size() const { return n_; }

 private:
  static constexpr std::size_t kSlot = std::size_t(64) << 10;
  static std::size_t offset_of(int slot) {
    STRATA_CHECK(slot >= 0 && std::size_t(slot) * kSlot < kArrayAlign, "array slot {} out of range",
                 slot);
    return std::size_t(slot) * kSlot;
  }
  static char* allocate(std::size_t bytes) {
    auto* p = static_cast<char*>(
        std::aligned_alloc(kArrayAlign, (bytes + kArrayAlign - 1) / kArrayAlign * kArrayAlign));
    STRATA_CHECK(p != nullptr, "cannot allocate {} bytes for the benchmark", bytes);
    return p;
  }
  std::size_t n_, offset_;
  char* base_;
  T* p_ = nullptr;
};

struct Arrays {
  explicit Arrays(std::size_t n)
      : p(n, 0), m(n, 1), v(n, 2), g(n, 3), m16(n, 4), v16(n, 5), g16(n, 6), c16(n, 7) {}
  Aligned<float> p, m, v, g;
  Aligned<std::uint16_t> m16, v16, g16, c16;
};

// Where each array starts past a 2 MiB boundary, in KiB, from its address (`array_offsets_kib`
// in the JSON): the arrays a loop streams together must not share one.
template <class T>
std::size_t offset_kib(Aligned<T>& x) {
  return (reinterpret_cast<std::uintptr_t>(x.data()) & (kArrayAlign - 1)) >> 10;
}
nlohmann::json array_offsets_kib(Arrays& a, Aligned<float>& ta, Aligned<float>& tb,
                                 Aligned<float>& tc) {
  return {{"p", offset_kib(a.p)},      {"m", offset_kib(a.m)},     {"v", offset_kib(a.v)},
          {"g", offset_kib(a.g)},      {"m16", offset_kib(a.m16)}, {"v16", offset_kib(a.v16)},
          {"g16", offset_kib(a.g16)},  {"c16", offset_kib(a.c16)}, {"triad_a", offset_kib(ta)},
          {"triad_b", offset_kib(tb)}, {"triad_c", offset_kib(tc)}};
}

void init(Arrays& a, int threads) {
  timed_parallel(a.p.size(), threads, [&](std::size_t lo, std::size_t hi) {
    for (std::size_t i = lo; i < hi; ++i) {
      a.p[i] = 1.0f + float(i % 1024) / 1024;
      a.m[i] = 1e-3f;
      a.v[i] = 1e-6f;
      a.g[i] = 1e-3f * (float(i % 97) / 97 - 0.5f) + 1e-5f;
      a.m16[i] = f32_to_bf16(a.m[i]);
      a.v16[i] = f32_to_bf16(a.v[i]);
      a.g16[i] = f32_to_bf16(a.g[i]);
      a.c16[i] = 0;
    }
  });
}

AdamWShard shard_of(Arrays& a, const Mode& mode) {
  const std::size_t n = a.p.size();
  const bool sb = mode.state == DType::kBF16;
  AdamWShard s;
  s.params = host_tensor(a.p.data(), DType::kF32, n);
  s.grads = mode.grad == DType::kBF16 ? host_tensor(a.g16.data(), DType::kBF16, n)
                                      : host_tensor(a.g.data(), DType::kF32, n);
  s.m = sb ? host_tensor(a.m16.data(), DType::kBF16, n) : host_tensor(a.m.data(), DType::kF32, n);
  s.v = sb ? host_tensor(a.v16.data(), DType::kBF16, n) : host_tensor(a.v.data(), DType::kF32, n);
  if (mode.copy) s.copy_out = host_tensor(a.c16.data(), DType::kBF16, n);
  return s;
}

// Seconds of one step.
double time_step(CpuAdamW& eng, const AdamWShard& s, const AdamWOptions& o,
                 NonFinitePolicy policy) {
  const Stopwatch sw;
  const AdamWResult res = eng.step(o, std::span<const AdamWShard>(&s, 1), policy);
  const double sec = sw.seconds();
  STRATA_CHECK(res.all_finite(), "benchmark data produced {} non-finite gradients", res.non_finite);
  return sec;
}

AdamWOptions bench_options(int step) {
  AdamWOptions o;
  o.weight_decay = 0.01f;
  o.step = step;
  return o;
}

// Best seconds per step of `reps` steps.
double time_steps(CpuAdamW& eng, const AdamWShard& s, int reps, NonFinitePolicy policy) {
  double best = 1e30;
  for (int r = 0; r < reps; ++r)
    best = std::min(best, time_step(eng, s, bench_options(r + 1), policy));
  return best;
}

// strata's step and the DeepSpeed-style loop (adam_ds_style.h) on the same fp32 arrays, in
// alternating rounds (which runs first alternates too), `reps` of each, the best of each kept:
// a burst of other work on a shared machine falls on both alike. The loop runs over `threads`
// threads, each one contiguous part (timed_parallel, as the bound's probes; strata's step gives
// each worker one contiguous run of tiles, cpu_adam's OpenMP loop one contiguous part per thread).
struct StepVsDsStyle {
  double step_s = 1e30, ds_style_s = 1e30;
};
StepVsDsStyle time_vs_ds_style(CpuAdamW& eng, const AdamWShard& s, Arrays& a, Isa isa, int threads,
                               int reps, NonFinitePolicy policy) {
  StepVsDsStyle best;
  for (int r = 0; r < reps; ++r) {
    const AdamWOptions o = bench_options(r + 1);
    const DsStyleScalars k = ds_style_scalars(o);
    const auto ds_style = [&] {
      return timed_parallel(a.p.size(), threads, [&](std::size_t lo, std::size_t hi) {
        ds_style_adamw(isa, k, a.p.data(), a.g.data(), a.m.data(), a.v.data(), lo, hi);
      });
    };
    if (r % 2 == 1) best.ds_style_s = std::min(best.ds_style_s, ds_style());
    best.step_s = std::min(best.step_s, time_step(eng, s, o, policy));
    if (r % 2 == 0) best.ds_style_s = std::min(best.ds_style_s, ds_style());
  }
  return best;
}

// The same-pattern loop: one pass that reads and writes every array of the mode as the step
// does, with one cheap operation per array (the compiler vectorises it).
template <bool kGradBf16, bool kStateBf16, bool kCopy>
[[gnu::always_inline]] inline void same_pattern_body(Arrays& a, std::size_t lo, std::size_t hi) {
  float* __restrict p = a.p.data();
  const float* __restrict g = a.g.data();
  const std::uint16_t* __restrict g16 = a.g16.data();
  float* __restrict m = a.m.data();
  float* __restrict v = a.v.data();
  std::uint16_t* __restrict m16 = a.m16.data();
  std::uint16_t* __restrict v16 = a.v16.data();
  std::uint16_t* __restrict c = a.c16.data();
  for (std::size_t i = lo; i < hi; ++i) {
    const float gi = kGradBf16 ? f32_from_bits(std::uint32_t(g16[i]) << 16) : g[i];
    const float pi = p[i] + gi * 0.0f;
    p[i] = pi;
    if constexpr (kStateBf16) {
      m16[i] = static_cast<std::uint16_t>(m16[i] ^ 1u);
      v16[i] = static_cast<std::uint16_t>(v16[i] ^ 1u);
    } else {
      m[i] += 0.0f;
      v[i] += 0.0f;
    }
    if constexpr (kCopy) c[i] = static_cast<std::uint16_t>(f32_bits(pi) >> 16);
  }
}

// The loops compiled for each ISA the kernels dispatch to: the body inlined into a function
// with that target (GCC inlines a generic always_inline body into a more capable target and
// vectorises it there), so the bound runs the instructions the step can.
using Pass = void (*)(Arrays&, std::size_t, std::size_t);
template <bool G, bool S, bool C>
void same_pattern_scalar(Arrays& a, std::size_t lo, std::size_t hi) {
  same_pattern_body<G, S, C>(a, lo, hi);
}
template <bool G, bool S, bool C>
[[gnu::target("avx2,fma,f16c")]] void same_pattern_avx2(Arrays& a, std::size_t lo, std::size_t hi) {
  same_pattern_body<G, S, C>(a, lo, hi);
}
template <bool G, bool S, bool C>
[[gnu::target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")]] void same_pattern_avx512(
    Arrays& a, std::size_t lo, std::size_t hi) {
  same_pattern_body<G, S, C>(a, lo, hi);
}
// The AVX-512 step streams its bf16 copy-out above a size (adamw_streams_copy_out): this loop
// then writes it as the step does, in the same pass, 16 elements a vector: p, m and v read and
// written back, the copy of the new p stored non-temporally (no line read first); the ends, to
// the copy's 32-byte alignment and past the last whole vector, through the plain loop.
template <bool G, bool S>
[[gnu::target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")]] void same_pattern_avx512_nt_copy(
    Arrays& a, std::size_t lo, std::size_t hi) {
  float* p = a.p.data();
  float* m = a.m.data();
  float* v = a.v.data();
  const float* g = a.g.data();
  const std::uint16_t* g16 = a.g16.data();
  std::uint16_t* m16 = a.m16.data();
  std::uint16_t* v16 = a.v16.data();
  std::uint16_t* c = a.c16.data();
  std::size_t i = lo;
  for (; i < hi && reinterpret_cast<std::uintptr_t>(c + i) % 32 != 0; ++i)
    same_pattern_body<G, S, true>(a, i, i + 1);
  const __m512 zero = _mm512_setzero_ps();
  const __m256i one = _mm256_set1_epi16(1);
  for (; i + 16 <= hi; i += 16) {
    // The zero-masked forms: GCC 12's unmasked ones read an undefined source it warns about.
    const __m512 gi =
        G ? _mm512_castsi512_ps(_mm512_maskz_slli_epi32(
                0xffff,
                _mm512_maskz_cvtepu16_epi32(
                    0xffff, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(g16 + i))),
                16))
          : _mm512_loadu_ps(g + i);
    const __m512 pi = _mm512_fmadd_ps(gi, zero, _mm512_loadu_ps(p + i));
    _mm512_storeu_ps(p + i, pi);
    if constexpr (S) {
      auto* mi = reinterpret_cast<__m256i*>(m16 + i);
      auto* vi = reinterpret_cast<__m256i*>(v16 + i);
      _mm256_storeu_si256(mi, _mm256_xor_si256(_mm256_loadu_si256(mi), one));
      _mm256_storeu_si256(vi, _mm256_xor_si256(_mm256_loadu_si256(vi), one));
    } else {
      _mm512_storeu_ps(m + i, _mm512_add_ps(_mm512_loadu_ps(m + i), zero));
      _mm512_storeu_ps(v + i, _mm512_add_ps(_mm512_loadu_ps(v + i), zero));
    }
    _mm256_stream_si256(reinterpret_cast<__m256i*>(c + i),
                        _mm512_maskz_cvtepi32_epi16(
                            0xffff, _mm512_maskz_srli_epi32(0xffff, _mm512_castps_si512(pi), 16)));
  }
  same_pattern_body<G, S, true>(a, i, hi);
  _mm_sfence();
}
const Pass kNtCopyPasses[2][2] = {
    {&same_pattern_avx512_nt_copy<false, false>, &same_pattern_avx512_nt_copy<false, true>},
    {&same_pattern_avx512_nt_copy<true, false>, &same_pattern_avx512_nt_copy<true, true>}};

#define STRATA_PASSES(fn)                                  \
  {                                                        \
    {{&fn<false, false, false>, &fn<false, false, true>},  \
     {&fn<false, true, false>, &fn<false, true, true>}},   \
    {                                                      \
      {&fn<true, false, false>, &fn<true, false, true>}, { \
        &fn<true, true, false>, &fn<true, true, true>      \
      }                                                    \
    }                                                      \
  }
const Pass kPasses[3][2][2][2] = {STRATA_PASSES(same_pattern_scalar),
                                  STRATA_PASSES(same_pattern_avx2),
                                  STRATA_PASSES(same_pattern_avx512)};
#undef STRATA_PASSES

// 0 scalar, 1 AVX2, 2 AVX-512: the kernels' ISA (Isa::kAuto resolved), and back.
int isa_slot(Isa isa) { return isa == Isa::kAvx512 ? 2 : isa == Isa::kAvx2 ? 1 : 0; }
constexpr Isa kSlotIsa[3] = {Isa::kScalar, Isa::kAvx2, Isa::kAvx512};

// Whether the same-pattern loop writes the copy-out with non-temporal stores: where the step does
// (the AVX-512 path only, so the loop is kNtCopyPasses' AVX-512 one).
bool nt_copy_pattern(const Mode& mode, Isa isa, std::size_t n) {
  return mode.copy && adamw_streams_copy_out(isa, n);
}

// The loop's rate, and in `copy_stores` the stores its pass wrote the copy-out with.
double same_pattern_gbps(Arrays& a, const Mode& mode, Isa isa, int threads, int reps,
                         const char** copy_stores) {
  const std::size_t n = a.p.size();
  const bool g16 = mode.grad == DType::kBF16, s16 = mode.state == DType::kBF16;
  const bool nt = nt_copy_pattern(mode, isa, n);
  const Pass pass = nt ? kNtCopyPasses[g16][s16] : kPasses[isa_slot(isa)][g16][s16][mode.copy];
  *copy_stores = !mode.copy ? "none" : nt ? "non_temporal" : "plain";
  double best = 1e30;
  for (int r = 0; r < reps; ++r) {
    best = std::min(
        best, timed_parallel(n, threads, [&](std::size_t lo, std::size_t hi) { pass(a, lo, hi); }));
  }
  // A probe is one only if it did the work: the copy it wrote is the high half of every p (a
  // sample of 257 elements, the last included).
  for (std::size_t k = 0; mode.copy && k <= 256; ++k) {
    const std::size_t i = k == 256 ? n - 1 : n / 256 * k;
    STRATA_CHECK(a.c16[i] == static_cast<std::uint16_t>(f32_bits(a.p[i]) >> 16),
                 "the same-pattern loop ({} copy-out stores) left element {} of the copy at "
                 "{:#06x}, not the high half of p {:#010x}",
                 *copy_stores, i, a.c16[i], f32_bits(a.p[i]));
  }
  return mode.bytes_per_param() * double(n) / best / 1e9;
}

// The STREAM triad a = b + s*c, plain stores (each reads its line first) or non-temporal ones
// (vector stores that bypass the cache where the range is aligned; the ends plain).
[[gnu::always_inline]] inline void triad_body(float* __restrict a, const float* __restrict b,
                                              const float* __restrict c, float s, std::size_t lo,
                                              std::size_t hi) {
  for (std::size_t i = lo; i < hi; ++i) a[i] = b[i] + s * c[i];
}
using Triad = void (*)(float*, const float*, const float*, float, std::size_t, std::size_t, bool);
void triad_scalar(float* a, const float* b, const float* c, float s, std::size_t lo, std::size_t hi,
                  bool) {
  triad_body(a, b, c, s, lo, hi);  // no non-temporal stores without a vector ISA
}
[[gnu::target("avx2,fma")]] void triad_avx2(float* a, const float* b, const float* c, float s,
                                            std::size_t lo, std::size_t hi, bool nt) {
  if (!nt) return triad_body(a, b, c, s, lo, hi);
  std::size_t i = lo;
  for (; i < hi && reinterpret_cast<std::uintptr_t>(a + i) % 32 != 0; ++i) a[i] = b[i] + s * c[i];
  const __m256 vs = _mm256_set1_ps(s);
  for (; i + 8 <= hi; i += 8)
    _mm256_stream_ps(a + i, _mm256_fmadd_ps(vs, _mm256_loadu_ps(c + i), _mm256_loadu_ps(b + i)));
  for (; i < hi; ++i) a[i] = b[i] + s * c[i];
  _mm_sfence();
}
[[gnu::target("avx512f,avx2,fma")]] void triad_avx512(float* a, const float* b, const float* c,
                                                      float s, std::size_t lo, std::size_t hi,
                                                      bool nt) {
  if (!nt) return triad_body(a, b, c, s, lo, hi);
  std::size_t i = lo;
  for (; i < hi && reinterpret_cast<std::uintptr_t>(a + i) % 64 != 0; ++i) a[i] = b[i] + s * c[i];
  const __m512 vs = _mm512_set1_ps(s);
  for (; i + 16 <= hi; i += 16)
    _mm512_stream_ps(a + i, _mm512_fmadd_ps(vs, _mm512_loadu_ps(c + i), _mm512_loadu_ps(b + i)));
  for (; i < hi; ++i) a[i] = b[i] + s * c[i];
  _mm_sfence();
}
const Triad kTriads[3] = {&triad_scalar, &triad_avx2, &triad_avx512};

// The triad over three fp32 arrays holding `bytes` together, in GB/s as the hardware moves
// them: 16 bytes an element with plain stores (write-allocate), 12 with non-temporal ones.
double triad_same_bytes(Aligned<float>& a, Aligned<float>& b, Aligned<float>& c, double bytes,
                        Isa isa, bool nt, int threads, int reps) {
  const std::size_t n = std::min(a.size(), static_cast<std::size_t>(bytes / 12));
  const Triad triad = kTriads[isa_slot(isa)];
  double best = 1e30;
  for (int r = 0; r < reps; ++r) {
    const float s = 0.5f + float(r);
    best = std::min(best, timed_parallel(n, threads, [&](std::size_t lo, std::size_t hi) {
                      triad(a.data(), b.data(), c.data(), s, lo, hi, nt);
                    }));
  }
  return (nt ? 12.0 : 16.0) * double(n) / best / 1e9;
}

// The last-level cache this process's first CPU shares, from sysfs (glibc's sysconf gives the
// whole package's on some VMs: 320 MiB where this CPU's is 32); 0 when unknown.
long last_level_cache_bytes() {
  for (int index = 4; index >= 2; --index) {
    std::ifstream f(fmt::format("/sys/devices/system/cpu/cpu0/cache/index{}/size", index));
    std::string text;
    if (!(f >> text) || text.empty()) continue;
    long v = 0;
    std::size_t used = 0;
    try {
      v = std::stol(text, &used);
    } catch (...) {
      continue;
    }
    const char unit = used < text.size() ? text[used] : ' ';
    return unit == 'K' ? v << 10 : unit == 'M' ? v << 20 : v;
  }
  return ::sysconf(_SC_LEVEL3_CACHE_SIZE) > 0 ? ::sysconf(_SC_LEVEL3_CACHE_SIZE) : 0;
}

// What every row shares: the arrays, the kernels' ISA and the run's settings.
struct Bench {
  std::size_t params;
  int reps;
  NonFinitePolicy policy;
  Isa isa;
  Arrays& a;
  Aligned<float>&ta, &tb, &tc;
};

// The mode the DeepSpeed-style loop is timed on: the only one cpu_adam's fp32 step has.
bool ds_style_mode(const Mode& mode) {
  return mode.grad == DType::kF32 && mode.state == DType::kF32 && !mode.copy;
}

struct Row {
  double sec = 0, sec_scalar = 0;
  double triad = 0, triad_nt = 0, pattern = 0;
  double ds_style_sec = 0;           // 0: not timed in this mode
  const char* copy_stores = "none";  // how the same-pattern loop stored the copy-out
};

// One mode at one thread count. The bound's probes are measured before and after the step is
// timed, the better kept: a burst of other work on a shared machine during one measurement must
// not make the ratio come out high.
Row measure_row(Bench& b, const Mode& mode, int threads, CpuAdamW& eng, CpuAdamW& scalar) {
  const AdamWShard s = shard_of(b.a, mode);
  const double bytes = mode.bytes_per_param() * double(b.params);
  Row r;
  for (int round = 0; round < 2; ++round) {
    r.triad =
        std::max(r.triad, triad_same_bytes(b.ta, b.tb, b.tc, bytes, b.isa, false, threads, b.reps));
    r.triad_nt = std::max(r.triad_nt,
                          triad_same_bytes(b.ta, b.tb, b.tc, bytes, b.isa, true, threads, b.reps));
    r.pattern =
        std::max(r.pattern, same_pattern_gbps(b.a, mode, b.isa, threads, b.reps, &r.copy_stores));
    if (round == 1) break;
    if (ds_style_mode(mode)) {
      const StepVsDsStyle t = time_vs_ds_style(eng, s, b.a, b.isa, threads, b.reps, b.policy);
      r.sec = t.step_s;
      r.ds_style_sec = t.ds_style_s;
    } else {
      r.sec = time_steps(eng, s, b.reps, b.policy);
    }
    r.sec_scalar = time_steps(scalar, s, std::max(1, b.reps / 2), b.policy);
  }
  return r;
}

// The table's row (and, where the DeepSpeed-style loop ran, a line under it) and the JSON's;
// returns whether the bound is broken there.
bool report_row(const Bench& b, const Mode& mode, int threads, const Row& r, nlohmann::json& rows) {
  const double bpp = mode.bytes_per_param(), n = double(b.params);
  const double gps = n / r.sec / 1e9, gbps = bpp * n / r.sec / 1e9;
  const double ds_gps = r.ds_style_sec > 0 ? n / r.ds_style_sec / 1e9 : 0;
  const double ds_gbps = bpp * ds_gps;
  // The loop moves the same bytes as the step: one more probe of what this machine can move.
  const double bound = std::max({r.triad, r.triad_nt, r.pattern, ds_gbps});
  const double scalar_gps = n / r.sec_scalar / 1e9;
  const bool broken = broken_bound(gbps / bound);
  std::printf("%-28s %3d %5.0f %9.3f %8.2f %9.2f %9.2f %9.2f %8.2f %9.3f %9.2f%s\n",
              mode.name().c_str(), threads, bpp, gps, gbps, r.triad, r.triad_nt, r.pattern,
              gbps / bound, scalar_gps, gps / scalar_gps, broken_bound_note(gbps / bound));
  nlohmann::json row = {{"grads", std::string(dtype_name(mode.grad))},
                        {"states", std::string(dtype_name(mode.state))},
                        {"copy_out", mode.copy ? "bf16" : "none"},
                        {"copy_out_stores", r.copy_stores},
                        {"threads", threads},
                        {"bytes_per_param", bpp},
                        {"seconds_per_step", r.sec},
                        {"gparams_per_s", gps},
                        {"gbps", gbps},
                        {"triad_gbps", r.triad},
                        {"triad_nt_gbps", r.triad_nt},
                        {"same_pattern_gbps", r.pattern},
                        {"bound_gbps", bound},
                        {"ratio_vs_bound", gbps / bound},
                        {"broken_bound", broken},
                        {"scalar_gparams_per_s", scalar_gps},
                        {"ratio_vs_scalar", gps / scalar_gps}};
  if (r.ds_style_sec > 0) {
    std::printf("%-28s %3d %5.0f %9.3f %8.2f   DeepSpeed-style loop; strata / it: %.2f\n",
                "  ds-style (rendering)", threads, bpp, ds_gps, ds_gbps, gps / ds_gps);
    row["ds_style_seconds_per_step"] = r.ds_style_sec;
    row["ds_style_gparams_per_s"] = ds_gps;
    row["ds_style_gbps"] = ds_gbps;
    row["ratio_vs_ds_style"] = gps / ds_gps;
  }
  rows.push_back(std::move(row));
  return broken;
}

constexpr const char* kDsStyleName =
    "a DeepSpeed-style loop (strata's rendering of cpu_adam's AVX step), not DeepSpeed itself";

void print_header(const Bench& b, const DsStyleCheck& check) {
  const char* isa = isa_name(b.isa);
  std::string checked;
  for (const std::string& w : check.isas) checked += (checked.empty() ? "" : ", ") + w;
  std::printf(
      "strata-bench adam: %zu parameters, ISA %s%s, best of %d steps, non-finite %s\n", b.params,
      isa, adamw_native_bf16() && b.isa == Isa::kAvx512 ? " (AVX512_BF16)" : "", b.reps,
      b.policy == NonFinitePolicy::kSkipStep ? "pre-check (kSkipStep)" : "fused (kReportOnly)");
  std::printf(
      "bound = max(STREAM triad over the mode's bytes at 16 B an element (write-allocate), the "
      "same with non-temporal stores at 12 B, same-pattern read/write loop with the step's "
      "copy-out stores (%s), and on g:fp32 s:fp32 copy:none the DeepSpeed-style loop), each "
      "compiled for %s, same threads; a step above it by more than 2%% is a broken bound\n",
      adamw_streams_copy_out(b.isa, b.params) ? "non-temporal" : "plain", isa);
  std::printf(
      "ds-style = %s: fp32 p, g, m, v in place, %s vectors (+ FMA) unrolled 8, 4, 1, no gradient "
      "scale, no non-finite check, one contiguous part per thread; timed on g:fp32 s:fp32 "
      "copy:none in rounds alternating with strata's step, best of %d each; held to AdamW in "
      "double first (%s: worst %.2f of the tolerance)\n",
      kDsStyleName,
      b.isa == Isa::kAvx512 ? "16-lane AVX-512"
      : b.isa == Isa::kAvx2 ? "8-lane AVX2"
                            : "scalar",
      b.reps, checked.c_str(), check.worst_of_tolerance);
}

nlohmann::json ds_style_json(const Bench& b, const DsStyleCheck& check) {
  return {{"ds_style_reference", kDsStyleName},
          {"ds_style_method",
           fmt::format("fp32 params, grads, exp_avg and exp_avg_sq stepped in place in AdamW mode "
                       "(step_size = -lr/bias_correction1, w_decay = -lr*weight_decay on the "
                       "param, denom = sqrt(v)/sqrt(bias_correction2) + eps), {} lanes with FMA, "
                       "unrolled 8, 4 and 1 vectors, no non-finite detection; same threads, each "
                       "one contiguous part (std::threads, as the bound's probes); timed on the "
                       "fp32/fp32/no-copy mode only, in rounds alternating with strata's step, "
                       "best of reps each",
                       b.isa == Isa::kAvx512 ? 16
                       : b.isa == Isa::kAvx2 ? 8
                                             : 1)},
          {"ds_style_isa", isa_name(b.isa)},
          {"ds_style_check",
           {{"isas", check.isas},
            {"elements", check.elements},
            {"steps", check.steps},
            {"tolerance", kDsStyleTolerance},
            {"worst_of_tolerance", check.worst_of_tolerance}}}};
}

void run(std::size_t params, const std::vector<int>& thread_counts, int reps, bool skip_check,
         bool json) {
  const NonFinitePolicy policy =
      skip_check ? NonFinitePolicy::kSkipStep : NonFinitePolicy::kReportOnly;
  const Isa isa = adamw_selected_isa();
  const int max_threads = *std::max_element(thread_counts.begin(), thread_counts.end());
  // The comparison is with a correct AdamW or none.
  const DsStyleCheck check = check_ds_style(isa);
  STRATA_CHECK(check.worst_of_tolerance <= 1,
               "the DeepSpeed-style loop strays from AdamW ({:.2f} of its tolerance)",
               check.worst_of_tolerance);
  Arrays a(params);
  // Triad arrays big enough for the largest mode's bytes (30 B/param) / 3.
  const std::size_t triad_n = params * 30 / 12 + 1;
  Aligned<float> ta(triad_n, 0), tb(triad_n, 1), tc(triad_n, 2);
  Bench b{params, reps, policy, isa, a, ta, tb, tc};
  print_header(b, check);
  // A working set the last-level cache holds runs at cache speed, the step and the bound alike,
  // and their ratio then says little about memory (both beat DRAM; the step may beat the loops).
  const long l3 = last_level_cache_bytes();
  const bool cache_resident = l3 > 0 && double(params) * 16 <= double(l3);
  if (cache_resident)
    std::printf(
        "note: %s of fp32 master/grad/m/v fit in the %s last-level cache: cache speeds, not "
        "memory's; use --params of at least %zu for the memory bound\n",
        human_bytes(double(params) * 16).c_str(), human_bytes(double(l3)).c_str(),
        std::size_t(l3) / 16 * 8);
  init(a, max_threads);
  timed_parallel(triad_n, max_threads, [&](std::size_t lo, std::size_t hi) {
    std::fill(ta.data() + lo, ta.data() + hi, 0.0f);
    std::fill(tb.data() + lo, tb.data() + hi, 1.0f);
    std::fill(tc.data() + lo, tc.data() + hi, 2.0f);
  });

  const Mode modes[] = {
      {DType::kF32, DType::kF32, false},   {DType::kF32, DType::kF32, true},
      {DType::kBF16, DType::kF32, false},  {DType::kBF16, DType::kF32, true},
      {DType::kF32, DType::kBF16, false},  {DType::kF32, DType::kBF16, true},
      {DType::kBF16, DType::kBF16, false}, {DType::kBF16, DType::kBF16, true},
  };
  nlohmann::json rows = nlohmann::json::array();
  std::printf("%-28s %3s %5s %9s %8s %9s %9s %9s %8s %9s %9s\n", "mode", "thr", "B/par", "Gparam/s",
              "GB/s", "triad", "triad-nt", "pattern", "vs bound", "scalar", "vs scalar");
  int broken = 0;
  Isa kernel_isa = Isa::kAuto;  // the path the timed steps took, as their engine reports it
  for (int threads : thread_counts) {
    CpuAdamW eng(CpuAdamWConfig{threads, Isa::kAuto, policy});
    kernel_isa = eng.isa();
    CpuAdamW scalar(CpuAdamWConfig{threads, Isa::kScalar, policy});
    for (const Mode& mode : modes)
      broken += report_row(b, mode, threads, measure_row(b, mode, threads, eng, scalar), rows);
  }
  if (broken > 0)
    std::printf(
        "broken bound: %d row(s) ran faster than every probe of the memory bound; the bound, not "
        "the step, is wrong there\n",
        broken);
  if (json) {
    nlohmann::json j = {
        {"command", "adam"},
        {"params", params},
        {"isa", isa_name(kernel_isa)},
        {"bound_isa", isa_name(kSlotIsa[isa_slot(isa)])},
        {"bound",
         "max(triad_gbps: STREAM triad, 16 B an element with write-allocate; triad_nt_gbps: "
         "non-temporal stores, 12 B; same_pattern_gbps: the mode's arrays read and written, the "
         "copy-out with the step's stores (copy_out_stores), at the mode's bytes as the step; "
         "ds_style_gbps where the row has it: the DeepSpeed-style loop, the same bytes), each "
         "compiled for bound_isa, the probes best of before and after the step"},
        {"array_layout",
         "each array its own allocation, starting slot * 64 KiB past a 2 MiB boundary (p, m, v, "
         "g, m16, v16, g16, c16: slots 0-7; the triad's a, b, c: 0-2), so that no two arrays a "
         "loop streams together lie a multiple of 2 MiB apart"},
        {"native_bf16", adamw_native_bf16()},
        {"non_finite_policy", skip_check ? "skip_step" : "report_only"},
        {"reps", reps},
        {"cache_resident", cache_resident},
        {"results", rows}};
    j.update(ds_style_json(b, check));
    j["array_offsets_kib"] = array_offsets_kib(a, ta, tb, tc);
    print_json(j);
  }
}

}  // namespace

void add_adam_command(CLI::App& app) {
  auto* cmd = app.add_subcommand(
      "adam", "CPU AdamW step vs the memory bandwidth bound, per mode and thread count");
  struct Args {
    std::size_t params = 100'000'000;
    std::vector<int> threads{1, 2};
    int reps = 5;
    bool skip_check = false;
    bool json = false;
  };
  auto args = std::make_shared<Args>();
  cmd->add_option("--params", args->params,
                  "parameters per step, e.g. 100M (M = 10^6), 2500k or 100000000 (default 100M)")
      ->transform(CLI::Validator(
          [](std::string& v) {  // "100M" -> "100000000" (k, M, G: 10^3, 10^6, 10^9)
            std::size_t digits = 0;
            while (digits < v.size() && std::isdigit(static_cast<unsigned char>(v[digits])))
              ++digits;
            const std::string unit = v.substr(digits);
            const std::uint64_t mult = unit.empty()                 ? 1
                                       : unit == "k" || unit == "K" ? 1000
                                       : unit == "m" || unit == "M" ? 1000000
                                       : unit == "g" || unit == "G" ? 1000000000
                                                                    : 0;
            if (digits == 0 || mult == 0 || digits > 19)
              return "'" + v + "' is not a count: write e.g. 100M, 2500k or 100000000";
            const std::uint64_t n = std::stoull(v.substr(0, digits));
            if (n > UINT64_MAX / mult) return "'" + v + "' is more than any memory holds";
            v = std::to_string(n * mult);
            return std::string();
          },
          "", "count"))
      ->check(strata::tools::kPositive);
  auto* threads_opt = cmd->add_option("--threads", args->threads,
                                      "thread counts to run (default 1,2, up to the usable cores)")
                          ->delimiter(',');
  cmd->add_option("--reps", args->reps, "steps per measurement; the best is reported")
      ->check(strata::tools::kPositive);
  cmd->add_flag("--skip-check", args->skip_check,
                "run the kSkipStep pre-check pass too (its cost)");
  cmd->add_flag("--json", args->json, "print, last, one JSON object of the figures");
  cmd->callback([args, threads_opt] {
    STRATA_REQUIRE(
        !args->threads.empty() && *std::min_element(args->threads.begin(), args->threads.end()) > 0,
        "--threads takes positive counts, e.g. --threads 1,2");
    // More threads than cores would not be what the row says: the optimizer's pool keeps to
    // the cores (oneTBB ignores the extra workers) while the bound's loops time-share them.
    const int cores = cpu::usable_cores();
    if (threads_opt->count() == 0)  // the default on a one-core process: what it can run
      std::erase_if(args->threads, [cores](int t) { return t > cores; });
    const int most = *std::max_element(args->threads.begin(), args->threads.end());
    STRATA_REQUIRE(most <= cores,
                   "--threads {}: this process may run on {} core{} (sched_getaffinity: taskset, "
                   "the cgroup's cpuset); give counts up to {}",
                   most, cores, cores == 1 ? "" : "s", cores);
    // The step's arrays (p, m, v, g: 4 x fp32; m16, v16, g16, copy: 4 x bf16) and the triad's three
    // (30 B/param together): refused up front, not met by the OOM killer while they are filled.
    const double need = double(args->params) * (4 * 4 + 4 * 2 + 30);
    const std::size_t avail = cpu::mem_available_bytes();
    STRATA_REQUIRE(
        avail == 0 || need <= 0.9 * double(avail),
        "--params {}: the benchmark needs about {} of memory and {} is available; lower --params",
        args->params, human_bytes(need), human_bytes(double(avail)));
    run(args->params, args->threads, args->reps, args->skip_check, args->json);
  });
}

}  // namespace strata::bench
