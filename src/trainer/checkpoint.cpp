// Crash-safe training checkpoints (include/strata/trainer.h: write_checkpoint,
// verify_checkpoint, find_checkpoint).
//
// Protocol (every rank runs write_checkpoint with the same arguments):
//   1. The ranks find which of them share a file system at <root>: rank 0 creates
//      <root>/step-<N>.tmp-<tag> (an older leftover of that name is removed) with a .owner file
//      holding a token of this run; barrier; the ranks that read that token there share rank
//      0's folder. While some rank has not, the lowest such rank does the same on its own file
//      system (a node-local drive), and so on: one round for a shared file system, one per node
//      for node-local ones. The first rank of each group is its leader.
//   2. every rank writes its engine state there (Engine::save_state: rank<R>.bin/.json, each
//      fsync'd) and hashes its own two files (xxh3-64); the sizes and hashes go to every rank,
//      with a flag a rank for one whose files could not be written: then every leader removes its
//      folder, and after a barrier every rank ends the save with an error.
//   3. every leader writes manifest.json (the same on each: every rank's files with the node that
//      wrote them; fsync'd; its last field, manifest_xxh3, the checksum of the rest of it), fsyncs
//      the folder, renames it to <root>/step-<N> (an existing step-<N> is moved aside first) and
//      fsyncs <root>; then a flag a rank goes to every rank: where a leader could not finish,
//      every leader removes its folder (a renamed one too) and puts back what it had set aside,
//      and after a barrier every rank ends the save with an error; else the set-aside copies go.
// A crash at any point leaves either a .tmp-* folder (never chosen: find_checkpoint skips it)
// or a complete step-<N>. find_checkpoint verifies the manifest's own checksum first, then every
// file's size and checksum, before choosing one, so a folder damaged after the fact (the manifest
// included: a flipped data position would resume elsewhere) is skipped too. A node-local
// checkpoint's folder on one node holds that node's ranks' files: the files of the other nodes
// are checked where they are, by the ranks that read them.
#include <fcntl.h>
#include <fmt/format.h>
#include <signal.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <set>
#include <sstream>

#include "core/process.h"
#include "core/write_fd.h"
#include "strata/comm.h"
#include "strata/error.h"
#include "strata/json_config.h"
#include "strata/log.h"
#include "strata/model_io.h"
#include "strata/trainer.h"

namespace strata {
namespace {

namespace fs = std::filesystem;
// 2: the manifest carries its own checksum (manifest_xxh3). Version 1 manifests, without it,
// are still read.
constexpr int kCheckpointVersion = 2;
// 3: node-local (each node's folder holds its own ranks' files); otherwise as 2.
constexpr int kNodeLocalVersion = 3;
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
// (find_checkpoint only skips it). And a step-<N>.pruned-<tag>: a checkpoint a run was removing
// (prune_checkpoints renames it first). A step-<N> exists only once complete (it is renamed into
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
    // A checkpoint a run was pruning when it stopped: renamed so, it is garbage whoever left it.
    if (const auto pruned = n.find(".pruned-");
        n.starts_with("step-") && pruned != std::string::npos && n.substr(pruned + 8) != tmp_tag) {
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
          "checkpoint: removed {}, left by a run that stopped while {} {}", p.string(),
          p.filename().string().find(".pruned-") != std::string::npos ? "removing" : "writing",
          p.filename().string().find(".old-") != std::string::npos ? "that step again" : "it");
  }
}

}  // namespace

namespace {

// The manifest itself, written and fsync'd (half of it, then abort(), under the test hook; an
// I/O error under the other).
void write_manifest(const std::string& mpath, const std::string& text, std::int64_t step,
                    bool may_crash) {
  const int fd = ::open(mpath.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) STRATA_THROW(kIo, "checkpoint: cannot create {}: {}", mpath, std::strerror(errno));
  if (const char* fail = std::getenv("STRATA_TEST_FAIL_MANIFEST");
      fail && std::atoll(fail) == step) {
    ::close(fd);
    STRATA_THROW(kIo, "checkpoint: writing {} failed: {} (STRATA_TEST_FAIL_MANIFEST)", mpath,
                 std::strerror(EIO));
  }
  const char* crash = std::getenv("STRATA_TEST_CRASH_IN_CHECKPOINT");
  const bool crash_here = may_crash && crash && std::atoll(crash) == step;
  if (const int err = write_fd_fully(fd, text.data(), crash_here ? text.size() / 2 : text.size())) {
    ::close(fd);
    STRATA_THROW(kIo, "checkpoint: writing {} failed: {}", mpath, std::strerror(err));
  }
  if (crash_here) {
    std::fprintf(stderr,
                 "strata-train: STRATA_TEST_CRASH_IN_CHECKPOINT=%lld: aborting mid-checkpoint\n",
                 (long long)step);
    std::fflush(stderr);
    std::abort();
  }
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  if (rc != 0) STRATA_THROW(kIo, "checkpoint: fsync {} failed: {}", mpath, std::strerror(err));
}

// What <tmp>/.owner holds, "" when it cannot be read.
std::string read_owner(const std::string& tmp) {
  std::ifstream f(fs::path(tmp) / kOwnerFile);
  std::string line;
  std::getline(f, line);
  return line;
}

// The ranks' groups by file system at the checkpoint's folder (the protocol's step 1): each
// rank's leader, the lowest rank of its group, which made the .tmp folder the group writes to.
// `tokens` holds every rank's "<host> <pid> <nonce>" (the .owner line its leader writes).
std::vector<int> find_file_systems(Communicator& comm, Stream& s, const std::string& root,
                                   const std::string& tmp, const std::string& tmp_tag,
                                   const std::vector<std::string>& tokens) {
  const int rank = comm.rank(), world = comm.world_size();
  std::vector<int> leader(std::size_t(world), -1);
  auto make_folder = [&] {
    std::error_code ec;
    fs::create_directories(root, ec);
    if (ec) STRATA_THROW(kIo, "checkpoint: cannot create {}: {}", root, ec.message());
    remove_dead_runs_folders(root, tmp_tag);
    fs::remove_all(tmp, ec);
    fs::create_directories(tmp, ec);
    if (ec) STRATA_THROW(kIo, "checkpoint: cannot create {}: {}", tmp, ec.message());
    std::ofstream(fs::path(tmp) / kOwnerFile) << tokens[std::size_t(rank)] << "\n";
  };
  if (world == 1) {
    make_folder();
    return {0};
  }
  // The rank whose token `tmp` holds, when it is one of this run's leaders (or `candidate`).
  auto owner_of_tmp = [&](int candidate) {
    const std::string owner = read_owner(tmp);
    for (int r = 0; r < world; ++r)
      if ((r == candidate || leader[std::size_t(r)] == r) && owner == tokens[std::size_t(r)])
        return r;
    return -1;
  };
  for (;;) {
    const auto it = std::find(leader.begin(), leader.end(), -1);
    if (it == leader.end()) break;
    const int candidate = int(it - leader.begin());
    int mine = leader[std::size_t(rank)];
    if (rank == candidate) {
      // A folder an earlier group's leader made (a file system this rank did not see as shared a
      // moment ago, e.g. a network file system's cache): join it, never remove it.
      const int earlier = owner_of_tmp(-1);
      if (earlier >= 0) {
        mine = earlier;
      } else {
        make_folder();
        mine = rank;
      }
    }
    barrier(comm, s);
    if (mine < 0) mine = owner_of_tmp(candidate);
    std::vector<double> v(std::size_t(world), -1.0);
    v[std::size_t(rank)] = mine;
    max_across_ranks(comm, v);
    for (int r = 0; r < world; ++r) leader[std::size_t(r)] = int(v[std::size_t(r)]);
    STRATA_CHECK(leader[std::size_t(candidate)] >= 0,
                 "checkpoint: rank {} found no folder for step files", candidate);
  }
  return leader;
}

}  // namespace

WrittenCheckpoint write_checkpoint(Engine& engine, Communicator& comm, Stream& s,
                                   const std::string& root, std::int64_t step,
                                   const std::string& tmp_tag,
                                   const nlohmann::json& trainer_state) {
  const int rank = comm.rank(), world = comm.world_size();
  const std::string name = fmt::format("step-{}", step);
  const std::string final_dir = (fs::path(root) / name).string();
  const std::string tmp = (fs::path(root) / fmt::format("{}.tmp-{}", name, tmp_tag)).string();
  // This rank's token: its host (the node the manifest names), pid and a random number.
  std::random_device rd;
  const std::vector<std::string> tokens = strings_across_ranks(
      comm, fmt::format("{} {} {:08x}{:08x}", this_host(), ::getpid(), rd(), rd()));
  std::vector<int> leader;
  bool leads = false;
  int groups = 0;  // separate folders (1: a file system every rank sees)
  // A failed save (a full drive, an I/O error) leaves no half-written folder behind to fill the
  // drive: each leader removes its .tmp folder before the error goes on, and puts back a
  // complete checkpoint of the same step it had set aside.
  std::string aside;
  bool renamed = false;  // this leader's folder is <root>/step-<N>
  try {
    leader = find_file_systems(comm, s, root, tmp, tmp_tag, tokens);
    leads = leader[std::size_t(rank)] == rank;
    for (int r = 0; r < world; ++r) groups += leader[std::size_t(r)] == r;
    // Each rank hashes its own files: [bytes, high and low 32 bits of the xxh3] for .bin, .json;
    // then one flag a rank, 1 where its files could not be written. A rank whose save fails (its
    // drive full) still joins the exchange, so that every rank ends the save with an error and
    // every leader removes its folder (the failing rank alone threw, and the folder's leader died
    // in the next collective, leaving it).
    std::vector<double> sums(std::size_t(world) * 7, -1.0);
    std::exception_ptr failed;
    const char* exts[2] = {"bin", "json"};
    try {
      engine.save_state(tmp);
      for (int k = 0; k < 2; ++k) {
        const std::string f = fmt::format("rank{}.{}", rank, exts[k]);
        std::uint64_t bytes = 0, h = 0;
        std::string hex;
        STRATA_REQUIRE(hash_file((fs::path(tmp) / f).string(), bytes, hex),
                       "checkpoint: {}/{} cannot be read back", tmp, f);
        h = std::stoull(hex, nullptr, 16);
        double* at = &sums[std::size_t(rank) * 6 + std::size_t(k) * 3];
        at[0] = double(bytes);
        at[1] = double(h >> 32);
        at[2] = double(h & 0xffffffffu);
      }
    } catch (...) {  // a full drive, an I/O error, memory
      if (world == 1) throw;
      failed = std::current_exception();
    }
    sums[std::size_t(world) * 6 + std::size_t(rank)] = failed ? 1.0 : 0.0;
    if (world > 1) max_across_ranks(comm, sums);
    int first_failed = -1;
    for (int r = world - 1; r >= 0; --r)
      if (sums[std::size_t(world) * 6 + std::size_t(r)] > 0) first_failed = r;
    if (first_failed >= 0) {
      // Every leader's folder is gone before any rank throws: the first error to reach the
      // launcher ends the job (mpirun's abort), which must not cut a removal short.
      if (leads) {
        std::error_code ec;
        fs::remove_all(tmp, ec);
      }
      barrier(comm, s);
      if (failed) std::rethrow_exception(failed);
      throw PeerCheckpointError(first_failed,
                                fmt::format("checkpoint: rank {} could not write its files of "
                                            "step {} (its own message says why)",
                                            first_failed, step),
                                __FILE__, __LINE__);
    }
    // Node-local: every folder's manifest the same, rank 0's trainer state (the ranks' step log
    // lines differ in their timings).
    nlohmann::json state = trainer_state;
    if (groups > 1) state = nlohmann::json::parse(broadcast_string(comm, trainer_state.dump(), 0));
    // A leader that cannot finish its folder (the manifest, the rename) says so to every rank, as
    // a failed rank's files do above: no rank waits for it, and with node-local folders the
    // leaders that did rename theirs take them back (a step is whole on every node or on none).
    std::exception_ptr unfinished;
    try {
      if (leads) {
        const bool node_local = groups > 1;
        nlohmann::json m;
        m["format"] = "strata-checkpoint";
        m["version"] = node_local ? kNodeLocalVersion : kCheckpointVersion;
        m["step"] = step;
        m["world_size"] = world;
        m["engine_steps_taken"] = engine.steps_taken();
        m["trainer"] = std::move(state);
        nlohmann::json files = nlohmann::json::array();
        for (int r = 0; r < world; ++r) {
          const std::string host =
              tokens[std::size_t(r)].substr(0, tokens[std::size_t(r)].find(' '));
          for (int k = 0; k < 2; ++k) {
            const double* at = &sums[std::size_t(r) * 6 + std::size_t(k) * 3];
            STRATA_CHECK(at[0] >= 0, "checkpoint: rank {} sent no checksum", r);
            const std::uint64_t h = (std::uint64_t(at[1]) << 32) | std::uint64_t(at[2]);
            nlohmann::json e = {{"name", fmt::format("rank{}.{}", r, exts[k])},
                                {"bytes", std::uint64_t(at[0])},
                                {"xxh3", fmt::format("{:016x}", h)},
                                {"node", host}};
            // Node-local: which folder holds it (the writing group's leader).
            if (node_local) e["folder_of_rank"] = leader[std::size_t(r)];
            files.push_back(std::move(e));
          }
        }
        m["files"] = std::move(files);
        m["node_local"] = node_local;
        m[kManifestChecksum] = manifest_checksum(m);
        write_manifest((fs::path(tmp) / kManifest).string(), m.dump(1) + "\n", step, rank == 0);
        fsync_path(tmp, true, "checkpoint");
        std::error_code ec;
        if (fs::exists(final_dir, ec)) {  // e.g. a resumed run saving a step again
          aside = (fs::path(root) / fmt::format("{}.old-{}", name, tmp_tag)).string();
          fs::remove_all(aside, ec);
          fs::rename(final_dir, aside, ec);
          if (ec)
            STRATA_THROW(kIo, "checkpoint: cannot move the old {} aside: {}", final_dir,
                         ec.message());
        }
        fs::remove(fs::path(tmp) / kOwnerFile, ec);
        fs::rename(tmp, final_dir, ec);
        if (ec)
          STRATA_THROW(kIo, "checkpoint: cannot rename {} to {}: {}", tmp, final_dir, ec.message());
        renamed = true;
        fsync_path(root, true, "checkpoint");
      }
    } catch (...) {
      if (world == 1) throw;
      unfinished = std::current_exception();
    }
    int first_unfinished = -1;
    if (world > 1) {
      std::vector<double> flags(std::size_t(world), 0.0);
      flags[std::size_t(rank)] = unfinished ? 1.0 : 0.0;
      max_across_ranks(comm, flags);  // also the barrier: every folder is done
      for (int r = world - 1; r >= 0; --r)
        if (flags[std::size_t(r)] > 0) first_unfinished = r;
    }
    if (first_unfinished >= 0) {
      if (leads) {  // gone before any rank throws (as above)
        std::error_code ec;
        if (renamed) fs::remove_all(final_dir, ec);
        fs::remove_all(tmp, ec);
        if (!aside.empty() && fs::exists(aside, ec)) fs::rename(aside, final_dir, ec);
        aside.clear();
      }
      barrier(comm, s);
      if (unfinished) std::rethrow_exception(unfinished);
      throw PeerCheckpointError(first_unfinished,
                                fmt::format("checkpoint: rank {} could not finish its folder of "
                                            "step {} (its own message says why)",
                                            first_unfinished, step),
                                __FILE__, __LINE__);
    }
    if (leads && !aside.empty()) {
      std::error_code ec;
      fs::remove_all(aside, ec);
    }
    return {final_dir, leads, groups};
  } catch (...) {
    if (leads) {
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
  if (config::nested_too_deep(ss.str()))
    return fmt::format("manifest.json nests arrays and objects more than {} deep (damaged)",
                       config::kMaxJsonDepth);
  try {
    m = nlohmann::json::parse(ss.str());
  } catch (const std::exception& e) {
    return fmt::format("manifest.json does not parse ({})", e.what());
  }
  try {  // a field of the wrong type (a damaged manifest) throws from value()
    if (!m.is_object() || m.value("format", "") != "strata-checkpoint")
      return "manifest.json is not a strata checkpoint manifest";
    const int version = m.value("version", 0);
    if (version < 1 || version > kNodeLocalVersion)
      return fmt::format("format version {}, this build reads 1 to {}", version, kNodeLocalVersion);
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
    // Node-local: the files of a node whose folder this is (any of its files here) must all be
    // here and verify; another node's are checked on that node.
    const bool node_local = m.value("node_local", false);
    std::map<int, int> present_of_folder;
    for (const auto& e : m["files"]) {
      const std::string name = e.value("name", "");
      if (name.empty() || name.find('/') != std::string::npos)
        return "manifest.json has a bad file entry";
      const int folder = node_local ? e.value("folder_of_rank", -1) : 0;
      std::error_code ec;
      if (node_local && !fs::exists(fs::path(dir) / name, ec)) continue;
      ++present_of_folder[folder];
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
    if (node_local) {
      if (present_of_folder.empty())
        return "a node-local checkpoint with none of its ranks' files in this folder (they are on "
               "the nodes its manifest names)";
      for (const auto& e : m["files"]) {
        const int folder = e.value("folder_of_rank", -1);
        std::error_code ec;
        if (present_of_folder.count(folder) && !fs::exists(fs::path(dir) / e.value("name", ""), ec))
          return fmt::format("{} is missing (written on node {} with {} file(s) that are here)",
                             e.value("name", ""), e.value("node", "?"), present_of_folder[folder]);
      }
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

std::string checkpoint_rank_missing(const std::string& dir, const nlohmann::json& manifest,
                                    int rank) {
  for (const char* ext : {"bin", "json"}) {
    const std::string name = fmt::format("rank{}.{}", rank, ext);
    std::error_code ec;
    if (fs::exists(fs::path(dir) / name, ec)) continue;
    std::string node;
    for (const auto& e : manifest.value("files", nlohmann::json::array()))
      if (e.is_object() && e.value("name", "") == name) node = e.value("node", "");
    const std::string written =
        node.empty() ? std::string()
        : manifest.value("node_local", false)
            ? fmt::format(
                  ": the checkpoint is node-local, and node {} wrote rank {}'s files into "
                  "its own {}",
                  node, rank, dir)
            : fmt::format(" (node {} wrote it)", node);
    return fmt::format("rank {}'s engine state ({}) is not in {} on this node ({}){}", rank, name,
                       dir, this_host(), written);
  }
  return "";
}

FoundCheckpoint find_checkpoint(const std::string& path, const std::string& what,
                                std::int64_t max_step) {
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
  // Listed again where a candidate went while it was verified (a live run's pruning removed it
  // as its next checkpoint was completed: an export of a run still going failed, "no complete
  // checkpoint", about one time in twenty with --keep-checkpoints 1).
  std::vector<std::pair<std::int64_t, std::string>> found;
  // Each note said once, however many times the folder is listed: true the first time.
  std::set<std::string> said;
  const auto first_time = [&](const std::string& m) { return said.insert(m).second; };
  const auto warn_once = [&](const std::string& m) {
    if (first_time(m)) log::warn("{}", m);
  };
  for (int listing = 0;; ++listing) {
    const bool last_listing = listing == 4;
    std::vector<std::pair<std::int64_t, std::string>> set_aside;
    found.clear();
    for (const auto& e : fs::directory_iterator(root, ec)) {
      std::error_code link_ec;  // a link that loops or dangles: not a folder, said if named step-*
      if (!e.is_directory(link_ec)) {
        if (link_ec && e.path().filename().string().rfind("step-", 0) == 0)
          warn_once(fmt::format("{}: skipping {}: {}", what, e.path().string(), link_ec.message()));
        continue;
      }
      const std::string name = e.path().filename().string();
      const std::int64_t st = step_of(name);
      const auto old = name.find(".old-");
      if (st >= 0)
        found.emplace_back(st, e.path().string());
      else if (old != std::string::npos && step_of(name.substr(0, old)) >= 0)
        set_aside.emplace_back(step_of(name.substr(0, old)), e.path().string());
      else if (name.rfind("step-", 0) == 0)
        warn_once(fmt::format("{}: skipping {}: {}", what, e.path().string(),
                              name.find(".pruned-") != std::string::npos
                                  ? "a checkpoint a run was removing (the next save removes it)"
                                  : "an unfinished checkpoint"));
    }
    STRATA_REQUIRE(!ec, "{} {}: cannot list {}: {}", what, path, root, ec.message());
    // A complete step-<N> a run moved aside to save step N again, and died before the new one took
    // its name (write_checkpoint): it stands for step N while there is no step-<N>.
    // Beside its step-<N> it is the older copy of that step: tried after it (the stable sort below
    // keeps it behind), when step-<N> does not verify.
    for (const auto& [st, dir] : set_aside) {
      const bool have = std::any_of(found.begin(), found.end(),
                                    [st = st](const auto& f) { return f.first == st; });
      if (have) {
        const std::string m =
            fmt::format("{}: {} is an older copy of step-{}: taken only if step-{} does not verify",
                        what, dir, st, st);
        if (first_time(m)) log::info("{}", m);
      } else {
        warn_once(fmt::format(
            "{}: {} is step-{} set aside by a run that stopped while saving that step again: "
            "taking it as step-{}",
            what, dir, st, st));
      }
      found.emplace_back(st, dir);
    }
    std::stable_sort(found.begin(), found.end(),
                     [](const auto& a, const auto& b) { return a.first > b.first; });
    std::vector<std::string> skipped;
    bool gone = false;
    for (const auto& [st, dir] : found) {
      if (max_step >= 0 && st > max_step) continue;
      FoundCheckpoint fc;
      std::string why = verify_checkpoint(dir, &fc.manifest);
      if (why.empty() && fc.manifest.value("step", std::int64_t(-1)) != st)
        why = fmt::format("its manifest says step {}", fc.manifest.value("step", std::int64_t(-1)));
      if (std::error_code gone_ec; !why.empty() && !last_listing && !fs::exists(dir, gone_ec)) {
        gone = true;  // removed while it was read: the folder is listed again
        break;
      }
      if (!why.empty()) {
        warn_once(fmt::format("{}: skipping {}: {}", what, dir, why));
        skipped.push_back(fmt::format("{}: {}", dir, why));
        continue;
      }
      fc.dir = dir;
      fc.root = root;
      fc.step = st;
      fc.skipped = std::move(skipped);
      return fc;
    }
    if (!gone) break;
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
