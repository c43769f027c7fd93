// GlooCommunicator: collectives over Gloo's TCP transport for host memory and the CPU-emulated
// device, in a job started without MPI (torchrun, srun without --mpi). Gloo is the library
// PyTorch's CPU collectives use; Debian ships it as libgloo-dev.
//
// Owns: a Gloo context whose pairs were connected through the launch's TCP rendezvous
// (rendezvous.h: each rank publishes its pair addresses there under a prefix of its own), the
// collective worker (comm_internal.h: issue order, streams held, watchdog) and fp32 scratch.
// Invariants:
//  - Every Gloo call runs on the worker, in issue order, with a tag of its own (a counter every
//    rank advances alike), and with the communicator's timeout as Gloo's own: a peer that
//    closed its connection (died) makes the pending call throw at once, naming the peer's
//    address; one that hangs makes it throw at the timeout. Either ends the job, naming the
//    collective, the rank and the elapsed time; the watchdog is the backstop.
//  - Reductions are as in the MPI backend: bf16/fp16 widened to fp32 scratch, reduced in fp32
//    and rounded once to nearest even; avg is the sum times 1/world_size. Gloo's ring reduces
//    each element once and hands the result to every rank, so all ranks hold the same bits.
//  - reduce_scatter is an all-reduce of an fp32 (fp64) copy of the input, of which each rank
//    keeps its block: the input is never written, at twice the traffic of a true
//    reduce-scatter (this Gloo has none for the unbound-buffer API).
// Never: calls Gloo from the caller's thread after construction, or blocks the caller.
#include <gloo/allgather.h>
#include <gloo/allreduce.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/gather.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/prefix_store.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/device.h>

#include <atomic>
#include <cstring>

#include "comm/comm_internal.h"
#include "comm/rendezvous.h"
#include "cpu/cpu_kernels.h"
#include "strata/error.h"
#include "strata/log.h"

namespace strata::comm {
namespace {

// Gloo's store interface over the launch's TCP store.
class RendezvousStore final : public gloo::rendezvous::Store {
 public:
  RendezvousStore(TcpStore& store, double timeout_s) : store_(store), timeout_s_(timeout_s) {}
  void set(const std::string& key, const std::vector<char>& data) override {
    store_.set(key, std::string(data.begin(), data.end()));
  }
  std::vector<char> get(const std::string& key) override {
    const std::string v = store_.get(key, timeout_s_);
    return {v.begin(), v.end()};
  }
  void wait(const std::vector<std::string>& keys) override {
    for (const auto& k : keys) store_.get(k, timeout_s_);
  }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& t) override {
    for (const auto& k : keys) store_.get(k, std::chrono::duration<double>(t).count());
  }

 private:
  TcpStore& store_;
  double timeout_s_;
};

bool is_16bit(DType t) { return t == DType::kBF16 || t == DType::kF16; }

template <typename T>
void reduce_into(ReduceOp op, void* c, const void* a, const void* b, std::size_t n) {
  auto* z = static_cast<T*>(c);
  const auto* x = static_cast<const T*>(a);
  const auto* y = static_cast<const T*>(b);
  if (op == ReduceOp::kMax)
    for (std::size_t i = 0; i < n; ++i) z[i] = x[i] > y[i] ? x[i] : y[i];
  else
    for (std::size_t i = 0; i < n; ++i) z[i] = x[i] + y[i];
}

// Communicators made in this process: each gets its own key prefix in the store (every rank
// makes them in the same order, as make_communicator's contract says).
std::atomic<int> g_made{0};

// A full mesh of Gloo pairs among `size` ranks (this one `rank`) through the rendezvous store,
// under the store keys' `prefix`.
std::shared_ptr<gloo::Context> connect(TcpStore& store, int rank, int size,
                                       const std::string& prefix, double timeout_s) {
  auto ctx = std::make_shared<gloo::rendezvous::Context>(rank, size);
  ctx->setTimeout(std::chrono::milliseconds(std::int64_t(timeout_s * 1000)));
  gloo::transport::tcp::attr attr;
  attr.hostname = store.local_address();
  auto dev = gloo::transport::tcp::CreateDevice(attr);
  RendezvousStore rs(store, timeout_s);
  gloo::rendezvous::PrefixStore prefixed(prefix, rs);
  ctx->connectFullMesh(prefixed, dev);
  return ctx;
}

// "rank 1 on b (10.0.0.2), ...": the first 8 ranks of `world` (ranks of the rendezvous) other
// than `me`, where they joined from.
std::string peers_of(TcpStore& store, const std::vector<int>& world, int me) {
  std::string peers;
  int listed = 0;
  for (int r = 0; r < int(world.size()) && listed < 8; ++r)
    if (r != me) {
      peers += fmt::format("{}rank {} on {}", listed ? ", " : "", r, store.where(world[r]));
      ++listed;
    }
  if (int(world.size()) - 1 > listed)
    peers += fmt::format(" and {} more", int(world.size()) - 1 - listed);
  return peers;
}

class GlooCommunicator final : public Communicator {
 public:
  // `ranks`: each rank's rank in the rendezvous (the launch's); `prefix`: its store keys'.
  GlooCommunicator(Device& device, double timeout_s, std::shared_ptr<gloo::Context> ctx,
                   TcpStore& store, std::vector<int> ranks, std::string prefix)
      : Communicator(CommBackend::kGloo, device, ctx->rank, ctx->size, timeout_s),
        ctx_(std::move(ctx)),
        timeout_(std::chrono::milliseconds(std::int64_t(timeout_s * 1000))),
        store_(store),
        ranks_(std::move(ranks)),
        prefix_(std::move(prefix)),
        peers_(peers_of(store_, ranks_, ctx_->rank)),
        worker_(
            rank(), world_size(), timeout_s,
            [this](const Collective& c) {
              // Gloo names a peer by address where it knows one (a closed connection), not on a
              // timeout: say which ranks are where.
              try {
                execute(c);
              } catch (const gloo::Exception& e) {
                throw std::runtime_error(fmt::format("{} (the other ranks: {})", e.what(), peers_));
              }
            },
            fmt::format(" (the other ranks: {})", peers_)) {}

 protected:
  bool accepts_host_memory() const noexcept override { return true; }
  void do_enqueue(const Collective& c, Stream& stream) override { worker_.enqueue(c, stream); }

  // A new mesh among the members, under store keys of its own (the n-th split of this one, its
  // color): the pairs of this one stay untouched.
  std::unique_ptr<Communicator> do_split(int color, const std::vector<int>& members) override {
    const int me = int(std::find(members.begin(), members.end(), rank()) - members.begin());
    const std::string prefix = fmt::format("{}/split{}/{}", prefix_, splits_++, color);
    std::vector<int> ranks;
    for (int m : members) ranks.push_back(ranks_[std::size_t(m)]);
    try {
      auto ctx = connect(store_, me, int(members.size()), prefix, timeout_s());
      return std::make_unique<GlooCommunicator>(device(), timeout_s(), std::move(ctx), store_,
                                                std::move(ranks), prefix);
    } catch (const gloo::Exception& e) {
      STRATA_THROW(kIo,
                   "Communicator::split: rank {} of {} could not connect Gloo's pairs to {} "
                   "peer(s) of its group (through the rendezvous at {}): {}",
                   rank(), world_size(), members.size() - 1, store_.endpoint(), e.what());
    }
  }

 private:
  // fp32 (or fp64) scratch slot `i`, kept for the next call (worker only).
  void* scratch(std::size_t i, std::size_t bytes) {
    if (scratch_.size() <= i) scratch_.resize(i + 1);
    if (scratch_[i].size() < (bytes + 7) / 8) scratch_[i].resize((bytes + 7) / 8);
    return scratch_[i].data();
  }

  // All-reduce of n elements of fp32 or fp64 at p, in place.
  void allreduce(DType t, void* p, std::size_t n, ReduceOp op) {
    gloo::AllreduceOptions o(ctx_);
    o.setTag(next_tag_++);
    o.setTimeout(timeout_);
    if (t == DType::kF64) {
      o.setOutput(static_cast<double*>(p), n);
      o.setReduceFunction([op](void* c, const void* a, const void* b, std::size_t k) {
        reduce_into<double>(op, c, a, b, k);
      });
    } else {
      o.setOutput(static_cast<float*>(p), n);
      o.setReduceFunction([op](void* c, const void* a, const void* b, std::size_t k) {
        reduce_into<float>(op, c, a, b, k);
      });
    }
    gloo::allreduce(o);
  }

  // The reduction of `in` (n elements of t) into wide scratch (fp32, or fp64 for fp64), averaged
  // when asked: the caller rounds or copies out what it keeps.
  void* reduce_wide(const TensorRef& in, ReduceOp op, std::size_t slot) {
    const DType t = in.dtype;
    const DType wide = t == DType::kF64 ? DType::kF64 : DType::kF32;
    void* s = scratch(slot, in.numel * dtype_size(wide));
    if (is_16bit(t))
      cpu::cast(t, in.mem.ptr, DType::kF32, s, in.numel);
    else
      std::memcpy(s, in.mem.ptr, in.numel * dtype_size(t));
    allreduce(wide, s, in.numel, op);
    if (op == ReduceOp::kAvg) {
      if (wide == DType::kF64) {
        auto* d = static_cast<double*>(s);
        for (std::size_t i = 0; i < in.numel; ++i) d[i] /= world_size();
      } else {
        cpu::scale(1.0f / float(world_size()), DType::kF32, s, in.numel);
      }
    }
    return s;
  }

  void execute(const Collective& c) {
    if (c.kind == Kind::kBarrier) {
      gloo::BarrierOptions o(ctx_);
      o.setTag(next_tag_++);
      o.setTimeout(timeout_);
      gloo::barrier(o);
      return;
    }
    for (std::size_t i = 0; i < c.inputs.size(); ++i) {
      const TensorRef& in = c.inputs[i];
      const DType t = in.dtype;
      const std::size_t es = dtype_size(t), bytes = in.numel * es;
      auto* in_p = static_cast<std::uint8_t*>(in.mem.ptr);
      if (in.numel == 0) continue;  // every rank passes the same sizes: every rank skips it
      switch (c.kind) {
        case Kind::kBarrier:
          break;
        case Kind::kBroadcast: {
          gloo::BroadcastOptions o(ctx_);
          o.setTag(next_tag_++);
          o.setTimeout(timeout_);
          o.setRoot(c.root);
          o.setOutput(in_p, bytes);  // in place on every rank
          gloo::broadcast(o);
          break;
        }
        case Kind::kGather: {
          gloo::GatherOptions o(ctx_);
          o.setTag(next_tag_++);
          o.setTimeout(timeout_);
          o.setRoot(c.root);
          std::uint8_t* src = in_p;
          if (!c.outputs.empty()) {
            auto* out = static_cast<std::uint8_t*>(c.outputs[i].mem.ptr);
            if (in_p ==
                out + std::size_t(rank()) * bytes) {  // in place: Gather copies it over itself
              src = static_cast<std::uint8_t*>(scratch(0, bytes));
              std::memcpy(src, in_p, bytes);
            }
            o.setOutput(out, bytes * std::size_t(world_size()));
          }
          o.setInput(src, bytes);
          gloo::gather(o);
          break;
        }
        case Kind::kAllGather: {
          const TensorRef& out = c.outputs[i];
          auto* out_p = static_cast<std::uint8_t*>(out.mem.ptr);
          gloo::AllgatherOptions o(ctx_);
          o.setTag(next_tag_++);
          o.setTimeout(timeout_);
          // No input: in place, this rank's block already in the output.
          if (in_p != out_p + std::size_t(rank()) * bytes) o.setInput(in_p, bytes);
          o.setOutput(out_p, bytes * std::size_t(world_size()));
          gloo::allgather(o);
          break;
        }
        case Kind::kAllReduce: {
          if (!is_16bit(t) && c.op != ReduceOp::kAvg) {
            allreduce(t, in_p, in.numel, c.op);
          } else {
            void* s = reduce_wide(in, c.op, 0);
            if (is_16bit(t))
              cpu::cast(DType::kF32, s, t, in_p, in.numel);
            else
              std::memcpy(in_p, s, bytes);
          }
          break;
        }
        case Kind::kReduceScatter: {
          const TensorRef& out = c.outputs[i];
          const DType wide = t == DType::kF64 ? DType::kF64 : DType::kF32;
          const auto* s = static_cast<const std::uint8_t*>(reduce_wide(in, c.op, 0));
          const std::uint8_t* mine = s + std::size_t(rank()) * out.numel * dtype_size(wide);
          if (is_16bit(t))
            cpu::cast(DType::kF32, mine, t, out.mem.ptr, out.numel);
          else
            std::memcpy(out.mem.ptr, mine, out.numel * es);
          break;
        }
      }
    }
  }

  std::shared_ptr<gloo::Context> ctx_;
  std::chrono::milliseconds timeout_;
  TcpStore& store_;
  std::vector<int> ranks_;      // each rank's rank in the rendezvous
  std::string prefix_;          // its store keys'
  int splits_ = 0;              // split() calls so far (every rank's alike: it is collective)
  std::string peers_;           // "rank 1 on b (10.0.0.2), ...": for error messages
  std::uint32_t next_tag_ = 1;  // worker only
  std::vector<std::vector<std::uint64_t>> scratch_;  // worker only; 8-byte aligned
  CollectiveWorker worker_;                          // last: its thread runs execute()
};

}  // namespace

std::unique_ptr<Communicator> make_gloo_communicator(Device& device, double timeout_s) {
  const LaunchInfo li = init_launch();
  TcpStore* store = rendezvous_store();
  STRATA_REQUIRE(
      store && li.world_size > 1,
      "the gloo communicator joins the ranks of a launch without MPI (torchrun: RANK, "
      "WORLD_SIZE, MASTER_ADDR, MASTER_PORT; or srun without --mpi), and this process was "
      "started by {} as rank {} of {}; use the {} communicator",
      li.launcher, li.rank, li.world_size, li.under_mpi ? "mpi" : "local");
  const int n = g_made++;
  try {
    const std::string prefix = fmt::format("gloo/{}", n);
    auto ctx = connect(*store, li.rank, li.world_size, prefix, timeout_s);
    install_termination_note(li.rank, li.world_size);
    log::debug("gloo communicator: rank {} of {} at {}, timeout {} s", li.rank, li.world_size,
               store->local_address(), timeout_s);
    std::vector<int> ranks(std::size_t(li.world_size));
    for (int r = 0; r < li.world_size; ++r) ranks[std::size_t(r)] = r;
    return std::make_unique<GlooCommunicator>(device, timeout_s, std::move(ctx), *store,
                                              std::move(ranks), prefix);
  } catch (const gloo::Exception& e) {
    STRATA_THROW(kIo,
                 "rank {} of {} could not connect Gloo's pairs to its peers (through the "
                 "rendezvous at {}): {}",
                 li.rank, li.world_size, store->endpoint(), e.what());
  }
}

}  // namespace strata::comm
