// strata-bench comm: time per collective and size on whichever backend make_communicator()
// picks (NCCL on a GPU, MPI under mpirun on the CPU-emulated device, local otherwise), and
// algorithm / bus bandwidth as nccl-tests defines them:
//   algbw = size / time, where size is the buffer of all_reduce / broadcast, the gathered
//   output of all_gather and the scattered input of reduce_scatter;
//   busbw = algbw * 2(n-1)/n (all_reduce), * (n-1)/n (all_gather, reduce_scatter), * 1 (broadcast).
// The time of a size is the slowest rank's mean over --iters back-to-back calls. The bound is
// a one-thread memcpy measured in the same run: on one host the MPI "link" is shared memory.
// Run it on every rank (mpirun -np N strata-bench comm); rank 0 prints.
#include <algorithm>
#include <cstdio>
#include <map>
#include <sstream>
#include <vector>

#include "bench_common.h"
#include "strata/comm.h"
#include "strata/device.h"
#include "strata/error.h"
#include "strata/system_info.h"

namespace strata::bench {
// This command's own names: the benchmarks compile as one file (tools/CMakeLists.txt).
namespace comm_cmd {
namespace {

struct CommArgs {
  std::string device = "auto";
  std::string dtype = "fp32";
  std::string min_bytes = "8";
  std::string max_bytes = "256M";
  int factor = 4;
  int iters = 20;
  int warmup = 3;
  std::vector<std::string> ops = {"all_reduce", "all_gather", "reduce_scatter", "broadcast"};
  bool json = false;
};

double bus_factor(const std::string& op, int n) {
  if (n <= 1) return 0;  // one rank moves nothing between ranks (broadcast too: it is a no-op)
  if (op == "all_reduce") return 2.0 * (n - 1) / n;
  if (op == "broadcast") return 1.0;
  return double(n - 1) / n;
}

void run_comm(const CommArgs& a) {
  const LaunchInfo li = init_launch();
  const DType t = parse_dtype(a.dtype);
  const std::size_t es = dtype_size(t);
  const std::size_t min_b = parse_bytes(a.min_bytes, "--min-bytes");
  const std::size_t max_b = parse_bytes(a.max_bytes, "--max-bytes");
  STRATA_REQUIRE(min_b >= 1 && min_b <= max_b,
                 "comm: --min-bytes {} / --max-bytes {}: need 1 <= --min-bytes <= --max-bytes",
                 a.min_bytes, a.max_bytes);
  STRATA_REQUIRE(a.factor >= 2,
                 "comm: --factor {}: must be >= 2 (each size is the last one times it)", a.factor);
  STRATA_REQUIRE(a.iters >= 1, "comm: --iters {}: must be >= 1", a.iters);
  STRATA_REQUIRE(a.warmup >= 0, "comm: --warmup {}: must be >= 0", a.warmup);
  for (const auto& op : a.ops)
    STRATA_REQUIRE(
        op == "all_reduce" || op == "all_gather" || op == "reduce_scatter" || op == "broadcast",
        "comm: unknown op '{}': use all_reduce, all_gather, reduce_scatter, broadcast", op);

  HostDeviceOptions host;
  host.capacity_bytes = 2 * max_b + (std::size_t(64) << 20);
  // On the emulated device every rank's buffers are this node's RAM (and MPI's own copies of the
  // largest size come on top): refused up front rather than met by the OOM killer mid-run.
  if (a.device == "cpu" || probe_cuda().device_count == 0) {
    const double need = double(li.local_size) * double(host.capacity_bytes);
    const std::size_t avail = cpu::mem_available_bytes();
    STRATA_REQUIRE(
        avail == 0 || need <= double(avail),
        "comm: --max-bytes {} needs about {} of memory on this node ({} rank(s) x the largest size "
        "twice + 64 MiB, on the CPU-emulated device), and {} is available; lower --max-bytes",
        a.max_bytes, human_bytes(need), li.local_size, human_bytes(double(avail)));
  }
  CudaDeviceOptions cuda;
  if (a.device != "cpu") {
    const CudaProbe p = probe_cuda();
    if (p.device_count > 0) cuda.ordinal = launch_gpu_ordinal(li, p.device_count);
  }
  auto dev = make_device(a.device, host, cuda);
  auto comm = make_communicator(*dev);
  auto s = dev->create_stream("bench");
  const int n = comm->world_size();
  const bool root = comm->rank() == 0;

  // The bound, measured by rank 0 alone (the others wait) so the ranks do not share it: the
  // bytes a one-thread memcpy copies per second (copy_gbps counts each byte read and written;
  // busbw counts each payload byte once).
  double memcpy_gbps = 0;
  if (root)
    memcpy_gbps =
        copy_gbps(std::min<std::size_t>(std::max<std::size_t>(max_b, 16 << 20), 256 << 20), 1) / 2;
  comm->barrier(*s).synchronize();

  if (root) {
    std::printf("# strata-bench comm: backend %s, %d rank(s), device %s, dtype %s\n",
                comm_backend_name(comm->backend()), n, dev->name().c_str(), dtype_name(t).data());
    if (comm->backend() == CommBackend::kLocal)
      std::printf(
          "# local backend (one process, no mpirun): collectives are copies or no-ops, not a link; "
          "run under mpirun -np N for link figures\n");
    std::printf("# bound: one-thread memcpy %.2f GB/s (rank 0)\n", memcpy_gbps);
  }

  Buffer big = dev->alloc(max_b + 256);
  Buffer small = dev->alloc(max_b / std::max(n, 1) + 256);
  s->fill(tensor(big, DType::kF32, big.size() / 4), 1.0f);
  s->fill(tensor(small, DType::kF32, small.size() / 4), 1.0f);
  Buffer timing = dev->alloc(4);

  nlohmann::json results = nlohmann::json::array();
  std::map<std::string, double> peak_busbw,
      largest_busbw;  // largest: at the top size, DRAM-bound as memcpy is
  for (const auto& op : a.ops) {
    if (root) {
      std::printf("\n# %s\n#%14s %12s %6s %6s %12s %12s %12s\n", op.c_str(), "size(B)", "count",
                  "type", "redop", "time(us)", "algbw(GB/s)", "busbw(GB/s)");
    }
    // min, min x factor, ... and --max-bytes itself last where the steps pass over it (8 x 4^k
    // never meets 256M): the largest size asked for is measured, and the buffers are its size.
    std::vector<std::size_t> sizes;
    for (std::size_t size = min_b; size <= max_b;
         size = size > max_b / std::size_t(a.factor) ? max_b + 1 : size * std::size_t(a.factor))
      sizes.push_back(size);
    if (sizes.back() != max_b) sizes.push_back(max_b);
    for (const std::size_t size : sizes) {
      // Whole elements per rank, as nccl-tests rounds.
      const bool sharded = op == "all_gather" || op == "reduce_scatter";
      const std::size_t per_rank =
          sharded ? std::max<std::size_t>(size / es / n, 1) : std::max<std::size_t>(size / es, 1);
      const std::size_t count = sharded ? per_rank * n : per_rank;
      const std::size_t bytes = count * es;
      auto issue = [&] {
        if (op == "all_reduce")
          comm->all_reduce(tensor(big, t, count), ReduceOp::kSum, *s);
        else if (op == "broadcast")
          comm->broadcast(tensor(big, t, count), 0, *s);
        else if (op == "all_gather")
          comm->all_gather(tensor(small, t, per_rank), tensor(big, t, count), *s);
        else
          comm->reduce_scatter(tensor(big, t, count), tensor(small, t, per_rank), ReduceOp::kSum,
                               *s);
      };
      for (int i = 0; i < a.warmup; ++i) issue();
      comm->barrier(*s).synchronize();
      const Stopwatch sw;
      for (int i = 0; i < a.iters; ++i) issue();
      s->synchronize();
      float secs = float(sw.seconds() / a.iters);
      // The slowest rank's time is the collective's time.
      s->copy(timing.ref(), host_ref(&secs, 4));
      comm->all_reduce(tensor(timing, DType::kF32, 1), ReduceOp::kMax, *s);
      s->copy(host_ref(&secs, 4), timing.ref());
      s->synchronize();
      const double algbw = double(bytes) / secs / 1e9;
      const double busbw = algbw * bus_factor(op, n);
      peak_busbw[op] = std::max(peak_busbw[op], busbw);
      largest_busbw[op] = busbw;
      if (root) {
        const char* redop = (op == "all_reduce" || op == "reduce_scatter") ? "sum" : "none";
        std::printf(" %14zu %12zu %6s %6s %12.1f %12.3f %12.3f\n", bytes, count,
                    dtype_name(t).data(), redop, secs * 1e6, algbw, busbw);
        results.push_back({{"op", op},
                           {"size_bytes", bytes},
                           {"count", count},
                           {"time_us", secs * 1e6},
                           {"algbw_gbps", algbw},
                           {"busbw_gbps", busbw}});
      }
    }
  }
  if (!root) return;
  if (n == 1) peak_busbw.clear();  // one rank moves nothing between ranks: no bus figure
  std::printf(
      "\n# bus bandwidth against one-thread memcpy (%.2f GB/s copied); peak may be cache-resident, "
      "largest size is memory-bound\n#   %-15s %12s %12s %18s\n",
      memcpy_gbps, "op", "peak(GB/s)", "largest(GB/s)", "largest/memcpy");
  nlohmann::json peaks = nlohmann::json::object();
  for (const auto& [op, bw] : peak_busbw) {
    const double last = largest_busbw[op];
    const double ratio = memcpy_gbps > 0 ? last / memcpy_gbps : 0.0;
    std::printf("#   %-15s %12.3f %12.3f %18.2f%s\n", op.c_str(), bw, last, ratio,
                broken_bound_note(ratio));
    peaks[op] = {{"peak_busbw_gbps", bw},
                 {"largest_busbw_gbps", last},
                 {"ratio_vs_memcpy", ratio},
                 {"broken_bound", broken_bound(ratio)}};
  }
  if (a.json)
    print_json({{"backend", comm_backend_name(comm->backend())},
                {"world_size", n},
                {"device", dev->name()},
                {"dtype", dtype_name(t)},
                {"iters", a.iters},
                {"memcpy_gbps", memcpy_gbps},
                {"reference",
                 "one-thread memcpy on rank 0 alone in this run (the largest size, at least 16 "
                 "MiB, at most 256 MiB; best of its repetitions), against which each collective's "
                 "bus bandwidth at the largest size is a ratio; " +
                     broken_bound_clause()},
                {"busbw", peaks},
                {"results", results}});
}

}  // namespace
}  // namespace comm_cmd

void add_comm_command(CLI::App& app) {
  using namespace comm_cmd;
  auto args = std::make_shared<CommArgs>();
  CLI::App* cmd = app.add_subcommand(
      "comm",
      "collectives: time, algbw and busbw per collective and size (run under mpirun -np N)");
  cmd->add_option("--device", args->device, "auto | cpu | cuda")->capture_default_str();
  cmd->add_option("--dtype", args->dtype, "fp32 | bf16 | fp16")->capture_default_str();
  cmd->add_option("--min-bytes", args->min_bytes, "smallest size, e.g. 8")->capture_default_str();
  cmd->add_option("--max-bytes", args->max_bytes, "largest size, e.g. 256M")->capture_default_str();
  cmd->add_option("--factor", args->factor, "size multiplier between steps")->capture_default_str();
  cmd->add_option("--iters", args->iters, "timed calls per size")->capture_default_str();
  cmd->add_option("--warmup", args->warmup, "untimed calls per size")->capture_default_str();
  cmd->add_option("--ops", args->ops, "collectives to run")->delimiter(',')->capture_default_str();
  cmd->add_flag("--json", args->json, "print one JSON object of the figures, last");
  cmd->callback([args] { run_comm(*args); });
}

}  // namespace strata::bench
