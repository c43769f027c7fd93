// The Communicator wrapper layer, backend selection, the local (one-rank) backend, and the
// watchdog and termination note every multi-rank backend uses.
//
// The wrapper validates every call (dtypes, sizes, devices, overlaps) before a backend sees
// it, so backends can trust their input; it never touches memory itself. The local backend
// copies only when a result must move (out-of-place all_gather / reduce_scatter); every
// other one-rank collective is already complete and costs one event record.
#include "strata/comm.h"

#include <signal.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <string_view>

#include "comm/comm_internal.h"
#include "core/process.h"
#include "gpu/cuda_module.h"
#include "strata/error.h"
#include "strata/log.h"

namespace strata {

const char* reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return "sum";
    case ReduceOp::kAvg:
      return "avg";
    case ReduceOp::kMax:
      return "max";
  }
  return "?";
}

const char* comm_backend_name(CommBackend b) {
  switch (b) {
    case CommBackend::kLocal:
      return "local";
    case CommBackend::kMpi:
      return "mpi";
    case CommBackend::kNccl:
      return "nccl";
    case CommBackend::kGloo:
      return "gloo";
  }
  return "?";
}

namespace {

const char* kind_name(Communicator::Kind k) {
  switch (k) {
    case Communicator::Kind::kAllGather:
      return "all_gather";
    case Communicator::Kind::kReduceScatter:
      return "reduce_scatter";
    case Communicator::Kind::kAllReduce:
      return "all_reduce";
    case Communicator::Kind::kBroadcast:
      return "broadcast";
    case Communicator::Kind::kBarrier:
      return "barrier";
    case Communicator::Kind::kGather:
      return "gather";
  }
  return "?";
}

bool overlaps(const MemRef& a, const MemRef& b) {
  const auto* pa = static_cast<const char*>(a.ptr);
  const auto* pb = static_cast<const char*>(b.ptr);
  return pa < pb + b.bytes && pb < pa + a.bytes;
}

}  // namespace

const char* Communicator::Collective::name() const noexcept {
  // Static strings: a span's name outlives the call.
  static constexpr const char* kTp[] = {"tp.all_gather", "tp.reduce_scatter", "tp.all_reduce",
                                        "tp.broadcast",  "tp.barrier",        "tp.gather"};
  static constexpr const char* kDp[] = {"dp.all_gather", "dp.reduce_scatter", "dp.all_reduce",
                                        "dp.broadcast",  "dp.barrier",        "dp.gather"};
  const auto k = static_cast<std::size_t>(kind);
  switch (group) {
    case Group::kTensorParallel:
      return k < std::size(kTp) ? kTp[k] : "tp.?";
    case Group::kDataParallel:
      return k < std::size(kDp) ? kDp[k] : "dp.?";
    case Group::kJob:
      break;
  }
  return kind_name(kind);
}

std::uint64_t Communicator::Collective::bytes() const noexcept {
  std::uint64_t total = 0;
  for (const TensorRef& t : inputs) total += std::uint64_t(t.numel) * dtype_size(t.dtype);
  return total;
}

std::string Communicator::Collective::describe() const {
  std::string s = kind_name(kind);
  if (coalesced) s += "_coalesced";
  s += "(";
  if (kind == Kind::kReduceScatter || kind == Kind::kAllReduce)
    s += fmt::format("{}, ", reduce_op_name(op));
  if (kind == Kind::kBroadcast || kind == Kind::kGather) s += fmt::format("root {}, ", root);
  if (kind == Kind::kBarrier) return s + ")";
  if (inputs.size() == 1) {
    s += fmt::format("{}, {} elements)", dtype_name(inputs[0].dtype), inputs[0].numel);
  } else {
    std::size_t total = 0;
    for (const auto& t : inputs) total += t.numel;
    s += fmt::format("{} tensors, {} input elements)", inputs.size(), total);
  }
  return s;
}

void Communicator::check_tensor(const TensorRef& t, const char* what) const {
  STRATA_REQUIRE(t.dtype == DType::kF32 || t.dtype == DType::kBF16 || t.dtype == DType::kF16 ||
                     t.dtype == DType::kF64,
                 "{}: dtype {} is not supported by collectives: use fp32, bf16, fp16 or fp64", what,
                 dtype_name(t.dtype));
  STRATA_REQUIRE(t.numel > 0 && t.mem.ptr != nullptr,
                 "{}: empty tensor ({} elements at {}); pass at least one element", what, t.numel,
                 t.mem.ptr);
  STRATA_REQUIRE(t.mem.bytes >= t.numel * dtype_size(t.dtype),
                 "{}: {} elements of {} need {} bytes but the memory holds {}", what, t.numel,
                 dtype_name(t.dtype), t.numel * dtype_size(t.dtype), t.mem.bytes);
  if (t.mem.space == MemSpace::kHost) {
    STRATA_REQUIRE(accepts_host_memory(),
                   "{}: the {} communicator needs device memory; copy the host data to a buffer "
                   "of {} first",
                   what, comm_backend_name(backend_), device_->name());
  } else {
    STRATA_REQUIRE(
        t.mem.device == device_,
        "{}: the tensor is in the memory of another device; the communicator works on {}", what,
        device_->name());
  }
}

Communicator::Communicator(CommBackend backend, Device& device, int rank, int world_size,
                           double timeout_s)
    : backend_(backend),
      device_(&device),
      rank_(rank),
      world_size_(world_size),
      timeout_s_(timeout_s) {
  const char* check = std::getenv("STRATA_COMM_CHECK");
  check_calls_ = check && std::string_view(check) == "1";
  if (check && *check && !check_calls_ && std::string_view(check) != "0")
    log::warn_once("comm.check",
                   fmt::format("STRATA_COMM_CHECK='{}': use 1 (compare every collective across the "
                               "ranks) or 0; it is off",
                               check));
}

// STRATA_COMM_CHECK=1: this call's signature (its number, from 1, kind, op, root, tensor count,
// first dtype, total elements, and a hash of every tensor's dtype and length in order) gathered
// from every rank and compared on the host before the call is queued. A mismatch throws on every
// rank alike (they all see the same gathered table).
void Communicator::check_same_call(const Collective& c, Stream& stream) {
  constexpr std::size_t kFields = 9;
  double total = 0;
  std::uint64_t layout = 0xcbf29ce484222325ull;  // FNV-1a over (dtype, numel) of each tensor
  for (const TensorRef& t : c.inputs) {
    total += double(t.numel);
    for (const std::uint64_t v : {std::uint64_t(t.dtype), std::uint64_t(t.numel)}) {
      layout ^= v;
      layout *= 0x100000001b3ull;
    }
  }
  // Doubles hold 32-bit halves exactly.
  const double mine[kFields] = {double(++calls_),
                                double(int(c.kind)),
                                double(int(c.op)),
                                double(c.root),
                                double(c.inputs.size()),
                                c.inputs.empty() ? -1.0 : double(int(c.inputs[0].dtype)),
                                total,
                                double(layout >> 32),
                                double(layout & 0xffffffffu)};
  const std::size_t W = std::size_t(world_size_);
  Buffer buf = device_->alloc(kFields * 8 * W, &stream);
  const TensorRef all = tensor(buf, DType::kF64, kFields * W);
  const TensorRef slot = tensor(buf, DType::kF64, kFields, kFields * std::size_t(rank_));
  std::vector<double> got(kFields * W);
  stream.copy(slot.mem, host_ref(mine, sizeof mine));
  do_enqueue(Collective{Kind::kAllGather, ReduceOp::kSum, 0, false, {slot}, {all}}, stream);
  stream.copy(host_ref(got.data(), got.size() * 8), all.mem);
  stream.synchronize();
  bool same = true, same_but_layout = true;
  for (std::size_t r = 0; r < W; ++r) {
    const auto row = got.begin() + std::ptrdiff_t(r * kFields);
    same = same && std::equal(mine, mine + kFields, row);
    same_but_layout = same_but_layout && std::equal(mine, mine + kFields - 2, row);
  }
  if (same) return;
  std::string calls;
  for (std::size_t r = 0; r < W; ++r) {
    const double* f = got.data() + r * kFields;
    const auto kind = Kind(int(f[1]));
    std::string d = fmt::format("rank {}: call #{} {}(", r, std::uint64_t(f[0]), kind_name(kind));
    if (kind == Kind::kReduceScatter || kind == Kind::kAllReduce)
      d += fmt::format("{}, ", reduce_op_name(ReduceOp(int(f[2]))));
    if (kind == Kind::kBroadcast || kind == Kind::kGather) d += fmt::format("root {}, ", int(f[3]));
    if (f[4] > 0)
      d += fmt::format("{} tensor(s), {}, {} elements", int(f[4]), dtype_name(DType(int(f[5]))),
                       std::uint64_t(f[6]));
    if (same_but_layout)
      d += fmt::format(", layout {:08x}{:08x}", std::uint64_t(f[7]), std::uint64_t(f[8]));
    calls += d + ")" + (r + 1 < W ? "; " : "");
  }
  STRATA_THROW(kInvalidArgument,
               "STRATA_COMM_CHECK: the ranks issued different collectives ({}){}: every rank must "
               "issue the same "
               "collectives, with the same sizes and dtypes, in the same order",
               calls,
               same_but_layout
                   ? "; the same totals, but the tensors' dtypes or lengths differ in order"
                   : "");
}

Event Communicator::submit(Collective c, Stream& stream) {
  STRATA_REQUIRE(&stream.device() == device_,
                 "{}: stream '{}' belongs to another device; use a stream of {}", c.describe(),
                 stream.name(), device_->name());
  c.group = group_;
  const std::string what = c.describe();
  for (const auto& t : c.inputs) check_tensor(t, what.c_str());
  for (const auto& t : c.outputs) check_tensor(t, what.c_str());
  const std::size_t n = static_cast<std::size_t>(world_size_);
  for (std::size_t i = 0; i < c.outputs.size(); ++i) {
    const TensorRef& in = c.inputs[i];
    const TensorRef& out = c.outputs[i];
    STRATA_REQUIRE(in.dtype == out.dtype,
                   "{}: tensor {} has input dtype {} but output dtype {}; they must match", what, i,
                   dtype_name(in.dtype), dtype_name(out.dtype));
    const std::size_t es = dtype_size(in.dtype);
    // The NCCL in-place layouts: the small side is block `rank` of the large one.
    if (c.kind == Kind::kAllGather || c.kind == Kind::kGather) {
      STRATA_REQUIRE(
          out.numel == in.numel * n,
          "{}: tensor {}: output has {} elements, needs world_size ({}) x input ({}) = {}", what, i,
          out.numel, n, in.numel, in.numel * n);
      const bool in_place = in.mem.ptr == static_cast<char*>(out.mem.ptr) + rank_ * in.numel * es;
      STRATA_REQUIRE(
          in_place || !overlaps({in.mem.ptr, in.numel * es}, {out.mem.ptr, out.numel * es}),
          "{}: tensor {}: input overlaps the output other than as block {} of it; use "
          "separate buffers or the in-place layout",
          what, i, rank_);
    } else {
      STRATA_REQUIRE(
          in.numel == out.numel * n,
          "{}: tensor {}: input has {} elements, needs world_size ({}) x output ({}) = {}; "
          "pad the flat buffer to a multiple of the world size",
          what, i, in.numel, n, out.numel, out.numel * n);
      const bool in_place = out.mem.ptr == static_cast<char*>(in.mem.ptr) + rank_ * out.numel * es;
      STRATA_REQUIRE(
          in_place || !overlaps({in.mem.ptr, in.numel * es}, {out.mem.ptr, out.numel * es}),
          "{}: tensor {}: output overlaps the input other than as block {} of it; use "
          "separate buffers or the in-place layout",
          what, i, rank_);
    }
  }
  if (c.coalesced) {
    // The tensors of one call run concurrently (one NCCL group, one MPI wait), not in order: a
    // tensor the call writes may not overlap any other tensor of the call.
    const bool writes_inputs = c.kind == Kind::kAllReduce || c.kind == Kind::kBroadcast;
    const auto& written = writes_inputs ? c.inputs : c.outputs;
    auto span = [](const TensorRef& t) { return MemRef{t.mem.ptr, t.numel * dtype_size(t.dtype)}; };
    for (std::size_t i = 0; i < written.size(); ++i)
      for (std::size_t j = 0; j < c.inputs.size(); ++j) {
        if (j == i) continue;  // tensor i's own input: the in-place layouts checked above
        const bool hit = overlaps(span(written[i]), span(c.inputs[j])) ||
                         (!writes_inputs && overlaps(span(written[i]), span(c.outputs[j])));
        STRATA_REQUIRE(
            !hit,
            "{}: tensor {} overlaps tensor {} of the same call; the tensors of a coalesced "
            "call run concurrently: use separate buffers or separate calls",
            what, i, j);
      }
  }
  if (check_calls_ && world_size_ > 1) check_same_call(c, stream);
  do_enqueue(c, stream);
  return stream.record();
}

Event Communicator::all_gather(TensorRef input, TensorRef output, Stream& stream) {
  return submit(Collective{Kind::kAllGather, ReduceOp::kSum, 0, false, {input}, {output}}, stream);
}

Event Communicator::reduce_scatter(TensorRef input, TensorRef output, ReduceOp op, Stream& stream) {
  STRATA_REQUIRE(op == ReduceOp::kSum || op == ReduceOp::kAvg || op == ReduceOp::kMax,
                 "reduce_scatter: unknown reduce op");
  return submit(Collective{Kind::kReduceScatter, op, 0, false, {input}, {output}}, stream);
}

Event Communicator::all_reduce(TensorRef data, ReduceOp op, Stream& stream) {
  return submit(Collective{Kind::kAllReduce, op, 0, false, {data}, {}}, stream);
}

Event Communicator::broadcast(TensorRef data, int root, Stream& stream) {
  STRATA_REQUIRE(root >= 0 && root < world_size_,
                 "broadcast: root {} is not a rank of this {}-rank job", root, world_size_);
  return submit(Collective{Kind::kBroadcast, ReduceOp::kSum, root, false, {data}, {}}, stream);
}

Event Communicator::gather(TensorRef input, TensorRef output, int root, Stream& stream) {
  STRATA_REQUIRE(root >= 0 && root < world_size_,
                 "gather: root {} is not a rank of this {}-rank job", root, world_size_);
  const bool has_output = output.numel != 0 || output.mem.ptr != nullptr;
  STRATA_REQUIRE(
      has_output == (rank_ == root),
      "gather: rank {} {} an output, and only the root (rank {}) passes one; the others pass "
      "TensorRef{{}}",
      rank_, has_output ? "passed" : "did not pass", root);
  std::vector<TensorRef> outputs;
  if (has_output) outputs.push_back(output);
  return submit(Collective{Kind::kGather, ReduceOp::kSum, root, false, {input}, std::move(outputs)},
                stream);
}

Event Communicator::barrier(Stream& stream) {
  return submit(Collective{Kind::kBarrier, ReduceOp::kSum, 0, false, {}, {}}, stream);
}

Event Communicator::all_gather_coalesced(std::span<const TensorRef> inputs,
                                         std::span<const TensorRef> outputs, Stream& stream) {
  STRATA_REQUIRE(
      !inputs.empty() && inputs.size() == outputs.size(),
      "all_gather_coalesced: {} inputs and {} outputs; pass one output per input, at least one",
      inputs.size(), outputs.size());
  return submit(Collective{Kind::kAllGather,
                           ReduceOp::kSum,
                           0,
                           true,
                           {inputs.begin(), inputs.end()},
                           {outputs.begin(), outputs.end()}},
                stream);
}

Event Communicator::reduce_scatter_coalesced(std::span<const TensorRef> inputs,
                                             std::span<const TensorRef> outputs, ReduceOp op,
                                             Stream& stream) {
  STRATA_REQUIRE(
      !inputs.empty() && inputs.size() == outputs.size(),
      "reduce_scatter_coalesced: {} inputs and {} outputs; pass one output per input, at least one",
      inputs.size(), outputs.size());
  return submit(Collective{Kind::kReduceScatter,
                           op,
                           0,
                           true,
                           {inputs.begin(), inputs.end()},
                           {outputs.begin(), outputs.end()}},
                stream);
}

Event Communicator::all_reduce_coalesced(std::span<const TensorRef> data, ReduceOp op,
                                         Stream& stream) {
  STRATA_REQUIRE(!data.empty(), "all_reduce_coalesced: pass at least one tensor");
  return submit(Collective{Kind::kAllReduce, op, 0, true, {data.begin(), data.end()}, {}}, stream);
}

int launch_gpu_ordinal(const LaunchInfo& info, int device_count) {
  STRATA_REQUIRE(device_count > 0, "launch_gpu_ordinal: no GPU is visible to rank {}", info.rank);
  if (info.local_size > device_count && info.local_rank == 0)
    log::warn("{} ranks on this node share {} GPU(s): launch one rank per GPU", info.local_size,
              device_count);
  return info.local_rank % device_count;
}

std::unique_ptr<Communicator> make_communicator(Device& device, const CommOptions& options) {
  const double timeout_s = comm::resolve_timeout_s(options.timeout_s);
  CommBackend backend;
  if (options.backend) {
    backend = *options.backend;
  } else if (device.kind() == DeviceKind::kCuda) {
    backend = CommBackend::kNccl;
  } else {
    const LaunchInfo li = launch_info();
    backend = li.under_mpi        ? CommBackend::kMpi
              : li.world_size > 1 ? CommBackend::kGloo  // torchrun, srun without MPI
                                  : CommBackend::kLocal;
  }
  switch (backend) {
    case CommBackend::kLocal: {
      const LaunchInfo li = launch_info();
      STRATA_REQUIRE(
          li.world_size == 1 || options.process_local,
          "the local communicator serves one rank, but the launcher started {}; use the mpi, "
          "gloo or nccl backend (the default), or set CommOptions::process_local for a group of "
          "this process alone",
          li.world_size);
      return comm::make_local_communicator(device, timeout_s);
    }
    case CommBackend::kMpi:
      return comm::make_mpi_communicator(device, timeout_s);
    case CommBackend::kGloo:
      STRATA_REQUIRE(device.kind() != DeviceKind::kCuda,
                     "the gloo communicator works on host memory, not {}'s; use nccl",
                     device.name());
      return comm::make_gloo_communicator(device, timeout_s);
    case CommBackend::kNccl:
      STRATA_REQUIRE(device.kind() == DeviceKind::kCuda,
                     "the nccl communicator needs a CUDA device, not {}; use mpi or local",
                     device.name());
      return comm::make_nccl_communicator(device, timeout_s);
  }
  STRATA_THROW(kInvalidArgument, "unknown communicator backend");
}

namespace comm {

// ---- local: one rank ----
namespace {

class LocalCommunicator final : public Communicator {
 public:
  LocalCommunicator(Device& device, double timeout_s)
      : Communicator(CommBackend::kLocal, device, 0, 1, timeout_s) {}

 protected:
  bool accepts_host_memory() const noexcept override { return true; }

  std::unique_ptr<Communicator> do_split(int, const std::vector<int>&) override {
    return std::make_unique<LocalCommunicator>(device(), timeout_s());
  }

  void do_enqueue(const Collective& c, Stream& stream) override {
    // With one rank, every result equals the input (a sum, average or max of one value,
    // rounded from itself); only an out-of-place gather or scatter has bytes to move.
    for (std::size_t i = 0; i < c.outputs.size(); ++i) {
      const TensorRef& in = c.inputs[i];
      const TensorRef& out = c.outputs[i];
      if (in.mem.ptr == out.mem.ptr) continue;
      const std::size_t bytes = in.numel * dtype_size(in.dtype);
      MemRef dst = out.mem, src = in.mem;
      dst.bytes = src.bytes = bytes;
      stream.copy(dst, src);
    }
  }
};

}  // namespace

std::unique_ptr<Communicator> make_local_communicator(Device& device, double timeout_s) {
  return std::make_unique<LocalCommunicator>(device, timeout_s);
}

#if !defined(STRATA_HAVE_GLOO)
std::unique_ptr<Communicator> make_gloo_communicator(Device& device, double) {
  STRATA_THROW(kUnsupported,
               "no Gloo communicator for {}: this build has no Gloo; install libgloo-dev "
               "(scripts/setup.sh) and rebuild, or start the job with mpirun",
               device.name());
}
#endif

// The NCCL backend is in the CUDA module (nccl_comm.cpp is built into libstrata_cuda.so).
std::unique_ptr<Communicator> make_nccl_communicator(Device& device, double timeout_s) {
  const gpu::CudaModule* m = gpu::cuda_module();
  if (!m)
    STRATA_THROW(kUnsupported, "no NCCL communicator for {}: {}", device.name(),
                 gpu::cuda_unavailable_reason());
  if (!m->make_nccl_communicator)
    STRATA_THROW(
        kUnsupported,
        "no NCCL communicator for {}: this build has no NCCL (configure with the CUDA toolkit and "
        "NCCL installed, libnccl in the toolkit's lib64)",
        device.name());
  return m->make_nccl_communicator(device, timeout_s);
}

// ---- timeout and watchdog ----

double resolve_timeout_s(double option_s) {
  // At most kMaxTimeoutS: a deadline past what the clocks and Gloo's milliseconds hold wrapped
  // (inf failed every collective in Gloo's own words, 1e10 timed out each at once).
  if (option_s > 0 && option_s <= kMaxTimeoutS) return option_s;
  STRATA_REQUIRE(option_s == 0,
                 "CommOptions::timeout_s must be from just above 0 to {} seconds (0 = default), "
                 "got {}",
                 kMaxTimeoutS, option_s);
  if (const char* env = std::getenv("STRATA_COMM_TIMEOUT_S"); env && *env)
    return timeout_from_env("STRATA_COMM_TIMEOUT_S", env);
  return 300.0;
}

double timeout_from_env(const char* var, const char* value) {
  char* end = nullptr;
  const double v = std::strtod(value, &end);
  STRATA_REQUIRE(end != value && *end == '\0' && v > 0 && v <= kMaxTimeoutS,
                 "{}='{}' is not a number of seconds from just above 0 to {:g} ({:.1f} days); "
                 "set e.g. 300",
                 var, value, kMaxTimeoutS, kMaxTimeoutS / 86400);
  return v;
}

Progress wait_in_progress(const std::function<Progress()>& state, double timeout_s,
                          const std::function<void(double waited_s)>& on_timeout) {
  const auto start = std::chrono::steady_clock::now();
  auto pause = std::chrono::microseconds(1);
  for (;;) {
    const Progress p = state();
    if (p != Progress::kInProgress) return p;
    const double waited =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (timeout_s > 0 && waited > timeout_s) {
      on_timeout(waited);
      return Progress::kFailed;
    }
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::microseconds(1000));
  }
}

std::string Watchdog::timeout_message(const std::string& what, int rank, int world_size,
                                      double elapsed_s, double timeout_s) {
  return fmt::format(
      "collective {} on rank {} of {} has not completed after {:.1f} s (timeout {:.1f} s): a peer "
      "rank "
      "died or hangs, or the ranks issued collectives in different orders; ending the job. Raise "
      "STRATA_COMM_TIMEOUT_S if collectives are legitimately this slow",
      what, rank, world_size, elapsed_s, timeout_s);
}

Watchdog::Watchdog(int rank, int world_size, double timeout_s, OnTimeout on_timeout,
                   std::function<std::string()> async_error)
    : rank_(rank),
      world_size_(world_size),
      timeout_s_(timeout_s),
      on_timeout_(std::move(on_timeout)),
      async_error_(std::move(async_error)) {
  thread_ = std::thread([this] { run(); });
}

Watchdog::~Watchdog() { stop(); }

void Watchdog::stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

std::uint64_t Watchdog::begin(std::string what, std::function<bool()> poll) {
  std::lock_guard<std::mutex> lock(mu_);
  const std::uint64_t id = next_id_++;
  entries_.push_back(Entry{id, std::move(what), std::chrono::steady_clock::now(), std::move(poll)});
  return id;
}

void Watchdog::end(std::uint64_t id) {
  std::lock_guard<std::mutex> lock(mu_);
  entries_.remove_if([id](const Entry& e) { return e.id == id; });
}

void Watchdog::run() {
  // Polls often enough that a 1-s test timeout fires promptly, rarely enough to cost nothing.
  constexpr auto kPeriod = std::chrono::milliseconds(50);
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_) {
    cv_.wait_for(lock, kPeriod, [&] { return stop_; });
    if (stop_) break;
    const auto now = std::chrono::steady_clock::now();
    for (auto it = entries_.begin(); it != entries_.end();) {
      if (it->poll && it->poll()) {
        it = entries_.erase(it);
        continue;
      }
      const double elapsed = std::chrono::duration<double>(now - it->start).count();
      if (elapsed > timeout_s_ && !fired_) {
        fired_ = true;
        const std::string msg = timeout_message(it->what, rank_, world_size_, elapsed, timeout_s_);
        lock.unlock();
        on_timeout_(msg);  // ends the process
        lock.lock();
      }
      ++it;
    }
    if (async_error_ && !entries_.empty()) {
      lock.unlock();
      std::string err = async_error_();
      if (!err.empty() && !fired_) {
        fired_ = true;
        on_timeout_(fmt::format("rank {} of {}: {}", rank_, world_size_, err));
      }
      lock.lock();
    }
  }
}

// ---- the SIGTERM note ----
namespace {

constexpr std::size_t kNoteBytes = 200;
// Written by whichever thread starts a collective; read by the signal handler. A torn read
// (a description half-overwritten) can only garble the note, never crash: the buffer is
// fixed and always NUL-terminated at its end.
char g_note_what[kNoteBytes + 1];
std::atomic<std::int64_t> g_note_start_ns{0};  // 0 = nothing in flight
std::atomic<bool> g_note_installed{false};
int g_note_rank = 0, g_note_world = 1;
// A handler the program had installed before (the tools' swap-file clean-up): run after the
// note, so that it still runs and ends the process by the signal itself.
void (*g_prev_sigterm)(int) = nullptr;

std::int64_t monotonic_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);  // async-signal-safe, unlike steady_clock in theory
  return std::int64_t(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

// Async-signal-safe decimal formatting into buf; returns the length.
std::size_t format_uint(char* buf, std::uint64_t v) {
  char tmp[24];
  std::size_t n = 0;
  do {
    tmp[n++] = char('0' + v % 10);
    v /= 10;
  } while (v);
  for (std::size_t i = 0; i < n; ++i) buf[i] = tmp[n - 1 - i];
  return n;
}

void append(char* buf, std::size_t& len, std::size_t cap, const char* s) {
  while (*s && len < cap) buf[len++] = *s++;
}

void on_sigterm(int sig) {
  char buf[512];
  std::size_t len = 0;
  char num[24];
  const std::size_t cap = sizeof buf - 1;
  append(buf, len, cap, "[strata] [error] rank ");
  num[format_uint(num, std::uint64_t(g_note_rank))] = 0;
  append(buf, len, cap, num);
  append(buf, len, cap, " of ");
  num[format_uint(num, std::uint64_t(g_note_world))] = 0;
  append(buf, len, cap, num);
  append(buf, len, cap,
         " received SIGTERM (a launcher ending the job when another rank failed, a scheduler, or "
         "a kill) ");
  const std::int64_t start = g_note_start_ns.load(std::memory_order_acquire);
  if (start) {
    const std::int64_t ms = (monotonic_ns() - start) / 1000000;
    append(buf, len, cap, "while collective ");
    append(buf, len, cap, g_note_what);
    append(buf, len, cap, " was in flight for ");
    num[format_uint(num, std::uint64_t(ms / 1000))] = 0;
    append(buf, len, cap, num);
    append(buf, len, cap, ".");
    char frac[4] = {char('0' + ms % 1000 / 100), char('0' + ms % 100 / 10), char('0' + ms % 10), 0};
    append(buf, len, cap, frac);
    append(buf, len, cap, " s\n");
  } else {
    append(buf, len, cap, "with no collective in flight\n");
  }
  ssize_t unused = ::write(2, buf, len);
  (void)unused;
  if (g_prev_sigterm) {
    g_prev_sigterm(sig);
    return;
  }
  // Die of the signal, as the launcher expects.
  ::signal(sig, SIG_DFL);
  ::raise(sig);
}

}  // namespace

void note_in_flight(const std::string& what) {
  const std::size_t n = std::min(what.size(), kNoteBytes);
  std::memcpy(g_note_what, what.data(), n);
  g_note_what[n] = 0;
  g_note_start_ns.store(monotonic_ns(), std::memory_order_release);
}

void note_done() { g_note_start_ns.store(0, std::memory_order_release); }

void install_termination_note(int rank, int world_size) {
  if (g_note_installed.exchange(true)) return;
  g_note_rank = rank;
  g_note_world = world_size;
  struct sigaction old {};
  if (::sigaction(SIGTERM, nullptr, &old) != 0 || old.sa_handler == SIG_IGN ||
      (old.sa_flags & SA_SIGINFO))
    return;
  if (old.sa_handler != SIG_DFL) g_prev_sigterm = old.sa_handler;  // chained: see on_sigterm
  struct sigaction sa {};
  sa.sa_handler = on_sigterm;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESETHAND;
  ::sigaction(SIGTERM, &sa, nullptr);
}

}  // namespace comm
void max_across_ranks(Communicator& comm, std::span<double> values) {
  if (values.empty()) return;
  Device& dev = comm.device();
  auto stream = dev.create_stream("agree");
  const std::size_t bytes = values.size() * sizeof(double);
  Buffer b = dev.alloc(bytes, stream.get());
  stream->copy(b.ref(), host_ref(values.data(), bytes));
  comm.all_reduce(tensor(b, DType::kF64, values.size()), ReduceOp::kMax, *stream);
  stream->copy(host_ref(values.data(), bytes), b.ref());
  stream->synchronize();
}

std::unique_ptr<Communicator> Communicator::split(int color, int key) {
  STRATA_REQUIRE(color >= 0, "Communicator::split: color {} is negative (give 0 or more)", color);
  // Every rank's color and key.
  const std::size_t world = std::size_t(world_size_);
  std::vector<double> ck(2 * world, -0x1p60);
  ck[2 * std::size_t(rank_)] = color;
  ck[2 * std::size_t(rank_) + 1] = key;
  if (world > 1) max_across_ranks(*this, ck);
  std::vector<int> members;
  for (int r = 0; r < world_size_; ++r)
    if (ck[2 * std::size_t(r)] == color) members.push_back(r);
  std::stable_sort(members.begin(), members.end(), [&](int a, int b) {
    return ck[2 * std::size_t(a) + 1] < ck[2 * std::size_t(b) + 1];
  });
  return do_split(color, members);
}

ProcessGroups make_process_groups(Communicator& world, int tensor_parallel) {
  const int n = world.world_size(), tp = tensor_parallel;
  STRATA_REQUIRE(tp >= 1 && n % tp == 0,
                 "tensor parallelism of {} does not divide the job's {} rank{}: give a divisor of "
                 "{} (the ranks are arranged as {} x data parallelism)",
                 tp, n, n == 1 ? "" : "s", n, tp);
  // Every TP group on one node: its ranks' host names alike.
  const std::vector<std::string> hosts = strings_across_ranks(world, this_host());
  for (int g = 0; g < n / tp; ++g)
    for (int r = g * tp + 1; r < (g + 1) * tp; ++r)
      STRATA_REQUIRE(hosts[std::size_t(r)] == hosts[std::size_t(g * tp)],
                     "tensor parallelism of {} puts ranks {} to {} in one group, and they are on "
                     "different nodes (rank {} on {}, rank {} on {}): tensor parallelism stays "
                     "within a node; give at most the ranks per node, and start consecutive ranks "
                     "on one node (mpirun --map-by ppr:N:node, torchrun --nproc-per-node N)",
                     tp, g * tp, (g + 1) * tp - 1, g * tp, hosts[std::size_t(g * tp)], r,
                     hosts[std::size_t(r)]);
  ProcessGroups pg;
  pg.tp_size = tp;
  pg.dp_size = n / tp;
  pg.tp_rank = world.rank() % tp;
  pg.dp_rank = world.rank() / tp;
  pg.tp = world.split(pg.dp_rank, pg.tp_rank);
  pg.dp = world.split(pg.tp_rank, pg.dp_rank);
  if (tp > 1) {  // (under TP 1 the DP group is the job: its spans keep their plain names)
    pg.tp->set_group(Communicator::Group::kTensorParallel);
    pg.dp->set_group(Communicator::Group::kDataParallel);
  }
  return pg;
}

std::vector<std::string> strings_across_ranks(Communicator& comm, const std::string& mine) {
  const std::size_t world = std::size_t(comm.world_size()), me = std::size_t(comm.rank());
  if (world == 1) return {mine};
  std::vector<double> len(world, 0.0);
  len[me] = double(mine.size());
  max_across_ranks(comm, len);
  const std::size_t width = std::size_t(*std::max_element(len.begin(), len.end()));
  std::vector<std::string> out(world);
  if (width == 0) return out;
  // Row r holds rank r's bytes; every other rank's row is 0 there (bytes are 0..255).
  std::vector<double> rows(world * width, 0.0);
  for (std::size_t i = 0; i < mine.size(); ++i)
    rows[me * width + i] = double(std::uint8_t(mine[i]));
  max_across_ranks(comm, rows);
  for (std::size_t r = 0; r < world; ++r) {
    out[r].resize(std::size_t(len[r]));
    for (std::size_t i = 0; i < out[r].size(); ++i)
      out[r][i] = char(std::uint8_t(rows[r * width + i]));
  }
  return out;
}

std::string broadcast_string(Communicator& comm, const std::string& text, int root) {
  if (comm.world_size() == 1) return text;
  const bool am_root = comm.rank() == root;
  std::vector<double> len = {am_root ? double(text.size()) : 0.0};
  max_across_ranks(comm, len);
  const std::size_t n = std::size_t(len[0]);
  if (n == 0) return {};
  // One byte a double: the strings this carries are a few KiB.
  std::vector<double> bytes(n, 0.0);
  if (am_root)
    for (std::size_t i = 0; i < n; ++i) bytes[i] = double(std::uint8_t(text[i]));
  Device& dev = comm.device();
  auto stream = dev.create_stream("broadcast");
  Buffer b = dev.alloc(n * sizeof(double), stream.get());
  stream->copy(b.ref(), host_ref(bytes.data(), n * sizeof(double)));
  comm.broadcast(tensor(b, DType::kF64, n), root, *stream);
  stream->copy(host_ref(bytes.data(), n * sizeof(double)), b.ref());
  stream->synchronize();
  std::string out(n, '\0');
  for (std::size_t i = 0; i < n; ++i) out[i] = char(std::uint8_t(bytes[i]));
  return out;
}

std::uint64_t bytes_from_double(double bytes) {
  return bytes >= 0x1p64 ? UINT64_MAX : bytes <= 0 ? 0 : std::uint64_t(bytes);
}

int ranks_on_this_node(const Communicator& comm) {
  if (comm.world_size() <= 1) return 1;
  return std::clamp(launch_info().local_size, 1, comm.world_size());
}

}  // namespace strata
