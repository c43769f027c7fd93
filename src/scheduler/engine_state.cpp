// Placing a unit's shard on its tiers and reading it back (finalize, load_state, master_shard),
// and the engine's checkpoints (save_state / load_state). Part of the engine (engine_impl.h).
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "scheduler/engine_impl.h"
#include "strata/json_config.h"

namespace strata {
namespace {

constexpr int kStateVersion = 1;

// A file written with write(2) and fsync'd before close, for save_state.
class SyncedFile {
 public:
  explicit SyncedFile(const std::string& path) : path_(path) {
    fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd_ < 0) STRATA_THROW(kIo, "checkpoint: cannot create {}: {}", path, std::strerror(errno));
  }
  ~SyncedFile() {
    if (fd_ >= 0) ::close(fd_);
  }
  void write(const void* data, std::size_t bytes) { write_at(data, bytes, end_); }
  // At byte `offset` of the file (pwrite(2)); write() goes on after the furthest byte written.
  void write_at(const void* data, std::size_t bytes, std::uint64_t offset) {
    const char* p = static_cast<const char*>(data);
    while (bytes > 0) {
      const ssize_t n = ::pwrite(fd_, p, bytes, off_t(offset));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0)
        STRATA_THROW(kIo, "checkpoint: writing {} failed: {}", path_, std::strerror(errno));
      p += n;
      bytes -= std::size_t(n);
      offset += std::uint64_t(n);
    }
    end_ = std::max(end_, offset);
  }
  void close() {
    if (::fsync(fd_) != 0)
      STRATA_THROW(kIo, "checkpoint: fsync {} failed: {}", path_, std::strerror(errno));
    const int fd = fd_;
    fd_ = -1;
    if (::close(fd) != 0)
      STRATA_THROW(kIo, "checkpoint: closing {} failed: {}", path_, std::strerror(errno));
  }

 private:
  std::string path_;
  int fd_ = -1;
  std::uint64_t end_ = 0;
};

std::string state_file(const std::string& dir, int rank, const char* ext) {
  return (std::filesystem::path(dir) / fmt::format("rank{}.{}", rank, ext)).string();
}

}  // namespace

using detail::Unit;

void Engine::Impl::begin_put(std::size_t ui, bool first) {
  Unit& u = units[ui];
  if (first) {
    if (u.resident)
      u.w.full = dev.alloc(u.padded * c_size);
    else if (u.w_tier == Tier::kDevice)
      u.w.dev = dev.alloc(u.shard * c_size);
    else if (u.w_tier == Tier::kHost)
      u.w.host = pinned(SwapStore::padded_bytes(u.shard * c_size));
    if (u.o_tier == Tier::kDevice)
      u.o.dev = dev.alloc(3 * u.shard * 4);
    else if (u.o_tier == Tier::kHost)
      u.o.host = pinned(SwapStore::padded_bytes(detail::state_elems(u.shard) * 4));
  }
  if (u.resident && u.fetch.released.valid())
    fetch_s->wait(u.fetch.released);  // the compute stream's last read
  if (!u.resident && u.w_tier == Tier::kHost && u.w.written.valid())
    u.w.written.synchronize();  // a write-back
}

Engine::Impl::PutsInFlight::~PutsInFlight() {
  while (!q_.empty()) try {
      wait_front();
    } catch (...) {  // (the error in flight is the one to report)
    }
}

void Engine::Impl::PutsInFlight::add(std::vector<IoHandle> io,
                                     std::vector<std::shared_ptr<PinnedBlock>> keep) {
  q_.push_back({std::move(io), std::move(keep)});
  while (q_.size() > depth_) wait_front();
}

std::shared_ptr<PinnedBlock> Engine::Impl::pinned(std::size_t bytes) {
  if (placing && !placing->empty()) {
    try {
      return std::make_shared<PinnedBlock>(pool->allocate(bytes));
    } catch (const Error& e) {
      if (e.kind() != ErrorKind::kOutOfMemory) throw;
    }
    placing->drain();  // a budget with no room beside the writes' blocks: one at a time
  }
  return std::make_shared<PinnedBlock>(pool->allocate(bytes));
}

Engine::Impl::Placing::Placing(Impl& s, PutsInFlight& in_flight) : s_(s) {
  s_.placing = &in_flight;
}

Engine::Impl::Placing::~Placing() { s_.placing = nullptr; }

void Engine::Impl::PutsInFlight::drain() {
  while (!q_.empty()) wait_front();
}

// Every write of the oldest sub-group waited for before its blocks go, then its first failure.
void Engine::Impl::PutsInFlight::wait_front() {
  const Entry e = std::move(q_.front());
  q_.pop_front();
  detail::wait_all(e.io);
}

void Engine::Impl::put_group(std::size_t ui, std::size_t g, const FillPart& fill,
                             PutsInFlight* pending) {
  Unit& u = units[ui];
  const detail::Range r = range(u, g);
  const std::size_t a = r.first, n = r.size, w_bytes = n * c_size;
  const DType ct = cfg.compute_dtype;
  Stream& up = *fetch_s;
  // Where part k is filled: in place (host tier), in the record's pinned block (NVMe), else one
  // part's scratch, copied up before the next is filled (device tier).
  std::shared_ptr<PinnedBlock> block;  // NVMe: the sub-group's master | m | v (layout.h)
  const std::size_t block_bytes = detail::state_elems(n) * 4;
  if (u.o_tier == Tier::kNvme) {
    block = pinned(SwapStore::padded_bytes(block_bytes));
    std::memset(block->data(), 0, block_bytes);  // the gaps too: the record is written whole
  }
  float* o = block                     ? static_cast<float*>(block->data())
             : u.o_tier == Tier::kHost ? static_cast<float*>(u.o.host->data()) + a
                                       : nullptr;
  const std::size_t stride = detail::state_stride(block ? n : u.shard);
  std::vector<float> scratch;
  const auto part = [&](std::size_t k) {
    float* dst = o ? o + k * stride : (scratch.resize(n), scratch.data());
    fill(k, dst);
    return dst;
  };
  const auto up_part = [&](std::size_t k, const float* values) {
    if (u.o_tier != Tier::kDevice) return;
    up.copy(view(u.o.dev, DType::kF32, n, k * u.shard + a).mem, host_ref(values, n * 4));
    up.synchronize();  // before the scratch is filled again
  };
  const float* master = part(0);
  const bool w_host = !u.resident && u.w_tier == Tier::kHost;
  std::shared_ptr<PinnedBlock> staging;
  if (!w_host) staging = pinned(SwapStore::padded_bytes(w_bytes));
  // A fill that throws after the weights' copy was queued (a truncated checkpoint): the copy
  // ends before the staging it reads goes (declared after it: destroyed first).
  struct Settle {
    Stream& s;
    ~Settle() {
      try {
        s.synchronize();
      } catch (...) {  // (the error in flight is the one to report)
      }
    }
  } settle{up};
  void* w = w_host ? static_cast<char*>(u.w.host->data()) + a * c_size : staging->data();
  cpu::cast(DType::kF32, master, ct, w, n);  // round to nearest even, as the copy-out
  // Writes started here: an error before they are handed on (the next part's fill, a full drive
  // at the state's write) waits for them before the blocks they read go (destroyed first).
  struct Started {
    std::vector<IoHandle> io;
    ~Started() {
      try {
        detail::wait_all(io);
      } catch (...) {  // (the error in flight is the one to report)
      }
    }
  } started;
  std::vector<IoHandle>& io = started.io;
  if (const auto target = w_target_dev(u, a, n))
    up.copy(target->mem, host_ref(w, w_bytes));
  else if (u.w_tier == Tier::kNvme)
    io.push_back(w_store->write(w_key(ui, g), w, w_bytes));
  up_part(0, master);
  for (std::size_t k = 1; k < 3; ++k) up_part(k, part(k));
  if (block) io.push_back(o_store->write(o_key(ui, g), block->data(), block_bytes));
  up.synchronize();  // the staging is released when this scope ends (or by `pending`)
  if (pending) {
    pending->add(std::exchange(io, {}), {std::move(block), std::move(staging)});
  } else {
    detail::wait_all(std::exchange(io, {}));
  }
}

void Engine::Impl::end_put(std::size_t ui) {
  Unit& u = units[ui];
  if (!u.resident) return;
  const DType ct = cfg.compute_dtype;
  if (world > 1)
    comm.all_gather(view(u.w.full, ct, u.shard, std::size_t(rank) * u.shard),
                    view(u.w.full, ct, u.padded), *fetch_s);
  u.fetch.gathered = true;
  u.fetch.ready = fetch_s->record();
}

void Engine::Impl::read_group(std::size_t ui, std::size_t g, std::size_t parts,
                              std::vector<float>& scratch, const UsePart& use) {
  Unit& u = units[ui];
  const detail::Range r = range(u, g);
  const std::size_t a = r.first, n = r.size;
  if (u.o_tier == Tier::kDevice) {
    scratch.resize(n);
    for (std::size_t k = 0; k < parts; ++k) {
      opt_s->copy(host_ref(scratch.data(), n * 4), u.o.dev.ref((k * u.shard + a) * 4, n * 4));
      opt_s->synchronize();
      use(k, scratch.data());
    }
  } else if (u.o_tier == Tier::kHost) {
    const float* o = static_cast<const float*>(u.o.host->data());
    const std::size_t stride = detail::state_stride(u.shard);
    for (std::size_t k = 0; k < parts; ++k) use(k, o + k * stride + a);
  } else {
    const std::size_t block_bytes = detail::state_elems(n) * 4, stride = detail::state_stride(n);
    auto b = pinned(SwapStore::padded_bytes(block_bytes));
    o_store->read(o_key(ui, g), b->data(), block_bytes).wait();
    const float* o = static_cast<const float*>(b->data());
    for (std::size_t k = 0; k < parts; ++k) use(k, o + k * stride);
  }
}

std::vector<float> Engine::master_shard(int unit) {
  Impl& s = *impl_;
  STRATA_REQUIRE(s.finalized, "Engine::master_shard before finalize()");
  Unit& u = s.unit_at(unit, "Engine::master_shard");
  s.early_step.finish(std::size_t(unit), true);
  std::vector<float> out(u.shard), scratch;
  for (std::size_t g = 0; g < s.groups(u); ++g) {
    const detail::Range r = s.range(u, g);
    s.read_group(std::size_t(unit), g, /*parts=*/1, scratch, [&](std::size_t, const float* v) {
      std::copy_n(v, r.size, out.begin() + std::ptrdiff_t(r.first));
    });
  }
  return out;
}

std::vector<float> Engine::gather_master(int unit) {
  Impl& s = *impl_;
  Unit& u = s.unit_at(unit, "Engine::gather_master");
  std::vector<float> shard = master_shard(unit);
  if (s.world == 1) {
    shard.resize(u.numel);
    return shard;
  }
  std::vector<float> full(u.padded);
  {
    Buffer b = s.alloc(u.padded * 4, s.opt_s.get());
    const TensorRef block = Impl::view(b, DType::kF32, u.shard, std::size_t(s.rank) * u.shard);
    s.opt_s->copy(block.mem, host_ref(shard.data(), u.shard * 4));
    s.comm.all_gather(block, Impl::view(b, DType::kF32, u.padded), *s.opt_s);
    s.opt_s->copy(host_ref(full.data(), u.padded * 4), b.ref());
    s.opt_s->synchronize();
  }
  full.resize(u.numel);
  return full;
}

std::vector<float> Engine::gather_master_to(int unit, int root) {
  Impl& s = *impl_;
  Unit& u = s.unit_at(unit, "Engine::gather_master_to");
  STRATA_REQUIRE(root >= 0 && root < s.world,
                 "Engine::gather_master_to: root {} is not a rank of this {}-rank job", root,
                 s.world);
  if (s.world == 1) return gather_master(unit);
  std::vector<float> shard = master_shard(unit);
  const bool am_root = s.rank == root;
  Buffer b = s.alloc((am_root ? u.padded : u.shard) * 4, s.opt_s.get());
  const TensorRef block =
      Impl::view(b, DType::kF32, u.shard, am_root ? std::size_t(s.rank) * u.shard : 0);
  s.opt_s->copy(block.mem, host_ref(shard.data(), u.shard * 4));
  s.comm.gather(block, am_root ? Impl::view(b, DType::kF32, u.padded) : TensorRef{}, root,
                *s.opt_s);
  std::vector<float> full;
  if (am_root) {
    full.resize(u.padded);
    s.opt_s->copy(host_ref(full.data(), u.padded * 4), b.ref());
  }
  s.opt_s->synchronize();
  if (am_root) full.resize(u.numel);
  return full;
}

// ---- checkpoints ----
// dir/rank<R>.bin: for every unit in order, this rank's master | m | v shard (3 * shard fp32
// values, padding included), streamed one unit at a time from whichever tier holds it.
// dir/rank<R>.json: the layout (units, numel, shard, byte offsets), the rank and world size,
// and the scalar state (steps taken, fp16 loss-scaler fields). Under tensor parallelism R and the
// world size are the job's (DP rank x TP + TP rank, as make_process_groups), with the TP size.
void Engine::save_state(const std::string& dir) {
  Impl& s = *impl_;
  STRATA_REQUIRE(s.finalized, "Engine::save_state before finalize()");
  for (auto& u : s.units)
    STRATA_REQUIRE(u.fetch.in_use == 0 && !u.g.full,
                   "Engine::save_state: unit '{}' is still fetched or has an unreduced "
                   "gradient; save between steps",
                   u.name);
  s.early_step.finish_all();
  s.comm_s->synchronize();
  s.fetch_s->synchronize();
  s.opt_s->synchronize();
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  STRATA_REQUIRE(!ec, "checkpoint: cannot create {}: {}", dir, ec.message());

  nlohmann::json j;
  j["format"] = "strata-engine-state";
  j["version"] = kStateVersion;
  j["rank"] = s.job_rank();
  j["world_size"] = s.job_world();
  j["tensor_parallel"] = s.tp_size();
  j["steps_taken"] = s.steps_taken;
  j["loss_scale"] = s.scale;
  j["hysteresis_left"] = s.hysteresis_left;
  j["scaler_iter"] = s.scaler_iter;
  j["last_overflow_iter"] = s.last_overflow_iter;
  j["compute_dtype"] = std::string(dtype_name(s.cfg.compute_dtype));
  nlohmann::json units = nlohmann::json::array();
  SyncedFile bin(state_file(dir, s.job_rank(), "bin"));
  std::vector<float> scratch;
  std::uint64_t offset = 0;
  for (std::size_t ui = 0; ui < s.units.size(); ++ui) {
    const Unit& u = s.units[ui];
    // A sub-group at a time, each of its master, m and v to its place in the unit's record
    // (the file does not depend on sub_group_size).
    for (std::size_t g = 0; g < s.groups(u); ++g) {
      const detail::Range r = s.range(u, g);
      s.read_group(ui, g, /*parts=*/3, scratch, [&](std::size_t k, const float* v) {
        bin.write_at(v, r.size * 4, offset + (k * u.shard + r.first) * 4);
      });
    }
    units.push_back({{"name", u.name}, {"numel", u.numel}, {"shard", u.shard}, {"offset", offset}});
    offset += 3 * u.shard * 4;
  }
  bin.close();
  j["units"] = std::move(units);
  j["bytes"] = offset;
  const std::string text = j.dump(1);
  SyncedFile meta(state_file(dir, s.job_rank(), "json"));
  meta.write(text.data(), text.size());
  meta.close();
}

void Engine::load_state(const std::string& dir) {
  Impl& s = *impl_;
  STRATA_REQUIRE(
      s.finalized,
      "Engine::load_state before finalize(): build the engine as for training, then load");
  for (auto& u : s.units)
    STRATA_REQUIRE(u.fetch.in_use == 0 && !u.g.full,
                   "Engine::load_state: unit '{}' is still fetched", u.name);
  auto read_json = [&](int r) {
    const std::string path = state_file(dir, r, "json");
    std::ifstream f(path);
    if (!f) return nlohmann::json();
    std::stringstream ss;
    ss << f.rdbuf();
    return config::parse(ss.str(), fmt::format("checkpoint {}: {}", dir, path),
                         /*duplicates_last_wins=*/true);
  };
  // How many ranks wrote the checkpoint, whatever this run's world size: this rank's own file
  // says (all a same-world resume reads: a node-local checkpoint's folder holds only its node's
  // ranks' files), else rank 0's.
  // Under tensor parallelism the files are numbered by job rank: those of this rank's TP slice are
  // every tp-th from its TP rank (DP index q's is q * tp + TP rank).
  const int tp = s.tp_size(), tp_rank = s.tp ? s.tp->rank() : 0;
  const nlohmann::json j_own = read_json(s.job_rank());
  const bool same_world = !j_own.is_null() && j_own.value("world_size", -1) == s.job_world() &&
                          j_own.value("rank", -1) == s.job_rank() &&
                          j_own.value("tensor_parallel", 1) == tp;
  const nlohmann::json j0 = same_world ? j_own : read_json(tp_rank);
  STRATA_REQUIRE(
      !j0.is_null(), "checkpoint {}: no engine state ({})", dir,
      s.job_rank() == tp_rank
          ? fmt::format("rank{}.json is missing", tp_rank)
          : fmt::format("neither rank{}.json nor rank{}.json is there", s.job_rank(), tp_rank));
  const int ck_tp = j0.value("tensor_parallel", 1);
  STRATA_REQUIRE(ck_tp == tp,
                 "checkpoint {} was written with tensor parallelism {}, this run has {}: its "
                 "files hold other slices of the split layers; resume with tensor parallelism "
                 "{} (strata-export writes it as a whole model for any other)",
                 dir, ck_tp, tp, ck_tp);
  const int ck_job = j0.value("world_size", -1);
  STRATA_REQUIRE(ck_job >= 1 && ck_job % tp == 0,
                 "checkpoint {}: rank{}.json gives no world size a multiple of its tensor "
                 "parallelism {}",
                 dir, same_world ? s.job_rank() : tp_rank, tp);
  const int ck_world = ck_job / tp;  // its data-parallel ranks
  // The same world: this rank's own file. Another (resharding): every DP rank's file of this TP
  // slice, each unit's old shards read back as the one array they cut, and this rank's new
  // shard taken from it.
  const bool reshard = ck_world != s.world;
  const int first_file = reshard ? 0 : s.rank, files = reshard ? ck_world : 1;
  struct RankState {
    nlohmann::json j;
    std::string path;
    std::ifstream bin;
  };
  std::vector<RankState> ck(static_cast<std::size_t>(files));
  for (int i = 0; i < files; ++i) {
    const int r = (first_file + i) * tp + tp_rank;  // its job rank
    RankState& rs = ck[std::size_t(i)];
    rs.j = r == (same_world ? s.job_rank() : tp_rank) ? j0 : read_json(r);
    STRATA_REQUIRE(!rs.j.is_null(), "checkpoint {}: rank{}.json is missing{}", dir, r,
                   reshard ? fmt::format(" (the checkpoint's {} ranks' files are all read to "
                                         "reshard them to this run's {})",
                                         ck_world, s.world)
                           : std::string());
    const nlohmann::json& j = rs.j;
    STRATA_REQUIRE(
        j.value("format", "") == "strata-engine-state" && j.value("version", 0) == kStateVersion,
        "checkpoint {}: rank{}.json is not a strata engine state of version {}", dir, r,
        kStateVersion);
    STRATA_REQUIRE(j.value("rank", -1) == r && j.value("world_size", -1) == ck_job,
                   "checkpoint {}: rank{}.json was written by rank {} of {}, rank{}.json by one of "
                   "{}",
                   dir, r, j.value("rank", -1), j.value("world_size", -1), tp_rank, ck_job);
    const nlohmann::json& units = j.at("units");
    STRATA_REQUIRE(units.size() == s.units.size(),
                   "checkpoint {} has {} units, this model has {}: a different model", dir,
                   units.size(), s.units.size());
    for (std::size_t ui = 0; ui < s.units.size(); ++ui) {
      const Unit& u = s.units[ui];
      const nlohmann::json& cu = units[ui];
      const std::string name = cu.value("name", "");
      STRATA_REQUIRE(name == u.name,
                     "checkpoint {}: unit {} is '{}', this model's is '{}': a different model", dir,
                     ui, name, u.name);
      const std::size_t numel = cu.value("numel", std::size_t(0)),
                        shard = cu.value("shard", std::size_t(0));
      STRATA_REQUIRE(numel == u.numel,
                     "checkpoint {}: unit '{}' has {} elements, this model's {}: a different model",
                     dir, u.name, numel, u.numel);
      if (!reshard)
        STRATA_REQUIRE(shard == u.shard,
                       "checkpoint {}: unit '{}' has a shard of {} elements, this run {}", dir,
                       u.name, shard, u.shard);
      else
        STRATA_REQUIRE(
            shard * std::size_t(ck_world) >= numel &&
                shard == ck[0].j.at("units")[ui].value("shard", std::size_t(0)),
            "checkpoint {}: unit '{}': rank{}.json's shard of {} elements does not cut {} "
            "elements over {} ranks as rank0.json's does",
            dir, u.name, r, shard, numel, ck_world);
    }
    rs.path = state_file(dir, r, "bin");
    rs.bin.open(rs.path, std::ios::binary);
    STRATA_REQUIRE(rs.bin.good(), "checkpoint {}: {} cannot be read: {}", dir, rs.path,
                   std::strerror(errno));
    rs.bin.seekg(0, std::ios::end);
    const std::uint64_t size = std::uint64_t(rs.bin.tellg());
    STRATA_REQUIRE(size == j.value("bytes", std::uint64_t(0)),
                   "checkpoint {}: {} has {} bytes, rank{}.json says {}", dir, rs.path, size, r,
                   j.value("bytes", std::uint64_t(0)));
    rs.bin.seekg(0);
  }

  s.early_step.finish_all();
  s.comm_s->synchronize();
  s.fetch_s->synchronize();
  s.opt_s->synchronize();
  s.early_step
      .void_results();  // early optimizer work of a step in progress read the state replaced below
  for (auto& u : s.units) s.drop(u);  // gathered copies hold the old weights
  // count values of record part k (0 master, 1 m, 2 v) of unit ui from element `first` of the
  // unit's flat array (resharding) or of this rank's shard, into out.
  auto read = [&](std::size_t ui, std::size_t k, std::size_t first, std::size_t count, float* out) {
    const Unit& u = s.units[ui];
    auto from = [&](RankState& rs, std::size_t shard, std::size_t off, std::size_t n, float* o) {
      const std::uint64_t at = rs.j.at("units")[ui].value("offset", std::uint64_t(0));
      rs.bin.seekg(std::streamoff(at + (k * shard + off) * 4));
      rs.bin.read(reinterpret_cast<char*>(o), std::streamsize(n * 4));
      STRATA_REQUIRE(rs.bin.good(), "checkpoint {}: {} is truncated at unit '{}'", dir, rs.path,
                     u.name);
    };
    if (!reshard) return from(ck[0], u.shard, first, count, out);
    const std::size_t old = ck[0].j.at("units")[ui].value("shard", std::size_t(0));
    while (count > 0) {
      if (first >= u.numel) {  // the new cut's padding (the old one is zero too)
        std::fill(out, out + count, 0.0f);
        break;
      }
      const std::size_t q = first / old, off = first % old;
      const std::size_t n = std::min({count, old - off, u.numel - first});
      from(ck[q], old, off, n, out);
      first += n;
      out += n;
      count -= n;
    }
  };
  Impl::PutsInFlight pending(Impl::kPutsInFlight);
  const Impl::Placing placing(s, pending);
  for (std::size_t ui = 0; ui < s.units.size(); ++ui) {
    Unit& u = s.units[ui];
    // This rank's shard starts at element rank * shard of the unit (resharding: of the new cut).
    const std::size_t base = reshard ? std::size_t(s.rank) * u.shard : 0;
    s.begin_put(ui, /*first=*/false);
    for (std::size_t g = 0; g < s.groups(u); ++g) {  // read from the file where each part goes
      const detail::Range r = s.range(u, g);
      s.put_group(
          ui, g, [&](std::size_t k, float* dst) { read(ui, k, base + r.first, r.size, dst); },
          &pending);
    }
    s.end_put(ui);
    if (u.g_tier == Tier::kDevice) {
      s.opt_s->fill(Impl::view(u.g.dev, DType::kF32, u.shard), 0.0f);
    } else if (u.g_tier == Tier::kHost) {
      std::memset(u.g.host->data(), 0, u.shard * 4);
    } else {
      try {
        s.settle_grad_io(u);  // (what they wrote is dropped: a write error does not matter now)
      } catch (const Error&) {
      }
      u.g.fresh = true;
    }
  }
  pending.drain();
  s.opt_s->synchronize();
  // The scalar state is every rank's alike: rank 0's (or, same world, this rank's own).
  const nlohmann::json& j = ck[0].j;
  s.steps_taken = j.at("steps_taken").get<std::int64_t>();
  s.scale = j.at("loss_scale").get<double>();
  s.hysteresis_left = j.at("hysteresis_left").get<int>();
  s.scaler_iter = j.at("scaler_iter").get<std::int64_t>();
  s.last_overflow_iter = j.at("last_overflow_iter").get<std::int64_t>();
}

}  // namespace strata
