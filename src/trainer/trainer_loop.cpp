// The step loop: micro-batches through forward and backward, the optimizer step, evaluation,
// the checkpoints and the log line of each step, and the model written at the end. Every rank
// runs each step's collectives (the engine's, the loss all-reduce, a checkpoint's gathers) in
// the same order; only rank 0 prints or writes the log.
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <numbers>

#include "core/utf8.h"
#include "strata/error.h"
#include "strata/generate.h"
#include "strata/log.h"
#include "strata/model_io.h"
#include "strata/paths.h"
#include "strata/trace.h"
#include "trainer/train_job.h"

namespace strata {

namespace fs = std::filesystem;

double lr_at(std::int64_t t, double lr, std::int64_t warmup, std::int64_t total,
             const std::string& schedule, double min_lr) {
  STRATA_REQUIRE(schedule == "const" || schedule == "cosine" || schedule == "linear",
                 "--lr-schedule '{}': use const, cosine or linear", schedule);
  // (The peak is the optimizer's fp32: a --min-lr equal to --lr is a hair above it.)
  STRATA_REQUIRE(min_lr >= 0 && min_lr <= lr * (1 + 1e-6),
                 "--min-lr {:g} must be from 0 to the peak lr {:g}", min_lr, lr);
  if (warmup > 0 && t <= warmup) return lr * double(t) / double(warmup);
  if (schedule == "const") return lr;
  const double span = double(std::max<std::int64_t>(1, total - warmup));
  const double progress = std::min(1.0, double(t - warmup) / span);
  const double factor =
      schedule == "cosine" ? 0.5 * (1.0 + std::cos(std::numbers::pi * progress)) : 1.0 - progress;
  return min_lr + (lr - min_lr) * factor;
}

double step_loss_denominator(std::int64_t counted, std::int64_t accum, int world,
                             std::int64_t step) {
  STRATA_REQUIRE(accum > 0 && world > 0, "step_loss_denominator: accum {} and world {} must be > 0",
                 accum, world);
  if (counted <= 0)
    STRATA_THROW(kInvalidArgument,
                 "step {}: every target of its {} micro-batch{} (on {} rank{}) is masked "
                 "(kIgnoreTarget), so the step's loss has no token to average over: the data "
                 "masks whole batches (a conversation with no assistant tokens, or a prompt "
                 "longer than --seq-len); drop those rows or raise --seq-len",
                 step, accum * world, accum * world == 1 ? "" : "es", world, world == 1 ? "" : "s");
  return double(counted) / double(accum * world);
}

namespace train_job {

// The mean of `v` over the ranks (every rank calls it).
double mean_over_ranks(double v, Communicator& comm, Device& dev, Stream& s) {
  if (comm.world_size() == 1) return v;
  Buffer b = dev.alloc(8, &s);
  s.copy(b.ref(), host_ref(&v, 8));
  comm.all_reduce(TensorRef{b.ref(), DType::kF64, 1}, ReduceOp::kSum, s);
  s.copy(host_ref(&v, 8), b.ref());
  s.synchronize();
  return v / comm.world_size();
}

void prepare_checkpoints(Run& r) {
  const Settings& s = r.s;
  const TrainOptions& o = s.o;
  const int rank = s.rank, world = s.world;
  // The name of the temporary checkpoint folders: rank 0's pid, the same on every rank.
  r.tmp_tag = std::to_string(::getpid());
  if (o.save_every > 0 && world > 1) {
    double pid = rank == 0 ? double(::getpid()) : 0.0;
    pid = mean_over_ranks(pid, *r.comm, *r.dev, *r.compute) * world;
    r.tmp_tag = std::to_string(std::int64_t(std::llround(pid)));
  }
  r.saved_steps = s.inherited_checkpoints;
}

namespace {

// Steps that go nowhere several in a row: a loss that is not finite, or (without fp16's loss
// scaling, whose skips are its business) a gradient norm that is not finite. The weights (or the
// activations they make) overflowed, every step since was skipped, and the run would go on to
// its end and write those weights to --out and its checkpoints. Every rank holds the same loss
// (averaged over the ranks) and the same skip, so every rank stops at the same step. Before the
// step's checkpoint: none of that state is saved.
constexpr std::int64_t kNonfiniteStepsToStop = 3;

void stop_if_the_steps_stay_nonfinite(Run& r, std::int64_t step, double loss, bool skipped,
                                      double lr) {
  if (std::isfinite(loss) && (!skipped || r.s.ecfg.fp16.enabled)) {
    r.nonfinite_steps = 0;
    return;
  }
  if (r.nonfinite_steps++ == 0) r.first_nonfinite_step = step;
  if (r.nonfinite_steps < kNonfiniteStepsToStop) return;
  // The first bad step ran on the weights of the step before it, whose update made them: a
  // checkpoint of that step holds them already. The newest one before it is the one to resume
  // (pruning waits while steps go nowhere).
  const std::int64_t before = r.first_nonfinite_step - 2;
  std::int64_t good = -1;
  for (std::int64_t saved : r.saved_steps)
    if (saved <= before) good = std::max(good, saved);
  const std::string ck =
      good >= 0 ? (fs::path(r.s.ckpt_root) / fmt::format("step-{}", good)).string() : "";
  STRATA_THROW(kInvalidArgument,
               "step {}: the {} was not finite for {} steps in a row (from step {}): the model's "
               "weights or activations overflowed, and every step since was skipped; lower the "
               "learning rate (now {:g}) or its schedule's peak, or look at the data, then {}{}",
               step, std::isfinite(loss) ? "gradient norm" : "loss", r.nonfinite_steps,
               r.first_nonfinite_step, lr,
               ck.empty() ? fmt::format("run again (no checkpoint of this run from before step {}, "
                                        "whose update overflowed them, is left)",
                                        r.first_nonfinite_step - 1)
                          : fmt::format("resume from {} (--resume {}): a checkpoint of step {} or "
                                        "later holds the overflowed weights",
                                        ck, ck, r.first_nonfinite_step - 1),
               r.s.o.out_dir.empty() ? "" : "; nothing was written to --out");
}

// An I/O error's message with its errno text (Error::detail), which the message alone leaves out.
std::string with_errno(const Error& e) {
  return e.detail().empty() || e.message().find(e.detail()) != std::string::npos
             ? e.message()
             : fmt::format("{} ({})", e.message(), e.detail());
}

// What lets `folder` take a write that failed with `e`: space on a full drive, permission where
// it may not be written (read-only, another owner), else either.
std::string write_fix(const Error& e, const std::string& folder, bool shards) {
  const std::string said = e.message() + " " + e.detail();
  const auto says = [&](int err) { return said.find(std::strerror(err)) != std::string::npos; };
  // (A file past the process's limit or the file system's largest: free space does not help.)
  if (says(EFBIG))
    return fmt::format(
        "raise the process's file-size limit (ulimit -f) or write {} to a file system that holds "
        "larger files{}",
        folder, shards ? ", or cut the model into smaller shards (--max-shard-mb N)" : "");
  if (says(ENOSPC) || says(EDQUOT)) return fmt::format("free space in {}", folder);
  if (says(EACCES) || says(EPERM) || says(EROFS)) return fmt::format("make {} writable", folder);
  return fmt::format("free space in {} or make it writable", folder);
}

// The data files as absolute paths, links resolved: a resume from another folder compares them
// as the same files.
std::vector<std::string> absolute_paths(const std::vector<std::string>& files) {
  std::vector<std::string> out;
  for (const auto& f : files) out.push_back(canonical_path(f));
  return out;
}

// `log_line`: the step's --log-json line, so that a resume from this checkpoint can write it
// when the run died before it did.
nlohmann::json trainer_state(const Run& r, std::int64_t step, const nlohmann::json& log_line) {
  const Settings& s = r.s;
  const TrainOptions& o = s.o;
  const std::int64_t B = s.B, accum = s.accum, seq_len = s.seq_len;
  const ModelConfig& mcfg = s.mcfg;
  const int world = s.world;
  const DataOptions& dopt = r.s.dopt;
  return nlohmann::json{
      {"step", step},
      {"log_line", log_line},
      {"model_config_hash", r.model_hash},
      // The model's config.json, so that a checkpoint alone can be exported (strata-export).
      {"model_config", nlohmann::json::parse(model_config_json(mcfg))},
      // The Hugging Face folder the run started from ("" for none): strata-export copies its
      // tokenizer files beside the weights.
      {"model_dir", s.o.model_dir.empty() ? std::string() : fs::absolute(s.o.model_dir).string()},
      // Where it writes the model ("" for nowhere): a resumed run may take back what it wrote.
      {"out_dir", s.o.out_dir.empty() ? std::string() : canonical_path(s.o.out_dir)},
      {"model", r.model_desc},
      {"world_size", world},
      {"tensor_parallel", s.tp},
      {"data",
       {{"train_batches", r.train_batches},
        {"epoch", r.loader->epoch()},
        {"epochs", s.epochs},
        {"steps_per_epoch", s.steps_per_epoch},
        {"micro_batch", B},
        {"seq_len", seq_len},
        {"grad_accum", accum},
        {"seed", o.seed},
        {"shuffle", o.shuffle},
        {"files", absolute_paths(dopt.files)},
        {"file_bytes", r.data_identity.bytes},
        {"file_samples", r.data_identity.samples},
        {"val_fraction", dopt.val_fraction}}},
      // The only randomness after initialisation is the loaders' shuffle, seeded by `seed`
      // per epoch: the position above restores it.
      {"rng", {{"init_seed", o.seed}, {"shuffle_seed", o.seed}}},
      {"lr_schedule", s.lr_schedule_record(step + 1)},
      {"optimizer", r.optimizer_state},
      {"loss_scale", r.engine->loss_scale()}};
}

// The step's checkpoint, with its log line.
void save_checkpoint(Run& r, std::int64_t step, const nlohmann::json& log_line) {
  const Settings& s = r.s;
  const std::string& ckpt_root = s.ckpt_root;
  std::string dir;
  try {
    const WrittenCheckpoint w = write_checkpoint(*r.engine, *r.comm, *r.compute, ckpt_root, step,
                                                 r.tmp_tag, trainer_state(r, step, log_line));
    dir = w.dir;
    r.checkpoint_writer = w.writer;
    if (w.file_systems > 1 && w.file_systems != r.checkpoint_file_systems && s.con) {
      std::fprintf(s.con,
                   "checkpoints: %s is node-local (%d folders, each node's holding its own "
                   "ranks' files); resume with every rank on the node that wrote its files\n",
                   ckpt_root.c_str(), w.file_systems);
      std::fflush(s.con);
    }
    r.checkpoint_file_systems = w.file_systems;
  } catch (const Error& e) {
    // A file or folder that could not be written (a full drive, a folder made read-only): say
    // what is left and what to do (write_checkpoint removed the half-written folder). Other
    // errors pass as they are.
    // Another rank's failure (its drive, its folder) is mended there, not in this rank's folder.
    if (e.kind() != ErrorKind::kIo) throw;
    const auto* peer = dynamic_cast<const PeerCheckpointError*>(&e);
    const std::string newest = !r.checkpoints.empty() ? r.checkpoints.back() : s.resume.dir;
    STRATA_THROW(kIo,
                 "{}; the checkpoint of step {} was not written and nothing of it is left; {}; "
                 "{}, then run the same command{}",
                 with_errno(e), step,
                 newest.empty() ? std::string("no checkpoint of this run is complete")
                                : fmt::format("the newest complete one is {}", newest),
                 peer ? fmt::format("mend what rank {} says", peer->peer)
                      : write_fix(e, ckpt_root, false) + " (or give another --checkpoint-dir)",
                 newest.empty() ? std::string(" again (there is nothing to --resume from)")
                                : fmt::format(" with --resume {}", newest));
  }
  r.checkpoints.push_back(dir);
  r.saved_steps.push_back(step);
  if (s.rank == 0 && r.s.o.interrupt_notes)  // what Ctrl-C (or a scheduler's SIGTERM) says now
    set_interrupt_note(
        fmt::format("\nstrata-train: interrupted; the newest checkpoint is {} (step {}): continue "
                    "with the same command and --resume {}\n",
                    dir, step, ckpt_root));
}

// Older complete checkpoints of the run beyond the newest keep_checkpoints: after the step's
// log line (a removal of ~100 MiB takes a while, and the line must not wait behind it).
void prune_checkpoints(Run& r) {
  const TrainOptions& o = r.s.o;
  std::vector<std::int64_t>& saved_steps = r.saved_steps;
  const std::string& ckpt_root = r.s.ckpt_root;
  // Not while steps go nowhere: the checkpoints from before the weights overflowed are the ones a
  // stop names.
  if (!r.checkpoint_writer || o.keep_checkpoints == 0 || r.nonfinite_steps > 0) return;
  while (saved_steps.size() > std::size_t(o.keep_checkpoints)) {
    // Renamed first, then removed: a run killed during the removal leaves a step-<N>.pruned-<tag>
    // that the next save removes (removed in place, it left a half-empty step-<N> for good).
    std::error_code ec;
    const fs::path step = fs::path(ckpt_root) / fmt::format("step-{}", saved_steps.front());
    const fs::path gone =
        fs::path(ckpt_root) / fmt::format("step-{}.pruned-{}", saved_steps.front(), r.tmp_tag);
    fs::rename(step, gone, ec);
    fs::remove_all(ec ? step : gone, ec);
    saved_steps.erase(saved_steps.begin());
  }
}

struct StepLoss {
  double loss_sum = 0;       // this rank's micro-batches' forward() values, summed
  std::int64_t counted = 0;  // the step's counted targets, every rank's micro-batches
};

// The step's micro-batches through forward and backward: the sum of their losses (each the sum of
// its counted targets' losses over step_loss_denominator) and the step's counted targets over every
// rank. Each rank takes every world-th batch of the stream; every rank reads them all, so each
// knows the step's counted targets before its first forward, without a collective.
StepLoss forward_backward(Run& run, std::int64_t step) {
  const Settings& s = run.s;
  const TrainOptions& o = s.o;
  const std::int64_t B = s.B, accum = s.accum, seq_len = s.seq_len;
  // The data-parallel ranks take turns; a TP group's ranks run the same batches.
  const int rank = s.dp_rank, world = s.dp_world;
  TokenLoader& loader = *run.loader;
  std::int64_t& train_batches = run.train_batches;
  Phases& ph = run.ph;
  Model& model = *run.model;
  EngineWeights& weights = *run.weights;
  Stream* compute = run.compute.get();
  const Engine& engine = *run.engine;
  const ModelOptions& mopt = run.mopt;
  const bool demo_capped = run.demo_capped;
  const Device* dev = run.dev.get();
  StepLoss out;
  std::vector<Batch> mine(static_cast<std::size_t>(accum));
  {
    const auto t0 = Clock::now();
    for (std::int64_t a = 0; a < accum; ++a)
      for (int r = 0; r < world; ++r) {
        Batch b = loader.next();
        ++train_batches;
        out.counted += counted_targets(b);
        if (r == rank) mine[std::size_t(a)] = std::move(b);
      }
    ph.data += since(t0);
  }
  const double den = step_loss_denominator(out.counted, accum, world, step);
  for (std::int64_t a = 0; a < accum; ++a) {
    const Batch& batch = mine[std::size_t(a)];
    try {
      auto t0 = Clock::now();
      out.loss_sum += double(model.forward(batch, weights, /*grad=*/true, den));
      ph.forward += since(t0);
      t0 = Clock::now();
      model.backward(weights);
      compute->synchronize();
      ph.backward += since(t0);
    } catch (const Error& e) {
      // The plan covered the training state; what did not fit is a micro-batch's work.
      if (e.kind() != ErrorKind::kOutOfMemory) throw;
      // The pinned pool's budget (its errors begin "pinned pool:"), not the device's.
      if (e.message().rfind("pinned pool:", 0) == 0)
        STRATA_THROW(kOutOfMemory,
                     "step {}: pinned host memory ran out during a micro-batch: raise "
                     "strata.host_budget_bytes in "
                     "--config (the plan's host total is {} bytes; the pool commits whole 2 MiB "
                     "pieces) ({})",
                     step, engine.plan().host_bytes, e.user_message());
      STRATA_THROW(
          kOutOfMemory,
          "step {}: the device ran out of memory during a micro-batch (its activations are not in "
          "the "
          "plan): a smaller --micro-batch (now {}) or --seq-len (now {}){}{}, or fewer weights on "
          "the "
          "device (--config: offload_param, stage3_max_live_parameters) ({})",
          step, B, seq_len,
          mopt.checkpoint ? "" : ", --checkpoint-activations (or --checkpoint-on-host)",
          demo_capped
              ? ", a larger --device-mem-gb (the demo model's emulated device is capped at 20 MiB, "
                "below its weights)"
          : dev->kind() == DeviceKind::kCpu || o.device_mem_gb > 0 ? ", a larger --device-mem-gb"
                                                                   : "",
          e.user_message());
    }
  }
  return out;
}

// The traced step written (--trace): a debugging aid, whose failure only warns.
void end_trace(const Run& r) {
  const TrainOptions& o = r.s.o;
  const int rank = r.s.rank;
  Tracer::global().set_enabled(false);
  if (rank == 0) {
    try {
      Tracer::global().write_chrome_trace(o.trace_file);
    } catch (const Error& e) {  // a debugging aid: not worth the run
      log::warn("--trace: {}; the training goes on", e.user_message());
    }
  }
}

// The validation loss over --eval-batches batches (every rank takes its share, as in training).
double evaluate(Run& run) {
  const TrainOptions& o = run.s.o;
  const int rank = run.s.dp_rank, world = run.s.dp_world;  // (a TP group: the same batches)
  Engine& engine = *run.engine;
  TokenLoader* val = run.val.get();
  Model& model = *run.model;
  EngineWeights& weights = *run.weights;
  // The data-parallel group: a TP group's ranks hold the same loss (the world under TP 1).
  Communicator* comm = &run.dp_comm();
  Device* dev = run.dev.get();
  Stream* compute = run.compute.get();
  Phases& ph = run.ph;
  double val_loss = NAN;
  const auto t0 = Clock::now();
  double sum = 0, counted = 0;
  engine.set_eval(true);  // the training's recorded unit order stays as it is
  // The same batches every evaluation, from the evaluation data's start (each rank a batch in
  // turn): --eval-batches of them, or 0: the whole evaluation data. (Each evaluation took the
  // next batches once: a model that did not change showed a validation loss that did.)
  const std::int64_t batches =
      o.eval_batches > 0 ? o.eval_batches : val->batches_per_epoch() / world;
  val->reset();
  for (std::int64_t i = 0; i < batches; ++i) {
    Batch vb;
    for (int r = 0; r < world; ++r) {
      Batch b = val->next();
      if (r == rank) vb = std::move(b);
    }
    // The sum of the counted targets' losses (denominator 1); the mean over every rank's below.
    sum += double(model.forward(vb, weights, /*grad=*/false, 1.0));
    counted += double(counted_targets(vb));
  }
  engine.set_eval(false);
  // Both averaged over the ranks: the ratio is the sum over the ranks over their count.
  const double all_sum = mean_over_ranks(sum, *comm, *dev, *compute),
               all_counted = mean_over_ranks(counted, *comm, *dev, *compute);
  STRATA_REQUIRE(all_counted > 0,
                 "evaluation: every target of the {} validation batch{} is masked (kIgnoreTarget): "
                 "the validation loss has no token to average over; give --eval-batches more "
                 "batches or validation data with targets that count",
                 batches * world, batches * world == 1 ? "" : "es");
  val_loss = all_sum / all_counted;
  ph.eval += since(t0);
  return val_loss;
}

// --sample-every: a greedy continuation of the prompt through the engine's weights (every rank
// runs it: the units are gathered as in evaluation), as the --model folder's tokenizer's text, a
// byte-level model's bytes, or else ids.
std::string sample(Run& run) {
  const auto t0 = Clock::now();
  Engine& engine = *run.engine;
  engine.set_eval(true);
  GenerateOptions g;
  g.max_new_tokens = run.s.o.sample_tokens;
  GenerateResult res;
  try {
    res = generate(*run.model, *run.weights, run.s.sample_prompt, g);
  } catch (...) {
    run.model->reset_decode();
    engine.set_eval(false);
    throw;
  }
  run.model->reset_decode();  // the cache's memory back before the next step
  engine.set_eval(false);
  std::string text;
  if (run.s.tokenizer) {
    // The new tokens go on from the prompt's text (decode_generated's `continues`).
    text = decode_generated(*run.s.tokenizer, run.s.sample_prompt);
    text += decode_generated(*run.s.tokenizer, res.tokens, true, !text.empty());
  } else if (!run.s.o.sample_prompt.empty()) {
    text = run.s.o.sample_prompt;
    for (std::int32_t t : res.tokens) text += static_cast<char>(t);
  } else {
    text = fmt::format("{}", fmt::join(res.tokens, " "));
  }
  run.ph.sample += since(t0);
  return text;
}

// The step's line in --log-json; a line that cannot be written ends the log, not the run.
void write_log_line(Run& r, std::int64_t step, const nlohmann::json& j) {
  const TrainOptions& o = r.s.o;
  std::unique_ptr<JsonLog>& jlog = r.jlog;
  if (jlog)
    if (const int err = jlog->append(j.dump()); err != 0) {
      // a full drive, a reader gone: the run goes on, but the log is said to be incomplete
      jlog.reset();
      log::warn(
          "--log-json {}: the line of step {} could not be written ({}); the log stops here, the "
          "run goes on",
          o.log_json, step, std::strerror(err));
    }
}

}  // namespace

// One step: its micro-batches, the optimizer step, the loss over the ranks, evaluation, the
// checkpoint, the log line and the progress line.
void run_step(Run& r, std::int64_t step) {
  const Settings& s = r.s;
  const TrainOptions& o = s.o;
  const std::int64_t accum = s.accum, steps = s.steps;
  const int rank = s.rank;
  std::FILE* con = s.con;
  Engine& engine = *r.engine;
  Phases& ph = r.ph;
  const EngineStats& prev = r.prev;
  const TokenLoader* val = r.val.get();
  const auto t_step = Clock::now();
  const bool tracing = !o.trace_file.empty() && step == o.trace_step;
  if (tracing) Tracer::global().set_enabled(true);
  const double lr = s.lr_of(step);
  engine.set_next_lr(float(lr));  // the early optimizer step (overlapping backward) uses it
  const StepLoss fb = forward_backward(r, step);
  auto t0 = Clock::now();
  const StepResult sr = engine.step(float(lr));
  ph.optimizer += since(t0);
  // Each micro-batch's loss is its counted targets' sum over counted / (accum x world): summed here
  // and averaged over the data-parallel ranks, the step's sum over its counted targets (a TP
  // group's ranks hold the same loss: it is not sent among them).
  const double loss = mean_over_ranks(fb.loss_sum / double(accum), r.dp_comm(), *r.dev, *r.compute);
  r.counted_tokens += double(fb.counted);
  stop_if_the_steps_stay_nonfinite(r, step, loss, sr.skipped, lr);
  if (tracing) end_trace(r);
  StepRecord rec;
  rec.step = step;
  rec.loss = loss;
  rec.lr = lr;
  rec.grad_norm = sr.grad_norm;
  rec.skipped = sr.skipped;
  rec.step_s = since(t_step);
  rec.tokens_per_s = r.tokens_per_step / rec.step_s;
  rec.counted_tokens_per_s = double(fb.counted) / rec.step_s;
  r.result.steps.push_back(rec);

  // Every --eval-every steps, and after the last.
  const bool eval_now = val && ((o.eval_every > 0 && step % o.eval_every == 0) || step == steps);
  const double val_loss = eval_now ? evaluate(r) : NAN;

  const bool sample_now = o.sample_every > 0 && (step % o.sample_every == 0 || step == steps);
  r.sample.clear();
  std::string sampled;
  if (sample_now) sampled = sample(r);

  const EngineStats st = engine.stats();
  nlohmann::json j = {{"step", step},
                      {"loss", loss},
                      {"lr", lr},
                      {"grad_norm", sr.grad_norm},
                      {"tokens_per_s", rec.tokens_per_s},
                      {"counted_tokens_per_s", rec.counted_tokens_per_s},
                      {"step_time_s", rec.step_s},
                      {"skipped", sr.skipped},
                      {"loss_scale", sr.loss_scale},
                      {"h2d_bytes", st.h2d_bytes - prev.h2d_bytes},
                      {"d2h_bytes", st.d2h_bytes - prev.d2h_bytes},
                      {"nvme_read_bytes", st.nvme_read_bytes - prev.nvme_read_bytes},
                      {"nvme_written_bytes", st.nvme_written_bytes - prev.nvme_written_bytes}};
  if (!std::isnan(val_loss)) {
    j["val_loss"] = val_loss;
    j["val_ppl"] = std::exp(val_loss);  // perplexity
  }
  if (sample_now) {
    // A byte-level model's text may hold any byte: bytes that are no UTF-8 become U+FFFD in the
    // log (JSON is UTF-8) and on the console (quoted and escaped as JSON: newlines too).
    j["sample"] = utf8::lossy(sampled);
    r.sample = j["sample"].dump();
  }

  // The checkpoint before the step's log line: a logged step's checkpoint is complete. The line
  // is in the checkpoint too, for a resume after a death between the two.
  const bool checkpointed = o.save_every > 0 && (step % o.save_every == 0 || step == steps);
  if (checkpointed) {
    t0 = Clock::now();
    save_checkpoint(r, step, j);
    ph.save += since(t0);
    if (const char* crash = std::getenv("STRATA_TEST_CRASH_AFTER_CHECKPOINT");
        crash && std::atoll(crash) == step && rank == 0) {
      std::fprintf(
          stderr,
          "strata-train: STRATA_TEST_CRASH_AFTER_CHECKPOINT=%lld: aborting before the step's log "
          "line\n",
          (long long)step);
      std::fflush(stderr);
      std::abort();
    }
  }

  write_log_line(r, step, j);
  plot_step(r, j);
  if (checkpointed) prune_checkpoints(r);
  if (con) print_progress(r, rec, val_loss, st);
  r.prev = st;
}

void say_where_an_interrupted_start_leaves(const Settings& s) {
  if (s.launch.rank != 0 || !s.o.interrupt_notes) return;
  set_interrupt_note(
      s.resume.dir.empty()
          ? std::string("\nstrata-train: interrupted while starting, before its first step\n")
          : fmt::format("\nstrata-train: interrupted while starting; the newest checkpoint is {} "
                        "(step {}): continue with the same command\n",
                        s.resume.dir, s.resume.step));
}

// The steps after the resumed one (none resumed: from the first) to --steps.
void run_steps(Run& r) {
  const Settings& s = r.s;
  const TrainOptions& o = s.o;
  const FoundCheckpoint& resume = s.resume;
  r.result.resumed_from = r.resumed_from;
  r.prev = r.engine->stats();
  if (s.rank == 0 && o.interrupt_notes)  // where an interrupted run can go on from
    set_interrupt_note(
        !resume.dir.empty() ? fmt::format("\nstrata-train: interrupted; the newest checkpoint is "
                                          "{} (step {}): continue with the same "
                                          "command\n",
                                          resume.dir, resume.step)
        : o.save_every > 0 ? std::string("\nstrata-train: interrupted before its first checkpoint: "
                                         "nothing to resume from\n")
                           : std::string("\nstrata-train: interrupted; no checkpoints were written "
                                         "(--save-every N keeps a run's "
                                         "progress)\n"));
  r.loop_start = Clock::now();
  for (std::int64_t step = r.start_step + 1; step <= s.steps; ++step) run_step(r, step);
}

// The trained model written to --out (Hugging Face layout), after the last step.
void write_model(Run& r) {
  const Settings& s = r.s;
  const TrainOptions& o = s.o;
  if (o.out_dir.empty()) return;
  const auto t0 = Clock::now();
  if (s.rank == 0 && o.overwrite) {  // a file where the folder goes; in a folder, the save
    std::error_code ec;              // replaces the weights and config.json, and other files stay
    if (fs::exists(o.out_dir, ec) && !fs::is_directory(o.out_dir, ec)) fs::remove(o.out_dir, ec);
  }
  try {
    // With the model folder's tokenizer, chat template and generation_config.json beside the
    // weights, so that --out loads as it is (rank 0 wrote config.json).
    const std::vector<std::string> copied =
        save_engine_weights(*r.engine, s.mcfg, s.ecfg.compute_dtype, o.out_dir, s.rank, r.tp_comm(),
                            o.out_max_shard_bytes, o.model_dir);
    std::error_code same_ec;  // (--out the --model folder: its files are there already)
    if (s.rank == 0 && !o.model_dir.empty() && !fs::equivalent(o.model_dir, o.out_dir, same_ec)) {
      if (copied.empty())
        log::warn(
            "--out {}: {} has no tokenizer files ({}, ...): the folder holds the weights "
            "and config.json only",
            o.out_dir, o.model_dir, hf_side_files().front());
      else
        log::info("--out {}: copied {} from {}", o.out_dir, fmt::join(copied, ", "), o.model_dir);
    }
    // (a run stopped now is complete: its --out counts as taken by the command said before)
    if (s.rank == 0 && o.interrupt_notes)
      set_interrupt_note(fmt::format(
          "\nstrata-train: interrupted after writing the model to {}: the run is complete\n",
          o.out_dir));
  } catch (const Error& e) {
    // A full drive at the end: the training is in the newest checkpoint, if any; say so, and how to
    // finish (the same command with --resume writes the model and runs no step).
    if (e.kind() != ErrorKind::kIo) throw;
    const std::string newest = !r.checkpoints.empty() ? r.checkpoints.back() : s.resume.dir;
    STRATA_THROW(
        kIo, "{}; the model was not written to {}; {}", with_errno(e), o.out_dir,
        newest.empty()
            ? fmt::format("no checkpoint of this run holds its training (--save-every N keeps "
                          "it): {} and run again",
                          write_fix(e, o.out_dir, true))
            : fmt::format("the newest checkpoint is {}: {}, then run the same command with "
                          "--resume {}",
                          newest, write_fix(e, o.out_dir, true), newest));
  }
  r.ph.save += since(t0);
}

}  // namespace train_job
}  // namespace strata
