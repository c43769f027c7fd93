// What the user sees of a run: the plan alone (--plan), the header, the progress line of each
// step, the per-step JSON log (--log-json) and the summary table. Only rank 0 prints (Settings::con
// is null on the others) or writes the log.
#include <fcntl.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/write_fd.h"
#include "cpu/cpu_info.h"
#include "strata/error.h"
#include "strata/json_config.h"
#include "strata/log.h"
#include "strata/paths.h"
#include "trainer/train_job.h"

namespace strata::train_job {

namespace {

// The whole model's parameters (under tensor parallelism a rank's model holds its slices).
std::uint64_t whole_params(const ModelConfig& cfg) { return num_params(model_units(cfg)); }

std::string human_bytes(double b) { return log::human_bytes(b, 1); }

std::string hms(double s) {
  const auto t = std::int64_t(std::max(0.0, s) + 0.5);
  return t >= 3600 ? fmt::format("{}:{:02}:{:02}", t / 3600, t / 60 % 60, t % 60)
                   : fmt::format("{}:{:02}", t / 60, t % 60);
}

}  // namespace

// ---- the plan alone ----
// --plan: the memory plan of the job, printed, and no step run.
TrainResult report_plan(const Settings& s) {
  const TrainOptions& o = s.o;
  const EngineConfig& ecfg = s.ecfg;
  const ModelConfig& mcfg = s.mcfg;
  const int world = s.dp_world;  // ZeRO shards over the data-parallel ranks
  std::FILE* con = s.con;
  Engine::check_host_settings(ecfg);  // a plan that says "fits" must not be refused by the run
  auto dev = make_device(o.device, s.hopt, s.copt);
  PlanInputs in;
  for (const auto& u : s.units) in.units.push_back({u.name, u.numel});
  in.world_size = world;
  in.device_capacity = dev->stats().capacity_bytes;
  in.host_capacity = ecfg.host_budget_bytes;
  in.nvme_capacity = nvme_capacity(ecfg, s.rank, s.launch.local_size, world);
  in.ranks_on_node = s.launch.local_size;
  set_host_ram_inputs(in, *dev, s.launch.local_size);
  MemoryPlan plan = plan_memory(Engine::with_device_defaults(ecfg, *dev), in);
  // A plan made on the CPU-emulated device for a GPU job (a login node): the early optimizer step
  // is off here and on by default on a GPU, where its lines take more host memory.
  if (dev->kind() == DeviceKind::kCpu && !ecfg.overlap_optimizer.has_value()) {
    EngineConfig on_gpu = Engine::with_device_defaults(ecfg, *dev);
    on_gpu.overlap_optimizer = true;
    const MemoryPlan early = plan_memory(on_gpu, in);
    if (early.early_optimizer_step && early.host_bytes > plan.host_bytes)
      plan.notes.push_back(fmt::format(
          "planned for the CPU-emulated device, where the early optimizer step is off; on a GPU "
          "it is on where the host has room for its lines: {} more pinned host memory ({} in all; "
          "\"strata\": {{\"overlap_optimizer\": true}} plans them here)",
          human_bytes(double(early.host_bytes - plan.host_bytes)),
          human_bytes(double(early.host_bytes))));
  }
  // The training state only: what a micro-batch's activations take depends on the kernels
  // and is measured, not estimated (a "fits" here can still run out of device memory).
  plan.notes.push_back(
      fmt::format("activations are not in this plan: a micro-batch of {} x {} tokens needs device "
                  "memory beyond the device total above{}; strata-prof measures them{}",
                  ecfg.micro_batch_per_gpu, s.seq_len,
                  dev->kind() == DeviceKind::kCpu
                      ? fmt::format(" (on the CPU-emulated device, host RAM beyond the ram total "
                                    "too, up to its {} cap)",
                                    human_bytes(double(in.device_capacity)))
                      : std::string(),
                  o.checkpoint_activations || o.checkpoint_on_host
                      ? ""
                      : " (--checkpoint-activations keeps them small)"));
  if (!plan.fits && o.device_mem_gb > 0)
    plan.notes.push_back(fmt::format(
        "--device-mem-gb {:g} caps the device: a larger one is another way", o.device_mem_gb));
  // Under tensor parallelism the plan is one rank's: its slice of the model, sharded over the
  // data-parallel ranks.
  std::string params = fmt::format("{} parameters", s.total_numel),
              ranks = fmt::format("{} rank(s)", world);
  if (s.tp > 1) {
    std::uint64_t slice = 0;
    for (const auto& u : s.units) slice += u.numel;
    params += fmt::format(" ({} on this rank: its tensor-parallel slice)", slice);
    ranks = fmt::format("{} ranks (tensor-parallel {} x data-parallel {})", s.launch.world_size,
                        s.tp, world);
    if (s.launch.launcher == "none")
      plan.notes.push_back(fmt::format(
          "planned as rank 0 of a {}-rank launch (one tensor-parallel group, no data "
          "parallelism); to plan another, launch the plan as the job (e.g. mpirun -np N "
          "strata-train ... --plan)",
          s.tp));
  }
  if (con) {
    std::fprintf(con, "%s%s, %s, %zu units, %s, %s on %s\n%s", mcfg.model_type.c_str(),
                 s.demo_model ? " (demo)" : "", params.c_str(), s.units.size(), ranks.c_str(),
                 std::string(dtype_name(ecfg.compute_dtype)).c_str(), dev->name().c_str(),
                 plan.table().c_str());
  }
  TrainResult r;
  r.plan_fits = plan.fits;
  return r;
}

JsonLog::JsonLog(const std::string& p, int held) : path(p), stream(written_in_place(p)) {
  if (held >= 0 && !stream) {
    fd = ::fcntl(held, F_DUPFD_CLOEXEC, 0);
    if (fd >= 0 && (::ftruncate(fd, 0) != 0 || ::lseek(fd, 0, SEEK_SET) != 0)) {
      const int err = errno;
      ::close(fd);
      fd = -1;
      errno = err;
    }
  } else {
    fd = open_output(path);
  }
  if (fd < 0) STRATA_THROW(kIo, "--log-json {} cannot be written: {}", path, std::strerror(errno));
}

JsonLog::~JsonLog() {
  if (fd >= 0) ::close(fd);
}

int JsonLog::append(const std::string& line) {
  const std::string text = line + "\n";
  if (stream) std::fflush(nullptr);  // the console's lines before it, in the order they came
  const int err = stream ? write_holding_sigpipe(fd, text.data(), text.size())
                         : write_fd_fully(fd, text.data(), text.size());
  if (err == 0)
    whole += text.size();
  else if (!stream)  // no torn line at the end (a JSON reader refuses it): its whole lines
    (void)!::ftruncate(fd, off_t(whole));
  return err;
}

// --log-json opened: a resumed run keeps the log's lines up to the checkpoint's step.
void open_json_log(Run& r) {
  const TrainOptions& o = r.s.o;
  if (r.s.rank != 0 || o.log_json.empty()) return;
  // Resumed: keep the log's lines up to the checkpoint's step and continue after them. (A stream,
  // as /dev/stdout, has none to read back: reading a terminal would wait for its keyboard.)
  std::string kept;
  if (r.start_step > 0 && !written_in_place(o.log_json)) {
    std::ifstream old(o.log_json);
    std::string line;
    bool has_start = false, has_earlier = false;
    std::int64_t last = 0;  // the newest step kept
    while (std::getline(old, line)) {
      try {
        const std::int64_t at =
            config::parse(line, o.log_json, true).value("step", std::int64_t(0));
        if (at <= r.start_step) {
          kept += line + "\n";
          last = std::max(last, at);
        }
        has_start = has_start || at == r.start_step;
        has_earlier = has_earlier || at < r.start_step;
      } catch (const std::exception&) {
        break;  // a torn last line of the killed run
      }
    }
    // The run's own log, which it died before writing the checkpoint's line to: the checkpoint
    // has the line. (A new log of the resumed run starts after the checkpoint, as ever.)
    const nlohmann::json t = r.s.resume.manifest.value("trainer", nlohmann::json::object());
    const bool from_checkpoint =
        has_earlier && !has_start && t.contains("log_line") && t["log_line"].is_object();
    if (from_checkpoint) kept += t["log_line"].dump() + "\n";
    // A log that stopped before the checkpoint (its drive was full then): the steps between are
    // not in it, and the resumed run's lines follow on from the checkpoint.
    const std::int64_t missing_to = from_checkpoint ? r.start_step - 1 : r.start_step;
    if (last > 0 && last < missing_to)
      log::warn(
          "--log-json {}: its lines end at step {}, and the run resumes after step {}: steps {} "
          "to {} are not in the log (it stopped there)",
          o.log_json, last, r.start_step, last + 1, missing_to);
  }
  r.jlog = std::make_unique<JsonLog>(o.log_json, r.s.held_log ? r.s.held_log->fd : -1);
  // Now: a run that dies before its first line keeps them. Line by line, so that a full drive
  // leaves whole lines only.
  std::istringstream lines(kept);
  for (std::string line; std::getline(lines, line);)
    if (const int err = r.jlog->append(line); err != 0) {
      // a full drive: as a step's line that cannot be written, the run goes on
      r.jlog.reset();
      log::warn(
          "--log-json {}: the lines up to the resumed step {} could not be written ({}); the "
          "log stops here, the run goes on",
          o.log_json, r.start_step, std::strerror(err));
      break;
    }
  // --plot draws the resumed run's steps too: the lines kept are its steps up to the checkpoint.
  if (!o.plot_file.empty()) {
    std::istringstream lines(kept);
    for (std::string line; std::getline(lines, line);) {
      try {
        r.plot_steps.push_back(run_record_from_json(config::parse(line, o.log_json, true)));
      } catch (const std::exception&) {  // a line that is no step's: not the picture's
      }
    }
  }
}

namespace {

std::string plot_title(const Run& r) {
  const Settings& s = r.s;
  return fmt::format("strata-train: {}{}, {:.2f}M parameters, {} rank(s), {} steps",
                     s.mcfg.model_type, s.demo_model ? " (embedded demo)" : "",
                     double(whole_params(s.mcfg)) / 1e6, s.world, s.steps);
}

// The picture redrawn; a file that cannot be written ends the picture, not the run.
void draw_plot(Run& r) {
  try {
    const auto t0 = Clock::now();
    write_run_plot(r.s.o.plot_file, run_plot_svg(r.plot_steps, plot_title(r)));
    r.plot_drawn_at = Clock::now();
    r.plot_draw_s = since(t0);
  } catch (const Error& e) {
    log::warn("--plot: {}; the picture stops here, the run goes on", e.user_message());
    r.plotting = false;
  }
}

}  // namespace

// --plot: rank 0 draws the picture now (the resumed steps, or none yet) and after every step.
void open_plot(Run& r) {
  if (r.s.rank != 0 || r.s.o.plot_file.empty()) return;
  r.plotting = true;
  draw_plot(r);
}

void plot_step(Run& r, const nlohmann::json& line) {
  if (!r.plotting) return;
  RunRecord rec = run_record_from_json(line);
  // A step again (the resumed run's kept lines end at its checkpoint): the new one replaces it.
  while (!r.plot_steps.empty() && r.plot_steps.back().step >= rec.step) r.plot_steps.pop_back();
  r.plot_steps.push_back(rec);
  // A drawing (and the file's write) costs milliseconds: the next waits until 20 times that has
  // passed since it, so the picture takes at most 5% of the run however quick its steps (one
  // only over 10 ms waited: 3 ms drawings after 4 ms steps took half a run). The last step is
  // always drawn.
  if (rec.step < r.s.steps && since(r.plot_drawn_at) < 20 * r.plot_draw_s) return;
  draw_plot(r);
}

// The run's header: the model, the device, where each piece of state is placed, the batch and the
// data.
void print_header(Run& r) {
  const Settings& s = r.s;
  const TrainOptions& o = s.o;
  const EngineConfig& ecfg = s.ecfg;
  const ModelConfig& mcfg = s.mcfg;
  const std::int64_t B = s.B, accum = s.accum, seq_len = s.seq_len;
  const int world = s.world;
  std::FILE* con = s.con;
  // Under an MPI launcher stdout is a pseudo-terminal the launcher forwards, wherever its own
  // output goes (a file got "\r\x1b[K" for every step): plain lines there.
  r.tty = con && ::isatty(::fileno(con)) && !s.launch.under_mpi;
  r.print_every = std::max<std::int64_t>(1, s.steps / 20);
  r.tokens_per_step = double(B * seq_len * accum * s.dp_world);
  if (!con) return;
  std::string on = r.dev->name();  // the emulated device's name says its cap already
  if (on.find("(cap ") == std::string::npos)
    on += " (cap " + human_bytes(double(r.dev->stats().capacity_bytes)) + ")";
  std::fprintf(con, "strata-train: %s%s, %.2fM parameters, %s, %d rank(s) on %s\n",
               mcfg.model_type.c_str(), s.demo_model ? " (embedded demo)" : "",
               double(whole_params(mcfg)) / 1e6,
               std::string(dtype_name(ecfg.compute_dtype)).c_str(), world, on.c_str());
  // Where the job stands, from rank 0 alone: "rank 0 of 8 (2 nodes), backend nccl, launcher
  // torchrun, rendezvous node01:29500".
  if (world > 1) {
    const LaunchInfo& li = s.launch;
    std::fprintf(con, "rank %d of %d (%d node%s), backend %s, launcher %s%s\n", li.rank, world,
                 li.num_nodes, li.num_nodes == 1 ? "" : "s", comm_backend_name(r.comm->backend()),
                 li.launcher.c_str(),
                 li.master_addr.empty()
                     ? ""
                     : fmt::format(", rendezvous {}:{}", li.master_addr, li.master_port).c_str());
    if (s.tp > 1)
      std::fprintf(con,
                   "tensor parallel %d x data parallel %d: each layer's matrices split over %d "
                   "ranks of a node, ZeRO-3 over each data-parallel group of %d ranks\n",
                   s.tp, s.dp_world, s.tp, s.dp_world);
  }
  // "device", "host", "nvme", or the split ("device 70% + host 30%"; it said "nvme" for any split).
  const auto where = [](const Placement& p) {
    std::vector<std::string> parts;
    const std::pair<const char*, double> tiers[] = {
        {"device", p.device_fraction}, {"host", p.host_fraction}, {"nvme", p.nvme_fraction()}};
    for (const auto& [name, f] : tiers)
      if (f > 1e-9)
        parts.push_back(f >= 1 - 1e-9 ? std::string(name)
                                      : fmt::format("{} {:.0f}%", name, f * 100));
    return fmt::format("{}", fmt::join(parts, " + "));
  };
  // The split as placed: units are placed whole (by where their first byte falls), so a
  // fraction is met only as nearly as the units allow — the plan's bytes say how nearly.
  const auto placed = [&](const char* prefix, const Placement& asked) {
    double bytes[3] = {}, total = 0;
    for (const PlanLine& l : r.engine->plan().lines)
      if (l.what.starts_with(prefix))
        bytes[int(l.tier)] += double(l.bytes), total += double(l.bytes);
    if (total <= 0) {
      // Every unit small enough to stay gathered on the device
      // (stage3_param_persistence_threshold): no weight shard goes where the config asks, whatever
      // it says.
      if (std::string_view(prefix) == "compute weights (" && where(asked) != "device")
        for (const PlanLine& l : r.engine->plan().lines)
          if (l.what.starts_with("persistent units") && l.bytes > 0)
            return fmt::format(
                "device ({} asked; every unit is within "
                "stage3_param_persistence_threshold and stays gathered)",
                where(asked));
      return where(asked);
    }
    const Placement got{bytes[0] / total, bytes[1] / total};
    std::string said = where(got);
    if (std::abs(got.device_fraction - asked.device_fraction) > 0.005 ||
        std::abs(got.host_fraction - asked.host_fraction) > 0.005)
      said += fmt::format(" ({} asked; units are placed whole)", where(asked));
    return said;
  };
  const std::string clip =
      ecfg.gradient_clipping <= 0 ? std::string()
      : s.clip_defaulted
          ? "; gradient norm clipped at 1.0 (the Hugging Face Trainer's max_grad_norm when "
            "fine-tuning a --model; --max-grad-norm sets another, 0 none)"
          : fmt::format("; gradient norm clipped at {}", ecfg.gradient_clipping);
  const std::string decay =
      ecfg.adamw.weight_decay <= 0 ? std::string()
      : ecfg.decay_exempt_norms_and_biases
          ? fmt::format("; weight decay {}, not on norms and biases", ecfg.adamw.weight_decay)
          : fmt::format(
                "; weight decay {} on every parameter (strata.weight_decay_exempt \"none\")",
                ecfg.adamw.weight_decay);
  std::fprintf(con,
               "  stage %d; weights on %s, optimizer on %s, gradients on %s; batch %lld x %lld "
               "tokens x %lld accum x %d %sranks%s%s\n",
               ecfg.stage, placed("compute weights (", ecfg.params).c_str(),
               placed("optimizer state (", ecfg.optimizer).c_str(),
               placed("gradient shard", ecfg.grads).c_str(), (long long)B, (long long)seq_len,
               (long long)accum, s.dp_world, s.tp > 1 ? "data-parallel " : "", clip.c_str(),
               decay.c_str());
  std::string data =
      r.s.text_file.empty() ? fmt::format("{}", fmt::join(o.data_files, ", ")) : r.s.text_file;
  if (s.demo_data) data += " (the demo's generated text: no --data or --text given)";
  if (!s.demo_dir.empty()) std::fprintf(con, "  NVMe folder: %s\n", s.demo_dir.c_str());
  std::fprintf(con, "  data: %s\n", data.c_str());
  if (s.epochs > 0)
    std::fprintf(
        con, "  %s\n",
        fmt::format("--epochs {:g}: {} steps (an epoch: {} sequences of {} tokens, {} "
                    "steps of {})",
                    s.epochs, s.steps, s.epoch_rows, seq_len, s.steps_per_epoch, B * accum * world)
            .c_str());
  std::fflush(con);
}

namespace {
// A rate in three figures or more: 1407, 36.2, 1.26 (a billion-parameter model's "1 tok/s").
std::string rate(double x) {
  return fmt::format(fmt::runtime(x >= 100 ? "{:.0f}" : x >= 10 ? "{:.1f}" : "{:.2f}"), x);
}
}  // namespace

// The step's progress line: on a terminal one line rewritten, kept every --steps/20 steps.
void print_progress(Run& r, const StepRecord& rec, double val_loss, const EngineStats& st) {
  const std::int64_t step = rec.step, steps = r.s.steps;
  const EngineStats& prev = r.prev;
  std::FILE* con = r.s.con;
  const double gbps = 1e-9 / rec.step_s;
  const double elapsed = since(r.loop_start);
  const std::string line = fmt::format(
      "step {}/{}{}  loss {:.4f}{}  {} tok/s  {:.2f} s/step  h2d {:.2f} d2h {:.2f} nvme r "
      "{:.2f} "
      "w {:.2f} GB/s  ETA {}",
      step, steps,
      r.s.epochs > 0 ? fmt::format(" (epoch {:.2f}/{:g})",
                                   double(step) / double(r.s.steps_per_epoch), r.s.epochs)
                     : std::string(),
      rec.loss,
      std::isnan(val_loss) ? std::string()
                           : fmt::format(" (val {:.4f}, ppl {:.2f})", val_loss, std::exp(val_loss)),
      rate(rec.tokens_per_s), rec.step_s, double(st.h2d_bytes - prev.h2d_bytes) * gbps,
      double(st.d2h_bytes - prev.d2h_bytes) * gbps,
      double(st.nvme_read_bytes - prev.nvme_read_bytes) * gbps,
      double(st.nvme_written_bytes - prev.nvme_written_bytes) * gbps,
      hms(elapsed / double(step - r.start_step) * double(steps - step)));
  const bool keep = step == 1 || step == steps || step % r.print_every == 0 ||
                    !std::isnan(val_loss) || !r.sample.empty();
  if (r.tty)
    std::fprintf(con, "\r\x1b[K%s%s", line.c_str(), keep ? "\n" : "");
  else if (keep)
    std::fprintf(con, "%s\n", line.c_str());
  if (!r.sample.empty()) std::fprintf(con, "  sample: %s\n", r.sample.c_str());
  std::fflush(con);
}

// The summary: the steps run, the time of each phase, what moved between the tiers and their peaks.
void print_summary(Run& r) {
  const Settings& job = r.s;
  const TrainOptions& o = job.o;
  const std::int64_t steps = job.steps, start_step = r.start_step;
  std::FILE* con = job.con;
  if (!con) return;
  const EngineStats& s = r.result.stats;
  const double total = since(job.t_start);
  // A resumed run says which steps it ran (it said "9 steps" for steps 7-9).
  const std::string ran =
      start_step >= steps ? fmt::format("resumed at step {}: no step left", start_step)
      : start_step > 0 && start_step + 1 == steps
          ? fmt::format("step {} of {}, resumed", steps, steps)
      : start_step > 0 ? fmt::format("steps {}-{} of {}, resumed", start_step + 1, steps, steps)
                       : fmt::format("{} step{}", steps, steps == 1 ? "" : "s");
  // No step run (resumed at the last step): the checkpoint's loss, when its log line is there.
  std::string final_loss;
  if (!r.result.steps.empty()) {
    final_loss = fmt::format(", final loss {:.4f}", r.result.steps.back().loss);
  } else if (const nlohmann::json line =
                 job.resume.manifest.value("trainer", nlohmann::json::object())
                     .value("log_line", nlohmann::json::object());
             line.contains("loss") && line["loss"].is_number()) {
    final_loss = fmt::format(", loss {:.4f} at the checkpoint", line["loss"].get<double>());
  }
  const double loop_s = since(r.loop_start);
  std::fprintf(con, "\nsummary (%s, %.1f s, %s tokens/s, %s counted in the loss%s)\n", ran.c_str(),
               total, rate(r.tokens_per_step * double(steps - start_step) / loop_s).c_str(),
               rate(r.counted_tokens / loop_s).c_str(), final_loss.c_str());
  std::fprintf(con, "  %-12s %9s\n", "phase", "seconds");
  std::vector<std::pair<const char*, double>> rows = {
      {"data", r.ph.data},           {"forward", r.ph.forward}, {"backward", r.ph.backward},
      {"optimizer", r.ph.optimizer}, {"eval", r.ph.eval},       {"save", r.ph.save}};
  if (o.sample_every > 0) rows.emplace_back("sample", r.ph.sample);
  for (const auto& [n, v] : rows) std::fprintf(con, "  %-12s %9.2f\n", n, v);
  std::fprintf(con, "  %-8s %-22s %-22s\n", "tier", "moved", "peak / capacity");
  std::fprintf(con, "  %-8s %-22s %-22s\n", "device",
               fmt::format("in {} out {}", human_bytes(double(s.h2d_bytes)),
                           human_bytes(double(s.d2h_bytes)))
                   .c_str(),
               fmt::format("{} / {}", human_bytes(double(s.device_peak_bytes)),
                           human_bytes(double(s.device_capacity)))
                   .c_str());
  std::fprintf(con, "  %-8s %-22s %-22s\n", "host", "(staging of the above)",
               fmt::format("{} / {}", human_bytes(double(s.host_pinned_peak_bytes)),
                           human_bytes(double(s.host_budget_bytes)))
                   .c_str());
  std::fprintf(con, "  %-8s %-22s %-22s\n", "nvme",
               fmt::format("read {} written {}", human_bytes(double(s.nvme_read_bytes)),
                           human_bytes(double(s.nvme_written_bytes)))
                   .c_str(),
               fmt::format("{} held", human_bytes(double(s.nvme_bytes))).c_str());
  // The process's resident memory at its peak, beside what the plan counted for it (the training
  // state's: what is past it is said).
  const std::uint64_t rss_peak = cpu::process_peak_rss_bytes(),
                      ram_planned = r.engine->plan().ram_bytes;
  std::fprintf(con, "  %-8s %-22s %-22s\n", "ram", "(the process, peak)",
               fmt::format("{} / {} planned", human_bytes(double(rss_peak)),
                           human_bytes(double(ram_planned)))
                   .c_str());
  if (rss_peak > ram_planned)
    std::fprintf(con,
                 "  ram past the plan by %s: the plan counts the training state; the kernels' "
                 "working memory%s not in it\n",
                 human_bytes(double(rss_peak - ram_planned)).c_str(),
                 r.dev->kind() == DeviceKind::kCpu
                     ? " and the activations (on the CPU-emulated device, in host RAM) are"
                     : " is");
  if (s.early_units_kept + s.early_units_redone > 0)
    std::fprintf(
        con,
        "  early optimizer step: %llu unit updates kept (%llu finished under the next forward), "
        "%llu redone (clipping, overflow, lr), %llu steps without it (backing off after redone "
        "ones)\n",
        (unsigned long long)s.early_units_kept, (unsigned long long)s.early_units_finished_behind,
        (unsigned long long)s.early_units_redone, (unsigned long long)s.early_steps_skipped);
  if (s.device_alloc_waits > 0)  // (what is on already is not offered: the demo checkpoints)
    std::fprintf(
        con,
        "  device memory full: %llu allocations waited for frees still queued on streams (%llu per "
        "step); a smaller micro-batch%s or, where weights are gathered on use, a smaller "
        "stage3_max_live_parameters avoids the stalls%s\n",
        (unsigned long long)s.device_alloc_waits,
        (unsigned long long)(s.device_alloc_waits /
                             std::uint64_t(std::max<std::int64_t>(1, steps - start_step))),
        r.mopt.checkpoint ? "" : ", activation checkpointing (--checkpoint-activations)",
        job.demo_model ? " (expected in the demo: its cap is below its weights)" : "");
  if (!o.out_dir.empty()) std::fprintf(con, "model written to %s\n", o.out_dir.c_str());
  if (!r.checkpoints.empty())
    std::fprintf(con, "checkpoints in %s (newest: %s)\n", job.ckpt_root.c_str(),
                 r.checkpoints.back().c_str());
  std::fflush(con);
}

}  // namespace strata::train_job
