// Crash-safe training checkpoints (include/strata/trainer.h: write_checkpoint,
// verify_checkpoint, find_checkpoint).
//
// Protocol (every rank runs write_checkpoint with the same arguments):
//   1. rank 0 creates <root>/step-<N>.tmp-<tag> (an older leftover of that name is removed);
//      barrier.
//   2. every rank writes its engine state there (Engine::save_state: rank<R>.bin/.json, each
//      fsync'd); barrier.
//   3. rank 0 hashes every file (xxh3-64), writes manifest.json (fsync'd; its last field,
//      manifest_xxh3, the checksum of the rest of it), fsyncs the folder, renames it to
//      <root>/step-<N> (an existing step-<N> is moved aside first and removed after) and fsyncs
//      <root>; barrier.
// A crash at any point leaves either a .tmp-* folder (never chosen: find_checkpoint skips it)
// or a complete step-<N>. find_checkpoint verifies the manifest's own checksum first, then every
// file's size and checksum, before choosing one, so a folder damaged after the fact (the manifest
// included: a flipped data position would resume elsewhere) is skipped too.
#include <fcntl.h>
#include <fmt/format.h>
#include <signal.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/process.h"
#include "strata/error.h"
#include "strata/log.h"
#include "strata/model_io.h"
#include "strata/trainer.h"

namespace strata {
namespace {

namespace fs = std::filesystem;
// 2: the manifest carries its own checksum (manifest_xxh3). Version 1 manifests, without it,
// are still read.
constexpr int kCheckpointVersion = 2;
constexpr const char* kManifest = "manifest.json";
constexpr const char* kManifestChecksum = "manifest_xxh3";

// Size and xxh3-64 of a file, streamed; false when it cannot be read.
bool hash_file(const std::string& path, std::uint64_t& bytes, std::string& hex) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return false;
  XXH3_state_t* st = XXH3_createState();
  XXH3_64bits_reset(st);
  std::vector<char> buf(std::size_t(4) << 20);
  bytes = 0;
  while (f) {
    f.read(buf.data(), std::streamsize(buf.size()));
    const std::streamsize n = f.gcount();
    if (n <= 0) break;
    XXH3_64bits_update(st, buf.data(), std::size_t(n));
    bytes += std::uint64_t(n);
  }
  const bool ok = f.eof();
  hex = fmt::format("{:016x}", XXH3_64bits_digest(st));
  XXH3_freeState(st);
  return ok;
}

void barrier(Communicator& comm, Stream& s) {
  if (comm.world_size() == 1) return;
  comm.barrier(s);
  s.synchronize();
}

std::int64_t step_of(const std::string& name) {
  if (name.rfind("step-", 0) != 0) return -1;
  const std::string digits = name.substr(5);
  if (digits.empty() || digits.size() > 18 || !std::all_of(digits.begin(), digits.end(), ::isdigit))
    return -1;
  return std::stoll(digits);
}

}  // namespace

// Its compact dump: nlohmann keeps an object's keys sorted, so the same content dumps the same.
std::string manifest_checksum(nlohmann::json manifest) {
  manifest.erase(kManifestChecksum);
  const std::string body = manifest.dump();
  return fmt::format("{:016x}", XXH3_64bits(body.data(), body.size()));
}

std::string model_config_hash(const ModelConfig& c) {
  std::string key = fmt::format(
      "arch={} vocab={} hidden={} inter={} layers={} heads={} kv={} head_dim={} pos={} eps={:a} "
      "theta={:a} "
      "l3={:a},{:a},{:a},{:a} tie={} qkv_bias={}",
      int(c.arch), c.vocab_size, c.hidden_size, c.intermediate_size, c.num_layers, c.num_heads,
      c.num_kv_heads, c.head_dim, c.max_positions, c.norm_eps, c.rope_theta, c.rope_llama3_factor,
      c.rope_llama3_low_freq_factor, c.rope_llama3_high_freq_factor,
      c.rope_llama3_original_max_positions, c.tie_word_embeddings, c.qkv_bias);
  // Only when not the default, so that the hashes of earlier checkpoints still match.
  if (!c.scale_attn_weights || c.scale_attn_by_inverse_layer_idx)
    key +=
        fmt::format(" attn_scale={},{}", c.scale_attn_weights, c.scale_attn_by_inverse_layer_idx);
  for (const UnitSpec& u : model_units(c)) {
    key += fmt::format("|{}:{}", u.name, u.numel);
    for (const ParamSpec& p : u.params) key += fmt::format(",{}@{}+{}", p.name, p.offset, p.numel);
  }
  return fmt::format("{:016x}", XXH3_64bits(key.data(), key.size()));
}

namespace {

// Who is writing a .tmp folder: "<host> <pid>" of rank 0, removed before the rename.
constexpr const char* kOwnerFile = ".owner";

// Half-written checkpoints of runs that died: never chosen, only taking space. Only a folder
// whose owner was on this host and whose process is gone (a live run's, or one from another
// host sharing the folder, is left alone). Also a step-<N>.old-<pid> beside a step-<N> with
// its manifest: the older copy of a step saved again by a run that died before removing it
// (find_checkpoint only skips it). A step-<N> exists only once complete (it is renamed into
// place), and a run that is saving step N has no step-<N> until its rename.
void remove_dead_runs_folders(const std::string& root, const std::string& tmp_tag) {
  std::error_code ec;
  std::vector<fs::path> dead;
  for (fs::directory_iterator it(root, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string n = it->path().filename().string();
    if (const auto old = n.find(".old-"); n.starts_with("step-") && old != std::string::npos) {
      // Only beside a step-<N> that verifies as step N: one damaged since leaves the older copy
      // the only good one. (That hashes step-<N> once; a set-aside copy is left only by a crash.)
      const std::string step_dir = (fs::path(root) / n.substr(0, old)).string();
      std::error_code e2;
      nlohmann::json m;
      if (n.substr(old + 5) != tmp_tag && fs::exists(fs::path(step_dir) / kManifest, e2) &&
          verify_checkpoint(step_dir, &m).empty() &&
          m.value("step", std::int64_t(-1)) == step_of(n.substr(0, old)))
        dead.push_back(it->path());
      continue;
    }
    const auto at = n.find(".tmp-");
    if (!n.starts_with("step-") || at == std::string::npos || n.substr(at + 5) == tmp_tag) continue;
    std::ifstream owner(it->path() / kOwnerFile);
    std::string host;
    long pid = 0;
    if (!(owner >> host >> pid) || host != this_host() || !process_gone(pid)) continue;
    dead.push_back(it->path());
  }
  for (const fs::path& p : dead) {
    fs::remove_all(p, ec);
    if (!ec)
      log::info(
          "checkpoint: removed {}, left by a run that stopped while writing {}", p.string(),
          p.filename().string().find(".old-") != std::string::npos ? "that step again" : "it");
  }
}

}  // namespace

std::string write_checkpoint(Engine& engine, Communicator& comm, Stream& s, const std::string& root,
                             std::int64_t step, const std::string& tmp_tag,
                             const nlohmann::json& trainer_state) {
  const int rank = comm.rank(), world = comm.world_size();
  const std::string name = fmt::format("step-{}", step);
  const std::string final_dir = (fs::path(root) / name).string();
  const std::string tmp = (fs::path(root) / fmt::format("{}.tmp-{}", name, tmp_tag)).string();
  if (rank == 0) {
    std::error_code ec;
    fs::create_directories(root, ec);
    STRATA_REQUIRE(!ec, "checkpoint: cannot create {}: {}", root, ec.message());
    remove_dead_runs_folders(root, tmp_tag);
    fs::remove_all(tmp, ec);
    fs::create_directories(tmp, ec);
    STRATA_REQUIRE(!ec, "checkpoint: cannot create {}: {}", tmp, ec.message());
    std::ofstream(fs::path(tmp) / kOwnerFile) << this_host() << " " << ::getpid() << "\n";
  }
  // A failed save (a full drive, an I/O error) leaves no half-written folder behind to fill the
  // drive: rank 0 removes its .tmp folder before the error goes on, and puts back a complete
  // checkpoint of the same step it had set aside.
  std::string aside;
  try {
    barrier(comm, s);
    engine.save_state(tmp);
    barrier(comm, s);
    if (rank == 0) {
      nlohmann::json m;
      m["format"] = "strata-checkpoint";
      m["version"] = kCheckpointVersion;
      m["step"] = step;
      m["world_size"] = world;
      m["engine_steps_taken"] = engine.steps_taken();
      m["trainer"] = trainer_state;
      nlohmann::json files = nlohmann::json::array();
      for (int r = 0; r < world; ++r)
        for (const char* ext : {"bin", "json"}) {
          const std::string f = fmt::format("rank{}.{}", r, ext);
          std::uint64_t bytes = 0;
          std::string hex;
          STRATA_REQUIRE(hash_file((fs::path(tmp) / f).string(), bytes, hex),
                         "checkpoint: {}/{} cannot be read back", tmp, f);
          files.push_back({{"name", f}, {"bytes", bytes}, {"xxh3", hex}});
        }
      m["files"] = std::move(files);
      m[kManifestChecksum] = manifest_checksum(m);
      const std::string text = m.dump(1) + "\n";
      const std::string mpath = (fs::path(tmp) / kManifest).string();
      {
        const int fd = ::open(mpath.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
        STRATA_REQUIRE(fd >= 0, "checkpoint: cannot create {}: {}", mpath, std::strerror(errno));
        std::size_t done = 0;
        const char* crash = std::getenv("STRATA_TEST_CRASH_IN_CHECKPOINT");
        const bool crash_here = crash && std::atoll(crash) == step;
        const std::size_t limit = crash_here ? text.size() / 2 : text.size();
        while (done < limit) {
          const ssize_t n = ::write(fd, text.data() + done, limit - done);
          if (n < 0 && errno == EINTR) continue;
          if (n <= 0) {
            const int err = errno;
            ::close(fd);
            STRATA_THROW(kIo, "checkpoint: writing {} failed: {}", mpath, std::strerror(err));
          }
          done += std::size_t(n);
        }
        if (crash_here) {
          std::fprintf(
              stderr,
              "strata-train: STRATA_TEST_CRASH_IN_CHECKPOINT=%lld: aborting mid-checkpoint\n",
              (long long)step);
          std::fflush(stderr);
          std::abort();
        }
        const int rc = ::fsync(fd);
        const int err = errno;
        ::close(fd);
        STRATA_REQUIRE(rc == 0, "checkpoint: fsync {} failed: {}", mpath, std::strerror(err));
      }
      fsync_path(tmp, true, "checkpoint");
      std::error_code ec;
      if (fs::exists(final_dir, ec)) {  // e.g. a resumed run saving a step again
        aside = (fs::path(root) / fmt::format("{}.old-{}", name, tmp_tag)).string();
        fs::remove_all(aside, ec);
        fs::rename(final_dir, aside, ec);
        STRATA_REQUIRE(!ec, "checkpoint: cannot move the old {} aside: {}", final_dir,
                       ec.message());
      }
      fs::remove(fs::path(tmp) / kOwnerFile, ec);
      fs::rename(tmp, final_dir, ec);
      STRATA_REQUIRE(!ec, "checkpoint: cannot rename {} to {}: {}", tmp, final_dir, ec.message());
      fsync_path(root, true, "checkpoint");
      if (!aside.empty()) fs::remove_all(aside, ec);
    }
    barrier(comm, s);
    return final_dir;
  } catch (...) {
    if (rank == 0) {
      std::error_code ec;
      fs::remove_all(tmp, ec);
      if (!aside.empty() && !fs::exists(final_dir, ec) && fs::exists(aside, ec))
        fs::rename(aside, final_dir, ec);
    }
    throw;
  }
}

std::string verify_checkpoint(const std::string& dir, nlohmann::json* manifest) {
  const std::string mpath = (fs::path(dir) / kManifest).string();
  std::ifstream f(mpath);
  if (!f) return "no manifest.json (incomplete)";
  std::stringstream ss;
  ss << f.rdbuf();
  nlohmann::json m;
  try {
    m = nlohmann::json::parse(ss.str());
  } catch (const std::exception& e) {
    return fmt::format("manifest.json does not parse ({})", e.what());
  }
  try {  // a field of the wrong type (a damaged manifest) throws from value()
    if (!m.is_object() || m.value("format", "") != "strata-checkpoint")
      return "manifest.json is not a strata checkpoint manifest";
    const int version = m.value("version", 0);
    if (version != 1 && version != kCheckpointVersion)
      return fmt::format("format version {}, this build reads 1 to {}", version,
                         kCheckpointVersion);
    if (version >= 2) {  // the manifest itself first: every value below is read from it
      if (!m.contains(kManifestChecksum) || !m[kManifestChecksum].is_string())
        return "manifest.json has no checksum of its own (manifest_xxh3)";
      const std::string want = m[kManifestChecksum].get<std::string>(), got = manifest_checksum(m);
      if (got != want)
        return fmt::format(
            "manifest.json has checksum {}, its manifest_xxh3 says {}: it changed after it was "
            "written",
            got, want);
    }
    if (!m.contains("files") || !m["files"].is_array() || m["files"].empty())
      return "manifest.json lists no files";
    for (const auto& e : m["files"]) {
      const std::string name = e.value("name", "");
      if (name.empty() || name.find('/') != std::string::npos)
        return "manifest.json has a bad file entry";
      std::uint64_t bytes = 0;
      std::string hex;
      if (!hash_file((fs::path(dir) / name).string(), bytes, hex))
        return fmt::format("{} is missing", name);
      if (bytes != e.value("bytes", std::uint64_t(0)))
        return fmt::format("{} has {} bytes, the manifest says {}", name, bytes,
                           e.value("bytes", std::uint64_t(0)));
      if (hex != e.value("xxh3", ""))
        return fmt::format("{} has checksum {}, the manifest says {}", name, hex,
                           e.value("xxh3", ""));
    }
  } catch (const nlohmann::json::exception& e) {
    return fmt::format("manifest.json has a field of the wrong type ({})", e.what());
  }
  if (manifest) *manifest = std::move(m);
  return "";
}

std::vector<std::string> checkpoint_folders(const std::string& dir) {
  std::vector<std::pair<std::int64_t, std::string>> found;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    if (!e.is_directory(ec)) continue;
    const std::string name = e.path().filename().string();
    const auto old = name.find(".old-");
    const std::int64_t st = step_of(old == std::string::npos ? name : name.substr(0, old));
    if (st >= 0) found.emplace_back(st, e.path().string());
  }
  std::sort(found.begin(), found.end(), std::greater<>());
  std::vector<std::string> out;
  for (auto& f : found) out.push_back(std::move(f.second));
  return out;
}

FoundCheckpoint find_checkpoint(const std::string& path, const std::string& what) {
  std::error_code ec;
  STRATA_REQUIRE(
      fs::is_directory(path, ec), "{} {}: {}", what, path,
      fs::exists(path, ec)
          ? "a file, not a folder: give a checkpoint's folder, a checkpoints folder or a "
            "run's --out"
          : "no such directory");
  // A checkpoint folder itself.
  if (fs::exists(fs::path(path) / kManifest, ec) ||
      step_of(fs::path(path).filename().string()) >= 0) {
    FoundCheckpoint fc;
    const std::string why = verify_checkpoint(path, &fc.manifest);
    STRATA_REQUIRE(why.empty(), "{} {}: not a complete checkpoint: {}", what, path, why);
    fc.dir = path;
    fc.step = fc.manifest.value("step", std::int64_t(0));
    return fc;
  }
  std::string root = path;
  if (fs::is_directory(fs::path(path) / "checkpoints", ec))
    root = (fs::path(path) / "checkpoints").string();
  std::vector<std::pair<std::int64_t, std::string>> found, set_aside;
  for (const auto& e : fs::directory_iterator(root, ec)) {
    if (!e.is_directory()) continue;
    const std::string name = e.path().filename().string();
    const std::int64_t st = step_of(name);
    const auto old = name.find(".old-");
    if (st >= 0)
      found.emplace_back(st, e.path().string());
    else if (old != std::string::npos && step_of(name.substr(0, old)) >= 0)
      set_aside.emplace_back(step_of(name.substr(0, old)), e.path().string());
    else if (name.rfind("step-", 0) == 0)
      log::warn("{}: skipping {}: an unfinished checkpoint", what, e.path().string());
  }
  STRATA_REQUIRE(!ec, "{} {}: cannot list {}: {}", what, path, root, ec.message());
  // A complete step-<N> a run moved aside to save step N again, and died before the new one took
  // its name (write_checkpoint): it stands for step N while there is no step-<N>.
  // Beside its step-<N> it is the older copy of that step: tried after it (the stable sort below
  // keeps it behind), when step-<N> does not verify.
  for (const auto& [st, dir] : set_aside) {
    const bool have =
        std::any_of(found.begin(), found.end(), [st = st](const auto& f) { return f.first == st; });
    if (have)
      log::info("{}: {} is an older copy of step-{}: taken only if step-{} does not verify", what,
                dir, st, st);
    else
      log::warn(
          "{}: {} is step-{} set aside by a run that stopped while saving that step again: taking "
          "it as step-{}",
          what, dir, st, st);
    found.emplace_back(st, dir);
  }
  std::stable_sort(found.begin(), found.end(),
                   [](const auto& a, const auto& b) { return a.first > b.first; });
  std::vector<std::string> skipped;
  for (const auto& [st, dir] : found) {
    FoundCheckpoint fc;
    std::string why = verify_checkpoint(dir, &fc.manifest);
    if (why.empty() && fc.manifest.value("step", std::int64_t(-1)) != st)
      why = fmt::format("its manifest says step {}", fc.manifest.value("step", std::int64_t(-1)));
    if (!why.empty()) {
      log::warn("{}: skipping {}: {}", what, dir, why);
      skipped.push_back(fmt::format("{}: {}", dir, why));
      continue;
    }
    fc.dir = dir;
    fc.root = root;
    fc.step = st;
    fc.skipped = std::move(skipped);
    return fc;
  }
  STRATA_REQUIRE(!found.empty(), "{} {}: no checkpoint there yet (no step-<N> folder in {}){}",
                 what, path, root,
                 what == "--resume" ? "; to start the run from the beginning, drop --resume" : "");
  STRATA_THROW(kInvalidArgument,
               "{} {}: no complete checkpoint found (looked for step-<N> folders with a valid "
               "manifest.json in {}; {} candidate(s) failed verification)",
               what, path, root, found.size());
}

}  // namespace strata
