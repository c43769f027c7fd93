// strata-bench gpu: strata's CUDA paths against the GPU's own bounds, measured in the same run.
//
//   link    pinned H2D / D2H through Stream::copy from PinnedPool memory, in chunks of the sizes
//           the engine moves (a layer's shard: 4-256 MiB), against the best single large copy
//   gemm    bf16 GEMM TFLOP/s through Stream::matmul (cuBLAS's default algorithm) against the
//           fastest of cuBLASLt's heuristic candidates (the CUDA module's best_cublaslt_gemm),
//           at the GEMM shapes of an 8B Llama layer with 8192 tokens
//   adamw   Stream::adamw GB/s (fp32 params/grads/m/v, bf16 copy-out: 30 bytes per parameter)
//           against a device-to-device copy that moves as many bytes
//   kernels the model kernels with two variants (simple, the reference; tiled: tensor-core
//           attention, parallel column reductions; src/gpu/model_kernels.cu) on the same inputs,
//           at an 8B Llama layer's shapes: the largest difference between them against a
//           tolerance (bf16 for attention, fp32 summation order for the reductions, none for the
//           embedding's, which is bit-equal by construction), whether the tiled results repeat bit
//           for bit, and each variant's GPU time (CUDA events) with the ratio simple / tiled
//   model   strata::train on the GPU, bf16, ZeRO-3 with parameters and optimizer state on the
//           host and, separately, on NVMe: tokens/s, model FLOPs utilisation (against the best
//           cuBLAS rate of the gemm part) and the GPU's idle share of a traced step (the union
//           of the compute stream's GPU-timed spans against the trace's extent)
//   parity  a small Llama, a few steps, host offload, on the GPU and on the CPU-emulated
//           device: the logged losses must agree within the bf16 tolerance (3e-2 relative)
//
// Without a usable GPU it prints "SKIPPED: <reason>" and exits 0 (--json: {"skipped": true}).
// --rehearse runs every part on the CPU-emulated device at small sizes instead: the bench's own
// plumbing (configs, data, training runs, trace analysis, JSON) tested where there is no GPU.
// A part that fails is reported with its error and the others still run; the command then
// exits 1 after printing everything.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <random>
#include <sstream>

#include "bench_common.h"
#include "strata/error.h"
#include "strata/gpu_bench.h"
#include "strata/kernels.h"
#include "strata/model.h"
#include "strata/pinned_pool.h"
#include "strata/system_info.h"
#include "strata/trace.h"
#include "strata/trainer.h"
#include "tool_main.h"

namespace strata::bench {
// This command's own names: the benchmarks compile as one file (tools/CMakeLists.txt).
namespace gpu_cmd {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

struct Args {
  std::string parts = "link,gemm,adamw,kernels,model,parity";
  std::string out;        // configs, logs and traces of the model runs
  std::string nvme_path;  // the NVMe placement's swap folder
  double link_gib = 1.0;
  double adamw_mparams = 256;
  // The model part's Llama (~134M parameters) and batch.
  std::int64_t hidden = 768, layers = 12, heads = 12, kv_heads = 4, inter = 2048, vocab = 32000;
  std::int64_t batch = 8, seq = 1024, steps = 4;
  bool json = false;
  bool probe = false;
  // Every part on the CPU-emulated device instead (no cuBLASLt reference; parity compares the
  // emulated device with itself): tests the bench's own plumbing where there is no GPU.
  bool rehearse = false;
  bool overwrite = false;  // --out: replace the bench's own files left there by an earlier run
  std::string train_device() const { return rehearse ? "cpu" : "cuda"; }
};

const char* const kParts[] = {"link", "gemm", "adamw", "kernels", "model", "parity"};

std::string part_names(const char* sep) {
  std::string names;
  for (const char* p : kParts) names += (names.empty() ? "" : sep) + std::string(p);
  return names;
}

// --parts as a list, each name checked: before the GPU is probed, so a typo is an error on a
// machine without one too (not SKIPPED, exit 0).
std::vector<std::string> parse_parts(const std::string& text) {
  std::vector<std::string> parts;
  std::stringstream ss(text);
  for (std::string p; std::getline(ss, p, ',');) {
    STRATA_REQUIRE(std::find(std::begin(kParts), std::end(kParts), p) != std::end(kParts),
                   "--parts: '{}' is not one of {}", p, part_names(", "));
    parts.push_back(p);
  }
  STRATA_REQUIRE(!parts.empty(), "--parts is empty: name one or more of {}", part_names(", "));
  return parts;
}

constexpr double kParityTolerance = 3e-2;  // docs/model.md, "Tolerances": CUDA vs CPU, bf16

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Seconds of the fastest of `reps` runs of `queue` (work on `s`), each ended by a synchronize.
template <class F>
double best_seconds(Stream& s, int reps, F queue) {
  double best = 1e30;
  for (int r = 0; r < reps; ++r) {
    const Stopwatch sw;
    queue();
    s.synchronize();
    best = std::min(best, sw.seconds());
  }
  return best;
}

json bench_link(Device& dev, Stream& s, const Args& a, std::vector<std::string>& table) {
  const std::size_t mib = std::size_t(1) << 20;
  std::vector<std::size_t> sizes = {4 * mib, 16 * mib, 64 * mib, 256 * mib};
  if (a.rehearse) sizes = {mib, 4 * mib};
  const std::size_t unit = sizes.back();
  const auto total =
      a.rehearse ? 4 * unit : std::size_t(a.link_gib * double(1u << 30)) / unit * unit;
  STRATA_REQUIRE(total > 0, "--link-gib must be at least 0.25");
  PinnedPoolOptions po;
  po.budget_bytes = total + 4 * unit + 64 * mib;
  po.device = &dev;  // cudaHostRegister
  PinnedPool pool(po);
  Buffer d = dev.alloc(total, &s);
  PinnedBlock big = pool.allocate(total);
  std::memset(big.data(), 1, total);
  auto peak = [&](bool h2d) {
    return double(total) / 1e9 / best_seconds(s, 3, [&] {
             h2d ? s.copy(d.ref(), host_ref(big.data(), total))
                 : s.copy(host_ref(big.data(), total), d.ref());
           });
  };
  double peak_h2d = peak(true), peak_d2h = peak(false);
  big.reset();
  json chunks = json::array();
  double h2d_min = 1e30, d2h_min = 1e30;
  std::vector<std::pair<double, double>> rates;  // per chunk size: H2D, D2H
  for (std::size_t chunk : sizes) {
    std::vector<PinnedBlock> ring;
    for (int i = 0; i < 4; ++i) {
      ring.push_back(pool.allocate(chunk));
      std::memset(ring.back().data(), 1, chunk);
    }
    auto rate = [&](bool h2d) {
      return double(total) / 1e9 / best_seconds(s, 3, [&] {
               for (std::size_t off = 0, i = 0; off < total; off += chunk, ++i) {
                 const MemRef host = host_ref(ring[i % ring.size()].data(), chunk);
                 h2d ? s.copy(d.ref(off, chunk), host) : s.copy(host, d.ref(off, chunk));
               }
             });
    };
    const double h2d = rate(true), d2h = rate(false);
    h2d_min = std::min(h2d_min, h2d);
    d2h_min = std::min(d2h_min, d2h);
    // The peak is the fastest the link was seen to go, whole-buffer copy or chunks.
    peak_h2d = std::max(peak_h2d, h2d);
    peak_d2h = std::max(peak_d2h, d2h);
    chunks.push_back({{"chunk_bytes", chunk}, {"h2d_gbps", h2d}, {"d2h_gbps", d2h}});
    rates.emplace_back(h2d, d2h);
  }
  table.push_back(fmt::format("  link (pinned, {} per run)  peak H2D {:.1f} GB/s, D2H {:.1f} GB/s",
                              human_bytes(double(total)), peak_h2d, peak_d2h));
  for (std::size_t i = 0; i < sizes.size(); ++i)
    table.push_back(fmt::format(
        "    chunks of {:>8}: H2D {:6.1f} GB/s ({:.2f} of peak), D2H {:6.1f} GB/s ({:.2f})",
        human_bytes(double(sizes[i])), rates[i].first, rates[i].first / peak_h2d, rates[i].second,
        rates[i].second / peak_d2h));
  return {{"bytes_per_run", total},
          {"peak_h2d_gbps", peak_h2d},
          {"peak_d2h_gbps", peak_d2h},
          {"chunks", chunks},
          {"h2d_gbps", h2d_min},  // the slowest chunk size
          {"d2h_gbps", d2h_min},
          {"h2d_ratio_vs_peak", h2d_min / peak_h2d},
          {"d2h_ratio_vs_peak", d2h_min / peak_d2h},
          {"reference",
           "peak_h2d_gbps / peak_d2h_gbps: the fastest this run saw the link go each way, one "
           "copy of bytes_per_run from pinned memory or any chunk size's (best of 3 each); the "
           "ratios are the slowest chunk size's share of it"}};
}

json bench_gemm(Device& dev, Stream& s, const Args& args, std::vector<std::string>& table,
                double* peak_tflops) {
  struct Shape {
    const char* name;
    std::int64_t m, n, k;
  };
  // An 8B Llama layer (hidden 4096, 8 KV heads of 128, MLP 14336) over 8192 tokens: y = x W^T.
  std::vector<Shape> shapes = {{"qkv", 8192, 6144, 4096},
                               {"attn_out", 8192, 4096, 4096},
                               {"gate_up", 8192, 28672, 4096},
                               {"down", 8192, 4096, 14336}};
  if (args.rehearse) shapes = {{"small", 256, 384, 256}};
  json rows = json::array();
  // A rehearsal (the CPU-emulated device) has no cuBLASLt to compare with: its column says so.
  table.push_back(
      args.rehearse
          ? "  bf16 GEMM (A [m,k] x W[n,k]^T, fp32 out)      ours TFLOP/s  (no cuBLASLt)  ratio"
          : "  bf16 GEMM (A [m,k] x W[n,k]^T, fp32 out)      ours TFLOP/s  cuBLASLt best  ratio");
  *peak_tflops = 0;
  for (const Shape& sh : shapes) {
    Buffer a = dev.alloc(std::size_t(sh.m * sh.k) * 2, &s),
           b = dev.alloc(std::size_t(sh.n * sh.k) * 2, &s),
           c = dev.alloc(std::size_t(sh.m * sh.n) * 4, &s);
    s.fill(tensor(a, DType::kBF16), 0.5f);
    s.fill(tensor(b, DType::kBF16), 0.25f);
    MatmulDesc d;
    d.m = sh.m;
    d.n = sh.n;
    d.k = sh.k;
    d.trans_b = true;
    d.a = tensor(a, DType::kBF16);
    d.b = tensor(b, DType::kBF16);
    d.c = tensor(c, DType::kF32);
    s.matmul(d);  // warm-up (cuBLAS's handle, its heuristics)
    const int calls = 10;
    const double ours_s = best_seconds(s, 5,
                                       [&] {
                                         for (int i = 0; i < calls; ++i) s.matmul(d);
                                       }) /
                          calls;
    gpu::GemmBest lt{ours_s, 0, -1, 0};  // rehearsal: ours is its own reference
    if (!args.rehearse) lt = gpu::best_cublaslt_gemm(s, d, 16, calls);
    const double flop = 2.0 * double(sh.m) * double(sh.n) * double(sh.k);
    const double ours = flop / ours_s / 1e12, best = flop / lt.seconds / 1e12;
    *peak_tflops = std::max({*peak_tflops, best, ours});
    rows.push_back({{"name", sh.name},
                    {"m", sh.m},
                    {"n", sh.n},
                    {"k", sh.k},
                    {"tflops", ours},
                    {"cublaslt_best_tflops", best},
                    {"cublaslt_candidates", lt.candidates},
                    {"cublaslt_best_candidate", lt.candidate},
                    {"ratio_vs_cublaslt", ours / best},
                    {"broken_bound", !args.rehearse && broken_bound(ours / best)}});
    table.push_back(fmt::format(
        "    {:<9} {:>5}x{:>5}x{:>5}                 {:8.1f}  {:13.1f}  {:5.2f}{}", sh.name, sh.m,
        sh.n, sh.k, ours, best, ours / best, args.rehearse ? "" : broken_bound_note(ours / best)));
  }
  double worst = 1e30;
  for (const auto& r : rows) worst = std::min(worst, r["ratio_vs_cublaslt"].get<double>());
  return {{"shapes", rows},
          {"peak_tflops", *peak_tflops},
          {"ratio_vs_cublaslt", worst},
          {"reference", args.rehearse
                            ? "rehearsal: strata's own matmul stands in for cuBLASLt"
                            : "cuBLASLt's fastest of up to 16 of its heuristic's algorithms on "
                              "each shape and the same operands in this run (10 calls each "
                              "after one); " +
                                  broken_bound_clause()}};
}

json bench_adamw(Device& dev, Stream& s, const Args& a, std::vector<std::string>& table) {
  const auto n = std::size_t(a.adamw_mparams * 1e6) / 64 * 64;
  STRATA_REQUIRE(n > 0, "--adamw-mparams must be > 0");
  const int shards = 16;
  const std::size_t per = n / shards;
  double adamw_s = 0;
  {
    Buffer p = dev.alloc(n * 4, &s), g = dev.alloc(n * 4, &s), m = dev.alloc(n * 4, &s),
           v = dev.alloc(n * 4, &s), w = dev.alloc(n * 2, &s), bad = dev.alloc(4, &s);
    s.fill(tensor(p, DType::kF32), 1.0f);
    s.fill(tensor(g, DType::kF32), 0.01f);
    s.fill(tensor(m, DType::kF32), 0.0f);
    s.fill(tensor(v, DType::kF32), 0.0f);
    AdamWDesc desc;
    desc.policy = NonFinitePolicy::kReportOnly;  // as the engine runs it: no pre-check pass
    desc.non_finite = tensor(bad, DType::kF32, 1);
    for (int i = 0; i < shards; ++i) {
      const std::size_t off = std::size_t(i) * per;
      desc.shards.push_back({tensor(p, DType::kF32, per, off), tensor(g, DType::kF32, per, off),
                             tensor(m, DType::kF32, per, off), tensor(v, DType::kF32, per, off),
                             tensor(w, DType::kBF16, per, off)});
    }
    std::int64_t step = 0;
    auto run = [&] {
      desc.options.step = ++step;
      s.adamw(desc);
    };
    run();
    adamw_s = best_seconds(s, 3,
                           [&] {
                             for (int i = 0; i < 5; ++i) run();
                           }) /
              5;
  }
  const std::size_t moved = std::size_t(per) * shards * 30;  // read p g m v, write p m v, bf16 out
  Buffer src = dev.alloc(moved / 2, &s), dst = dev.alloc(moved / 2, &s);  // a copy reads and writes
  s.fill(tensor(src, DType::kF32), 1.0f);
  s.copy(dst.ref(), src.ref());
  const double copy_s = best_seconds(s, 3,
                                     [&] {
                                       for (int i = 0; i < 5; ++i) s.copy(dst.ref(), src.ref());
                                     }) /
                        5;
  const double adamw_gbps = double(moved) / adamw_s / 1e9, copy_gbps = double(moved) / copy_s / 1e9;
  table.push_back(fmt::format(
      "  AdamW ({:.0f}M params, fp32 state, bf16 copy-out)  {:.0f} GB/s, device copy {:.0f} GB/s: "
      "ratio {:.2f}{}",
      double(per * shards) / 1e6, adamw_gbps, copy_gbps, adamw_gbps / copy_gbps,
      broken_bound_note(adamw_gbps / copy_gbps)));
  return {{"params", per * shards},
          {"bytes_per_step", moved},
          {"adamw_gbps", adamw_gbps},
          {"params_per_s", double(per * shards) / adamw_s},
          {"d2d_copy_gbps", copy_gbps},
          {"reference", "a device-to-device copy of the same bytes in this run (best of 3 x 5); " +
                            broken_bound_clause()},
          {"ratio_vs_copy", adamw_gbps / copy_gbps},
          {"broken_bound", broken_bound(adamw_gbps / copy_gbps)}};
}

// The kernels part's inputs: uniform in [lo, hi) from a fixed seed (xorshift: the attention
// inputs are 50M values).
std::vector<float> uniform(std::size_t n, std::uint64_t seed, float lo, float hi) {
  std::vector<float> v(n);
  std::uint64_t x = seed * 0x9E3779B97F4A7C15ull | 1;
  for (auto& e : v) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    e = lo + (hi - lo) * float(x >> 40) * 0x1p-24f;
  }
  return v;
}

Buffer upload(Device& dev, Stream& s, const void* host, std::size_t bytes) {
  Buffer b = dev.alloc(bytes, &s);
  s.copy(b.ref(), host_ref(host, bytes));
  s.synchronize();  // the host vector may go once this returns
  return b;
}

std::vector<float> download(Stream& s, const Buffer& b) {
  std::vector<float> h(b.size() / 4);
  s.copy(host_ref(h.data(), b.size()), b.ref());
  s.synchronize();
  return h;
}

// Milliseconds of the work `queue` puts on `s`: CUDA events around it on a GPU, the wall clock
// to a synchronize on the emulated device (a rehearsal).
double queued_ms(Stream& s, const Args& a, const std::function<void()>& queue) {
  if (!a.rehearse) return gpu::time_queued_ms(s, queue);
  s.synchronize();
  const Stopwatch sw;
  queue();
  s.synchronize();
  return sw.seconds() * 1e3;
}

// The CUDA module's variant for the kernels part's span, the one it found put back after (the
// emulated device has one CPU kernel per op: nothing to switch).
class VariantScope {
 public:
  explicit VariantScope(bool cuda) : cuda_(cuda) {
    if (cuda_) saved_ = gpu::model_kernel_variant();
  }
  ~VariantScope() {
    if (cuda_) gpu::set_model_kernel_variant(saved_);
  }
  VariantScope(const VariantScope&) = delete;
  VariantScope& operator=(const VariantScope&) = delete;
  void use(gpu::KernelVariant v) const {
    if (cuda_) gpu::set_model_kernel_variant(v);
  }

 private:
  bool cuda_;
  gpu::KernelVariant saved_ = gpu::KernelVariant::kSimple;
};

// The largest |got - ref| (infinite where either is NaN or they differ in infinity) and the
// largest |ref|.
struct Diff {
  double max_abs = 0, scale = 0;
  double rel() const { return max_abs == 0 ? 0 : max_abs / std::max(scale, 1e-30); }
};
Diff diff(const std::vector<float>& ref, const std::vector<float>& got) {
  Diff d;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    const double e = std::fabs(double(got[i]) - double(ref[i]));
    if (!(e <= d.max_abs)) d.max_abs = std::isnan(e) ? INFINITY : e;
    d.scale = std::max(d.scale, std::fabs(double(ref[i])));
  }
  return d;
}

constexpr int kKernelRuns = 5;  // timed runs per variant; the median is reported

// One op of the kernels part: its launcher (through model_ops, as the model calls it), the
// buffers it writes (zeroed before a run whose results are read: some accumulate) and those
// compared between the variants.
struct KernelCase {
  std::string name;   // JSON key prefix
  std::string shape;  // for the table
  double tolerance;   // of the largest difference relative to the simple result's largest value
  std::vector<const Buffer*> written, compared;
  std::function<void()> run;
};

json bench_kernels(Device& dev, Stream& s, const Args& a, std::vector<std::string>& table) {
  using model_ops::Weight;
  const bool small = a.rehearse;
  // An 8B Llama layer's attention (32 heads of 128, 8 KV heads) over 4 x 2048 tokens, its norms
  // and a bias over 8192 rows of 4096, and the embedding of a 32000-token vocabulary.
  const std::int64_t b = small ? 1 : 4, t = small ? 77 : 2048, nh = small ? 4 : 32,
                     nkv = small ? 2 : 8, hd = small ? 64 : 128;
  const std::int64_t n = b * t, c = small ? 96 : 4096, vocab = small ? 50 : 32000;
  const double scale = 1.0 / std::sqrt(double(hd));
  const std::size_t qkv_n = std::size_t(n * (nh + 2 * nkv) * hd), o_n = std::size_t(n * nh * hd),
                    lse_n = std::size_t(b * nh * t), nc = std::size_t(n * c);
  auto f32 = [&](std::size_t count) {
    Buffer buf = dev.alloc(count * 4, &s);
    s.fill(tensor(buf, DType::kF32), 0.0f);
    return buf;
  };
  auto in = [&](std::size_t count, std::uint64_t seed, float lo, float hi) {
    const std::vector<float> h = uniform(count, seed, lo, hi);
    return upload(dev, s, h.data(), h.size() * 4);
  };
  const VariantScope variants(!a.rehearse);

  Buffer qkv = in(qkv_n, 1, -1.0f, 1.0f), dout = in(o_n, 2, -1.0f, 1.0f);
  Buffer o = f32(o_n), lse = f32(lse_n), o_in = f32(o_n), lse_in = f32(lse_n), dqkv = f32(qkv_n);
  variants.use(gpu::KernelVariant::kSimple);  // the backward's inputs: the simple forward's outputs
  model_ops::attention_forward(s, static_cast<float*>(qkv.data()), static_cast<float*>(o_in.data()),
                               nullptr, static_cast<float*>(lse_in.data()), b, t, nh, nkv, hd,
                               scale, DType::kBF16);
  Buffer rows_a = in(nc, 3, -1.0f, 1.0f), rows_b = in(nc, 4, -1.0f, 1.0f), dx = f32(nc);
  Buffer w = in(std::size_t(c), 5, 0.5f, 1.5f), rstd = in(std::size_t(n), 6, 0.5f, 2.0f),
         mean = in(std::size_t(n), 7, -0.1f, 0.1f);
  Buffer dw = f32(std::size_t(c)), db = f32(std::size_t(c));
  Buffer dwte = f32(std::size_t(vocab * c)), dwpe = f32(std::size_t(t * c));
  std::vector<std::int32_t> tokens(static_cast<std::size_t>(n));
  std::mt19937_64 rng(8);
  for (auto& tok : tokens) tok = std::int32_t(rng() % std::uint64_t(vocab));
  Buffer tok = upload(dev, s, tokens.data(), tokens.size() * 4);

  auto p = [](const Buffer& buf) { return static_cast<float*>(buf.data()); };
  const std::string attn = fmt::format("b{} t{} h{}/{} d{} bf16", b, t, nh, nkv, hd);
  const std::string rows = fmt::format("{} x {}", n, c);
  std::vector<KernelCase> cases = {
      {"attention_forward",
       attn,
       3e-2,
       {&o, &lse},
       {&o, &lse},
       [&] {
         model_ops::attention_forward(s, p(qkv), p(o), nullptr, p(lse), b, t, nh, nkv, hd, scale,
                                      DType::kBF16);
       }},
      {"attention_backward",
       attn,
       3e-2,
       {&dqkv},
       {&dqkv},
       [&] {
         model_ops::attention_backward(s, p(qkv), p(o_in), p(dout), p(lse_in), p(dqkv), b, t, nh,
                                       nkv, hd, scale, DType::kBF16);
       }},
      {"rmsnorm_backward",
       rows,
       1e-4,
       {&dx, &dw},
       {&dw},
       [&] {
         model_ops::rmsnorm_backward(s, p(rows_a), p(rows_b), Weight{w.data(), DType::kF32},
                                     p(rstd), p(dx), p(dw), n, c);
       }},
      {"layernorm_backward",
       rows,
       1e-4,
       {&dx, &dw, &db},
       {&dw, &db},
       [&] {
         model_ops::layernorm_backward(s, p(rows_a), p(rows_b), Weight{w.data(), DType::kF32},
                                       p(mean), p(rstd), p(dx), p(dw), p(db), n, c);
       }},
      {"bias_backward",
       rows,
       1e-4,
       {&db},
       {&db},
       [&] { model_ops::bias_backward(s, p(rows_a), p(db), n, c); }},
      // Bit-equal by construction (each element's additions in the same order): tolerance 0.
      {"embedding_backward",
       fmt::format("{} x {}, vocab {}, t {}", n, c, vocab, t),
       0.0,
       {&dwte, &dwpe},
       {&dwte, &dwpe},
       [&] {
         model_ops::embedding_backward(s, static_cast<const std::int32_t*>(tok.data()), p(rows_a),
                                       p(dwte), p(dwpe), n, t, c);
       }},
  };

  table.push_back(fmt::format(
      "  kernels: simple vs tiled (STRATA_GPU_KERNELS), GPU ms, median of {} runs{}", kKernelRuns,
      a.rehearse ? " (rehearsal: both columns run the CPU reference)" : ""));
  table.push_back(
      "    kernel              shape                          simple ms  tiled ms  ratio  "
      "max|diff|  "
      "rel diff  tolerance");
  json figures = {
      {"runs", kKernelRuns},
      {"attention_shape", {{"b", b}, {"t", t}, {"heads", nh}, {"kv_heads", nkv}, {"head_dim", hd}}},
      {"rows", n},
      {"columns", c},
      {"vocab", vocab}};
  bool ok = true;
  for (const KernelCase& k : cases) {
    auto result = [&] {
      for (const Buffer* buf : k.written) s.fill(tensor(*buf, DType::kF32), 0.0f);
      k.run();
      std::vector<float> all;
      for (const Buffer* buf : k.compared) {
        const std::vector<float> h = download(s, *buf);
        all.insert(all.end(), h.begin(), h.end());
      }
      return all;
    };
    std::vector<float> got[2];
    double ms[2];
    for (int v = 0; v < 2; ++v) {
      variants.use(v == 0 ? gpu::KernelVariant::kSimple : gpu::KernelVariant::kTiled);
      got[v] = result();
      std::vector<double> runs;
      for (int r = 0; r < kKernelRuns; ++r) runs.push_back(queued_ms(s, a, k.run));
      ms[v] = median(runs);
    }
    const std::vector<float> again = result();  // the tiled variant again: bit for bit?
    const bool repeatable = again.size() == got[1].size() &&
                            std::memcmp(again.data(), got[1].data(), again.size() * 4) == 0;
    const Diff d = diff(got[0], got[1]);
    const bool within = d.rel() <= k.tolerance;
    ok = ok && within && repeatable;
    figures[k.name + "_simple_ms"] = ms[0];
    figures[k.name + "_tiled_ms"] = ms[1];
    figures[k.name + "_tiled_speedup"] = ms[0] / ms[1];  // simple ms / tiled ms
    figures[k.name + "_max_abs_diff"] = d.max_abs;
    figures[k.name + "_max_rel_diff"] = d.rel();  // relative to the simple result's largest |value|
    figures[k.name + "_tolerance"] = k.tolerance;
    figures[k.name + "_tiled_repeatable"] = repeatable;
    table.push_back(
        fmt::format("    {:<19} {:<30} {:9.3f} {:9.3f} {:6.2f}  {:9.2e}  {:8.1e}  {:9.0e}{}{}",
                    k.name, k.shape, ms[0], ms[1], ms[0] / ms[1], d.max_abs, d.rel(), k.tolerance,
                    within ? "" : "  OUT OF TOLERANCE", repeatable ? "" : "  NOT REPEATABLE"));
  }
  figures["ok"] = ok;
  figures["reference"] =
      "the simple kernels (STRATA_GPU_KERNELS=simple) on the same inputs: the tiled ones' results "
      "held to them within each kernel's tolerance (relative to the simple result's largest "
      "value) and run twice bit for bit; *_tiled_speedup is simple ms / tiled ms, medians of "
      "runs, a comparison of two variants, not a bound";
  return figures;
}

void write_file(const fs::path& path, const std::string& text) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f << text;
  STRATA_CHECK(f.good(), "cannot write {}", path.string());
}

// `count` u16 tokens below `vocab`: a fixed recurrence with 10% noise, so a model has
// something to learn and the losses move.
void write_tokens(const fs::path& path, std::size_t count, std::int64_t vocab) {
  std::mt19937_64 rng(7);
  std::vector<std::uint16_t> t(count);
  std::uint64_t x = 1;
  for (auto& e : t) {
    x = (x * 7 + 3) % std::uint64_t(vocab);
    e = static_cast<std::uint16_t>(rng() % 10 == 0 ? rng() % std::uint64_t(vocab) : x);
  }
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(reinterpret_cast<const char*>(t.data()), std::streamsize(t.size() * 2));
  STRATA_CHECK(f.good(), "cannot write {}", path.string());
}

json llama_config(std::int64_t hidden, std::int64_t layers, std::int64_t heads, std::int64_t kv,
                  std::int64_t inter, std::int64_t vocab, std::int64_t seq) {
  return {{"model_type", "llama"},
          {"architectures", {"LlamaForCausalLM"}},
          {"vocab_size", vocab},
          {"hidden_size", hidden},
          {"intermediate_size", inter},
          {"num_hidden_layers", layers},
          {"num_attention_heads", heads},
          {"num_key_value_heads", kv},
          {"max_position_embeddings", seq},
          {"rms_norm_eps", 1e-5},
          {"rope_theta", 10000.0},
          {"tie_word_embeddings", false}};
}

// A ds_config: ZeRO-3, bf16, AdamW, parameters and optimizer state on `where` (cpu | nvme).
json ds_config(const std::string& where, const std::string& nvme_path, std::int64_t micro_batch) {
  json off = {{"device", where}, {"pin_memory", true}};
  if (where == "nvme") off["nvme_path"] = nvme_path;
  return {
      {"train_micro_batch_size_per_gpu", micro_batch},
      {"gradient_accumulation_steps", 1},
      {"bf16", {{"enabled", true}}},
      {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 1e-4}, {"weight_decay", 0.0}}}}},
      {"zero_optimization", {{"stage", 3}, {"offload_param", off}, {"offload_optimizer", off}}}};
}

struct TraceFigures {
  double busy_s = 0;    // the union of the lane's spans
  double extent_s = 0;  // first start to last end of every span in the trace: the traced step
};

// How long the lane `lane` of a Chrome trace of one step is busy, and how long the step is.
TraceFigures lane_busy(const fs::path& trace, const std::string& lane) {
  std::ifstream f(trace);
  STRATA_CHECK(f.good(), "no trace at {}", trace.string());
  const json t = json::parse(f);
  int tid = -1;
  std::vector<std::pair<double, double>> spans;  // microseconds
  double first = 1e300, last = -1e300;
  for (const auto& e : t.at("traceEvents"))
    if (e.value("ph", "") == "M" && e.at("args").value("name", "") == lane)
      tid = e.at("tid").get<int>();
  for (const auto& e : t.at("traceEvents")) {
    if (e.value("ph", "") != "X") continue;
    const double ts = e.at("ts").get<double>(), end = ts + e.at("dur").get<double>();
    first = std::min(first, ts);
    last = std::max(last, end);
    // (the emulated device also records its streams' event waits: not work)
    if (e.at("tid").get<int>() == tid && !e.value("name", "").starts_with("wait"))
      spans.emplace_back(ts, end);
  }
  STRATA_CHECK(tid >= 0 && !spans.empty(), "the trace {} has no span on lane '{}'", trace.string(),
               lane);
  std::sort(spans.begin(), spans.end());
  double busy = 0, lo = 0, hi = -1;
  for (const auto& [a, b] : spans) {
    if (a > hi) {
      busy += std::max(0.0, hi - lo);
      lo = a;
      hi = b;
    } else {
      hi = std::max(hi, b);
    }
  }
  busy += std::max(0.0, hi - lo);
  return {busy * 1e-6, (last - first) * 1e-6};
}

// One strata::train run; its console output goes to `log`.
TrainResult train_logged(TrainOptions o, const fs::path& log) {
  std::FILE* con = std::fopen(log.c_str(), "w");
  STRATA_CHECK(con != nullptr, "cannot write {}", log.string());
  o.console = con;
  Tracer::global()
      .clear();  // a trace holds this run's step only, not an earlier run's in this process
  try {
    TrainResult r = train(o);
    std::fclose(con);
    return r;
  } catch (...) {
    std::fclose(con);
    throw;
  }
}

json bench_model(const Args& a, const fs::path& out, double peak_tflops,
                 std::vector<std::string>& table) {
  const json cfg = llama_config(a.hidden, a.layers, a.heads, a.kv_heads, a.inter, a.vocab, a.seq);
  write_file(out / "model-config.json", cfg.dump(2));
  write_tokens(out / "model-tokens.u16", std::size_t((a.steps + 2) * a.batch * a.seq + 1), a.vocab);
  // FLOPs of one step (one micro-batch) from the model itself, built on a small emulated device.
  double flops = 0;
  std::size_t params = 0;
  {
    auto hd = make_host_device(
        HostDeviceOptions{.capacity_bytes = std::size_t(256) << 20, .poison = false});
    auto hs = hd->create_stream("flops");
    ModelOptions mo;
    mo.micro_batch = a.batch;
    mo.seq_len = a.seq;
    mo.compute = DType::kBF16;
    const Model m(parse_model_config(cfg.dump(), "model-config.json"), *hd, *hs, mo);
    flops = m.flops_per_step();
    params = m.num_params();
  }
  table.push_back(fmt::format(
      "  model step: Llama {:.1f}M params (hidden {}, {} layers), B={} T={}, bf16, ZeRO-3, 1 GPU",
      double(params) / 1e6, a.hidden, a.layers, a.batch, a.seq));
  table.push_back(a.rehearse ? "    placement     step s   tokens/s    MFU  device idle (emulated)"
                             : "    placement     step s   tokens/s    MFU  GPU idle");
  json runs = json::object();
  // On a GPU also the host placement with the tiled kernels, when the simple ones (the default)
  // are in use: the step's speed with each (the kernels part times them one by one).
  const VariantScope variants(!a.rehearse);
  struct Run {
    std::string tag, where;
    bool tiled;
  };
  std::vector<Run> plan = {{"host", "cpu", false}, {"nvme", "nvme", false}};
  if (!a.rehearse && gpu::model_kernel_variant() == gpu::KernelVariant::kSimple)
    plan.push_back({"host_tiled", "cpu", true});
  // Whether the MFU is held to a bound: a rehearsal's peak is its own small matmul's, no bound (as
  // the gemm part's).
  const bool mfu_bounded = !a.rehearse && peak_tflops > 0;
  for (const Run& run : plan) {
    const std::string& tag = run.tag;
    const std::string& where = run.where;
    if (run.tiled) variants.use(gpu::KernelVariant::kTiled);
    write_file(out / ("ds-" + tag + ".json"), ds_config(where, a.nvme_path, a.batch).dump(2));
    TrainOptions o;
    o.model_config = (out / "model-config.json").string();
    o.data_files = {(out / "model-tokens.u16").string()};
    o.data_format = "u16";
    o.ds_config = (out / ("ds-" + tag + ".json")).string();
    o.seq_len = a.seq;
    o.steps = a.steps;
    o.device = a.train_device();
    o.log_json = (out / ("model-" + tag + ".jsonl")).string();
    o.trace_file = (out / ("trace-" + tag + ".json")).string();
    o.trace_step = a.steps;  // the last: the earlier ones warm up (prefetch order, allocator)
    o.overwrite = true;      // the log and the trace are this part's own files in --out
    const TrainResult r = train_logged(o, out / ("model-" + tag + ".log"));
    STRATA_CHECK(std::int64_t(r.steps.size()) == a.steps, "{} steps ran, {} expected",
                 r.steps.size(), a.steps);
    std::vector<double> untraced;
    for (std::size_t i = 1; i + 1 < r.steps.size(); ++i) untraced.push_back(r.steps[i].step_s);
    if (untraced.empty()) untraced.push_back(r.steps.back().step_s);
    const double step_s = median(untraced);
    // The traced step's length as its trace shows it: the trainer's own step time for it also
    // counts writing the trace.
    const TraceFigures tf = lane_busy(o.trace_file, "compute");
    const double traced_s = tf.extent_s, busy = tf.busy_s;
    const double idle = std::clamp(1.0 - busy / traced_s, 0.0, 1.0);
    const double tokens_per_s = double(a.batch * a.seq) / step_s;
    const double mfu = peak_tflops > 0 ? flops / step_s / (peak_tflops * 1e12) : 0;
    runs[tag] = {{"step_s", step_s},
                 {"tokens_per_s", tokens_per_s},
                 {"model_tflops", flops / step_s / 1e12},
                 {"mfu", peak_tflops > 0 ? json(mfu) : json(nullptr)},
                 {"broken_bound", mfu_bounded && broken_bound(mfu)},
                 {"traced_step_s", traced_s},
                 {"gpu_busy_s", busy},
                 {"gpu_idle_share", idle},
                 {"losses",
                  [&] {
                    json l = json::array();
                    for (const auto& s : r.steps) l.push_back(s.loss);
                    return l;
                  }()},
                 {"trace", o.trace_file},
                 {"log_json", o.log_json}};
    table.push_back(fmt::format("    {:<11} {:8.3f} {:10.0f} {:>6} {:8.2f}{}",
                                run.tiled ? "host, tiled" : tag, step_s, tokens_per_s,
                                peak_tflops > 0 ? fmt::format("{:.3f}", mfu) : "-", idle,
                                mfu_bounded ? broken_bound_note(mfu) : ""));
  }
  return {{"params", params},
          {"flops_per_step", flops},
          {"batch", a.batch},
          {"seq_len", a.seq},
          {"steps", a.steps},
          {"peak_tflops", peak_tflops},
          {"placements", runs},
          {"reference",
           a.rehearse && peak_tflops > 0
               ? std::string("rehearsal: mfu is flops_per_step over the median untraced step as a "
                             "share of the gemm part's own matmul on its small shape, no bound")
           : peak_tflops > 0
               ? "mfu: flops_per_step over the median untraced step, as a share of peak_tflops, "
                 "the fastest bf16 GEMM the gemm part measured in this run (cuBLASLt's best or "
                 "ours, on an 8B Llama layer's shapes); " +
                     broken_bound_clause()
               : std::string("no mfu: the gemm part did not run (--parts without gemm), so there "
                             "is no peak to divide by")}};
}

json bench_parity(const Args& a, const fs::path& out, std::vector<std::string>& table) {
  const std::int64_t vocab = 512, seq = 128, batch = 4, steps = 8;
  write_file(out / "parity-config.json", llama_config(256, 4, 4, 2, 688, vocab, seq).dump(2));
  write_tokens(out / "parity-tokens.u16", std::size_t((steps + 2) * batch * seq + 1), vocab);
  write_file(out / "ds-parity.json", ds_config("cpu", "", batch).dump(2));
  std::map<std::string, std::vector<double>> losses;
  for (const std::string dev : {"cuda", "cpu"}) {
    TrainOptions o;
    o.device = dev == "cuda" ? a.train_device() : dev;
    o.model_config = (out / "parity-config.json").string();
    o.data_files = {(out / "parity-tokens.u16").string()};
    o.data_format = "u16";
    o.ds_config = (out / "ds-parity.json").string();
    o.seq_len = seq;
    o.steps = steps;
    o.lr = 3e-3;
    o.log_json = (out / ("parity-" + dev + ".jsonl")).string();
    o.overwrite = true;  // this part's own file in --out
    for (const auto& s : train_logged(o, out / ("parity-" + dev + ".log")).steps)
      losses[dev].push_back(s.loss);
  }
  const auto& g = losses["cuda"];
  const auto& c = losses["cpu"];
  STRATA_CHECK(g.size() == c.size() && !g.empty(), "parity: {} GPU steps, {} CPU steps", g.size(),
               c.size());
  double worst = 0;
  for (std::size_t i = 0; i < g.size(); ++i)
    worst = std::max(worst, std::abs(g[i] - c[i]) / std::abs(c[i]));
  const bool ok = std::isfinite(worst) && worst <= kParityTolerance;
  table.push_back(fmt::format(
      "  parity (Llama 4x256, {} steps, host offload, bf16): GPU vs CPU-emulated losses, max rel "
      "diff {:.2e} (tolerance {:.0e}): {}",
      steps, worst, kParityTolerance, ok ? "ok" : "FAILED"));
  return {{"steps", steps},
          {"cuda_losses", g},
          {"cpu_losses", c},
          {"max_rel_diff", worst},
          {"tolerance", kParityTolerance},
          {"ok", ok},
          {"reference",
           "the same training (model, data, ds_config, seed) on the CPU-emulated device: each "
           "step's loss held to it, the largest relative difference within tolerance"}};
}

// The model part's shape, checked as strata-train would check its config.json, before the GPU
// is probed: a bad value is an error on a machine without one too (gpu-check runs this first),
// not a failure after the other parts' minutes on one.
void check_model_flags(const Args& a) {
  STRATA_REQUIRE(a.vocab > 0 && a.vocab <= 65536,
                 "--vocab {} must be in 1..65536 (the data is u16 tokens)", a.vocab);
  try {
    parse_model_config(
        llama_config(a.hidden, a.layers, a.heads, a.kv_heads, a.inter, a.vocab, a.seq).dump(),
        "the model part's config");
  } catch (const Error& e) {
    STRATA_THROW(kInvalidArgument,
                 "{} (from the flags: hidden_size is --hidden, num_attention_heads --heads, "
                 "num_key_value_heads --kv-heads, intermediate_size --intermediate, "
                 "num_hidden_layers --layers, "
                 "max_position_embeddings --seq)",
                 e.message());
  }
}

void run(Args a) {
  const CudaProbe probe = probe_cuda();
  if (probe.device_count == 0 && !a.rehearse) {
    std::printf("SKIPPED: %s\n", probe.reason.c_str());
    json parts = json::object();
    for (const char* p : kParts) parts[p] = "skipped";
    if (a.json)
      print_json(
          {{"command", "gpu"}, {"skipped", true}, {"reason", probe.reason}, {"parts", parts}});
    return;
  }
  if (a.probe && !a.rehearse) {
    for (const auto& d : gpu::device_descriptions()) std::printf("GPU: %s\n", d.c_str());
    if (a.json)
      print_json({{"command", "gpu"}, {"skipped", false}, {"devices", gpu::device_descriptions()}});
    return;
  }
  const std::vector<std::string> parts = parse_parts(a.parts);
  const fs::path out = a.out.empty() ? fs::path(default_scratch_dir("gpu-bench")) : fs::path(a.out);
  fs::create_directories(out);
  if (std::find(parts.begin(), parts.end(), "model") != parts.end()) {
    // The model part's token file, (steps + 2) x batch x seq u16 tokens, on the drive's free space
    // before any part runs.
    const double tokens_bytes = (double(a.steps + 2) * double(a.batch) * double(a.seq) + 1) * 2;
    std::error_code ec;
    const fs::space_info sp = fs::space(out, ec);
    STRATA_REQUIRE(ec || tokens_bytes <= double(sp.available) * 0.9,
                   "the model part's token file ({} steps + 2 of --batch {} x --seq {} tokens) "
                   "takes {}, more than 90% of the {} free in {}: give a smaller --batch, --seq "
                   "or --steps, or another --out",
                   a.steps, a.batch, a.seq, human_bytes(tokens_bytes),
                   human_bytes(double(sp.available)), out.string());
  }
  if (a.nvme_path.empty()) a.nvme_path = default_scratch_dir("gpu-bench-nvme");
  fs::create_directories(a.nvme_path);

  json figures = {{"command", "gpu"}, {"skipped", false}, {"rehearsal", a.rehearse}};
  std::vector<std::string> table;
  double peak_tflops = 0;
  int failures = 0;
  {
    auto dev =
        a.rehearse ? make_host_device(HostDeviceOptions{.poison = false}) : make_cuda_device({});
    figures["device"] = dev->name();
    std::printf("strata-bench gpu: %s\n", dev->name().c_str());
    auto s = dev->create_stream("bench-gpu");
    for (const std::string& p : parts) {
      if (p == "model" || p == "parity") continue;  // below, once this device is gone
      const Stopwatch sw;
      try {
        if (p == "link") figures["link"] = bench_link(*dev, *s, a, table);
        if (p == "gemm") figures["gemm"] = bench_gemm(*dev, *s, a, table, &peak_tflops);
        if (p == "adamw") figures["adamw"] = bench_adamw(*dev, *s, a, table);
        if (p == "kernels") {
          figures["kernels"] = bench_kernels(*dev, *s, a, table);
          if (!figures["kernels"]["ok"].get<bool>()) ++failures;
        }
      } catch (const Error& e) {
        ++failures;
        figures[p] = {{"error", e.what()}};
        table.push_back(fmt::format("  {}: FAILED: {}", p, e.what()));
      }
      figures[p]["seconds"] = sw.seconds();
    }
  }
  // strata::train makes its own device; the one above is released first.
  for (const std::string& p : parts) {
    if (p != "model" && p != "parity") continue;
    const Stopwatch sw;
    try {
      if (p == "model") figures["model"] = bench_model(a, out, peak_tflops, table);
      if (p == "parity") {
        figures["parity"] = bench_parity(a, out, table);
        if (!figures["parity"]["ok"].get<bool>()) ++failures;
      }
    } catch (const Error& e) {
      ++failures;
      figures[p] = {{"error", e.what()}};
      table.push_back(fmt::format("  {}: FAILED: {}", p, e.what()));
    }
    figures[p]["seconds"] = sw.seconds();
  }
  for (const auto& line : table) std::printf("%s\n", line.c_str());
  std::printf("  files: %s\n", out.c_str());
  json status = json::object();
  for (const char* p : kParts)
    status[p] = !figures.contains(p)           ? "not run"
                : figures[p].contains("error") ? "failed"
                : figures[p].value("ok", true) ? "ok"
                                               : "failed";
  figures["parts"] = status;
  figures["ok"] = failures == 0;
  figures["out"] = out.string();
  if (a.json) print_json(figures);
  std::fflush(stdout);
  if (failures > 0) {  // a measured result, not an error of the tool: the figures stay last
    std::fprintf(stderr, "strata-bench gpu: %d part(s) failed (see above)\n", failures);
    exit_code() = 1;
  }
}

}  // namespace
}  // namespace gpu_cmd

void add_gpu_command(CLI::App& app) {
  using namespace gpu_cmd;
  auto* cmd = app.add_subcommand(
      "gpu",
      "link, GEMM, AdamW, model kernels and model step on a CUDA GPU vs its measured "
      "bounds");
  auto a = std::make_shared<Args>();
  cmd->add_option("--parts", a->parts, "comma-separated: " + part_names(",") + " (default all)");
  cmd->add_option(
      "--out", a->out,
      "folder for the model runs' configs, logs and traces (default: the scratch folder)");
  cmd->add_flag("--overwrite", a->overwrite,
                "replace the bench's files an earlier run left in --out");
  cmd->add_option("--nvme-path", a->nvme_path,
                  "swap folder of the NVMe placement (default: the scratch folder)");
  cmd->add_option("--link-gib", a->link_gib, "bytes per link run, GiB (default 1)")
      ->check(tools::kPositive);
  cmd->add_option("--adamw-mparams", a->adamw_mparams, "AdamW parameters, millions (default 256)")
      ->check(tools::kPositive);
  cmd->add_option("--hidden", a->hidden, "model part: hidden size (default 768)")
      ->check(tools::kPositive);
  cmd->add_option("--layers", a->layers, "model part: decoder layers (default 12)")
      ->check(tools::kPositive);
  cmd->add_option("--heads", a->heads, "model part: attention heads (default 12)")
      ->check(tools::kPositive);
  cmd->add_option("--kv-heads", a->kv_heads, "model part: key/value heads (default 4)")
      ->check(tools::kPositive);
  cmd->add_option("--intermediate", a->inter, "model part: MLP size (default 2048)")
      ->check(tools::kPositive);
  cmd->add_option("--vocab", a->vocab, "model part: vocabulary, <= 65536 (default 32000)");
  cmd->add_option("--batch", a->batch, "model part: micro-batch (default 8)")
      ->check(tools::kPositive);
  cmd->add_option("--seq", a->seq, "model part: sequence length (default 1024)")
      ->check(tools::kPositive);
  cmd->add_option("--steps", a->steps,
                  "model part: steps per placement, the last traced (default 4)")
      ->check(CLI::Range(2, 1000));
  cmd->add_flag("--json", a->json, "print, last, one JSON object of the figures");
  cmd->add_flag("--probe", a->probe, "only say whether a GPU is usable (GPU: ... or SKIPPED: ...)");
  cmd->add_flag(
      "--rehearse", a->rehearse,
      "run every part on the CPU-emulated device (no cuBLASLt reference; parity against itself): "
      "tests the bench where there is no GPU, at small sizes unless given (AdamW 1M parameters, a "
      "2-layer hidden-64 model, B=2 x 64, 3 steps)");
  cmd->callback([a, cmd] {
    parse_parts(a->parts);
    if (a->rehearse) {  // the GPU's sizes would take minutes (and more than the emulated cap) here
      auto small = [&](const char* flag, auto& value, auto v) {
        if (cmd->count(flag) == 0) value = v;
      };
      small("--adamw-mparams", a->adamw_mparams, 1.0);
      small("--hidden", a->hidden, 64);
      small("--layers", a->layers, 2);
      small("--heads", a->heads, 4);
      small("--kv-heads", a->kv_heads, 2);
      small("--intermediate", a->inter, 128);
      small("--vocab", a->vocab, 512);
      small("--batch", a->batch, 2);
      small("--seq", a->seq, 64);
      small("--steps", a->steps, 3);
    }
    check_model_flags(*a);
    // Sizes in the flags' words before the GPU is looked for (--adamw-mparams 1e30 or 1e-5 was
    // "must be > 0" after a cast; --seq 1e9 wrote a 9.4 GB token file, then std::bad_alloc).
    STRATA_REQUIRE(a->adamw_mparams >= 64e-6 && a->adamw_mparams <= 1e5,
                   "--adamw-mparams {} is outside 0.000064 (64 parameters) to 100000 (100 "
                   "billion)",
                   a->adamw_mparams);
    STRATA_REQUIRE(double(a->batch) * double(a->seq) <= double(std::int64_t(1) << 24),
                   "--batch {} x --seq {} is {:.3g} tokens, more than the model part's "
                   "micro-batch takes (at most 2^24 = 16777216: no GPU holds the activations of "
                   "more): give smaller ones",
                   a->batch, a->seq, double(a->batch) * double(a->seq));
    if (a->probe &&
        a->rehearse) {  // flags checked above; nothing to look for (gpu-check.sh's pre-check)
      std::printf("REHEARSAL: flags accepted; --probe looks for no GPU with --rehearse\n");
      return;
    }
    STRATA_REQUIRE(a->link_gib >= 0.25, "--link-gib {}: at least 0.25 (one 256 MiB chunk)",
                   a->link_gib);
    for (const auto& [flag, dir] :
         {std::pair{"--out", a->out}, std::pair{"--nvme-path", a->nvme_path}}) {
      std::error_code ec;
      STRATA_REQUIRE(dir.empty() || !fs::exists(dir, ec) || fs::is_directory(dir, ec),
                     "{} {} is a file: give a folder", flag, dir);
    }
    // The model and parity parts write these names into --out: a user's files there are not
    // replaced unless --overwrite says they are the bench's own (gpu-check.sh runs again into its
    // folder).
    const auto parts = parse_parts(a->parts);
    const auto has = [&](const char* p) {
      return std::find(parts.begin(), parts.end(), p) != parts.end();
    };
    std::vector<std::string> names;
    if (has("model"))
      names = {"model-config.json", "model-tokens.u16", "ds-host.json",   "ds-nvme.json",
               "model-host.jsonl",  "model-nvme.jsonl", "model-host.log", "model-nvme.log",
               "trace-host.json",   "trace-nvme.json"};
    if (has("model") && !a->rehearse)  // the host placement with the tiled kernels, on a GPU
      for (const char* n : {"ds-host_tiled.json", "model-host_tiled.jsonl", "model-host_tiled.log",
                            "trace-host_tiled.json"})
        names.push_back(n);
    if (has("parity"))
      for (const char* n :
           {"parity-config.json", "parity-tokens.u16", "ds-parity.json", "parity-cuda.jsonl",
            "parity-cpu.jsonl", "parity-cuda.log", "parity-cpu.log"})
        names.push_back(n);
    if (!a->out.empty() && !a->overwrite)
      for (const std::string& name : names) {
        std::error_code ec;
        STRATA_REQUIRE(
            !fs::exists(fs::path(a->out) / name, ec),
            "--out {}: {} is there and the bench writes its own; give an empty or new folder, or "
            "--overwrite if it is an earlier run's",
            a->out, name);
      }
    run(*a);
  });
}

}  // namespace strata::bench
