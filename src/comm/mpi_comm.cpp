// MpiCommunicator: collectives over MPI for host memory and the CPU-emulated device.
//
// Owns: a duplicate of MPI_COMM_WORLD (our collectives never interleave with a program's
// own), the collective worker (comm_internal.h: one thread, a watchdog), and fp32 scratch for
// 16-bit reductions.
// Invariants:
//  - Every MPI call of this communicator runs on its worker, in the order the collectives
//    were issued (over all streams together), so every rank makes the same calls in the
//    same order whatever its streams do (CollectiveWorker).
//  - bf16/fp16 reductions are not done on raw 16-bit words (an integer sum of bit
//    patterns is garbage): the worker widens them to fp32 scratch (exact), reduces fp32
//    with MPI's own MPI_SUM / MPI_MAX, and rounds the result once, to nearest even, with
//    strata's conversions. The result is the fp32 sum (in MPI's reduction order) rounded
//    once; max is exact. Avg is the fp32 sum times 1/world_size, then rounded.
//  - A failed or timed-out collective ends the job (the ranks can no longer agree on what
//    was done): the error names the collective, the rank and the elapsed time. MPI errors
//    are returned to us (MPI_ERRORS_RETURN on our communicator) so the message is ours.
// Never: calls MPI from the caller's thread after construction, or blocks the caller.
#include <mpi.h>

#include <algorithm>
#include <climits>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

#include "comm/comm_internal.h"
#include "cpu/cpu_kernels.h"
#include "strata/error.h"
#include "strata/log.h"

namespace strata::comm {
namespace {

std::string mpi_error_text(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(code, text, &len);
  return std::string(text, static_cast<std::size_t>(len));
}

bool is_16bit(DType t) { return t == DType::kBF16 || t == DType::kF16; }

MPI_Datatype mpi_type(DType t) {
  switch (t) {
    case DType::kF32:
      return MPI_FLOAT;
    case DType::kF64:
      return MPI_DOUBLE;
    case DType::kBF16:
    case DType::kF16:
      return MPI_UINT16_T;  // moved as words, never reduced as such
  }
  return MPI_DATATYPE_NULL;
}

class MpiCommunicator final : public Communicator {
 public:
  // `peers`: "rank 1 on b, ..." (where the other ranks run), for error messages; `hosts`: every
  // rank's host, by rank.
  MpiCommunicator(Device& device, double timeout_s, MPI_Comm comm, int rank, int world_size,
                  std::vector<std::string> hosts)
      : Communicator(CommBackend::kMpi, device, rank, world_size, timeout_s),
        comm_(comm),
        hosts_(std::move(hosts)),
        peers_(peers_of(hosts_, rank)),
        worker_(std::make_unique<CollectiveWorker>(
            rank, world_size, timeout_s, [this](const Collective& c) { execute(c); },
            world_size > 1 ? fmt::format(" (the other ranks: {})", peers_) : std::string())) {
    // Before any collective of comm_ is queued (MPI wants one order of collectives per
    // communicator, and the worker thread issues comm_'s).
    check(MPI_Comm_dup(comm_, &split_comm_), "MPI_Comm_dup");
  }

  ~MpiCommunicator() override {
    worker_.reset();  // after every issued collective has run: their streams still wait on them
    if (mpi_active()) {
      MPI_Comm_free(&comm_);
      if (split_comm_ != MPI_COMM_NULL) MPI_Comm_free(&split_comm_);
    }
  }

  // "rank 1 on b, rank 2 on c, ...": the first 8 ranks other than `rank`, where they run.
  static std::string peers_of(const std::vector<std::string>& hosts, int rank) {
    std::string peers;
    int listed = 0;
    const int size = int(hosts.size());
    for (int r = 0; r < size && listed < 8; ++r)
      if (r != rank) peers += fmt::format("{}rank {} on {}", listed++ ? ", " : "", r, hosts[r]);
    if (size - 1 > listed) peers += fmt::format(" and {} more", size - 1 - listed);
    return peers;
  }

 protected:
  bool accepts_host_memory() const noexcept override { return true; }

  // MPI_Comm_split on the duplicate of comm_ kept for splits (the worker thread may have comm_'s
  // collectives in flight).
  std::unique_ptr<Communicator> do_split(int color, const std::vector<int>& members) override {
    const int key = int(std::find(members.begin(), members.end(), rank()) - members.begin());
    MPI_Comm sub = MPI_COMM_NULL;
    check(MPI_Comm_split(split_comm_, color, key, &sub), "MPI_Comm_split");
    MPI_Comm_set_errhandler(sub, MPI_ERRORS_RETURN);
    int r = 0, n = 1;
    MPI_Comm_rank(sub, &r);
    MPI_Comm_size(sub, &n);
    std::vector<std::string> hosts;
    for (int m : members) hosts.push_back(hosts_[std::size_t(m)]);
    return std::make_unique<MpiCommunicator>(device(), timeout_s(), sub, r, n, std::move(hosts));
  }

  void do_enqueue(const Collective& c, Stream& stream) override {
    for (const auto* list : {&c.inputs, &c.outputs})
      for (const TensorRef& t : *list)
        STRATA_REQUIRE(t.numel <= std::size_t(INT_MAX),
                       "{}: {} elements exceed MPI's int count ({}); split the tensor",
                       c.describe(), t.numel, INT_MAX);
    worker_->enqueue(c, stream);
  }

 private:
  void check(int rc, const char* call) {
    if (rc == MPI_SUCCESS) return;
    int cls = rc;
    MPI_Error_class(rc, &cls);
    std::string text = mpi_error_text(rc);
    if (cls == MPI_ERR_TRUNCATE)
      text +=
          ": the ranks passed this collective different sizes or dtypes (or issued different "
          "collectives); rerun with STRATA_COMM_CHECK=1 to name each rank's call";
    if (world_size() > 1) text += fmt::format(" (the other ranks: {})", peers_);
    detail::throw_error(ErrorKind::kMpi, __FILE__, __LINE__, call, "MPI collective failed", text);
  }

  // fp32 scratch slot `i`, grown as needed and kept for the next call.
  float* scratch(std::size_t i, std::size_t n) {
    if (scratch_.size() <= i) scratch_.resize(i + 1);
    if (scratch_[i].size() < n) scratch_[i].resize(n);
    return scratch_[i].data();
  }

  // Posts every tensor's nonblocking collective, waits for all, then finishes (rounds,
  // averages, copies out) in order: a coalesced call is one wait.
  void execute(const Collective& c) {
    std::vector<MPI_Request> reqs;
    std::vector<std::function<void()>> finish;
    const MPI_Op mop = c.op == ReduceOp::kMax ? MPI_MAX : MPI_SUM;
    const bool avg = c.op == ReduceOp::kAvg;
    const float inv = 1.0f / float(world_size());
    std::size_t slot = 0;
    auto average = [inv, this](DType t, void* p, std::size_t n) {
      if (t == DType::kF64) {
        auto* d = static_cast<double*>(p);
        for (std::size_t i = 0; i < n; ++i) d[i] /= world_size();
      } else {
        cpu::scale(inv, t, p, n);  // fp32 here: 16-bit data is scaled before rounding
      }
    };

    if (c.kind == Kind::kBarrier) {
      reqs.emplace_back();
      check(MPI_Ibarrier(comm_, &reqs.back()), "MPI_Ibarrier");
    }
    for (std::size_t i = 0; i < c.inputs.size(); ++i) {
      const TensorRef& in = c.inputs[i];
      const DType t = in.dtype;
      const int n = static_cast<int>(in.numel);
      reqs.emplace_back();
      MPI_Request* req = &reqs.back();
      switch (c.kind) {
        case Kind::kBarrier:
          break;
        case Kind::kBroadcast:
          check(MPI_Ibcast(in.mem.ptr, n, mpi_type(t), c.root, comm_, req), "MPI_Ibcast");
          break;
        case Kind::kGather: {
          void* out = c.outputs.empty() ? nullptr : c.outputs[i].mem.ptr;
          const bool in_place =
              out && in.mem.ptr == static_cast<char*>(out) + rank() * in.numel * dtype_size(t);
          check(MPI_Igather(in_place ? MPI_IN_PLACE : in.mem.ptr, n, mpi_type(t), out, n,
                            mpi_type(t), c.root, comm_, req),
                "MPI_Igather");
          break;
        }
        case Kind::kAllGather: {
          const TensorRef& out = c.outputs[i];
          const bool in_place =
              in.mem.ptr == static_cast<char*>(out.mem.ptr) + rank() * in.numel * dtype_size(t);
          check(MPI_Iallgather(in_place ? MPI_IN_PLACE : in.mem.ptr, n, mpi_type(t), out.mem.ptr, n,
                               mpi_type(t), comm_, req),
                "MPI_Iallgather");
          break;
        }
        case Kind::kAllReduce:
          if (is_16bit(t)) {
            float* s = scratch(slot++, in.numel);
            cpu::cast(t, in.mem.ptr, DType::kF32, s, in.numel);
            check(MPI_Iallreduce(MPI_IN_PLACE, s, n, MPI_FLOAT, mop, comm_, req), "MPI_Iallreduce");
            finish.push_back([=] {
              if (avg) average(DType::kF32, s, in.numel);
              cpu::cast(DType::kF32, s, t, in.mem.ptr, in.numel);
            });
          } else if (c.inputs.size() == 1) {
            // One tensor: the blocking call, which takes Open MPI's tuned algorithms (the
            // nonblocking one is libnbc's: half the speed from 2 MiB up, measured with 2 ranks
            // here). A blocking and a nonblocking call do not match: ranks issuing different
            // collectives (which STRATA_COMM_CHECK=1 names) wait for the watchdog, as any mismatch
            // does.
            reqs.back() = MPI_REQUEST_NULL;
            check(MPI_Allreduce(MPI_IN_PLACE, in.mem.ptr, n, mpi_type(t), mop, comm_),
                  "MPI_Allreduce");
            if (avg) finish.push_back([=] { average(t, in.mem.ptr, in.numel); });
          } else {
            check(MPI_Iallreduce(MPI_IN_PLACE, in.mem.ptr, n, mpi_type(t), mop, comm_, req),
                  "MPI_Iallreduce");
            if (avg) finish.push_back([=] { average(t, in.mem.ptr, in.numel); });
          }
          break;
        case Kind::kReduceScatter: {
          const TensorRef& out = c.outputs[i];
          const int n_out = static_cast<int>(out.numel);
          if (is_16bit(t)) {
            float* s_in = scratch(slot++, in.numel);
            float* s_out = scratch(slot++, out.numel);
            cpu::cast(t, in.mem.ptr, DType::kF32, s_in, in.numel);
            check(MPI_Ireduce_scatter_block(s_in, s_out, n_out, MPI_FLOAT, mop, comm_, req),
                  "MPI_Ireduce_scatter_block");
            finish.push_back([=] {
              if (avg) average(DType::kF32, s_out, out.numel);
              cpu::cast(DType::kF32, s_out, t, out.mem.ptr, out.numel);
            });
          } else {
            // MPI forbids the output aliasing the input, which the in-place layout does.
            const std::size_t out_bytes = out.numel * dtype_size(t);
            const bool in_place =
                out.mem.ptr == static_cast<char*>(in.mem.ptr) + rank() * out_bytes;
            void* dst = in_place ? scratch(slot++, (out_bytes + 3) / 4) : out.mem.ptr;
            check(MPI_Ireduce_scatter_block(in.mem.ptr, dst, n_out, mpi_type(t), mop, comm_, req),
                  "MPI_Ireduce_scatter_block");
            finish.push_back([=] {
              if (dst != out.mem.ptr) std::memcpy(out.mem.ptr, dst, out_bytes);
              if (avg) average(t, out.mem.ptr, out.numel);
            });
          }
          break;
        }
      }
    }
    // MPI_ERR_IN_STATUS says only that a request failed: report that request's own error.
    std::vector<MPI_Status> statuses(reqs.size());
    int rc = MPI_Waitall(static_cast<int>(reqs.size()), reqs.data(), statuses.data());
    if (rc == MPI_ERR_IN_STATUS)
      for (const MPI_Status& st : statuses)
        if (st.MPI_ERROR != MPI_SUCCESS && st.MPI_ERROR != MPI_ERR_PENDING) {
          rc = st.MPI_ERROR;
          break;
        }
    check(rc, "MPI_Waitall");
    for (auto& f : finish) f();
  }

  MPI_Comm comm_;
  std::vector<std::vector<float>> scratch_;  // worker only
  MPI_Comm split_comm_ = MPI_COMM_NULL;      // made at the first split
  std::vector<std::string> hosts_;
  std::string peers_;
  std::unique_ptr<CollectiveWorker> worker_;  // last: its thread runs execute()
};

}  // namespace

std::unique_ptr<Communicator> make_mpi_communicator(Device& device, double timeout_s) {
  const LaunchInfo li = init_launch();
  STRATA_REQUIRE(
      li.under_mpi,
      "the mpi communicator needs an MPI launcher: start the program with mpirun -np N (or "
      "srun --mpi=pmix), or use the local communicator for one process");
  MPI_Comm comm;
  int rc = MPI_Comm_dup(MPI_COMM_WORLD, &comm);
  if (rc != MPI_SUCCESS)
    detail::throw_error(ErrorKind::kMpi, __FILE__, __LINE__, "MPI_Comm_dup(MPI_COMM_WORLD)",
                        "cannot create the communicator", mpi_error_text(rc));
  MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN);
  // OpenMPI reports a failed nonblocking collective on MPI_COMM_WORLD's handler: return there too,
  // so the error reaches check() and the job ends with the collective named.
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  int rank = 0, size = 1;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &size);
  install_termination_note(rank, size);
  // Where every rank runs (MPI_Get_processor_name: the host name), for the messages of a
  // collective that fails or times out.
  std::vector<char> names(std::size_t(size) * MPI_MAX_PROCESSOR_NAME, 0);
  int len = 0;
  MPI_Get_processor_name(&names[std::size_t(rank) * MPI_MAX_PROCESSOR_NAME], &len);
  std::vector<std::string> hosts(std::size_t(size), "?");
  if (size == 1 || MPI_Allgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, names.data(),
                                 MPI_MAX_PROCESSOR_NAME, MPI_CHAR, comm) == MPI_SUCCESS)
    for (int r = 0; r < size; ++r) {
      const char* n = &names[std::size_t(r) * MPI_MAX_PROCESSOR_NAME];
      hosts[std::size_t(r)] = std::string(n, strnlen(n, MPI_MAX_PROCESSOR_NAME));
    }
  return std::make_unique<MpiCommunicator>(device, timeout_s, comm, rank, size, std::move(hosts));
}

}  // namespace strata::comm
