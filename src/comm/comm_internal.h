// Pieces shared by the communicator backends (src/comm only): the watchdog that turns a
// hung collective into a job-ending error, the in-flight note a terminating rank prints,
// and the backend constructors make_communicator() chooses between.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "strata/comm.h"

namespace strata::comm {

// Tracks in-flight collectives with their start times. When one has been in flight longer
// than the timeout, it calls `on_timeout` once with the full error message (collective,
// rank, elapsed time, what to do) from its own thread; on_timeout must end the process.
// A `poll` given to begin() is asked (on the watchdog thread) whether the collective has
// finished (NCCL: a cudaEvent); without one, end() says so (MPI's worker).
class Watchdog {
 public:
  using OnTimeout = std::function<void(const std::string& message)>;
  Watchdog(int rank, int world_size, double timeout_s, OnTimeout on_timeout,
           std::function<std::string()> async_error = {});
  ~Watchdog();
  // Ends its thread (idempotent): before what on_timeout / async_error use goes away.
  void stop();
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

  std::uint64_t begin(std::string what, std::function<bool()> poll = {});
  void end(std::uint64_t id);
  // The message on_timeout gets; public so tests and the MPI error path say the same thing.
  static std::string timeout_message(const std::string& what, int rank, int world_size,
                                     double elapsed_s, double timeout_s);

 private:
  struct Entry {
    std::uint64_t id;
    std::string what;
    std::chrono::steady_clock::time_point start;
    std::function<bool()> poll;
  };
  void run();

  int rank_, world_size_;
  double timeout_s_;
  OnTimeout on_timeout_;
  std::function<std::string()> async_error_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::list<Entry> entries_;
  std::uint64_t next_id_ = 1;
  bool stop_ = false;
  bool fired_ = false;  // on_timeout is called once, even if it returns
  std::thread thread_;  // last: started after every other member exists
};

// The host half of the backends that run collectives on the CPU (MPI, Gloo): one worker thread
// runs every collective, in the order they were issued over all streams, so every rank makes the
// same calls in the same order whatever its streams do. A collective is queued on its stream as a
// host step that hands it to the worker and holds the stream until the worker has finished it:
// stream order is kept, and the stream is busy while the collective runs, as a GPU stream is
// while NCCL runs. A collective still running after the timeout (the watchdog), or one whose
// `execute` throws, ends the job naming the collective, the rank and the elapsed time.
class CollectiveWorker {
 public:
  using Execute = std::function<void(const Communicator::Collective&)>;
  // `context` is appended to the watchdog's message (Gloo: where the other ranks are).
  CollectiveWorker(int rank, int world_size, double timeout_s, Execute execute,
                   std::string context = {});
  // After every issued collective has run: their streams still wait on them.
  ~CollectiveWorker();
  CollectiveWorker(const CollectiveWorker&) = delete;
  CollectiveWorker& operator=(const CollectiveWorker&) = delete;

  void enqueue(const Communicator::Collective& c, Stream& stream);

 private:
  struct Pending;
  void run();

  int rank_, world_size_;
  Execute execute_;
  Watchdog watchdog_;
  std::mutex issue_mu_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<Pending>> queue_;
  bool stopping_ = false;
  std::thread thread_;  // last: started after every other member exists
};

// The longest timeout a collective or the rendezvous takes, in seconds (11.6 days): a longer one
// would wrap the clocks' deadlines and Gloo's milliseconds.
inline constexpr double kMaxTimeoutS = 1e6;

// The timeout from options, else STRATA_COMM_TIMEOUT_S, else 300 s.
double resolve_timeout_s(double option_s);
// `value` of the environment variable `var` as a timeout in seconds; throws naming the variable
// when it is not a number in (0, kMaxTimeoutS].
double timeout_from_env(const char* var, const char* value);

// A call a backend finishes in the background (NCCL's non-blocking communicator returns
// ncclInProgress), waited for: `state` is asked, with sleeps from 1 us doubling to 1 ms, until
// it is no longer in progress, and that answer returned. Past `timeout_s` (> 0) `on_timeout`
// is called once with the seconds waited (the NCCL backend aborts the communicator and ends the
// job there); if it returns, so does the wait, with kFailed.
enum class Progress { kDone, kInProgress, kFailed };
Progress wait_in_progress(const std::function<Progress()>& state, double timeout_s,
                          const std::function<void(double waited_s)>& on_timeout);

// What is in flight right now, for the SIGTERM note: when a launcher ends the job because a
// peer died (OpenMPI sends SIGTERM to the survivors), each survivor prints which collective
// it was in, its rank and for how long, instead of dying silently. Process-wide, lock-free.
void note_in_flight(const std::string& what);
void note_done();
// Installs the SIGTERM note once per process where SIGTERM has its default action or a plain
// handler of the program's (remove_swap_files_on_interrupt), which then runs after the note.
void install_termination_note(int rank, int world_size);

// Ends the job after a fatal communication error: logs `message` and aborts every rank
// (MPI_Abort when MPI is up, else exits the process non-zero).
[[noreturn]] void abort_job(const std::string& message, int exit_code = 3);

// Backends (each in its own file). Their constructors are collective.
std::unique_ptr<Communicator> make_local_communicator(Device& device, double timeout_s);
std::unique_ptr<Communicator> make_mpi_communicator(Device& device, double timeout_s);
// Gloo (gloo_comm.cpp, when libgloo-dev is installed): over the launch's TCP rendezvous.
std::unique_ptr<Communicator> make_gloo_communicator(Device& device, double timeout_s);
// NCCL: the CUDA module's (cuda_module.h), loaded on first use; create_nccl_communicator is
// its implementation inside libstrata_cuda.so (nccl_comm.cpp).
std::unique_ptr<Communicator> make_nccl_communicator(Device& device, double timeout_s);
std::unique_ptr<Communicator> create_nccl_communicator(Device& device, double timeout_s);

// MPI helpers the NCCL bootstrap shares (launch.cpp): whether MPI is up, and a broadcast
// of bytes from rank 0 over MPI_COMM_WORLD.
bool mpi_active();
void mpi_broadcast_bytes(void* data, std::size_t bytes);
// The NCCL bootstrap's broadcast of bytes from rank 0: over MPI when it is up, else through the
// TCP rendezvous (init_launch() must have run). Collective.
void bootstrap_broadcast_bytes(void* data, std::size_t bytes, double timeout_s);

// ---- launch (launch_env.cpp: pure functions of the environment) ----
// The launchers' variables through `lookup` (getenv in a process, a map in tests).
using EnvLookup = std::function<const char*(const char*)>;
struct EnvLaunch {
  LaunchInfo info;
  std::string refusal;  // not empty: a launch this process cannot complete; init_launch throws it
};
EnvLaunch launch_from_env(const EnvLookup& lookup);
// Slurm's compressed host list ("node[01-03,07]", "a1,b2", "rack[1-2]-n[1,3]") in full, in order.
// Throws kInvalidArgument naming a list it cannot read.
std::vector<std::string> expand_slurm_nodelist(std::string_view list);
// The task count of node `node_id` in SLURM_STEP_TASKS_PER_NODE's form ("2(x3),1"), else -1.
int slurm_tasks_on_node(std::string_view tasks_per_node, int node_id);
// torchrun's default MASTER_PORT; a Slurm step without MASTER_PORT uses
// kSlurmBasePort + SLURM_JOB_ID % kSlurmPortSpan, so two jobs sharing a node do not collide.
constexpr int kDefaultMasterPort = 29500;
constexpr int kSlurmBasePort = 20000;
constexpr int kSlurmPortSpan = 20000;

// The launch's TCP rendezvous (rendezvous.h), joined by init_launch() under torchrun or Slurm
// without MPI with several ranks; nullptr otherwise.
class TcpStore;
TcpStore* rendezvous_store();

}  // namespace strata::comm
