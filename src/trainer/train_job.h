// The parts of train() (trainer.cpp), one file a job:
//   trainer_setup.cpp   the options checked, the model config, the checkpoints' folder, the
//                       engine config with the flags' overrides, the schedule; then the data,
//                       the device and communicator, the model and engine, the resume
//   trainer_loop.cpp    the step loop, the checkpoints it saves, the model it writes at the end
//   trainer_report.cpp  what the user sees: the plan alone, the header, the progress line, the
//                       per-step JSON log, the summary table
//   trainer_demo.cpp    the embedded demo's model, text and engine config
// Settings holds what the options and files decide before any device or collective; Run holds
// the objects of the job itself. Every rank runs the same steps in the same order: see
// trainer.cpp.
#pragma once

#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "strata/comm.h"
#include "strata/model_data.h"
#include "strata/run_plot.h"
#include "strata/tokenizer.h"
#include "strata/trainer.h"

namespace strata::train_job {

using Clock = std::chrono::steady_clock;

inline double since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// The data files' identity, as a checkpoint records it: each one's size in bytes (-1 where it
// cannot be read) and a hash of its first and last MiB and size (16 hex digits; "" where it cannot
// be read). A resume on a file changed in place (a corpus prepared again into its cache path) is
// said not to continue where it stopped; the same bytes under another path (a moved file) are the
// same data.
struct DataIdentity {
  std::vector<std::int64_t> bytes;
  std::vector<std::string> samples;
};

// A folder this run writes into, locked for its life (hold_folder).
struct HeldFolder {
  int fd = -1;
  // The folders the run made to hold it, the folder first, then the parents it made: removed
  // when the run ends with them still empty (a run refused before it wrote anything, e.g. by
  // its ranks' disagreeing settings, left an empty --out).
  std::vector<std::string> made;
  HeldFolder(int f, std::vector<std::string> m) : fd(f), made(std::move(m)) {}
  HeldFolder(const HeldFolder&) = delete;
  HeldFolder& operator=(const HeldFolder&) = delete;
  ~HeldFolder() {
    // Removed while still locked: a run starting now finds it gone, not taken and then removed.
    for (const std::string& d : made)
      if (::rmdir(d.c_str()) != 0) break;  // not empty: the run wrote there
    if (fd >= 0) ::close(fd);              // (releases the lock)
  }
};

// --log-json's file, locked for the run's life from before anything is built (a second run
// writing the same log replaced or interleaved this one's lines without a word); JsonLog writes
// through a copy of the descriptor. The file the run made is removed when it ends still empty.
struct HeldFile {
  int fd = -1;
  std::string made;  // the path, where this run created the file
  HeldFile(int f, std::string m) : fd(f), made(std::move(m)) {}
  HeldFile(const HeldFile&) = delete;
  HeldFile& operator=(const HeldFile&) = delete;
  ~HeldFile() {
    struct stat st {};
    if (!made.empty() && ::fstat(fd, &st) == 0 && st.st_size == 0) ::unlink(made.c_str());
    ::close(fd);  // (releases the lock)
  }
};

// What the options and files decide before any device or collective.
struct Settings {
  explicit Settings(const TrainOptions& options) : o(options) {}
  Settings(const Settings&) = delete;
  Settings& operator=(const Settings&) = delete;
  ~Settings() {
    held_log.reset();  // (an empty log it made removed first: it may be in a folder it made)
    while (!held_folders.empty()) held_folders.pop_back();  // the checkpoints in --out first
  }
  const TrainOptions& o;
  Clock::time_point t_start;
  bool demo_model = false, demo_data = false;
  ModelConfig mcfg;
  // Resume: the newest complete checkpoint, found (and verified) before anything is built.
  FoundCheckpoint resume;
  std::vector<std::int64_t> inherited_checkpoints;  // steps, oldest first
  // --out holds a model's files (a resumed run's, without --overwrite): free only where the
  // checkpoint resumed records this --out as its run's (find_checkpoints).
  bool out_holds_a_model = false;
  // Complete checkpoints in the folder this run continues that are newer than the one --resume
  // named itself: the run it branches from went further (steps, oldest first).
  std::vector<std::int64_t> newer_checkpoints;
  std::string ckpt_root;
  // --out and the checkpoint folder, held while the run lives (rank 0's): a second run into
  // either is refused.
  std::vector<std::unique_ptr<HeldFolder>> held_folders;
  std::unique_ptr<HeldFile> held_log;  // --log-json's file (rank 0's; none for a stream)
  // The launch and the device's options
  LaunchInfo launch;
  HostDeviceOptions hopt;
  CudaDeviceOptions copt;
  std::vector<UnitSpec> units;
  std::uint64_t max_unit = 0;     // this rank's largest unit (its TP slice's)
  std::uint64_t total_numel = 0;  // the whole model's elements
  // The engine config: the file (or defaults), then the flags
  EngineConfig ecfg;
  std::string demo_dir;
  // The schedule and the batch
  std::int64_t warmup = 0, steps = 0, seq_len = 0, B = 0, accum = 0;
  bool ds_schedule = false;
  bool clip_defaulted = false;  // gradient clipping 1.0: the fine-tuning default, not asked for
  std::vector<std::int32_t> sample_prompt;  // --sample-prompt / --sample-prompt-ids as ids
  std::shared_ptr<Tokenizer> tokenizer;     // the --model folder's, for --sample-every (or none)
  std::string schedule;
  // The data the loaders read (the demo's text file named, not yet written), and the epochs:
  // --epochs E, or 0 when --steps (or the default) sets the steps.
  std::string text_file;
  DataOptions dopt;
  // --eval-data's files as the evaluation loader reads them (a corpus replaced by its prepared
  // file).
  std::vector<std::string> eval_files;
  double epochs = 0;
  std::int64_t steps_per_epoch = 0;  // with --epochs: optimizer steps in one pass over the data
  std::int64_t epoch_rows = 0;       // ... and the sequences of seq_len tokens in that pass
  int rank = 0, world = 1;           // in the whole job
  // Tensor parallelism (--tensor-parallel): this rank's place in the TP x DP grid (TP innermost,
  // as make_process_groups). The data, the batch and the loss are the data-parallel ranks'.
  int tp = 1, tp_rank = 0, dp_rank = 0, dp_world = 1;
  std::FILE* con = nullptr;  // rank 0's console, else null

  // The lr of optimizer step t (1-based).
  double lr_of(std::int64_t t) const;
  // The schedule as a checkpoint records it, going on at step `next` (1-based): a resume
  // compares it with its own.
  nlohmann::json lr_schedule_record(std::int64_t next) const;
};

struct Phases {
  double data = 0, forward = 0, backward = 0, optimizer = 0, eval = 0, save = 0, sample = 0;
};

// --log-json as rank 0 writes it: a file made anew, or a stream written into (strata/paths.h:
// a pipe, /dev/stdout, whose console lines are not written over), and how much of it is whole
// lines.
struct JsonLog {
  // Throws naming the path when it cannot be opened. `held`: the file's descriptor, locked by
  // the run (HeldFile), written from its start.
  explicit JsonLog(const std::string& path, int held = -1);
  JsonLog(const JsonLog&) = delete;
  JsonLog& operator=(const JsonLog&) = delete;
  ~JsonLog();
  // `line` and a newline appended: 0, or the errno that ended the log (a full drive, a reader
  // gone), which is then cut back to its whole lines where it is a file.
  int append(const std::string& line);

  std::string path;
  int fd = -1;
  bool stream = false;
  std::uint64_t whole = 0;  // bytes of whole lines written
};

// The job's objects, declared in the order they are made (and destroyed in reverse).
struct Run {
  explicit Run(Settings& settings) : s(settings) {}
  Settings& s;
  // Device, communicator, loaders
  std::unique_ptr<Device> dev;
  bool demo_capped = false;  // under the demo's 20 MiB cap
  std::unique_ptr<Communicator> comm;
  // --tensor-parallel N > 1: the TP group (the model's) and the DP group (the engine's).
  ProcessGroups groups;
  Communicator& dp_comm() const { return groups.dp ? *groups.dp : *comm; }
  Communicator* tp_comm() const { return groups.tp.get(); }
  std::unique_ptr<TokenLoader> loader, val;
  DataIdentity data_identity;      // of the files the loader reads, recorded by every checkpoint
  std::int64_t train_batches = 0;  // the loader's next() calls so far: the data position
  // Model and engine
  std::unique_ptr<Stream> compute;
  ModelOptions mopt;
  std::unique_ptr<Model> model;
  std::unique_ptr<Engine> engine;
  std::unique_ptr<EngineWeights> weights;
  // Resume and checkpoints
  std::string model_hash, model_desc;
  nlohmann::json optimizer_state;  // what else shapes the steps after a checkpoint
  std::int64_t start_step = 0;
  std::int64_t resumed_from = 0;
  std::vector<std::string> checkpoints;  // folders written, in order
  std::vector<std::int64_t> saved_steps;
  // Steps in a row that went nowhere (loss or gradient norm not finite), and the first of them.
  std::int64_t nonfinite_steps = 0, first_nonfinite_step = 0;
  std::string tmp_tag;
  // This rank made its file system's checkpoint folders (rank 0, or the first rank of a node
  // whose node-local folder rank 0 does not see): it prunes them.
  bool checkpoint_writer = false;
  int checkpoint_file_systems = 0;  // of the last checkpoint written (0: none yet)
  // Reporting
  std::unique_ptr<JsonLog> jlog;
  // --plot on rank 0: the steps drawn so far (a resumed run's from its --log-json), and whether
  // the picture is still being drawn (a file that could not be written ends it, not the run).
  std::vector<RunRecord> plot_steps;
  bool plotting = false;
  Clock::time_point plot_drawn_at;  // when the picture was last drawn, and what that cost
  double plot_draw_s = 0;
  bool tty = false;
  std::int64_t print_every = 1;
  std::string sample;  // this step's --sample-every text (JSON-quoted), printed under its line
  double tokens_per_step = 0;
  double counted_tokens = 0;  // targets that counted in the loss, every rank's, over the steps run
  // The loop
  TrainResult result;
  Phases ph;
  EngineStats prev;
  Clock::time_point loop_start;
};

// That the folder `path` (given as `flag`) can be made, leaving nothing made behind; ranks may
// check the same path at once. Throws kInvalidArgument naming the flag and the fix.
void require_creatable_folder(const std::string& flag, const std::string& path);

// Of `files` (DataIdentity).
DataIdentity data_identity(const std::vector<std::string>& files);

// ---- set-up (trainer_setup.cpp), in this order ----
void check_flags(Settings& s);
void read_model_config(Settings& s);
void check_files(Settings& s);
void find_checkpoints(Settings& s);
void device_options(Settings& s);
void build_engine_config(Settings& s);
void sequence_and_batch(Settings& s);
void data_and_steps(Settings& s);
void check_resume_step(Settings& s);
void lr_schedule(Settings& s);
// After the checks, before the run (rank 0): --out and the checkpoint folder held for the run's
// life; another run holding either is refused.
void hold_folders(Settings& s);
void prepare_data(Run& r);
void open_device(Run& r);
void build_model_and_engine(Run& r);
void resume_from_checkpoint(Run& r);

// ---- the loop (trainer_loop.cpp) ----
// The mean of `v` over the ranks (every rank calls it).
double mean_over_ranks(double v, Communicator& comm, Device& dev, Stream& s);
void prepare_checkpoints(Run& r);
// What Ctrl-C (a scheduler's SIGTERM) says while the run starts (its data read, its state placed
// or read back from the checkpoint: a billion parameters take a minute): rank 0's, set once the
// checks have passed. run_steps, each checkpoint and write_model say it anew.
void say_where_an_interrupted_start_leaves(const Settings& s);
void run_steps(Run& r);
void write_model(Run& r);

// ---- what the user sees (trainer_report.cpp) ----
TrainResult report_plan(const Settings& s);
void open_json_log(Run& r);
void open_plot(Run& r);
// The step's --log-json object drawn into --plot's picture (rank 0; nothing without --plot).
void plot_step(Run& r, const nlohmann::json& line);
void print_header(Run& r);
void print_progress(Run& r, const StepRecord& rec, double val_loss, const EngineStats& st);
void print_summary(Run& r);

// ---- the embedded demo (trainer_demo.cpp) ----
void write_demo_text(const std::string& path);
// The largest byte of the demo's text: a byte-level model trained on it needs a vocab_size above.
int demo_text_largest_byte();
EngineConfig demo_engine_config(const std::string& nvme_dir, std::uint64_t layer_numel, int world);

}  // namespace strata::train_job
