// strata-bench model: forward+backward throughput of the native transformer (a ~100M-parameter
// Llama by default, all weights resident) on a device, against the GEMM library of the same
// device measured in the same run (oneDNN on the CPU device, cuBLAS on CUDA) on the model's own
// GEMMs (Model::gemm_shapes: every linear layer's forward, dX and dW, the LM head's chunks), each
// shape timed alone in the compute dtype and in fp32 (on a CPU without a bf16 matmul, bf16 GEMMs
// are widened to fp32 and fp32 may be the faster), the faster kept, and the shapes combined by
// their FLOPs in a step: the time the library would take for the step's GEMMs, as a rate.
// ratio_vs_matmul = achieved model GFLOP/s / that rate, "the share of the library's rate on the
// model's GEMMs" (on a GPU, the model FLOPs utilisation against it). Recomputation (activation
// checkpointing) is not in the model's FLOPs; its GEMM FLOPs are reported apart.
#include <algorithm>
#include <cstdio>
#include <map>
#include <random>

#include "bench_common.h"
#include "strata/error.h"
#include "strata/model.h"
#include "strata/system_info.h"
#include "strata/trace.h"
#include "tool_main.h"

namespace strata::bench {
// This command's own names: the benchmarks compile as one file (tools/CMakeLists.txt).
namespace model_cmd {
namespace {

struct Args {
  std::string device = "cpu";
  std::string dtype = "bf16";
  std::int64_t hidden = 768, layers = 12, heads = 12, kv_heads = 12, inter = 2048, vocab = 16384;
  std::int64_t batch = 2, seq = 256;
  std::int64_t doc_len = 0;  // > 0: packed rows of documents of this many tokens (Batch::positions)
  int steps = 3, warmup = 1;
  bool checkpoint = false;
  std::int64_t loss_chunk_rows = 0;
  bool json = false;
  bool breakdown = false;
  std::string trace;
  bool overwrite = false;
};

// The best rate over `windows` timed bursts of at least 5 ms each: on a shared machine one
// burst can land on a busy moment, and the ratio's denominator must not come out low.
// In the model's compute dtype (fp32 against an fp32 GEMM: a bf16 bound made fp32 look 2.7x worse).
double gemm_gflops(Device& dev, Stream& s, DType dt, const Model::GemmShape& g, int windows) {
  const std::int64_t m = g.m, n = g.n, k = g.k;
  const std::size_t es = dtype_size(dt);
  Buffer a = dev.alloc(m * k * es, &s), b = dev.alloc(k * n * es, &s), c = dev.alloc(m * n * 4, &s);
  s.fill(tensor(a, dt), 0.5f);
  s.fill(tensor(b, dt), 0.25f);
  MatmulDesc d;
  d.m = m;
  d.n = n;
  d.k = k;
  d.trans_a = g.trans_a;
  d.trans_b = g.trans_b;
  d.a = tensor(a, dt);
  d.b = tensor(b, dt);
  d.c = tensor(c, DType::kF32);
  s.matmul(d);
  s.synchronize();
  double best = 1e30;
  for (int r = 0; r < windows; ++r) {
    const Stopwatch sw;
    int calls = 0;
    do {
      for (int i = 0; i < 8; ++i) s.matmul(d);
      s.synchronize();
      calls += 8;
    } while (sw.seconds() < 0.005);
    best = std::min(best, sw.seconds() / calls);
  }
  return 2.0 * double(m) * n * k / best / 1e9;
}

void run(const Args& a) {
  // No poisoning of fresh and freed memory: a debugging aid that costs a memset per buffer.
  auto dev = make_device(
      a.device, HostDeviceOptions{.capacity_bytes = std::size_t(20) << 30, .poison = false});
  auto s = dev->create_stream("bench-model");
  const nlohmann::json cj =
      llama_config_json(a.vocab, a.hidden, a.inter, a.layers, a.heads, a.kv_heads, a.seq);
  const ModelConfig cfg = parse_model_config(cj.dump(), "bench config");
  ModelOptions mo;
  mo.micro_batch = a.batch;
  mo.seq_len = a.seq;
  mo.compute = parse_dtype(a.dtype);
  mo.checkpoint = a.checkpoint;
  mo.loss_chunk_rows = a.loss_chunk_rows;
  Model m(cfg, *dev, *s, mo);
  ResidentWeights w(m, *s);
  w.init_random(1);
  std::mt19937_64 rng(1);
  Batch b;
  for (std::int64_t i = 0; i < a.batch * a.seq; ++i) {
    b.tokens.push_back(static_cast<std::int32_t>(rng() % a.vocab));
    b.targets.push_back(static_cast<std::int32_t>(rng() % a.vocab));
    if (a.doc_len > 0) b.positions.push_back(static_cast<std::int32_t>((i % a.seq) % a.doc_len));
  }
  std::printf(
      "strata-bench model: %s, Llama %.1fM params (hidden %ld, %ld layers, vocab %ld), B=%ld "
      "T=%ld, %s%s%s\n",
      dev->name().c_str(), m.num_params() / 1e6, long(a.hidden), long(a.layers), long(a.vocab),
      long(a.batch), long(a.seq), a.dtype.c_str(), a.checkpoint ? ", checkpointing" : "",
      a.doc_len > 0 ? fmt::format(", packed rows of {}-token documents", a.doc_len).c_str() : "");
  float loss = 0;
  for (int i = 0; i < a.warmup; ++i) {
    loss = m.forward(b, w);
    m.backward(w);
  }
  s->synchronize();
  // The GEMM rates are taken before and after the timed steps, each shape's best burst of either,
  // in the compute dtype and (when that is not fp32) in fp32.
  std::vector<DType> gemm_types{mo.compute};
  if (mo.compute != DType::kF32) gemm_types.push_back(DType::kF32);
  const std::vector<Model::GemmShape> shapes = m.gemm_shapes();
  std::vector<std::vector<double>> rate(shapes.size(), std::vector<double>(gemm_types.size()));
  auto measure_gemms = [&] {
    for (std::size_t g = 0; g < shapes.size(); ++g)
      for (std::size_t i = 0; i < gemm_types.size(); ++i)
        rate[g][i] = std::max(rate[g][i], gemm_gflops(*dev, *s, gemm_types[i], shapes[g], 5));
  };
  measure_gemms();
  double best = 1e30;
  for (int i = 0; i < a.steps; ++i) {
    const Stopwatch sw;
    loss = m.forward(b, w);
    m.backward(w);
    s->synchronize();
    best = std::min(best, sw.seconds());
  }
  // Where the stream's time goes: `steps` more steps under the tracer, each op's time summed
  // per step; the median step of each op is printed (the machine may be shared: a median is
  // steadier than one step).
  if (a.breakdown || !a.trace.empty()) {
    Tracer& tr = Tracer::global();
    tr.clear();
    tr.set_enabled(true);
    std::vector<std::pair<std::int64_t, std::int64_t>> bounds;
    for (int i = 0; i < a.steps; ++i) {
      const std::int64_t t0 = tr.now_ns();
      m.forward(b, w);
      m.backward(w);
      s->synchronize();
      bounds.emplace_back(t0, tr.now_ns());
    }
    tr.set_enabled(false);
    if (!a.trace.empty()) tr.write_chrome_trace(a.trace);
    if (a.breakdown) {
      auto median = [](std::vector<double> v) {
        std::sort(v.begin(), v.end());
        return v.empty() ? 0.0 : v[v.size() / 2];
      };
      std::map<std::string, std::vector<double>> per_op;  // op -> seconds in each step
      std::map<std::string, int> calls;
      std::vector<double> step_s;
      for (const auto& [t0, t1] : bounds) step_s.push_back(double(t1 - t0) * 1e-9);
      for (const TraceSpan& sp : tr.spans()) {
        if (sp.lane != s->name()) continue;
        for (std::size_t i = 0; i < bounds.size(); ++i) {
          if (sp.start_ns < bounds[i].first || sp.start_ns >= bounds[i].second) continue;
          auto& v = per_op[sp.name];
          v.resize(bounds.size(), 0.0);
          v[i] += double(sp.end_ns - sp.start_ns) * 1e-9;
          if (i == 0) ++calls[sp.name];
        }
      }
      std::vector<std::pair<std::string, double>> rows;
      for (auto& [name, v] : per_op) rows.emplace_back(name, median(v));
      std::sort(rows.begin(), rows.end(),
                [](const auto& x, const auto& y) { return x.second > y.second; });
      const double step = median(step_s);
      std::printf("  stream time by op (median of %d traced steps; step %.3f s):\n", a.steps, step);
      for (const auto& [name, sec] : rows)
        std::printf("    %-24s %8.1f ms %6.1f%% %6d calls\n", name.c_str(), sec * 1e3,
                    100 * sec / step, calls[name]);
    }
    tr.clear();
  }
  const double tokens = double(a.batch * a.seq);
  const double gflops = m.flops_per_step() / best / 1e9;
  measure_gemms();
  const bool cuda = dev->kind() == DeviceKind::kCuda;
  // How the compute dtype's GEMMs run: cuBLAS, or oneDNN's own kernel or widened to fp32.
  std::string route = "cuBLAS";
  if (!cuda)
    for (const auto& g : cpu::cpu_paths().gemms)
      if (g.dtype == dtype_name(mo.compute)) route = g.route;
  // The step's GEMMs (recomputation apart) at each dtype's rate, and at the faster per shape.
  double gemm_flops = 0, recompute_flops = 0, best_time = 0;
  std::vector<double> dtype_time(gemm_types.size());
  nlohmann::json shape_rows = nlohmann::json::array();
  for (std::size_t g = 0; g < shapes.size(); ++g) {
    const double f = shapes[g].flops();
    nlohmann::json row = {{"name", shapes[g].name},
                          {"m", shapes[g].m},
                          {"n", shapes[g].n},
                          {"k", shapes[g].k},
                          {"trans_a", shapes[g].trans_a},
                          {"trans_b", shapes[g].trans_b},
                          {"count", shapes[g].count},
                          {"recompute", shapes[g].recompute}};
    for (std::size_t i = 0; i < gemm_types.size(); ++i)
      row[fmt::format("{}_gflops", dtype_name(gemm_types[i]))] = rate[g][i];
    shape_rows.push_back(row);
    if (shapes[g].recompute) {
      recompute_flops += f;
      continue;
    }
    gemm_flops += f;
    for (std::size_t i = 0; i < gemm_types.size(); ++i) dtype_time[i] += f / (rate[g][i] * 1e9);
    best_time += f / (*std::max_element(rate[g].begin(), rate[g].end()) * 1e9);
  }
  const double reference = gemm_flops / best_time / 1e9;
  std::printf("  step %.3f s (best of %d), loss %.4f\n", best, a.steps, loss);
  std::printf("  %-28s %12.0f\n", "tokens/s", tokens / best);
  std::printf(
      "  %-28s %12.1f  (%.1f GFLOP a step%s)\n", "model GFLOP/s", gflops, m.flops_per_step() / 1e9,
      recompute_flops > 0 ? fmt::format("; recomputation adds {:.1f} GFLOP of GEMMs, not counted",
                                        recompute_flops / 1e9)
                                .c_str()
                          : "");
  for (std::size_t i = 0; i < gemm_types.size(); ++i)
    std::printf(
        "  %-28s %12.1f  (the model's %zu GEMM shapes, by FLOPs; same device, best burst%s)\n",
        fmt::format("{} GEMM GFLOP/s", dtype_name(gemm_types[i])).c_str(),
        gemm_flops / dtype_time[i] / 1e9, shapes.size(),
        i == 0 ? fmt::format("; {}", route).c_str() : "");
  std::printf("  %-28s %12.1f  (the faster dtype per shape)\n", "reference GEMM GFLOP/s",
              reference);
  std::printf("  %-28s %12.3f  (share of %s's rate on the model's GEMMs)%s\n", "ratio vs matmul",
              gflops / reference, cuda ? "cuBLAS" : "oneDNN",
              broken_bound_note(gflops / reference));
  if (a.json) {
    nlohmann::json j = {{"command", "model"},
                        {"device", dev->name()},
                        {"params", m.num_params()},
                        {"batch", a.batch},
                        {"seq_len", a.seq},
                        {"dtype", a.dtype},
                        {"checkpoint", a.checkpoint},
                        {"doc_len", a.doc_len},
                        {"gemm_route", route},
                        {"step_s", best},
                        {"tokens_per_s", tokens / best},
                        {"gflops", gflops},
                        {"gflop_per_step", m.flops_per_step() / 1e9},
                        {"recompute_gemm_gflop_per_step", recompute_flops / 1e9}};
    const char* lib = cuda ? "cublas" : "onednn";
    for (std::size_t i = 0; i < gemm_types.size(); ++i)
      j[fmt::format("{}_{}_gflops", lib, dtype_name(gemm_types[i]))] =
          gemm_flops / dtype_time[i] / 1e9;
    // The dtypes each shape was timed in ("bf16 and fp32", or "fp32").
    const std::string timed_in = gemm_types.size() > 1
                                     ? fmt::format("{} and fp32", dtype_name(mo.compute))
                                     : std::string("fp32");
    j["reference_gemm"] = fmt::format(
        "{} on the model's GEMM shapes, the faster of {} per shape, weighted by "
        "their FLOPs in a step",
        lib, timed_in);
    j["reference_method"] = fmt::format(
        "each shape (gemm_shapes) timed on the same device and stream, in {}: windows of at least "
        "5 ms of back-to-back matmuls, the best of 5, measured before and after the timed steps "
        "and the better kept; the ratio's numerator is gflop_per_step (the GEMMs and attention's "
        "QK^T and PV, recomputation not counted) over the best step; {}",
        timed_in, broken_bound_clause());
    j["reference_gemm_gflops"] = reference;
    j["ratio_vs_matmul"] = gflops / reference;
    j["broken_bound"] = broken_bound(gflops / reference);
    j["gemm_shapes"] = shape_rows;
    if (!cuda) {
      const cpu::CpuPaths paths = cpu::cpu_paths();
      j["cpu_isa_cap"] = paths.cap;
      j["onednn_isa"] = paths.onednn;
    }
    print_json(j);
  }
}

}  // namespace
}  // namespace model_cmd

void add_model_command(CLI::App& app) {
  using namespace model_cmd;
  auto* cmd = app.add_subcommand(
      "model",
      "transformer forward+backward tokens/s and GFLOP/s vs the library's rate on the model's own "
      "GEMM shapes");
  auto a = std::make_shared<Args>();
  cmd->add_option("--device", a->device, "auto, cpu or cuda (default cpu)");
  cmd->add_option("--dtype", a->dtype, "compute dtype: bf16 or fp32 (default bf16)");
  cmd->add_option("--hidden", a->hidden, "hidden size (default 768)")
      ->check(strata::tools::kPositive);
  cmd->add_option("--layers", a->layers, "decoder layers (default 12)")
      ->check(strata::tools::kPositive);
  cmd->add_option("--heads", a->heads, "attention heads (default 12)")
      ->check(strata::tools::kPositive);
  cmd->add_option("--kv-heads", a->kv_heads, "key/value heads (default 12)")
      ->check(strata::tools::kPositive);
  cmd->add_option("--intermediate", a->inter, "MLP size (default 2048)")
      ->check(strata::tools::kPositive);
  cmd->add_option("--vocab", a->vocab, "vocabulary (default 16384)")
      ->check(strata::tools::kPositive);
  cmd->add_option("--batch", a->batch, "micro-batch B (default 2)")
      ->check(strata::tools::kPositive);
  cmd->add_option("--seq", a->seq, "sequence length T (default 256)")
      ->check(strata::tools::kPositive);
  cmd->add_option("--doc-len", a->doc_len,
                  "pack each row with documents of this many tokens (Batch::positions: attention "
                  "within each, positions restarting); GFLOP/s still counts whole-row attention "
                  "(default 0: unpacked)")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--steps", a->steps, "timed steps; the best is reported (default 3)")
      ->check(CLI::Range(1, 100000));
  cmd->add_option("--warmup", a->warmup, "untimed steps first (default 1)")
      ->check(CLI::Range(0, 100000));
  cmd->add_flag("--checkpoint", a->checkpoint, "activation checkpointing");
  cmd->add_option("--loss-chunk-rows", a->loss_chunk_rows,
                  "rows per fused LM-head/loss chunk (default 0: the model's choice)")
      ->check(strata::tools::kNonNegative);
  cmd->add_flag("--json", a->json, "print, last, one JSON object of the figures");
  cmd->add_flag("--breakdown", a->breakdown,
                "then trace --steps more steps and print the stream's time by op");
  cmd->add_option("--trace", a->trace,
                  "then trace --steps more steps and write them as a Chrome trace to this path");
  cmd->add_flag("--overwrite", a->overwrite, "replace an existing --trace file");
  cmd->callback([a] {
    // Written after the timed steps: checked first, and not replaced unasked.
    strata::require_output_file("--trace", a->trace, a->overwrite);
    // Sizes in the flags' words, before anything is made (they came out as a config key's name,
    // std::bad_alloc, or an allocation of 0 bytes after an overflow).
    constexpr std::int64_t kMaxSeq = std::int64_t(1) << 24, kMaxTokens = std::int64_t(1) << 31;
    STRATA_REQUIRE(a->seq <= kMaxSeq, "--seq {} is more positions than strata runs (at most {})",
                   a->seq, kMaxSeq);
    STRATA_REQUIRE(double(a->batch) * double(a->seq) <= double(kMaxTokens),
                   "--batch {} x --seq {} is {:.3g} tokens, more than a micro-batch holds (at "
                   "most 2^31): give smaller ones",
                   a->batch, a->seq, double(a->batch) * double(a->seq));
    STRATA_REQUIRE(a->doc_len <= a->seq,
                   "--doc-len {} is longer than --seq {}: a row would hold no whole document; "
                   "give at most --seq (0: unpacked rows)",
                   a->doc_len, a->seq);
    const auto too_big = [&](const std::string& why) {
      STRATA_THROW(kOutOfMemory,
                   "the model (--hidden {}, --layers {}, --vocab {}) at --batch {} x --seq {} does "
                   "not fit {}: give a smaller --batch, --seq or model ({})",
                   a->hidden, a->layers, a->vocab, a->batch, a->seq,
                   a->device == "cpu" ? "the CPU device's 20 GiB or this machine's memory"
                                      : "the device's memory",
                   why);
    };
    try {
      run(*a);
    } catch (const std::bad_alloc&) {
      too_big("host memory ran out");
    } catch (const Error& e) {
      if (e.kind() != ErrorKind::kOutOfMemory) throw;
      too_big(e.user_message());
    }
  });
}

}  // namespace strata::bench
