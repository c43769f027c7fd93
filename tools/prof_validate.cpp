// strata-prof's validation: the configuration written for a candidate (--out, and each
// validation run's), the strata-train command that runs the recommendation, and --validate K:
// the best K run through strata::train for a few steps, predicted against measured step time.
#include <fcntl.h>
#include <fmt/format.h>
#include <signal.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <utility>

#include "prof.h"
#include "strata/comm.h"
#include "strata/error.h"
#include "strata/json_config.h"
#include "strata/log.h"
#include "strata/paths.h"
#include "strata/system_info.h"

namespace strata::prof {
namespace {

namespace fs = std::filesystem;

struct Measured {
  double step_s = 0;
  std::vector<double> steps;
};

// The configuration written for a candidate: what the search decided, and otherwise the user's
// own keys — not this machine's defaults (the host budget of 80% of its RAM over its ranks, the
// emulated device's early-step and norm settings), which strata-train works out again where it
// runs (a config carried to a GPU or to more ranks must not take them along).
EngineConfig written_config(const EngineConfig& chosen, const EngineConfig& user,
                            bool host_budget_given) {
  EngineConfig w = chosen;
  if (!host_budget_given) w.host_budget_bytes = 0;
  w.overlap_optimizer = user.overlap_optimizer;
  w.device_grad_norm = user.device_grad_norm;
  return w;
}

// The recommendation as written to --out: `chosen`'s settings, with the --config's own keys that
// strata's full config would lose put back as the user wrote them — Hugging Face's "auto"
// placeholders, keys strata does not use, defaults written out — wherever that leaves the
// configuration the same (each tried, parsed and compared): a key of the user's that only says
// what strata does anyway, and does not change what was decided.
std::string written_json(const EngineConfig& chosen, const std::string& user_text, int world) {
  const std::string plain = engine_config_json(chosen);
  if (user_text.empty()) return plain;
  // The trial parses warn of the user's unused keys and "auto"s: said once already, when read.
  const log::Quiet quiet(log::Level::kOff);
  auto meaning = [&](const config::Json& j) -> std::string {
    try {
      return engine_config_json(parse_engine_config(j.dump(), world));
    } catch (const Error&) {
      return {};
    }
  };
  config::Json out = config::Json::parse(plain);
  const config::Json user = config::parse(user_text, "--config");
  const std::string decided = meaning(out), users = meaning(user);
  if (decided.empty() || users.empty()) return plain;
  // The user's values, each a leaf where `out` has no object at that place.
  using Ptr = config::Json::json_pointer;
  std::vector<Ptr> leaves;
  const auto collect = [&](const auto& self, const config::Json& at, const Ptr& where) -> void {
    for (auto it = at.begin(); it != at.end(); ++it) {
      const Ptr p = where / it.key();
      if (it->is_object() && out.contains(p) && out[p].is_object())
        self(self, *it, p);
      else
        leaves.push_back(p);
    }
  };
  if (user.is_object()) collect(collect, user, Ptr());
  for (const Ptr& p : leaves) {
    const config::Json& v = user[p];
    const bool missing = !out.contains(p),
               placeholder = v.is_string() && v == "auto" && !missing && out[p] != v;
    if (!missing && !placeholder) continue;
    try {
      // A key the user wrote: inert in their own config (removing it changes nothing there). A
      // placeholder may mean a value ("auto" lr is the Trainer's 5e-5): it goes back wherever it
      // means what was decided (below), so that a Trainer given the file fills it in again.
      config::Json without = user;
      without[p.parent_pointer()].erase(p.back());
      if (!placeholder && meaning(without) != users) continue;
      config::Json trial = out;  // ... and it changes nothing in the recommendation
      trial[p] = v;
      if (meaning(trial) == decided) out = std::move(trial);
    } catch (const nlohmann::json::exception&) {  // (a place `out` holds a value, not an object,
                                                  // above it)
    }
  }
  return out.dump(2) + "\n";
}

Measured run_candidate(const Args& a, const Candidate& c, const std::string& work,
                       const std::string& data_file, const std::string& trace_file, int index) {
  const std::string cfg_path = (fs::path(work) / fmt::format("candidate{}.json", index)).string();
  {
    // No schedule: a step's time does not depend on its lr, and a schedule the --config sizes for
    // the whole run ("auto" total steps, a long warmup) may not fit the few steps measured here.
    EngineConfig w = written_config(c.config, a.user_config, a.host_budget_given);
    w.scheduler = LrScheduleConfig{};
    std::ofstream f(cfg_path, std::ios::trunc);
    f << engine_config_json(w);
  }
  TrainOptions o;
  o.model_dir = a.model_dir;
  o.model_config = a.model_config;
  if (a.model_dir.empty() && a.model_config.empty()) {
    // The demo model, from its config: train() then needs no demo data.
    const std::string mc = (fs::path(work) / "model_config.json").string();
    std::ofstream f(mc, std::ios::trunc);
    f << model_config_json(demo_model_config());
    o.model_config = mc;
  }
  if (!a.data_files.empty()) {
    o.data_files = a.data_files;
    o.data_format = a.data_format;
  } else if (!a.text_file.empty())
    o.text_file = a.text_file;
  else
    o.data_files = {data_file};
  if (a.data_files.empty() && a.text_file.empty()) o.data_format = "u32";
  o.ds_config = cfg_path;
  o.seq_len = a.seq_len;
  o.micro_batch = c.micro_batch;
  o.grad_accum = a.grad_accum;
  o.steps = a.validate_steps;
  o.dtype = a.dtype;
  o.device = a.device;
  o.device_mem_gb = a.device_mem_gb;
  o.emu_h2d_gbps = a.emu_h2d;
  o.emu_d2h_gbps = a.emu_d2h;
  o.emu_compute_gflops = a.emu_gflops;
  o.tensor_parallel = a.tp.size;
  o.checkpoint_activations = c.checkpoint;
  o.checkpoint_on_host = c.checkpoint_on_host;
  o.trace_file = trace_file;
  o.trace_step = a.validate_steps;
  o.overwrite = true;  // written again each round (a work file, or the --trace checked up front)
  o.interrupt_notes = false;  // (strata-prof's own says what an interrupt leaves)
  std::FILE* null = std::fopen("/dev/null", "w");
  o.console = null;
  TrainResult r;
  try {
    r = train(o);
  } catch (...) {
    std::fclose(null);
    throw;
  }
  std::fclose(null);
  Measured m;
  for (std::size_t i = 1; i < r.steps.size(); ++i)
    m.steps.push_back(r.steps[i].step_s);  // step 1 records the order
  m.step_s = median(m.steps);
  return m;
}

// Random tokens for the validation runs (every rank its own, in its work folder): the step's
// time does not depend on what they are.
std::string write_token_file(const Args& a, const std::string& work, const ModelConfig& mcfg,
                             int world_size) {
  const std::string data_file = (fs::path(work) / "tokens.u32").string();
  std::vector<std::uint32_t> tok(std::size_t(a.seq_len + 1) * std::size_t(a.micro_batches.back()) *
                                 std::size_t(a.grad_accum * world_size * (a.validate_steps + 2)));
  std::mt19937_64 rng(3);
  for (auto& t : tok) t = std::uint32_t(rng() % std::uint64_t(mcfg.vocab_size));
  std::ofstream f(data_file, std::ios::binary | std::ios::trunc);
  f.write(reinterpret_cast<const char*>(tok.data()), std::streamsize(tok.size() * 4));
  return data_file;
}

// Rounds of one candidate this far apart (as large as the error target) are named below the
// errors: an error that size may be the machine's, not the model's.
constexpr double kDriftNote = 0.15;
// How much slower than the fastest validated the recommended configuration may train (tokens/s).
constexpr double kRecommendedTarget = 0.05;

// One of the machine's rates (a second: bytes, or a layer's forward and backward), measured beside
// the runs (before each round and after the last), and the profile's.
struct SpeedCheck {
  std::vector<double> rate;
  double profile_rate = 0;
  std::string failed;  // why the checks stopped early ("": they did not)
  // The profile's over the checks' median (0: nothing to compare).
  double profile_vs_checks() const {
    const double m = median(rate);
    return m > 0 && profile_rate > 0 ? profile_rate / m : 0;
  }
  // Whether the profile's lies outside what the checks saw, by more than a tenth of their range's
  // ends: it ran at another speed while profiled.
  bool profiled_at_another_speed() const {
    if (profile_rate <= 0 || rate.empty()) return false;
    const auto [lo, hi] = std::minmax_element(rate.begin(), rate.end());
    return profile_rate < 0.9 * *lo || profile_rate > 1.1 * *hi;
  }
};

// What the validation runs measured, one entry a pick (0: the run failed).
struct Runs {
  std::vector<double> step_s, tokens_per_s;
  std::vector<double> spread;                     // step_spread of each run's timed steps
  std::vector<std::vector<double>> round_step_s;  // each pick's rounds' median steps
  double worst = 0;  // the largest prediction error, relative to the measured step
  int failed = 0;
  // The host's memory rate (host_copy_bps), the drive's (probe_drive) and the device's kernels'
  // (probe_compute) before each round and after the last, and the profile's.
  SpeedCheck host_mem, drive, compute;
};

// How a check beside the runs is printed and written into the JSON.
struct ShownCheck {
  const SpeedCheck& check;
  const char* what;
  double (*value)(double rate);  // what is printed of a rate
  int digits;
  const char* unit;
  const char* when;       // said of the checks
  const char* why;        // what a profile at another speed means
  const char* failed_as;  // the check, named when it failed
  const char* json_name;
  const char* json_unit;
};
std::vector<ShownCheck> shown_checks(const Runs& runs) {
  const auto gbps = [](double r) { return r / 1e9; };
  const auto ms = [](double r) { return r > 0 ? 1e3 / r : 0.0; };
  return {
      {runs.host_mem, "host memory", gbps, 1, "GB/s", ": before each round and after the last",
       "the machine ran at another speed while it was profiled, and the predictions above carry "
       "that as far as their steps depend on the host's memory and cores; on a quiet machine they "
       "say more",
       "host memory's check", "host_mem", "gbps"},
      {runs.drive, "the drive", gbps, 2, "GB/s",
       " at the same times: the engine's mix of reads and writes, probed as the profile did",
       "the drive ran at another speed while it was profiled, and the predictions above carry "
       "that as far as their steps wait on it",
       "the drive's check", "drive", "gbps"},
      {runs.compute, "a layer's forward and backward", ms, 2, "ms",
       " at the same times: the profile's 2-layer copy on a device of its own, timed as it was",
       "the device's kernels ran at another speed while they were profiled, and the predictions "
       "above carry that as far as their steps wait on them",
       "the kernels' check", "compute", "layer_ms"},
  };
}

// The validation's summary: failures, the worst prediction error, the rank correlation and how
// the recommended configuration fared against the fastest validated, all over every validated
// candidate, top or spread (printed on rank 0, and into `j`).
int report_validation(const Args& a, const std::vector<Candidate>& ranked,
                      const std::vector<ValidationPick>& picks, const Runs& runs,
                      bool trace_written, bool talk, nlohmann::json& j) {
  const std::string& trace = a.trace;
  const std::size_t k = picks.size();
  const int failed = runs.failed;
  const double worst = runs.worst;
  int exit_code = 0;
  // How much slower the recommended configuration (picks[0], ranked first) trains than the
  // fastest validated (>= 1).
  std::vector<Candidate> run_cands;
  for (const ValidationPick& p : picks) run_cands.push_back(ranked[p.index]);
  const std::size_t best_measured_i = fastest_validated(run_cands, runs.step_s);
  const std::vector<double>& measured_tps = runs.tokens_per_s;
  const double rec_vs_best = measured_tps[0] > 0 && best_measured_i < k
                                 ? measured_tps[best_measured_i] / measured_tps[0]
                                 : 0;
  if (failed > 0) {
    exit_code = 3;
    if (talk) std::printf("%d of %zu validation runs FAILED (see above)\n", failed, k);
  }
  const int validated_ok = int(k) - failed;
  // Whether the model orders the candidates as their runs do: Spearman's rank correlation of the
  // predicted and the measured tokens a second, over the runs that finished.
  // Besides, the same with values the runs cannot tell apart as ties: within the median
  // step-to-step spread of the runs (a candidate's own steps move that much), on both sides.
  std::vector<double> predicted_ok, measured_ok, spreads;
  for (std::size_t i = 0; i < k; ++i)
    if (measured_tps[i] > 0) {
      predicted_ok.push_back(run_cands[i].prediction.tokens_per_s);
      measured_ok.push_back(measured_tps[i]);
      spreads.push_back(runs.spread[i]);
    }
  const std::optional<double> rho = spearman(predicted_ok, measured_ok);
  const double resolution = median(spreads);
  const std::optional<double> rho_resolved = spearman(predicted_ok, measured_ok, resolution);
  const double rec_step = runs.step_s[0];
  // Whether the runs can tell the fastest validated from the recommended at all: its lead within
  // their median step-to-step spread is a tie, as the resolved rank correlation counts one (on the
  // AMD EPYC Zen 3 VM, 2026-12-07, the offload regime's two best, predicted 1.0-1.8% apart in nine
  // runs, measured 0.94-1.11 of each other, 1.00 on average: one run put the recommended 5.9%
  // behind at an 11.1% spread).
  const bool rec_within_spread = rec_vs_best > 0 && rec_vs_best - 1 <= resolution;
  // The pick whose rounds came apart the most (k: none ran twice).
  std::size_t drift_i = k;
  double drift = 0;
  for (std::size_t i = 0; i < k; ++i) {
    if (runs.round_step_s[i].size() < 2) continue;
    const double d = round_drift(runs.round_step_s[i]);
    if (drift_i == k || d > drift) {
      drift_i = i;
      drift = d;
    }
  }
  if (talk) {
    if (predicted_ok.size() >= 3)
      std::printf(
          "rank correlation of predicted and measured tokens/s (Spearman) %s over %zu runs; %s "
          "with values within %.1f%% of each other (the runs' step-to-step spread) as ties "
          "(target 0.8)\n",
          rho ? fmt::format("{:.2f}", *rho).c_str() : "- (all tied)", predicted_ok.size(),
          rho_resolved ? fmt::format("{:.2f}", *rho_resolved).c_str() : "- (all tied)",
          resolution * 100);
    if (rec_step <= 0 && validated_ok > 0)
      std::printf(
          "worst prediction error %.1f%% (target 15%%) over the %d that ran; the recommended "
          "configuration's run FAILED\n",
          worst * 100, validated_ok);
    if (rec_step > 0) {
      std::printf(
          "worst prediction error %.1f%% (target 15%%); the recommended configuration measured "
          "%.1f ms (%.0f tokens/s), %s\n",
          worst * 100, rec_step * 1e3, measured_tps[0],
          best_measured_i == 0
              ? "the fastest of those validated"
              : fmt::format("{:.1f}% slower than #{} in tokens/s (target {:.0f}%{})",
                            (rec_vs_best - 1) * 100, picks[best_measured_i].index + 1,
                            kRecommendedTarget * 100,
                            rec_vs_best - 1 > kRecommendedTarget && rec_within_spread
                                ? fmt::format("; within the runs' step-to-step spread of {:.1f}%: "
                                              "a tie they cannot order",
                                              resolution * 100)
                                : std::string())
                    .c_str());
    }
    if (drift_i < k && drift >= kDriftNote) {
      const std::vector<double>& r = runs.round_step_s[drift_i];
      const auto [lo, hi] = std::minmax_element(r.begin(), r.end());
      std::printf(
          "the machine drifted: #%zu's rounds' median steps ranged from %.1f to %.1f ms, %.0f%% "
          "apart (the errors above can be off by as much); on a quiet machine, or with more "
          "--validate-rounds, they say more\n",
          picks[drift_i].index + 1, *lo * 1e3, *hi * 1e3, drift * 100);
    }
    // The rates checked beside the runs, each against the profile's.
    for (const ShownCheck& s : shown_checks(runs)) {
      const SpeedCheck& c = s.check;
      if (c.rate.empty() || c.profile_rate <= 0) continue;
      const auto [lo, hi] = std::minmax_element(c.rate.begin(), c.rate.end());
      double a0 = s.value(*lo), a1 = s.value(*hi);
      if (a0 > a1) std::swap(a0, a1);
      const bool elsewhere = c.profiled_at_another_speed();
      std::printf("%s while validating %.*f-%.*f %s (%zu checks%s), the profile's %.*f %s%s%s\n",
                  s.what, s.digits, a0, s.digits, a1, s.unit, c.rate.size(), s.when, s.digits,
                  s.value(c.profile_rate), s.unit, elsewhere ? ": outside that range, " : "",
                  elsewhere ? s.why : "");
    }
    for (const ShownCheck& s : shown_checks(runs))
      if (!s.check.failed.empty())
        std::printf("%s beside the runs failed, and was not taken again: %s\n", s.failed_as,
                    s.check.failed.c_str());
    if (trace_written)
      std::printf("Chrome trace of the recommended configuration's step %d: %s\n", a.validate_steps,
                  trace.c_str());
  }
  j["reference"] = fmt::format(
      "each validated candidate's measured step: strata-train on this machine with its "
      "configuration, {} steps a run (the first records the order and is not timed), {} round(s) "
      "in turns, each begun further along the order (validation_order); the median of all its "
      "timed steps (measured_step_s); prediction_error = (predicted - measured) / measured; "
      "Spearman over "
      "predicted and measured tokens/s, and with values within rank_tie_resolution (the runs' "
      "median step-to-step spread) as ties; measured_bottleneck: the busiest lane in the last "
      "run's traced last step; recommended_vs_best_within_spread: whether the fastest validated's "
      "lead over the recommended is within rank_tie_resolution; validation_host_mem_gbps: the "
      "host's memory rate (measured as "
      "machine.host_mem_gbps is) before each round and after the last, and "
      "host_mem_profile_vs_validation the profile's over their median; validation_drive_gbps and "
      "drive_profile_vs_validation: the same for the drive (probed as machine.drive_probe_gbps "
      "is), where a validated candidate keeps bytes on NVMe; validation_compute_layer_ms and "
      "compute_profile_vs_validation: the same for the device's kernels, a layer's forward and "
      "backward (timed as machine.compute_probe_layer_ms is, on the CPU-emulated device), the "
      "ratio of speeds (the checks' median time over the profile's)",
      a.validate_steps, a.validate_rounds);
  j["validated"] = k;
  j["validated_top"] = std::count_if(picks.begin(), picks.end(),
                                     [](const ValidationPick& p) { return p.reason == "top"; });
  j["validation_failures"] = failed;
  j["worst_prediction_error"] = validated_ok > 0 ? nlohmann::json(worst) : nlohmann::json(nullptr);
  j["rank_correlation_spearman"] = rho ? nlohmann::json(*rho) : nlohmann::json(nullptr);
  j["rank_correlation_spearman_resolved"] =
      rho_resolved ? nlohmann::json(*rho_resolved) : nlohmann::json(nullptr);
  j["rank_tie_resolution"] =
      predicted_ok.empty() ? nlohmann::json(nullptr) : nlohmann::json(resolution);
  j["recommended_vs_best_measured"] =
      rec_step > 0 ? nlohmann::json(rec_vs_best) : nlohmann::json(nullptr);
  j["recommended_vs_best_within_spread"] =
      rec_step > 0 ? nlohmann::json(rec_within_spread) : nlohmann::json(nullptr);
  j["round_drift"] = drift_i < k ? nlohmann::json(drift) : nlohmann::json(nullptr);
  for (const ShownCheck& s : shown_checks(runs)) {
    nlohmann::json values = nlohmann::json::array();
    for (double r : s.check.rate) values.push_back(s.value(r));
    j[fmt::format("validation_{}_{}", s.json_name, s.json_unit)] = values;
    const double ratio = s.check.profile_vs_checks();
    j[fmt::format("{}_profile_vs_validation", s.json_name)] =
        ratio > 0 ? nlohmann::json(ratio) : nlohmann::json(nullptr);
  }
  j["trace_file"] = trace_written ? nlohmann::json(trace) : nlohmann::json(nullptr);
  return exit_code;
}

// The --json entry of the candidate ranked `index` (candidates_json wrote one for each pick).
nlohmann::json& entry_of(nlohmann::json& cands, std::size_t index) {
  for (nlohmann::json& c : cands)
    if (c["rank"] == index + 1) return c;
  STRATA_THROW(kInternal, "no --json entry for candidate #{}", index + 1);
}

// What validate() prints before the runs: which candidates, and how they run.
void print_validation_intro(const Args& a, const std::vector<ValidationPick>& picks) {
  const std::size_t top = std::size_t(std::count_if(
      picks.begin(), picks.end(), [](const ValidationPick& p) { return p.reason == "top"; }));
  // (one pick alone runs its rounds back to back: there is nothing to put between them)
  const std::string how =
      a.validate_rounds > 1
          ? fmt::format(
                "{} steps a run, the first not timed; {} rounds in turns, each begun further "
                "along the order{}",
                a.validate_steps, a.validate_rounds,
                picks.size() > 1 ? " (none run twice in a row)" : "")
          : fmt::format("{} steps each, the first not timed", a.validate_steps);
  if (top == picks.size())
    std::printf("\nvalidating the best %zu (%s):\n", top, how.c_str());
  else
    std::printf(
        "\nvalidating the best %zu and %zu more for spread, the best of other placement classes "
        "and low-ranked ones (%s):\n",
        top, picks.size() - top, how.c_str());
  std::fflush(stdout);
}

void print_validation_columns() {
  std::printf("  %-4s %12s %12s %8s %10s  %-18s %-19s  %s\n", "#", "predicted ms", "measured ms",
              "error", "tokens/s", "bound by pred/meas", "chosen as", "configuration");
}

}  // namespace

// The demo's model config, written beside --out for the printed command: best.json ->
// best.model.json.
std::string demo_model_file(const std::string& out) {
  if (written_in_place(out)) return {};  // (--out /dev/null: no file beside it, in /dev)
  return fs::path(out).replace_extension(".model.json").string();
}

// The recommendation: --out, written as the user's --config would have it (written_json), and the
// strata-train command that runs it on the device it was measured on.
void write_recommendation(const Args& a, const Candidate& best, const Measurement& m,
                          std::int64_t config_train_batch) {
  const MachineProfile& machine = m.machine;
  const std::string& dev_name = m.dev_name;
  const std::string text =
      written_json(written_config(best.config, a.user_config, a.host_budget_given), a.user_text,
                   std::max(1, machine.world_size));
  const int err = write_output(a.out, text);
  STRATA_REQUIRE(err == 0, "--out {}: cannot be written: {}", a.out, std::strerror(err));
  if (written_in_place(a.out)) {  // a stream (/dev/null, /dev/stdout): no run line
    std::printf(
        "\nbest configuration written to %s (a stream: give --out a file to keep it, and "
        "for the strata-train line that runs it)\n",
        a.out.c_str());
    return;
  }
  std::string model_flag = !a.model_dir.empty()      ? " --model " + a.model_dir
                           : !a.model_config.empty() ? " --model-config " + a.model_config
                                                     : "";
  if (model_flag.empty()) {
    // The demo model as profiled: strata-train without a model runs the demo under its own
    // 20 MiB cap, not the device this plan was made for.
    const std::string mc = demo_model_file(a.out);
    const int merr = write_output(mc, model_config_json(demo_model_config()));
    STRATA_REQUIRE(merr == 0, "{}: cannot be written: {}", mc, std::strerror(merr));
    model_flag = " --model-config " + mc;
  }
  // The device it was measured on, as strata-train takes it (the emulated one with its cap and
  // throttles).
  std::string device_flags;
  if (machine.tensor_parallel > 1)
    device_flags += fmt::format(" --tensor-parallel {}", machine.tensor_parallel);
  if (dev_name.starts_with("cpu")) {
    device_flags += " --device cpu";
    if (a.device_mem_gb > 0) device_flags += fmt::format(" --device-mem-gb {:g}", a.device_mem_gb);
    if (a.emu_h2d > 0) device_flags += fmt::format(" --emu-h2d-gbps {:g}", a.emu_h2d);
    if (a.emu_d2h > 0) device_flags += fmt::format(" --emu-d2h-gbps {:g}", a.emu_d2h);
    if (a.emu_gflops > 0) device_flags += fmt::format(" --emu-compute-gflops {:g}", a.emu_gflops);
  } else if (a.device_mem_gb > 0) {  // a GPU planned under a cap: the run keeps to it too
    device_flags += fmt::format(" --device-mem-gb {:g}", a.device_mem_gb);
  }
  // The data it validated on, as strata-train takes it (without it the run would train on the
  // demo's text, or refuse).
  std::string data_flags;
  if (!a.text_file.empty()) data_flags += " --text " + a.text_file;
  for (const std::string& f : a.data_files) data_flags += " --data " + f;
  if (!a.data_files.empty() && a.data_format != "auto")
    data_flags += " --data-dtype " + a.data_format;
  // strata-train beside this binary (a build tree's tools/, a package's bin/), else by name.
  std::error_code ec;
  const fs::path train = fs::read_symlink("/proc/self/exe", ec).parent_path() / "strata-train";
  const std::int64_t global = best.config.micro_batch_per_gpu *
                              best.config.gradient_accumulation_steps * machine.world_size;
  if (config_train_batch > 0 && global != config_train_batch) {
    const std::int64_t per_b = best.config.gradient_accumulation_steps * machine.world_size;
    const std::string keep =
        config_train_batch % per_b == 0
            ? fmt::format("pass --micro-batches {} to keep it", config_train_batch / per_b)
            : fmt::format(
                  "no micro-batch keeps it with {} x {} rank(s): choose a --grad-accum that "
                  "divides it",
                  best.config.gradient_accumulation_steps, machine.world_size);
    std::printf(
        "\nnote: B=%lld x gradient_accumulation_steps %lld x %d rank(s) = %lld sequences a step, "
        "not the "
        "train_batch_size %lld of --config %s (%s)\n",
        (long long)best.config.micro_batch_per_gpu,
        (long long)best.config.gradient_accumulation_steps, machine.world_size, (long long)global,
        (long long)config_train_batch, a.ds_config.c_str(), keep.c_str());
  }
  std::printf(
      "\nbest configuration written to %s; run it with:\n  %s%s%s --config %s --seq-len %lld%s%s\n",
      a.out.c_str(), !ec && fs::exists(train) ? train.c_str() : "strata-train", model_flag.c_str(),
      data_flags.c_str(), a.out.c_str(), (long long)a.seq_len,
      best.checkpoint_on_host ? " --checkpoint-on-host"
      : best.checkpoint       ? " --checkpoint-activations"
                              : "",
      device_flags.c_str());
  if (machine.tensor_parallel > 1)
    std::printf("  (under mpirun -np %d, as profiled: --tensor-parallel %d x %d data-parallel)\n",
                machine.tensor_parallel * machine.world_size, machine.tensor_parallel,
                machine.world_size);
  else if (machine.world_size > 1)
    std::printf("  (under mpirun -np %d, as profiled: %d data-parallel ranks)\n",
                machine.world_size, machine.world_size);
}

// ---- validation ----
namespace {

constexpr const char* kWorkLock = ".lock";         // a work folder's, held by its run
constexpr const char* kWorkLockNew = ".lock-new";  // the same before it is held

// The work folders that runs of this host interrupted while validating left in `parent`
// (prof-work-<host>-<pid>, each locked by its run while it lives: one whose lock can be taken is
// dead, in whatever PID namespace it ran; one a run of another host sharing the drive made is
// left alone): removed, as each would stay for good otherwise.
void remove_dead_work_folders(const fs::path& parent, const std::string& prefix) {
  std::error_code ec;
  std::vector<fs::path> dead;
  for (fs::directory_iterator it(parent, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string n = it->path().filename().string();
    long pid = 0;
    const char* digits = n.data() + std::min(prefix.size(), n.size());
    const auto [at, err] = std::from_chars(digits, n.data() + n.size(), pid);
    if (!n.starts_with(prefix) || err != std::errc() || at != n.data() + n.size() || pid <= 0)
      continue;
    const int lock = ::open((it->path() / kWorkLock).c_str(), O_RDWR | O_CLOEXEC);
    if (lock >= 0) {
      if (::flock(lock, LOCK_EX | LOCK_NB) == 0) dead.push_back(it->path());
      ::close(lock);
    } else if (::kill(pid_t(pid), 0) != 0 && errno == ESRCH) {  // (made, not yet locked: gone)
      dead.push_back(it->path());
    }
  }
  for (const fs::path& d : dead) fs::remove_all(d, ec);
}

}  // namespace

Validation validate(const Args& a, const std::vector<Candidate>& ranked,
                    const std::vector<ValidationPick>& picks, const ModelConfig& mcfg,
                    const std::string& nvme_dir, int world_size, bool talk, const Measurement& m,
                    const DeviceOptions& dopt, nlohmann::json& cands, nlohmann::json& j) {
  const DriveProbe& profile_drive = m.drive;
  Validation out;
  const std::size_t k = picks.size();
  const fs::path parent = nvme_dir.empty() ? fs::temp_directory_path() : fs::path(nvme_dir);
  const std::string prefix = fmt::format("prof-work-{}-", strata::this_host());
  remove_dead_work_folders(parent, prefix);
  const std::string work = (parent / fmt::format("{}{}", prefix, ::getpid())).string();
  fs::create_directories(work);
  struct Held {
    int fd;
    ~Held() {
      if (fd >= 0) ::close(fd);
    }
  } held{::open((fs::path(work) / kWorkLockNew).c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644)};
  // Locked before it takes its name: a lock file another run's scan could open unlocked (between
  // this open and the flock) would have this folder taken for a dead run's and removed.
  if (held.fd >= 0 && ::flock(held.fd, LOCK_EX) == 0)
    (void)::rename((fs::path(work) / kWorkLockNew).c_str(), (fs::path(work) / kWorkLock).c_str());
  const std::string data_file = a.data_files.empty() && a.text_file.empty()
                                    ? write_token_file(a, work, mcfg, world_size)
                                    : std::string();
  // The candidates may differ in micro-batch size: which is fastest is a matter of tokens a
  // second (what the search ranks by), not of step time (fastest_validated).
  Runs runs;
  runs.step_s.assign(k, 0.0);
  runs.tokens_per_s.assign(k, 0.0);
  runs.spread.assign(k, 0.0);
  runs.round_step_s.assign(k, {});
  runs.host_mem.profile_rate = m.machine.host_mem_bps;
  // The host's memory rate beside the runs, as the profile measured it (64 MiB memcpy's).
  constexpr std::size_t kCheckBytes = std::size_t(64) << 20;
  std::vector<char> check_dst(kCheckBytes), check_src(kCheckBytes, 2);
  // And the drive's, where the profile probed it and a pick keeps bytes on NVMe (with that one's
  // aio settings), in the work folder (under the NVMe folder).
  const auto on_drive = std::find_if(picks.begin(), picks.end(), [&](const ValidationPick& p) {
    return ranked[p.index].plan.nvme_bytes > 0;
  });
  const bool check_drive = profile_drive.bps > 0 && on_drive != picks.end();
  if (check_drive) runs.drive.profile_rate = profile_drive.bps;
  // And the device's kernels', where the profile timed them for it (ComputeProbe).
  const bool check_compute = m.compute.layer_s > 0;
  if (check_compute) runs.compute.profile_rate = 1 / m.compute.layer_s;
  auto check_machine = [&] {
    runs.host_mem.rate.push_back(host_copy_bps(check_dst.data(), check_src.data(), kCheckBytes));
    if (check_drive && runs.drive.failed.empty()) {
      try {
        runs.drive.rate.push_back(
            probe_drive(work, ranked[on_drive->index].config.aio, profile_drive));
      } catch (const Error& e) {  // (the runs say for themselves what the drive does to them)
        runs.drive.failed = e.user_message();
      }
    }
    if (check_compute && runs.compute.failed.empty()) {
      try {
        const double layer_s = probe_compute(a, dopt, mcfg, m.compute);
        if (layer_s > 0) runs.compute.rate.push_back(1 / layer_s);
      } catch (const Error& e) {  // (likewise)
        runs.compute.failed = e.user_message();
      }
    }
  };
  if (talk) print_validation_intro(a, picks);
  const std::string& trace = a.trace;
  bool trace_written = false;  // only by the recommended configuration's run, when it ran
  {
    // An older file of that name is not this run's trace (checked replaceable up front).
    std::error_code ec;
    if (talk && !trace.empty()) fs::remove(trace, ec);
  }
  // Every pick runs once a round (validation_order); its measured step is the median of all its
  // rounds' timed steps. A run that fails is a finding, not the end: that pick is not run again.
  std::vector<std::vector<double>> steps(k), round_steps(k);
  std::vector<std::string> errors(k);
  std::vector<LaneBusy> busy(k);
  const std::vector<std::size_t> order = validation_order(k, a.validate_rounds);
  const auto t0 = Clock::now();
  for (std::size_t at = 0; at < order.size(); ++at) {
    const std::size_t n = order[at];
    const std::size_t i = picks[n].index;
    if (at % k == 0) check_machine();  // a round begins
    if (errors[n].empty()) {
      // Every run's last step is traced, for its measured bottleneck: the recommended one's into
      // --trace, the others' (and with --trace "" that one's too) into the work folder. A later
      // round's trace replaces an earlier one's.
      const std::string trace_file =
          i == 0 && !trace.empty() ? trace
                                   : (fs::path(work) / fmt::format("trace{}.json", i)).string();
      Tracer::global().clear();
      try {
        // A test's way to have one rank's run fail while the others' go on.
        if (const char* r = std::getenv("STRATA_TEST_FAIL_VALIDATION_RANK");
            r && std::atoi(r) == launch_info().rank)
          STRATA_THROW(kIo, "--data {}: cannot be read (STRATA_TEST_FAIL_VALIDATION_RANK)",
                       data_file);
        const Measured mres = run_candidate(a, ranked[i], work, data_file, trace_file, int(i));
        const std::vector<Interval> sched = measured_schedule(Tracer::global().spans());
        busy[n] = lane_busy(sched);
        steps[n].insert(steps[n].end(), mres.steps.begin(), mres.steps.end());
        round_steps[n].push_back(mres.step_s);
        if (i == 0) {
          trace_written = !trace.empty() && fs::exists(trace);
          out.measured_sched = sched;
          out.have_trace = !sched.empty();
          out.measured_best_step = mres.steps.empty() ? 0 : mres.steps.back();
        }
      } catch (const Error& e) {
        // A configuration the planner passed and the run refused. Under several ranks the runs
        // must stay in step (each begins with a collective of every rank): one rank going on to
        // the next run while the others wait in this one's would leave the job hung, so the
        // failure ends it.
        if (world_size * a.tp.size > 1)
          throw Error(e.kind(),
                      fmt::format("validating #{} ({}) failed on this rank: {}; the job's ranks "
                                  "validate in step, so strata-prof stops here (one rank alone "
                                  "reports a failed run and goes on)",
                                  i + 1, ranked[i].label, e.message()),
                      e.call(), e.file(), e.line(), e.detail());
        errors[n] = e.user_message();
        ++runs.failed;
      }
      Tracer::global().clear();
    }
    if (talk && a.validate_rounds > 1 && (at + 1) % k == 0 && at + 1 < order.size())
      std::printf("  round %zu of %d done (%.1f s)\n", (at + 1) / k, a.validate_rounds, since(t0));
    std::fflush(stdout);
  }
  check_machine();
  if (talk) print_validation_columns();
  for (std::size_t n = 0; n < k; ++n) {
    const std::size_t i = picks[n].index;
    const Candidate& c = ranked[i];
    nlohmann::json& entry = entry_of(cands, i);
    entry["validated_as"] = picks[n].reason;
    const std::string predicted_bound = resource_name(c.prediction.bottleneck);
    if (!errors[n].empty()) {
      if (talk)
        std::printf("  %-4zu %12.1f %12s %8s %10s  %-18s %-19s  %s\n      FAILED: %s\n", i + 1,
                    c.prediction.step_s * 1e3, "-", "-", "-", (predicted_bound + " / -").c_str(),
                    picks[n].reason.c_str(), c.label.c_str(), errors[n].c_str());
      entry["validation_error"] = errors[n];
      for (const char* k2 :
           {"measured_step_s", "measured_tokens_per_s", "measured_steps_s", "measured_round_step_s",
            "prediction_error", "measured_bottleneck", "measured_busy_s"})
        entry[k2] = nullptr;
      continue;
    }
    const double step_s = median(steps[n]);
    runs.step_s[n] = step_s;
    runs.tokens_per_s[n] = measured_tokens_per_s(c, step_s);
    runs.spread[n] = step_spread(steps[n]);
    runs.round_step_s[n] = round_steps[n];
    const double err = (c.prediction.step_s - step_s) / step_s;
    runs.worst = std::max(runs.worst, std::abs(err));
    const std::string measured_bound = busy[n].busiest ? resource_name(*busy[n].busiest) : "-";
    if (talk)
      std::printf("  %-4zu %12.1f %12.1f %+7.1f%% %10.0f  %-18s %-19s  %s\n", i + 1,
                  c.prediction.step_s * 1e3, step_s * 1e3, err * 100, runs.tokens_per_s[n],
                  (predicted_bound + " / " + measured_bound).c_str(), picks[n].reason.c_str(),
                  c.label.c_str());
    entry["measured_step_s"] = step_s;
    entry["measured_tokens_per_s"] = runs.tokens_per_s[n];
    entry["measured_steps_s"] = steps[n];
    entry["measured_round_step_s"] = round_steps[n];
    entry["prediction_error"] = err;
    nlohmann::json busy_s;
    for (int r = 0; r < int(Resource::kCount); ++r)
      busy_s[resource_name(Resource(r))] = busy[n].busy_s[r];
    entry["measured_busy_s"] = busy[n].busiest ? busy_s : nlohmann::json(nullptr);
    entry["measured_bottleneck"] =
        busy[n].busiest ? nlohmann::json(measured_bound) : nlohmann::json(nullptr);
  }
  j["validate_rounds"] = a.validate_rounds;
  std::error_code ec;
  fs::remove_all(work, ec);
  out.exit_code = report_validation(a, ranked, picks, runs, trace_written, talk, j);
  return out;
}

}  // namespace strata::prof
