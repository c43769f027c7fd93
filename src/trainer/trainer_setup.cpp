// The job's set-up: everything train() checks, reads and builds before its first step. Every
// error here is thrown before the first collective (agree_on_resume, then require_same_settings,
// in open_device, are the first), or is one every rank throws alike, so no rank is left waiting
// for another.
#include <fcntl.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <sstream>

#include "core/json_config.h"
#include "core/utf8.h"
#include "strata/corpus.h"
#include "strata/error.h"
#include "strata/generate.h"
#include "strata/log.h"
#include "strata/model_io.h"
#include "strata/paths.h"
#include "strata/perf_model.h"
#include "strata/run_plot.h"
#include "strata/tokenizer.h"
#include "trainer/train_job.h"

namespace strata::train_job {

namespace fs = std::filesystem;

namespace {

std::string read_text(const std::string& path, const char* what) {
  std::ifstream f(path, std::ios::binary);
  if (!f) STRATA_THROW(kIo, "{} '{}' cannot be read: {}", what, path, std::strerror(errno));
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// Whether `path` holds what a run writes under `flag`, which a resumed run may take over: a log
// whose first line is a step's (or nothing yet), a trace's JSON, an SVG picture.
bool a_runs_file(const std::string& flag, const std::string& path) {
  // (a stream is never read: a FIFO would wait for its writer, a terminal for its keyboard)
  if (written_in_place(path)) return false;
  std::ifstream f(path, std::ios::binary);
  std::string first;
  std::getline(f, first);
  if (flag == "--log-json") {
    if (first.empty()) return true;
    try {
      (void)run_record_from_json(config::parse(first, path, true));  // as strata-plot reads it
      return true;
    } catch (const std::exception&) {
      return false;
    }
  }
  if (flag == "--plot") return first.starts_with("<svg") || first.starts_with("<?xml");
  return first.starts_with("{") || first.starts_with("[");  // --trace: Chrome's JSON
}

// The nearest folder of `path` (itself or an ancestor) that exists: where a folder for it would
// be created.
fs::path nearest_existing(const std::string& path) {
  std::error_code ec;
  fs::path up = fs::absolute(path, ec).lexically_normal();
  // (a relative path in a working directory removed under the shell: said, not an empty name)
  STRATA_REQUIRE(!ec, "{}: {} ({}): cd to a folder that exists, or give an absolute path", path,
                 fs::path(path).is_relative() ? "the working directory no longer exists"
                                              : "cannot be resolved",
                 ec.message());
  while (!up.empty() && !fs::exists(up, ec) && up != up.root_path()) up = up.parent_path();
  return up;
}

}  // namespace

// A folder the run will make (--out, the checkpoints') can be made: some file systems pass the
// write check on an existing ancestor and still refuse the mkdir (/proc, /sys; NFS with root
// squashed), which was found when the model was written, after the whole training. A folder of a
// name no one else uses is made in the nearest existing folder of `path` and removed again: the
// ranks check the same paths at once, and making the real folders (each rank removing what it
// made) let one rank's mkdir meet a folder another had made and removed before it looked. Nothing
// of the user's is made or touched ("link/../X" is not the lexical X).
void require_creatable_folder(const std::string& flag, const std::string& path) {
  // The longest name a run writes under a folder: a checkpoint's
  // step-<N>.pruned-<pid>/rank<R>.json (under --out, in checkpoints/), a model file's
  // .strata-tmp-model.safetensors.index.json.
  constexpr std::size_t kLongestNameBelow = 128;
  require_room_for_names(flag, path, kLongestNameBelow);
  std::error_code ec;
  if (fs::is_directory(path, ec)) return;
  const fs::path base = nearest_existing(path);
  // Unique across ranks, threads and hosts sharing the drive.
  static std::atomic<std::uint64_t> counter{0};
  const fs::path probe = base / fmt::format(".strata-mkdir-check-{:x}-{:x}-{:x}", ::getpid(),
                                            std::random_device{}(), counter.fetch_add(1));
  if (::mkdir(probe.c_str(), 0700) != 0) {
    const int err = errno;
    STRATA_THROW(kInvalidArgument,
                 "{} {}: the folder cannot be made there: {}; give a folder on a writable drive",
                 flag, path, std::strerror(err));
  }
  ::rmdir(probe.c_str());
}

namespace {

// Whether `folder` is a folder this process can write in (write_errno 0), found once.
struct FolderCheck {
  fs::path folder;
  bool is_folder = false;
  int write_errno = ENOTDIR;
  bool ok() const { return is_folder && write_errno == 0; }
};
FolderCheck check_folder(const fs::path& folder) {
  std::error_code ec;
  FolderCheck c{folder, fs::is_directory(folder, ec)};
  if (c.is_folder) c.write_errno = ::access(folder.c_str(), W_OK) == 0 ? 0 : errno;
  return c;
}

// The same of the nearest existing folder of `path`.
FolderCheck check_nearest_existing(const std::string& path) {
  return check_folder(nearest_existing(path));
}

// Checked before the first step, not when the file is written: the checked folder (the file's,
// or the nearest existing ancestor of a folder the run will create) is one this process can
// write in.
void require_writable_folder(const std::string& flag, const std::string& path,
                             const FolderCheck& c) {
  std::error_code ec;
  if (!c.is_folder && !fs::exists(c.folder, ec))
    throw_folder_missing(flag, path, c.folder.string());
  STRATA_REQUIRE(c.is_folder, "{} {}: {} is not a folder", flag, path, c.folder.string());
  STRATA_REQUIRE(c.write_errno == 0, "{} {}: {} cannot be written in: {}", flag, path,
                 c.folder.string(), std::strerror(c.write_errno));
}

// A setting every rank must share: a rank started with other flags or another config trains
// something else, and its gradients average into the others' without any error.
struct SharedSetting {
  const char* name;
  double value;
  bool hashed = false;  // a hash of the setting (paths): said to differ, without the numbers
};

// Every rank calls it: refuses the job, on every rank alike, when the ranks' settings differ,
// naming the first that does and its value on rank 0 and on the first rank that differs.
void require_same_settings(const std::vector<SharedSetting>& mine, Communicator& comm,
                           Device& dev) {
  if (comm.world_size() == 1) return;
  const std::size_t k = mine.size(), world = std::size_t(comm.world_size());
  std::vector<double> v, all(k * world);
  for (const auto& m : mine) v.push_back(m.value);
  auto s = dev.create_stream("settings");
  Buffer in = dev.alloc(8 * k, s.get()), out = dev.alloc(8 * k * world, s.get());
  s->copy(in.ref(), host_ref(v.data(), 8 * k));
  comm.all_gather(TensorRef{in.ref(), DType::kF64, k}, TensorRef{out.ref(), DType::kF64, k * world},
                  *s);
  s->copy(host_ref(all.data(), 8 * k * world), out.ref());
  s->synchronize();
  for (std::size_t i = 0; i < k; ++i)
    for (std::size_t r = 1; r < world; ++r)
      STRATA_REQUIRE(all[r * k + i] == all[i],
                     "the ranks were started with different settings: {}; start every rank with "
                     "the same flags and --config",
                     mine[i].hashed
                         ? fmt::format("{} differ between rank 0 and rank {}", mine[i].name, r)
                         : fmt::format("{} is {:g} on rank 0 and {:g} on rank {}", mine[i].name,
                                       all[i], all[r * k + i], r));
}

// --out may already exist when all it holds is the run's checkpoints/ folder; with
// `model_files`, also the files a model save writes there (a resumed run's whose run stopped as
// or after it wrote the model: its own, as its log and picture are).
bool out_dir_free(const std::string& out, bool model_files) {
  const auto saved = [](const std::string& n) {
    return n == "config.json" || n == "model.safetensors" || n == "model.safetensors.index.json" ||
           (n.starts_with("model-") && n.ends_with(".safetensors") &&
            n.find("-of-") != std::string::npos) ||
           std::find(hf_side_files().begin(), hf_side_files().end(), n) != hf_side_files().end();
  };
  std::error_code ec;
  // One look: another rank's check may make and remove the (empty) folder meanwhile.
  const fs::file_status st = fs::status(out, ec);
  if (!fs::exists(st)) return true;
  if (!fs::is_directory(st)) return false;
  for (const auto& e : fs::directory_iterator(out, ec)) {
    const std::string n = e.path().filename().string();
    // checkpoints/, and the temporary files of a save that was killed (commit_hf_files removes
    // them)
    if (n != "checkpoints" && !n.starts_with(".strata-tmp-") && !(model_files && saved(n)))
      return false;
  }
  return true;
}

// The settings every rank must share (require_same_settings), with their names.
// `data`: the identity of the training files (data_identity; unread for the demo's text).
std::vector<SharedSetting> shared_settings(const Settings& s, const DataIdentity& data) {
  // The model's shape whole (heads, rope, vocabulary...): the first 52 bits of its config hash, a
  // double exactly.
  const double model_hash =
      double(std::stoull(model_config_hash(s.mcfg).substr(0, 13), nullptr, 16));
  // Paths as one number each: 52 bits of a hash of their absolute forms, links not followed
  // (node-local folders and files have the same path on every node, maybe a link to its drive).
  const auto paths_hash = [](const std::vector<std::string>& paths) {
    std::string all;
    for (const auto& p : paths) {
      std::error_code ec;
      const fs::path abs = p.empty() ? fs::path() : fs::absolute(p, ec);
      all += (ec ? p : abs.lexically_normal().string()) + '\n';
    }
    return double(XXH3_64bits(all.data(), all.size()) >> 12);
  };
  const auto bytes_hash = [](const DataIdentity& id) {
    std::string all;
    for (std::size_t i = 0; i < id.bytes.size(); ++i)
      all += fmt::format("{} {}\n", id.bytes[i], id.samples[i]);
    return double(XXH3_64bits(all.data(), all.size()) >> 12);
  };
  return {{"the model's parameter count", double(s.total_numel)},
          {"the model's layers", double(s.mcfg.num_layers)},
          {"the model's hidden size", double(s.mcfg.hidden_size)},
          {"the model's shape (its config hash: heads, positions, rope, norm, tying)", model_hash},
          {"--seq-len", double(s.seq_len)},
          {"the micro-batch (--micro-batch, train_micro_batch_size_per_gpu)", double(s.B)},
          {"the accumulation (--grad-accum, gradient_accumulation_steps)", double(s.accum)},
          {"the steps (--steps, or --epochs over the data)", double(s.steps)},
          {"the learning rate (--lr, optimizer.params.lr)", double(s.ecfg.adamw.lr)},
          {"the weight decay (--weight-decay, optimizer.params.weight_decay)",
           double(s.ecfg.adamw.weight_decay)},
          {"what weight decay skips (strata.weight_decay_exempt; 1: norms and biases)",
           s.ecfg.decay_exempt_norms_and_biases ? 1.0 : 0.0},
          // Each rank steps its own shard: mixed betas train a mixed optimizer without a word.
          {"optimizer.params.betas[0]", double(s.ecfg.adamw.beta1)},
          {"optimizer.params.betas[1]", double(s.ecfg.adamw.beta2)},
          {"optimizer.params.eps", double(s.ecfg.adamw.eps)},
          {"the optimizer's bias correction (1: on)", s.ecfg.adamw.bias_correction ? 1.0 : 0.0},

          {"--warmup", double(s.warmup)},
          {"the schedule (0 const, 1 cosine, 2 the --config's, 3 linear)",
           s.ds_schedule            ? 2.0
           : s.schedule == "cosine" ? 1.0
           : s.schedule == "linear" ? 3.0
                                    : 0.0},
          {"--min-lr", std::max(0.0, s.o.min_lr)},
          {"the compute dtype (0 fp32, 1 bf16)", s.ecfg.compute_dtype == DType::kBF16 ? 1.0 : 0.0},
          {"zero_optimization.stage", double(s.ecfg.stage)},
          {"gradient_clipping", double(s.ecfg.gradient_clipping)},
          {"--seed", double(s.o.seed)},
          {"shuffling (--no-shuffle: 0)", s.o.shuffle ? 1.0 : 0.0},
          {"--checkpoint-activations", s.o.checkpoint_activations ? 1.0 : 0.0},
          {"the tensor parallelism (--tensor-parallel, tensor_parallel.autotp_size)", double(s.tp)},
          {"--sequence-parallel", s.o.sequence_parallel ? 1.0 : 0.0},
          {"--save-every", double(s.o.save_every)},
          // Every rank takes part in writing --out and in each sample's forwards.
          {"--out (1: given)", s.o.out_dir.empty() ? 0.0 : 1.0},
          {"--sample-every", double(s.o.sample_every)},
          {"--sample-tokens", s.o.sample_every > 0 ? double(s.o.sample_tokens) : 0.0},
          {"--eval-every", double(s.o.eval_every)},
          {"--eval-batches", double(s.o.eval_batches)},
          {"--eval-data files", double(s.o.eval_files.size())},
          // Each rank found its checkpoint on its own (node-local folders, a file one rank could
          // not verify): different steps would mix states and desynchronise the step loop.
          {"the step of the checkpoint --resume found (0: none; give every rank the same --resume "
           "DIR/step-<N>)",
           double(s.resume.step)},
          // The ranks take turns over one stream of micro-batches, and save into one folder (one
          // a node for node-local drives, at the same path).
          // By their bytes (data_identity), not paths: strata-prof's validation ranks read copies.
          // (The demo's text is rank 0's to write, the same on every rank, and not yet there.)
          {"the data files (--data / --text: the same bytes, in the same order)",
           s.demo_data ? 0.0 : bytes_hash(data), true},
          {"the --eval-data files", bytes_hash(data_identity(s.eval_files)), true},
          {"the checkpoint folders (--checkpoint-dir, else --out's checkpoints/)",
           paths_hash({s.o.save_every > 0 ? s.ckpt_root : std::string()}), true},
          {"the --out folders", paths_hash({s.o.out_dir}), true}};
}

}  // namespace

// The flags alone: what they may not combine to, and the values they may take.
void check_flags(Settings& s) {
  const TrainOptions& o = s.o;
  s.demo_model = o.model_dir.empty() && o.model_config.empty();
  s.demo_data = o.data_files.empty() && o.text_file.empty();
  STRATA_REQUIRE(o.model_dir.empty() || o.model_config.empty(),
                 "give --model or --model-config, not both");
  STRATA_REQUIRE(o.data_files.empty() || o.text_file.empty(), "give --data or --text, not both");
  STRATA_REQUIRE(s.demo_model == s.demo_data || !s.demo_model,
                 "--data/--text without a model: give --model DIR or --model-config FILE too");
  STRATA_REQUIRE(o.dtype.empty() || o.dtype == "fp32" || o.dtype == "bf16",
                 "--dtype '{}': use fp32 or bf16", o.dtype);
  STRATA_REQUIRE(o.lr_schedule.empty() || o.lr_schedule == "const" || o.lr_schedule == "cosine" ||
                     o.lr_schedule == "linear",
                 "--lr-schedule '{}': use const, cosine or linear", o.lr_schedule);
  STRATA_REQUIRE(
      o.min_lr <= 0 || o.lr_schedule == "cosine" || o.lr_schedule == "linear",
      "--min-lr is the floor of a decaying schedule: add --lr-schedule cosine or linear");
  STRATA_REQUIRE(o.sample_every >= 0 && o.sample_tokens > 0,
                 "--sample-every must be >= 0 and --sample-tokens > 0");
  const bool prompt = !o.sample_prompt.empty() || !o.sample_prompt_ids.empty();
  STRATA_REQUIRE(o.sample_every > 0 || !prompt,
                 "{} is the prompt of --sample-every's samples: add --sample-every N",
                 o.sample_prompt.empty() ? "--sample-prompt-ids" : "--sample-prompt");
  STRATA_REQUIRE(o.sample_every == 0 || o.sample_prompt.empty() != o.sample_prompt_ids.empty(),
                 "--sample-every N needs its prompt once: --sample-prompt TEXT (through the "
                 "--model folder's tokenizer, or a byte-level model's bytes) or "
                 "--sample-prompt-ids \"ID ID ...\"");
  STRATA_REQUIRE(o.epochs == 0 || o.steps <= 0,
                 "give --epochs or --steps, not both: --epochs {:g} derives the steps from the "
                 "data, --steps {} sets them",
                 o.epochs, o.steps);
  STRATA_REQUIRE(o.epochs >= 0 && std::isfinite(o.epochs),
                 "--epochs {:g}: give a number of passes over the data above 0 (2, or 0.5 for "
                 "half of it)",
                 o.epochs);
  STRATA_REQUIRE(o.epochs == 0 || !s.demo_data,
                 "--epochs counts passes over your data: give --data FILE or --text FILE, or "
                 "--steps N for the demo's generated text");
}

// ---- model ----
// The model: a Hugging Face folder's config.json, a config.json of its own, or the demo's.
void read_model_config(Settings& s) {
  const TrainOptions& o = s.o;
  ModelConfig& mcfg = s.mcfg;
  if (!o.model_dir.empty()) {
    std::error_code ec;
    STRATA_REQUIRE(
        fs::is_directory(o.model_dir, ec), "--model {}: {}", o.model_dir,
        fs::exists(o.model_dir, ec)
            ? fmt::format("a file, not a folder: give the folder that holds config.json and the "
                          "*.safetensors ({})",
                          fs::path(o.model_dir).has_parent_path()
                              ? fs::path(o.model_dir).parent_path().string()
                              : std::string("."))
            : std::string("no such directory"));
    if (const std::string why = checkpoint_not_model(o.model_dir); !why.empty())
      STRATA_THROW(kInvalidArgument, "--model {}; to continue its training, give it to --resume",
                   why);
    require_input_file("--model (config.json)", o.model_dir + "/config.json");
    mcfg = load_model_config(o.model_dir + "/config.json");
  } else if (!o.model_config.empty()) {
    require_input_file("--model-config", o.model_config);
    mcfg = load_model_config(o.model_config);
  } else {
    mcfg = demo_model_config();
  }
}

// The files the run reads exist, and the folders it writes to can be made, before anything is
// built.
void check_files(Settings& s) {
  const TrainOptions& o = s.o;
  // The paths a run records are JSON text, UTF-8: a corpus's in the prepared data's cache key,
  // the model folder's and the data's in every checkpoint's manifest. One that is not UTF-8 ended
  // the run at its first checkpoint (or before its first step).
  NamedPaths recorded;
  const bool saves = o.save_every > 0;
  if (saves && !o.model_dir.empty())
    recorded.push_back({"--model", fs::absolute(o.model_dir).string()});
  if (!o.text_file.empty()) recorded.push_back({"--text", o.text_file});
  for (const std::string& f : o.data_files)
    if (saves || is_corpus_file(f)) recorded.push_back({"--data", f});
  for (const std::string& f : o.eval_files)
    if (is_corpus_file(f)) recorded.push_back({"--eval-data", f});
  for (const auto& [flag, path] : recorded) {
    const std::size_t bad = utf8::first_invalid(path);
    STRATA_REQUIRE(bad == std::string_view::npos,
                   "{} {}: the path is not UTF-8 (byte {} of it), and the run records it as text "
                   "(in the prepared data's cache key, or its checkpoints): rename it, or link "
                   "to it from a UTF-8 name",
                   flag, path, bad);
  }
  for (const auto& f : o.data_files) require_input_file("--data", f);
  for (const auto& f : o.eval_files) require_input_file("--eval-data", f);
  if (!o.text_file.empty()) require_input_file("--text", o.text_file);
  if (!o.ds_config.empty()) require_input_file("--config", o.ds_config);
  // What the run writes is none of the files it reads, nor one file twice; a file of the user's
  // there is replaced only with --overwrite, or by the run --resume continues (a log, a picture
  // or a trace such as a run writes); --plan writes none.
  NamedPaths ins = model_files_in_folder("--model", o.model_dir);
  for (const std::string& f : o.data_files) ins.push_back({"--data", f});
  for (const std::string& f : o.eval_files) ins.push_back({"--eval-data", f});
  ins.push_back({"--text", o.text_file});
  ins.push_back({"--model-config", o.model_config});
  ins.push_back({"--config", o.ds_config});
  const NamedPaths outs = {
      {"--log-json", o.log_json}, {"--plot", o.plot_file}, {"--trace", o.trace_file}};
  require_outputs_apart("the run", outs, ins);
  for (const auto& [flag, path] : outs)
    require_overwrite_to_replace(
        flag, path, o.overwrite || o.plan_only || (!o.resume.empty() && a_runs_file(flag, path)));
  if (!o.out_dir.empty()) {
    // Checked now, not after the training: a folder (never a file of the user's, even with
    // --overwrite) under a writable folder.
    // One look at it.
    std::error_code ec;
    const fs::file_status st = fs::status(o.out_dir, ec);
    STRATA_REQUIRE(!fs::exists(st) || fs::is_directory(st),
                   "--out {} is a file, not a folder: give a folder for the model", o.out_dir);
    const FolderCheck up = check_nearest_existing(o.out_dir);
    STRATA_REQUIRE(up.ok(),
                   "--out {}: {} is not a writable folder, so the model could not be written there",
                   o.out_dir, up.folder.string());
    if (!o.overwrite && !out_dir_free(o.out_dir, false)) {
      STRATA_REQUIRE(!o.resume.empty() && out_dir_free(o.out_dir, true),
                     "--out {} exists: pass --overwrite to replace it{}", o.out_dir,
                     same_file(o.out_dir, o.model_dir)
                         ? " (it is the --model folder: --overwrite replaces the model this run "
                           "starts from with the trained one; another --out keeps both)"
                         : "");
      s.out_holds_a_model = true;
    }
    require_creatable_folder("--out", o.out_dir);
  }
  STRATA_REQUIRE(o.save_every >= 0 && o.keep_checkpoints >= 0,
                 "--save-every and --keep-checkpoints must be >= 0");
  STRATA_REQUIRE(
      o.save_every == 0 || !o.checkpoint_dir.empty() || !o.out_dir.empty() || !o.resume.empty(),
      "--save-every needs a folder for the checkpoints: give --checkpoint-dir DIR or --out DIR");
}

// `folder` (given as `flag`), made if missing and held by an exclusive lock on it for the run's
// life, by rank 0 (its job's other ranks write into the same folders): another run writing into
// it (the same --out, the same checkpoint folder: each replaced the other's model and checkpoints
// without a word, and their saves could interleave) is refused while this one lives. No lock
// where the file system has none.
void hold_folder(Settings& s, const std::string& flag, const std::string& folder) {
  if (s.launch.rank != 0 || folder.empty() || s.o.plan_only) return;
  std::error_code ec;
  // The folders missing on the way to it, as the path names them (create_directories walks it
  // the same way: "a/../b" makes a and b, "link/../x" x beside the link's target), deepest first.
  std::vector<std::string> made;
  fs::path prefix;
  for (const fs::path& part : fs::path(folder)) {
    prefix /= part;
    if (part.empty() || part == "." || part == ".." || part == prefix.root_path() ||
        fs::exists(prefix, ec))
      continue;
    made.insert(made.begin(), prefix.string());
  }
  fs::create_directories(folder, ec);
  const int fd = ::open(folder.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  // Unlocked (the run's own checks and writes name what is wrong with the folder; a file system
  // without locks), the folders it made still go when it fails.
  if (fd < 0) {
    s.held_folders.push_back(std::make_unique<HeldFolder>(-1, std::move(made)));
    return;
  }
  if (lock_unless_held(fd)) {
    s.held_folders.push_back(std::make_unique<HeldFolder>(fd, std::move(made)));
    return;
  }
  ::close(fd);
  STRATA_THROW(kInvalidArgument,
               "{} {} is in use by another running strata-train, which writes into it: give "
               "this run its own {}, or start it once that one has ended",
               flag, folder, flag);
}

// --log-json's file (not a stream), opened without emptying it (a resumed run reads its lines
// first) and locked for the run's life by rank 0: another run writing the same log is refused.
// Unopened here (a folder that is not there), JsonLog says why later; no lock where the file
// system has none.
void hold_log(Settings& s) {
  const std::string& path = s.o.log_json;
  if (s.launch.rank != 0 || path.empty() || s.o.plan_only || written_in_place(path)) return;
  std::error_code ec;
  const bool existed = fs::exists(path, ec);
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) return;
  if (lock_unless_held(fd)) {
    s.held_log = std::make_unique<HeldFile>(fd, existed ? std::string() : path);
    return;
  }
  ::close(fd);
  STRATA_THROW(kInvalidArgument,
               "--log-json {} is being written by another running strata-train: give this run "
               "its own --log-json, or start it once that one has ended",
               path);
}

void hold_folders(Settings& s) {
  const TrainOptions& o = s.o;
  hold_folder(s, "--out", o.out_dir);
  if (o.save_every > 0)
    hold_folder(s, o.checkpoint_dir.empty() ? "the checkpoint folder" : "--checkpoint-dir",
                s.ckpt_root);
  hold_log(s);
}

// Resume: the newest complete checkpoint, found (and verified) before anything is built; the
// folder this run's checkpoints go to, and which of those there it continues.
void find_checkpoints(Settings& s) {
  const TrainOptions& o = s.o;
  FoundCheckpoint& resume = s.resume;
  std::string& ckpt_root = s.ckpt_root;
  std::vector<std::int64_t>& inherited_checkpoints = s.inherited_checkpoints;
  if (!o.resume.empty()) resume = find_checkpoint(o.resume);
  if (s.out_holds_a_model) {
    const nlohmann::json t = resume.manifest.value("trainer", nlohmann::json::object());
    const std::string recorded = t.value("out_dir", "");
    STRATA_REQUIRE(!recorded.empty() && recorded == canonical_path(o.out_dir),
                   "--out {} exists: pass --overwrite to replace it (it holds a model, and {})",
                   o.out_dir,
                   t.contains("out_dir")
                       ? fmt::format("the run of {} did not write its model there", resume.dir)
                       : fmt::format("{} is of an older strata, which does not record its run's "
                                     "--out: whether that run wrote the model is not known",
                                     resume.dir));
  }
  ckpt_root = o.checkpoint_dir;
  if (ckpt_root.empty() && !o.out_dir.empty())
    ckpt_root = (fs::path(o.out_dir) / "checkpoints").string();
  if (ckpt_root.empty() && !resume.root.empty()) {
    // --resume named a folder of checkpoints (or a run's): the next resume of it looks there,
    // whatever its step-<N> entries link to.
    ckpt_root = resume.root;
  } else if (ckpt_root.empty() && !resume.dir.empty()) {
    // Beside the resumed one, where it really is: "--resume latest" with latest -> ck/step-2
    // continues in ck/, not beside the link ("P/step-4/" and "step-4" too).
    std::error_code ec;
    fs::path dir = fs::canonical(resume.dir, ec);
    if (ec) dir = fs::absolute(resume.dir).lexically_normal();
    if (dir.filename().empty()) dir = dir.parent_path();
    ckpt_root = dir.parent_path().string();
  }
  // Files written during the run: their folders are checked now, not at the step that writes
  // them (a run that cannot save its checkpoint was lost at that step).
  if (o.save_every > 0) {
    require_writable_folder(o.checkpoint_dir.empty() ? "checkpoints in" : "--checkpoint-dir",
                            ckpt_root, check_nearest_existing(ckpt_root));
    require_creatable_folder(o.checkpoint_dir.empty() ? "checkpoints in" : "--checkpoint-dir",
                             ckpt_root);
    // This run's step-<N> would replace another run's in that folder (even another model's), and
    // a later --resume of it would take whichever is newest. Only the run the folder's checkpoints
    // come from continues there: one resumed from a checkpoint in it.
    const std::vector<std::string> there = checkpoint_folders(ckpt_root);
    std::error_code ec;
    bool continues = false;
    if (!resume.dir.empty()) {
      const fs::path resumed = fs::canonical(resume.dir, ec);  // links, "P/step-4/", ".."
      continues = !ec && fs::equivalent(resumed.parent_path(), ckpt_root, ec);
      if (!continues && !resume.root.empty())
        continues = fs::equivalent(resume.root, ckpt_root, ec);
    }
    STRATA_REQUIRE(
        there.empty() || continues,
        "{} {} already holds checkpoints of another run (newest: {}), which this run's would "
        "replace: "
        "continue that run with --resume {}, give another --checkpoint-dir, or remove them",
        o.checkpoint_dir.empty() ? "the checkpoint folder" : "--checkpoint-dir", ckpt_root,
        fs::path(there.front()).filename().string(), ckpt_root);
    // A resumed run continues the run: its complete checkpoints up to the resumed step count
    // towards --keep-checkpoints with this run's own (oldest first).
    if (continues)
      for (auto it = there.rbegin(); it != there.rend(); ++it) {
        const std::string name = fs::path(*it).filename().string();
        if (name.find(".old-") != std::string::npos ||
            !fs::exists(fs::path(*it) / "manifest.json", ec))
          continue;
        const std::int64_t st = std::stoll(name.substr(5));  // checkpoint_folders: "step-<N>"
        // Newer ones: only where --resume named the older checkpoint itself (of a folder it
        // takes the newest that verifies; newer ones there are damaged).
        if (st <= resume.step)
          inherited_checkpoints.push_back(st);
        else if (resume.root.empty())
          s.newer_checkpoints.push_back(st);
      }
  }
}

// The --trace, --log-json and --plot files' folders, and a resumed run has steps left (or a model
// to write) and, with --epochs, the total its checkpoint's run had.
void check_resume_step(Settings& s) {
  const TrainOptions& o = s.o;
  const FoundCheckpoint& resume = s.resume;
  if (!o.trace_file.empty()) {
    const fs::path parent = fs::absolute(o.trace_file).parent_path();
    require_writable_folder("--trace", o.trace_file, check_folder(parent));
  }
  // (--log-json was opened only after the data and the device were ready: a folder missing was
  // said minutes in.) Its folder may be the --out or checkpoint folder the run makes.
  if (!o.log_json.empty() && !written_in_place(o.log_json) && !o.plan_only) {
    const fs::path parent = fs::absolute(o.log_json).parent_path().lexically_normal();
    const auto made_by_the_run = [&](const std::string& folder) {
      return !folder.empty() && fs::absolute(folder).lexically_normal() == parent;
    };
    require_writable_folder("--log-json", o.log_json,
                            made_by_the_run(o.out_dir) || made_by_the_run(s.ckpt_root)
                                ? check_nearest_existing(parent.string())
                                : check_folder(parent));
  }
  if (!o.plot_file.empty()) {
    std::error_code ec;
    STRATA_REQUIRE(!fs::is_directory(o.plot_file, ec),
                   "--plot {} is a folder: give a file name for the picture, such as {}/run.svg",
                   o.plot_file, o.plot_file);
    const fs::path parent = fs::absolute(o.plot_file).parent_path();
    require_writable_folder("--plot", o.plot_file, check_folder(parent));
  }
  if (resume.step > 0 && s.epochs > 0) {
    // --epochs derives the run's total from the data and the batch: the resumed run must derive
    // the one it started with, or its schedule and its end would be another run's.
    const nlohmann::json ls = resume.manifest.value("trainer", nlohmann::json::object())
                                  .value("lr_schedule", nlohmann::json::object());
    const std::int64_t was = ls.value("total_steps", std::int64_t(0));
    STRATA_REQUIRE(was == s.steps,
                   "--resume {}: the checkpoint's run was {} steps, and --epochs {:g} over this "
                   "run's data is {} ({} steps of {} sequences a pass of its {} sequences of {} "
                   "tokens): resume with the same data, --epochs, --seq-len, --micro-batch, "
                   "--grad-accum and ranks, or give --steps {} instead of --epochs to end where "
                   "that run would",
                   resume.dir, was, s.epochs, s.steps, s.steps_per_epoch,
                   s.B * s.accum * s.dp_world, s.epoch_rows, s.seq_len, was);
  }
  if (resume.step > 0) {
    const std::int64_t total = s.steps;
    // A run killed after its last checkpoint, while writing --out: the same command finishes it
    // (no step left to run, the model is written from the checkpoint).
    const bool only_out = total == resume.step && !o.out_dir.empty();
    STRATA_REQUIRE(total > resume.step || only_out,
                   "--resume {}: the checkpoint is at step {}, and --steps {}{} is not beyond it: "
                   "--steps counts from "
                   "the run's start, so give more than {} to train on{}",
                   resume.dir, resume.step, total,
                   s.epochs > 0  ? fmt::format(" (--epochs {:g})", s.epochs)
                   : o.steps > 0 ? ""
                                 : " (the default)",
                   resume.step,
                   total == resume.step
                       ? fmt::format(", or write its model with strata-export {} OUT_DIR (or --out "
                                     "DIR here)",
                                     resume.dir)
                       : std::string());
  }
}

// ---- launch, device, communicator ----
// The launch (rank, world), the device's options and the model's units.
void device_options(Settings& s) {
  const TrainOptions& o = s.o;
  HostDeviceOptions& hopt = s.hopt;
  CudaDeviceOptions& copt = s.copt;
  std::uint64_t &max_unit = s.max_unit, &total_numel = s.total_numel;
  s.launch = init_launch();
  // The flag, else the --config's tensor_parallel.autotp_size, else none.
  const int config_tp = o.ds_config.empty()
                            ? 0
                            : config_tensor_parallel(read_text(o.ds_config, "--config"),
                                                     fmt::format("--config {}", o.ds_config));
  s.tp = o.tensor_parallel > 0 ? o.tensor_parallel : config_tp > 0 ? config_tp : 1;
  if (o.tensor_parallel > 0 && config_tp > 0 && config_tp != o.tensor_parallel &&
      s.launch.rank == 0)
    log::warn("--tensor-parallel {} replaces tensor_parallel.autotp_size {} of --config {}",
              o.tensor_parallel, config_tp, o.ds_config);
  if (o.plan_only && s.launch.launcher == "none" && s.tp > 1) {
    // A plan without its launch: planned as rank 0 of the smallest job, one tensor-parallel
    // group on one node (report_plan says so).
    s.launch.world_size = s.tp;
    s.launch.local_size = std::max(s.launch.local_size, s.tp);
  }
  STRATA_REQUIRE(s.launch.world_size % s.tp == 0,
                 "{} {} does not divide the job's {} rank(s): each tensor-parallel group is {} "
                 "ranks of one node and the rest data-parallel; launch a multiple of {} ranks",
                 o.tensor_parallel > 0 ? "--tensor-parallel" : "tensor_parallel.autotp_size", s.tp,
                 s.launch.world_size, s.tp, s.tp);
  STRATA_REQUIRE(!o.sequence_parallel || s.tp > 1,
                 "--sequence-parallel shards the tokens over a tensor-parallel group: give "
                 "--tensor-parallel N (N > 1) too");
  s.tp_rank = s.launch.rank % s.tp;
  s.dp_rank = s.launch.rank / s.tp;
  s.dp_world = s.launch.world_size / s.tp;
  // (a cast past 2^64 is undefined: 1e30 came out as a cap of 0 bytes)
  if (const std::uint64_t bytes = gib_to_bytes("--device-mem-gb", o.device_mem_gb); bytes > 0) {
    hopt.capacity_bytes = bytes;
    copt.capacity_bytes = bytes;
  }
  STRATA_REQUIRE(
      o.emu_h2d_gbps >= 0 && o.emu_d2h_gbps >= 0 && o.emu_compute_gflops >= 0,
      "--emu-h2d-gbps, --emu-d2h-gbps and --emu-compute-gflops must be >= 0 (0: unthrottled)");
  hopt.h2d_gbps = o.emu_h2d_gbps;
  hopt.d2h_gbps = o.emu_d2h_gbps;
  hopt.compute_gflops = o.emu_compute_gflops;
  s.units = model_units(s.mcfg, {s.tp, s.tp_rank});  // this rank's slices under TP
  for (const auto& u : s.units) max_unit = std::max<std::uint64_t>(max_unit, u.numel);
  for (const auto& u : model_units(s.mcfg)) total_numel += u.numel;  // the whole model's
  if (s.demo_model && o.device_mem_gb <= 0) {
    // Below the model's fp32 weights (5.94M parameters, 22.7 MiB): one layer gathered at a
    // time plus one in flight, one layer's gradient, the checkpoints and one layer's
    // activations at micro-batch 2 (~17 MB at the peak) fit in 20 MiB.
    hopt.capacity_bytes = std::size_t(20) << 20;
  }
}

// ---- engine config: the file (or defaults), then the flags ----
void build_engine_config(Settings& s) {
  const TrainOptions& o = s.o;
  const LaunchInfo& launch = s.launch;
  EngineConfig& ecfg = s.ecfg;
  std::string& demo_dir = s.demo_dir;
  if (!o.ds_config.empty()) {
    const std::string text = read_text(o.ds_config, "--config");
    // Parsed here first: a syntax error names the file.
    config::parse(text, fmt::format("--config {}", o.ds_config));
    // Every rank reads the same file: what it warns of (keys strata does not use, settings it
    // ignores) is said once, by rank 0, not once a rank.
    const log::Quiet quiet(log::Level::kError, launch.rank > 0);
    ecfg = parse_engine_config(text, s.dp_world);
  } else if (s.demo_model) {
    demo_dir = o.demo_nvme_dir.empty() ? default_scratch_dir("demo-nvme") : o.demo_nvme_dir;
    std::error_code ec;
    fs::create_directories(demo_dir, ec);
    STRATA_REQUIRE(!ec, "{}{}: the demo's NVMe folder cannot be created: {}{}",
                   o.demo_nvme_dir.empty() ? "" : "--demo-nvme ", demo_dir, ec.message(),
                   o.demo_nvme_dir.empty() ? "; give another with --demo-nvme DIR" : "");
    std::uint64_t layer = s.units.size() > 2 ? s.units[1].numel : s.max_unit;
    ecfg = demo_engine_config(demo_dir, layer, s.dp_world);
  } else {
    ecfg = default_engine_config();
  }
  resolve_config_for_model(ecfg, s.mcfg, s.dp_world, o.ds_config, !o.dtype.empty(),
                           launch.rank == 0);
  // The --config's global batch and clipping, when it gives them.
  const bool config_batch = ecfg.train_batch_size_given;
  const bool config_clip = ecfg.gradient_clipping_given;
  const std::int64_t config_train_batch = ecfg.train_batch_size;
  if (o.micro_batch > 0)
    ecfg.micro_batch_per_gpu = o.micro_batch;
  else if (s.demo_model && o.ds_config.empty())
    ecfg.micro_batch_per_gpu = 2;
  if (o.grad_accum > 0) ecfg.gradient_accumulation_steps = o.grad_accum;
  if (config_batch && (o.micro_batch > 0) != (o.grad_accum > 0)) {
    // One of the two flags: the --config's global batch stays, the other factor follows (as
    // DeepSpeed derives it), instead of silently becoming another batch.
    const bool by_micro = o.micro_batch > 0;
    const std::int64_t given = by_micro ? o.micro_batch : o.grad_accum;
    const std::int64_t per = given * s.dp_world;
    STRATA_REQUIRE(config_train_batch % per == 0,
                   "{} {} x {} {}rank(s) does not divide train_batch_size {} of --config {}: "
                   "give {} too, or a value that divides it",
                   by_micro ? "--micro-batch" : "--grad-accum", given, s.dp_world,
                   s.tp > 1 ? "data-parallel " : "", config_train_batch, o.ds_config,
                   by_micro ? "--grad-accum" : "--micro-batch");
    (by_micro ? ecfg.gradient_accumulation_steps : ecfg.micro_batch_per_gpu) =
        config_train_batch / per;
  }
  ecfg.train_batch_size = ecfg.micro_batch_per_gpu * ecfg.gradient_accumulation_steps * s.dp_world;
  if (config_batch && ecfg.train_batch_size != config_train_batch)
    log::warn(
        "--micro-batch {} x --grad-accum {} x {} {}rank(s) = {} sequences a step replaces "
        "train_batch_size {} of --config {}",
        ecfg.micro_batch_per_gpu, ecfg.gradient_accumulation_steps, s.dp_world,
        s.tp > 1 ? "data-parallel " : "", ecfg.train_batch_size, config_train_batch, o.ds_config);
  if (o.lr >= 0)
    ecfg.adamw.lr = o.lr;
  else if (s.demo_model && o.ds_config.empty())
    ecfg.adamw.lr = 3e-3;
  if (o.weight_decay >= 0)
    ecfg.adamw.weight_decay = o.weight_decay;
  else if (o.ds_config.empty())
    ecfg.adamw.weight_decay = 0;
  if (!o.dtype.empty()) {
    // The flag replaces the --config's precision, fp16's loss scaling with it (kept, it divided
    // every gradient by a scale the fp32/bf16 loss was never multiplied by: 65536x too small).
    if (ecfg.fp16.enabled)
      log::warn("--dtype {} replaces the --config's fp16 (fp16.enabled): no loss scaling", o.dtype);
    ecfg.fp16.enabled = false;
    ecfg.compute_dtype = o.dtype == "bf16" ? DType::kBF16 : DType::kF32;
  }
  STRATA_REQUIRE(ecfg.compute_dtype == DType::kF32 || ecfg.compute_dtype == DType::kBF16,
                 "the model computes in fp32 or bf16; fp16 (fp16.enabled in --config) is not "
                 "supported yet: pass --dtype bf16, or in --config set \"fp16\": {{\"enabled\": "
                 "false}} and \"bf16\": {{\"enabled\": true}}");
  if (o.max_grad_norm >= 0) {
    ecfg.gradient_clipping = o.max_grad_norm;
  } else if (!config_clip && !o.model_dir.empty()) {
    ecfg.gradient_clipping = 1.0;  // said in the run's banner
    s.clip_defaulted = true;
  }
  if (ecfg.host_budget_bytes == 0)
    ecfg.host_budget_bytes = default_host_budget(s.launch.local_size);
}

// The schedule: --warmup / --lr-schedule when given, else the --config's scheduler block
// (DeepSpeed's WarmupLR, WarmupDecayLR, WarmupCosineLR), else constant, over the run's steps
// (data_and_steps).
void lr_schedule(Settings& s) {
  const TrainOptions& o = s.o;
  EngineConfig& ecfg = s.ecfg;
  std::int64_t &warmup = s.warmup, &steps = s.steps;
  bool& ds_schedule = s.ds_schedule;
  std::string& schedule = s.schedule;
  const bool cli_schedule = o.warmup >= 0 || !o.lr_schedule.empty();
  warmup = std::max<std::int64_t>(0, o.warmup);
  ds_schedule = !cli_schedule && !ecfg.scheduler.type.empty();
  schedule = ds_schedule ? ecfg.scheduler.type : o.lr_schedule.empty() ? "const" : o.lr_schedule;
  if (!ecfg.scheduler.type.empty() && cli_schedule)
    log::warn("--config: scheduler '{}' is replaced by --warmup / --lr-schedule",
              ecfg.scheduler.type);
  // Checked now, not at step 1 (after the model, the data and the device were made ready).
  STRATA_REQUIRE(ds_schedule || o.min_lr <= double(ecfg.adamw.lr) * (1 + 1e-6),
                 "--min-lr {:g} is above the peak learning rate {:g} (--lr, or the --config's "
                 "optimizer.params.lr): give a --min-lr from 0 to {:g}",
                 o.min_lr, double(ecfg.adamw.lr), double(ecfg.adamw.lr));
  if (ds_schedule && ecfg.scheduler.type != "WarmupLR" && ecfg.scheduler.total_num_steps == 0) {
    // "auto", as Hugging Face fills it: the run's steps.
    STRATA_REQUIRE(
        steps >= ecfg.scheduler.warmup_num_steps,
        "--config: scheduler.params.total_num_steps \"auto\" is this run's {} steps, below its "
        "warmup_num_steps {}: give more --steps (or --epochs) or fewer warmup steps",
        steps, ecfg.scheduler.warmup_num_steps);
    ecfg.scheduler.total_num_steps = steps;
    log::info("--config: scheduler.params.total_num_steps \"auto\" is this run's steps, {}", steps);
  }
  LrScheduleConfig& sc = ecfg.scheduler;
  // --lr is the run's learning rate: where the schedule's peak is its own warmup_max_lr (the
  // optimizer's lr is not read then), the flag replaces that, or it would be ignored.
  if (ds_schedule && o.lr >= 0 && sc.type != "WarmupCosineLR" && sc.warmup_max_lr >= 0 &&
      sc.warmup_max_lr != o.lr) {
    STRATA_REQUIRE(o.lr >= sc.warmup_min_lr,
                   "--lr {} is below the --config's scheduler.params.warmup_min_lr {}, where its "
                   "warmup starts: give a larger --lr, or lower warmup_min_lr",
                   o.lr, sc.warmup_min_lr);
    log::warn(
        "--lr {} replaces the --config's scheduler.params.warmup_max_lr {}{} (the peak of its "
        "{} schedule)",
        o.lr, sc.warmup_max_lr,
        sc.warmup_max_lr_given ? "" : ", DeepSpeed's default where the block gives none", sc.type);
    sc.warmup_max_lr = o.lr;
  }
  // A schedule of fewer steps than the run: DeepSpeed's formulas go on past the end (the decay
  // stays at 0, the cosine climbs again), which no one means.
  if (ds_schedule && sc.type != "WarmupLR" && steps > sc.total_num_steps)
    log::warn(
        "--steps {} runs past the --config's scheduler.params.total_num_steps {}: the {} "
        "schedule ends there, and the steps after it run at {}; give total_num_steps "
        "\"auto\" (this run's steps) or {}",
        steps, sc.total_num_steps, sc.type,
        sc.type == "WarmupDecayLR" ? "its warmup_min_lr" : "a cosine that climbs again", steps);
}

// The sequence length, the batch and the ranks.
void sequence_and_batch(Settings& s) {
  const TrainOptions& o = s.o;
  const ModelConfig& mcfg = s.mcfg;
  // Default: the demo's 128, else 1024 or the model's positions (or its attention's binding
  // window) when it has fewer.
  const std::int64_t window = binding_sliding_window(mcfg);
  std::int64_t fits =
      mcfg.max_positions > 0 ? std::min<std::int64_t>(1024, mcfg.max_positions) : 1024;
  if (window > 0) fits = std::min(fits, window);
  const std::int64_t seq_len = s.seq_len = o.seq_len > 0 ? o.seq_len : s.demo_model ? 128 : fits;
  STRATA_REQUIRE(window == 0 || seq_len <= window,
                 "--seq-len {} exceeds the model config's sliding_window {}: strata's attention is "
                 "full causal over the sequence, which that window would cut; give --seq-len {} "
                 "or less",
                 seq_len, window, window);
  STRATA_REQUIRE(mcfg.arch != ModelArch::kGpt2 || seq_len <= mcfg.max_positions,
                 "--seq-len {} exceeds the model's {} positions (n_positions: a GPT-2 has a "
                 "learned embedding for each): give --seq-len {} or less",
                 seq_len, mcfg.max_positions, mcfg.max_positions);
  // RoPE takes any length, but the model was trained (and its config sized) for this many.
  if (mcfg.arch != ModelArch::kGpt2 && mcfg.max_positions > 0 && seq_len > mcfg.max_positions)
    log::warn(
        "--seq-len {} is beyond the model's max_position_embeddings ({}): positions past it are "
        "ones the "
        "model has not seen",
        seq_len, mcfg.max_positions);
  if (o.sample_every > 0) {
    // The --model folder's tokenizer (tokenizer.json or tokenizer.model) reads a text prompt
    // and writes the samples as text.
    const fs::path tok_file = o.model_dir.empty() ? fs::path() : Tokenizer::file_in(o.model_dir);
    if (!tok_file.empty()) {
      try {
        s.tokenizer = std::make_shared<Tokenizer>(Tokenizer::from_folder(o.model_dir));
      } catch (const Error& e) {
        STRATA_REQUIRE(o.sample_prompt.empty(),
                       "--sample-prompt TEXT: {} cannot be used ({}): give the "
                       "prompt's token ids with --sample-prompt-ids",
                       tok_file.string(), e.user_message());
        log::warn("--sample-every: {} cannot be used ({}): samples print as ids", tok_file.string(),
                  e.user_message());
      }
    }
    if (!o.sample_prompt.empty() && s.tokenizer) {
      s.sample_prompt = s.tokenizer->encode(o.sample_prompt);
      for (std::int32_t id : s.sample_prompt)
        STRATA_REQUIRE(id < mcfg.vocab_size,
                       "--sample-prompt: {} gives id {}, beyond the model's "
                       "vocab_size {}: the tokenizer is not this model's",
                       tok_file.string(), id, mcfg.vocab_size);
    } else if (!o.sample_prompt.empty()) {
      STRATA_REQUIRE(mcfg.vocab_size <= 256,
                     "--sample-prompt TEXT is read by the --model folder's tokenizer, or byte by "
                     "byte for a byte-level model; this one has neither (vocab_size {}): give the "
                     "prompt's token ids with --sample-prompt-ids",
                     mcfg.vocab_size);
      for (unsigned char c : o.sample_prompt) {
        STRATA_REQUIRE(c < mcfg.vocab_size,
                       "--sample-prompt: byte {} is outside the model's vocabulary [0, {}): give "
                       "the prompt's token ids with --sample-prompt-ids",
                       int(c), mcfg.vocab_size);
        s.sample_prompt.push_back(c);
      }
    } else {
      s.sample_prompt =
          parse_token_ids(o.sample_prompt_ids, mcfg.vocab_size, "--sample-prompt-ids");
    }
    const std::int64_t need = std::int64_t(s.sample_prompt.size()) + o.sample_tokens - 1;
    STRATA_REQUIRE(need <= seq_len,
                   "--sample-prompt ({} tokens) and --sample-tokens {} need {} positions, more "
                   "than --seq-len {}: shorten them",
                   s.sample_prompt.size(), o.sample_tokens, need, seq_len);
  }
  s.B = s.ecfg.micro_batch_per_gpu;
  s.accum = s.ecfg.gradient_accumulation_steps;
  // A step reads its micro-batches before its first forward and holds them at once (step_data:
  // strata-prof refuses the same).
  const StepData held = step_data(double(s.accum), double(s.B), double(seq_len));
  STRATA_REQUIRE(held.fits(),
                 "gradient accumulation of {} micro-batches of {} x {} tokens: a step holds them "
                 "all before its first forward, {}, more than the {} of memory available: give a "
                 "smaller --grad-accum (or gradient_accumulation_steps / train_batch_size in the "
                 "--config)",
                 s.accum, s.B, seq_len, log::human_bytes(held.held_bytes, 1),
                 log::human_bytes(held.available_bytes, 1));
  // (the model refuses it too; said here with the flags, before any data or weights are read)
  STRATA_REQUIRE(
      !o.sequence_parallel || (s.B * seq_len) % s.tp == 0,
      "--sequence-parallel cuts each micro-batch's {} x {} = {} token rows (--micro-batch "
      "x --seq-len) over the {} ranks of a tensor-parallel group: give a --micro-batch "
      "or --seq-len whose product {} divides",
      s.B, seq_len, s.B * seq_len, s.tp, s.tp);
  // The model's layer checkpoints in host RAM: a line of the plan's RAM section.
  if (o.checkpoint_on_host) {
    const int sp = o.sequence_parallel ? int(s.tp) : 1;
    s.ecfg.model_host_ram_bytes = host_checkpoint_bytes(mcfg, s.B, seq_len, sp);
    s.ecfg.model_host_ram_what = fmt::format(
        "layer checkpoints (--checkpoint-on-host: {} layers x {} x {} tokens{} x hidden {}, fp32)",
        mcfg.num_layers, s.B, seq_len, sp > 1 ? fmt::format(" / {} ranks", sp) : "",
        mcfg.hidden_size);
  }
  s.rank = s.launch.rank;
  s.world = s.launch.world_size;  // (tp, tp_rank, dp_rank, dp_world: device_options)
  s.con = s.rank == 0 ? o.console : nullptr;
}

// ---- corpora ----
// Text and JSON lines given as data are prepared once with the --model folder's tokenizer into a
// cache (docs/prepared-data.md) and read as prepared files; prepared files are checked against
// that tokenizer.

// The --model folder's tokenizer, when it has one that loads; `why_not` says otherwise.
struct FolderTokenizer {
  std::shared_ptr<Tokenizer> tok;
  std::string dir, hash, why_not;
};

FolderTokenizer folder_tokenizer(const Settings& s) {
  FolderTokenizer t;
  const TrainOptions& o = s.o;
  if (o.model_dir.empty()) {
    t.why_not = o.model_config.empty() ? "the demo model has no tokenizer"
                                       : "--model-config gives no tokenizer";
    return t;
  }
  t.dir = o.model_dir;
  const fs::path file = Tokenizer::file_in(o.model_dir);
  if (file.empty()) {
    t.why_not = fmt::format("{} has no tokenizer.json (or tokenizer.model)", o.model_dir);
    return t;
  }
  try {
    t.tok = s.tokenizer ? s.tokenizer
                        : std::make_shared<Tokenizer>(Tokenizer::from_folder(o.model_dir));
    t.hash = tokenizer_hash(o.model_dir, *t.tok);
  } catch (const Error& e) {
    t.tok.reset();
    t.why_not = fmt::format("{} cannot be used ({})", file.string(), e.user_message());
  }
  return t;
}

// Where prepared corpora are cached: $STRATA_CACHE_DIR/prep, else default_scratch_dir's prep
// (beside the build tree when run from it, else the XDG cache).
std::string prep_cache_dir() {
  if (const char* d = std::getenv("STRATA_CACHE_DIR"); d && *d) return std::string(d) + "/prep";
  return default_scratch_dir("prep");
}

// `inputs` prepared with `t` (or the cached file reused when the inputs' sizes and mtimes, the
// options and the tokenizer hash are the ones it records); the summary on rank 0's console. Ranks
// on one machine take turns on a lock: the first prepares, the others reuse its file.
std::string prepare_cached(const Settings& s, const FolderTokenizer& t,
                           const std::vector<std::string>& inputs, const char* flag) {
  CorpusOptions c;
  c.text_field = s.o.text_field;
  c.text_field_named = s.o.text_field_named;
  c.separator = s.o.separator;
  use_chat_template(c, t.dir, s.o.chat_format);
  const nlohmann::json sources = describe_sources(inputs, c);
  nlohmann::json key = sources;
  for (auto& in : key["inputs"]) {
    in.erase("bytes");
    in.erase("mtime_ns");
    in.erase("sample_xxh3");
  }
  key["tokenizer_hash"] = t.hash;
  const std::string k = key.dump();
  const std::string dir = prep_cache_dir();
  std::error_code ec;
  fs::create_directories(dir, ec);
  STRATA_REQUIRE(!ec,
                 "{}: the cache of prepared corpora cannot be made ({}): set STRATA_CACHE_DIR "
                 "to a writable folder, or prepare the corpus with strata-prep and give its file",
                 dir, ec.message());
  // Named after the first input, cut to 64 bytes (with the hash and the suffixes the cache adds,
  // a 240-byte name passed the file system's 255).
  const std::string path =
      fmt::format("{}/{}-{:016x}.prep", dir, utf8::prefix(fs::path(inputs[0]).stem().string(), 64),
                  XXH3_64bits(k.data(), k.size()));
  const int lock = ::open((path + ".lock").c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  const int lock_err = lock < 0 ? errno : 0;
  // A cache this user may only read (one shared, or on a read-only drive): its file is reused
  // when it is this corpus's, unlocked (no one who can change it is this run's concern).
  const bool read_only = lock_err == EACCES || lock_err == EPERM || lock_err == EROFS;
  if (lock < 0 && !read_only)
    detail::throw_errno(__FILE__, __LINE__, "open", lock_err,
                        fmt::format("cannot lock the prepared corpus {}", path));
  struct Unlock {
    int fd;
    ~Unlock() {
      if (fd >= 0) ::close(fd);  // closing releases the flock
    }
  } unlock{lock};
  // Another run preparing the same corpus: said, then waited for (it went on without a word,
  // for as long as the other's preparing took), and its file reused.
  if (lock >= 0 && !lock_unless_held(lock)) {
    if (s.con)
      log::info(
          "{}: another run is preparing this corpus; waiting for it (its file is then reused)",
          path);
    while (::flock(lock, LOCK_EX) != 0 && errno == EINTR) {
    }
  }
  std::optional<PreparedHeader> reused;  // the header of the file reused
  if (fs::exists(path, ec)) {
    try {
      // Whole (header, documents' starts, mask), as the loader will check it: a damaged body
      // was reused by every run, each refused with advice that did not help a .jsonl's user.
      const PreparedFile f(path);
      const PreparedHeader& h = f.header();
      if (h.tokenizer_hash_hex() == t.hash && config::parse(h.source, path, true) == sources)
        reused = h;
    } catch (const std::exception& e) {
      // Damaged or of another version: prepared again.
      const auto* err = dynamic_cast<const Error*>(&e);
      if (s.con)
        log::warn("{}: the cached prepared corpus cannot be reused ({}); preparing it again", path,
                  err ? err->message() : std::string(e.what()));
    }
  }
  STRATA_REQUIRE(reused || !read_only,
                 "{}: the cache of prepared corpora cannot be written by this user ({}): set "
                 "STRATA_CACHE_DIR to a folder you can write, or prepare the corpus with "
                 "strata-prep and give its file",
                 dir, std::strerror(lock_err));
  std::string line;
  if (reused) {
    const PreparedHeader& h = *reused;
    line = fmt::format("{} documents, {} tokens ({:.1f}% masked), {} truncated (reused)",
                       h.documents, h.tokens,
                       h.tokens ? 100.0 * (1.0 - double(h.counted_tokens) / double(h.tokens)) : 0.0,
                       h.truncated_documents);
  } else {
    const PrepSummary p = prepare_corpus(*t.tok, t.hash, inputs, path, c);
    line = fmt::format(
        "{} documents, {} tokens ({:.1f}% masked), {} truncated; {:.2f} s on {} threads",
        p.documents, p.tokens,
        p.tokens ? 100.0 * (1.0 - double(p.counted_tokens) / double(p.tokens)) : 0.0,
        p.truncated_documents, p.seconds, p.threads);
  }
  if (s.con) {
    std::fprintf(s.con, "%s %s: prepared with %s's tokenizer into %s: %s\n", flag,
                 fmt::format("{}", fmt::join(inputs, " ")).c_str(), t.dir.c_str(), path.c_str(),
                 line.c_str());
    std::fflush(s.con);
  }
  return path;
}

// `files` with their corpora (.txt, .jsonl) replaced by one prepared file, when the model's
// tokenizer can prepare them; the rest as given (the loader names what it cannot read).
std::vector<std::string> prepare_corpora(const Settings& s, const FolderTokenizer& t,
                                         const std::vector<std::string>& files, const char* flag) {
  std::vector<std::string> corpora, out;
  for (const auto& f : files) (is_corpus_file(f) ? corpora : out).push_back(f);
  if (corpora.empty()) return files;
  if (!t.tok) {
    // Without a tokenizer a .jsonl cannot be read at all, and a .txt only byte by byte by a
    // byte-level model: the loader says so; say why the tokenizer is not there first.
    const bool bytes_ok = s.mcfg.vocab_size <= 256 &&
                          std::all_of(corpora.begin(), corpora.end(), is_text_corpus_file);
    STRATA_REQUIRE(bytes_ok,
                   "{} {}: a corpus is tokenized with the model's tokenizer, and {}: give --model "
                   "DIR whose folder has the model's tokenizer.json, or prepare it with "
                   "strata-prep --tokenizer DIR and give the .prep file",
                   flag, corpora[0], t.why_not);
    return files;
  }
  out.insert(out.begin(), prepare_cached(s, t, corpora, flag));
  return out;
}

DataIdentity data_identity(const std::vector<std::string>& files) {
  DataIdentity out;
  for (const auto& f : files) {
    std::error_code ec;
    const auto size = fs::file_size(f, ec);
    out.bytes.push_back(ec ? -1 : std::int64_t(size));
    out.samples.push_back(ec ? std::string() : file_sample_hash(f, size));
  }
  return out;
}

// ---- data ----
// The files the loaders read and how; the run's steps: --steps, the default 60, or --epochs
// passes over the data, counted from the files' sizes (the loaders are made after the ranks
// agree on their settings, the steps among them).
void data_and_steps(Settings& s) {
  const TrainOptions& o = s.o;
  DataOptions& dopt = s.dopt;
  s.text_file = o.text_file;
  // The demo's text is read byte by byte: a model of the user's with a wider vocabulary has no
  // data here (the loader's own refusal named the demo's file and a tokenizer already given).
  // --plan reads no data.
  STRATA_REQUIRE(!s.demo_data || s.demo_model || s.mcfg.vocab_size <= 256 || o.plan_only,
                 "no --data or --text: with no data of yours a model trains on the demo's "
                 "generated text, read byte by byte (ids 0-255), and this model's vocab_size is "
                 "{}: give its data with --data FILE (a .txt or .jsonl is prepared with a "
                 "--model folder's tokenizer; a .prep from strata-prep) or --text FILE",
                 s.mcfg.vocab_size);
  // (the loader refused its first byte past the vocabulary as "wrong tokenizer or format?")
  STRATA_REQUIRE(
      !s.demo_data || s.demo_model || s.mcfg.vocab_size > demo_text_largest_byte() || o.plan_only,
      "no --data or --text: with no data of yours a model trains on the demo's "
      "generated text, read byte by byte, whose bytes go up to {}, and this model's "
      "vocab_size is {}: give its data with --data FILE or --text FILE, or a "
      "vocab_size of {} or more",
      demo_text_largest_byte(), s.mcfg.vocab_size, demo_text_largest_byte() + 1);
  if (s.demo_data) {
    // Beside the demo's NVMe folder, or (a config of the user's with the demo's data) in the
    // scratch folder: never the working directory. Written in prepare_data.
    const std::string dir = s.demo_dir.empty() ? default_scratch_dir("demo-data") : s.demo_dir;
    s.text_file = (fs::path(dir) / "demo-text.txt").string();
  }
  dopt.files = s.text_file.empty() ? o.data_files : std::vector<std::string>{s.text_file};
  dopt.format = s.text_file.empty() ? parse_token_format(o.data_format) : TokenFormat::kBytes;
  s.eval_files = o.eval_files;
  // The model's tokenizer, read only where the data needs it: corpora to prepare, prepared files
  // to check.
  auto wants_tokenizer = [&](const std::vector<std::string>& files) {
    return std::any_of(files.begin(), files.end(), [](const std::string& f) {
      return is_corpus_file(f) || is_prepared_file(f);
    });
  };
  // --separator splits the text corpora prepared with the model's tokenizer; said where there is
  // none (only JSON lines or token files; text read byte by byte without a tokenizer).
  auto any_text = [](const std::vector<std::string>& files) {
    return std::any_of(files.begin(), files.end(), is_text_corpus_file);
  };
  bool split_text = false;
  std::string unsplit_why;
  if (!s.demo_data &&
      (!o.text_file.empty() || wants_tokenizer(o.data_files) || wants_tokenizer(o.eval_files))) {
    const FolderTokenizer t = folder_tokenizer(s);
    dopt.tokenizer_hash = t.hash;
    dopt.tokenizer_origin = t.dir;
    if (!o.text_file.empty() && (t.tok || s.mcfg.vocab_size > 256)) {
      // --text: a corpus of the model's tokenizer where the folder has one; byte by byte only
      // for a byte-level model without one; else refused.
      STRATA_REQUIRE(t.tok,
                     "--text {}: this model's vocab_size is {}, so its text must be tokenized by "
                     "its own tokenizer (byte ids 0-255 would be read as its tokens), and {}: "
                     "give --model DIR whose folder has the model's tokenizer.json, or prepare "
                     "the text with strata-prep --tokenizer DIR and give --data FILE.prep",
                     o.text_file, s.mcfg.vocab_size, t.why_not);
      dopt.files = {prepare_cached(s, t, {o.text_file}, "--text")};
      dopt.format = TokenFormat::kAuto;
    } else if (o.text_file.empty() && dopt.format == TokenFormat::kAuto) {
      dopt.files = prepare_corpora(s, t, o.data_files, "--data");
    }
    if (parse_token_format(o.data_format) == TokenFormat::kAuto)
      s.eval_files = prepare_corpora(s, t, o.eval_files, "--eval-data");
    split_text =
        t.tok &&
        (!o.text_file.empty() || (dopt.format == TokenFormat::kAuto && any_text(o.data_files)) ||
         (parse_token_format(o.data_format) == TokenFormat::kAuto && any_text(o.eval_files)));
    if (!t.tok && (!o.text_file.empty() || any_text(o.data_files) || any_text(o.eval_files)))
      unsplit_why = t.why_not;
    if (t.hash.empty() && s.con)
      for (const auto& f : dopt.files)
        if (is_prepared_file(f))
          std::fprintf(s.con,
                       "--data %s: a prepared file, checked against the model's vocabulary only "
                       "(%s)\n",
                       f.c_str(), t.why_not.c_str());
  }
  if (o.separator && !split_text && s.rank == 0)
    log::warn(
        "--separator is not used: it splits .txt corpora prepared with the model's "
        "tokenizer into documents, and {}",
        !unsplit_why.empty()
            ? fmt::format("this text is read byte by byte ({})", unsplit_why)
            : std::string("no --data / --eval-data / --text here is a .txt corpus"));
  // --text-field and --chat-format read JSON lines records: where there are none (every file
  // prepared already, or text), said as --separator is (they were dropped without a word).
  const auto any_json_lines = [&] {
    for (const auto* files : {&o.data_files, &o.eval_files})
      if (std::any_of(files->begin(), files->end(), is_json_lines_file)) return true;
    return false;
  };
  if (s.rank == 0 && (o.text_field_named || !o.chat_format.empty()) && !any_json_lines())
    log::warn(
        "{} is not used: it reads JSON lines records (.jsonl), and no --data / --eval-data "
        "here is one (a prepared file keeps what it was prepared with)",
        o.text_field_named ? "--text-field" : "--chat-format");
  // Read byte by byte as --text is (the evaluation's loader is the training's): a token file or
  // a prepared one would give a validation loss of bytes that are no text. Text has no NUL.
  if (dopt.format == TokenFormat::kBytes)
    for (const std::string& f : s.eval_files) {
      std::ifstream in(f, std::ios::binary);
      std::string head(std::size_t(1) << 16, '\0');
      in.read(head.data(), std::streamsize(head.size()));
      head.resize(std::size_t(in.gcount()));
      STRATA_REQUIRE(head.find('\0') == std::string::npos,
                     "--eval-data {}: holds NUL bytes, so it is no text, and --eval-data is read "
                     "byte by byte as --text is: give a text file, or train on token files with "
                     "--data FILE --data-dtype u16|u32 and give the evaluation's in that format",
                     f);
    }
  dopt.batch = s.B;
  dopt.seq_len = s.seq_len;
  dopt.vocab_size = s.mcfg.vocab_size;
  dopt.shuffle = o.shuffle;
  dopt.seed = o.seed;
  // The last 10% of each training file, unless --eval-data gives the evaluation its own (it
  // shapes the train split: recorded, compared on resume).
  dopt.val_fraction = o.eval_every > 0 && o.eval_files.empty() ? 0.1 : 0.0;
  s.steps = o.steps > 0 ? o.steps : 60;
  const bool prepared = dopt.format == TokenFormat::kPrepared ||
                        (dopt.format == TokenFormat::kAuto &&
                         std::any_of(dopt.files.begin(), dopt.files.end(),
                                     [](const std::string& f) { return is_prepared_file(f); }));
  if (prepared && s.con) {
    // What the packing makes of the documents at this --seq-len (docs/prepared-data.md).
    const DataExtent e = measure_tokens(dopt);
    std::fprintf(s.con,
                 "data: %lld documents, %lld tokens, %lld counted targets (%.1f%% masked); %lld "
                 "rows of --seq-len %lld (%.1f%% padding), %lld document%s longer than a row "
                 "split into row-sized pieces\n",
                 (long long)e.documents, (long long)e.tokens, (long long)e.counted,
                 e.tokens ? 100.0 * (1.0 - double(e.counted) / double(e.tokens)) : 0.0,
                 (long long)e.rows, (long long)s.seq_len,
                 e.rows ? 100.0 * (1.0 - double(e.tokens) / double(e.rows * s.seq_len)) : 0.0,
                 (long long)e.split_documents, e.split_documents == 1 ? "" : "s");
    std::fflush(s.con);
  }
  if (o.epochs > 0) {
    s.epochs = o.epochs;
    const DataExtent e = measure_tokens(dopt);
    const std::int64_t rows_per_step = s.B * s.accum * s.dp_world;
    s.epoch_rows = e.rows;
    s.steps_per_epoch = e.rows / rows_per_step;
    const std::string split =
        dopt.val_fraction > 0 ? " (the train split: --eval-every keeps the last 10% of each file)"
                              : "";
    STRATA_REQUIRE(
        s.steps_per_epoch > 0,
        "--epochs: the data holds {} tokens{}, {} sequence(s) of --seq-len {}{}, and one "
        "optimizer step takes --micro-batch {} x --grad-accum {} x {} rank(s) = {} sequences, "
        "{} tokens or more: give more data, or a smaller --micro-batch, --grad-accum or "
        "--seq-len",
        e.tokens, split, e.rows, s.seq_len,
        o.shuffle ? "" : " (--no-shuffle: in whole micro-batches of a file)", s.B, s.accum,
        s.dp_world, rows_per_step, rows_per_step * s.seq_len + 1);
    // The Hugging Face Trainer's count: ceil(epochs x whole steps per epoch).
    const double total = std::ceil(s.epochs * double(s.steps_per_epoch));
    STRATA_REQUIRE(total < 9.2e18, "--epochs {:g} x {} steps an epoch is beyond 2^63 - 1 steps",
                   s.epochs, s.steps_per_epoch);
    s.steps = static_cast<std::int64_t>(total);
  }
  STRATA_REQUIRE(o.trace_file.empty() || o.trace_step <= s.steps,
                 "--trace-step {} is after the last step ({} {}): nothing would be traced; pick a "
                 "step from 1 to {}",
                 o.trace_step, s.epochs > 0 ? "--epochs, steps:" : "--steps", s.steps, s.steps);
}

// The demo's generated text, when the run trains on it.
void prepare_data(Run& r) {
  const Settings& s = r.s;
  const TrainOptions& o = s.o;
  if (!s.demo_data) return;
  if (s.rank == 0) write_demo_text(s.text_file);
  if (s.rank == 0 && !s.demo_model)
    log::warn(
        "no --data or --text: training {} on the demo's generated text (a smoke test, not a "
        "fine-tune); "
        "give --data FILE or --text FILE for your own",
        o.model_dir.empty() ? "the model" : o.model_dir);
}

// Each rank found its checkpoint alone, before the communicator existed. Node-local folders can
// hold different newest steps (a job that died while its nodes renamed theirs): every rank takes
// the newest step all of them have. Then each rank checks that it sees the engine state it will
// read (its own files, or every rank's to reshard); when one does not, every rank stops, each
// saying what it misses and where the manifest says those files are. Collective.
void agree_on_resume(Run& r) {
  Settings& s = r.s;
  FoundCheckpoint& resume = s.resume;
  const int rank = s.rank, world = s.world;
  std::string why;
  if (world > 1) {
    std::vector<double> v = {-double(resume.step)};
    max_across_ranks(*r.comm, v);
    const std::int64_t common = std::int64_t(-v[0]);
    if (common > 0 && resume.step > common && !resume.root.empty()) {
      try {
        FoundCheckpoint older = find_checkpoint(s.o.resume, "--resume", common);
        STRATA_REQUIRE(older.step == common,
                       "--resume {}: rank {} found step-{}, another rank's newest complete "
                       "checkpoint is step-{}, which this rank does not have (its next older is "
                       "step-{}): the nodes' folders hold different checkpoints; give every rank "
                       "--resume {}/step-<N> of a step all of them have",
                       s.o.resume, rank, resume.step, common, older.step, resume.root);
        log::warn(
            "--resume: rank {} found step-{} in {}, but another rank's newest complete checkpoint "
            "is step-{}: every rank resumes from step {}",
            rank, resume.step, resume.root, common, common);
        resume = std::move(older);
        std::erase_if(s.inherited_checkpoints, [&](std::int64_t st) { return st > common; });
      } catch (const Error& e) {
        why = e.message();
      }
    }
  }
  if (!resume.dir.empty() && why.empty()) {
    const int ck_world = resume.manifest.value("world_size", -1);
    std::int64_t rank_files = 0;
    for (const auto& f : resume.manifest.value("files", nlohmann::json::array()))
      if (f.is_object() && f.value("name", "").ends_with(".bin")) ++rank_files;
    if (ck_world < 1 || rank_files != ck_world)
      why = fmt::format(
          "--resume {}: the manifest says {} rank(s) but lists the engine state of {}: a damaged "
          "checkpoint; resume from another one",
          resume.dir, ck_world, rank_files);
    std::string missing;  // the first file this rank needs and cannot see
    for (int q = ck_world == world ? rank : 0;
         why.empty() && missing.empty() && q < (ck_world == world ? rank + 1 : ck_world); ++q)
      missing = checkpoint_rank_missing(resume.dir, resume.manifest, q);
    if (!missing.empty())
      why = fmt::format(
          "--resume {}: {}; {}", resume.dir, missing,
          ck_world == world
              ? "start each rank on the node that wrote its files (the same ranks per node), or "
                "copy the rank's files into this node's folder"
              : fmt::format("resharding its {} ranks to {} reads every rank's files: copy the "
                            "step's folder from every node into one (its files side by side, "
                            "any manifest.json), or use a file system every node sees, and "
                            "resume from that",
                            ck_world, world));
  }
  if (world > 1) {
    std::vector<double> missing(std::size_t(world), 0.0);
    missing[std::size_t(rank)] = why.empty() ? 0.0 : 1.0;
    max_across_ranks(*r.comm, missing);
    std::vector<int> who;
    for (int q = 0; q < world; ++q)
      if (missing[std::size_t(q)] > 0) who.push_back(q);
    STRATA_REQUIRE(who.empty() || !why.empty(),
                   "--resume {}: rank(s) {} cannot read the checkpoint's engine state they need "
                   "(their errors say which files and where they are)",
                   resume.dir, fmt::join(who, ", "));
  }
  STRATA_REQUIRE(why.empty(), "{}", why);
}

// The device and the communicator; the ranks agree on the checkpoint they resume and on their
// settings (the first collectives); the loaders.
void open_device(Run& r) {
  const Settings& s = r.s;
  const TrainOptions& o = s.o;
  const int rank = s.rank, world = s.world;
  std::unique_ptr<Device>& dev = r.dev;
  std::unique_ptr<Communicator>& comm = r.comm;
  dev = make_device(o.device, s.hopt, s.copt);
  // Under the demo's 20 MiB cap (set on the emulated device's options above; a GPU runs it
  // uncapped).
  r.demo_capped = s.demo_model && o.device_mem_gb <= 0 && dev->kind() == DeviceKind::kCpu;
  comm = make_communicator(*dev);
  STRATA_CHECK(comm->rank() == rank && comm->world_size() == world,
               "the communicator disagrees with the launcher");
  agree_on_resume(r);
  // The data's identity, taken once: the user's files before the ranks compare them (the loader
  // opens them next), the demo's text once rank 0 has written it.
  if (!s.demo_data) r.data_identity = data_identity(s.dopt.files);
  if (world > 1) require_same_settings(shared_settings(s, r.data_identity), *comm, *dev);
  // TP groups of consecutive ranks on one node (refused otherwise, on every rank alike).
  if (s.tp > 1) r.groups = make_process_groups(*comm, s.tp);
  if (s.demo_data && world > 1) {  // rank 0 wrote the text
    auto bs = dev->create_stream("barrier");
    comm->barrier(*bs);
    bs->synchronize();
  }
  // The loaders' warnings are the data's, the same on every rank: said once.
  const log::Quiet quiet(log::Level::kError, r.s.rank > 0);
  r.loader = std::make_unique<TokenLoader>(r.s.dopt);
  if (s.demo_data) r.data_identity = data_identity(s.dopt.files);
  if (!o.eval_files.empty()) {  // read whole, in order
    DataOptions e = r.s.dopt;
    e.files = r.s.eval_files;
    e.val_fraction = 0;
    e.shuffle = false;
    r.val = std::make_unique<TokenLoader>(e);
  } else if (o.eval_every > 0) {
    r.val = std::make_unique<TokenLoader>(r.s.dopt, DataSplit::kVal);
  }
  // The whole evaluation data once: each rank a batch of every `world` in turn.
  STRATA_REQUIRE(!r.val || o.eval_batches > 0 || r.val->batches_per_epoch() >= s.dp_world,
                 "--eval-batches 0 evaluates the whole evaluation data, {} batch(es) of {} x {} "
                 "tokens, fewer than the {} data-parallel ranks: give more evaluation data or a "
                 "smaller --micro-batch",
                 r.val->batches_per_epoch(), s.B, s.seq_len, s.dp_world);
}

// ---- model + engine ----
void build_model_and_engine(Run& r) {
  const Settings& s = r.s;
  const TrainOptions& o = s.o;
  const ModelConfig& mcfg = s.mcfg;
  Device& dev = *r.dev;
  ModelOptions& mopt = r.mopt;
  r.compute = dev.create_stream("compute");
  Stream& compute = *r.compute;
  mopt.micro_batch = s.B;
  mopt.seq_len = s.seq_len;
  mopt.compute = s.ecfg.compute_dtype;
  mopt.checkpoint = o.checkpoint_activations || o.checkpoint_on_host || s.demo_model;
  mopt.checkpoint_on_host = o.checkpoint_on_host;
  mopt.tensor_parallel = r.tp_comm();
  mopt.sequence_parallel = o.sequence_parallel;
  r.model = std::make_unique<Model>(mcfg, dev, compute, mopt);
  // ZeRO-3 over the data-parallel group (the whole job without TP).
  r.engine = std::make_unique<Engine>(dev, r.dp_comm(), s.ecfg);
  Engine& engine = *r.engine;
  // Each rank's slices computed (from scratch) or read (a Hugging Face folder) where they go.
  const TensorParallel tp{s.tp, s.tp_rank};
  ModelSource source = o.model_dir.empty() ? fresh_model_source(mcfg, o.seed, tp)
                                           : hf_model_source(mcfg, o.model_dir, tp);
  // A resume reads the checkpoint's whole state over the first one (Engine::load_state): zeros
  // stand in (a 70B --model folder was read whole, or a billion values made, to be replaced).
  if (!s.resume.dir.empty()) source = [](std::size_t, std::size_t, std::size_t, float*) {};
  add_model_units(engine, r.model->units(), std::move(source));
  if (r.tp_comm())
    engine.set_tensor_parallel(*r.tp_comm(), tensor_parallel_counted(r.model->units(), s.tp_rank));
  if (s.ecfg.decay_exempt_norms_and_biases)
    engine.set_weight_decay_exempt(weight_decay_exempt_ranges(r.model->units()));
  // A big model's first state takes a while to make and place (a billion parameters, from
  // scratch onto NVMe: tens of seconds on two cores): said, not silence before the banner.
  constexpr std::uint64_t kSaidFrom = 100'000'000;
  const bool say = s.rank == 0 && s.total_numel >= kSaidFrom;
  const Clock::time_point t_place = Clock::now();
  if (say)
    log::info("placing the training state of {:.0f}M parameters on its tiers ({}){}",
              double(s.total_numel) / 1e6,
              !s.resume.dir.empty() ? "room for the checkpoint's state, read next"
              : o.model_dir.empty() ? "weights initialised from scratch"
                                    : "weights read from --model",
              s.dp_world > 1 || s.tp > 1 ? ", each rank its share" : "");
  try {
    engine.finalize();
  } catch (const Error& e) {
    // Two demos at once: the demo's folder is the flag's, not a config key of the user's.
    if (!s.demo_dir.empty() &&
        e.user_message().find("in use by another running strata process") != std::string::npos)
      STRATA_THROW(kInvalidArgument,
                   "the demo's NVMe folder {} is in use by another running demo; give this one "
                   "its own with --demo-nvme DIR",
                   s.demo_dir);
    // The demo's config is the demo's, not the user's: its nvme_path is the demo's folder.
    if (!s.demo_dir.empty() && o.ds_config.empty() &&
        e.user_message().find("nvme_path") != std::string::npos)
      detail::throw_error(
          e.kind(), __FILE__, __LINE__, "",
          fmt::format("the demo's NVMe folder {}: {}\n(give the demo another with --demo-nvme DIR)",
                      s.demo_dir, e.message()));
    // The demo runs on a device capped below its weights, which its own config offloads
    // around; a config of the user's may not: say where the cap comes from.
    // A cap of the user's own is one of the things to change.
    if (e.kind() == ErrorKind::kOutOfMemory && o.device_mem_gb > 0)
      STRATA_THROW(kOutOfMemory,
                   "{}\n(--device-mem-gb {:g} caps the device: a larger one is another way)",
                   e.message(), o.device_mem_gb);
    if (e.kind() != ErrorKind::kOutOfMemory || !r.demo_capped || o.ds_config.empty()) throw;
    STRATA_THROW(kOutOfMemory,
                 "the demo model runs on an emulated device capped at 20 MiB (below its weights), "
                 "and --config {} "
                 "does not fit it: offload as the message below says, or give a larger device with "
                 "--device-mem-gb\n{}",
                 o.ds_config, e.user_message());
  }
  if (say) log::info("the training state placed in {:.1f} s", since(t_place));
  r.weights = std::make_unique<EngineWeights>(engine, compute, r.model->units());
}

// ---- resume ----
// The checkpoint's state loaded, after what differs from its run is said; the data position
// replayed.
void resume_from_checkpoint(Run& r) {
  const Settings& s = r.s;
  const TrainOptions& o = s.o;
  const ModelConfig& mcfg = s.mcfg;
  const EngineConfig& ecfg = s.ecfg;
  const FoundCheckpoint& resume = s.resume;
  const std::int64_t B = s.B, accum = s.accum, seq_len = s.seq_len, steps = s.steps,
                     warmup = s.warmup;
  const int world = s.dp_world;  // the ranks that take batches
  const std::string& schedule = s.schedule;
  const bool ds_schedule = s.ds_schedule;
  std::FILE* con = s.con;
  const DataOptions& dopt = r.s.dopt;
  Engine& engine = *r.engine;
  TokenLoader& loader = *r.loader;
  std::int64_t &train_batches = r.train_batches, &start_step = r.start_step;
  const std::string& model_hash = r.model_hash = model_config_hash(mcfg);
  const std::string& model_desc = r.model_desc =
      fmt::format("{} {}x{} {} layers, vocab {}", mcfg.model_type, mcfg.hidden_size,
                  mcfg.intermediate_size, mcfg.num_layers, mcfg.vocab_size);
  // What else shapes the steps after a checkpoint: recorded, compared on resume.
  const nlohmann::json& optimizer_state = r.optimizer_state = {
      {"weight_decay", double(ecfg.adamw.weight_decay)},
      {"weight_decay_exempt", weight_decay_exempt_name(ecfg.decay_exempt_norms_and_biases)},
      {"beta1", double(ecfg.adamw.beta1)},
      {"beta2", double(ecfg.adamw.beta2)},
      {"eps", double(ecfg.adamw.eps)},
      {"bias_correction", ecfg.adamw.bias_correction},
      {"gradient_clipping", ecfg.gradient_clipping},
      {"compute_dtype", std::string(dtype_name(ecfg.compute_dtype))}};
  if (!resume.dir.empty()) {
    const nlohmann::json& m = resume.manifest;
    const nlohmann::json t = m.value("trainer", nlohmann::json::object());
    // Its data-parallel ranks (agree_on_resume checked its world size): those took the batches.
    const int ck_tp = t.value("tensor_parallel", 1);
    STRATA_REQUIRE(ck_tp == s.tp,
                   "--resume {}: the checkpoint was written with --tensor-parallel {}, this run "
                   "has {}: its files hold other slices of the split layers; resume with "
                   "--tensor-parallel {} (strata-export writes it as a whole model, which "
                   "--model then starts any other from)",
                   resume.dir, ck_tp, s.tp, ck_tp);
    const int ck_world = m.value("world_size", -1) / ck_tp;
    const std::string ck_hash = t.value("model_config_hash", "");
    STRATA_REQUIRE(ck_hash == model_hash,
                   "--resume {}: the checkpoint was taken with a different model ({}, config "
                   "hash {}; this run's: {}, hash {}); resume with the same --model/--model-config",
                   resume.dir, t.value("model", "?"), ck_hash, model_desc, model_hash);
    const nlohmann::json d = t.value("data", nlohmann::json::object());
    auto differs = [&](const char* key, const nlohmann::json& now) {
      if (d.contains(key) && d[key] != now)
        log::warn(
            "--resume: {} was {} in the checkpoint's run, {} now: the data will not continue where "
            "it stopped",
            key, d[key].dump(), now.dump());
    };
    differs("micro_batch", B);
    differs("seq_len", seq_len);
    // Ranks take turns over one stream of micro-batches (rank r the r-th of each group of world),
    // so the micro-batches of a step, grad_accum x ranks, decide the data, not how they split.
    // (under TP the ranks that take batches and hold shards are the data-parallel ones)
    const char* ranks_of = s.tp > 1 ? "data-parallel rank" : "rank";
    if (d.contains("grad_accum") && d["grad_accum"].is_number_integer() &&
        d["grad_accum"].get<std::int64_t>() * ck_world != accum * world)
      log::warn(
          "--resume: a step was {} micro-batches (grad_accum {} x {} {}{}) in the checkpoint's "
          "run, {} now ({} x {}): the data will not continue where it stopped; keep grad_accum x "
          "{}s to continue it",
          d["grad_accum"].get<std::int64_t>() * ck_world, d["grad_accum"].get<std::int64_t>(),
          ck_world, ranks_of, ck_world == 1 ? "" : "s", accum * world, accum, world, ranks_of);
    if (ck_world != world && con)
      std::fprintf(con,
                   "resharding the checkpoint's %d %s%s to %d: every unit's master weights and "
                   "Adam moments re-cut, a unit at a time\n",
                   ck_world, ranks_of, ck_world == 1 ? "" : "s", world);
    differs("seed", o.seed);
    differs("shuffle", o.shuffle);
    {
      // The data's identity: each file's size and a hash of its ends (data_identity), where
      // the checkpoint records them; the same bytes under another path (moved, or named from
      // another folder) are the same data, and the same path with other bytes is not. Older
      // checkpoints: the paths, from this folder.
      auto canon = [](const nlohmann::json& list) {
        std::vector<std::string> out;
        if (!list.is_array()) return out;
        for (const auto& f : list) out.push_back(canonical_path(f.get<std::string>()));
        return out;
      };
      const nlohmann::json then_bytes = d.value("file_bytes", nlohmann::json()),
                           then_samples = d.value("file_samples", nlohmann::json());
      const std::vector<std::int64_t>& now_bytes = r.data_identity.bytes;
      const std::vector<std::string>& now_samples = r.data_identity.samples;
      const bool same_paths = !d.contains("files") || canon(d["files"]) == canon(dopt.files);
      const bool recorded = then_bytes.is_array() && then_samples.is_array() &&
                            then_bytes.size() == now_bytes.size() &&
                            then_samples.size() == now_samples.size();
      bool same_bytes = true;
      std::size_t changed = 0;
      if (recorded)
        for (std::size_t i = 0; i < now_bytes.size() && same_bytes; ++i)
          if (then_bytes[i] != now_bytes[i] || then_samples[i] != now_samples[i]) {
            same_bytes = false;
            changed = i;
          }
      // An older checkpoint's files under other paths (a corpus whose cache name changed with
      // strata's version: the run was warned that its data would not continue, and it did):
      // their bytes, where they are still there.
      bool compared = recorded;
      if (!recorded && !same_paths && d.contains("files") && d["files"].is_array()) {
        const std::vector<std::string> then_files = canon(d["files"]);
        std::error_code ec;
        if (!then_files.empty() &&
            std::all_of(then_files.begin(), then_files.end(),
                        [&](const std::string& f) { return fs::is_regular_file(f, ec); })) {
          const DataIdentity then = data_identity(then_files);
          compared = true;
          same_bytes = then.bytes == now_bytes && then.samples == now_samples;
        }
      }
      if (compared && same_bytes) {
        if (!same_paths && s.con)
          std::fprintf(s.con,
                       "--resume: the data files are the checkpoint's (the same sizes and "
                       "bytes) under other paths: %s then, %s now\n",
                       d["files"].dump().c_str(), nlohmann::json(dopt.files).dump().c_str());
      } else if (!same_paths) {
        log::warn(
            "--resume: files was {} in the checkpoint's run, {} now: the data will not continue "
            "where it stopped",
            d["files"].dump(), nlohmann::json(dopt.files).dump());
      } else if (recorded) {
        // The same files, changed in place since (edited, appended to, prepared again).
        log::warn(
            "--resume: {} {}: it changed since, and the data will not continue where it stopped",
            dopt.files[changed],
            then_bytes[changed] != now_bytes[changed]
                ? fmt::format("had {} bytes in the checkpoint's run, {} now",
                              then_bytes[changed].dump(), now_bytes[changed])
                : std::string("held other bytes in the checkpoint's run (the same size)"));
      }
    }
    differs("val_fraction", dopt.val_fraction);  // --eval-every takes 10% for validation
    const nlohmann::json ls = t.value("lr_schedule", nlohmann::json::object());
    nlohmann::json now = s.lr_schedule_record(resume.step + 1);
    // The total and the minimum shape a decay (cosine, linear): extending a constant-lr run is no
    // change of schedule. (Within the warmup the next lr is the same whatever the decay after it.)
    const bool by_total = !ds_schedule && schedule != "const";
    if (ls.value("lr", ecfg.adamw.lr) != double(ecfg.adamw.lr) ||
        ls.value("warmup", warmup) != warmup || ls.value("schedule", schedule) != schedule ||
        (by_total && ls.value("total_steps", steps) != steps) ||
        (by_total && ls.value("min_lr", std::max(0.0, o.min_lr)) != std::max(0.0, o.min_lr)) ||
        ls.value("next_lr", s.lr_of(resume.step + 1)) != s.lr_of(resume.step + 1)) {
      // Each side whole, the keys that differ first; an lr as the fp32 it is (the record's double
      // of it printed 0.0010000000474974513 for 1e-3).
      nlohmann::json then = ls;
      std::string differ;
      for (const auto& [key, v] : now.items())
        if (then.contains(key) && then[key] != v) differ += (differ.empty() ? "" : ", ") + key;
      for (nlohmann::json* side : {&then, &now})
        for (auto& [key, v] : side->items())
          if (v.is_number_float()) v = std::stod(fmt::format("{}", float(v.get<double>())));
      log::warn(
          "--resume: the learning-rate schedule differs from the checkpoint's run ({} differ): "
          "the checkpoint's {}, this run's {}; continuing with this run's",
          differ.empty() ? std::string("its records") : differ, then.dump(), now.dump());
    }
    nlohmann::json ck_opt = t.value("optimizer", nlohmann::json::object());
    // A run that recorded no exemption decayed every parameter; with no weight decay in either
    // run, what it would skip does not matter (a change of the decay itself is said as that).
    if (ck_opt.contains("weight_decay") && !ck_opt.contains("weight_decay_exempt"))
      ck_opt["weight_decay_exempt"] = weight_decay_exempt_name(false);
    if (ck_opt.value("weight_decay", -1.0) == 0 || ecfg.adamw.weight_decay == 0)
      ck_opt.erase("weight_decay_exempt");
    for (const auto& [key, now] : optimizer_state.items())
      if (ck_opt.contains(key) && ck_opt[key] != now)
        log::warn(
            "--resume: {} was {} in the checkpoint's run, {} now: the steps after the checkpoint "
            "will not be those of the run that wrote it ({})",
            key, ck_opt[key].dump(), now.dump(),
            key == "weight_decay_exempt"
                ? fmt::format("a --config with \"strata\": {{\"weight_decay_exempt\": {}}} "
                              "continues it exactly",
                              ck_opt[key].dump())
                : std::string("give the same --config / flags to continue it exactly"));
    engine.load_state(resume.dir);
    // The data position: replay the loader's batches (their order is a function of the seed;
    // every evaluation starts from the evaluation data's start).
    const std::int64_t tb = d.value("train_batches", std::int64_t(0));
    for (; train_batches < tb; ++train_batches) loader.next();
    start_step = resume.step;
    r.resumed_from = start_step;
    if (con) {
      std::fprintf(con, "resumed from %s (step %lld)\n", resume.dir.c_str(), (long long)start_step);
      std::fflush(con);
    }
    // A run resumed from an older checkpoint branches off the run that went on from it: that
    // run's newer checkpoints stay (this run replaces each as it saves the same step), and until
    // it has saved past them, "--resume" of the folder takes the newest of them, not this run's.
    if (r.s.rank == 0 && !r.s.newer_checkpoints.empty())
      log::warn(
          "{} holds checkpoints newer than the resumed step {} (steps {}) of the run this one "
          "branches from: until this run saves past step {}, --resume {} takes the newest of "
          "them; resume this run's by its step-<N> folder, or move them away",
          r.s.ckpt_root, start_step, fmt::join(r.s.newer_checkpoints, ", "),
          r.s.newer_checkpoints.back(), r.s.ckpt_root);
  }
}

nlohmann::json Settings::lr_schedule_record(std::int64_t next) const {
  return {{"lr", double(ecfg.adamw.lr)},
          {"warmup", warmup},
          {"total_steps", steps},
          {"schedule", schedule},
          {"min_lr", std::max(0.0, o.min_lr)},
          {"next_step", next},
          {"next_lr", lr_of(next)}};
}

double Settings::lr_of(std::int64_t t) const {
  return ds_schedule ? scheduled_lr(ecfg.scheduler, ecfg.adamw.lr, t)
                     : lr_at(t, ecfg.adamw.lr, warmup, steps, schedule, std::max(0.0, o.min_lr));
}

}  // namespace strata::train_job
