// Launch: where this process sits in the job, and MPI's life in the process.
//
// Before MPI is initialized the launcher's environment says it all (mpirun, srun with PMIx,
// MPICH's hydra); reading it never initializes MPI, so a plain process stays a plain
// process and picks the local communicator without MPI ever starting (no singleton
// MPI_Init, which would spawn an ORTE daemon). init_launch() initializes MPI with
// MPI_THREAD_MULTIPLE at most once and finalizes it at exit, and only if strata was the one
// to initialize it: a program that owns MPI keeps owning it.
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <optional>
#include <string>

#if defined(STRATA_HAVE_MPI)
#include <mpi.h>
#endif

#include "comm/comm_internal.h"
#include "strata/comm.h"
#include "strata/error.h"
#include "strata/log.h"
#include "strata/nvme.h"

namespace strata {
namespace {

// The first of `names` set to an integer, else -1.
int env_int(std::initializer_list<const char*> names) {
  for (const char* n : names) {
    const char* v = std::getenv(n);
    if (!v || !*v) continue;
    char* end = nullptr;
    const long x = std::strtol(v, &end, 10);
    if (end != v && x >= 0) return static_cast<int>(x);
  }
  return -1;
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
  LaunchInfo li;
  if (std::getenv("OMPI_COMM_WORLD_RANK")) {
    li.launcher = "openmpi";
    li.rank = env_int({"OMPI_COMM_WORLD_RANK"});
    li.world_size = env_int({"OMPI_COMM_WORLD_SIZE"});
    li.local_rank = env_int({"OMPI_COMM_WORLD_LOCAL_RANK"});
    li.local_size = env_int({"OMPI_COMM_WORLD_LOCAL_SIZE"});
  } else if (std::getenv("PMIX_RANK")) {
    // srun --mpi=pmix: PMIx gives the rank, Slurm the step's sizes.
    li.launcher = "pmix";
    li.rank = env_int({"PMIX_RANK"});
    li.world_size = env_int({"SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "PMIX_SIZE"});
    li.local_rank = env_int({"SLURM_LOCALID", "PMIX_LOCAL_RANK"});
    li.local_size = env_int({"PMIX_LOCAL_SIZE"});
  } else if (std::getenv("PMI_RANK")) {
    li.launcher = "pmi";  // MPICH hydra, srun --mpi=pmi2
    li.rank = env_int({"PMI_RANK"});
    li.world_size = env_int({"PMI_SIZE", "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"});
    li.local_rank = env_int({"MPI_LOCALRANKID", "SLURM_LOCALID"});
    li.local_size = env_int({"MPI_LOCALNRANKS"});
  }
  if (li.launcher != "none") {
    li.under_mpi = true;
    if (li.rank < 0) li.rank = 0;
    if (li.world_size < 1) li.world_size = 1;
    if (li.local_rank < 0) li.local_rank = 0;
    if (li.local_size < 1) li.local_size = 1;  // refined by MPI once it is up
  }
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
// Signs of a multi-process launch that strata cannot join without MPI's variables: torchrun's
// (RANK, WORLD_SIZE > 1) or a Slurm step of several tasks started without --mpi. Left alone,
// each such process would train by itself as rank 0 of 1 (on GPU 0), silently.
void refuse_launch_without_mpi() {
  const int world = env_int({"WORLD_SIZE"});
  if (world > 1 && std::getenv("RANK")) {
    const char* addr = std::getenv("MASTER_ADDR");
    const char* port = std::getenv("MASTER_PORT");
    STRATA_THROW(kUnsupported,
                 "this process was started as rank {} of {} by a torchrun-style launcher (RANK, "
                 "WORLD_SIZE{}) and "
                 "strata joins several processes only under an MPI launcher: start it with mpirun "
                 "-np {} (or srun "
                 "--mpi=pmix); alone it would train as a 1-rank job",
                 env_int({"RANK"}), world,
                 addr || port
                     ? fmt::format(", MASTER_ADDR {}:{}", addr ? addr : "?", port ? port : "?")
                     : "",
                 world);
  }
  const int tasks = env_int({"SLURM_STEP_NUM_TASKS"});
  if (tasks > 1 && std::getenv("SLURM_PROCID"))
    STRATA_THROW(kUnsupported,
                 "this process is task {} of a {}-task Slurm step started without MPI's process "
                 "management: run "
                 "srun with --mpi=pmix (or pmi2), so the tasks can join as one job; alone each "
                 "would train as a "
                 "1-rank job",
                 env_int({"SLURM_PROCID"}), tasks);
}
}  // namespace

LaunchInfo init_launch() {
  const LaunchInfo env = launch_info();
  if (!env.under_mpi) {
    refuse_launch_without_mpi();
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
  if (mpi_active()) MPI_Abort(MPI_COMM_WORLD, exit_code);
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
  comm::end_job_if_one_of_many_impl(message, join_if_not_up);
}

}  // namespace strata
