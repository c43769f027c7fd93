// strata-prof: measure the machine and the model, predict the step time of every placement,
// recommend the fastest that fits, and check the prediction by running the best few.
//
//   measure   pinned H2D / D2H, device and host memory passes, NVMe write and read through the
//             engine's own swap store, CPU and device AdamW, collectives (more than one rank),
//             and the model's per-unit forward / backward time and activation bytes from real
//             micro-batches of a 1- and a 2-layer copy of it (every layer of a model costs
//             the same; the embedding and the head are measured on their own).
//   predict   src/scheduler/perf_model.cpp replays the engine's step on those rates.
//   search    placements x live window x micro-batch x checkpointing, filtered by the memory
//             planner; the best few printed, the best written as a ds_config.json (of
//             candidates predicted within 5%, the fastest that keeps the drive markedly less
//             busy).
//   validate  (--validate K) the top K and a spread of others (the best of other placement
//             classes, low-ranked ones) run through strata::train for a few steps; predicted vs
//             measured step time and bottleneck, and the Chrome trace of the best.
//   picture   an SVG with the best candidate's step per resource lane (predicted, and measured
//             when validated) and the bytes per tier of the top candidates.
//
// The jobs' files: prof_measure.cpp (the machine and the model), prof_validate.cpp (the
// validation runs, the written config), prof_picture.cpp (the SVG, the measured schedule); this
// one holds the options, run()'s sequence of steps and the JSON figures.
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <utility>

#include "prof.h"
#include "strata/comm.h"
#include "strata/engine_config.h"
#include "strata/error.h"
#include "strata/json_config.h"
#include "strata/log.h"
#include "strata/model_data.h"
#include "strata/nvme.h"
#include "strata/system_info.h"
#include "tool_main.h"

namespace strata::prof {
namespace {

namespace fs = std::filesystem;

// The model (--model, --model-config, else the demo's) and the sequence length strata-train would
// take; the demo model's file beside --out must be the tool's own.
ModelConfig load_model(Args& a, bool demo) {
  STRATA_REQUIRE(a.model_dir.empty() || a.model_config.empty(),
                 "give --model or --model-config, not both");
  ModelConfig mcfg = !a.model_dir.empty()      ? load_model_config(a.model_dir + "/config.json")
                     : !a.model_config.empty() ? load_model_config(a.model_config)
                                               : demo_model_config();
  if (a.seq_len <= 0)  // strata-train's default
    a.seq_len = demo                     ? 128
                : mcfg.max_positions > 0 ? std::min<std::int64_t>(1024, mcfg.max_positions)
                                         : 1024;
  // As strata-train refuses it (the model itself said so only after the machine was measured).
  STRATA_REQUIRE(mcfg.arch != ModelArch::kGpt2 || a.seq_len <= mcfg.max_positions,
                 "--seq-len {} exceeds the model's {} positions", a.seq_len, mcfg.max_positions);
  if (!a.out.empty()) {  // nothing of the user's is replaced by what strata-prof writes
    std::error_code ec;
    const std::string mc = demo_model_file(a.out);
    if (demo && !mc.empty() && fs::exists(mc, ec)) {
      std::ifstream f(mc);
      std::stringstream have;
      have << f.rdbuf();
      STRATA_REQUIRE(have.str() == model_config_json(demo_model_config()),
                     "{} exists and is not the demo model's config, which strata-prof writes "
                     "beside --out {}; move it, "
                     "or choose another --out",
                     mc, a.out);
    }
  }
  return mcfg;
}

// The flags that contradict each other or name what is not there, refused before anything runs.
void check_flags(const Args& a) {
  STRATA_REQUIRE(a.micro_batch <= 0 || a.micro_batches.empty(),
                 "--micro-batch {} and --micro-batches: --micro-batches is the list searched "
                 "(--micro-batch only sets "
                 "its default B/2, B, 2B); give one of them",
                 a.micro_batch);
  STRATA_REQUIRE(a.data_files.empty() || a.text_file.empty(),
                 "--data and --text: the validation runs read one of "
                 "them; give one");
  STRATA_REQUIRE(a.validate > 0 ||
                     ((!a.trace_named || a.trace.empty()) && a.data_files.empty() &&
                      a.text_file.empty() && !a.validate_spread_named && !a.validate_rounds_named),
                 "--trace, --data, --text, --validate-spread and --validate-rounds are for the "
                 "validation runs: add "
                 "--validate K (or leave them out)");
  for (const std::string& f : a.data_files) strata::require_input_file("--data", f);
  if (!a.text_file.empty()) strata::require_input_file("--text", a.text_file);
  STRATA_REQUIRE(a.dtype.empty() || a.dtype == "fp32" || a.dtype == "bf16",
                 "--dtype '{}': use fp32 or bf16", a.dtype);
  STRATA_REQUIRE(a.validate >= 0 && a.validate_steps >= 2,
                 "--validate-steps must be at least 2 (the first step records "
                 "the unit order and is not timed)");
  for (auto b : a.micro_batches)
    STRATA_REQUIRE(b >= 1, "--micro-batches: {} is not a positive batch size", b);
  STRATA_REQUIRE(
      std::isfinite(a.nvme_sustain_s) && a.nvme_sustain_s >= 0 && a.nvme_sustain_s <= 600,
      "--nvme-sustain-s {}: give seconds from 0 (the short runs' rates only) to 600",
      a.nvme_sustain_s);
}

// The --config's text, read once (a.user_text: what read_config parses and written_json keeps).
void read_config_text(Args& a) {
  if (a.ds_config.empty()) return;
  std::ifstream f(a.ds_config);
  STRATA_REQUIRE(f.good(), "--config {}: cannot be read", a.ds_config);
  std::stringstream ss;
  ss << f.rdbuf();
  a.user_text = ss.str();
}

// The --config (a.user_text, or the defaults), with the --aio block. Whether it gives a batch size
// (the micro-batch, or train_batch_size: the user's global batch, as strata-train takes it), or
// leaves the defaults, is set in `config_micro` and `config_train`.
EngineConfig read_config(Args& a, int world_size, bool& config_micro, bool& config_train) {
  EngineConfig base = a.ds_config.empty() ? default_engine_config() : [&] {
    // Parsed here too: a syntax error names the file, and the batch keys are read from it.
    const config::Json top = config::parse(a.user_text, fmt::format("--config {}", a.ds_config));
    EngineConfig c = parse_engine_config(a.user_text, world_size);
    config_train = top.is_object() && top.contains("train_batch_size");
    config_micro =
        config_train || (top.is_object() && top.contains("train_micro_batch_size_per_gpu"));
    return c;
  }();
  if (!a.aio_file.empty()) {
    std::ifstream f(a.aio_file);
    STRATA_REQUIRE(f.good(),
                   "--aio {}: cannot be read (write one with strata-bench nvme --sweep --out FILE)",
                   a.aio_file);
    std::stringstream ss;
    ss << f.rdbuf();
    // A file without one (a model's config.json by mistake) would leave every aio key at its
    // default, silently. (Not JSON at all: parse_aio_config says where.)
    STRATA_REQUIRE(has_aio_block(ss.str()),
                   "--aio {}: no \"aio\" block in it; give the file strata-bench nvme --sweep "
                   "--out FILE writes "
                   "({{\"aio\": {{\"block_size\": ..., \"queue_depth\": ..., ...}}}})",
                   a.aio_file);
    base.aio = parse_aio_config(ss.str());
  }
  return base;
}

// --tensor-parallel, else the --config's tensor_parallel.autotp_size, else 1: the TP size (which
// must divide the job's ranks) and this rank's place in its group (TP innermost).
TensorParallel tensor_parallel_of(const Args& a, const LaunchInfo& job) {
  int tp = a.tensor_parallel;
  std::string from = "--tensor-parallel";
  if (tp == 0 && !a.ds_config.empty()) {
    from = fmt::format("--config {}: tensor_parallel.autotp_size", a.ds_config);
    tp = config_tensor_parallel(a.user_text, fmt::format("--config {}", a.ds_config));
  }
  tp = std::max(tp, 1);
  STRATA_REQUIRE(
      job.world_size % tp == 0,
      "{} {}: tensor parallelism splits each layer over {} ranks, and this job has {} "
      "(a multiple of {} is needed): launch it with mpirun -np {} (or another multiple), "
      "or give a tensor-parallel size that divides {}",
      from, tp, tp, job.world_size, tp, tp, job.world_size);
  return {tp, job.rank % tp};
}

// What strata-train refuses of the sizes, refused before anything is measured: a step reads all
// its micro-batches before its first forward and holds them at once (step_data), here the largest
// micro-batch searched (--micro-batches' largest, else 2B). In doubles: a huge --grad-accum,
// --micro-batch or --seq-len (2^62, 1e11) hung, ate the memory or wrapped.
void check_step_data(const Args& a, bool grad_accum_given) {
  const double largest =
      a.micro_batches.empty()
          ? 2.0 * double(a.micro_batch)
          : double(*std::max_element(a.micro_batches.begin(), a.micro_batches.end()));
  const StepData d = step_data(double(a.grad_accum), largest, double(a.seq_len));
  const std::string accum =
      grad_accum_given || a.ds_config.empty()
          ? fmt::format("--grad-accum {}", a.grad_accum)
          : fmt::format("gradient_accumulation_steps {} (--config {})", a.grad_accum, a.ds_config);
  const std::string batch =
      a.micro_batches.empty()
          ? fmt::format("2B of B = {}: the search tries B/2, B and 2B", a.micro_batch)
          : std::string("the largest of --micro-batches");
  STRATA_REQUIRE(d.fits(),
                 "{} x a micro-batch of {:.0f} x --seq-len {} tokens ({}): a step holds all its "
                 "micro-batches before its first forward, {}, more than the {} of memory "
                 "available: give a smaller --grad-accum, micro-batch or --seq-len",
                 accum, largest, a.seq_len, batch, log::human_bytes(d.held_bytes, 1),
                 log::human_bytes(d.available_bytes, 1));
}

// The flags over the --config: dtype, accumulation, the micro-batches searched and the host
// budget. Returns the --config's train_batch_size (0: it gives none).
std::int64_t apply_flags(Args& a, EngineConfig& base, const LaunchInfo& launch, bool demo,
                         bool config_micro, bool config_train) {
  // --dtype and --grad-accum override the --config (as strata-train's flags do); left out, its
  // values stand, and the run line and the written config carry them.
  if (!a.dtype.empty()) {
    base.compute_dtype = a.dtype == "bf16" ? DType::kBF16 : DType::kF32;
    base.fp16.enabled = false;
  }
  STRATA_REQUIRE(base.compute_dtype == DType::kF32 || base.compute_dtype == DType::kBF16,
                 "--config {}: fp16.enabled: the model computes in fp32 or bf16 (fp16 is not "
                 "supported yet): pass --dtype bf16, or in --config set \"fp16\": {{\"enabled\": "
                 "false}} and \"bf16\": {{\"enabled\": true}}",
                 a.ds_config);
  a.dtype = base.compute_dtype == DType::kBF16 ? "bf16" : "fp32";
  const bool grad_accum_given = a.grad_accum > 0;
  if (grad_accum_given) base.gradient_accumulation_steps = a.grad_accum;
  a.grad_accum = base.gradient_accumulation_steps;
  // As strata-train takes --grad-accum beside a train_batch_size: the global batch stays and the
  // micro-batch follows (the --config's micro-batch was derived under its own accumulation).
  if (a.micro_batch <= 0 && a.micro_batches.empty() && config_train && grad_accum_given) {
    // (in doubles first: a --grad-accum near 2^63 times the ranks wrapped)
    const bool within = double(a.grad_accum) * launch.world_size <= double(base.train_batch_size);
    const std::int64_t per = within ? a.grad_accum * launch.world_size : 0;
    STRATA_REQUIRE(within && base.train_batch_size % per == 0,
                   "--grad-accum {} x {} rank(s) does not divide the train_batch_size {} of "
                   "--config {}: give a "
                   "--grad-accum that divides it, or --micro-batch / --micro-batches",
                   a.grad_accum, launch.world_size, base.train_batch_size, a.ds_config);
    a.micro_batch = base.train_batch_size / per;
  }
  // The micro-batch the search centres on: --micro-batch, else the --config's (as --dtype and
  // --grad-accum default to it) when it gives one, else 4 for the demo and 1.
  if (a.micro_batch <= 0) a.micro_batch = config_micro ? base.micro_batch_per_gpu : demo ? 4 : 1;
  check_step_data(a, grad_accum_given);  // (before 2B is formed: a huge B doubled wrapped)
  if (a.micro_batches.empty()) {
    if (a.micro_batch >= 2) a.micro_batches.push_back(a.micro_batch / 2);
    a.micro_batches.push_back(a.micro_batch);
    a.micro_batches.push_back(a.micro_batch * 2);
  }
  std::sort(a.micro_batches.begin(), a.micro_batches.end());  // the token file is sized by the last
  a.micro_batches.erase(std::unique(a.micro_batches.begin(), a.micro_batches.end()),
                        a.micro_batches.end());
  a.user_config = base;
  a.host_budget_given = a.host_mem_gb > 0 || base.host_budget_bytes > 0;
  STRATA_REQUIRE(
      a.host_mem_gb <= 0 || a.host_mem_gb * double(1ull << 30) >= double(2 << 20),
      "--host-mem-gb {}: at least 0.002 (2 MiB): pinned memory is committed in 2 MiB steps",
      a.host_mem_gb);
  const std::uint64_t host_bytes = gib_to_bytes("--host-mem-gb", a.host_mem_gb);
  base.host_budget_bytes = host_bytes > 0
                               ? host_bytes
                               : (base.host_budget_bytes ? base.host_budget_bytes
                                                         : default_host_budget(launch.local_size));
  if (a.ds_config.empty() && a.model_dir.empty()) base.adamw.weight_decay = 0;
  return config_train ? base.train_batch_size : 0;
}

DeviceOptions device_options(const Args& a) {
  const std::uint64_t device_bytes = gib_to_bytes("--device-mem-gb", a.device_mem_gb);
  DeviceOptions o;
  HostDeviceOptions& hopt = o.hopt;
  CudaDeviceOptions& copt = o.copt;
  if (device_bytes > 0) {
    hopt.capacity_bytes = device_bytes;
    copt.capacity_bytes = device_bytes;
  }
  hopt.h2d_gbps = a.emu_h2d;
  hopt.d2h_gbps = a.emu_d2h;
  hopt.compute_gflops = a.emu_gflops;
  // The device the measurements run on must hold their buffers and a 2-layer copy of the
  // model: the emulated one is sized for it (its throttles stay), a GPU is what it is.
  o.mhopt = hopt;
  o.mhopt.capacity_bytes = std::max<std::size_t>(hopt.capacity_bytes, std::size_t(8) << 30);
  return o;
}

// Where NVMe is measured: --nvme-path, else the --config's nvme_path (the drive the user means),
// else a scratch folder; none with --no-nvme.
NvmeChoice choose_nvme(const Args& a, const EngineConfig& base) {
  NvmeChoice n;
  n.use = !a.no_nvme;
  STRATA_REQUIRE(!a.no_nvme || a.nvme_path.empty(),
                 "--no-nvme and --nvme-path {}: --no-nvme leaves NVMe out (nothing "
                 "is measured or placed there); give one of them",
                 a.nvme_path);
  if (n.use) {
    std::error_code ec;
    // Left out: the --config's nvme_path (the drive the user means), else a scratch folder.
    const std::vector<std::string>& cfg_paths =
        !base.optimizer_nvme_paths.empty() ? base.optimizer_nvme_paths : base.param_nvme_paths;
    if (a.nvme_path.empty() && !cfg_paths.empty()) {
      for (const auto* list : {&base.param_nvme_paths, &base.optimizer_nvme_paths})
        for (const std::string& p : *list)
          STRATA_REQUIRE(fs::is_directory(p, ec),
                         "--config {}: nvme_path {}: no such directory; create it on the "
                         "drive to profile, or give --nvme-path DIR",
                         a.ds_config, p);
      n.dir = cfg_paths.front();  // measured there
      n.key = !base.optimizer_nvme_paths.empty() ? "zero_optimization.offload_optimizer.nvme_path"
                                                 : "zero_optimization.offload_param.nvme_path";
      n.paths = cfg_paths;
      if (!base.param_nvme_paths.empty()) n.param_paths = base.param_nvme_paths;
    } else if (a.nvme_path.empty()) {
      n.dir = default_scratch_dir("prof-nvme");
      fs::create_directories(n.dir, ec);
      STRATA_REQUIRE(fs::is_directory(n.dir),
                     "cannot create the default NVMe folder {} ({}): give --nvme-path DIR", n.dir,
                     ec.message());
    } else {  // the drive to measure: a typo must not measure another one
      n.dir = a.nvme_path;
      STRATA_REQUIRE(fs::is_directory(n.dir, ec), "--nvme-path {}: {}", n.dir,
                     fs::exists(n.dir, ec)
                         ? "a file, not a folder: give a folder on the drive to profile"
                         : "no such directory; create it on the drive to profile, or leave the "
                           "flag out (a scratch folder, or --no-nvme)");
    }
  }
  return n;
}

// What rank 0 writes at the end, checked now: a folder that is not there, or a file of the
// user's in the way, must not cost the measuring and the search first (and --svg must not
// fail after --out was written).
void check_outputs(Args& a, bool demo, bool talk) {
  if (a.validate > 0 && a.trace.empty() && !a.trace_named)
    a.trace = "strata-prof.trace.json";  // --trace "": none
  {
    // What strata-prof writes must not name one file twice (the later replaced the earlier: the
    // recommendation by the picture or the trace), nor a file it reads (the model's config is
    // read again by the validation runs and named in the run line). Links resolved.
    strata::NamedPaths outs = {{"--out", a.out}, {"--svg", a.svg}};
    if (a.validate > 0) outs.push_back({"--trace", a.trace});
    if (demo && !demo_model_file(a.out).empty())
      outs.push_back({"the demo model file written beside --out", demo_model_file(a.out)});
    // Inputs may share a file with each other (--config and --aio, say), not with an output.
    strata::NamedPaths ins = strata::model_files_in_folder("--model", a.model_dir);
    if (!a.ds_config.empty()) ins.push_back({"--config", a.ds_config});
    if (!a.model_config.empty()) ins.push_back({"--model-config", a.model_config});
    if (!a.aio_file.empty()) ins.push_back({"--aio", a.aio_file});
    for (const std::string& f : a.data_files) ins.push_back({"--data", f});
    if (!a.text_file.empty()) ins.push_back({"--text", a.text_file});
    strata::require_outputs_apart("strata-prof", outs, ins);
  }
  if (talk) {
    strata::require_output_file("--out", a.out, a.overwrite || !a.out_named);
    strata::require_output_file("--svg", a.svg, a.overwrite || !a.svg_named);
    if (a.validate > 0)
      strata::require_output_file("--trace", a.trace, a.overwrite || !a.trace_named);
  }
}

// The measured figures and the search's counts, as --json prints them.
nlohmann::json figures_json(const Args& a, const ModelConfig& mcfg, const Measurement& m,
                            const NvmeChoice& nvme, const SearchResult& sr) {
  const MachineProfile& machine = m.machine;
  const std::string& dev_name = m.dev_name;
  const SearchSpace& space = m.space;
  const double t_machine = m.machine_s, t_measured = m.measured_s;
  nlohmann::json j;
  j["command"] = "prof";
  j["machine"] = {
      {"device", dev_name},
      {"world_size", machine.world_size * machine.tensor_parallel},
      {"data_parallel", machine.world_size},
      {"tensor_parallel", machine.tensor_parallel},
      {"tp_all_reduce_gbps", machine.tp_all_reduce_bps / 1e9},
      {"nvme_path", nvme.use ? nlohmann::json(nvme.dir) : nlohmann::json(nullptr)},
      {"h2d_gbps", machine.h2d_bps / 1e9},
      {"d2h_gbps", machine.d2h_bps / 1e9},
      {"device_mem_gbps", machine.device_mem_bps / 1e9},
      {"device_free_gbps", machine.free_bps / 1e9},
      {"host_mem_gbps", machine.host_mem_bps / 1e9},
      {"host_norm_gbps", machine.host_norm_bps / 1e9},
      {"nvme_read_gbps", machine.nvme_read_bps / 1e9},
      {"nvme_write_gbps", machine.nvme_write_bps / 1e9},
      {"nvme_mixed_gbps", machine.nvme_mixed_bps / 1e9},
      {"nvme_request_ms", machine.nvme_request_s * 1e3},
      {"nvme_subgroup_ms", machine.nvme_subgroup_s >= 0
                               ? nlohmann::json(machine.nvme_subgroup_s * 1e3)
                               : nlohmann::json(nullptr)},
      {"nvme_mixed_request_ms", machine.nvme_mixed_request_s * 1e3},
      {"nvme_mixed_deep_request_ms", machine.nvme_mixed_deep_request_s >= 0
                                         ? nlohmann::json(machine.nvme_mixed_deep_request_s * 1e3)
                                         : nlohmann::json(nullptr)},
      {"nvme_fetch_read_gbps", machine.nvme_fetch_read_bps / 1e9},
      {"nvme_fetch_request_ms", machine.nvme_fetch_request_s * 1e3},
      {"nvme_sustained_gbps", machine.nvme_sustained_bps / 1e9},
      {"nvme_mixed_burst_gbps", machine.nvme_mixed_burst_bps / 1e9},
      {"drive_probe_gbps",
       m.drive.bps > 0 ? nlohmann::json(m.drive.bps / 1e9) : nlohmann::json(nullptr)},
      {"compute_probe_layer_ms",
       m.compute.layer_s > 0 ? nlohmann::json(m.compute.layer_s * 1e3) : nlohmann::json(nullptr)},
      {"device_shares_host_cores", machine.device_shares_host_cores},
      {"nvme_compute_slowdown", machine.nvme_compute_slowdown},
      {"nvme_compute_slowdown_rounds", m.nvme_slowdown_rounds},
      {"nvme_load_gbps", machine.nvme_load_bps / 1e9},
      {"cpu_adamw_mparams_per_s", machine.cpu_adamw_params_per_s / 1e6},
      {"cpu_adamw_call_ms", machine.cpu_adamw_call_s * 1e3},
      {"device_adamw_mparams_per_s", machine.device_adamw_params_per_s / 1e6},
      {"all_gather_gbps", machine.all_gather_bps / 1e9},
      {"reduce_scatter_gbps", machine.reduce_scatter_bps / 1e9},
      {"device_capacity_bytes", machine.device_capacity},
      {"host_capacity_bytes", machine.host_capacity},
      {"nvme_free_bytes", machine.nvme_free}};
  j["model"] = {{"type", mcfg.model_type},
                {"layers", mcfg.num_layers},
                {"params",
                 [&] {
                   std::uint64_t n = 0;
                   for (const auto& u : model_units(mcfg)) n += u.numel;
                   return n;
                 }()},
                {"params_per_rank",
                 [&] {
                   std::uint64_t n = 0;  // this rank's TP slices (all of it under TP 1)
                   for (const auto& u : model_units(mcfg, a.tp)) n += u.numel;
                   return n;
                 }()},
                {"seq_len", a.seq_len},
                {"dtype", a.dtype},
                {"gradient_accumulation_steps", a.grad_accum}};
  {
    nlohmann::json rows = nlohmann::json::array();
    for (const auto& mp : space.models)
      rows.push_back(
          {{"micro_batch", mp.micro_batch},
           {"checkpoint", !mp.checkpoint          ? "off"
                          : mp.checkpoint_on_host ? "host"
                                                  : "on"},
           {"layer_forward_s", mp.units[1].forward_s},
           {"layer_backward_s", mp.units[1].backward_s},
           {"head_forward_s", mp.units.back().forward_s},
           {"embed_s", mp.units[0].forward_s + mp.units[0].backward_s},
           {"layer_tp_bytes", mp.units[1].tp_forward_bytes + mp.units[1].tp_backward_bytes},
           {"activation_bytes", mp.activation_bytes},
           {"device_cores", mp.device_cores}});
    j["model"]["measured"] = std::move(rows);
    nlohmann::json left_out = nlohmann::json::array();
    for (const Unmeasured& u : m.unmeasured)
      left_out.push_back(
          {{"micro_batch", u.micro_batch}, {"checkpoint", u.checkpoint}, {"why", u.why}});
    j["model"]["does_not_fit"] = std::move(left_out);
  }
  j["machine_seconds"] = t_machine;
  j["measure_seconds"] = t_measured;
  j["candidates_considered"] = sr.considered;
  j["candidates_feasible"] = sr.ranked.size();
  return j;
}

// The flags that would let the closest plan fit, from the tiers it is short of: the device (a
// larger --device-mem-gb: the emulated device's cap, or a GPU's planned under one; a GPU's own
// memory is its limit), the pinned budget (a larger --host-mem-gb, unless host RAM is short too:
// the budget is taken from RAM), host RAM (no flag gives more: what is placed on NVMe leaves it);
// and those that shrink any plan: smaller micro-batches, NVMe.
std::string ways_out(const Args& a, const Measurement& m, const NvmeChoice& nvme,
                     const MemoryPlan& closest) {
  const bool device = closest.device_bytes > closest.device_capacity,
             pinned = closest.host_bytes > closest.host_capacity,
             ram = closest.ram_capacity > 0 && closest.ram_bytes > closest.ram_capacity;
  const bool device_flag = device && (m.dev_name.starts_with("cpu") || a.device_mem_gb > 0),
             host_flag = pinned && !ram;
  std::vector<std::string> ways;
  if (device_flag && host_flag)
    ways.push_back("a larger --device-mem-gb or --host-mem-gb");
  else if (device_flag)
    ways.push_back("a larger --device-mem-gb");
  else if (host_flag)
    ways.push_back("a larger --host-mem-gb");
  if (a.micro_batches.front() > 1)
    ways.push_back(fmt::format("--micro-batches below {}", a.micro_batches.front()));
  ways.push_back(nvme.use ? "--nvme-path on a drive with more free space"
                          : "NVMe (leave out --no-nvme)");
  std::string out;
  for (std::size_t i = 0; i < ways.size(); ++i)
    out += (i == 0 ? "" : i + 1 == ways.size() ? ", or " : ", ") + ways[i];
  if (ram)
    out += fmt::format(
        " (host RAM is short: the closest plan needs {} of it and this rank has {}, which "
        "neither --device-mem-gb nor --host-mem-gb adds to: what is placed on NVMe leaves it, "
        "or free memory on this machine)",
        human(double(closest.ram_bytes)), human(double(closest.ram_capacity)));
  return out;
}

// No placement fits: the closest, and the ways out (rank 0).
void report_no_fit(const Args& a, const Measurement& m, const NvmeChoice& nvme,
                   const SearchResult& sr, nlohmann::json& j, Clock::time_point t_start) {
  std::printf(
      "no placement fits: %zu candidates considered. The one closest to fitting (the fewest bytes "
      "missing over all tiers), %s:\n%s",
      sr.considered, sr.smallest_label.c_str(), sr.smallest.table().c_str());
  // The table's device capacity is the headroom's share, not the device's: say so.
  std::printf(
      "(a plan may fill %.0f%% of the device's memory, %s of %s: the rest is the allocator's)\n",
      100 * m.space.device_headroom, log::human_bytes(double(sr.smallest.device_capacity)).c_str(),
      log::human_bytes(double(m.machine.device_capacity)).c_str());
  std::printf("strata-prof's own ways out: %s\n", ways_out(a, m, nvme, sr.smallest).c_str());
  std::error_code ec;
  for (const std::string* f : {&a.out, &a.svg, &a.trace})
    if (!f->empty() && fs::exists(*f, ec))
      std::printf("(%s is not this run's: nothing was written)\n", f->c_str());
  if (!nvme.use) std::printf("(NVMe placements were not considered: --no-nvme)\n");
  if (a.json) {
    j["fits"] = false;
    j["candidates"] = nlohmann::json::array();
    if (a.validate > 0) {
      j["validated"] = 0;
      j["validated_top"] = 0;
      j["validation_failures"] = 0;
      for (const char* k2 : {"worst_prediction_error", "rank_correlation_spearman",
                             "rank_correlation_spearman_resolved", "rank_tie_resolution",
                             "recommended_vs_best_measured", "round_drift", "trace_file"})
        j[k2] = nullptr;
    }
    j["problems"] = sr.problems;
    j["closest"] = {{"label", sr.smallest_label},
                    {"device_bytes", sr.smallest.device_bytes},
                    {"device_capacity_bytes", sr.smallest.device_capacity},
                    {"host_bytes", sr.smallest.host_bytes},
                    {"host_capacity_bytes", sr.smallest.host_capacity},
                    {"nvme_bytes", sr.smallest.nvme_bytes},
                    {"nvme_capacity_bytes", sr.smallest.nvme_capacity}};
    j["best_config_file"] = nullptr;
    j["total_seconds"] = since(t_start);
    std::printf("%s\n", j.dump().c_str());
  }
}

// The candidate predicted fastest: 0 unless the recommendation among near-ties moved another
// first (recommend_less_drive_bound).
std::size_t fastest_predicted(const SearchResult& sr) {
  std::size_t f = 0;
  for (std::size_t i = 1; i < sr.ranked.size(); ++i)
    if (sr.ranked[i].prediction.tokens_per_s > sr.ranked[f].prediction.tokens_per_s) f = i;
  return f;
}

// The best `shown` candidates as predicted (rank 0), and why #1 is not the fastest prediction
// when it is not (`fastest`: fastest_predicted()).
void print_ranked(const SearchResult& sr, std::size_t shown, std::size_t fastest) {
  std::printf("%zu placements considered, %zu fit; the best %zu (predicted):\n", sr.considered,
              sr.ranked.size(), shown);
  std::printf("  %-3s %10s %10s %-9s %10s %10s %10s  %s\n", "#", "step ms", "tokens/s", "bound by",
              "device", "host", "nvme", "configuration");
  for (std::size_t i = 0; i < shown; ++i) {
    const Candidate& c = sr.ranked[i];
    std::printf("  %-3zu %10.1f %10.0f %-9s %10s %10s %10s  %s\n", i + 1, c.prediction.step_s * 1e3,
                c.prediction.tokens_per_s, resource_name(c.prediction.bottleneck),
                human(double(c.plan.device_bytes)).c_str(),
                human(double(c.plan.host_bytes)).c_str(), human(double(c.plan.nvme_bytes)).c_str(),
                c.label.c_str());
  }
  if (fastest != 0) {
    const Candidate &rec = sr.ranked[0], &f = sr.ranked[fastest];
    const int drive = int(Resource::kNvme);
    std::printf(
        "#1 is recommended over #%zu, predicted %.1f%% faster: within %.0f%% of the fastest "
        "prediction, the fastest that keeps the NVMe drive markedly less busy (%.1f ms a step "
        "against %.1f), less exposed to the drive's swings from run to run and wearing it less\n",
        fastest + 1, (f.prediction.tokens_per_s / rec.prediction.tokens_per_s - 1) * 100,
        kRecommendTieWithin * 100, rec.prediction.busy_s[drive] * 1e3,
        f.prediction.busy_s[drive] * 1e3);
  }
  std::fflush(stdout);
}

// The candidates for --json, in rank order: the printed ones, and every one to validate (--top 1
// --validate 3, and the spread's, ranked anywhere).
nlohmann::json candidates_json(const SearchResult& sr, std::size_t shown,
                               const std::vector<ValidationPick>& picks) {
  nlohmann::json cands = nlohmann::json::array();
  std::set<std::size_t> in_json;
  for (std::size_t i = 0; i < shown; ++i) in_json.insert(i);
  for (const ValidationPick& p : picks) in_json.insert(p.index);
  for (const std::size_t i : in_json) {
    const Candidate& c = sr.ranked[i];
    nlohmann::json busy;
    for (int r = 0; r < int(Resource::kCount); ++r)
      busy[resource_name(Resource(r))] = c.prediction.busy_s[r];
    cands.push_back({{"rank", i + 1},
                     {"label", c.label},
                     {"placement_class", placement_class(c)},
                     {"micro_batch", c.micro_batch},
                     {"checkpoint", !c.checkpoint          ? "off"
                                    : c.checkpoint_on_host ? "host"
                                                           : "on"},
                     {"predicted_step_s", c.prediction.step_s},
                     {"predicted_tokens_per_s", c.prediction.tokens_per_s},
                     {"predicted_forward_s", c.prediction.forward_s},
                     {"predicted_backward_s", c.prediction.backward_s},
                     {"predicted_optimizer_s", c.prediction.optimizer_s},
                     {"bottleneck", resource_name(c.prediction.bottleneck)},
                     {"busy_s", busy},
                     {"device_bytes", c.plan.device_bytes},
                     {"host_bytes", c.plan.host_bytes},
                     {"nvme_bytes", c.plan.nvme_bytes}});
  }
  return cands;
}

// The validation runs' data, opened as strata-train opens it (text for ids, bytes for a
// vocabulary that is not bytes are refused) at the --seq-len and the largest micro-batch searched,
// and what a run reads of it read (every rank reads every rank's batches, `dp_world` of them a
// micro-batch): a file without a window of seq_len + 1 tokens, or an id outside the vocabulary
// where a run reads, is refused before the machine is measured, not once a candidate. A smaller
// micro-batch reads the first windows of the same shuffled order: these cover its batches.
void check_data(const Args& a, const ModelConfig& mcfg, int dp_world) {
  if (a.data_files.empty() && a.text_file.empty()) return;
  const TrainOptions run;  // a validation run's loader settings: its shuffle and seed
  DataOptions d;
  d.files = a.text_file.empty() ? a.data_files : std::vector<std::string>{a.text_file};
  d.format = a.text_file.empty() ? parse_token_format(a.data_format) : TokenFormat::kBytes;
  d.vocab_size = mcfg.vocab_size;
  d.seq_len = a.seq_len;
  d.batch = a.micro_batches.back();
  d.shuffle = run.shuffle;
  d.seed = run.seed;
  TokenLoader check(d);
  const std::int64_t batches = std::int64_t(a.validate_steps) * a.grad_accum * dp_world;
  for (std::int64_t i = 0; i < batches; ++i) check.next();
}

}  // namespace

int run(Args a) {
  const auto t_start = Clock::now();
  const bool demo = a.model_dir.empty() && a.model_config.empty();
  const ModelConfig mcfg = load_model(a, demo);
  check_flags(a);
  const LaunchInfo job = init_launch();
  read_config_text(a);
  a.tp = tensor_parallel_of(a, job);
  // The ZeRO state is sharded over the data-parallel ranks: the batch keys count those.
  LaunchInfo launch = job;
  launch.world_size = job.world_size / a.tp.size;
  bool config_micro = false, config_train = false;
  EngineConfig base = read_config(a, launch.world_size, config_micro, config_train);
  resolve_config_for_model(base, mcfg, launch.world_size, a.ds_config, !a.dtype.empty(),
                           launch.rank == 0);
  const std::int64_t config_train_batch =
      apply_flags(a, base, launch, demo, config_micro, config_train);
  check_data(a, mcfg, launch.world_size);
  const DeviceOptions dopt = device_options(a);
  const NvmeChoice nvme = choose_nvme(a, base);
  const bool talk = launch.rank == 0;
  check_outputs(a, demo, talk);

  // ---- measure ----
  const Measurement m = measure(a, base, mcfg, nvme, dopt, launch.world_size, talk, t_start);

  // ---- search ----
  const SearchResult sr = search_placements(m.machine, m.space);
  nlohmann::json j = figures_json(a, mcfg, m, nvme, sr);
  if (sr.ranked.empty()) {
    if (talk) report_no_fit(a, m, nvme, sr, j, t_start);
    return 2;
  }
  const std::size_t shown =
      std::min<std::size_t>(std::size_t(std::max(1, a.top)), sr.ranked.size());
  const std::size_t fastest = fastest_predicted(sr);
  if (talk) print_ranked(sr, shown, fastest);
  const Candidate& best = sr.ranked[0];
  if (talk && !a.out.empty()) write_recommendation(a, best, m, config_train_batch);
  const std::vector<ValidationPick> picks =
      a.validate > 0
          ? validation_picks(sr.ranked, std::size_t(a.validate), std::size_t(a.validate_spread))
          : std::vector<ValidationPick>{};
  nlohmann::json cands = candidates_json(sr, shown, picks);

  // ---- validate ----
  Validation v;
  if (a.validate > 0)
    v = validate(a, sr.ranked, picks, mcfg, nvme.dir, launch.world_size, talk, m, dopt, cands, j);
  if (talk && !a.svg.empty()) {
    write_svg(a.svg, best, v.have_trace ? &v.measured_sched : nullptr, v.measured_best_step,
              std::vector<Candidate>(sr.ranked.begin(), sr.ranked.begin() + std::ptrdiff_t(shown)));
    std::printf("picture: %s\n", a.svg.c_str());
  }
  if (a.validate == 0)
    j["reference"] =
        "none: predictions only, from the measured machine and layer profile; --validate K runs "
        "candidates and holds the predictions to their measured steps";
  j["fits"] = true;
  j["fastest_predicted_rank"] = fastest + 1;
  j["candidates"] = cands;
  j["best_config_file"] = a.out.empty() ? nlohmann::json(nullptr) : nlohmann::json(a.out);
  j["total_seconds"] = since(t_start);
  if (talk && a.json) std::printf("%s\n", j.dump().c_str());
  return v.exit_code;
}

}  // namespace strata::prof

int main(int argc, char** argv) {
  strata::reexec_with_passive_openmp(argv);  // before libgomp's first team: see device.h
  strata::remove_swap_files_on_interrupt();  // its validation runs' swap files too
  strata::tools::g_ranks_start_mpi = true;  // every rank starts MPI: one failing early ends the job
  strata::prof::Args a;
  CLI::App app{
      "strata-prof: measure this machine and the model, predict the step time of every placement "
      "of\n"
      "weights, gradients and optimizer state over device, host and NVMe, recommend the fastest\n"
      "that fits (of near-ties, one that keeps the NVMe drive markedly less busy; written as a\n"
      "ds_config.json), and --validate the prediction by running the best."};
  app.add_option("--model", a.model_dir,
                 "Hugging Face model folder (config.json); default: the demo model");
  app.add_option("--model-config", a.model_config, "config.json of the model");
  app.add_option("--config", a.ds_config,
                 "ds_config.json whose other settings (precision, clipping, aio) are kept");
  app.add_option("--aio", a.aio_file, "an aio block from strata-bench nvme --sweep --out FILE");
  app.add_option("--data", a.data_files, "token file(s) for --validate (default: random tokens)");
  app.add_option("--data-dtype", a.data_format,
                 "the --data files' format, as strata-train's (raw ids without a header need u16 "
                 "or u32)")
      ->check(CLI::IsMember({"auto", "u16", "u32", "llmc", "bytes", "prepared"}));
  app.add_option("--text", a.text_file, "a text file for --validate (byte-level models)");
  app.add_option("--seq-len", a.seq_len,
                 "tokens per sequence (default 128 demo, else 1024 or the model's "
                 "max_position_embeddings when smaller)")
      ->check(strata::tools::kPositive);
  app.add_option("--micro-batch", a.micro_batch,
                 "sequences per micro-batch (default 4 demo, else 1)")
      ->check(strata::tools::kPositive);
  app.add_option("--micro-batches", a.micro_batches,
                 "micro-batch sizes to search (default B/2, B, 2B)");
  app.add_option("--grad-accum", a.grad_accum,
                 "micro-batches per step (default: --config's, else 1)")
      ->check(strata::tools::kPositive);
  app.add_option("--dtype", a.dtype, "compute dtype (default: --config's, else fp32)")
      ->check(CLI::IsMember({"fp32", "bf16"}));
  app.add_option("--device", a.device, "device")->check(CLI::IsMember({"auto", "cpu", "cuda"}));
  app.add_option("--device-mem-gb", a.device_mem_gb,
                 "device memory to plan for, GiB (the emulated device's cap)")
      ->check(strata::tools::kPositive);
  app.add_option("--host-mem-gb", a.host_mem_gb,
                 "pinned host memory to plan for, GiB (default 80% of RAM)")
      ->check(strata::tools::kPositive);
  app.add_option("--emu-h2d-gbps", a.emu_h2d, "emulated device: host-to-device GB/s")
      ->check(strata::tools::kNonNegative);
  app.add_option("--emu-d2h-gbps", a.emu_d2h, "emulated device: device-to-host GB/s")
      ->check(strata::tools::kNonNegative);
  app.add_option("--emu-compute-gflops", a.emu_gflops, "emulated device: matmul GFLOP/s")
      ->check(strata::tools::kNonNegative);
  app.add_option("--nvme-path", a.nvme_path,
                 "folder on the NVMe drive (default <build>/prof-nvme, or "
                 "~/.cache/strata/prof-nvme installed)");
  app.add_flag("--no-nvme", a.no_nvme, "do not consider NVMe placements");
  app.add_option("--nvme-sustain-s", a.nvme_sustain_s,
                 "seconds the drive's mix of reads and writes runs for its sustained rate, the "
                 "second half counted; a drive that bursts has its rates scaled to it (default 8; "
                 "0: the short runs' rates)");
  app.add_option("--top", a.top, "candidates to print (default 5)")->check(CLI::Range(1, 100));
  app.add_option("--validate", a.validate,
                 "run the best K for a few steps and compare, with the spread (default 0)")
      ->check(CLI::Range(0, 20));
  app.add_option("--validate-spread", a.validate_spread,
                 "with --validate K: up to N more runs, so that a wrong ranking can show: the best "
                 "of each placement class not among the K, the median and the last-ranked "
                 "(default 4; 0: the best K only)")
      ->check(CLI::Range(0, 20));
  app.add_option("--validate-steps", a.validate_steps, "steps per validation run (default 4)")
      ->check(CLI::Range(2, 100));
  app.add_option("--validate-rounds", a.validate_rounds,
                 "run the validated candidates this many times, in turns, each round begun "
                 "further along the order, so that of two or more none runs twice in a row (one "
                 "slow stretch of the machine falls on one of its runs) and a drift over the runs "
                 "falls on all nearly alike; each one's measured step is the median over all its "
                 "runs' timed steps (default 2)")
      ->check(CLI::Range(1, 10));
  app.add_option("--out", a.out,
                 "write the best configuration here (default strata-prof.ds_config.json)");
  app.add_option("--svg", a.svg, "the picture (default strata-prof.svg; empty: none)");
  app.add_option("--trace", a.trace,
                 "Chrome trace of the recommended configuration (with --validate; default "
                 "strata-prof.trace.json; \"\": none)");
  app.add_flag("--overwrite", a.overwrite,
               "replace existing --out, --svg and --trace files you named");
  app.add_option("--tensor-parallel", a.tensor_parallel,
                 "split each layer over N ranks (Megatron tensor parallelism, N innermost: "
                 "under mpirun the others are data parallel; default: the --config's "
                 "tensor_parallel.autotp_size, else 1)")
      ->check(CLI::Range(1, 1024));
  app.add_flag("--json", a.json, "print, last, one JSON object of the figures");
  return strata::tools::run_tool("strata-prof", app, argc, argv, strata::tools::ToolRuns::kernels,
                                 [&] {
                                   a.out_named = app.count("--out") > 0;
                                   a.svg_named = app.count("--svg") > 0;
                                   a.trace_named = app.count("--trace") > 0;
                                   a.validate_spread_named = app.count("--validate-spread") > 0;
                                   a.validate_rounds_named = app.count("--validate-rounds") > 0;
                                   strata::set_interrupt_note(
                                       "\nstrata-prof: interrupted; its results are written "
                                       "once it has measured everything: run it again\n");
                                   const int rc = strata::prof::run(a);
                                   strata::set_interrupt_note("");
                                   return rc;
                                 });
}
