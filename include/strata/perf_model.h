// The step-time model strata-prof predicts with, and the search over placements it runs.
//
// predict_step() replays one optimizer step of the ZeRO-3 engine (src/scheduler/*: engine_impl.h)
// on paper: the same units in the same order, the same streams and their FIFO order, the same
// waits. Each resource is a lane that does one thing at a time; an operation starts when its
// lane is free and its inputs are ready, and lasts bytes / measured bandwidth (or the measured
// compute time). What the engine does, the model does:
//   forward, per micro-batch: units 0..N-1 are fetched in order (NVMe read -> H2D -> all-gather
//     on the fetch stream) and computed on the compute stream; a fetch waits for the release of
//     the unit it evicts when stage3_max_live_parameters is full (the victim is the gathered
//     unit whose next use is furthest away, as the engine picks it). The last unit (the LM
//     head) also runs its backward in forward and reduces its gradient there.
//   backward: units N-2..0; a unit dropped since forward is fetched again; each unit's fp32
//     gradient is zero-filled on the compute stream, and reduced on the comm stream
//     (reduce-scatter, then either an add into the device shard or a D2H: straight into the
//     host accumulator for the step's first micro-batch, into staging + a host add after).
//   step: the gradient norm (a pass over every gradient shard), then unit by unit on the host
//     thread: optimizer state read from NVMe one unit ahead, AdamW on the device (optimizer
//     stream) or the CPU (host thread), new compute weights back to their tier (H2D, D2H or an
//     NVMe write), state written behind with at most optimizer_buffer_count writes in flight;
//     then every write waited for and the device gradients zeroed (host ones are overwritten).
//   early optimizer step (strata.overlap_optimizer, on unless the config says false): a unit
//     whose optimizer runs on the host from host gradients is stepped by the engine's early
//     worker as soon as its last gradient of the step is accumulated (norm part, AdamW, its
//     state read ahead and written behind on NVMe), overlapping the rest of backward; step()
//     then waits for each in the worker's order, sends device-bound weights over the link,
//     and steps only the other units. The model assumes the early work is kept (no clipping,
//     the lr announced), the steady state of training.
// The host thread runs ahead of the device streams everywhere except where the engine blocks
// it: the end of forward (the loss), the end of backward, and the waits in step().
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "strata/engine_config.h"

namespace strata {

// What strata-prof measures on the machine (rates in bytes or parameters per second).
struct MachineProfile {
  double h2d_bps = 0, d2h_bps = 0;  // pinned host <-> device copies
  double device_mem_bps = 0;        // device memory traffic of a fill / add pass
  // Bytes a free costs per second on the stream that frees them (the CPU-emulated device
  // poisons freed memory; a GPU's caching allocator frees for nothing: 0 = no cost).
  double free_bps = 0;
  double host_mem_bps = 0;   // host memory traffic of a memcpy / add pass
  double host_norm_bps = 0;  // gradient bytes per second of the host's norm pass (0: host_mem_bps)
  double nvme_read_bps = 0, nvme_write_bps = 0;
  // Reads and writes in flight together (the optimizer's read-ahead and write-behind, the
  // gradients' writes): a request of b bytes holds the drive nvme_mixed_request_s + b at
  // nvme_mixed_bps (the line through that traffic's time a request at two request sizes, with
  // kMixedInFlight requests in flight: small requests pay a per-request part). 0 = take the
  // one-direction rates, no fixed part.
  static constexpr int kMixedInFlight = 4, kMixedDeepInFlight = 8;
  double nvme_mixed_bps = 0;
  double nvme_mixed_request_s = 0;
  // The per-request part again with kMixedDeepInFlight in flight: the more requests wait on the
  // drive, the more of it they overlap. A configuration's part is taken at the depth it keeps in
  // flight, in a line between the two (mixed_request_at). < 0: not measured (the part above at
  // every depth).
  double nvme_mixed_deep_request_s = -1;
  // The fixed part of a read's time when it is waited for alone (queue depth 1): a read of b
  // bytes of optimizer state (a sub-group's) costs nvme_request_s + b at the rate above. The
  // optimizer waits for each sub-group's read, issued one ahead, so small sub-groups pay it
  // once each. 0 = bytes only.
  double nvme_request_s = 0;
  // The optimizer's loop over NVMe state, as the engine runs it (wait for sub-group g's read, read
  // g+1 issued, g written behind): the time a sub-group takes beyond its bytes. The read's wait
  // and the writes' per-request parts overlap there, so with it measured a sub-group's read of
  // state pays this and the writes behind it (its state, its new weights) no fixed part of their
  // own. < 0: not measured (the read pays nvme_request_s, every write the mixed part).
  double nvme_subgroup_s = -1;
  // A fetch's read of one unit's weight shard, one request at a time, as the fetch stream
  // waits for each: 0 = nvme_read_bps.
  double nvme_fetch_read_bps = 0;
  // The engine reads a unit's weights from NVMe one request a sub-group (at most
  // aio.block_size each), all issued at once: each request beyond those of one read of the
  // whole shard adds this much to the fetch (small sub-groups make many). 0 = none.
  double nvme_fetch_request_s = 0;
  // The mix's rate over the second half of a run of some seconds (0: not measured), and the short
  // runs' mixed rate: where the sustained one is lower (a drive that bursts), the rates above are
  // the short runs' scaled down to it.
  double nvme_sustained_bps = 0, nvme_mixed_burst_bps = 0;
  // CpuAdamW, all its threads, as the engine calls it (a sub-group a call, out of the cache): a
  // call of n parameters takes cpu_adamw_call_s + n at this rate.
  double cpu_adamw_params_per_s = 0, cpu_adamw_call_s = 0;
  double device_adamw_params_per_s = 0;               // Stream::adamw on the device
  double all_gather_bps = 0, reduce_scatter_bps = 0;  // bytes of the full buffer per second
  int world_size = 1;  // the data-parallel ranks the ZeRO state is sharded over
  // Tensor parallelism: the ranks each layer is split over (TP innermost: world_size is the DP
  // group's size) and the rate of their all-reduce (bytes of the buffer per second), which the
  // replay shows the model's TP collectives at (UnitCost::tp_*_bytes).
  int tensor_parallel = 1;
  double tp_all_reduce_bps = 0;
  int ranks_on_node = 1;  // sharing its RAM and drives: the capacities below are a share
  std::uint64_t device_capacity = 0, host_capacity = 0, nvme_free = 0;
  // Host RAM (PlanInputs'): this rank's share of what the node has (0: not checked), the resident
  // memory of the process before an engine, and whether the device's memory is host RAM.
  std::uint64_t ram_capacity = 0, ram_base_bytes = 0;
  bool device_in_ram = false;
  // The CPU-emulated device: its streams are threads on these host cores, shared with the
  // host thread and the CPU optimizer (0: a real device, nothing shared). Its kernels use
  // device_kernel_threads of them (0: all).
  double device_shares_host_cores = 0;
  int device_kernel_threads = 0;
  // The CPU-emulated device: how much longer its kernels take while the drive streams the
  // engine's mix of reads and writes (0.3: 30% longer; 0: none measured). On a virtual machine
  // the drive's I/O is served on the same physical cores and memory, and the guest's CPU time
  // does not show it; the replay applies it to kernels while its NVMe lane is busy.
  double nvme_compute_slowdown = 0;
  double nvme_load_bps = 0;  // the drive's rate while that was measured
};

// One fetch unit of the model: its size and its measured compute time per micro-batch
// (forward; backward including any recomputation of a checkpointed forward).
struct UnitCost {
  std::string name;
  std::uint64_t numel = 0;  // under tensor parallelism: this rank's slice
  double forward_s = 0, backward_s = 0;
  // Under tensor parallelism: the bytes of the TP collectives (all-reduces; under sequence
  // parallelism all-gathers and reduce-scatters) the unit's forward and backward queue on the
  // compute stream. Their time is part of forward_s / backward_s (measured with them); the
  // replay shows it on the "tp" lane, at MachineProfile::tp_all_reduce_bps.
  std::uint64_t tp_forward_bytes = 0, tp_backward_bytes = 0;
};

// The model at one micro-batch size and one checkpointing mode.
struct ModelProfile {
  std::vector<UnitCost> units;  // in forward order; the last one is the LM head
  std::int64_t micro_batch = 1, seq_len = 1;
  bool checkpoint = false;             // activation checkpointing (recompute in backward)
  bool checkpoint_on_host = false;     // ... with the checkpoints kept in host memory
  std::uint64_t activation_bytes = 0;  // device bytes one micro-batch's activations take
  // With checkpoint_on_host: the host RAM the layer checkpoints take (host_checkpoint_bytes), a
  // line of the candidate's memory plan as of strata-train's.
  std::uint64_t host_checkpoint_bytes = 0;
  // The CPU-emulated device: the host cores its work kept busy on average while the forward and
  // backward ran alone (the process's CPU time over their wall time), which is what its kernels
  // take of the cores shared with copies and the CPU optimizer. 0: not measured (the kernels
  // take MachineProfile::device_kernel_threads of them).
  double device_cores = 0;
  double tokens_per_micro_batch() const { return double(micro_batch) * double(seq_len); }
};

// kTp: the tensor-parallel collectives, which hold the compute stream while they run.
enum class Resource { kCompute, kH2D, kD2H, kNvme, kCpu, kComm, kTp, kCount };
const char* resource_name(Resource r);  // "compute", "h2d", "d2h", "nvme", "cpu", "comm", "tp"

struct Interval {
  Resource lane;
  double start_s = 0, end_s = 0;
  std::string what;  // "fwd layers.3", "h2d layers.3", "adamw embed", ...
  // The engine's stream it is queued on ("fetch", "comm", "optimizer", "writeback", "compute"),
  // "host" / "early" for the engine's host thread / early-optimizer worker, "" for an NVMe
  // request; and the bytes it moves (copies and NVMe requests; 0 for compute).
  std::string stream;
  std::uint64_t bytes = 0;
};

struct Prediction {
  double step_s = 0;
  double forward_s = 0, backward_s = 0, optimizer_s = 0;  // phase ends minus starts
  double busy_s[int(Resource::kCount)] = {};
  Resource bottleneck = Resource::kCompute;
  double tokens_per_s = 0;
  std::vector<Interval> schedule;  // every operation of the step, for the timeline picture
};

// The drive's per-request part with `in_flight` requests of reads and writes in flight: the
// profile's at kMixedInFlight, its deep one at kMixedDeepInFlight, in a line between them, the
// nearer beyond.
double mixed_request_at(const MachineProfile& m, double in_flight);

// The predicted time of one optimizer step (gradient_accumulation_steps micro-batches and the
// update) of `model` under `config` on `machine`. Throws strata::Error for a profile that lacks
// a rate the configuration needs (e.g. optimizer state on NVMe with no NVMe bandwidth).
Prediction predict_step(const MachineProfile& machine, const ModelProfile& model,
                        const EngineConfig& config);

// ---- the search ----
struct Candidate {
  std::string label;    // "params nvme, optimizer host, grads host, live 4 units, B=8, ckpt"
  EngineConfig config;  // micro_batch_per_gpu set; nvme paths set when used
  bool checkpoint = false, checkpoint_on_host = false;
  std::int64_t micro_batch = 1;
  MemoryPlan plan;
  Prediction prediction;
};

struct SearchSpace {
  // Model profiles to choose from (one per micro-batch size and checkpointing mode).
  std::vector<ModelProfile> models;
  EngineConfig base;                    // everything the search does not set (dtype, clipping, ...)
  std::vector<std::string> nvme_paths;  // empty: NVMe placements are not considered
  std::vector<std::string>
      param_nvme_paths;                // the weights' own, when they differ (empty: nvme_paths)
  bool allow_device_optimizer = true;  // the optimizer state on the device
  // The share of device memory a candidate's plan may fill: the rest is the allocator's
  // (fragmentation, frees still queued on streams). A plan over it would make the engine
  // wait for every stream whenever an allocation fails, which the model does not predict.
  double device_headroom = 0.9;
};

struct SearchResult {
  // Feasible candidates, the recommended first (recommend_less_drive_bound), then fastest
  // (predicted tokens/s) first.
  std::vector<Candidate> ranked;
  std::size_t considered = 0;  // all candidates, feasible or not
  // When nothing fits: the plan of the least demanding candidate and its problems (what is
  // missing on which tier).
  std::vector<std::string> problems;
  MemoryPlan smallest;
  std::string smallest_label;  // its configuration, as Candidate::label
};

SearchResult search_placements(const MachineProfile& machine, const SearchSpace& space);

// The recommendation among near-ties: of the candidates predicted within kRecommendTieWithin of
// the fastest (tokens/s; `ranked` sorted fastest first), the fastest whose NVMe drive is busy for
// at most kRecommendDriveAtMost of the fastest's drive time is moved first, when the fastest uses
// the drive; the others keep their order. Predictions that close are one answer within the
// model's error (strata-prof holds the recommended to within 5% of the fastest validated), and
// the drive is the rate that moves most from run to run (docs/benchmarks.md#strata-prof: the same
// drive-bound step took 52-79 ms in runs of one evening) and the one its writes wear. Without
// NVMe, or with no such candidate, nothing moves.
inline constexpr double kRecommendTieWithin = 0.05;
inline constexpr double kRecommendDriveAtMost = 0.8;
void recommend_less_drive_bound(std::vector<Candidate>& ranked);

// Validation (strata-prof --validate): a candidate's measured tokens a second, from its measured
// step (the tokens of a step as the prediction counts them); and, of the first
// measured_step_s.size() ranked candidates (0: the run failed), the one that trains fastest
// by it — what the search ranks by: candidates of other micro-batch sizes differ in step time
// for that alone. measured_step_s.size() when none ran.
double measured_tokens_per_s(const Candidate& c, double measured_step_s);
std::size_t fastest_validated(const std::vector<Candidate>& ranked,
                              const std::vector<double>& measured_step_s);
// Spearman's rank correlation of x and y (ties ranked by their mean rank): 1 when y orders the
// values as x does, -1 reversed. strata-prof --validate gives it for the predicted against the
// measured tokens a second. Empty with fewer than 3 pairs, or when either side is all ties.
// `tie_within` > 0 ties values closer than that (relative, to the smaller of a pair) on each side
// alike, pair by pair: a value's rank is the values clearly below it plus half of those within
// tie_within of it (its mean rank over their possible orders; the same whichever way the values
// run, tokens/s or step times). With it the measurement's resolution, candidates the runs cannot
// tell apart are not ranked on noise.
std::optional<double> spearman(const std::vector<double>& x, const std::vector<double>& y,
                               double tie_within = 0);
// How much a run's step times spread: their interquartile range (the sorted steps at n/4 and
// 3n/4) over their median. 0 with fewer than 2 steps. strata-prof takes the median of it over
// the validation runs as the resolution its rank correlation ties values within.
double step_spread(std::vector<double> steps_s);
// How far a candidate's rounds of --validate came apart: (slowest - fastest) over the fastest of
// its rounds' step times (each round's median step). 0 with fewer than 2 rounds. The machine's
// own drift (a shared host, a drive or cores slowing): a prediction cannot be checked closer than
// that.
double round_drift(const std::vector<double>& round_step_s);
// The mean of `v` without its smallest and its largest value (with fewer than 3 values, the plain
// mean; 0 when empty). strata-prof reduces a layer's repeated timings with it: on the emulated
// device they fall into groups (a copy's first repetitions on one core, the later ones on more),
// where a median snaps to one group or the other from run to run, and a step's kernels run
// between them; one outlier each way is dropped.
double trimmed_mean(std::vector<double> v);

// A candidate's placement class: the tiers its weights, gradients and optimizer state occupy
// (joined by "+" where split) and whether the early optimizer step runs, e.g. "params host+nvme,
// optimizer host, grads host, early step". Candidates of one class differ only in live window,
// micro-batch, checkpointing or buffer counts.
std::string placement_class(const Candidate& c);

// A candidate strata-prof --validate runs, and why it was chosen.
struct ValidationPick {
  std::size_t index = 0;  // into the ranked candidates
  // "top" (among the best `top`), "best of class" (the best-ranked of a placement class not
  // yet chosen), "low-ranked (median)" or "low-ranked (last)".
  std::string reason;
};
// The ranked candidates --validate runs, in rank order: the best `top`, then up to `spread`
// others so that a wrong ranking can show — the best-ranked candidate of each placement class
// not already chosen (best first), and, ranked low, the median (or the first rank below it not
// yet chosen) and the last (these two keep up to half of `spread`, and take what the classes
// leave). No candidate twice; at most top + spread.
std::vector<ValidationPick> validation_picks(const std::vector<Candidate>& ranked, std::size_t top,
                                             std::size_t spread);

// The order --validate runs `picks` picks in over `rounds` rounds: each pick once a round, in
// turns, every round starting a rounds-th of the way further along the order (7 picks in 3
// rounds: 0 1 2 3 4 5 6, 2 3 4 5 6 0 1, 4 5 6 0 1 2 3; with no more picks than rounds the same
// order each time). A pick's runs are then about a round apart, never back to back (of two picks
// or more), so one slow
// stretch of a shared machine falls on one of them, not on two (reversing every other round ran
// the first and the last pick twice in a row); and each pick's mean place in the order is within
// picks / rounds of the others', so a drift over the validation (a drive or the cores slowing as
// they warm) falls on every pick nearly alike. Pick indices, picks x rounds of them.
std::vector<std::size_t> validation_order(std::size_t picks, int rounds);

// The busiest of `busy_s` (per Resource): the first of the largest. The bottleneck of a step.
Resource busiest(const double (&busy_s)[int(Resource::kCount)]);

// How long each lane of `schedule` was busy: the union of its intervals (overlapping ones on one
// lane, as NVMe requests in flight together or two device streams computing, count once), and
// the busiest lane: a traced step's measured bottleneck (nullopt when nothing was busy).
struct LaneBusy {
  double busy_s[int(Resource::kCount)] = {};
  std::optional<Resource> busiest;
};
LaneBusy lane_busy(const std::vector<Interval>& schedule);

// A ds_config.json text that parse_engine_config reads back as `config` (the placement,
// prefetch, live-parameter and batch settings, precision, optimizer, aio).
// stage3_gather_16bit_weights_on_model_save is written only when true (its default is false).
std::string engine_config_json(const EngineConfig& config);

// What a step holds of its data: it reads all `grad_accum` micro-batches of `micro_batch` x
// `seq_len` tokens before its first forward (the loss is over all their targets) and holds them
// at once, ids, targets and positions (12 bytes a token) and each micro-batch's record; against
// the memory this process can still take (cgroup limit included; 0: unknown). In doubles: the
// sizes are what the flags say, products of them past 2^63 included. A step that holds more
// than is available cannot run: strata-train refuses it, strata-prof before measuring anything.
struct StepData {
  double held_bytes = 0, available_bytes = 0;
  bool fits() const { return available_bytes <= 0 || held_bytes <= available_bytes; }
};
StepData step_data(double grad_accum, double micro_batch, double seq_len);

}  // namespace strata
