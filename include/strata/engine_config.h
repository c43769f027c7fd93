// What the ZeRO-3 engine is told: a DeepSpeed-style ds_config.json, parsed and validated,
// and the memory plan it implies. Keys and defaults follow DeepSpeed (shared/DS_CONFIG.md);
// strata's own keys are marked (strata).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "strata/adamw.h"
#include "strata/device.h"
#include "strata/nvme.h"

namespace strata {

enum class Tier { kDevice, kHost, kNvme };
const char* tier_name(Tier t);  // "device", "host", "nvme"

// Where one piece of training state lives. Fractions of the piece's bytes, in unit order:
// the first `device_fraction` of the units' bytes on the device, the next `host_fraction`
// on pinned host memory, the rest on NVMe. They sum to 1.
struct Placement {
  double device_fraction = 1.0;
  double host_fraction = 0.0;
  double nvme_fraction() const { return 1.0 - device_fraction - host_fraction; }
  // The tier of the piece at byte position `pos` of `total` (pos < total).
  Tier tier_at(double pos, double total) const;
};

struct LossScaleConfig {
  bool enabled = false;   // fp16.enabled
  double loss_scale = 0;  // 0 = dynamic
  int initial_scale_power = 16;
  int loss_scale_window = 1000;
  int hysteresis = 2;
  double min_loss_scale = 1;
};

struct LrScheduleConfig {
  std::string type;  // "" (constant), "WarmupLR", "WarmupDecayLR", "WarmupCosineLR"
  // WarmupLR / WarmupDecayLR. warmup_max_lr < 0: optimizer.params.lr (the key "auto", as Hugging
  // Face fills it); without the key DeepSpeed's default, 0.001, for either type.
  double warmup_min_lr = 0, warmup_max_lr = 0.001;
  bool warmup_max_lr_given = false;  // the block names it (a value or "auto")
  std::int64_t warmup_num_steps = 1000;
  std::int64_t total_num_steps = 0;  // WarmupDecayLR / WarmupCosineLR; 0: "auto", the run's steps
  double cos_min_ratio = 0.0001;     // WarmupCosineLR
  double warmup_min_ratio = 0;       // WarmupCosineLR
  std::string warmup_type = "log";   // warmup curve: "log" | "linear" (all three types)
};

struct EngineConfig {
  // batch
  std::int64_t train_batch_size = 0;  // derived when 0 (parse_engine_config always fills it)
  std::int64_t micro_batch_per_gpu = 1;
  std::int64_t gradient_accumulation_steps = 1;
  double gradient_clipping = 0;  // 0 = off
  // precision
  DType compute_dtype = DType::kF32;  // bf16.enabled -> kBF16, fp16.enabled -> kF16
  // bf16.enabled "auto" (the Hugging Face Trainer's placeholder): the model's own dtype decides,
  // which the file does not know; resolve_auto_dtype() sets compute_dtype from it.
  bool bf16_auto = false;
  LossScaleConfig fp16;
  // optimizer ("Adam" and "AdamW" both run AdamW; see docs/configuration.md for "Adam" +
  // weight_decay)
  std::string optimizer_type = "AdamW";
  AdamWOptions adamw;  // lr, betas, eps, weight_decay
  LrScheduleConfig scheduler;
  // zero_optimization
  int stage = 3;  // strata's default when no config is given; a ds_config without "stage" gives 0
  bool overlap_comm = true;
  bool contiguous_gradients = true;
  std::uint64_t reduce_bucket_size = 500'000'000;     // elements
  std::uint64_t allgather_bucket_size = 500'000'000;  // elements
  std::uint64_t sub_group_size = 1'000'000'000;       // elements
  // train_batch_size / gradient_clipping given as values in the ds_config ("auto" and null are
  // not): the user's global batch and clipping, which flags that set one factor keep.
  bool train_batch_size_given = false, gradient_clipping_given = false;
  // reduce_bucket_size / sub_group_size given in the ds_config (not defaults): the plan notes a
  // value below the largest unit only then (the defaults are below a large model's embedding).
  bool reduce_bucket_size_given = false, sub_group_size_given = false;
  // sub_group_size 0, as axolotl's ZeRO-3 files give it: in DeepSpeed every parameter tensor's
  // partition is a sub-group of its own. strata's sub-groups are element ranges of a unit's
  // shard; resolve_per_tensor_sub_groups() sizes them as the largest tensor's partition.
  bool sub_group_per_tensor = false;
  std::uint64_t prefetch_bucket_size = 50'000'000;      // stage3_prefetch_bucket_size
  std::uint64_t max_live_parameters = 1'000'000'000;    // stage3_max_live_parameters
  std::uint64_t max_reuse_distance = 1'000'000'000;     // stage3_max_reuse_distance
  std::uint64_t param_persistence_threshold = 100'000;  // stage3_param_persistence_threshold
  bool gather_16bit_weights_on_model_save = false;      // stage3_gather_16bit_weights_on_model_save
  // placement of each piece of this rank's shard
  Placement params;     // compute-weight shard: offload_param.device (+ strata fractions)
  Placement grads;      // fp32 gradient shard: strata key zero_optimization.offload_grads
  Placement optimizer;  // master, m, v: offload_optimizer.device (+ ratio / strata fractions)
  std::vector<std::string> param_nvme_paths, optimizer_nvme_paths;
  // Where NVMe-tier gradient shards go: the optimizer's nvme_path when offload_optimizer.device is
  // "nvme", else the parameters' (parse_engine_config fills it when offload_grads is "nvme").
  std::vector<std::string> grad_nvme_paths;
  int param_buffer_count = 5;
  std::uint64_t param_buffer_size = 100'000'000;   // elements
  std::uint64_t param_max_in_cpu = 1'000'000'000;  // elements
  int optimizer_buffer_count = 4;
  bool pin_memory =
      true;  // false if offload_param.pin_memory or offload_optimizer.pin_memory is false
  bool pipeline_read = false, pipeline_write = false;
  AioConfig aio;
  // strata additions
  // Host RAM the caller's model holds through the run beside the engine (its layer checkpoints
  // kept on the host: strata-train --checkpoint-on-host, host_checkpoint_bytes), and what it is:
  // a line of the memory plan's RAM section. Set by the caller, not a ds_config key.
  std::uint64_t model_host_ram_bytes = 0;
  std::string model_host_ram_what;
  // Pinned host memory the engine may hold; 0 = default_host_budget(): 80% of RAM, shared
  // evenly by the ranks on this node.
  std::uint64_t host_budget_bytes = 0;
  // strata.overlap_optimizer: run each unit's host AdamW while backward still runs, into a
  // second copy of its optimizer state, kept if the step needs no clipping and no skip (see
  // Engine::set_next_lr). Unset: on when the memory plan fits with it, else off.
  std::optional<bool> overlap_optimizer;
  // strata.optimizer_threads: threads of the host's CPU AdamW (0 = every core). Fewer leave
  // cores to data loading, or to the kernels of the CPU-emulated device.
  int optimizer_threads = 0;
  // strata.optimizer_isa: the host CPU AdamW's code path, "auto" (the widest this CPU has, or
  // STRATA_ADAMW_ISA), "avx512", "avx2" or "scalar". Every path gives the same bits; a narrower
  // one is slower (the scalar one ~7x here), e.g. to stand in for a slower host CPU.
  Isa optimizer_isa = Isa::kAuto;
  // strata.device_grad_norm: a host-tier gradient that arrives whole in one reduce (one
  // micro-batch a step) has its part of the gradient norm taken by the device, beside its
  // copy to the host, instead of by a pass of the host's CPU (which the optimizer needs).
  // Unset: on, except on the CPU-emulated device, whose "device" is those same cores.
  std::optional<bool> device_grad_norm;
  // strata.weight_decay_exempt: "norms_and_biases" (true, the default) — weight decay skips the
  // model's norm weights and biases, as the Hugging Face Trainer's AdamW, Megatron and nanoGPT
  // do — or "none" (false): every parameter decays, as DeepSpeed's own optimizer decays every
  // parameter it is handed. Applied by the trainer (Engine::set_weight_decay_exempt).
  bool decay_exempt_norms_and_biases = true;
};
// strata.weight_decay_exempt's value for decay_exempt_norms_and_biases: "norms_and_biases", "none".
const char* weight_decay_exempt_name(bool norms_and_biases);

// Parses a ds_config.json text. `world_size` checks train_batch_size against micro batch x
// grad accumulation x ranks. Unknown keys warn once; wrong types and impossible values throw
// strata::Error naming the key and the allowed values. A string "auto" (the Hugging Face
// Trainer's placeholder) takes the value the Trainer fills in where that is known here —
// gradient_clipping its max_grad_norm 1.0, optimizer.params.lr its learning_rate 5e-5 and
// weight_decay 0 (the flags of strata-train and strata-prof then apply as over any value), the
// scheduler's warmup, peak lr and total steps — or sets bf16_auto; every other "auto" is
// treated as not given. Each is said in a warning naming the key.
EngineConfig parse_engine_config(std::string_view json_text, int world_size = 1);
// The ds_config's tensor-parallel size, `tensor_parallel.autotp_size` (DeepSpeed's AutoTP
// training key): 0 when the file does not give one. The job's ranks must be known to resolve the
// batch (train_batch_size is per data-parallel rank), so strata-train reads it first. Throws
// naming the key when it is not an integer >= 1, and `what` (the file) when the text is not JSON.
int config_tensor_parallel(std::string_view json_text, const std::string& what = "ds_config");

// bf16.enabled "auto", as the Trainer fills it (its --bf16 flag; here the model itself): bf16
// when the model's config.json says torch_dtype "bfloat16", else fp32. Returns the line saying
// which; "" (nothing changed) when the config did not say "auto".
std::string resolve_auto_dtype(EngineConfig& c, const std::string& model_torch_dtype);

// sub_group_size 0 (sub_group_per_tensor): the sub-group becomes the largest parameter tensor's
// partition over `world_size` ranks (`largest_tensor` elements), what DeepSpeed's largest
// sub-group is then. Returns the line saying so; "" when the config gave another size.
std::string resolve_per_tensor_sub_groups(EngineConfig& c, std::uint64_t largest_tensor,
                                          int world_size);

// The lr of optimizer step `step` (1-based) under the config's scheduler, as DeepSpeed's
// lr_schedules.py gives it: DeepSpeed sets the lr of iteration -1 when it makes the scheduler and
// steps it after every optimizer step, so step t runs with iteration t - 2 (step 1: warmup_min_lr,
// or 0 for WarmupCosineLR). `optimizer_lr` is optimizer.params.lr: WarmupCosineLR's base, and
// WarmupLR's maximum when the config gives none; with no scheduler it is the lr of every step.
double scheduled_lr(const LrScheduleConfig& s, double optimizer_lr, std::int64_t step);
// The defaults strata uses with no config file: stage 3, no offload.
EngineConfig default_engine_config();

// ---- the memory planner ----
struct UnitSize {
  std::string name;
  std::uint64_t numel = 0;  // parameters in the unit (unpadded)
};

struct PlanLine {
  std::string what;  // "compute weights (shard)", "gathered units (live budget)", ...
  Tier tier = Tier::kDevice;
  std::uint64_t bytes = 0;
};

struct MemoryPlan {
  std::vector<PlanLine> lines;
  std::uint64_t device_bytes = 0, host_bytes = 0, nvme_bytes = 0;  // totals per tier
  std::uint64_t device_capacity = 0, host_capacity = 0, nvme_capacity = 0;
  bool fits = true;
  // The plan counts the early (overlapped) optimizer step's second copies of the state.
  bool early_optimizer_step = false;
  std::vector<std::string> notes;  // choices the planner made for the user, said aloud
  std::vector<std::string>
      problems;  // one per tier that does not fit: what is missing, what to change
  // Host RAM: what this rank keeps resident in all (the process before the engine, the pinned
  // lines, the CPU-emulated device's memory, the larger of the initial weights' and a save's
  // pageable buffer), against PlanInputs::ram_capacity (not checked when that is 0).
  std::vector<PlanLine> ram_lines;  // (tier kHost; their own section of the table)
  std::uint64_t ram_bytes = 0, ram_capacity = 0;
  std::string table() const;  // the table `--plan` prints
};

struct PlanInputs {
  std::vector<UnitSize> units;
  int world_size = 1;
  std::uint64_t device_capacity = 0;
  std::uint64_t host_capacity = 0;
  std::uint64_t nvme_capacity = 0;  // free bytes on the NVMe paths (this rank's share)
  int ranks_on_node = 1;            // ranks sharing this node's RAM and drives (for the messages)
  std::uint64_t activation_bytes = 0;  // the model's estimate for one micro-batch
  // Host RAM: this rank's share of what the node has (0: not checked), the process's resident
  // memory before the engine, and whether the device's memory is host RAM (CPU-emulated).
  std::uint64_t ram_capacity = 0, ram_base_bytes = 0;
  bool device_in_ram = false;
};

// Fills PlanInputs' host-RAM fields for a rank of this process on `device`, one of
// `ranks_on_node` sharing the node: its share of what the node can still give
// (cpu::ram_available_bytes() / ranks_on_node) plus what the process holds now, which is also
// the base.
void set_host_ram_inputs(PlanInputs& in, const Device& device, int ranks_on_node);

MemoryPlan plan_memory(const EngineConfig& config, const PlanInputs& inputs);

// PlanInputs::nvme_capacity for `rank`: the free bytes under the NVMe paths the placement uses
// (SwapStore::free_bytes: a file system counted once, a previous run's files counted as free),
// each file system's free space split evenly among the `ranks_on_node` ranks of this node
// (one config: they all keep their swap files under the same paths); with `world_size`, a dead
// run's ranks beyond it count as free too (rank 0's store removes them); UINT64_MAX when nothing
// is placed on NVMe. Throws naming the key of a missing directory.
std::uint64_t nvme_capacity(const EngineConfig& config, int rank, int ranks_on_node = 1,
                            int world_size = 0);
// Pinned host memory an engine may hold when strata.host_budget_bytes is 0: 80% of the
// machine's RAM divided among the `ranks_on_node` ranks of this node, in whole 2 MiB pieces (the
// pinned pool commits memory so; plan_memory uses any budget so).
std::uint64_t default_host_budget(int ranks_on_node = 1);
// A memory size a flag gives in GiB (--device-mem-gb, --host-mem-gb) as bytes, rounded down;
// one past what a 64-bit count holds (2^33 GiB; the cast would wrap) is refused naming `flag`.
std::uint64_t gib_to_bytes(std::string_view flag, double gib);

}  // namespace strata
