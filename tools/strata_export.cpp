// strata-export: a strata-train checkpoint (any number of ranks) -> a Hugging Face folder
// (config.json + safetensors, sharded with model.safetensors.index.json when large).
//
//   strata-export CKPT_DIR OUT_DIR [--dtype fp32|bf16] [--overwrite] [--max-shard-mb N]
//
// CKPT_DIR is a checkpoint (step-<N>), a folder of checkpoints or a run's --out (the newest
// complete checkpoint is taken, as --resume does). The model comes from the checkpoint's
// manifest (trainer.model_config, checked against trainer.model_config_hash), or from
// --model-config FILE for checkpoints written before the manifest carried it.
//
// Bounded memory: one engine unit at a time. For each unit, every rank's shard of its fp32
// master weights is read from rank<R>.bin at the offset rank<R>.json gives (the shard is the
// first third of the unit's master|m|v record), the shards are concatenated, the padding is
// dropped and the unit goes to HfWeightsWriter (strata/model_io.h), the writer strata-train
// --out uses: the shards' headers are known up front (the shapes come from the config), so each
// safetensors file is written header first and then tensor by tensor as the units arrive, and an
// fp32 export of a checkpoint is byte for byte what strata-train --out writes at that step. Files
// go to temporary names and are renamed into place only when every one is complete.
#include <fcntl.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "strata/dtype.h"
#include "strata/error.h"
#include "strata/model.h"
#include "strata/model_io.h"
#include "strata/nvme.h"
#include "strata/paths.h"
#include "strata/trainer.h"
#include "tool_main.h"

namespace {

namespace fs = std::filesystem;
using strata::DType;

struct RankFile {
  int fd = -1;
  std::string path;
  std::uint64_t size = 0;
  nlohmann::json units;
};

struct Options {
  std::string ckpt, out, dtype = "fp32", model_config, model_dir;
  bool overwrite = false;
  bool accept_older = false;
  double max_shard_mb = 5 * 1024;
};

// ---- the checkpoint ----
// CKPT_DIR itself when it holds a manifest, else the newest complete checkpoint under it.
strata::FoundCheckpoint find_export_checkpoint(const Options& o) {
  std::error_code ec;
  strata::require_input_folder("", o.ckpt, "the checkpoint's folder (or a run's --out)");
  strata::FoundCheckpoint ck;
  if (fs::exists(fs::path(o.ckpt) / "manifest.json", ec)) {
    const std::string why = strata::verify_checkpoint(o.ckpt, &ck.manifest);
    STRATA_REQUIRE(why.empty(), "{}: not a complete checkpoint: {}", o.ckpt, why);
    ck.dir = o.ckpt;
    ck.step = ck.manifest.value("step", std::int64_t(0));
  } else {
    ck = strata::find_checkpoint(o.ckpt, "checkpoint");
    // A damaged newest checkpoint: exporting an older step without a word would pass for the
    // run's latest model.
    STRATA_REQUIRE(ck.skipped.empty() || o.accept_older,
                   "{}: the newest checkpoint does not verify ({}); the newest complete one is {} "
                   "(step {}): pass "
                   "--accept-older to export that one, or give its folder",
                   o.ckpt, ck.skipped.front(), ck.dir, ck.step);
  }
  return ck;
}

// ---- the model ----
// --model-config, else the manifest's, checked against the hash the checkpoint was taken with.
strata::ModelConfig export_model(const Options& o, const strata::FoundCheckpoint& ck,
                                 const nlohmann::json& trainer) {
  strata::ModelConfig cfg;
  if (!o.model_config.empty()) {
    strata::require_input_file("--model-config", o.model_config);
    cfg = strata::load_model_config(o.model_config);
  } else {
    STRATA_REQUIRE(trainer.contains("model_config") && trainer["model_config"].is_object(),
                   "{}: the manifest does not carry the model's config (a checkpoint of an older "
                   "strata-train); "
                   "give --model-config FILE",
                   ck.dir);
    cfg = strata::parse_model_config(trainer["model_config"].dump(),
                                     ck.dir + "/manifest.json (trainer.model_config)");
  }
  const std::string want_hash = trainer.value("model_config_hash", "");
  STRATA_REQUIRE(
      want_hash.empty() || want_hash == strata::model_config_hash(cfg),
      "{}: the checkpoint was taken with a different model (config hash {}, this config's {})",
      ck.dir, want_hash, strata::model_config_hash(cfg));
  return cfg;
}

// ---- every rank's layout ----
// Rank r's engine state (rank<r>.json), checked against the model (its TP rank's slices, `units`)
// and its TP rank's first file's shards, and its rank<r>.bin opened. Under tensor parallelism (tp
// > 1) rank r holds TP slice r % tp and is data-parallel rank r / tp of world / tp.
void open_rank(std::vector<RankFile>& ranks, int r, const std::string& ck_dir, int world, int tp,
               const std::vector<strata::UnitSpec>& units) {
  RankFile& rf = ranks[std::size_t(r)];
  const nlohmann::json j =
      strata::tools::read_json_file((fs::path(ck_dir) / fmt::format("rank{}.json", r)).string());
  STRATA_REQUIRE(j.value("format", "") == "strata-engine-state",
                 "{}/rank{}.json is not a strata engine state", ck_dir, r);
  STRATA_REQUIRE(j.value("rank", -1) == r && j.value("world_size", -1) == world,
                 "{}/rank{}.json says rank {} of {}, the manifest {} of {}", ck_dir, r,
                 j.value("rank", -1), j.value("world_size", -1), r, world);
  rf.units = j.value("units", nlohmann::json::array());
  STRATA_REQUIRE(rf.units.size() == units.size(), "{}/rank{}.json has {} units, the model {}",
                 ck_dir, r, rf.units.size(), units.size());
  for (std::size_t u = 0; u < units.size(); ++u) {
    const auto& ju = rf.units[u];
    STRATA_REQUIRE(ju.value("name", "") == units[u].name &&
                       ju.value("numel", std::uint64_t(0)) == units[u].numel,
                   "{}/rank{}.json: unit {} is '{}' ({} elements), the model's '{}' ({})", ck_dir,
                   r, u, ju.value("name", ""), ju.value("numel", std::uint64_t(0)), units[u].name,
                   units[u].numel);
    STRATA_REQUIRE(
        ju.value("shard", std::uint64_t(0)) * std::uint64_t(world / tp) >= units[u].numel,
        "{}/rank{}.json: unit '{}' has a shard of {} elements, too small for {} ranks", ck_dir, r,
        units[u].name, ju.value("shard", std::uint64_t(0)), world / tp);
    // At most an even cut and one page of padding (the engine pads a unit to a multiple of the
    // ranks x 2048 elements): a damaged one sized the read.
    const std::uint64_t dp = std::uint64_t(world / tp);
    STRATA_REQUIRE(ju.value("shard", std::uint64_t(0)) <= (units[u].numel + dp - 1) / dp + 2048,
                   "{}/rank{}.json: unit '{}' has a shard of {} elements, more than {} ranks' cut "
                   "of its {} elements holds (damaged)",
                   ck_dir, r, units[u].name, ju.value("shard", std::uint64_t(0)), dp,
                   units[u].numel);
    const std::size_t first = std::size_t(r % tp);  // its TP slice's first file
    STRATA_REQUIRE(ju.value("shard", std::uint64_t(0)) ==
                       ranks[first].units[u].value("shard", std::uint64_t(0)),
                   "{}: unit '{}' has shards of different sizes on rank {} and rank {}", ck_dir,
                   units[u].name, first, r);
  }
  rf.path = (fs::path(ck_dir) / fmt::format("rank{}.bin", r)).string();
  rf.fd = ::open(rf.path.c_str(), O_RDONLY | O_CLOEXEC);
  STRATA_REQUIRE(rf.fd >= 0, "{} cannot be opened: {}", rf.path, std::strerror(errno));
  rf.size = fs::file_size(rf.path);
}

// One unit's fp32 master weights, unpadded: every rank's shard in rank order.
std::vector<float> read_unit(const std::vector<RankFile>& ranks, std::size_t u,
                             const std::vector<strata::UnitSpec>& units) {
  const int world = int(ranks.size());
  const std::uint64_t shard = ranks[0].units[u].value("shard", std::uint64_t(0));
  std::vector<float> flat(shard * std::uint64_t(world));
  for (int r = 0; r < world; ++r) {
    const RankFile& rf = ranks[std::size_t(r)];
    const std::uint64_t off = rf.units[u].value("offset", std::uint64_t(0)), bytes = shard * 4;
    STRATA_REQUIRE(off + 3 * bytes <= rf.size,
                   "{}: unit '{}' at {} + {} bytes runs past the end ({} bytes)", rf.path,
                   units[u].name, off, 3 * bytes, rf.size);
    auto* dst = reinterpret_cast<char*>(flat.data() + std::uint64_t(r) * shard);
    std::uint64_t done = 0;
    while (done < bytes) {
      const ssize_t n = ::pread(rf.fd, dst + done, bytes - done, off_t(off + done));
      if (n < 0 && errno == EINTR) continue;
      STRATA_REQUIRE(n > 0, "{}: reading unit '{}' failed: {}", rf.path, units[u].name,
                     n == 0 ? "unexpected end of file" : std::strerror(errno));
      done += std::uint64_t(n);
    }
  }
  flat.resize(units[u].numel);  // the padding goes
  return flat;
}

// ---- the output folder ----
// OUT_DIR empty, or --overwrite, and never the checkpoint being exported or a folder above it.
void check_output_folder(const Options& o, const strata::FoundCheckpoint& ck) {
  // Its longest name: .strata-tmp-model.safetensors.index.json, or a model folder's file copied.
  strata::require_room_for_names("OUT_DIR", o.out, 128);
  std::error_code ec;
  const fs::path out(o.out);
  // Held for the export's life (closed as the process ends), as strata-train holds its --out:
  // temporary files there are then a dead export's, never a running one's.
  const auto hold = [&] {
    const int held = ::open(o.out.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (held >= 0 && !strata::lock_unless_held(held))
      STRATA_THROW(kInvalidArgument,
                   "{} is being written by another running strata-export or strata-train: give "
                   "this export another OUT_DIR, or run it once that one has ended",
                   o.out);
  };
  if (!fs::exists(out, ec)) {
    fs::create_directories(out, ec);  // (as the writer would: made now to be held)
    hold();
  } else {
    STRATA_REQUIRE(fs::is_directory(out, ec), "{} exists and is not a directory", o.out);
    hold();
    // (the temporary files of an export that was killed count for nothing: the export removes
    // them)
    bool empty = true;
    for (const auto& e : fs::directory_iterator(out, ec))
      empty = empty && e.path().filename().string().starts_with(".strata-tmp-");
    STRATA_REQUIRE(empty || o.overwrite, "{} exists: pass --overwrite to replace it", o.out);
    // Never delete the checkpoint being exported (a run's --out holds its checkpoints/).
    const fs::path ck_abs = strata::canonical_path(ck.dir), out_abs = strata::canonical_path(o.out);
    for (const auto& e : fs::directory_iterator(out, ec)) {
      const fs::path ea = strata::canonical_path(e.path().string());
      const auto rel = ck_abs.lexically_relative(ea);
      STRATA_REQUIRE(!(ck_abs == ea || (!rel.empty() && *rel.begin() != "..")) ||
                         e.path().filename() == "checkpoints",
                     "{} holds the checkpoint being exported ({}): choose another OUT_DIR", o.out,
                     ck.dir);
    }
    STRATA_REQUIRE(out_abs != ck_abs, "OUT_DIR {} is the checkpoint itself: choose another folder",
                   o.out);
  }
}

// Unit u whole, unpadded: under tensor parallelism (tp > 1) each TP rank's slice read from its
// files (ranks k, k + tp, ...: its data-parallel shards) and the slices put together.
std::vector<float> read_whole_unit(const std::vector<RankFile>& ranks, std::size_t u, int tp,
                                   const std::vector<std::vector<strata::UnitSpec>>& layouts,
                                   const strata::ModelConfig& cfg) {
  if (tp == 1) return read_unit(ranks, u, layouts[0]);
  std::vector<std::vector<float>> slices;
  for (int k = 0; k < tp; ++k) {
    std::vector<RankFile> mine;
    for (std::size_t r = std::size_t(k); r < ranks.size(); r += std::size_t(tp))
      mine.push_back(ranks[r]);
    slices.push_back(read_unit(mine, u, layouts[std::size_t(k)]));
  }
  return strata::tp_unit_whole(cfg, u, slices);
}

// The tokenizer, chat template and generation_config.json of the Hugging Face folder the run
// started from (--model, else the manifest's trainer.model_dir), beside the weights.
// The Hugging Face folder whose tokenizer files go beside the weights ("" for none, said why).
std::string side_files_source(const Options& o, const nlohmann::json& trainer) {
  const std::string recorded = trainer.value("model_dir", "");
  const std::string from = !o.model_dir.empty() ? o.model_dir : recorded;
  std::error_code ec;
  if (from.empty()) {
    std::printf(
        "no tokenizer files copied: the run did not start from a Hugging Face folder "
        "(--model DIR copies them from one)\n");
    return "";
  }
  if (!fs::is_directory(from, ec)) {
    std::printf(
        "no tokenizer files copied: the run's model folder %s is gone (--model DIR "
        "copies them from another)\n",
        from.c_str());
    return "";
  }
  return from;
}

// The checkpoint `ck` exported as OUT_DIR says (run's part once the checkpoint is found).
int export_checkpoint(const Options& o, const strata::FoundCheckpoint& ck, DType dtype,
                      std::size_t max_shard_bytes);

int run(const Options& o) {
  STRATA_REQUIRE(o.dtype == "fp32" || o.dtype == "bf16", "--dtype '{}': use fp32 or bf16", o.dtype);
  const DType dtype = o.dtype == "bf16" ? DType::kBF16 : DType::kF32;
  STRATA_REQUIRE(o.max_shard_mb > 0, "--max-shard-mb must be > 0");
  if (!o.model_dir.empty())
    strata::require_input_folder("--model", o.model_dir, "the model's Hugging Face folder");
  const std::size_t max_shard_bytes = strata::tools::mib_as_bytes(o.max_shard_mb);

  const strata::FoundCheckpoint ck = find_export_checkpoint(o);
  try {
    return export_checkpoint(o, ck, dtype, max_shard_bytes);
  } catch (const nlohmann::json::exception& e) {  // a field of another type: value() throws
    STRATA_THROW(kInvalidArgument,
                 "{}: a field of its manifest.json or rank<R>.json has the wrong type ({}): the "
                 "checkpoint is damaged; export another step",
                 ck.dir, e.what());
  }
}

int export_checkpoint(const Options& o, const strata::FoundCheckpoint& ck, DType dtype,
                      std::size_t max_shard_bytes) {
  const int world = ck.manifest.value("world_size", 0);
  STRATA_REQUIRE(world >= 1, "{}: the manifest has no world_size", ck.dir);
  // Its files list each rank's (a damaged world_size of 2e9 sized the ranks' table).
  if (const auto files = ck.manifest.find("files");
      files != ck.manifest.end() && files->is_array()) {
    std::size_t bins = 0;
    for (const auto& f : *files)
      if (f.is_object() && f.value("name", "").ends_with(".bin")) ++bins;
    STRATA_REQUIRE(std::size_t(world) <= bins,
                   "{}: the manifest says {} ranks and lists the engine state of {} (damaged): "
                   "export another step",
                   ck.dir, world, bins);
  }
  const nlohmann::json trainer = ck.manifest.value("trainer", nlohmann::json::object());
  const strata::ModelConfig cfg = export_model(o, ck, trainer);
  const std::vector<strata::UnitSpec> units = strata::model_units(cfg);
  // Tensor parallelism: the TP ranks' slices of every split layer, put together unit by unit.
  const int tp = trainer.value("tensor_parallel", 1);
  STRATA_REQUIRE(tp >= 1 && world % tp == 0,
                 "{}: the manifest's tensor parallelism {} does not divide its {} ranks", ck.dir,
                 tp, world);
  std::vector<std::vector<strata::UnitSpec>> layouts;
  for (int k = 0; k < tp; ++k) layouts.push_back(strata::model_units(cfg, {tp, k}));

  std::vector<RankFile> ranks(static_cast<std::size_t>(world));
  struct Closer {
    std::vector<RankFile>& r;
    ~Closer() {
      for (auto& f : r)
        if (f.fd >= 0) ::close(f.fd);
    }
  } closer{ranks};
  for (int r = 0; r < world; ++r) {
    const std::string missing = strata::checkpoint_rank_missing(ck.dir, ck.manifest, r);
    STRATA_REQUIRE(missing.empty(),
                   "{}: {}; exporting reads every rank's files: copy the step's folder from every "
                   "node into one (its files side by side) and export that",
                   ck.dir, missing);
  }
  for (int r = 0; r < world; ++r)
    open_rank(ranks, r, ck.dir, world, tp, layouts[std::size_t(r % tp)]);
  const auto read = [&](std::size_t u) { return read_whole_unit(ranks, u, tp, layouts, cfg); };

  check_output_folder(o, ck);
  // The writer strata-train --out uses: the same shards, header and order; its files go to
  // temporary names, renamed into place once every one is complete (removed on an error).
  // --overwrite replaces the weights and config.json; other files (tokenizer, README,
  // checkpoints/) stay.
  strata::HfWeightsWriter writer(o.out, cfg, dtype, max_shard_bytes);
  for (std::size_t u = 0; u < units.size(); ++u) writer.write_unit(u, read(u).data());
  const std::string from = side_files_source(o, trainer);
  strata::set_interrupt_note(fmt::format(
      "\nstrata-export: interrupted while moving its files into place in {}: run it again "
      "(with --overwrite where it says the folder exists)\n",
      o.out));
  const std::vector<std::string> copied = writer.finish(from);  // (the tokenizer's with them)
  strata::set_interrupt_note("");
  const std::size_t n = writer.files();
  std::printf("exported %s (step %lld, %d rank%s) to %s: %zu tensor file%s, %s\n", ck.dir.c_str(),
              (long long)ck.step, world, world == 1 ? "" : "s", o.out.c_str(), n, n == 1 ? "" : "s",
              o.dtype.c_str());
  if (!from.empty() && copied.empty())
    std::printf("no tokenizer files copied: %s has none\n", from.c_str());
  else if (!copied.empty())
    std::printf("copied from %s: %s\n", from.c_str(),
                fmt::format("{}", fmt::join(copied, ", ")).c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app{
      "strata-export: a strata-train checkpoint (any number of ranks) -> Hugging Face safetensors "
      "+ "
      "config.json, one unit at a time."};
  app.add_option("CKPT_DIR", o.ckpt,
                 "a checkpoint (step-<N>), a folder of checkpoints or a run's --out")
      ->required();
  app.add_option("OUT_DIR", o.out, "the Hugging Face folder to write")->required();
  app.add_option("--dtype", o.dtype, "dtype of the written tensors (default fp32)")
      ->check(CLI::IsMember({"fp32", "bf16"}));
  app.add_flag("--overwrite", o.overwrite, "replace an existing, non-empty OUT_DIR");
  app.add_flag(
      "--accept-older", o.accept_older,
      "when the newest checkpoint under CKPT_DIR does not verify, export the newest that does");
  app.add_option("--model-config", o.model_config,
                 "the model's config.json (default: the checkpoint manifest's)");
  app.add_option("--model", o.model_dir,
                 "the Hugging Face folder whose tokenizer files, chat template and "
                 "generation_config.json go beside the weights (default: the folder the run "
                 "started from, as its checkpoint records)");
  app.add_option("--max-shard-mb", o.max_shard_mb, "largest safetensors file in MiB (default 5120)")
      ->check(strata::tools::kPositive);
  // Ctrl-C (a scheduler's SIGTERM, a closed terminal) removes the temporary files, as large as
  // the model, and says so: the folder is as it was until every file is complete.
  strata::remove_swap_files_on_interrupt();
  return strata::tools::run_tool(
      "strata-export", app, argc, argv, strata::tools::ToolRuns::files, [&] {
        strata::set_interrupt_note(fmt::format(
            "\nstrata-export: interrupted; nothing was written to {} (its temporary files are "
            "removed): run it again\n",
            o.out));
        return run(o);
      });
}
