// The Communicator interface: collectives across the ranks of a job, queued on a Stream.
//
// Four backends implement it (src/comm): NCCL for CUDA devices, MPI for the CPU-emulated
// device (and host memory) under an MPI launcher, Gloo for the same without one (torchrun,
// srun without --mpi), and a one-rank local communicator. make_communicator() picks one from
// the device and the launcher; the scheduler talks to this interface only.
//
// Contract, the same on every backend:
//  - Every collective is asynchronous: it is queued on `stream` after the work already
//    there, returns before it has run, and returns an Event recorded after it. Buffers
//    must stay untouched until that event completes; order other streams with it.
//  - Every rank issues the same collectives, with the same sizes and dtypes, in the same
//    order (over all streams of the communicator together), as with NCCL and MPI. Broken,
//    the data is silently wrong (or the job hangs until the timeout); STRATA_COMM_CHECK=1
//    makes every collective first compare its call across the ranks (a small all-gather and
//    a wait on the host: for debugging) and throw, on every rank, naming each rank's call.
//  - Tensors are fp32, bf16, fp16 (or fp64), contiguous, in the memory of the
//    communicator's device (host memory is also accepted by the MPI, Gloo and local backends).
//  - all_gather: output (numel = world_size * input numel) holds rank r's input at
//    [r * n, (r + 1) * n). reduce_scatter: input (numel = world_size * output numel) is
//    reduced element-wise and rank r keeps block r. Shards are equal: pad the flat buffer
//    to a multiple of world_size. In-place as in NCCL: all_gather's input may be block
//    `rank` of its output, reduce_scatter's output may be block `rank` of its input; other
//    overlaps are refused.
//  - bf16/fp16 reductions compute in fp32 and round to nearest even; see the backends for
//    where rounding happens (MPI, Gloo: once, at the end).
//  - Argument errors throw strata::Error (kInvalidArgument) at the call, before anything
//    is queued. A collective that does not complete within the timeout ends the process
//    (and the job) with an error naming the collective, the rank and the elapsed time:
//    a peer that died must never become a silent hang.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "strata/device.h"

namespace strata {

enum class ReduceOp { kSum, kAvg, kMax };
enum class CommBackend { kLocal, kMpi, kNccl, kGloo };

const char* reduce_op_name(ReduceOp op);       // "sum", "avg", "max"
const char* comm_backend_name(CommBackend b);  // "local", "mpi", "nccl", "gloo"

// Where this process sits in the job. Read from MPI once it is initialized, else from the
// launcher's environment: MPI's launchers (mpirun: OMPI_COMM_WORLD_*; srun --mpi=pmix: PMIX_RANK
// and SLURM_*; MPICH: PMI_*), torchrun's (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
// MASTER_ADDR, MASTER_PORT) or a Slurm step's without MPI (SLURM_PROCID, SLURM_STEP_NUM_TASKS,
// SLURM_LOCALID, SLURM_NODEID, the step's first node as the address), in that order of
// precedence (docs/collectives.md says why); a plain process is rank 0 of 1 with launcher "none".
struct LaunchInfo {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;  // rank among the processes on this node: picks the GPU
  int local_size = 1;
  int num_nodes = 1;  // nodes of the job (MPI: counted once it is up)
  int node_rank = 0;
  bool under_mpi = false;  // started by an MPI launcher (mpirun, mpiexec, srun with PMI/PMIx)
  // "openmpi", "pmix", "pmi", "torchrun", "slurm", "none"
  std::string launcher = "none";
  // torchrun and Slurm without MPI: where the ranks meet (rank 0's TCP rendezvous).
  std::string master_addr;
  int master_port = 0;
};

// The launcher's view; never initializes MPI (a plain process stays a plain process). Once
// init_launch() has run, MPI's view as it found it (not a collective: any rank may ask alone).
LaunchInfo launch_info();
// Under an MPI launcher, initializes MPI once per process (MPI_THREAD_MULTIPLE, finalized at
// exit if strata initialized it) and returns MPI's view, local rank from the shared-memory
// split. Under torchrun or a Slurm step without MPI with several ranks, joins the TCP rendezvous
// at MASTER_ADDR:MASTER_PORT once per process (every rank must; STRATA_RENDEZVOUS_TIMEOUT_S,
// default 300 s, bounds the wait, after which the missing ranks are named). A plain process
// initializes nothing. Refuses (kUnsupported, naming what it saw, what is missing and how to
// start) a launch it cannot complete: torchrun's variables without MASTER_ADDR or with a bad
// RANK, a Slurm step without a node list, two launchers that disagree, MPI's variables in a
// build without MPI, a rendezvous launch in a build with neither Gloo nor NCCL: alone each
// process would train as a 1-rank job. Throws kMpi when MPI cannot give thread-multiple support,
// kIo when the rendezvous fails.
LaunchInfo init_launch();
// The GPU ordinal this rank should use: local_rank modulo the GPUs visible to it.
int launch_gpu_ordinal(const LaunchInfo& info, int device_count);
// A tool's error path: when this process is one of several MPI ranks, logs `message` with the
// rank and ends the whole job (MPI_Abort, exit code 1) — the others may be waiting for this one
// in a collective or in MPI_Finalize, and would wait for ever. Returns otherwise. With
// `join_if_not_up` (a tool whose ranks all start MPI: strata-train, strata-prof), a rank that
// fails before MPI is up first joins its peers in init_launch() and then ends the job: a
// launcher without mpirun's kill-on-exit (srun without --kill-on-bad-exit) would leave them
// waiting in MPI_Init. Off for tools whose ranks may never start MPI (they would wait there).
void end_job_if_one_of_many(const std::string& message, bool join_if_not_up = false);

struct CommOptions {
  // unset: NCCL for CUDA; for the CPU device MPI under an MPI launcher, Gloo under torchrun or
  // srun without MPI, else local
  std::optional<CommBackend> backend;
  // Seconds a collective may take before the job is ended. 0: STRATA_COMM_TIMEOUT_S, else 300.
  double timeout_s = 0;
  // With backend kLocal inside a multi-rank job: a deliberate one-rank group of this process
  // alone (a per-rank reference computation); otherwise that combination is refused.
  bool process_local = false;
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  CommBackend backend() const noexcept { return backend_; }
  int rank() const noexcept { return rank_; }
  int world_size() const noexcept { return world_size_; }
  Device& device() const noexcept { return *device_; }
  double timeout_s() const noexcept { return timeout_s_; }

  Event all_gather(TensorRef input, TensorRef output, Stream& stream);
  Event reduce_scatter(TensorRef input, TensorRef output, ReduceOp op, Stream& stream);
  // In place: every rank's `data` ends up holding the reduction of all ranks' `data`.
  Event all_reduce(TensorRef data, ReduceOp op, Stream& stream);
  // In place: every rank's `data` ends up holding rank `root`'s.
  Event broadcast(TensorRef data, int root, Stream& stream);
  // Rank `root`'s `output` (world_size x input elements: block r is rank r's input; the in-place
  // layout has root's input as its block) receives every rank's `input`. The other ranks pass
  // no output (a default TensorRef) and need memory for their input only.
  Event gather(TensorRef input, TensorRef output, int root, Stream& stream);
  Event barrier(Stream& stream);

  // Several tensors in one call (one NCCL group, one MPI wait): the same results as the
  // individual calls in order, with less latency. Tensors may differ in size and dtype.
  Event all_gather_coalesced(std::span<const TensorRef> inputs, std::span<const TensorRef> outputs,
                             Stream& stream);
  Event reduce_scatter_coalesced(std::span<const TensorRef> inputs,
                                 std::span<const TensorRef> outputs, ReduceOp op, Stream& stream);
  Event all_reduce_coalesced(std::span<const TensorRef> data, ReduceOp op, Stream& stream);

  // The ranks of this communicator that pass the same `color` (>= 0), as a communicator of their
  // own, ranked by `key`, then by rank (as MPI_Comm_split and ncclCommSplit). Collective: every
  // rank calls it, in the same order as its other collectives. The new communicator is
  // independent of this one (its collectives are its own order); this one stays usable.
  std::unique_ptr<Communicator> split(int color, int key);

  // Which of a job's groups this communicator is, for its collectives' trace spans: the whole job
  // ("all_reduce"), a tensor-parallel group ("tp.all_reduce") or a data-parallel one
  // ("dp.all_gather"). make_process_groups() names its groups when TP > 1.
  enum class Group { kJob, kTensorParallel, kDataParallel };
  void set_group(Group g) noexcept { group_ = g; }
  Group group() const noexcept { return group_; }

  // One queued call, as the wrapper hands it to a backend (validated).
  enum class Kind { kAllGather, kReduceScatter, kAllReduce, kBroadcast, kBarrier, kGather };
  struct Collective {
    Kind kind = Kind::kBarrier;
    ReduceOp op = ReduceOp::kSum;
    int root = 0;
    bool coalesced = false;
    std::vector<TensorRef> inputs;   // all_reduce / broadcast: the data (in place)
    std::vector<TensorRef> outputs;  // all_gather / reduce_scatter, gather on its root only
    Group group = Group::kJob;       // the communicator's (its span's prefix)
    // "all_reduce(sum, fp32, 1000 elements)": for logs and error messages.
    std::string describe() const;
    // "all_gather", "reduce_scatter", ...: the name of its trace span (a static string), with
    // "tp." or "dp." before it on a tensor- or data-parallel group's communicator.
    const char* name() const noexcept;
    // The bytes this rank puts in: its inputs' (what its trace span carries).
    std::uint64_t bytes() const noexcept;
  };

 protected:
  Communicator(CommBackend backend, Device& device, int rank, int world_size, double timeout_s);
  // Queues `c` on `stream`; the wrapper records the returned event afterwards.
  virtual void do_enqueue(const Collective& c, Stream& stream) = 0;
  // Whether the backend can read and write host (MemSpace::kHost) memory.
  virtual bool accepts_host_memory() const noexcept { return false; }
  // The new communicator of split(): `members` are this communicator's ranks in its order (this
  // rank among them), `color` what they passed. Collective over this communicator's ranks.
  virtual std::unique_ptr<Communicator> do_split(int color, const std::vector<int>& members) = 0;

 private:
  Event submit(Collective c, Stream& stream);
  void check_tensor(const TensorRef& t, const char* what) const;
  void check_same_call(const Collective& c, Stream& stream);

  CommBackend backend_;
  Device* device_;
  int rank_;
  int world_size_;
  double timeout_s_;
  bool check_calls_ = false;  // STRATA_COMM_CHECK=1
  std::uint64_t calls_ = 0;   // collectives submitted (with check_calls_)
  Group group_ = Group::kJob;
};

// The communicator for this process on `device`: NCCL for a CUDA device (MPI, or the TCP
// rendezvous without MPI, bootstraps it when there are several ranks), MPI for the CPU-emulated
// device under an MPI launcher, Gloo for it under torchrun or srun without MPI, local for a
// single process. Collective: every rank calls it, in the same order as its other
// communicators. Throws kUnsupported when the build lacks the backend, kMpi / kNccl when
// initialization fails.
std::unique_ptr<Communicator> make_communicator(Device& device, const CommOptions& options = {});

// The ranks of a job arranged as tensor-parallel x data-parallel, TP innermost (Megatron's
// layout): rank r is TP rank r % tp of TP group r / tp (tp consecutive ranks, one node's) and DP
// rank r / tp of DP group r % tp (the ranks holding the same TP slice, one per TP group).
struct ProcessGroups {
  int tp_size = 1, dp_size = 1;
  int tp_rank = 0, dp_rank = 0;
  std::unique_ptr<Communicator> tp, dp;  // split from the job's communicator
};
// Collective over `world`'s ranks. Refuses (kInvalidArgument, on every rank alike) a
// `tensor_parallel` below 1 or that does not divide the world size, and TP groups that span
// nodes (tensor parallelism's all-reduces stay on a node's links): naming the group, its hosts and
// how to place the ranks.
ProcessGroups make_process_groups(Communicator& world, int tensor_parallel);

// How many of `comm`'s ranks run on this node, sharing its RAM and drives: the launcher's local
// size for a group of several ranks, 1 for a one-rank group.
int ranks_on_this_node(const Communicator& comm);

// The element-wise maximum over the ranks of `values` (host memory), through a buffer of the
// communicator's device on a stream of its own; returns when this rank has it. For the few
// figures the ranks must agree on (negate a value to get its minimum). Collective.
void max_across_ranks(Communicator& comm, std::span<double> values);
// Every rank's `mine` (a short string: a host name, a token), in rank order, through
// max_across_ranks. Collective.
std::vector<std::string> strings_across_ranks(Communicator& comm, const std::string& mine);
// Rank `root`'s `text` on every rank (the others' `text` is ignored). Collective.
std::string broadcast_string(Communicator& comm, const std::string& text, int root);
// A byte count that travelled as a double back to an integer: 2^64, which UINT64_MAX rounds
// to, stays UINT64_MAX (converting it is undefined).
std::uint64_t bytes_from_double(double bytes);

}  // namespace strata
