// Fine-tuning a Model through the ZeRO-3 Engine: the bridge between the two (EngineWeights),
// and the training loop strata-train runs (train()).
//
// The bridge maps model fetch unit i to engine unit i one to one. Each engine unit holds the
// model unit's whole flat buffer (its 64-element alignment gaps included, as zeros), so the
// engine's gathered tensor is exactly the layout Model::units() describes and no copy or
// re-layout sits between them. The model's calls become engine calls:
//   acquire_weights -> Engine::fetch      release_weights -> Engine::release
//   acquire_grads   -> Engine::grad_buffer (zeroed fp32)  release_grads -> Engine::reduce_grad
// The model acquires each unit's gradient exactly once per micro-batch (the LM head's during
// forward(), the tied embedding's head part folded into unit 0's single gradient in
// backward()), which is what the engine requires: one grad_buffer/reduce_grad pair per unit
// per micro-batch, accumulated in the engine's fp32 shard until step().
//
// The loop: every rank reads the same token stream and takes every world_size-th micro-batch
// (rank r the r-th of each group), so N ranks with micro-batch B see the same global batch as
// one rank with N*B rows; the logged loss is the mean cross-entropy over all of a step's
// targets on all ranks, measured in forward before the update.
#pragma once

#include <cstdint>
#include <cstdio>
#include <functional>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "strata/engine.h"
#include "strata/error.h"
#include "strata/model.h"

namespace strata {

class EngineWeights final : public UnitProvider {
 public:
  // `engine` must already hold the model's units (add_model_units) and be finalized; all
  // work goes on `compute`, the model's stream.
  EngineWeights(Engine& engine, Stream& compute, const std::vector<UnitSpec>& units);

  TensorRef acquire_weights(std::size_t unit) override;
  void release_weights(std::size_t unit) override;
  TensorRef acquire_grads(std::size_t unit) override;
  void release_grads(std::size_t unit) override;

 private:
  Engine& engine_;
  Stream& compute_;
  std::size_t num_units_;
};

// Registers one engine unit per model unit, in order, with `flat_init[i]` (units[i].numel fp32
// values) as its initial weights. Throws when sizes disagree.
void add_model_units(Engine& engine, const std::vector<UnitSpec>& units,
                     const std::vector<std::vector<float>>& flat_init);

// A model's initial values for the engine: elements [first, first + count) of unit `unit`'s flat
// layout (model_units: parameters at their offsets, the alignment gaps zero) in fp32. The engine
// asks only for this rank's slices, a sub-group at a time.
using ModelSource =
    std::function<void(std::size_t unit, std::size_t first, std::size_t count, float* out)>;
// From scratch, as Hugging Face initialises the model (init_hf_values): every value a function of
// the seed, its parameter and its index, so 1, 2 or N ranks and every placement get the same
// weights, and no rank holds more than the slice it asks for.
// Under tensor parallelism (`tp`), of this rank's slices (model_units(cfg, tp)): the whole model's
// values at the same elements.
ModelSource fresh_model_source(const ModelConfig& cfg, std::uint64_t seed, TensorParallel tp = {});
// A Hugging Face folder's weights (HfWeightsReader: the whole folder checked when this is made,
// each slice read from its byte range; under TP each contiguous run of this rank's slice).
ModelSource hf_model_source(const ModelConfig& cfg, const std::string& dir, TensorParallel tp = {});
// The ranges of each unit whose squares this TP rank adds to the gradient norm
// (Engine::set_tensor_parallel): its split parameters' slices, and on TP rank 0 the whole unit
// (the replicated parameters, which every TP rank holds alike, counted there once).
std::vector<Engine::Ranges> tensor_parallel_counted(const std::vector<UnitSpec>& units,
                                                    int tp_rank);
// The ranges of each unit that weight decay skips (Engine::set_weight_decay_exempt): its norm
// weights and biases, the one-dimensional parameters of every family strata reads — what the
// Hugging Face Trainer's AdamW leaves undecayed (its LayerNorm / RMSNorm weights and every
// "bias"), and Megatron's and nanoGPT's too. Embeddings and the head decay.
std::vector<Engine::Ranges> weight_decay_exempt_ranges(const std::vector<UnitSpec>& units);
// Registers one engine unit per model unit, in order, its values from `source`.
void add_model_units(Engine& engine, const std::vector<UnitSpec>& units, ModelSource source);

// The model's initial weights as one fp32 flat buffer per unit (hf_model_source of `hf_dir` when
// it is not empty, else fresh_model_source): the whole model in host memory, for tests; a run
// gives the engine the source itself.
std::vector<std::vector<float>> initial_unit_weights(const ModelConfig& cfg,
                                                     const std::string& hf_dir, std::uint64_t seed);

// Gathers the units' fp32 master weights one at a time (collective: every rank calls it) and, on
// rank 0, writes each into its safetensors shard in `dtype` (fp32 or bf16) as it comes
// (HfWeightsWriter): Hugging Face layout in `dir`, at most one unit held at a time. Under tensor
// parallelism (`tp`, the engine being over this rank's DP group) the TP ranks' slices of each unit
// are gathered too and written as the whole tensors. `side_files_from`: a Hugging Face folder
// whose tokenizer files go with the weights (HfWeightsWriter::finish); the names copied are
// returned (rank 0's).
std::vector<std::string> save_engine_weights(Engine& engine, const ModelConfig& cfg, DType dtype,
                                             const std::string& dir, int rank,
                                             Communicator* tp = nullptr,
                                             std::size_t max_shard_bytes = std::size_t(5) << 30,
                                             const std::string& side_files_from = "");

// The ds_config settings that only the model decides (strata-train and strata-prof call it once,
// after parse_engine_config): bf16.enabled "auto" by the model's saved dtype (resolve_auto_dtype)
// and sub_group_size 0 by its largest tensor over `world_size` ranks
// (resolve_per_tensor_sub_groups). Logs each resolved one on rank 0 (`talk`), the dtype only
// when no --dtype flag will replace it (`dtype_flag`).
void resolve_config_for_model(EngineConfig& c, const ModelConfig& m, int world_size,
                              const std::string& config_file, bool dtype_flag, bool talk);

// The learning rate of optimizer step t (1-based): linear warmup over `warmup` steps (t/warmup),
// then constant ("const"), cosine decay ("cosine") or linear decay ("linear", the Hugging Face
// Trainer's default) reaching min_lr at step `total`: Hugging Face's
// get_{constant,cosine,linear}_schedule_with_warmup (cosine_with_min_lr with a floor) one step
// on — step t runs at their lambda(t), where theirs runs at lambda(t - 1) (a first step at lr 0).
double lr_at(std::int64_t t, double lr, std::int64_t warmup, std::int64_t total,
             const std::string& schedule, double min_lr = 0);

// The loss_denominator each micro-batch's Model::forward gets in a step of `accum` micro-batches on
// each of `world` ranks whose batches count `counted` targets in all (Batch targets that are not
// kIgnoreTarget): counted / (accum x world). The engine averages gradients over the ranks and
// divides their sum over the micro-batches by accum, so the step's gradient is that of (the sum of
// the step's counted targets' losses) / counted, as is its loss (the micro-batches' forward values
// summed, divided by accum and averaged over the ranks): the mean over every counted target of the
// step, not a mean of per-micro-batch means. counted 0: an error naming `step` (every target
// masked).
double step_loss_denominator(std::int64_t counted, std::int64_t accum, int world,
                             std::int64_t step);

// ---- checkpoints (src/trainer/checkpoint.cpp) ----
// A checkpoint is a folder <root>/step-<N> holding every rank's engine state (rank<R>.bin +
// rank<R>.json, Engine::save_state) and, written last, manifest.json: the step, the world size,
// the model's config hash, the trainer's state (data position, seeds, lr schedule) and every
// file's size, xxh3-64 checksum and the node (host name) that wrote it. It is written as
// <root>/step-<N>.tmp-<tag>, fsync'd (files and folder) and renamed into place only when
// complete, so a folder named step-<N> with a manifest whose sizes and checksums verify is a
// complete checkpoint. <root> may be one file system all ranks see, or a node-local one on each
// node (the same path, other drives): then each node's step-<N> holds its own ranks' files and
// the same manifest, which records that (node_local, each file's folder).

// A stable hash of everything that shapes the model's parameters (architecture, sizes, ties,
// biases, norm/rope constants): checkpoints of a different model are refused on resume.
std::string model_config_hash(const ModelConfig& cfg);

// Writes checkpoint `step` under `root` (collective: every rank calls it; `s` is a stream for
// the barriers). `tmp_tag` names the temporary folder (step-<N>.tmp-<tag>) and must be the same
// on every rank. `trainer_state` goes into the manifest as is, next to the files. The ranks find
// which of them share a file system at `root` (one group when it is shared, one a node for
// node-local drives); the first rank of each group makes the folder, writes the manifest and
// renames it into place. Test hook: STRATA_TEST_CRASH_IN_CHECKPOINT=<step> makes rank 0 abort()
// halfway through that step's manifest (the rank files written, the folder not yet renamed).
struct WrittenCheckpoint {
  std::string dir;       // the final folder
  bool writer = false;   // this rank made the folder on its file system (and prunes it)
  int file_systems = 1;  // separate folders written (1: a file system all ranks share)
};
// What write_checkpoint throws (kIo) on a rank whose own part went well when another rank's files
// or folder could not be written: the cause, and its fix, are that rank's (its own message).
class PeerCheckpointError : public Error {
 public:
  PeerCheckpointError(int peer_rank, std::string message, const char* file, int line)
      : Error(ErrorKind::kIo, std::move(message), "", file, line), peer(peer_rank) {}
  int peer;
};
WrittenCheckpoint write_checkpoint(Engine& engine, Communicator& comm, Stream& s,
                                   const std::string& root, std::int64_t step,
                                   const std::string& tmp_tag, const nlohmann::json& trainer_state);

// "" when `dir` is a complete checkpoint (manifest present and parsed, every listed file
// present with its size and checksum; node-local: every file of the nodes whose files are here),
// else why not. `manifest` receives the manifest.
std::string verify_checkpoint(const std::string& dir, nlohmann::json* manifest = nullptr);
// "" when rank `rank`'s engine state (rank<R>.bin and .json) of the verified checkpoint `dir`
// is there; else a sentence naming the file, this node, and the node that wrote it.
std::string checkpoint_rank_missing(const std::string& dir, const nlohmann::json& manifest,
                                    int rank);

struct FoundCheckpoint {
  std::string dir;   // the step-<N> folder
  std::string root;  // the folder of step-<N> folders it was found in; empty when given itself
  std::int64_t step = 0;
  nlohmann::json manifest;
  std::vector<std::string> skipped;  // newer candidates that failed verification: "<dir>: <why>"
};
// The newest complete checkpoint under `path`: a checkpoint folder itself, a folder of
// step-<N> checkpoints, or a run folder holding checkpoints/. Temporary (.tmp-*) folders and
// folders that fail verification are skipped with a warning (and listed in `skipped`); none
// complete: strata::Error (for --resume, one that says to drop it when there is nothing yet).
// max_step >= 0: the newest at or below that step (a folder of checkpoints only).
FoundCheckpoint find_checkpoint(const std::string& path, const std::string& what = "--resume",
                                std::int64_t max_step = -1);
// The checksum a checkpoint's manifest.json carries of itself (its manifest_xxh3 field): xxh3-64
// of the manifest without that field.
std::string manifest_checksum(nlohmann::json manifest);
// The step-<N> folders (and step-<N>.old-<pid> ones set aside) directly in `dir`, newest step
// first; none (or no such folder): empty.
std::vector<std::string> checkpoint_folders(const std::string& dir);

// The embedded demo's model: a byte-level Llama (GQA, untied head), ~5.9M parameters.
ModelConfig demo_model_config();
// A scratch folder on disk for `name` ("demo-nvme", "prof-nvme"): <build>/<name> for a program
// run from the build tree it was built in; else (a package unpacked anywhere) the user's cache
// folder ($XDG_CACHE_HOME or ~/.cache, /strata/<name>), which is on disk (O_DIRECT works there,
// unlike a tmpfs /tmp).
std::string default_scratch_dir(const std::string& name);

struct TrainOptions {
  // model: a Hugging Face folder, or a config.json for a fresh random init, or (both empty)
  // the embedded demo model
  std::string model_dir, model_config;
  // data: token files (format per data_format), prepared files (strata-prep), or corpora
  // (.txt, .jsonl: prepared with the --model folder's tokenizer into a cache, docs/
  // prepared-data.md); text_file: a text file, byte by byte for a byte-level model, else a corpus
  // of one document; both empty: demo data
  std::vector<std::string> data_files;
  std::string data_format = "auto";  // auto | u16 | u32 | llmc | bytes | prepared
  std::string text_file;
  // Corpora: the .jsonl field holding a document's text, and the string text files are split on
  // into documents (none: a file is one document).
  std::string text_field = "text";
  bool text_field_named = false;  // --text-field given: CorpusOptions::text_field_named
  std::optional<std::string> separator;
  // Chat records in corpora: rendered in this layout (chatml | llama3 | llama2 | mistral | none)
  // instead of the model folder's chat template (strata/chat.h); empty: the folder's.
  std::string chat_format;
  std::string ds_config;  // optional ds_config.json path
  // Flags that override the ds_config when set (<= 0 / empty: take the config's value).
  std::int64_t seq_len = 0, micro_batch = 0, grad_accum = 0, steps = 0;
  // Passes over the training data instead of `steps` (0: `steps`, else 60), as the Hugging Face
  // Trainer's num_train_epochs: steps = ceil(epochs x steps_per_epoch), steps_per_epoch = the
  // sequences an epoch of the loader gives (measure_tokens) // (micro_batch x grad_accum x
  // ranks), counted from the files' sizes before any is read. A positive real; with `steps`: an
  // error. Shuffled, a step's sequences continue across the loader's epochs, so E epochs read
  // steps x batch sequences, each window at most ceil(E) times (once for E <= 1).
  double epochs = 0;
  double lr = -1, weight_decay = -1;
  double min_lr = -1;  // the floor of a cosine or linear schedule (-1: 0)
  // The global gradient-norm clip (-1: the --config's gradient_clipping; without one, 1.0 when
  // fine-tuning a --model folder, the Hugging Face Trainer's max_grad_norm, else none); 0: none.
  double max_grad_norm = -1;
  // --warmup / --lr-schedule; when neither is given (-1, ""), the ds_config's scheduler block
  // applies (scheduled_lr), else 0 and "const".
  std::int64_t warmup = -1;
  std::string lr_schedule;
  std::uint64_t seed = 1234;
  bool shuffle = true;
  std::string dtype;  // "" (config's), fp32 | bf16
  std::string device = "auto";
  // Tensor parallelism (Megatron's, strata/model.h): the split layers' slices over this many
  // ranks of a node, ZeRO-3 over the data-parallel groups of the rest (ranks / N of them; the
  // batch flags are per data-parallel rank). 0: the --config's tensor_parallel.autotp_size, else 1.
  int tensor_parallel = 0;
  // With tensor parallelism: Megatron's sequence parallelism (ModelOptions::sequence_parallel):
  // the norms and the residual stream on 1/TP of the tokens a rank, less activation memory for
  // the same traffic.
  bool sequence_parallel = false;
  double device_mem_gb = 0;  // cap of the emulated device; 0 = its default
  // The emulated device's throttles (HostDeviceOptions; 0 = unthrottled): a slower link or
  // matmul rate, to rehearse a GPU machine's balance on a CPU (strata-prof validates with them).
  double emu_h2d_gbps = 0, emu_d2h_gbps = 0, emu_compute_gflops = 0;
  bool checkpoint_activations = false;
  bool checkpoint_on_host = false;  // with checkpoint_activations: the checkpoints in host memory
  // Evaluation: every eval_every steps (0: none) and after the last step, on eval_batches
  // batches a rank (0: the whole evaluation data once), from eval_files (any format data_files
  // takes) or, without them, the last 10% of the training data; with eval_files and no
  // eval_every, after the last step only.
  std::int64_t eval_every = 0, eval_batches = 4;
  std::vector<std::string> eval_files;
  // A greedy sample every sample_every steps (0: none) and after the last: sample_tokens new
  // tokens after sample_prompt (text, byte-level models) or sample_prompt_ids ("1 2 3"), printed
  // under the progress line and logged as the step's "sample".
  std::int64_t sample_every = 0, sample_tokens = 32;
  std::string sample_prompt, sample_prompt_ids;
  std::string log_json, out_dir, trace_file;
  // The largest safetensors file out_dir gets (a larger tensor alone in one); more: shards with
  // model.safetensors.index.json, as Hugging Face's max_shard_size.
  std::size_t out_max_shard_bytes = std::size_t(5) << 30;
  // The picture of the run (strata/run_plot.h), redrawn by rank 0 after every step's log line
  // ("": none).
  std::string plot_file;
  std::int64_t trace_step = 2;
  // Replace an existing out_dir, log_json, plot_file or trace_file (without it: refused, but for
  // the log, picture or trace of the run `resume` continues; plan_only writes none).
  bool overwrite = false;
  bool plan_only = false;
  // Checkpoints: every save_every steps and after the last step (0: none) into
  // checkpoint_dir (default <out_dir>/checkpoints; with --resume and neither given, the
  // resumed checkpoint's folder); keep_checkpoints > 0 keeps only the newest that many.
  std::int64_t save_every = 0, keep_checkpoints = 0;
  std::string checkpoint_dir;
  // Continue from the newest complete checkpoint under this folder (find_checkpoint).
  std::string resume;
  // The demo's NVMe folder (params and optimizer offloaded there); used only in demo mode.
  std::string demo_nvme_dir;
  std::FILE* console = stdout;  // progress and summary (rank 0 only)
  // What an interrupted run says (set_interrupt_note: strata-train's lines, where it can go on
  // from); off for a tool that runs train() as part of its own work and says its own.
  bool interrupt_notes = true;
};

struct StepRecord {
  std::int64_t step = 0;
  double loss = 0, lr = 0, grad_norm = 0, tokens_per_s = 0, step_s = 0;
  // Targets that counted in the loss (not kIgnoreTarget), every rank's, per second of the step.
  double counted_tokens_per_s = 0;
  bool skipped = false;
};

struct TrainResult {
  std::vector<StepRecord> steps;         // the steps this call ran (after the resumed one, if any)
  std::int64_t resumed_from = 0;         // the checkpoint's step, 0 when not resumed
  std::vector<std::string> checkpoints;  // folders written, in order
  EngineStats stats;
  bool plan_fits = true;  // --plan: whether the plan fits (strata-train exits 2 when not)
};

// Runs the whole job: model, data, engine, loop, logs, final save. Every rank calls it.
// Throws strata::Error for bad options, missing files and configurations that cannot fit, and
// before anything is written for an output that would replace a file: log_json, plot_file and
// trace_file are none of the files the run reads (the model folder's, data_files, eval_files,
// text_file, model_config, ds_config) nor one another, overwrite or not, and an existing one needs
// `overwrite` (strata/paths.h). Every rank checks them, though rank 0 alone writes them: a file
// of that name on another node's own disk counts too.
TrainResult train(const TrainOptions& options);

}  // namespace strata
