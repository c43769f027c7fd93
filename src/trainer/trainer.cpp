// The training loop strata-train runs (include/strata/trainer.h, train()).
//
// Owns the job's setup (model config, initial weights, data, device, communicator, engine
// config with the command line's overrides), the step loop, and what the user sees: the
// progress line, the per-step JSON log and the final summary table. Only rank 0 prints or
// writes files; every rank runs the same collectives in the same order (the loss all-reduce
// after each step, the gathers of a save), so a rank that returns early would hang the others:
// errors are thrown before the first collective or are fatal for the job.
//
// The embedded demo (no model and no data given) is a small byte-level Llama trained on text
// from a tiny generated grammar, with weights and optimizer state on NVMe and an emulated
// device capped below the size of the fp32 weights, so every tier is exercised in a minute.
//
// train() is the job's steps in order; each is in the file of its job (train_job.h lists them).
#include "strata/trainer.h"

#include <utility>

#include "strata/log.h"
#include "trainer/train_job.h"

namespace strata {

void resolve_config_for_model(EngineConfig& c, const ModelConfig& m, int world_size,
                              const std::string& config_file, bool dtype_flag, bool talk) {
  const std::string dtype = resolve_auto_dtype(c, m.torch_dtype);
  const std::string groups =
      resolve_per_tensor_sub_groups(c, largest_tensor(model_units(m)), world_size);
  if (!talk) return;
  if (!dtype.empty() && !dtype_flag) log::info("--config {}: {}", config_file, dtype);
  if (!groups.empty()) log::info("--config {}: {}", config_file, groups);
}

TrainResult train(const TrainOptions& o) {
  using namespace train_job;
  Settings s(o);
  s.t_start = Clock::now();
  check_flags(s);
  read_model_config(s);
  check_files(s);
  find_checkpoints(s);
  device_options(s);
  build_engine_config(s);
  sequence_and_batch(s);
  data_and_steps(s);
  check_resume_step(s);
  lr_schedule(s);
  if (o.plan_only) return report_plan(s);
  hold_folders(s);
  say_where_an_interrupted_start_leaves(s);

  Run r(s);
  prepare_data(r);
  open_device(r);
  build_model_and_engine(r);
  resume_from_checkpoint(r);
  prepare_checkpoints(r);
  open_json_log(r);
  open_plot(r);
  print_header(r);
  run_steps(r);
  write_model(r);
  r.result.stats = r.engine->stats();
  r.result.checkpoints = r.checkpoints;
  print_summary(r);
  return std::move(r.result);
}

}  // namespace strata
