// Checkpoints and resume (issue #8, item 3).
//
// In process: Engine::save_state / load_state between fresh Engine + Model objects continue
// a run bit-identically, across placements (saved with NVMe offload, resumed without, and the
// reverse), bf16 with gradient accumulation and resident units; incompatible states are
// refused with errors naming what differs.
// End to end (the strata-train binary, STRATA_TRAIN_BIN): a run SIGKILLed after step 6 is
// logged resumes and logs steps 7-10 bitwise equal to a straight run; a run that dies inside
// a checkpoint write (STRATA_TEST_CRASH_IN_CHECKPOINT) leaves a .tmp folder that is never
// chosen, a checkpoint with a bad checksum is skipped too; a different model or world size is
// a clear error.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/wait.h>
#include <unistd.h>
#define XXH_INLINE_ALL
#include <xxhash.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <thread>

#include "strata/comm.h"
#include "strata/engine.h"
#include "strata/error.h"
#include "strata/model.h"
#include "strata/trainer.h"
#include "test_util.h"

namespace strata {
namespace {

namespace fs = std::filesystem;
using namespace std::chrono_literals;

using testing::TempDir;

ModelConfig tiny_llama(bool tied, int hidden = 64) {
  const std::string j = fmt::format(R"({{"model_type": "llama", "vocab_size": 96, "hidden_size": {},
    "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "tie_word_embeddings": {}}})",
                                    hidden, tied ? "true" : "false");
  return parse_model_config(j, "tiny llama");
}

constexpr int kB = 2, kT = 16;

Batch batch_of(int i, std::int64_t vocab) {
  std::mt19937_64 rng(1000 + std::uint64_t(i));
  std::vector<std::int32_t> seq(kB * kT + 1);
  for (std::size_t k = 0; k < seq.size(); ++k)
    seq[k] = rng() % 5 == 0 ? std::int32_t(rng() % std::uint64_t(vocab))
                            : std::int32_t((k * 7 + std::size_t(i)) % 23);
  Batch b;
  b.tokens.assign(seq.begin(), seq.end() - 1);
  b.targets.assign(seq.begin() + 1, seq.end());
  return b;
}

Placement on(Tier t) {
  Placement p;
  p.device_fraction = t == Tier::kDevice ? 1 : 0;
  p.host_fraction = t == Tier::kHost ? 1 : 0;
  return p;
}

struct Run {
  std::vector<float> losses;  // of the steps this run took
  std::vector<std::vector<float>> master;
};

// Steps [first, last] (1-based) of a run on fresh objects; loads `load_from` first when given
// and saves to `save_to` after the last step when given.
Run run_steps(const ModelConfig& mc, EngineConfig cfg, int first, int last, int accum,
              const std::string& load_from, const std::string& save_to) {
  auto dev = make_host_device();
  CommOptions co;
  co.backend = CommBackend::kLocal;
  auto comm = make_communicator(*dev, co);
  auto s = dev->create_stream("compute");
  cfg.gradient_accumulation_steps = accum;
  cfg.host_budget_bytes = 64 << 20;
  Model model(mc, *dev, *s, {.micro_batch = kB, .seq_len = kT, .compute = cfg.compute_dtype});
  Engine e(*dev, *comm, cfg);
  // A different initialisation than the saving run's: load_state must replace all of it.
  add_model_units(e, model.units(), initial_unit_weights(mc, "", load_from.empty() ? 5 : 99));
  e.finalize();
  if (!load_from.empty()) {
    e.load_state(load_from);
    EXPECT_EQ(e.steps_taken(), first - 1);
  }
  EngineWeights w(e, *s, model.units());
  Run out;
  for (int step = first; step <= last; ++step) {
    float loss = 0;
    for (int a = 0; a < accum; ++a) {
      loss += model.forward(batch_of((step - 1) * accum + a, mc.vocab_size), w) / float(accum);
      model.backward(w);
    }
    out.losses.push_back(loss);
    e.step(1e-2f * float(step) / 10.0f);  // a varying lr: the schedule position matters
  }
  if (!save_to.empty()) e.save_state(save_to);
  for (std::size_t u = 0; u < model.units().size(); ++u)
    out.master.push_back(e.gather_master(int(u)));
  return out;
}

EngineConfig base_config() {
  EngineConfig c = default_engine_config();
  c.adamw.weight_decay = 0.1;
  c.param_persistence_threshold = 0;  // every unit gathered and released
  return c;
}

EngineConfig nvme_config(const std::string& dir) {
  EngineConfig c = base_config();
  c.params = c.optimizer = on(Tier::kNvme);
  c.grads = on(Tier::kHost);
  c.param_nvme_paths = c.optimizer_nvme_paths = {dir};
  return c;
}

void expect_resume_matches(const ModelConfig& mc, const EngineConfig& save_cfg,
                           const EngineConfig& load_cfg, int accum, const char* what) {
  SCOPED_TRACE(what);
  TempDir ck;
  // Steps 7-10 of the straight run are taken by the loading config's placement; placements
  // are bit-identical, so either config gives the reference.
  const Run straight = run_steps(mc, load_cfg, 1, 10, accum, "", "");
  const Run first = run_steps(mc, save_cfg, 1, 6, accum, "", ck.path);
  const Run second = run_steps(mc, load_cfg, 7, 10, accum, ck.path, "");
  ASSERT_EQ(second.losses.size(), 4u);
  for (int i = 0; i < 6; ++i)
    EXPECT_EQ(first.losses[std::size_t(i)], straight.losses[std::size_t(i)]) << "step " << i + 1;
  for (int i = 0; i < 4; ++i)
    EXPECT_EQ(second.losses[std::size_t(i)], straight.losses[std::size_t(6 + i)])
        << "step " << 7 + i;
  ASSERT_EQ(second.master.size(), straight.master.size());
  for (std::size_t u = 0; u < straight.master.size(); ++u)
    EXPECT_TRUE(second.master[u] == straight.master[u])
        << "master weights of unit " << u << " differ";
}

TEST(EngineCheckpoint, ResumeEqualsStraightRun) {
  const ModelConfig mc = tiny_llama(true);
  expect_resume_matches(mc, base_config(), base_config(), 1, "device state, fp32");
}

TEST(EngineCheckpoint, ResumeAcrossPlacements) {
  const ModelConfig mc = tiny_llama(false);
  TempDir nv1, nv2;
  expect_resume_matches(mc, nvme_config(nv1.path), base_config(), 1,
                        "saved from NVMe, resumed on the device");
  EngineConfig host = base_config();
  host.params = host.optimizer = host.grads = on(Tier::kHost);
  expect_resume_matches(mc, base_config(), host, 1, "saved from the device, resumed on the host");
  expect_resume_matches(mc, host, nvme_config(nv2.path), 1, "saved from the host, resumed on NVMe");
}

// The checkpoint does not depend on zero_optimization.sub_group_size: state saved a sub-group at
// a time from NVMe resumes whole on the device, and state saved whole resumes into sub-groups.
TEST(EngineCheckpoint, ResumeAcrossSubGroupSizes) {
  const ModelConfig mc = tiny_llama(false);  // the embedding's shard spans 3 sub-groups of 2048
  TempDir nv1, nv2;
  EngineConfig split = nvme_config(nv1.path);
  split.sub_group_size = 2048;
  expect_resume_matches(mc, split, base_config(), 1,
                        "saved from NVMe sub-groups, resumed whole on the device");
  EngineConfig host = base_config();
  host.params = host.optimizer = host.grads = on(Tier::kHost);
  EngineConfig split2 = nvme_config(nv2.path);
  split2.sub_group_size = 4096;
  expect_resume_matches(mc, host, split2, 1,
                        "saved whole from the host, resumed into NVMe sub-groups");
}

TEST(EngineCheckpoint, ResumeBf16WithAccumulationAndResidentUnits) {
  const ModelConfig mc = tiny_llama(true);
  EngineConfig c = default_engine_config();  // default persistence threshold: small units resident
  c.compute_dtype = DType::kBF16;
  TempDir nv;
  EngineConfig n = nvme_config(nv.path);
  n.compute_dtype = DType::kBF16;
  n.param_persistence_threshold = c.param_persistence_threshold;  // the same units resident
  // Same placement on both sides: with resident bf16 units, device-held and NVMe-held state
  // do not give bit-identical runs even without a checkpoint (an engine matter, not one of
  // checkpoints; see the report of issue #8 item 3).
  expect_resume_matches(mc, c, c, 2, "bf16, 2 micro-batches, resident units, device state");
  expect_resume_matches(mc, n, n, 2, "bf16, 2 micro-batches, resident units, NVMe state");
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(EngineCheckpoint, IncompatibleStateIsRefused) {
  TempDir ck;
  run_steps(tiny_llama(false), base_config(), 1, 1, 1, "", ck.path);
  // A different model.
  std::string err =
      error_of([&] { run_steps(tiny_llama(false, 32), base_config(), 2, 2, 1, ck.path, ""); });
  EXPECT_NE(err.find("different model"), std::string::npos) << err;
  // A different world size (rank0.json edited).
  {
    std::ifstream f(ck.path + "/rank0.json");
    nlohmann::json j = nlohmann::json::parse(f);
    j["world_size"] = 2;
    std::ofstream(ck.path + "/rank0.json") << j.dump();
  }
  err = error_of([&] { run_steps(tiny_llama(false), base_config(), 2, 2, 1, ck.path, ""); });
  EXPECT_NE(err.find("rank1.json is missing (the checkpoint's 2 ranks' files are all read to "
                     "reshard them to this run's 1)"),
            std::string::npos)
      << err;
  // No state at all.
  TempDir empty;
  err = error_of([&] { run_steps(tiny_llama(false), base_config(), 2, 2, 1, empty.path, ""); });
  EXPECT_NE(err.find("rank0.json is missing"), std::string::npos) << err;
}

// A node-local checkpoint's folder holds its own node's ranks' files and the manifest of all:
// it verifies with those alone (checkpoint_rank_missing names the node of the others), not with one
// of them missing nor with none of its ranks' files; a manifest of one shared folder needs all.
TEST(CheckpointManifest, ANodeLocalFolderVerifiesWithItsOwnRanksFiles) {
  TempDir d;
  const std::string step = d.path + "/step-4";
  fs::create_directories(step);
  const auto entry = [&](const std::string& name, const std::string& content,
                         const std::string& node, int folder) {
    std::ofstream(step + "/" + name) << content;
    return nlohmann::json{
        {"name", name},
        {"bytes", content.size()},
        {"xxh3", fmt::format("{:016x}", XXH3_64bits(content.data(), content.size()))},
        {"node", node},
        {"folder_of_rank", folder}};
  };
  const auto write = [&](bool node_local) {
    nlohmann::json m = {{"format", "strata-checkpoint"},
                        {"version", node_local ? 3 : 2},
                        {"step", 4},
                        {"world_size", 2},
                        {"node_local", node_local}};
    m["files"] = {entry("rank0.bin", "abc", "host-a", 0), entry("rank0.json", "{}", "host-a", 0),
                  entry("rank1.bin", "xyz", "host-b", 1), entry("rank1.json", "{ }", "host-b", 1)};
    m["manifest_xxh3"] = manifest_checksum(m);
    std::ofstream(step + "/manifest.json") << m.dump();
    return m;
  };
  nlohmann::json m = write(true);
  EXPECT_EQ(verify_checkpoint(step), "");  // every node's files side by side
  fs::remove(step + "/rank1.bin");
  fs::remove(step + "/rank1.json");
  EXPECT_EQ(verify_checkpoint(step), "");  // node a's folder
  EXPECT_EQ(checkpoint_rank_missing(step, m, 0), "");
  EXPECT_NE(checkpoint_rank_missing(step, m, 1)
                .find("rank 1's engine state (rank1.bin) is not in " + step + " on this node (" +
                      testing::host_name() +
                      "): the checkpoint is node-local, and node host-b wrote rank 1's files"),
            std::string::npos)
      << checkpoint_rank_missing(step, m, 1);
  fs::remove(step + "/rank0.json");
  EXPECT_EQ(verify_checkpoint(step),
            "rank0.json is missing (written on node host-a with 1 file(s) that are here)");
  fs::remove(step + "/rank0.bin");
  EXPECT_EQ(verify_checkpoint(step),
            "a node-local checkpoint with none of its ranks' files in this folder (they are on the "
            "nodes its manifest names)");
  // One shared folder: rank 1's files are needed there.
  m = write(false);
  fs::remove(step + "/rank1.bin");
  EXPECT_EQ(verify_checkpoint(step), "rank1.bin is missing");
  EXPECT_EQ(checkpoint_rank_missing(step, m, 1),
            "rank 1's engine state (rank1.bin) is not in " + step + " on this node (" +
                testing::host_name() + ") (node host-b wrote it)");
}

// A manifest nesting a value 100k deep (a damaged file) is a damaged checkpoint, skipped by
// --resume with the others: hashing it (a dump) overflowed the stack.
TEST(CheckpointManifest, ADeeplyNestedManifestIsDamaged) {
  TempDir d;
  const std::string step = d.path + "/step-4";
  fs::create_directories(step);
  std::ofstream(step + "/manifest.json")
      << R"({"format": "strata-checkpoint", "version": 2, "step": 4, "x": )" +
             std::string(100000, '[') + std::string(100000, ']') + "}";
  EXPECT_EQ(verify_checkpoint(step),
            "manifest.json nests arrays and objects more than 512 deep (damaged)");
}

// ---- the strata-train binary ----

struct Proc {
  pid_t pid = -1;
  std::string out, err;  // files with its stdout / stderr
};

Proc spawn(const std::vector<std::string>& args, const std::string& dir, const std::string& tag,
           const std::vector<std::pair<std::string, std::string>>& env = {}) {
  Proc p;
  p.out = dir + "/" + tag + ".stdout";
  p.err = dir + "/" + tag + ".stderr";
  p.pid = ::fork();
  if (p.pid == 0) {
    const rlimit no_core{0, 0};
    ::setrlimit(RLIMIT_CORE, &no_core);  // the abort() hook must not leave core files
    for (const auto& [k, v] : env) ::setenv(k.c_str(), v.c_str(), 1);
    // The signals a test sends arrive as in a shell's foreground job, whatever ctest inherited
    // (a script's background job starts with SIGINT ignored).
    ::signal(SIGINT, SIG_DFL);
    ::signal(SIGTERM, SIG_DFL);
    ::signal(SIGHUP, SIG_DFL);  // ignored under nohup
    sigset_t none;
    sigemptyset(&none);
    ::sigprocmask(SIG_SETMASK, &none, nullptr);
    const int o = ::open(p.out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    const int e = ::open(p.err.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    ::dup2(o, 1);
    ::dup2(e, 2);
    std::vector<char*> argv;
    std::string bin = STRATA_TRAIN_BIN;
    argv.push_back(bin.data());
    std::vector<std::string> copy = args;
    for (auto& a : copy) argv.push_back(a.data());
    argv.push_back(nullptr);
    ::execv(bin.c_str(), argv.data());
    ::_exit(127);
  }
  return p;
}

int wait_status(pid_t pid) {
  int st = 0;
  ::waitpid(pid, &st, 0);
  return st;
}

using testing::slurp;

// Flips the bits `mask` of the byte at `at` of a file: damage done to a checkpoint after the fact.
void flip_bits(const std::string& path, std::streamoff at, char mask) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  char c = 0;
  f.seekg(at);
  f.read(&c, 1);
  c = char(c ^ mask);
  f.seekp(at);
  f.write(&c, 1);
  ASSERT_TRUE(f.good()) << path;
}

// step -> the log line's JSON, for the complete lines of a --log-json file.
std::map<std::int64_t, nlohmann::json> read_log(const std::string& path) {
  std::map<std::int64_t, nlohmann::json> out;
  std::ifstream f(path);
  std::string line;
  while (std::getline(f, line)) {
    try {
      const auto j = nlohmann::json::parse(line);
      out[j.at("step").get<std::int64_t>()] = j;
    } catch (const std::exception&) {
    }
  }
  return out;
}

class TrainBinary : public ::testing::Test {
 protected:
  void SetUp() override {
    cfg = dir.path + "/model.json";
    std::ofstream(cfg) << R"({"model_type": "llama", "vocab_size": 256, "hidden_size": 64,
      "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
      "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "tie_word_embeddings": false})";
    text = dir.path + "/corpus.txt";
    std::ofstream t(text);
    std::mt19937_64 rng(3);
    const char* words[] = {"alpha ", "beta ", "gamma ", "delta. ", "epsilon\n"};
    for (int i = 0; i < 4000; ++i) t << words[rng() % 5];
  }
  std::vector<std::string> args(const std::string& log, std::vector<std::string> extra = {}) const {
    std::vector<std::string> a = {
        "--model-config", cfg,      "--text",   text,  "--seq-len",  "16",   "--micro-batch", "2",
        "--grad-accum",   "2",      "--steps",  "10",  "--lr",       "1e-2", "--warmup",      "2",
        "--lr-schedule",  schedule, "--device", "cpu", "--log-json", log};
    a.insert(a.end(), extra.begin(), extra.end());
    return a;
  }
  // `a` (from args) with --steps `steps` instead of 10.
  static void set_steps(std::vector<std::string>& a, const std::string& steps) {
    a[std::size_t(std::find(a.begin(), a.end(), "--steps") - a.begin()) + 1] = steps;
  }
  // The straight 10-step run's log (computed once per test).
  std::map<std::int64_t, nlohmann::json> straight() {
    const std::string log = dir.path + "/straight.jsonl";
    const Proc p = spawn(args(log), dir.path, "straight");
    const int st = wait_status(p.pid);
    EXPECT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0) << slurp(p.err);
    auto l = read_log(log);
    EXPECT_EQ(l.size(), 10u);
    return l;
  }
  static void expect_same_steps(const std::map<std::int64_t, nlohmann::json>& got,
                                const std::map<std::int64_t, nlohmann::json>& ref,
                                std::int64_t from) {
    for (std::int64_t s = from; s <= 10; ++s) {
      ASSERT_TRUE(got.count(s)) << "step " << s << " missing from the resumed log";
      // Bitwise: the doubles as logged (nlohmann writes the shortest round-trip form).
      EXPECT_EQ(got.at(s)["loss"].get<double>(), ref.at(s)["loss"].get<double>())
          << "loss of step " << s;
      EXPECT_EQ(got.at(s)["grad_norm"].get<double>(), ref.at(s)["grad_norm"].get<double>())
          << "grad_norm of step " << s;
      EXPECT_EQ(got.at(s)["lr"].get<double>(), ref.at(s)["lr"].get<double>()) << "lr of step " << s;
    }
  }
  // Two steps, checkpointed at step 2 under `ck`.
  void two_steps_saved_in(const std::string& ck) {
    auto a = args(dir.path + "/a.jsonl", {"--save-every", "2", "--checkpoint-dir", ck});
    set_steps(a, "2");
    Proc p = spawn(a, dir.path, "first");
    const int st = wait_status(p.pid);
    ASSERT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0) << slurp(p.err);
  }
  TempDir dir;
  std::string cfg, text;
  std::string schedule = "cosine";
};

TEST_F(TrainBinary, SigkillAfterStep6ThenResumeEqualsStraightRun) {
  // A constant schedule (after warmup) does not depend on --steps, so the run to be killed
  // can be given 1000 steps: the kill always lands, however slow the watcher is.
  schedule = "const";
  const auto ref = straight();
  const std::string ck = dir.path + "/ck", log = dir.path + "/run.jsonl";
  auto long_run = args(log, {"--save-every", "1", "--checkpoint-dir", ck});
  long_run[std::size_t(std::find(long_run.begin(), long_run.end(), "--steps") - long_run.begin()) +
           1] = "1000";
  Proc p = spawn(long_run, dir.path, "killed");
  bool seen = false;
  for (int i = 0; i < 60000 && !seen; ++i) {  // up to 60 s
    seen = read_log(log).count(6) > 0;
    if (!seen) std::this_thread::sleep_for(1ms);
  }
  ::kill(p.pid, SIGKILL);
  const int st = wait_status(p.pid);
  ASSERT_TRUE(seen) << "step 6 never logged: " << slurp(p.err);
  ASSERT_TRUE(WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL)
      << "the run ended before the kill: " << slurp(p.err);
  ASSERT_TRUE(fs::exists(ck + "/step-6/manifest.json")) << "a logged step's checkpoint is complete";
  const auto killed_log = read_log(log);
  const std::int64_t last_logged = killed_log.rbegin()->first;  // 6, or later if the kill was slow
  ASSERT_LE(last_logged, 9) << "the kill came too late to leave steps to resume";

  // Resume into the same log: it keeps steps up to the checkpoint and continues.
  Proc r = spawn(args(log, {"--save-every", "1", "--resume", ck}), dir.path, "resumed");
  const int rs = wait_status(r.pid);
  ASSERT_TRUE(WIFEXITED(rs) && WEXITSTATUS(rs) == 0) << slurp(r.err);
  const std::string out = slurp(r.out);
  EXPECT_NE(out.find("resumed from"), std::string::npos) << out;
  // The newest complete checkpoint: the last logged step's or (killed mid-write) the next.
  const std::size_t at = out.find("(step ");
  ASSERT_NE(at, std::string::npos) << out;
  const std::int64_t resumed = std::stoll(out.substr(at + 6));
  EXPECT_GE(resumed, last_logged);
  EXPECT_LE(resumed, last_logged + 1);
  if (resumed == 6) std::printf("resumed at step 6: steps 7-10 compared\n");
  const auto got = read_log(log);
  EXPECT_EQ(got.size(), 10u);
  expect_same_steps(got, ref, 1);
  EXPECT_TRUE(fs::exists(ck + "/step-10/manifest.json"));
}

// Ctrl-C (SIGINT), a scheduler's SIGTERM or a closed terminal's SIGHUP: the run ends by the
// signal as before, and its swap files go with it (they stayed until the next run in that folder:
// for a big model, most of the drive).
TEST_F(TrainBinary, AnInterruptedRunLeavesNoSwapFiles) {
  for (const int sig : {SIGINT, SIGTERM, SIGHUP}) {
    SCOPED_TRACE(sig);
    const std::string nv = dir.path + "/nv" + std::to_string(sig), log = dir.path + "/int.jsonl";
    fs::remove(log);
    Proc p =
        spawn({"--steps", "1000", "--demo-nvme", nv, "--log-json", log}, dir.path, "interrupted");
    const std::string stripe = nv + "/strata-swap/rank0/stripe.bin";
    bool running = false;
    for (int i = 0; i < 60000 && !running; ++i) {  // up to 60 s: the first step logged
      running = fs::exists(stripe) && read_log(log).count(1) > 0;
      if (!running) std::this_thread::sleep_for(1ms);
    }
    ::kill(p.pid, sig);
    const int st = wait_status(p.pid);
    ASSERT_TRUE(running) << slurp(p.err);
    EXPECT_TRUE(WIFSIGNALED(st) && WTERMSIG(st) == sig) << "status " << st << "\n" << slurp(p.err);
    EXPECT_FALSE(fs::exists(stripe)) << "the swap file stayed";
    // Nor the folders and lock file around it, as after a clean exit (the next run said it was
    // "removing swap files of a previous run" where there were none).
    EXPECT_FALSE(fs::exists(nv + "/strata-swap")) << "strata-swap/ stayed";
    // And it says so, and whether it can go on (it stopped without a word).
    EXPECT_NE(slurp(p.err).find(
                  "strata-train: interrupted; no checkpoints were written (--save-every N keeps a "
                  "run's progress)"),
              std::string::npos)
        << slurp(p.err);
  }
  // With checkpoints: where to continue from.
  const std::string ck = dir.path + "/ck", log = dir.path + "/ck.jsonl";
  auto a = args(log, {"--save-every", "1", "--checkpoint-dir", ck});
  set_steps(a, "1000");  // the kill always lands
  Proc p = spawn(a, dir.path, "saving");
  bool saved = false;
  for (int i = 0; i < 60000 && !saved; ++i) {  // up to 60 s: step 2 logged (after its checkpoint)
    saved = read_log(log).count(2) > 0;
    if (!saved) std::this_thread::sleep_for(1ms);
  }
  ::kill(p.pid, SIGINT);
  wait_status(p.pid);
  ASSERT_TRUE(saved) << slurp(p.err);
  EXPECT_NE(
      slurp(p.err).find("strata-train: interrupted; the newest checkpoint is " + ck + "/step-"),
      std::string::npos)
      << slurp(p.err);
  EXPECT_NE(slurp(p.err).find("continue with the same command and --resume " + ck),
            std::string::npos)
      << slurp(p.err);
}

// One flipped bit in a checkpoint's manifest.json (its data position: train_batches) is caught by
// the manifest's own checksum: the checkpoint is skipped with a warning like any damaged one, and
// the run resumes from the one before, bit for bit the straight run (the flip resumed silently at
// a shifted data position).
TEST_F(TrainBinary, AManifestChangedAfterItWasWrittenIsSkipped) {
  schedule = "const";  // --steps does not shape the lr: the 4-step run is the straight run's start
  const auto ref = straight();
  const std::string ck = dir.path + "/ck", log = dir.path + "/run.jsonl";
  auto a = args(log, {"--save-every", "1", "--checkpoint-dir", ck});
  set_steps(a, "4");
  Proc p = spawn(a, dir.path, "first");
  const int st = wait_status(p.pid);
  ASSERT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0) << slurp(p.err);
  {
    const std::string m = ck + "/step-4/manifest.json";
    std::string text = slurp(m);
    const std::size_t at = text.find("\"train_batches\": ");
    ASSERT_NE(at, std::string::npos) << text;
    char& digit = text[at + 17];
    digit = char(digit ^ 1);  // 8 -> 9: one bit
    std::ofstream(m, std::ios::trunc) << text;
  }
  Proc r = spawn(args(log, {"--save-every", "1", "--resume", ck}), dir.path, "resumed");
  const int rs = wait_status(r.pid);
  ASSERT_TRUE(WIFEXITED(rs) && WEXITSTATUS(rs) == 0) << slurp(r.err);
  EXPECT_NE(slurp(r.err).find("skipping " + ck + "/step-4: manifest.json has checksum"),
            std::string::npos)
      << slurp(r.err);
  EXPECT_NE(slurp(r.out).find("step-3 (step 3)"), std::string::npos) << slurp(r.out);
  const auto got = read_log(log);
  EXPECT_EQ(got.size(), 10u);
  expect_same_steps(got, ref, 1);
}

// A run that dies after a checkpoint is in place and before the step's --log-json line (the hook
// aborts there: the line used to come after the pruning of old checkpoints, ~0.1 s here) leaves
// no hole in the log: the resume writes that line from the checkpoint. And --keep-checkpoints
// counts the checkpoints the resumed run inherits: exactly K are left (the inherited ones stayed
// for ever, 6 folders of K = 3 after kills and resumes). A damaged newest checkpoint then stops
// strata-export (it exported an older step with exit 0) unless --accept-older.
TEST_F(TrainBinary, ADeathBetweenACheckpointAndItsLogLineLeavesNoHoleAndKeepsK) {
  schedule = "const";
  const auto ref = straight();
  const std::string ck = dir.path + "/ck", log = dir.path + "/run.jsonl";
  Proc p =
      spawn(args(log, {"--save-every", "1", "--keep-checkpoints", "3", "--checkpoint-dir", ck}),
            dir.path, "died", {{"STRATA_TEST_CRASH_AFTER_CHECKPOINT", "6"}});
  const int st = wait_status(p.pid);
  ASSERT_TRUE(WIFSIGNALED(st) && WTERMSIG(st) == SIGABRT) << slurp(p.err);
  ASSERT_TRUE(fs::exists(ck + "/step-6/manifest.json"));
  EXPECT_EQ(read_log(log).count(6), 0u) << "the hook stops the run before step 6's line";
  EXPECT_EQ(read_log(log).size(), 5u);

  Proc r = spawn(args(log, {"--save-every", "1", "--keep-checkpoints", "3", "--resume", ck}),
                 dir.path, "resumed");
  const int rs = wait_status(r.pid);
  ASSERT_TRUE(WIFEXITED(rs) && WEXITSTATUS(rs) == 0) << slurp(r.err);
  EXPECT_NE(slurp(r.out).find("step-6 (step 6)"), std::string::npos) << slurp(r.out);
  const auto got = read_log(log);
  EXPECT_EQ(got.size(), 10u);
  expect_same_steps(got, ref, 1);  // step 6's line, from the checkpoint, included
  std::vector<std::string> left;
  for (const auto& e : fs::directory_iterator(ck)) left.push_back(e.path().filename().string());
  std::sort(left.begin(), left.end());
  EXPECT_EQ(left, (std::vector<std::string>{"step-10", "step-8", "step-9"}));

  // strata-export: the newest damaged (a byte of its rank file flipped).
  flip_bits(ck + "/step-10/rank0.bin", 64, 0x10);
  const auto e1 = testing::run(STRATA_EXPORT_BIN, {ck, dir.path + "/out1"}, dir.path, "export1");
  EXPECT_EQ(e1.status, 1) << e1.out << e1.err;
  EXPECT_NE(e1.err.find("the newest checkpoint does not verify (" + ck +
                        "/step-10: rank0.bin has checksum"),
            std::string::npos)
      << e1.err;
  EXPECT_NE(e1.err.find("pass --accept-older to export that one"), std::string::npos) << e1.err;
  EXPECT_FALSE(fs::exists(dir.path + "/out1/model.safetensors"));
  const auto e2 = testing::run(STRATA_EXPORT_BIN, {ck, dir.path + "/out2", "--accept-older"},
                               dir.path, "export2");
  EXPECT_EQ(e2.status, 0) << e2.out << e2.err;
  EXPECT_TRUE(fs::exists(dir.path + "/out2/config.json")) << e2.out << e2.err;
}

// Swap folders a dead run left beyond this job's ranks (a rank killed with SIGKILL keeps its
// files; a later run with fewer ranks never removed them and was refused for space without naming
// them) are removed by the next run's rank 0, which says so. Only dead ones: a folder whose lock a
// live process holds, or whose owner is alive, stays.
TEST_F(TrainBinary, ADeadRanksSwapFolderIsReclaimedByTheNextRun) {
  const std::string nv = dir.path + "/nv", top = nv + "/strata-swap";
  fs::create_directories(top + "/rank1");
  fs::create_directories(top + "/rank2");
  fs::create_directories(top + "/rank3");
  const pid_t gone = ::fork();  // a pid that existed and is gone
  if (gone == 0) ::_exit(0);
  wait_status(gone);
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  for (int r = 1; r <= 3; ++r) {
    std::ofstream(top + "/rank" + std::to_string(r) + "/stripe.bin") << std::string(1 << 20, 'x');
    // rank 1: dead; rank 2: dead but its lock held (by this process); rank 3: its owner alive.
    std::ofstream(top + "/rank" + std::to_string(r) + ".lock")
        << host << " " << (r == 3 ? long(::getpid()) : long(gone)) << "\n";
  }
  const int held = ::open((top + "/rank2.lock").c_str(), O_RDWR);
  ASSERT_GE(held, 0);
  ASSERT_EQ(::flock(held, LOCK_EX | LOCK_NB), 0);
  Proc p = spawn({"--steps", "1", "--demo-nvme", nv}, dir.path, "next");
  const int st = wait_status(p.pid);
  ::close(held);
  ASSERT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0) << slurp(p.err);
  EXPECT_NE(
      slurp(p.err).find("of swap files in '" + top + "/rank1': rank 1 of a run that died (pid " +
                        std::to_string(gone) + ") left them"),
      std::string::npos)
      << slurp(p.err);
  EXPECT_FALSE(fs::exists(top + "/rank1")) << "the dead rank's folder stayed";
  EXPECT_FALSE(fs::exists(top + "/rank1.lock"));
  EXPECT_TRUE(fs::exists(top + "/rank2/stripe.bin")) << "a folder whose lock is held was removed";
  EXPECT_TRUE(fs::exists(top + "/rank3/stripe.bin")) << "a live owner's folder was removed";
}

TEST_F(TrainBinary, CrashInsideACheckpointWriteIsNeverChosen) {
  const auto ref = straight();
  const std::string ck = dir.path + "/ck", log = dir.path + "/run.jsonl";
  Proc p = spawn(args(log, {"--save-every", "1", "--checkpoint-dir", ck}), dir.path, "crashed",
                 {{"STRATA_TEST_CRASH_IN_CHECKPOINT", "6"}});
  const int st = wait_status(p.pid);
  ASSERT_TRUE(WIFSIGNALED(st) && WTERMSIG(st) == SIGABRT) << slurp(p.err);
  EXPECT_TRUE(fs::exists(ck + "/step-5/manifest.json"));
  EXPECT_FALSE(fs::exists(ck + "/step-6"));
  bool partial = false;
  for (const auto& e : fs::directory_iterator(ck))
    partial = partial || e.path().filename().string().rfind("step-6.tmp-", 0) == 0;
  EXPECT_TRUE(partial) << "the interrupted checkpoint's temporary folder is left behind";
  EXPECT_EQ(read_log(log).count(6), 0u) << "step 6 is logged only after its checkpoint";

  // Also damage step-5 after the fact: one flipped byte fails its checksum.
  flip_bits(ck + "/step-5/rank0.bin", 100, 0x40);
  const std::string log2 = dir.path + "/resumed.jsonl";
  Proc r = spawn(args(log2, {"--save-every", "1", "--resume", ck}), dir.path, "resumed");
  const int rs = wait_status(r.pid);
  ASSERT_TRUE(WIFEXITED(rs) && WEXITSTATUS(rs) == 0) << slurp(r.err);
  const std::string err = slurp(r.err), out = slurp(r.out);
  EXPECT_NE(err.find("step-6.tmp-"), std::string::npos)
      << "the skipped partial folder is warned about: " << err;
  EXPECT_NE(err.find("checksum"), std::string::npos)
      << "the damaged step-5 is warned about: " << err;
  EXPECT_NE(out.find("step-4 (step 4)"), std::string::npos) << out;
  const auto got = read_log(log2);
  EXPECT_EQ(got.size(), 6u) << "steps 5-10";
  expect_same_steps(got, ref, 5);
}

// Resuming "P/step-2/" (a trailing slash) saves beside it in P, not inside it; a save removes
// the half-written folder of a run that died (its process gone); --eval-every changing on resume
// (it takes 10% of the data for validation, so the train split moves) is said aloud.
TEST_F(TrainBinary, ResumeFromAPathWithASlashSavesBesideItAndCleansDeadRunsLeftovers) {
  const std::string ck = dir.path + "/ck";
  ASSERT_NO_FATAL_FAILURE(two_steps_saved_in(ck));
  // Folders runs left, each with its owner "<host> <pid>": a dead process on this host (beyond
  // pid_max) is removed; a live one (pid 1) and one from another host are left alone.
  char host[256] = {};
  ASSERT_EQ(::gethostname(host, sizeof host - 1), 0);
  const auto left = [&](const std::string& name, const std::string& owner) {
    fs::create_directories(ck + "/" + name);
    std::ofstream(ck + "/" + name + "/.owner") << owner << "\n";
  };
  left("step-3.tmp-2147483646", std::string(host) + " 2147483646");
  left("step-3.tmp-1", std::string(host) + " 1");
  left("step-3.tmp-77", "another-host-" + std::string(host) + " 2147483646");
  auto a = args(dir.path + "/b.jsonl",
                {"--save-every", "2", "--resume", ck + "/step-2/", "--eval-every", "100"});
  set_steps(a, "4");
  Proc p = spawn(a, dir.path, "resumed");
  const int st = wait_status(p.pid);
  ASSERT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0) << slurp(p.err);
  EXPECT_TRUE(fs::exists(ck + "/step-4/manifest.json")) << "saved beside step-2";
  EXPECT_FALSE(fs::exists(ck + "/step-2/step-4")) << "saved inside the resumed checkpoint";
  EXPECT_FALSE(fs::exists(ck + "/step-3.tmp-2147483646"));
  EXPECT_TRUE(fs::exists(ck + "/step-3.tmp-1"));
  EXPECT_TRUE(fs::exists(ck + "/step-3.tmp-77"));
  EXPECT_FALSE(fs::exists(ck + "/step-4/.owner")) << "the owner file went into the checkpoint";
  EXPECT_NE(slurp(p.err).find("val_fraction was 0.0 in the checkpoint's run, 0.1 now"),
            std::string::npos)
      << slurp(p.err);
}

TEST_F(TrainBinary, IncompatibleResumeIsAClearError) {
  const std::string ck = dir.path + "/ck";
  ASSERT_NO_FATAL_FAILURE(two_steps_saved_in(ck));
  ASSERT_TRUE(fs::exists(ck + "/step-2/manifest.json"));
  // A different model.
  const std::string other = dir.path + "/other.json";
  std::ofstream(other) << R"({"model_type": "llama", "vocab_size": 256, "hidden_size": 32,
      "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
      "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "tie_word_embeddings": false})";
  auto a = args(dir.path + "/b.jsonl", {"--resume", ck});
  a[1] = other;
  Proc p = spawn(a, dir.path, "other-model");
  int st = wait_status(p.pid);
  EXPECT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 1);
  EXPECT_NE(slurp(p.err).find("different model"), std::string::npos) << slurp(p.err);
  // Each side described as itself: the checkpoint's model first, then this run's (hidden 32).
  EXPECT_NE(slurp(p.err).find("this run's: llama 32x64 2 layers, vocab 256"), std::string::npos)
      << slurp(p.err);
  // A manifest at odds with its files: it says 2 ranks (its own checksum made again), and lists
  // one rank's engine state.
  {
    std::ifstream f(ck + "/step-2/manifest.json");
    nlohmann::json m = nlohmann::json::parse(f);
    m["world_size"] = 2;
    m["manifest_xxh3"] = manifest_checksum(m);
    std::ofstream(ck + "/step-2/manifest.json") << m.dump(1);
  }
  p = spawn(args(dir.path + "/c.jsonl", {"--resume", ck}), dir.path, "world");
  st = wait_status(p.pid);
  EXPECT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 1);
  EXPECT_NE(slurp(p.err).find("the manifest says 2 rank(s) but lists the engine state of 1: a "
                              "damaged checkpoint"),
            std::string::npos)
      << slurp(p.err);
  // Nothing to resume from.
  fs::create_directories(dir.path + "/empty");
  p = spawn(args(dir.path + "/d.jsonl", {"--resume", dir.path + "/empty"}), dir.path, "empty");
  st = wait_status(p.pid);
  EXPECT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 1);
  EXPECT_NE(slurp(p.err).find("--resume " + dir.path +
                              "/empty: no checkpoint there yet (no step-<N> folder in " + dir.path +
                              "/empty); to start the run from the beginning, drop --resume"),
            std::string::npos)
      << slurp(p.err);
}

// A fresh run saving into a folder that holds another run's checkpoints is refused before step 1:
// its step-2 replaced theirs (even another model's) and a later --resume took whichever was
// newest. Resuming from that folder continues there.
TEST_F(TrainBinary, AFreshRunDoesNotReplaceAnotherRunsCheckpoints) {
  const std::string ck = dir.path + "/ck";
  ASSERT_NO_FATAL_FAILURE(two_steps_saved_in(ck));
  const std::string before = slurp(ck + "/step-2/manifest.json");
  auto a = args(dir.path + "/b.jsonl", {"--save-every", "2", "--checkpoint-dir", ck});
  set_steps(a, "2");
  Proc p = spawn(a, dir.path, "fresh");
  int st = wait_status(p.pid);
  EXPECT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 1) << slurp(p.out);
  EXPECT_NE(slurp(p.err).find("--checkpoint-dir " + ck +
                              " already holds checkpoints of another run (newest: step-2), "
                              "which this run's would replace: continue that run with --resume " +
                              ck),
            std::string::npos)
      << slurp(p.err);
  EXPECT_FALSE(fs::exists(dir.path + "/b.jsonl")) << "it trained";
  EXPECT_EQ(slurp(ck + "/step-2/manifest.json"), before);
  // Continuing that run saves beside its checkpoints, also from a link to one of them (it was
  // taken for another run's).
  fs::create_directory_symlink(ck + "/step-2", dir.path + "/latest");
  a = args(dir.path + "/c.jsonl",
           {"--save-every", "2", "--checkpoint-dir", ck, "--resume", dir.path + "/latest"});
  set_steps(a, "4");
  p = spawn(a, dir.path, "continue");
  st = wait_status(p.pid);
  EXPECT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0) << slurp(p.err);
  EXPECT_TRUE(fs::exists(ck + "/step-4/manifest.json"));
  // Its summary counts the steps it ran ("4 steps" for steps 3-4).
  EXPECT_NE(slurp(p.out).find("summary (steps 3-4 of 4, resumed,"), std::string::npos)
      << slurp(p.out);
  // Without --checkpoint-dir a resume through that link saves where the checkpoint is, not beside
  // the link (step-6 went into the link's folder, where the next resume of ck did not look).
  fs::remove(dir.path + "/latest");
  fs::create_directory_symlink(ck + "/step-4", dir.path + "/latest");
  a = args(dir.path + "/d.jsonl", {"--save-every", "2", "--resume", dir.path + "/latest"});
  set_steps(a, "6");
  p = spawn(a, dir.path, "through-link");
  st = wait_status(p.pid);
  EXPECT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0) << slurp(p.err);
  EXPECT_TRUE(fs::exists(ck + "/step-6/manifest.json"));
  EXPECT_FALSE(fs::exists(dir.path + "/step-6")) << "saved beside the link";
  EXPECT_NE(slurp(p.out).find("checkpoints in " + ck + " (newest: " + ck + "/step-6)"),
            std::string::npos)
      << slurp(p.out);
  // A folder of checkpoints whose step-<N> links into another folder: resuming the folder saves in
  // it, where its next resume looks (it saved beside the link's target, and the next resume of
  // the folder took the old step again).
  const std::string mine = dir.path + "/mine";
  fs::create_directories(mine);
  fs::create_directory_symlink(ck + "/step-6", mine + "/step-6");
  a = args(dir.path + "/e.jsonl", {"--save-every", "1", "--resume", mine});
  set_steps(a, "7");
  p = spawn(a, dir.path, "folder-of-links");
  st = wait_status(p.pid);
  EXPECT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0) << slurp(p.err);
  EXPECT_TRUE(fs::exists(mine + "/step-7/manifest.json"));
  EXPECT_FALSE(fs::exists(ck + "/step-7")) << "saved beside the link's target";
  // A step-<N> link that loops is skipped with the others that do not verify (a raw
  // "filesystem error: status: Too many levels of symbolic links" ended the resume).
  fs::create_directory_symlink("step-9", mine + "/step-9");
  a = args(dir.path + "/f.jsonl", {"--resume", mine});
  set_steps(a, "8");
  p = spawn(a, dir.path, "looping-link");
  st = wait_status(p.pid);
  EXPECT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0) << slurp(p.err);
  EXPECT_NE(slurp(p.err).find("--resume: skipping " + mine +
                              "/step-9: Too many levels of symbolic "
                              "links"),
            std::string::npos)
      << slurp(p.err);
}

// A run killed while writing --out after its last checkpoint (a temporary file of the save left
// in --out) is finished by the same command with --resume: no step is left, the model is
// written from the checkpoint (it was refused twice: "--out exists", then "--steps is not
// beyond" the checkpoint), and so is one killed just after (the model's files there: refused as
// "--out exists"). Without --out the refusal names strata-export.
TEST_F(TrainBinary, AResumeAtTheLastStepWithOutWritesTheModel) {
  const std::string ck = dir.path + "/ck", out = dir.path + "/out";
  ASSERT_NO_FATAL_FAILURE(two_steps_saved_in(ck));
  fs::create_directories(out);
  std::ofstream(out + "/.strata-tmp-model.safetensors") << "half a file";
  auto a = args(dir.path + "/b.jsonl", {"--resume", ck, "--out", out});
  set_steps(a, "2");
  Proc p = spawn(a, dir.path, "finish");
  int st = wait_status(p.pid);
  ASSERT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0) << slurp(p.err);
  EXPECT_TRUE(fs::exists(out + "/model.safetensors"));
  EXPECT_FALSE(fs::exists(out + "/.strata-tmp-model.safetensors"));
  EXPECT_TRUE(read_log(dir.path + "/b.jsonl").empty()) << "a step ran";
  // Killed once the model was written (its files all there: the interrupt came after them, as
  // it said): the same command finishes again. Only a run whose checkpoint records that --out
  // takes its model files back: not the run of `ck` (it had none), nor with a file of the user's
  // beside them.
  const std::string ck2 = dir.path + "/ck2", out2 = dir.path + "/out2";
  a = args(dir.path + "/d.jsonl", {"--save-every", "2", "--checkpoint-dir", ck2, "--out", out2});
  set_steps(a, "2");
  p = spawn(a, dir.path, "with-out");
  st = wait_status(p.pid);
  ASSERT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0) << slurp(p.err);
  const std::string model = slurp(out2 + "/model.safetensors");
  std::ofstream(out2 + "/model.safetensors") << "an older save";
  a = args(dir.path + "/e.jsonl", {"--resume", ck2, "--out", out2});
  set_steps(a, "2");
  p = spawn(a, dir.path, "again");
  st = wait_status(p.pid);
  ASSERT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0) << slurp(p.err);
  EXPECT_EQ(slurp(out2 + "/model.safetensors"), model);
  auto other = args(dir.path + "/f.jsonl", {"--resume", ck, "--out", out2});
  set_steps(other, "2");
  p = spawn(other, dir.path, "not-its-own");
  st = wait_status(p.pid);
  EXPECT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 1);
  EXPECT_NE(slurp(p.err).find("did not write its model there"), std::string::npos) << slurp(p.err);
  // A checkpoint of an older strata, which recorded no --out: said as such.
  const std::string ck3 = dir.path + "/ck3";
  fs::copy(ck2, ck3, fs::copy_options::recursive);
  {
    std::ifstream f(ck3 + "/step-2/manifest.json");
    nlohmann::json m = nlohmann::json::parse(f);
    ASSERT_TRUE(m["trainer"].contains("out_dir"));
    m["trainer"].erase("out_dir");
    m["manifest_xxh3"] = manifest_checksum(m);
    std::ofstream(ck3 + "/step-2/manifest.json") << m.dump(1);
  }
  auto older = args(dir.path + "/g.jsonl", {"--resume", ck3, "--out", out2});
  set_steps(older, "2");
  p = spawn(older, dir.path, "older");
  st = wait_status(p.pid);
  EXPECT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 1);
  EXPECT_NE(slurp(p.err).find("is of an older strata, which does not record its run's --out"),
            std::string::npos)
      << slurp(p.err);
  std::ofstream(out2 + "/notes.txt") << "mine";
  p = spawn(a, dir.path, "taken");
  st = wait_status(p.pid);
  EXPECT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 1);
  EXPECT_NE(slurp(p.err).find("exists: pass --overwrite"), std::string::npos) << slurp(p.err);
  // Without --out: refused, naming the way to the model.
  a = args(dir.path + "/c.jsonl", {"--resume", ck});
  set_steps(a, "2");
  p = spawn(a, dir.path, "no-out");
  st = wait_status(p.pid);
  EXPECT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 1);
  EXPECT_NE(slurp(p.err).find("or write its model with strata-export"), std::string::npos)
      << slurp(p.err);
}

// Settings that shape the steps after a checkpoint and that the run does not take from it
// (weight decay, betas, eps, clipping, the compute dtype) are recorded, and a resume that
// changes one says so (it continued silently).
TEST_F(TrainBinary, AResumeWithAnotherWeightDecayWarns) {
  const std::string ck = dir.path + "/ck";
  ASSERT_NO_FATAL_FAILURE(two_steps_saved_in(ck));
  auto a = args(dir.path + "/b.jsonl", {"--resume", ck, "--weight-decay", "0.1"});
  set_steps(a, "3");
  Proc p = spawn(a, dir.path, "wd");
  const int st = wait_status(p.pid);
  ASSERT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0) << slurp(p.err);
  EXPECT_NE(slurp(p.err).find("--resume: weight_decay was"), std::string::npos) << slurp(p.err);
  EXPECT_EQ(slurp(p.err).find("--resume: beta1 was"), std::string::npos) << slurp(p.err);
}

// --keep-checkpoints renames a checkpoint before removing it: a run killed during the removal
// leaves a step-<N>.pruned-<tag> (not a half-empty step-<N> that nothing removed), which the next
// save removes; the kept ones are the newest.
TEST_F(TrainBinary, APrunedCheckpointLeftByADeadRunIsRemovedByTheNextSave) {
  const std::string ck = dir.path + "/ck";
  fs::create_directories(ck + "/step-1.pruned-4242");
  std::ofstream(ck + "/step-1.pruned-4242/rank0.bin") << "half removed";
  auto a = args(dir.path + "/a.jsonl",
                {"--save-every", "1", "--keep-checkpoints", "2", "--checkpoint-dir", ck});
  set_steps(a, "4");
  Proc p = spawn(a, dir.path, "prune");
  const int st = wait_status(p.pid);
  ASSERT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0) << slurp(p.err);
  std::vector<std::string> left;
  for (const auto& e : fs::directory_iterator(ck)) left.push_back(e.path().filename().string());
  std::sort(left.begin(), left.end());
  EXPECT_EQ(left, (std::vector<std::string>{"step-3", "step-4"}));
}

// A candidate removed while it is verified (a live run's pruning, its next checkpoint completed
// meanwhile) sends the search back to the folder: strata-export of a run still going failed, "no
// complete checkpoint found", about one time in twenty. Here the removal happens while the
// candidate's manifest is opened (a FIFO, written by this test once the search reads it).
TEST_F(TrainBinary, ACheckpointPrunedWhileItIsVerifiedIsLookedForAgain) {
  const std::string ck = dir.path + "/ck", live = dir.path + "/live";
  auto a = args(dir.path + "/a.jsonl", {"--save-every", "1", "--checkpoint-dir", ck});
  set_steps(a, "2");
  Proc p = spawn(a, dir.path, "two");
  const int st = wait_status(p.pid);
  ASSERT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0) << slurp(p.err);
  // The live folder as the search first lists it: step-1 (being pruned) and step-2 not yet
  // renamed into place.
  fs::create_directories(live);
  fs::copy(ck + "/step-1", live + "/step-1", fs::copy_options::recursive);
  fs::copy(ck + "/step-2", live + "/step-2.tmp-7", fs::copy_options::recursive);
  // An unfinished save besides, there at every listing: said once.
  fs::create_directories(live + "/step-0.tmp-3");
  const std::string fifo = live + "/step-1/manifest.json";
  fs::remove(fifo);
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0644), 0);
  std::thread run([&] {
    int w = -1;  // opened once the search opens it to read (ENXIO before; given up after 60 s)
    for (int i = 0; i < 60000 && (w = ::open(fifo.c_str(), O_WRONLY | O_NONBLOCK)) < 0; ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    fs::rename(live + "/step-2.tmp-7", live + "/step-2");
    fs::rename(live + "/step-1", live + "/step-1.pruned-7");
    if (w >= 0) ::close(w);  // (an empty manifest: the candidate fails, and is gone)
  });
  FoundCheckpoint found;
  std::string err;
  ::testing::internal::CaptureStderr();
  try {
    found = find_checkpoint(live, "strata-export");
  } catch (const Error& e) {
    err = e.what();
  }
  const std::string said = ::testing::internal::GetCapturedStderr();
  run.join();
  EXPECT_EQ(err, "");
  EXPECT_EQ(found.step, 2);
  EXPECT_EQ(found.dir, live + "/step-2");
  const std::string note = "skipping " + live + "/step-0.tmp-3: an unfinished checkpoint";
  const std::size_t first = said.find(note);
  EXPECT_NE(first, std::string::npos) << said;
  EXPECT_EQ(said.find(note, first + 1), std::string::npos) << "said more than once:\n" << said;
}

// The data is the checkpoint's by its bytes (size and a hash of its ends), not its path: a file
// changed in place since (appended to, or the same size with other bytes; a corpus prepared again
// into its cache path) is said (the paths alone matched), and the same bytes moved elsewhere are
// not (they were warned of as other data).
TEST_F(TrainBinary, AResumeOnADataFileChangedInPlaceWarns) {
  const std::string ck = dir.path + "/ck";
  ASSERT_NO_FATAL_FAILURE(two_steps_saved_in(ck));
  const std::string original = slurp(text);
  {
    // Moved: the same bytes under another path.
    const std::string moved = dir.path + "/moved.txt";
    fs::rename(text, moved);
    auto m = args(dir.path + "/m.jsonl", {"--resume", ck});
    for (auto& x : m)
      if (x == text) x = moved;
    set_steps(m, "3");
    Proc p = spawn(m, dir.path, "moved");
    const int st = wait_status(p.pid);
    ASSERT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0) << slurp(p.err);
    EXPECT_EQ(slurp(p.err).find("the data will not continue"), std::string::npos) << slurp(p.err);
    EXPECT_NE(slurp(p.out).find("the data files are the checkpoint's (the same sizes and bytes) "
                                "under other paths"),
              std::string::npos)
        << slurp(p.out);
    fs::rename(moved, text);
  }
  {
    // The same size, other bytes.
    std::string other = original;
    other[0] = other[0] == 'x' ? 'y' : 'x';
    std::ofstream(text, std::ios::binary | std::ios::trunc) << other;
    auto o = args(dir.path + "/o.jsonl", {"--resume", ck});
    set_steps(o, "3");
    Proc p = spawn(o, dir.path, "other-bytes");
    const int st = wait_status(p.pid);
    ASSERT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0) << slurp(p.err);
    EXPECT_NE(slurp(p.err).find("--resume: " + text +
                                " held other bytes in the checkpoint's run (the same size): it "
                                "changed since"),
              std::string::npos)
        << slurp(p.err);
    std::ofstream(text, std::ios::binary | std::ios::trunc) << original;
  }
  const auto before = std::int64_t(fs::file_size(text));
  auto a = args(dir.path + "/b.jsonl", {"--resume", ck});
  set_steps(a, "3");
  Proc same = spawn(a, dir.path, "same");
  int st = wait_status(same.pid);
  ASSERT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0) << slurp(same.err);
  EXPECT_EQ(slurp(same.err).find("changed since"), std::string::npos) << slurp(same.err);
  std::ofstream(text, std::ios::app) << "more text, appended after the checkpoint\n";
  a = args(dir.path + "/c.jsonl", {"--resume", ck});
  set_steps(a, "3");
  Proc changed = spawn(a, dir.path, "changed");
  st = wait_status(changed.pid);
  ASSERT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0) << slurp(changed.err);
  EXPECT_NE(slurp(changed.err)
                .find(fmt::format("--resume: {} had {} bytes in the checkpoint's run, {} now: it "
                                  "changed since, and the data will not continue where it stopped",
                                  text, before, before + 41)),
            std::string::npos)
      << slurp(changed.err);
}

// A checkpoint of an older strata records its data files' paths only; where they are now under
// other paths (a corpus whose cache name changed with strata's version) and the old paths are
// still there with the same bytes, the data continues and is not warned of (it was: "the data
// will not continue where it stopped"); with the old path gone it still is.
TEST_F(TrainBinary, AnOlderCheckpointsDataUnderAnotherPathIsComparedByItsBytes) {
  const std::string ck = dir.path + "/ck", copy = dir.path + "/copy.txt";
  ASSERT_NO_FATAL_FAILURE(two_steps_saved_in(ck));
  {
    std::ifstream f(ck + "/step-2/manifest.json");
    nlohmann::json m = nlohmann::json::parse(f);
    nlohmann::json& d = m["trainer"]["data"];
    ASSERT_TRUE(d.contains("file_bytes")) << d.dump();
    d.erase("file_bytes");
    d.erase("file_samples");
    m["manifest_xxh3"] = manifest_checksum(m);
    std::ofstream(ck + "/step-2/manifest.json") << m.dump(1);
  }
  fs::copy_file(text, copy);
  const auto resumed = [&](const std::string& tag) {
    auto a = args(dir.path + "/" + tag + ".jsonl", {"--resume", ck});
    for (auto& x : a)
      if (x == text) x = copy;
    set_steps(a, "3");
    Proc p = spawn(a, dir.path, tag);
    const int st = wait_status(p.pid);
    EXPECT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0) << slurp(p.err);
    return std::make_pair(slurp(p.out), slurp(p.err));
  };
  const auto [out, err] = resumed("there");
  EXPECT_EQ(err.find("the data will not continue"), std::string::npos) << err;
  EXPECT_NE(out.find("the data files are the checkpoint's (the same sizes and bytes) under other "
                     "paths"),
            std::string::npos)
      << out;
  fs::remove(text);
  const auto [out2, err2] = resumed("gone");
  EXPECT_NE(err2.find("in the checkpoint's run, [\"" + copy +
                      "\"] now: the data will not continue where it stopped"),
            std::string::npos)
      << err2;
}

// A linear decay resumed inside its warmup with another total (or --min-lr): the next lr is the
// same there, but the decay after it is not, and the resume says so (only a cosine's total was
// compared), giving both schedules.
TEST_F(TrainBinary, AResumeInsideTheWarmupOfAnotherDecayWarns) {
  const std::string ck = dir.path + "/ck";
  auto a = args(dir.path + "/a.jsonl", {"--save-every", "3", "--checkpoint-dir", ck});
  set_steps(a, "3");
  for (std::size_t i = 0; i + 1 < a.size(); ++i) {
    if (a[i] == "--warmup") a[i + 1] = "4";
    if (a[i] == "--lr-schedule") a[i + 1] = "linear";
  }
  Proc first = spawn(a, dir.path, "warm");
  int st = wait_status(first.pid);
  ASSERT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0) << slurp(first.err);
  a = args(dir.path + "/b.jsonl", {"--resume", ck});
  set_steps(a, "6");
  for (std::size_t i = 0; i + 1 < a.size(); ++i) {
    if (a[i] == "--warmup") a[i + 1] = "4";
    if (a[i] == "--lr-schedule") a[i + 1] = "linear";
  }
  Proc p = spawn(a, dir.path, "warm-resume");
  st = wait_status(p.pid);
  ASSERT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0) << slurp(p.err);
  const std::string err = slurp(p.err);
  EXPECT_NE(err.find("--resume: the learning-rate schedule differs from the checkpoint's "
                     "run (total_steps differ): the checkpoint's {"),
            std::string::npos)
      << err;
  // Both sides (it said the checkpoint's alone).
  const std::size_t now = err.find("this run's {");
  ASSERT_NE(now, std::string::npos) << err;
  EXPECT_NE(err.find("\"total_steps\":6", now), std::string::npos) << err;
  EXPECT_LT(err.find("\"total_steps\":3"), now) << err;
}

// A run resumed from an older checkpoint of a folder whose run went further is told that the newer
// checkpoints stay and that "--resume" of the folder takes them until it has saved past them (a
// later resume silently continued the abandoned branch).
TEST_F(TrainBinary, ResumingAnOlderCheckpointNamesTheNewerOnesThatStay) {
  const std::string ck = dir.path + "/ck";
  auto a = args(dir.path + "/a.jsonl", {"--save-every", "2", "--checkpoint-dir", ck});
  set_steps(a, "6");
  Proc p = spawn(a, dir.path, "first");
  int st = wait_status(p.pid);
  ASSERT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0) << slurp(p.err);
  auto b = args(dir.path + "/b.jsonl", {"--save-every", "2", "--resume", ck + "/step-2"});
  set_steps(b, "4");
  p = spawn(b, dir.path, "branch");
  st = wait_status(p.pid);
  ASSERT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0) << slurp(p.err);
  EXPECT_NE(slurp(p.err).find(ck +
                              " holds checkpoints newer than the resumed step 2 (steps 4, 6) "
                              "of the run this one branches from: until this run saves past "
                              "step 6, --resume " +
                              ck + " takes the newest of them"),
            std::string::npos)
      << slurp(p.err);
  // Resumed from the newest, nothing is newer: no word.
  auto c = args(dir.path + "/c.jsonl", {"--save-every", "2", "--resume", ck});
  set_steps(c, "8");
  p = spawn(c, dir.path, "newest");
  st = wait_status(p.pid);
  ASSERT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0) << slurp(p.err);
  EXPECT_EQ(slurp(p.err).find("newer than the resumed"), std::string::npos) << slurp(p.err);
}

// A checkpoint the drive cannot hold ends the run saying what is left and what to do: nothing of
// the failed one, the newest complete one by name, free space and --resume it (it named only the
// file that failed). Needs root (a small tmpfs); Skipped elsewhere.
TEST_F(TrainBinary, AFullDriveAtACheckpointSaysWhatIsLeftAndWhatToDo) {
  const testing::SmallTmpfs fs_small(dir.path + "/small", "16m");
  if (!fs_small.ok) GTEST_SKIP() << fs_small.why;
  const std::string small = fs_small.path;
  const std::string ck = small + "/ck";
  ASSERT_NO_FATAL_FAILURE(two_steps_saved_in(ck));
  std::uintmax_t one = 0;
  for (const auto& e : fs::recursive_directory_iterator(ck + "/step-2"))
    if (e.is_regular_file()) one += e.file_size();
  struct statvfs sv {};
  ASSERT_EQ(::statvfs(small.c_str(), &sv), 0);
  const std::uintmax_t avail = std::uintmax_t(sv.f_bavail) * sv.f_frsize;
  ASSERT_GT(avail, one);
  {  // leave room for half a checkpoint
    std::ofstream filler(small + "/filler", std::ios::binary);
    const std::vector<char> mb(1 << 20, 0);
    std::uintmax_t left = avail - one / 2;
    while (left > 0 && filler) {
      const std::size_t n = std::size_t(std::min<std::uintmax_t>(left, mb.size()));
      filler.write(mb.data(), std::streamsize(n));
      left -= n;
    }
  }
  auto a = args(dir.path + "/b.jsonl", {"--resume", ck, "--save-every", "2"});
  set_steps(a, "4");
  Proc p = spawn(a, dir.path, "full");
  const int st = wait_status(p.pid);
  EXPECT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 1) << slurp(p.err);
  const std::string err = slurp(p.err);
  EXPECT_NE(err.find("the checkpoint of step 4 was not written and nothing of it is left; the "
                     "newest complete one is " +
                     ck + "/step-2; free space in " + ck),
            std::string::npos)
      << err;
  EXPECT_NE(err.find("run the same command with --resume " + ck + "/step-2"), std::string::npos)
      << err;
  EXPECT_TRUE(fs::exists(ck + "/step-2/manifest.json"));
  for (const auto& e : fs::directory_iterator(ck))
    EXPECT_EQ(e.path().filename().string().find("step-4"), std::string::npos) << e.path();
  // A run whose first checkpoint does not fit has nothing to resume: it is told to run again.
  auto b = args(dir.path + "/c.jsonl", {"--save-every", "2", "--checkpoint-dir", small + "/ck2"});
  b[std::size_t(std::find(b.begin(), b.end(), "--steps") - b.begin()) + 1] = "2";
  p = spawn(b, dir.path, "full-first");
  const int st2 = wait_status(p.pid);
  EXPECT_TRUE(WIFEXITED(st2) && WEXITSTATUS(st2) == 1) << slurp(p.err);
  EXPECT_NE(
      slurp(p.err).find("no checkpoint of this run is complete; free space in " + small + "/ck2"),
      std::string::npos)
      << slurp(p.err);
  EXPECT_NE(
      slurp(p.err).find("then run the same command again (there is nothing to --resume from)"),
      std::string::npos)
      << slurp(p.err);
}

// A checkpoint folder made read-only under the run (a drive remounted read-only) ends it as a full
// drive does: an I/O error saying what is left, to make the folder writable and --resume the
// newest complete checkpoint (it was "invalid argument: checkpoint: cannot create ..." alone).
// Needs root (a tmpfs remounted read-only); Skipped elsewhere.
TEST_F(TrainBinary, ACheckpointFolderMadeReadOnlySaysWhatIsLeftAndWhatToDo) {
  const testing::SmallTmpfs fs_small(dir.path + "/ro", "64m");
  if (!fs_small.ok) GTEST_SKIP() << fs_small.why;
  const std::string small = fs_small.path;
  const std::string ck = small + "/ck";
  // Slow steps (the emulated device's throttle), so that the folder turns read-only between the
  // checkpoints of steps 2 and 4.
  auto a = args(dir.path + "/ro.jsonl",
                {"--save-every", "2", "--checkpoint-dir", ck, "--emu-compute-gflops", "0.05"});
  set_steps(a, "6");
  Proc p = spawn(a, dir.path, "ro");
  const auto start = std::chrono::steady_clock::now();
  while (!fs::exists(ck + "/step-2/manifest.json") &&
         std::chrono::steady_clock::now() - start < std::chrono::seconds(60))
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  const bool ro = std::system(("mount -o remount,ro '" + small + "'").c_str()) == 0;
  const int st = wait_status(p.pid);
  const std::string err = slurp(p.err);
  if (!ro) GTEST_SKIP() << "the tmpfs could not be remounted read-only (busy)";
  if (fs::exists(ck + "/step-4"))
    GTEST_SKIP() << "step 4 was saved before the folder turned read-only (a slow machine)";
  EXPECT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 1) << err;
  EXPECT_NE(err.find("strata-train: I/O error: checkpoint: cannot create " + ck), std::string::npos)
      << err;
  EXPECT_NE(err.find("Read-only file system; the checkpoint of step 4 was not written and "
                     "nothing of it is left; the newest complete one is " +
                     ck + "/step-2; make " + ck +
                     " writable (or give another --checkpoint-dir), then run the same command "
                     "with --resume " +
                     ck + "/step-2"),
            std::string::npos)
      << err;
}

// --out on a drive too small for the model: the error says why (its errno text, which it left
// out), the newest checkpoint and the command that finishes the run. Needs root (a small tmpfs).
TEST_F(TrainBinary, AFullDriveAtOutSaysWhyAndHowToFinish) {
  const testing::SmallTmpfs fs_small(dir.path + "/outfs", "64k");
  if (!fs_small.ok) GTEST_SKIP() << fs_small.why;
  const std::string small = fs_small.path;
  const std::string ck = dir.path + "/ck", out = small + "/model";
  auto a = args(dir.path + "/o.jsonl", {"--save-every", "2", "--checkpoint-dir", ck, "--out", out});
  set_steps(a, "2");
  Proc p = spawn(a, dir.path, "out-full");
  const int st = wait_status(p.pid);
  const std::string err = slurp(p.err);
  EXPECT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 1) << err;
  EXPECT_NE(err.find("No space left on device"), std::string::npos) << err;
  EXPECT_NE(err.find("; the model was not written to " + out + "; the newest checkpoint is " + ck +
                     "/step-2: free space in " + out +
                     ", then run the same command with --resume " + ck + "/step-2"),
            std::string::npos)
      << err;
}

// --out past the process's file-size limit (ulimit -f; or a file system's largest file): the fix
// is the limit or smaller shards (it said "free space", which does not help).
TEST_F(TrainBinary, AFileSizeLimitAtOutNamesTheLimitNotFreeSpace) {
  const std::string out = dir.path + "/model";
  auto a = args(dir.path + "/f.jsonl", {"--out", out});
  set_steps(a, "1");
  std::string cmd = std::string("ulimit -f 100 && exec ") + STRATA_TRAIN_BIN;  // 51200 bytes
  for (const std::string& x : a) cmd += " '" + x + "'";
  const auto r = testing::run("/bin/sh", {"-c", cmd}, dir.path, "fsize");
  EXPECT_EQ(r.status, 1) << r.err;
  EXPECT_NE(r.err.find("File too large"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("raise the process's file-size limit (ulimit -f) or write " + out +
                       " to a file system that holds larger files, or cut the model into smaller "
                       "shards (--max-shard-mb N)"),
            std::string::npos)
      << r.err;
  EXPECT_EQ(r.err.find("free space"), std::string::npos) << r.err;
}

// A --log-json whose drive fills mid-run keeps whole lines only (a torn last line made the file
// unreadable as JSON lines), and a resume after the gap says which steps the log lacks. Needs root.
TEST_F(TrainBinary, ALogOnAFullDriveKeepsWholeLinesAndAResumeNamesTheGap) {
  const testing::SmallTmpfs fs_small(dir.path + "/logfs", "8k");
  if (!fs_small.ok) GTEST_SKIP() << fs_small.why;
  const std::string small = fs_small.path;
  std::ofstream(small + "/filler") << std::string(4096, 'x');
  const std::string log = small + "/log.jsonl", ck = dir.path + "/ck";
  auto a = args(log, {"--save-every", "10", "--checkpoint-dir", ck});
  set_steps(a, "30");
  Proc p = spawn(a, dir.path, "full-log");
  int st = wait_status(p.pid);
  ASSERT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0) << slurp(p.err);
  const std::string err = slurp(p.err);
  const std::size_t at = err.find("could not be written (No space left on device); the log stops");
  ASSERT_NE(at, std::string::npos) << err;
  const std::string text = slurp(log);
  ASSERT_FALSE(text.empty());
  EXPECT_EQ(text.back(), '\n') << "a torn last line";
  std::int64_t last = 0;
  std::istringstream lines(text);
  for (std::string l; std::getline(lines, l);)
    last = nlohmann::json::parse(l).at("step").get<std::int64_t>();  // each line whole
  ASSERT_LT(last, 30);
  if (last >= 29) GTEST_SKIP() << "the drive held the log up to step " << last;
  // Room again; the resume from step 30's checkpoint says what the log lacks.
  fs::remove(small + "/filler");
  auto b = args(log, {"--save-every", "10", "--checkpoint-dir", ck, "--resume", ck});
  set_steps(b, "31");
  p = spawn(b, dir.path, "gap");
  st = wait_status(p.pid);
  ASSERT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0) << slurp(p.err);
  EXPECT_NE(slurp(p.err).find(fmt::format("--log-json {}: its lines end at step {}, and the run "
                                          "resumes after step 30: steps {} to 29 are not in the "
                                          "log",
                                          log, last, last + 1)),
            std::string::npos)
      << slurp(p.err);
  // The checkpoint's own line (30) and the resumed run's (31) follow the kept ones.
  std::vector<std::int64_t> steps;
  std::istringstream after(slurp(log));
  for (std::string l; std::getline(after, l);)
    steps.push_back(nlohmann::json::parse(l).at("step").get<std::int64_t>());
  ASSERT_GE(steps.size(), 3u);
  EXPECT_EQ(steps[steps.size() - 3], last);
  EXPECT_EQ(steps[steps.size() - 2], 30);
  EXPECT_EQ(steps.back(), 31);
}

// A run that dies in the moment between moving an existing step-N aside (to save step N again)
// and renaming the new one leaves step-N.old-<pid>: a complete checkpoint, taken as step N while
// there is no step-N (resume fell back one checkpoint, and the folder was never used).
TEST_F(TrainBinary, AStepSetAsideByARunThatDiedIsTakenWhenItsStepIsMissing) {
  const std::string ck = dir.path + "/ck";
  ASSERT_NO_FATAL_FAILURE(two_steps_saved_in(ck));
  fs::rename(ck + "/step-2", ck + "/step-2.old-99999");
  auto a = args(dir.path + "/b.jsonl", {"--resume", ck});
  set_steps(a, "3");
  Proc p = spawn(a, dir.path, "aside");
  const int st = wait_status(p.pid);
  ASSERT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0) << slurp(p.err);
  EXPECT_NE(slurp(p.err).find("step-2.old-99999 is step-2 set aside by a run that stopped"),
            std::string::npos)
      << slurp(p.err);
  EXPECT_EQ(read_log(dir.path + "/b.jsonl").begin()->first, 3) << "did not resume after step 2";
}

// ... and one beside a complete step-N is removed by the next checkpoint a run writes there (it
// was skipped on every resume and never removed: a whole checkpoint's bytes).
TEST_F(TrainBinary, AStepSetAsideBesideItsCompleteStepIsRemovedByTheNextSave) {
  const std::string ck = dir.path + "/ck";
  ASSERT_NO_FATAL_FAILURE(two_steps_saved_in(ck));
  fs::copy(ck + "/step-2", ck + "/step-2.old-99999", fs::copy_options::recursive);
  // One with no step-<N> beside it is all there is of its step: kept (a copy; its manifest says
  // step 2, so resume skips it).
  fs::copy(ck + "/step-2", ck + "/step-1.old-99998", fs::copy_options::recursive);
  auto a = args(dir.path + "/b.jsonl", {"--resume", ck, "--save-every", "3"});
  set_steps(a, "3");
  Proc p = spawn(a, dir.path, "aside-beside");
  const int st = wait_status(p.pid);
  ASSERT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0) << slurp(p.err);
  EXPECT_FALSE(fs::exists(ck + "/step-2.old-99999")) << slurp(p.err);
  EXPECT_NE(slurp(p.err).find("removed " + ck +
                              "/step-2.old-99999, left by a run that stopped while writing that "
                              "step again"),
            std::string::npos)
      << slurp(p.err);
  EXPECT_TRUE(fs::exists(ck + "/step-1.old-99998/manifest.json"))
      << "a step's only copy was removed";
  EXPECT_TRUE(fs::exists(ck + "/step-2/manifest.json"));
  EXPECT_TRUE(fs::exists(ck + "/step-3/manifest.json"));
}

// ... but not beside a step-N damaged since it was written: the set-aside copy is then the only
// good one of step N, and resume takes it (it fell back to the step before, and the next save
// removed the good copy).
TEST_F(TrainBinary, AStepSetAsideBesideADamagedStepIsTakenAndKept) {
  const std::string ck = dir.path + "/ck";
  ASSERT_NO_FATAL_FAILURE(two_steps_saved_in(ck));
  fs::copy(ck + "/step-2", ck + "/step-2.old-99999", fs::copy_options::recursive);
  {
    std::fstream f(ck + "/step-2/rank0.bin", std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(100);
    char c = 0;
    f.read(&c, 1);
    c = char(c ^ 0x40);
    f.seekp(100);
    f.write(&c, 1);
  }
  auto a = args(dir.path + "/b.jsonl", {"--resume", ck, "--save-every", "3"});
  set_steps(a, "3");
  Proc p = spawn(a, dir.path, "aside-damaged");
  const int st = wait_status(p.pid);
  ASSERT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0) << slurp(p.err);
  const std::string all = slurp(p.out) + slurp(p.err);
  EXPECT_NE(all.find("resumed from " + ck + "/step-2.old-99999 (step 2)"), std::string::npos)
      << all;
  EXPECT_TRUE(fs::exists(ck + "/step-2.old-99999/manifest.json"))
      << "the only good copy of step 2 was removed";
  EXPECT_EQ(read_log(dir.path + "/b.jsonl").begin()->first, 3) << "did not resume after step 2";
}

}  // namespace
}  // namespace strata
