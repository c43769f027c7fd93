// Launch: where this process sits in the job, MPI's life in the process, and the TCP rendezvous
// of a launch without MPI.
//
// Before MPI is initialized the launcher's environment says it all (mpirun, srun with PMIx,
// MPICH's hydra, torchrun, srun without MPI; launch_env.cpp reads it, precedence there);
// reading it never initializes MPI, so a plain process stays a plain process and picks the
// local communicator without MPI ever starting (no singleton MPI_Init, which would spawn an
// ORTE daemon). init_launch() initializes MPI with MPI_THREAD_MULTIPLE at most once and
// finalizes it at exit, and only if strata was the one to initialize it: a program that owns
// MPI keeps owning it. Without MPI, it joins the TCP rendezvous once (rendezvous.h), which
// lives until exit: Gloo's pairs and NCCL's unique id are exchanged through it.
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#if defined(STRATA_HAVE_MPI)
#include <mpi.h>
#endif

#include "comm/comm_internal.h"
#include "comm/rendezvous.h"
#include "strata/build_info.h"
#include "strata/comm.h"
#include "strata/error.h"
#include "strata/log.h"
#include "strata/nvme.h"

namespace strata {
namespace {

// The launchers' variables of this process.
comm::EnvLaunch env_launch() {
  return comm::launch_from_env([](const char* n) -> const char* { return std::getenv(n); });
}

#if defined(STRATA_HAVE_MPI)
std::once_flag g_init_once;
bool g_we_initialized = false;

std::string mpi_error_text(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(code, text, &len);
  return std::string(text, static_cast<std::size_t>(len));
}

void finalize_at_exit() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) MPI_Finalize();
}

LaunchInfo mpi_view(LaunchInfo li) {
  MPI_Comm_rank(MPI_COMM_WORLD, &li.rank);
  MPI_Comm_size(MPI_COMM_WORLD, &li.world_size);
  MPI_Comm node;
  MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, li.rank, MPI_INFO_NULL, &node);
  MPI_Comm_rank(node, &li.local_rank);
  MPI_Comm_size(node, &li.local_size);
  MPI_Comm_free(&node);
  int first_on_node = li.local_rank == 0 ? 1 : 0;
  MPI_Allreduce(&first_on_node, &li.num_nodes, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  li.under_mpi = true;
  return li;
}
#endif

}  // namespace

// MPI's view, taken once by init_launch (a collective) and handed out after.
static std::mutex g_view_mu;
static std::optional<LaunchInfo> g_mpi_view;

LaunchInfo launch_info() {
  {
    std::lock_guard<std::mutex> lock(g_view_mu);
    if (g_mpi_view) return *g_mpi_view;
  }
  LaunchInfo li = env_launch().info;
#if defined(STRATA_HAVE_MPI)
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (initialized && !finalized) {
    // MPI is up (the program's own MPI_Init) but init_launch() has not run: rank and size are
    // local queries; the shared-memory split is a collective, taken only by init_launch(), so
    // the launcher's local rank and size stand until then (any rank may ask alone).
    MPI_Comm_rank(MPI_COMM_WORLD, &li.rank);
    MPI_Comm_size(MPI_COMM_WORLD, &li.world_size);
    li.under_mpi = true;
  }
#endif
  return li;
}

namespace {
// The TCP rendezvous of this process (a launch without MPI), joined once by init_launch().
std::mutex g_rendezvous_mu;
std::unique_ptr<comm::TcpStore> g_rendezvous;
bool g_rendezvous_tried = false;  // once tried and failed, an error path does not wait again

// Who the job is, as the rendezvous checks it: STRATA_JOB_TOKEN, else torchrun's run id, else
// the Slurm job and step; every rank of one job sees the same, another job sharing the port not.
std::string job_token() {
  for (const char* n : {"STRATA_JOB_TOKEN", "TORCHELASTIC_RUN_ID"})
    if (const char* v = std::getenv(n); v && *v) return v;
  const char* job = std::getenv("SLURM_JOB_ID");
  const char* step = std::getenv("SLURM_STEP_ID");
  if (job && *job) return fmt::format("slurm-{}.{}", job, step ? step : "");
  return "";
}

void join_rendezvous(const LaunchInfo& li) {
  std::lock_guard<std::mutex> lock(g_rendezvous_mu);
  if (g_rendezvous) return;
  g_rendezvous_tried = true;
#if !defined(STRATA_HAVE_GLOO)
  if (!built_with_cuda())
    STRATA_THROW(kUnsupported,
                 "this process is rank {} of {} started by {} without MPI, and this build has "
                 "neither Gloo (CPU ranks) nor NCCL (GPU ranks) to join its peers with: install "
                 "libgloo-dev (scripts/setup.sh) and rebuild, or start the job with mpirun",
                 li.rank, li.world_size, li.launcher);
#endif
  comm::RendezvousOptions o;
  o.addr = li.master_addr;
  o.port = li.master_port;
  o.rank = li.rank;
  o.world_size = li.world_size;
  o.timeout_s = comm::rendezvous_timeout_s();
  o.token = job_token();
  g_rendezvous = std::make_unique<comm::TcpStore>(o);
  log::debug("rank {} of {} joined the rendezvous at {} (this host: {})", li.rank, li.world_size,
             g_rendezvous->endpoint(), g_rendezvous->local_address());
}
}  // namespace

LaunchInfo init_launch() {
  const comm::EnvLaunch e = env_launch();
  if (!e.refusal.empty()) STRATA_THROW(kUnsupported, "{}", e.refusal);
  const LaunchInfo env = launch_info();
  if (!env.under_mpi) {
    if (env.world_size > 1) join_rendezvous(env);
    return env;
  }
#if defined(STRATA_HAVE_MPI)
  std::call_once(g_init_once, [] {
    int initialized = 0;
    MPI_Initialized(&initialized);
    int provided = 0;
    if (!initialized) {
      const int rc = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided);
      if (rc != MPI_SUCCESS)
        detail::throw_error(ErrorKind::kMpi, __FILE__, __LINE__, "MPI_Init_thread",
                            "MPI failed to initialize under the launcher; check the mpirun / srun "
                            "command (srun needs --mpi=pmix)",
                            mpi_error_text(rc));
      g_we_initialized = true;
      std::atexit(finalize_at_exit);
    } else {
      MPI_Query_thread(&provided);
    }
    // Collectives run on a communicator's worker while the watchdog may call MPI_Abort from
    // its own thread: that needs MPI_THREAD_MULTIPLE (OpenMPI 4.1 provides it).
    if (provided < MPI_THREAD_MULTIPLE)
      STRATA_THROW(
          kMpi,
          "MPI provides thread level {} but strata needs MPI_THREAD_MULTIPLE ({}); use an MPI "
          "built with thread-multiple support{}",
          provided, int(MPI_THREAD_MULTIPLE),
          initialized ? ", or initialize MPI with MPI_Init_thread(MPI_THREAD_MULTIPLE)" : "");
  });
  // Every rank, here: the shared-memory split is a collective, taken once.
  std::lock_guard<std::mutex> lock(g_view_mu);
  if (!g_mpi_view && comm::mpi_active()) g_mpi_view = mpi_view(env);
  return g_mpi_view ? *g_mpi_view : env;
#else
  STRATA_THROW(kUnsupported,
               "started by an MPI launcher ({}, rank {} of {}) but this build has no MPI; install "
               "libopenmpi-dev and rebuild, or run a single process without mpirun",
               env.launcher, env.rank, env.world_size);
#endif
}

namespace comm {

TcpStore* rendezvous_store() {
  std::lock_guard<std::mutex> lock(g_rendezvous_mu);
  return g_rendezvous.get();
}

void bootstrap_broadcast_bytes(void* data, std::size_t bytes, double timeout_s) {
  if (mpi_active()) return mpi_broadcast_bytes(data, bytes);
  TcpStore* store = rendezvous_store();
  STRATA_REQUIRE(store,
                 "a multi-rank bootstrap needs MPI or the launch's TCP rendezvous; start the job "
                 "with mpirun, torchrun or srun");
  // One key per broadcast: every rank makes them in the same order.
  static std::atomic<int> n{0};
  const std::string key = fmt::format("bootstrap/{}", n++);
  if (store->options().rank == 0) {
    store->set(key, std::string(static_cast<const char*>(data), bytes));
    return;
  }
  const std::string v = store->get(key, timeout_s);
  STRATA_CHECK(v.size() == bytes, "bootstrap broadcast: {} bytes from rank 0, {} expected",
               v.size(), bytes);
  std::memcpy(data, v.data(), bytes);
}

#if defined(STRATA_HAVE_MPI)
bool mpi_active() {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  return initialized && !finalized;
}

void mpi_broadcast_bytes(void* data, std::size_t bytes) {
  const int rc = MPI_Bcast(data, static_cast<int>(bytes), MPI_BYTE, 0, MPI_COMM_WORLD);
  if (rc != MPI_SUCCESS)
    detail::throw_error(ErrorKind::kMpi, __FILE__, __LINE__, "MPI_Bcast",
                        "bootstrap broadcast failed", mpi_error_text(rc));
}

void abort_job(const std::string& message, int exit_code) {
  log::error("{}", message);
  remove_swap_files_now();  // no destructor runs past here: the swap files would stay on the drive
  if (mpi_active()) {
    // MPI_Abort asks mpirun to end every rank; with a node unreachable (its link down) Open MPI
    // 4.1 blocks there for ever (measured across network namespaces). This rank ends regardless.
    std::thread([exit_code] {
      std::this_thread::sleep_for(std::chrono::seconds(10));
      log::error(
          "MPI_Abort has not ended this rank after 10 s (the launcher cannot reach a node?); "
          "exiting");
      std::_Exit(exit_code);
    }).detach();
    MPI_Abort(MPI_COMM_WORLD, exit_code);
  }
  std::_Exit(exit_code);
}

void end_job_if_one_of_many_impl(const std::string& message, bool join_if_not_up) {
  if (!mpi_active()) {
    if (!join_if_not_up) return;
    // Failed before MPI was up (a bad flag, a missing file) while the peers go on into MPI_Init:
    // mpirun ends the job on this rank's non-zero exit, but srun (without --kill-on-bad-exit)
    // and other launchers leave them waiting there for ever. Join them, then abort.
    const LaunchInfo li = launch_info();
    if (!li.under_mpi || li.world_size <= 1) return;
    try {
      init_launch();
    } catch (const std::exception&) {
      return;
    }
    if (!mpi_active()) return;
  }
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  if (size > 1)
    abort_job(fmt::format("rank {} of {} stopped: {}; ending the job", rank, size, message), 1);
}
#else
bool mpi_active() { return false; }

void mpi_broadcast_bytes(void*, std::size_t) {
  STRATA_THROW(kUnsupported,
               "a multi-rank bootstrap needs MPI, and this build has none; install "
               "libopenmpi-dev and rebuild");
}

void abort_job(const std::string& message, int exit_code) {
  log::error("{}", message);
  remove_swap_files_now();
  std::_Exit(exit_code);
}

void end_job_if_one_of_many_impl(const std::string&, bool) {}

std::unique_ptr<Communicator> make_mpi_communicator(Device& device, double) {
  STRATA_THROW(kUnsupported,
               "no MPI communicator for {}: this build has no MPI; install libopenmpi-dev "
               "and rebuild",
               device.name());
}
#endif

}  // namespace comm
void end_job_if_one_of_many(const std::string& message, bool join_if_not_up) {
  const LaunchInfo li = launch_info();
  if (!li.under_mpi && li.world_size > 1) {
    // torchrun / srun without MPI: the peers may wait at the rendezvous (join it, so that they
    // get past it and hear why) or in the store; a peer in a collective finds this process's
    // connections closed when it exits.
    bool tried = false;
    {
      std::lock_guard<std::mutex> lock(g_rendezvous_mu);
      tried = g_rendezvous_tried;
    }
    if (join_if_not_up && !tried) {
      try {
        init_launch();
      } catch (const std::exception&) {
        return;
      }
    }
    if (comm::TcpStore* store = comm::rendezvous_store())
      store->abort(fmt::format("{}; ending the job", message));
    return;
  }
  comm::end_job_if_one_of_many_impl(message, join_if_not_up);
}

}  // namespace strata
