// strata-prof's parts (strata_prof.cpp's head comment names the jobs): what the measuring
// (prof_measure.cpp), the validation (prof_validate.cpp), the picture (prof_picture.cpp) and the
// tool's sequence of steps (strata_prof.cpp) share. Internal to the tool.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "strata/device.h"
#include "strata/engine_config.h"
#include "strata/log.h"
#include "strata/model.h"
#include "strata/perf_model.h"
#include "strata/trace.h"
#include "strata/trainer.h"

namespace strata::prof {

using Clock = std::chrono::steady_clock;

inline double since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

inline std::string human(double b) { return log::human_bytes(b); }

// The median of `v` (the upper of the two middle values of an even count; 0 when empty): how
// strata-prof reduces repeated measurements of the machine and the validation runs' steps (a layer
// profile's repetitions take trimmed_mean instead: see mean_timing).
inline double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct Args {
  std::string model_dir, model_config, ds_config, aio_file;
  std::vector<std::string> data_files;
  std::string data_format = "auto";  // of data_files, as strata-train's --data-dtype
  std::string text_file;
  std::int64_t seq_len = 0, micro_batch = 0, grad_accum = 0;  // 0: --config's, else 1
  std::vector<std::int64_t> micro_batches;                    // empty: B/2, B, 2B
  std::string dtype;                                          // "": --config's, else fp32
  std::string device = "auto";
  double device_mem_gb = 0, host_mem_gb = 0;
  double emu_h2d = 0, emu_d2h = 0, emu_gflops = 0;
  std::string nvme_path;
  bool no_nvme = false;
  double nvme_sustain_s = 8;  // the drive's mix run this long for its sustained rate (0: none)
  int top = 5;
  int validate = 0;
  int validate_spread = 4;  // with --validate K: up to this many more, of other classes and low
  int validate_steps = 4;
  int validate_rounds = 2;  // each pick run this many times, in turns (validation_order)
  std::string out = "strata-prof.ds_config.json";
  std::string svg = "strata-prof.svg";
  std::string trace;  // with --validate: default strata-prof.trace.json
  bool overwrite = false;
  // Which of --out, --svg, --trace the user named: the default files (strata-prof.*) are the
  // tool's own and replaced without --overwrite, as a re-run in the same folder expects.
  bool out_named = false, svg_named = false, trace_named = false;
  bool validate_spread_named = false;  // (refused without --validate)
  bool validate_rounds_named = false;  // (likewise)
  bool json = false;
  // --tensor-parallel N (0: the --config's tensor_parallel.autotp_size, else 1); `tp` what run()
  // made of it: the size and this rank's place in its TP group.
  int tensor_parallel = 0;
  TensorParallel tp;
  // Set in main: the --config as the user wrote it (plus the flags), before this machine's
  // defaults; and whether the host budget came from the user.
  EngineConfig user_config;
  std::string user_text;  // the --config as written (written_json puts its own keys back)
  bool host_budget_given = false;
};

// Where NVMe is measured and what the search may place there.
struct NvmeChoice {
  bool use = false;
  std::string dir, key = "--nvme-path";  // (the key: what gave it, for its errors)
  std::vector<std::string> paths;        // the search's: the --config's lists, else dir
  std::vector<std::string> param_paths;  // the --config's offload_param list, when it has its own
};

// The devices' options from the flags: `hopt`/`copt` the placements are planned for, `mhopt` the
// emulated device the measurements run on.
struct DeviceOptions {
  HostDeviceOptions hopt, mhopt;
  CudaDeviceOptions copt;
};

// A profile (micro-batch and checkpointing) that ran out of memory while measured, or holds more
// than one that did: not in the search space, its candidates do not fit.
struct Unmeasured {
  std::int64_t micro_batch = 0;
  std::string checkpoint;  // "off", "on", "host"
  std::string why;
};

// The drive's rate by one probe that the profile and the validation both take, so that a drive
// that changed speed between the two shows: the engine's mix of reads and writes (half each,
// MachineProfile::kMixedInFlight in flight) over `count` keys of one unit's `extent`, bytes a
// second, the median of 3 passes. 0 bytes a second: not measured (no drive).
struct DriveProbe {
  std::size_t extent = 0, count = 0;
  double bps = 0;
};

// The device's kernels' speed by one timing that the profile and the validation both take, so that
// kernels that changed speed between the two show: the 2-layer copy of the first profile measured
// (its micro-batch and checkpointing), a layer's forward and backward, timed as the profile times
// it (the cache written over before each repetition, the trimmed mean of them). Taken on the
// CPU-emulated device without tensor parallelism, where the kernels run on the host's cores and
// move with them; layer_s 0: not taken.
struct ComputeProbe {
  std::int64_t micro_batch = 0;
  bool checkpoint = false, checkpoint_on_host = false;
  DType dtype = DType::kF32;
  double layer_s = 0;  // the profile's: the trimmed mean over every repetition of that copy
};

// What the measure step found: the machine, the device's name as printed, the search space with
// the model's profiles, and the times taken.
struct Measurement {
  MachineProfile machine;
  std::string dev_name;
  SearchSpace space;
  double machine_s = 0, measured_s = 0;
  // The drive slowdown of each round alone (machine.nvme_compute_slowdown is over all of them):
  // how far one measurement of it moves on this machine. Rank 0's; empty without the drive.
  std::vector<double> nvme_slowdown_rounds;
  std::vector<Unmeasured> unmeasured;  // the same on every rank
  DriveProbe drive;                    // this rank's, as its profile measured it
  ComputeProbe compute;                // likewise
};

// ---- prof_measure.cpp ----
// Measures the machine and the model (printing both on rank 0); `a.device` becomes what "auto"
// chose and `base` takes the device's defaults.
Measurement measure(Args& a, EngineConfig& base, const ModelConfig& mcfg, const NvmeChoice& nvme,
                    const DeviceOptions& dopt, int world_size, bool talk,
                    Clock::time_point t_start);
// The host's memory rate as the profile measures it (MachineProfile::host_mem_bps): bytes read
// and written a second, best of 3 memcpy's of `bytes` from `src` to `dst`.
double host_copy_bps(char* dst, const char* src, std::size_t bytes);
// The drive's rate as `shape` says the profile probed it (DriveProbe), probed again now in a
// swap store of its own under `folder` with `aio` (its files removed before it returns).
double probe_drive(const std::string& folder, const AioConfig& aio, const DriveProbe& shape);
// A layer's forward and backward in seconds as `shape` says the profile timed it (ComputeProbe),
// timed again now on a device of its own, as the profile's.
double probe_compute(const Args& a, const DeviceOptions& dopt, const ModelConfig& mcfg,
                     const ComputeProbe& shape);

// ---- prof_picture.cpp ----
std::vector<Interval> measured_schedule(const std::vector<TraceSpan>& spans);
void write_svg(const std::string& path, const Candidate& best,
               const std::vector<Interval>* measured, double measured_step_s,
               const std::vector<Candidate>& top);

// ---- prof_validate.cpp ----
// The demo's model config, written beside --out for the printed command: best.json ->
// best.model.json.
std::string demo_model_file(const std::string& out);  // "" when --out is a stream (/dev/null)
// Writes --out and prints the strata-train command that runs it (rank 0).
void write_recommendation(const Args& a, const Candidate& best, const Measurement& m,
                          std::int64_t config_train_batch);
// What the validation runs leave for the picture.
struct Validation {
  std::vector<Interval> measured_sched;
  double measured_best_step = 0;
  bool have_trace = false;
  int exit_code = 0;
};
// --validate K: runs the picked candidates (validation_picks: the best K and the spread), prints
// predicted against measured step time and bottleneck, and adds the figures to `cands` (the
// entry of each by its "rank") and `j`. The host's memory rate is checked before each round and
// after the last, against the profile's (`m`), and so are the drive's (where the profile probed
// it and a picked candidate keeps bytes on NVMe) and the device's kernels' (where the profile
// timed them for it: ComputeProbe, on a device made with `dopt`): a machine that changed speed
// between the profile and the runs shows there.
Validation validate(const Args& a, const std::vector<Candidate>& ranked,
                    const std::vector<ValidationPick>& picks, const ModelConfig& mcfg,
                    const std::string& nvme_dir, int world_size, bool talk, const Measurement& m,
                    const DeviceOptions& dopt, nlohmann::json& cands, nlohmann::json& j);

}  // namespace strata::prof
