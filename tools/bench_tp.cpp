// strata-bench tp: Megatron tensor parallelism over the ranks of the job (mpirun -np N strata-bench
// tp: TP = N, the CPU-emulated device over MPI, or N GPUs over NCCL). One Llama-shaped model, split
// over the ranks (strata/model.h), runs forward + backward; the bench reports the step time and
// the TP traffic the model queued (Model::tp_traffic) against Megatron's formula: 2 all-reduces of
// B x T x hidden a decoder layer in each pass (4 a layer a step, fp32 here), beside the
// embedding's and the LM head's one each. The bound, measured in the same run: one all-reduce of
// B x T x hidden over the same ranks, timed alone; the step's TP all-reduces at that rate are the
// time the TP traffic takes on this link (tp_comm_s), and its share of the step. The time of a
// step is the slowest rank's. Rank 0 prints.
#include <algorithm>
#include <cstdio>
#include <random>

#include "bench_common.h"
#include "strata/comm.h"
#include "strata/error.h"
#include "strata/model.h"
#include "strata/system_info.h"
#include "tool_main.h"

namespace strata::bench {
// This command's own names: the benchmarks compile as one file (tools/CMakeLists.txt).
namespace tp_cmd {
namespace {

struct TpArgs {
  std::string device = "auto", dtype = "fp32";
  std::int64_t hidden = 256, layers = 4, heads = 8, kv_heads = 4, inter = 768, vocab = 4096;
  std::int64_t batch = 2, seq = 256;
  int steps = 3, warmup = 1;
  bool json = false;
};

// The slowest rank's `v` (seconds).
double slowest(Communicator& comm, Stream& s, Device& dev, double v) {
  float x = float(v);
  Buffer b = dev.alloc(4, &s);
  s.copy(b.ref(), host_ref(&x, 4));
  comm.all_reduce(tensor(b, DType::kF32, 1), ReduceOp::kMax, s);
  s.copy(host_ref(&x, 4), b.ref());
  s.synchronize();
  return double(x);
}

void run_tp(const TpArgs& a) {
  const LaunchInfo li = init_launch();
  STRATA_REQUIRE(a.steps >= 1 && a.warmup >= 0, "tp: --steps {} must be >= 1, --warmup {} >= 0",
                 a.steps, a.warmup);
  CudaDeviceOptions cuda;
  if (a.device != "cpu") {
    const CudaProbe p = probe_cuda();
    if (p.device_count > 0) cuda.ordinal = launch_gpu_ordinal(li, p.device_count);
  }
  auto dev = make_device(
      a.device, HostDeviceOptions{.capacity_bytes = std::size_t(8) << 30, .poison = false}, cuda);
  auto comm = make_communicator(*dev);
  const int n = comm->world_size();
  const bool root = comm->rank() == 0;
  auto s = dev->create_stream("bench-tp");
  const nlohmann::json cj =
      llama_config_json(a.vocab, a.hidden, a.inter, a.layers, a.heads, a.kv_heads, a.seq);
  const ModelConfig cfg = parse_model_config(cj.dump(), "bench config");
  ModelOptions mo;
  mo.micro_batch = a.batch;
  mo.seq_len = a.seq;
  mo.compute = parse_dtype(a.dtype);
  mo.tensor_parallel = comm.get();
  Model m(cfg, *dev, *s, mo);  // refuses a TP size that does not divide the heads, ...
  ResidentWeights w(m, *s);
  w.init_random(1);
  std::mt19937_64 rng(1);  // the same batch on every rank
  Batch b;
  for (std::int64_t i = 0; i < a.batch * a.seq; ++i) {
    b.tokens.push_back(std::int32_t(rng() % std::uint64_t(a.vocab)));
    b.targets.push_back(std::int32_t(rng() % std::uint64_t(a.vocab)));
  }
  auto step = [&] {
    w.zero_grads();
    m.forward(b, w);
    m.backward(w);
    s->synchronize();
  };
  for (int i = 0; i < a.warmup; ++i) step();
  const Model::TpTraffic before = m.tp_traffic();
  comm->barrier(*s).synchronize();
  const Stopwatch sw;
  for (int i = 0; i < a.steps; ++i) step();
  const double step_s = slowest(*comm, *s, *dev, sw.seconds() / a.steps);
  const Model::TpTraffic after = m.tp_traffic();
  const double reduces = double(after.all_reduces - before.all_reduces) / a.steps;
  const double reduce_bytes = double(after.all_reduce_bytes - before.all_reduce_bytes) / a.steps;
  const double gathers = double(after.all_gathers - before.all_gathers) / a.steps;
  const double gather_bytes = double(after.all_gather_bytes - before.all_gather_bytes) / a.steps;
  // Megatron's count: 2 all-reduces of B x T x hidden a layer in each pass; the embedding's sum
  // and the head's input gradient are one each besides.
  const double act = double(a.batch * a.seq * a.hidden) * 4;
  // (one rank reduces nothing: no TP traffic, not a negative count)
  const double per_layer_pass = n > 1 ? (reduce_bytes - 2 * act) / double(2 * a.layers) : 0.0;
  const double formula = 2 * act;
  // The bound: one all-reduce of the activations over the same ranks, alone.
  Buffer x = dev->alloc(std::size_t(act), s.get());
  s->fill(tensor(x, DType::kF32), 1.0f);
  const int reps = 8;
  comm->all_reduce(tensor(x, DType::kF32), ReduceOp::kSum, *s);
  comm->barrier(*s).synchronize();
  const Stopwatch ar;
  for (int i = 0; i < reps; ++i) comm->all_reduce(tensor(x, DType::kF32), ReduceOp::kSum, *s);
  s->synchronize();
  const double all_reduce_s = slowest(*comm, *s, *dev, ar.seconds() / reps);
  const double tp_comm_s = reduces * all_reduce_s;
  const double busbw = n > 1 ? act / all_reduce_s * 2 * (n - 1) / n / 1e9 : 0.0;
  if (!root) return;
  std::printf(
      "# strata-bench tp: TP %d over %s, device %s, %s; Llama %lld layers, hidden %lld, "
      "heads %lld/%lld, MLP %lld, vocab %lld, batch %lld x %lld\n",
      n, comm_backend_name(comm->backend()), dev->name().c_str(), a.dtype.c_str(),
      (long long)a.layers, (long long)a.hidden, (long long)a.heads, (long long)a.kv_heads,
      (long long)a.inter, (long long)a.vocab, (long long)a.batch, (long long)a.seq);
  if (n == 1) std::printf("# one rank: no tensor parallelism (run under mpirun -np N for TP N)\n");
  std::printf("step (forward + backward, slowest rank)   %10.4f s\n", step_s);
  std::printf("TP all-reduces a step                     %10.0f  (%.0f bytes)\n", reduces,
              reduce_bytes);
  std::printf(
      "  a layer a pass                          %10.0f bytes; formula 2 x B x T x hidden "
      "x 4 = %.0f: ratio %.3f\n",
      per_layer_pass, formula, n > 1 ? per_layer_pass / formula : 0.0);
  std::printf("TP all-gathers a step (cross-entropy)     %10.0f  (%.0f bytes a rank)\n", gathers,
              gather_bytes);
  std::printf("bound: one all-reduce of %.0f bytes      %10.1f us (busbw %.3f GB/s)\n", act,
              all_reduce_s * 1e6, busbw);
  std::printf("TP all-reduces at that rate               %10.4f s, %.1f%% of the step\n", tp_comm_s,
              100 * tp_comm_s / step_s);
  if (a.json)
    print_json({{"backend", comm_backend_name(comm->backend())},
                {"tensor_parallel", n},
                {"device", dev->name()},
                {"dtype", a.dtype},
                {"step_s", step_s},
                {"tp_all_reduces_per_step", reduces},
                {"tp_all_reduce_bytes_per_step", reduce_bytes},
                {"tp_bytes_per_layer_per_pass", per_layer_pass},
                {"formula_bytes_per_layer_per_pass", formula},
                {"ratio_vs_formula", n > 1 ? per_layer_pass / formula : 0.0},
                {"reference",
                 "bytes: Megatron's 2 x B x T x hidden x 4 a layer a pass; time: one all-reduce "
                 "of B x T x hidden fp32 over the same ranks alone in this run (mean of 8 after "
                 "one, the slowest rank's), times the step's all-reduces"},
                {"tp_all_gathers_per_step", gathers},
                {"tp_all_gather_bytes_per_step", gather_bytes},
                {"all_reduce_us", all_reduce_s * 1e6},
                {"all_reduce_busbw_gbps", busbw},
                {"tp_comm_s", tp_comm_s},
                {"tp_comm_share", tp_comm_s / step_s}});
}

}  // namespace
}  // namespace tp_cmd

void add_tp_command(CLI::App& app) {
  using namespace tp_cmd;
  auto a = std::make_shared<TpArgs>();
  CLI::App* cmd = app.add_subcommand(
      "tp",
      "tensor parallelism: a split Llama's step and TP traffic against Megatron's formula and "
      "the measured all-reduce (run under mpirun -np N)");
  cmd->add_option("--device", a->device, "auto, cpu or cuda (default auto)");
  cmd->add_option("--dtype", a->dtype, "compute dtype: fp32 or bf16 (default fp32)")
      ->check(CLI::IsMember({"fp32", "bf16"}));
  cmd->add_option("--hidden", a->hidden, "hidden size (default 256)")
      ->check(strata::tools::kPositive);
  cmd->add_option("--layers", a->layers, "decoder layers (default 4)")
      ->check(strata::tools::kPositive);
  cmd->add_option("--heads", a->heads, "attention heads (default 8)")
      ->check(strata::tools::kPositive);
  cmd->add_option("--kv-heads", a->kv_heads, "key/value heads (default 4)")
      ->check(strata::tools::kPositive);
  cmd->add_option("--intermediate", a->inter, "MLP size (default 768)")
      ->check(strata::tools::kPositive);
  cmd->add_option("--vocab", a->vocab, "vocabulary (default 4096)")
      ->check(strata::tools::kPositive);
  cmd->add_option("--batch", a->batch, "micro-batch B (default 2)")
      ->check(strata::tools::kPositive);
  cmd->add_option("--seq", a->seq, "sequence length T (default 256)")
      ->check(strata::tools::kPositive);
  cmd->add_option("--steps", a->steps, "timed steps, averaged (default 3)")
      ->check(strata::tools::kPositive);
  cmd->add_option("--warmup", a->warmup, "untimed steps first (default 1)");
  cmd->add_flag("--json", a->json, "print one JSON object of the figures, last");
  cmd->callback([a] { run_tp(*a); });
}

}  // namespace strata::bench
