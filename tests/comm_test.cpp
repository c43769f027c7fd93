// The collectives suite: every collective, dtype and odd size against a result computed
// locally, coalesced against individual calls, and a collective overlapping work on another
// stream ordered only by events. Run by ctest as one process (local backend), under
// `mpirun -np 2` / `-np 4` (MPI backend on the CPU-emulated device) and as 2 / 4 ranks with
// torchrun's variables (torchrun_ranks.sh: Gloo backend over the TCP rendezvous); built again with
// -DSTRATA_TEST_CUDA as comm_gpu_test (NCCL, one rank; skipped without a GPU).
//
// Exact expectations: inputs are random non-zero multiples of 2^-8 of magnitude <= 8,
// rounded to the dtype. Every partial sum of up to 4 of them is a multiple of 2^-8 below
// 2^6, which fp32 holds exactly, so the fp32 sum does not depend on the reduction order
// and the expected result is that exact sum rounded once to the dtype (RNE): results are
// compared bit for bit. Avg divides by a power of two (2 or 4 ranks): exact as well.
//
// Every rank runs every test; only rank 0 prints the full report, other ranks print their
// failures. main() agrees on the outcome over the communicator, so a failure on any rank
// fails every process and thus mpirun.
#include "strata/comm.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <future>
#include <map>
#include <thread>
#include <vector>

#include "comm/comm_internal.h"
#include "gpu/nccl_version.h"
#include "strata/device.h"
#include "strata/error.h"
#include "strata/trace.h"
#include "test_util.h"

namespace strata {
namespace {

using namespace std::chrono_literals;

struct Env {
  LaunchInfo launch;
  std::unique_ptr<Device> device;
  std::unique_ptr<Communicator> comm;
};
Env* g_env = nullptr;

std::uint64_t splitmix(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

float to_dtype_and_back(DType t, float v) {
  switch (t) {
    case DType::kBF16:
      return bf16_to_f32(f32_to_bf16(v));
    case DType::kF16:
      return f16_to_f32(f32_to_f16(v));
    default:
      return v;
  }
}

// Rank r's input element i for test `seed`: a non-zero multiple of 2^-8 in [-8, 8], exact in t.
float value(DType t, std::uint64_t seed, int r, std::size_t i) {
  const std::uint64_t h = splitmix(seed * 0x100000001b3ull ^ splitmix(std::uint64_t(r) << 40 ^ i));
  int k = int(h % 4001) - 2000;
  if (k == 0) k = 1;
  return to_dtype_and_back(t, float(k) / 256.0f);
}

// Elements [first, first + n) of rank r's input (from 0 unless a block of it is wanted).
std::vector<float> values(DType t, std::uint64_t seed, int r, std::size_t n,
                          std::size_t first = 0) {
  std::vector<float> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = value(t, seed, r, first + i);
  return v;
}

// fp32 values -> the bytes of dtype t (RNE), and back.
std::vector<std::uint8_t> encode(DType t, const std::vector<float>& v) {
  std::vector<std::uint8_t> out(v.size() * dtype_size(t));
  for (std::size_t i = 0; i < v.size(); ++i) {
    if (t == DType::kF32) {
      std::memcpy(&out[i * 4], &v[i], 4);
    } else {
      const std::uint16_t h = t == DType::kBF16 ? f32_to_bf16(v[i]) : f32_to_f16(v[i]);
      std::memcpy(&out[i * 2], &h, 2);
    }
  }
  return out;
}

class Collectives : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!g_env || !g_env->comm) GTEST_SKIP() << "no device for this suite (no usable GPU)";
    comm = g_env->comm.get();
    dev = g_env->device.get();
    s = dev->create_stream("comm");
    W = comm->world_size();
    R = comm->rank();
  }

  Buffer upload(DType t, const std::vector<float>& v) {
    const auto bytes = encode(t, v);
    Buffer b = dev->alloc(bytes.size());
    s->copy(b.ref(), host_ref(bytes.data(), bytes.size()));
    s->synchronize();
    return b;
  }
  std::vector<std::uint8_t> download(const Buffer& b, std::size_t bytes, std::size_t offset = 0) {
    std::vector<std::uint8_t> out(bytes);
    s->copy(host_ref(out.data(), bytes), b.ref(offset, bytes));
    s->synchronize();
    return out;
  }
  // Index of the first differing element (of size es), or -1.
  static long first_diff(const std::vector<std::uint8_t>& a, const std::vector<std::uint8_t>& b,
                         std::size_t es) {
    if (a.size() != b.size()) return 0;
    if (std::memcmp(a.data(), b.data(), a.size()) == 0) return -1;
    for (std::size_t i = 0; i < a.size() / es; ++i)
      if (std::memcmp(&a[i * es], &b[i * es], es) != 0) return long(i);
    return 0;
  }

  // Every rank's values(t, seed, r, n), rank after rank: what a gather or all-gather yields.
  std::vector<float> gathered(DType t, std::uint64_t seed, std::size_t n) {
    std::vector<float> out;
    for (int r = 0; r < W; ++r) {
      const auto v = values(t, seed, r, n);
      out.insert(out.end(), v.begin(), v.end());
    }
    return out;
  }

  // The element-wise reduction of every rank's values(t, seed, r, n), rounded to t.
  // Elements [first, first + n) of it: a reduce-scatter's block alone (the whole costs W times as
  // much to compute on every rank, and the 4-rank suites' time went there).
  std::vector<float> reduced(DType t, std::uint64_t seed, std::size_t n, ReduceOp op,
                             std::size_t first = 0) {
    std::vector<float> acc = values(t, seed, 0, n, first);
    for (int r = 1; r < W; ++r) {
      const auto v = values(t, seed, r, n, first);
      for (std::size_t i = 0; i < n; ++i)
        acc[i] = op == ReduceOp::kMax ? std::max(acc[i], v[i]) : acc[i] + v[i];
    }
    if (op == ReduceOp::kAvg)
      for (float& x : acc) x /= float(W);
    return acc;  // exact in fp32 (see the file comment); encode() rounds to t
  }

  Communicator* comm = nullptr;
  Device* dev = nullptr;
  std::unique_ptr<Stream> s;
  int W = 1, R = 0;
};

const DType kDtypes[] = {DType::kF32, DType::kBF16, DType::kF16};
const std::size_t kSizes[] = {1, 7, 1000003};
const ReduceOp kOps[] = {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax};

std::string label(DType t, std::size_t n) { return fmt::format("{} n={}", dtype_name(t), n); }

TEST_F(Collectives, LaunchAndBackend) {
  const LaunchInfo& li = g_env->launch;
  EXPECT_EQ(comm->rank(), li.rank);
  EXPECT_EQ(comm->world_size(), li.world_size);
  EXPECT_GE(li.local_rank, 0);
  EXPECT_LT(li.local_rank, li.local_size);
  if (const char* env = std::getenv("OMPI_COMM_WORLD_SIZE")) {
    EXPECT_TRUE(li.under_mpi);
    EXPECT_EQ(li.world_size, std::atoi(env));
    EXPECT_EQ(li.rank, std::atoi(std::getenv("OMPI_COMM_WORLD_RANK")));
  }
  if (const char* env = std::getenv("WORLD_SIZE"); env && !li.under_mpi) {
    EXPECT_EQ(li.launcher, "torchrun");
    EXPECT_EQ(li.world_size, std::atoi(env));
    EXPECT_EQ(li.rank, std::atoi(std::getenv("RANK")));
  }
  if (const char* env = std::getenv("SLURM_STEP_NUM_TASKS"); env && !li.under_mpi) {
    EXPECT_EQ(li.launcher, "slurm");
    EXPECT_EQ(li.world_size, std::atoi(env));
    EXPECT_EQ(li.rank, std::atoi(std::getenv("SLURM_PROCID")));
    EXPECT_EQ(li.master_addr, "localhost");
  }
  if (dev->kind() == DeviceKind::kCuda)
    EXPECT_EQ(comm->backend(), CommBackend::kNccl);
  else if (li.under_mpi)
    EXPECT_EQ(comm->backend(), CommBackend::kMpi);
  else
    EXPECT_EQ(comm->backend(), li.world_size > 1 ? CommBackend::kGloo : CommBackend::kLocal);
}

TEST_F(Collectives, AllGather) {
  for (DType t : kDtypes)
    for (std::size_t n : kSizes) {
      const std::uint64_t seed = 100 + n + std::size_t(t);
      Buffer in = upload(t, values(t, seed, R, n));
      Buffer out = dev->alloc(n * W * dtype_size(t));
      Event e = comm->all_gather(tensor(in, t, n), tensor(out, t, n * W), *s);
      e.synchronize();
      const std::vector<float> expect = gathered(t, seed, n);
      EXPECT_EQ(first_diff(download(out, out.size()), encode(t, expect), dtype_size(t)), -1)
          << label(t, n);
    }
}

// Each collective is a span of its own name on its stream's lane while the tracer is on (MPI:
// from the stream reaching it to its end; NCCL: its GPU time). The local backend's one rank
// has nothing to do, and no span. Each span carries the bytes its rank puts in.
TEST_F(Collectives, EachCollectiveIsATraceSpanOfItsName) {
  if (comm->backend() == CommBackend::kLocal)
    GTEST_SKIP() << "one rank, local backend: collectives do nothing";
  const std::size_t n = 1024;
  Buffer in = upload(DType::kF32, values(DType::kF32, 7, R, n));
  Buffer all = dev->alloc(n * W * 4);
  Tracer& t = Tracer::global();
  t.clear();
  t.set_enabled(true);
  comm->all_gather(tensor(in, DType::kF32, n), tensor(all, DType::kF32, n * W), *s);
  comm->reduce_scatter(tensor(all, DType::kF32, n * W), tensor(in, DType::kF32, n), ReduceOp::kSum,
                       *s);
  comm->all_reduce(tensor(in, DType::kF32, n), ReduceOp::kSum, *s);
  comm->broadcast(tensor(in, DType::kF32, n), 0, *s);
  s->synchronize();
  t.set_enabled(false);
  std::map<std::string, int> seen;
  std::map<std::string, std::uint64_t> bytes;
  for (const TraceSpan& sp : t.spans())
    if (sp.lane == s->name()) {
      ++seen[sp.name];
      bytes[sp.name] += sp.bytes;
    }
  t.clear();
  for (const char* name : {"all_gather", "reduce_scatter", "all_reduce", "broadcast"})
    EXPECT_EQ(seen[name], 1) << name << " on lane " << s->name();
  // Each with the bytes this rank puts in (they were 0).
  EXPECT_EQ(bytes["all_gather"], n * 4);
  EXPECT_EQ(bytes["reduce_scatter"], n * W * 4);
  EXPECT_EQ(bytes["all_reduce"], n * 4);
  EXPECT_EQ(bytes["broadcast"], n * 4);
}

TEST_F(Collectives, AllReduce) {
  for (DType t : kDtypes)
    for (std::size_t n : kSizes)
      for (ReduceOp op : kOps) {
        const std::uint64_t seed = 200 + n * 3 + std::size_t(op) * 7 + std::size_t(t);
        Buffer x = upload(t, values(t, seed, R, n));
        comm->all_reduce(tensor(x, t, n), op, *s).synchronize();
        EXPECT_EQ(
            first_diff(download(x, x.size()), encode(t, reduced(t, seed, n, op)), dtype_size(t)),
            -1)
            << label(t, n) << " " << reduce_op_name(op);
      }
}

TEST_F(Collectives, ReduceScatter) {
  for (DType t : kDtypes)
    for (std::size_t n : kSizes)
      for (ReduceOp op : kOps) {
        const std::uint64_t seed = 300 + n * 3 + std::size_t(op) * 7 + std::size_t(t);
        Buffer in = upload(t, values(t, seed, R, n * W));
        Buffer out = dev->alloc(n * dtype_size(t));
        comm->reduce_scatter(tensor(in, t, n * W), tensor(out, t, n), op, *s).synchronize();
        const auto mine = reduced(t, seed, n, op, R * n);
        EXPECT_EQ(first_diff(download(out, out.size()), encode(t, mine), dtype_size(t)), -1)
            << label(t, n) << " " << reduce_op_name(op);
      }
}

TEST_F(Collectives, Broadcast) {
  for (DType t : kDtypes)
    for (std::size_t n : kSizes) {
      const std::uint64_t seed = 400 + n + std::size_t(t);
      const int root = W - 1;
      Buffer x = upload(t, values(t, seed, R, n));
      comm->broadcast(tensor(x, t, n), root, *s).synchronize();
      EXPECT_EQ(
          first_diff(download(x, x.size()), encode(t, values(t, seed, root, n)), dtype_size(t)), -1)
          << label(t, n);
    }
}

// gather: the root alone receives every rank's block, out of place and in place; the others pass
// no output; an output on a non-root rank, or none on the root, is refused before queueing.
TEST_F(Collectives, GatherToOneRoot) {
  for (DType t : kDtypes)
    for (std::size_t n : kSizes) {
      const std::uint64_t seed = 450 + n + std::size_t(t);
      const int root = W - 1;
      Buffer in = upload(t, values(t, seed, R, n));
      Buffer out = R == root ? dev->alloc(n * W * dtype_size(t)) : Buffer();
      comm->gather(tensor(in, t, n), R == root ? tensor(out, t, n * W) : TensorRef{}, root, *s)
          .synchronize();
      if (R != root) continue;
      const std::vector<float> expect = gathered(t, seed, n);
      EXPECT_EQ(first_diff(download(out, out.size()), encode(t, expect), dtype_size(t)), -1)
          << label(t, n);
    }
  // In place on rank 0: its input is block 0 of the output.
  const DType t = DType::kF32;
  const std::size_t n = 1001;
  const std::uint64_t seed = 470;
  std::vector<float> init(R == 0 ? n * W : n, 0.0f);
  const auto mine = values(t, seed, R, n);
  std::copy(mine.begin(), mine.end(), init.begin());
  Buffer buf = upload(t, init);
  comm->gather(tensor(buf, t, n), R == 0 ? tensor(buf, t, n * W) : TensorRef{}, 0, *s)
      .synchronize();
  if (R == 0) {
    const std::vector<float> expect = gathered(t, seed, n);
    EXPECT_EQ(first_diff(download(buf, n * W * 4), encode(t, expect), 4), -1) << "in place";
  }
  Buffer a = dev->alloc(64 * 4), b = dev->alloc(64 * 4 * std::size_t(W));
  const ErrorKind wrong_side = [&] {
    try {
      // The root without an output, every other rank with one: each is refused on its own rank.
      comm->gather(tensor(a, t, 64), R == 0 ? TensorRef{} : tensor(b, t, 64 * std::size_t(W)), 0,
                   *s);
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("only the root (rank 0) passes one"), std::string::npos)
          << e.what();
      return e.kind();
    }
    return ErrorKind::kInternal;
  }();
  EXPECT_EQ(wrong_side, ErrorKind::kInvalidArgument);
}

TEST_F(Collectives, BarrierWaitsForTheLastRank) {
  // Rank 0 arrives 1 s late; nobody may leave the barrier before it arrived. (A lower bound only:
  // a correctness property, not a speed claim. The margin is for a rank that leaves the aligning
  // barrier late: four ranks share two cores.)
  if (W == 1) GTEST_SKIP() << "one rank: nothing to wait for";
  comm->barrier(*s).synchronize();  // align the start
  const auto t0 = std::chrono::steady_clock::now();
  if (R == 0) std::this_thread::sleep_for(1s);
  comm->barrier(*s).synchronize();
  EXPECT_GE(std::chrono::steady_clock::now() - t0, 250ms);
}

// The host-side helpers the trainer agrees through: every rank's string in rank order (lengths
// differ, one is empty, bytes above 127 and NUL kept), one rank's text on every rank, and the
// maximum of every rank's values.
TEST_F(Collectives, StringsAndMaximaAcrossRanks) {
  const auto mine = [](int r) {
    if (r == 1) return std::string();
    std::string t = fmt::format("host-{}", r) + std::string(std::size_t(r % 3), 'x');
    t += '\0';
    t += "\xc3\xa9";
    return t;
  };
  const std::vector<std::string> all = strings_across_ranks(*comm, mine(R));
  ASSERT_EQ(all.size(), std::size_t(W));
  for (int r = 0; r < W; ++r) EXPECT_EQ(all[std::size_t(r)], mine(r)) << "rank " << r;
  const std::string text = R == 1 % W ? std::string(5000, 'q') + "\xff end" : "not sent";
  EXPECT_EQ(broadcast_string(*comm, text, 1 % W), std::string(5000, 'q') + "\xff end");
  std::vector<double> v = {double(R), -double(R), 0.5};
  max_across_ranks(*comm, v);
  EXPECT_EQ(v[0], double(W - 1));
  EXPECT_EQ(v[1], 0.0);
  EXPECT_EQ(v[2], 0.5);
}

// split(): the ranks of one color as a communicator of their own, ranked by key (here the reverse
// of their rank); its collectives reach its members only, and the parent stays usable.
TEST_F(Collectives, SplitGroupsTheRanksOfAColorInKeyOrder) {
  const int color = R % 2;
  std::unique_ptr<Communicator> sub = comm->split(color, -R);
  std::vector<int> members;  // this color's ranks in key order
  for (int r = W - 1; r >= 0; --r)
    if (r % 2 == color) members.push_back(r);
  ASSERT_EQ(sub->world_size(), int(members.size()));
  EXPECT_EQ(members[std::size_t(sub->rank())], R);
  EXPECT_EQ(sub->backend(), comm->backend());
  // Each member's rank, gathered in the group's order.
  std::vector<double> mine = {double(R)};
  Buffer in = dev->alloc(8), out = dev->alloc(8 * members.size());
  s->copy(in.ref(), host_ref(mine.data(), 8));
  sub->all_gather(tensor(in, DType::kF64, 1), tensor(out, DType::kF64, members.size()), *s);
  std::vector<double> got(members.size());
  s->copy(host_ref(got.data(), 8 * got.size()), out.ref());
  s->synchronize();
  for (std::size_t i = 0; i < members.size(); ++i) EXPECT_EQ(got[i], members[i]) << i;
  // The parent still reduces over everyone.
  std::vector<double> v = {1.0};
  max_across_ranks(*comm, v);
  Buffer one = upload(DType::kF32, {1.0f});
  comm->all_reduce(tensor(one, DType::kF32, 1), ReduceOp::kSum, *s).synchronize();
  EXPECT_EQ(download(one, 4), encode(DType::kF32, {float(W)}));
  testing::expect_error([&] { comm->split(-1, 0); }, {"color -1 is negative"});
}

// Tensor x data parallelism: TP groups of consecutive ranks, DP groups of the ranks with the
// same TP rank; a TP that does not divide the world is refused on every rank.
TEST_F(Collectives, ProcessGroupsArrangeTensorTimesDataParallel) {
  // Every rank on a host of its own (comm_gloo_tp_across_nodes): a TP group of two spans nodes.
  const bool host_per_rank = std::getenv("STRATA_TEST_HOST_PER_RANK") != nullptr;
  for (int tp = 1; tp <= W; ++tp) {
    if (host_per_rank && tp > 1 && W % tp == 0) {
      testing::expect_error([&] { make_process_groups(*comm, tp); },
                            {fmt::format("tensor parallelism of {} puts ranks 0 to {} in one "
                                         "group, and they are on different nodes (rank 0 on "
                                         "strata-host-0, rank 1 on strata-host-1)",
                                         tp, tp - 1),
                             "tensor parallelism stays within a node"});
      continue;
    }
    if (W % tp != 0) {
      testing::expect_error(
          [&] { make_process_groups(*comm, tp); },
          {fmt::format("tensor parallelism of {} does not divide the job's {} ranks", tp, W)});
      continue;
    }
    ProcessGroups pg = make_process_groups(*comm, tp);
    EXPECT_EQ(pg.tp_size, tp);
    EXPECT_EQ(pg.dp_size, W / tp);
    EXPECT_EQ(pg.tp_rank, R % tp);
    EXPECT_EQ(pg.dp_rank, R / tp);
    ASSERT_EQ(pg.tp->world_size(), tp);
    ASSERT_EQ(pg.dp->world_size(), W / tp);
    EXPECT_EQ(pg.tp->rank(), pg.tp_rank);
    EXPECT_EQ(pg.dp->rank(), pg.dp_rank);
    // The sum of the ranks of each group.
    std::vector<double> a = {double(R)}, b = {double(R)};
    Buffer ta = dev->alloc(8), tb = dev->alloc(8);
    s->copy(ta.ref(), host_ref(a.data(), 8));
    s->copy(tb.ref(), host_ref(b.data(), 8));
    Tracer& tr = Tracer::global();
    tr.clear();
    tr.set_enabled(true);
    pg.tp->all_reduce(tensor(ta, DType::kF64, 1), ReduceOp::kSum, *s);
    pg.dp->all_reduce(tensor(tb, DType::kF64, 1), ReduceOp::kSum, *s);
    s->copy(host_ref(a.data(), 8), ta.ref());
    s->copy(host_ref(b.data(), 8), tb.ref());
    s->synchronize();
    tr.set_enabled(false);
    // The trace tells the groups apart under TP > 1 ("tp." / "dp."); under TP 1 the DP group is
    // the job, its spans named as the job's. (A group of one rank may or may not record one.)
    std::map<std::string, int> seen;
    for (const TraceSpan& sp : tr.spans())
      if (sp.name.find("all_reduce") != std::string::npos) ++seen[sp.name];
    tr.clear();
    EXPECT_EQ(pg.tp->group(),
              tp > 1 ? Communicator::Group::kTensorParallel : Communicator::Group::kJob);
    if (comm->backend() != CommBackend::kLocal) {
      const int plain = seen["all_reduce"], tps = seen["tp.all_reduce"],
                dps = seen["dp.all_reduce"];
      if (tp > 1) {
        EXPECT_EQ(tps, 1) << "tp " << tp;
        EXPECT_EQ(plain, 0) << "tp " << tp;
        if (W / tp > 1) {
          EXPECT_EQ(dps, 1) << "tp " << tp;
        }
      } else {
        EXPECT_GE(plain, 1) << "tp " << tp;
        EXPECT_EQ(tps + dps, 0) << "tp " << tp;
      }
    }
    double want_tp = 0, want_dp = 0;
    for (int r = 0; r < W; ++r) {
      if (r / tp == R / tp) want_tp += r;
      if (r % tp == R % tp) want_dp += r;
    }
    EXPECT_EQ(a[0], want_tp) << "tp " << tp;
    EXPECT_EQ(b[0], want_dp) << "tp " << tp;
  }
  testing::expect_error([&] { make_process_groups(*comm, 0); },
                        {"tensor parallelism of 0 does not divide"});
}

// ZeRO's flat buffers: numel not divisible by the world size, padded with zeros to
// W * shard; each rank owns one shard. Gather restores the flat tensor, reduce-scatter
// leaves each rank the sum of its shard (and zeros in the padding).
TEST_F(Collectives, UnevenShardsByPadding) {
  for (DType t : kDtypes)
    for (std::size_t numel : kSizes) {
      const std::size_t shard = (numel + W - 1) / W, padded = shard * W;
      const std::uint64_t seed = 500 + numel + std::size_t(t);
      // The flat tensor every rank holds (same on all ranks for gather: rank 0's values).
      std::vector<float> flat = values(t, seed, 0, numel);
      flat.resize(padded, 0.0f);
      const std::vector<float> my_shard(flat.begin() + R * shard, flat.begin() + (R + 1) * shard);
      Buffer sh = upload(t, my_shard);
      Buffer gathered = dev->alloc(padded * dtype_size(t));
      comm->all_gather(tensor(sh, t, shard), tensor(gathered, t, padded), *s).synchronize();
      EXPECT_EQ(
          first_diff(download(gathered, padded * dtype_size(t)), encode(t, flat), dtype_size(t)),
          -1)
          << "gather " << label(t, numel);

      std::vector<float> grads = values(t, seed + 1, R, numel);
      grads.resize(padded, 0.0f);
      Buffer g = upload(t, grads);
      Buffer out = dev->alloc(shard * dtype_size(t));
      comm->reduce_scatter(tensor(g, t, padded), tensor(out, t, shard), ReduceOp::kSum, *s)
          .synchronize();
      std::vector<float> expect = reduced(t, seed + 1, numel, ReduceOp::kSum);
      expect.resize(padded, 0.0f);
      const std::vector<float> mine(expect.begin() + R * shard, expect.begin() + (R + 1) * shard);
      EXPECT_EQ(first_diff(download(out, out.size()), encode(t, mine), dtype_size(t)), -1)
          << "reduce_scatter " << label(t, numel);
    }
}

TEST_F(Collectives, InPlaceLayouts) {
  for (DType t : {DType::kF32, DType::kBF16}) {
    const std::size_t n = 1001;
    const std::size_t es = dtype_size(t);
    const std::uint64_t seed = 600 + std::size_t(t);
    // all_gather: the input is block R of the output.
    std::vector<float> init(n * W, 0.0f);
    const auto mine = values(t, seed, R, n);
    std::copy(mine.begin(), mine.end(), init.begin() + R * n);
    Buffer buf = upload(t, init);
    comm->all_gather(tensor(buf, t, n, R * n), tensor(buf, t, n * W), *s).synchronize();
    const std::vector<float> expect = gathered(t, seed, n);
    EXPECT_EQ(first_diff(download(buf, n * W * es), encode(t, expect), es), -1)
        << "all_gather " << dtype_name(t);
    // reduce_scatter: the output is block R of the input.
    Buffer rs = upload(t, values(t, seed + 1, R, n * W));
    comm->reduce_scatter(tensor(rs, t, n * W), tensor(rs, t, n, R * n), ReduceOp::kSum, *s)
        .synchronize();
    const auto block = reduced(t, seed + 1, n, ReduceOp::kSum, R * n);
    EXPECT_EQ(first_diff(download(rs, n * es, R * n * es), encode(t, block), es), -1)
        << "reduce_scatter " << dtype_name(t);
  }
}

TEST_F(Collectives, CoalescedEqualsIndividual) {
  // Three tensors of different sizes and dtypes, in one call and one by one.
  const std::vector<std::pair<DType, std::size_t>> shapes = {
      {DType::kF32, 7}, {DType::kBF16, 1000}, {DType::kF16, 33}};
  auto make = [&](std::uint64_t seed, std::size_t mult) {
    std::vector<Buffer> bufs;
    for (std::size_t i = 0; i < shapes.size(); ++i)
      bufs.push_back(
          upload(shapes[i].first, values(shapes[i].first, seed + i, R, shapes[i].second * mult)));
    return bufs;
  };
  auto outs = [&](std::size_t mult) {
    std::vector<Buffer> bufs;
    for (auto& [t, n] : shapes) bufs.push_back(dev->alloc(n * mult * dtype_size(t)));
    return bufs;
  };
  auto refs = [&](const std::vector<Buffer>& bufs, std::size_t mult) {
    std::vector<TensorRef> r;
    for (std::size_t i = 0; i < shapes.size(); ++i)
      r.push_back(tensor(bufs[i], shapes[i].first, shapes[i].second * mult));
    return r;
  };
  auto same = [&](const std::vector<Buffer>& a, const std::vector<Buffer>& b, const char* what) {
    for (std::size_t i = 0; i < a.size(); ++i)
      EXPECT_EQ(first_diff(download(a[i], a[i].size()), download(b[i], b[i].size()),
                           dtype_size(shapes[i].first)),
                -1)
          << what << " tensor " << i;
  };
  const std::size_t w = std::size_t(W);

  auto ar1 = make(700, 1), ar2 = make(700, 1);
  comm->all_reduce_coalesced(refs(ar1, 1), ReduceOp::kSum, *s);
  for (const TensorRef& t : refs(ar2, 1)) comm->all_reduce(t, ReduceOp::kSum, *s);
  s->synchronize();
  same(ar1, ar2, "all_reduce");
  // And the result is right, not just equal.
  EXPECT_EQ(first_diff(download(ar1[1], ar1[1].size()),
                       encode(DType::kBF16, reduced(DType::kBF16, 701, 1000, ReduceOp::kSum)), 2),
            -1);

  auto ag_in = make(710, 1);
  auto ag1 = outs(w), ag2 = outs(w);
  comm->all_gather_coalesced(refs(ag_in, 1), refs(ag1, w), *s);
  for (std::size_t i = 0; i < shapes.size(); ++i)
    comm->all_gather(refs(ag_in, 1)[i], refs(ag2, w)[i], *s);
  s->synchronize();
  same(ag1, ag2, "all_gather");

  auto rs_in = make(720, w);
  auto rs1 = outs(1), rs2 = outs(1);
  comm->reduce_scatter_coalesced(refs(rs_in, w), refs(rs1, 1), ReduceOp::kAvg, *s);
  for (std::size_t i = 0; i < shapes.size(); ++i)
    comm->reduce_scatter(refs(rs_in, w)[i], refs(rs2, 1)[i], ReduceOp::kAvg, *s);
  s->synchronize();
  same(rs1, rs2, "reduce_scatter");
}

// A collective on one stream runs while another stream is busy, and data moves between the
// streams through events only: compute fills x, the comm stream waits for that event and
// all-reduces x, compute waits for the collective's event and scales x. The compute stream
// is blocked, meanwhile, until the collective has finished: were the collective serialized
// behind compute work, this would never end (the test gives up after 30 s and fails).
TEST_F(Collectives, OverlapsOtherStreamOrderedByEvents) {
  auto compute = dev->create_stream("compute");
  const std::size_t n = 100003;
  Buffer x = dev->alloc(n * 4, compute.get());
  compute->fill(tensor(x, DType::kF32, n), float(R + 1));
  Event filled = compute->record();

  auto collective_done = std::make_shared<std::promise<void>>();
  auto released = std::make_shared<std::atomic<bool>>(false);
  std::shared_future<void> done_future = collective_done->get_future().share();
  // The "kernel": occupies the compute stream until the collective on the other stream ends.
  compute->host_fn([done_future, released] {
    released->store(done_future.wait_for(30s) == std::future_status::ready);
  });

  s->wait(filled);
  Event reduced_ev = comm->all_reduce(tensor(x, DType::kF32, n), ReduceOp::kSum, *s);
  s->host_fn([collective_done] { collective_done->set_value(); });
  compute->wait(reduced_ev);
  compute->scale(2.0f, tensor(x, DType::kF32, n));
  std::vector<float> host(n);
  compute->copy(host_ref(host.data(), n * 4), x.ref());
  compute->synchronize();
  s->synchronize();
  EXPECT_TRUE(released->load()) << "the collective did not run while the other stream was busy";
  const float expect = 2.0f * float(W * (W + 1) / 2);
  std::size_t bad = 0;
  for (float v : host) bad += v != expect;
  EXPECT_EQ(bad, 0u) << "first value " << host[0] << ", expected " << expect;
}

// STRATA_COMM_CHECK=1: ranks that issue different collectives (here one element short on the
// last rank) get an error on every rank naming each rank's call, instead of wrong data; alike
// calls go through with their results unchanged.
TEST_F(Collectives, MismatchedCallsAreNamedUnderCommCheck) {
  if (W == 1) GTEST_SKIP() << "one rank: nothing to compare";
  ::setenv("STRATA_COMM_CHECK", "1", 1);
  std::unique_ptr<Communicator> checked = make_communicator(*dev);
  ::unsetenv("STRATA_COMM_CHECK");
  Buffer b = upload(DType::kF32, values(DType::kF32, 3, R, 1000));
  checked->all_reduce(tensor(b, DType::kF32, 1000), ReduceOp::kSum, *s);
  const auto sum = download(b, 4000);
  EXPECT_EQ(first_diff(sum, encode(DType::kF32, reduced(DType::kF32, 3, 1000, ReduceOp::kSum)), 4),
            -1);
  const std::size_t n = R == W - 1 ? 999 : 1000;
  try {
    checked->all_reduce(tensor(b, DType::kF32, n), ReduceOp::kSum, *s);
    s->synchronize();
    FAIL() << "rank " << R << ": a mismatched all_reduce went through";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("the ranks issued different collectives"), std::string::npos) << m;
    EXPECT_NE(m.find("rank 0: call #2 all_reduce(sum, 1 tensor(s), fp32, 1000 elements)"),
              std::string::npos)
        << m;
    EXPECT_NE(m.find(fmt::format(
                  "rank {}: call #2 all_reduce(sum, 1 tensor(s), fp32, 999 elements)", W - 1)),
              std::string::npos)
        << m;
  }
  // A coalesced call with the same count, first dtype and total, its tensors split differently
  // on the last rank (600 + 400 against 400 + 600): caught by the layout.
  const std::size_t first = R == W - 1 ? 400 : 600;
  const TensorRef parts[2] = {tensor(b, DType::kF32, first),
                              tensor(b, DType::kF32, 1000 - first, first)};
  try {
    checked->all_reduce_coalesced(parts, ReduceOp::kSum, *s);
    s->synchronize();
    FAIL() << "rank " << R << ": a mismatched coalesced all_reduce went through";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("the tensors' dtypes or lengths differ in order"), std::string::npos) << m;
    EXPECT_NE(m.find("rank 0: call #3 all_reduce(sum, 2 tensor(s), fp32, 1000 elements, layout "),
              std::string::npos)
        << m;
  }
}

// The tensors of one coalesced call run at once, not in order: one that the call writes may not
// overlap another of the call ({x, x} summed to 3 or 2 on 2 ranks, where the calls in order
// give 4). Refused at the call, on every rank alike, so nothing is queued.
TEST_F(Collectives, CoalescedTensorsThatOverlapAreRefused) {
  Buffer x = upload(DType::kF32, std::vector<float>(2000, 1.0f));
  const TensorRef same[2] = {tensor(x, DType::kF32, 1000), tensor(x, DType::kF32, 1000)};
  const TensorRef overlapping[2] = {tensor(x, DType::kF32, 1000),
                                    tensor(x, DType::kF32, 1000, 500)};
  for (const auto& parts : {same, overlapping}) {
    try {
      comm->all_reduce_coalesced(std::span<const TensorRef>(parts, 2), ReduceOp::kSum, *s);
      ADD_FAILURE() << "overlapping tensors of one coalesced call were accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
      EXPECT_NE(std::string(e.what()).find("tensor 0 overlaps tensor 1 of the same call"),
                std::string::npos)
          << e.what();
    }
  }
  // Adjacent, not overlapping: fine, and a collective still matches across ranks.
  const TensorRef adjacent[2] = {tensor(x, DType::kF32, 1000), tensor(x, DType::kF32, 1000, 1000)};
  comm->all_reduce_coalesced(std::span<const TensorRef>(adjacent, 2), ReduceOp::kSum, *s)
      .synchronize();
  EXPECT_EQ(
      first_diff(download(x, 8000), encode(DType::kF32, std::vector<float>(2000, float(W))), 4),
      -1);
}

TEST_F(Collectives, BadArgumentsThrowBeforeQueueing) {
  Buffer a = dev->alloc(64 * 4);
  Buffer b = dev->alloc(64 * 4 * W + 4);
  auto kind_of = [](auto&& fn) {
    try {
      fn();
    } catch (const Error& e) {
      return e.kind();
    }
    return ErrorKind::kInternal;
  };
  // Output one element too large for the gather.
  EXPECT_EQ(kind_of([&] {
              comm->all_gather(tensor(a, DType::kF32, 64), tensor(b, DType::kF32, 64 * W + 1), *s);
            }),
            ErrorKind::kInvalidArgument);
  // Mismatched dtypes.
  EXPECT_EQ(kind_of([&] {
              comm->all_gather(tensor(a, DType::kF32, 64), tensor(b, DType::kBF16, 64 * W), *s);
            }),
            ErrorKind::kInvalidArgument);
  // Root outside the job.
  EXPECT_EQ(kind_of([&] { comm->broadcast(tensor(a, DType::kF32, 64), W, *s); }),
            ErrorKind::kInvalidArgument);
  // A stream of another device.
  auto other = make_host_device({});
  auto os = other->create_stream("other");
  EXPECT_EQ(kind_of([&] { comm->all_reduce(tensor(a, DType::kF32, 64), ReduceOp::kSum, *os); }),
            ErrorKind::kInvalidArgument);
  // Nothing was queued by the calls above: a collective still matches across ranks.
  Buffer y = upload(DType::kF32, std::vector<float>(5, 1.0f));
  comm->all_reduce(tensor(y, DType::kF32, 5), ReduceOp::kSum, *s).synchronize();
  EXPECT_EQ(first_diff(download(y, 20), encode(DType::kF32, std::vector<float>(5, float(W))), 4),
            -1);
}

// Non-zero ranks: print failures only, prefixed with the rank.
class RankFailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit RankFailurePrinter(int rank) : rank_(rank) {}
  void OnTestPartResult(const ::testing::TestPartResult& r) override {
    if (r.failed())
      std::fprintf(stderr, "[rank %d] %s:%d: Failure\n%s\n", rank_,
                   r.file_name() ? r.file_name() : "?", r.line_number(), r.summary());
  }

 private:
  int rank_;
};

#ifndef STRATA_TEST_CUDA  // no GPU needed: in the CPU binary only (the gpu one's tests all skip
                          // without one)
// ncclGetVersion's code changed scheme at 2.9; the minimum must read as 2.10.0, and the old
// scheme's codes (2.8.4 = 2804) must not pass for new ones.
// The NCCL backend's wait for a call its non-blocking communicator finishes in the background
// (its bootstrap: a rank that died before joining must end the job at the timeout, not hang).
TEST(WaitInProgress, AsksUntilSettledAndGivesUpAtTheTimeout) {
  using comm::Progress;
  int asks = 0, timeouts = 0;
  EXPECT_EQ(
      comm::wait_in_progress([&] { return ++asks < 5 ? Progress::kInProgress : Progress::kDone; },
                             10, [&](double) { ++timeouts; }),
      Progress::kDone);
  EXPECT_EQ(asks, 5);
  EXPECT_EQ(
      comm::wait_in_progress([] { return Progress::kFailed; }, 10, [&](double) { ++timeouts; }),
      Progress::kFailed);
  EXPECT_EQ(timeouts, 0);
  double waited = 0;
  const auto start = std::chrono::steady_clock::now();
  EXPECT_EQ(comm::wait_in_progress([] { return Progress::kInProgress; }, 0.05,
                                   [&](double w) {
                                     ++timeouts;
                                     waited = w;
                                   }),
            Progress::kFailed);
  const double took =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(timeouts, 1);
  EXPECT_GT(waited, 0.05);
  EXPECT_LT(took, 5.0);  // no hang: at most a millisecond's sleep past the timeout, on any machine
}

TEST(NcclVersion, DecodesBothSchemesAndTheMinimum) {
  using strata::gpu::decode_nccl_version;
  EXPECT_EQ(decode_nccl_version(2804).str(), "2.8.4");
  EXPECT_EQ(decode_nccl_version(20906).str(), "2.9.6");
  EXPECT_EQ(decode_nccl_version(22703).str(), "2.27.3");
  EXPECT_EQ(decode_nccl_version(strata::gpu::kMinNcclCode).str(),
            std::string(strata::gpu::kMinNcclVersion) + ".0");
  EXPECT_LT(2804, strata::gpu::kMinNcclCode);
}
#endif

}  // namespace
}  // namespace strata

int main(int argc, char** argv) {
  using namespace strata;
  ::testing::InitGoogleTest(&argc, argv);
  Env env;
  try {
    env.launch = init_launch();
#ifdef STRATA_TEST_CUDA
    const CudaProbe probe = probe_cuda();
    if (probe.device_count > 0) {
      CudaDeviceOptions o;
      o.ordinal = launch_gpu_ordinal(env.launch, probe.device_count);
      env.device = make_cuda_device(o);
    }
#else
    HostDeviceOptions o;
    o.capacity_bytes = std::size_t(512) << 20;
    o.random_delay_us = 50;  // exposes a missing wait between the streams and the comm worker
    env.device = make_host_device(o);
#endif
    if (env.device) env.comm = make_communicator(*env.device);
  } catch (const Error& e) {
    std::fprintf(stderr, "comm_test: %s\n", e.what());
    return 1;
  }
  g_env = &env;
  if (env.launch.rank != 0) {
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new RankFailurePrinter(env.launch.rank));
  }
  int rc = RUN_ALL_TESTS();
  if (env.comm) {
    // Agree: any rank's failure fails every rank.
    float worst = float(rc);
    auto s = env.device->create_stream("agree");
    Buffer b = env.device->alloc(4);
    s->copy(b.ref(), host_ref(&worst, 4));
    env.comm->all_reduce(tensor(b, DType::kF32, 1), ReduceOp::kMax, *s);
    s->copy(host_ref(&worst, 4), b.ref());
    s->synchronize();
    if (env.launch.rank == 0 && worst != 0 && rc == 0)
      std::fprintf(stderr, "comm_test: another rank failed\n");
    rc = worst != 0 ? 1 : 0;
  }
  env.comm.reset();
  env.device.reset();
  g_env = nullptr;
  return rc;
}
