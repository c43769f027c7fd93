// The ZeRO-3 offload engine: owns where every byte of training state lives and when it moves.
//
// A model registers its parameters grouped into fetch units (one per layer, typically),
// each with its initial fp32 values, given whole or by a source the engine asks for this rank's
// slices at finalize() (a sub-group at a time, straight to the tier that keeps them: no rank ever
// holds a whole unit's initial values). The engine flattens each unit into one buffer, pads it
// to a multiple of world_size * 2048 elements and keeps only this rank's 1/world_size shard
// of everything: compute weights (fp32 or bf16), an fp32 gradient accumulator, and the
// fp32 master weights with AdamW's m and v — each piece on the tier the config places it
// (device, pinned host memory, or NVMe through the swap store).
//
// Usage (one rank shown; every rank runs the same calls in the same order):
//
//   auto dev = strata::make_device("auto");
//   auto comm = strata::make_communicator(*dev);
//   strata::Engine engine(*dev, *comm, strata::parse_engine_config(ds_config_text));
//   int fc1 = engine.add_unit({"fc1", {{"weight", 64 * 32, w1_init}, {"bias", 64, b1_init}}});
//   ...
//   engine.finalize();                       // partitions, places, checks the memory plan
//   auto compute = dev->create_stream("compute");
//   for (step...) {
//     for (micro-batch...) {
//       strata::TensorRef w = engine.fetch(fc1, *compute);   // full weights of fc1
//       ... forward kernels on *compute reading w ...
//       engine.release(fc1, *compute);
//       ... backward, per unit in reverse order:
//       w = engine.fetch(fc1, *compute);
//       strata::TensorRef g = engine.grad_buffer(fc1, *compute);  // zeroed fp32 gradient
//       // (GradInit::kOverwrite as a third argument when the kernels write all of g)
//       ... kernels on *compute writing g ...
//       engine.reduce_grad(fc1, *compute);   // reduce-scatter + accumulate, asynchronously
//       engine.release(fc1, *compute);
//     }
//     strata::StepResult r = engine.step(lr);  // clip, AdamW over sub-groups, new weights
//     engine.set_next_lr(next_lr);             // (when the lr changes) before the next backward
//     if (evaluate) {                          // forward-only passes between steps
//       engine.set_eval(true);                 // (fetch / release as in forward, no grad_buffer)
//       ...
//       engine.set_eval(false);
//     }
//   }
//
// Invariants: no byte is resident on a tier unless the memory plan budgeted it; the
// compute stream only ever waits on the event of the unit it needs now; results do not
// depend on placement (offload on or off gives bit-identical weights on one rank).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "strata/comm.h"
#include "strata/device.h"
#include "strata/engine_config.h"

namespace strata {

struct ParamDef {
  std::string name;
  std::size_t numel = 0;
  const float* init = nullptr;  // numel fp32 values; copied by add_unit
};

// Elements [first, first + count) of a unit's flat layout (its parameters in order, each at its
// param_offset), as fp32 into `out`. Asked only for what lies within the unit's elements.
using UnitSource = std::function<void(std::size_t first, std::size_t count, float* out)>;

struct UnitDef {
  std::string name;
  std::vector<ParamDef> params;
  // With a source, the params give names and sizes only (init null): finalize() asks it for this
  // rank's shard a sub-group at a time (the layout: parameters back to back, in order).
  UnitSource source = nullptr;
};

// What Engine::grad_buffer hands out: a zeroed gradient, or one the caller overwrites whole.
enum class GradInit { kZeroed, kOverwrite };

struct StepResult {
  bool skipped = false;   // fp16 overflow on some rank: no update anywhere
  double grad_norm = 0;   // global L2 norm of the true (unscaled, averaged) gradient
  double clip_coef = 1;   // applied to the gradient (1 = not clipped)
  double loss_scale = 1;  // the scale of the step that just ran
  std::int64_t step = 0;  // optimizer steps taken so far (skipped ones not counted)
};

struct EngineStats {
  std::uint64_t device_peak_bytes = 0, device_capacity = 0;
  std::uint64_t host_pinned_peak_bytes = 0, host_budget_bytes = 0;
  std::uint64_t nvme_bytes = 0;
  std::uint64_t h2d_bytes = 0, d2h_bytes = 0, nvme_read_bytes = 0, nvme_written_bytes = 0;
  std::uint64_t fetches = 0, prefetches = 0, trace_rebuilds = 0;
  // Gradient buckets reduced and accumulated: one per reduce_grad per reduce_bucket_size
  // share of the unit's shard (zero_optimization.reduce_bucket_size / world elements a rank).
  std::uint64_t grad_buckets = 0;
  // grad_buffer calls that waited for an earlier unit's reduce to finish and free its gradient:
  // the unit gradients alive stay the plan's two (zero_optimization.overlap_comm; one without).
  std::uint64_t grad_waits = 0;
  // Gradient reduce-scatter collectives issued (none on one rank): one per reduce_grad, or one
  // per bucket for a unit reduce-scattered bucket by bucket.
  std::uint64_t reduce_scatters = 0;
  // Units whose early optimizer step (strata.overlap_optimizer) was kept / redone serially
  // because the step clipped, overflowed or ran with another lr.
  std::uint64_t early_units_kept = 0, early_units_redone = 0;
  // Kept units whose early work was still queued or running when step() returned: finished
  // behind, while the next forward ran (each before its first use).
  std::uint64_t early_units_finished_behind = 0;
  // Steps that did not speculate because the last attempts were all redone (backing off).
  std::uint64_t early_steps_skipped = 0;
  // Device allocations that failed at first and waited for queued frees: on the engine's
  // streams only / on the whole device (the compute stream's queue too).
  std::uint64_t alloc_waits = 0, alloc_device_syncs = 0;
  // Device allocations (the model's too) that found the device full and waited for its
  // streams (DeviceStats::num_alloc_waits since the engine was made).
  std::uint64_t device_alloc_waits = 0;
};

class Engine {
 public:
  // `device` and `comm` must outlive the engine; `comm` spans the data-parallel ranks.
  Engine(Device& device, Communicator& comm, const EngineConfig& config);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Registers a fetch unit (before finalize); returns its index. Parameters are laid out in
  // the unit's flat buffer in the order given: param_offset() says where.
  int add_unit(const UnitDef& unit);
  std::size_t unit_numel(int unit) const;
  std::size_t param_offset(int unit, int param) const;
  // Tensor parallelism (strata/model.h): the ranks of `tp` hold the other slices of the model's
  // split parameters and the same replicated ones, and `comm` (the engine's) is this rank's
  // data-parallel group. The global gradient norm (clipping, the fp16 overflow skip) then sums
  // over `tp` too, counting every element once: `counted[unit]` are the element ranges
  // {first, count} of the unit's flat layout whose squares this rank adds — its split
  // parameters' slices, and on TP rank 0 the replicated parameters too
  // (tensor_parallel_counted() in strata/trainer.h gives them from the unit layout). Before
  // finalize(); `tp` must outlive the engine.
  using Ranges = std::vector<std::pair<std::size_t, std::size_t>>;
  void set_tensor_parallel(Communicator& tp, std::vector<Ranges> counted);
  // Weight decay (AdamWOptions::weight_decay) skips `exempt[unit]`: element ranges {first, count}
  // of each unit's flat layout, which then step as with weight_decay 0 on every tier — norm
  // weights and biases, as the Hugging Face Trainer's AdamW leaves them
  // (weight_decay_exempt_ranges() in strata/trainer.h gives them from the unit layout). Without
  // a call every element decays. Before finalize().
  void set_weight_decay_exempt(std::vector<Ranges> exempt);

  // Partitions, places every piece on its tier, and checks the memory plan: throws
  // strata::Error (kOutOfMemory) with the plan's table and what to change if it cannot fit.
  void finalize();
  // `config` with its device-dependent defaults filled in, as finalize() plans and runs it:
  // strata.overlap_optimizer left unset is off on the CPU-emulated device (its kernels use the
  // cores the host optimizer would). For planning without an engine (strata-train --plan).
  static EngineConfig with_device_defaults(EngineConfig config, const Device& device);
  // Throws what finalize() would for the settings that depend on this host, not on the plan
  // (strata.optimizer_threads beyond what oneTBB runs here): for planning without an engine.
  static void check_host_settings(const EngineConfig& config);
  // Forward-only passes (an evaluation) between steps: while on, fetches follow the forward part
  // of the recorded unit order — prefetching ahead in it, a pass beginning at its first unit —
  // without checking or recording the order, which the next training step finds as it was
  // (without it, each evaluation made the order be recorded again twice, unprefetched).
  void set_eval(bool on);
  const MemoryPlan& plan() const;
  const EngineConfig& config() const;
  DType compute_dtype() const;
  // The host CPU AdamW's code path as finalize() resolved it (strata.optimizer_isa, "auto"
  // being the widest this CPU has); Isa::kAuto before finalize().
  Isa host_optimizer_isa() const;

  // Makes unit `unit`'s full weights (compute dtype, unit_numel elements) available to work
  // queued on `compute` after this call, and prefetches the units that follow it in the
  // recorded order within the live-parameter budget. The tensor stays valid until release().
  TensorRef fetch(int unit, Stream& compute);
  // `compute` is done with the unit once the work queued so far completes.
  void release(int unit, Stream& compute);
  // An fp32 device tensor of unit_numel elements for the unit's gradient, zeroed (kernels may
  // accumulate into it). GradInit::kOverwrite, for kernels that write every element (a matmul
  // with beta 0): its contents are undefined until written, which saves a pass over it.
  TensorRef grad_buffer(int unit, Stream& compute, GradInit init = GradInit::kZeroed);
  // Reduce-scatters the gradient written on `compute` (averaged over ranks) and adds this
  // rank's shard into its fp32 accumulator, asynchronously, in buckets of
  // zero_optimization.reduce_bucket_size elements.
  void reduce_grad(int unit, Stream& compute);

  // fp16: the factor to multiply the loss by before backward (1 otherwise).
  float loss_scale() const;
  // The lr the coming step() will get. With strata.overlap_optimizer on (the plan says
  // early_optimizer_step), a unit's host AdamW runs as soon as backward has produced its last
  // gradient of the step, assuming no clipping and this lr (without a call: the last step's);
  // step() keeps that work when the assumption holds and redoes the unit otherwise, so the
  // result is always the serial step's. Call it before backward when the lr changes.
  void set_next_lr(float lr);
  // One optimizer step with learning rate `lr` over the gradients accumulated since the last
  // step (gradient_accumulation_steps micro-batches): global-norm clipping, fp16 overflow
  // skip agreed by all ranks, AdamW over sub-groups with NVMe reads and writes overlapped.
  // Kept early work (set_next_lr) is not waited for: it finishes behind, in the next
  // forward's order, and each unit is switched to its new weights before its next fetch (or
  // master_shard, save_state, the next step), so the next forward overlaps it.
  StepResult step(float lr);

  // This rank's fp32 master shard of `unit` / every rank's gathered into the full unit
  // (collective), unpadded. For checks and for saving.
  std::vector<float> master_shard(int unit);
  std::vector<float> gather_master(int unit);
  // The full unit on rank `root` alone (collective; empty on the other ranks, which hold only
  // their shard meanwhile): what a save needs, without every rank holding the unit.
  std::vector<float> gather_master_to(int unit, int root);

  // Checkpoints (between steps; every rank calls them with the same folder):
  // save_state writes this rank's master, m and v shard of every unit (fp32, streamed one
  // unit at a time from whichever tier holds it) to `dir`/rank<R>.bin and the layout plus
  // the scalar state (steps taken, fp16 loss-scale fields) to `dir`/rank<R>.json, each
  // fsync'd. load_state (after finalize, on an engine built with the same units) validates
  // rank, unit names and sizes (throwing strata::Error naming what differs); a checkpoint of
  // another world size is resharded (every rank's files read, each unit's shards re-cut to this
  // run's, a sub-group at a time),
  // Under tensor parallelism (set_tensor_parallel) the files are numbered by job rank (DP rank x
  // TP + TP rank) and record the TP size: a checkpoint loads with the same TP size only (each
  // TP rank resharding its own slice's files over a new DP size).
  // puts the state on this run's tiers (which may differ from the saving run's), derives
  // the compute weights from the master exactly as the optimizer does, zeroes the gradient
  // accumulators and re-gathers resident units. Training then continues bit-identically.
  void save_state(const std::string& dir);
  void load_state(const std::string& dir);
  // Optimizer steps taken so far (skipped ones not counted).
  std::int64_t steps_taken() const;

  EngineStats stats() const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

// Where the engine holds a unit's fp32 optimizer state off the device — one block, master | m | v,
// for a host-tier shard or an NVMe sub-group of `n` elements — each array starts this many
// elements after the one before: n, or n plus a 64 KiB gap or two, so that arrays the CPU AdamW
// streams together never lie a multiple of 64 MiB apart (docs/engine.md#the-optimizer-step-steplr).
// For a benchmark or a profile that steps AdamW on the engine's layout.
std::size_t optimizer_state_stride(std::size_t n);

}  // namespace strata
