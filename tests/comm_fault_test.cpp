// The failure half of the collectives suite, run by comm_fault.sh under mpirun -np 4:
//   kill  rank 2 SIGKILLs itself in the middle of a stream of all-reduces; the launcher ends
//         the job and every survivor says which collective it was in, its rank and for how long.
//   hang  rank 1 stops issuing collectives (alive, but stuck); the others' watchdogs fire after
//         STRATA_COMM_TIMEOUT_S and end the job with the collective, the rank and the elapsed time.
//   truncate  rank 3 all-gathers bf16 where the others gather fp32 (no STRATA_COMM_CHECK): the
//         error names MPI's own cause (MPI_ERR_TRUNCATE, not "error code in status") and the fix.
// Either way the job must end non-zero within 60 s: never a silent hang.
//   owned  not a fault: the program initializes MPI itself, and rank 0 alone asks launch_info()
//         before init_launch(): it must return (it took a collective, and hung), exit 0.
#include <mpi.h>
#include <signal.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "strata/comm.h"
#include "strata/device.h"
#include "strata/error.h"
#include "strata/nvme.h"

int main(int argc, char** argv) {
  using namespace strata;
  const std::string mode = argc == 2 ? argv[1] : "";
  if (mode != "kill" && mode != "hang" && mode != "truncate" && mode != "owned") {
    std::fprintf(stderr, "usage: comm_fault_test kill|hang|truncate|owned (under mpirun -np 4)\n");
    return 2;
  }
  const bool kill_mode = mode == "kill";
  if (mode == "owned") {
    int provided = 0;
    MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
    int rank = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    if (rank == 0) {
      const LaunchInfo li = launch_info();  // alone: not a collective
      std::printf("rank 0: launch_info says rank %d of %d\n", li.rank, li.world_size);
      std::fflush(stdout);
    }
    MPI_Barrier(MPI_COMM_WORLD);
    const LaunchInfo li = init_launch();  // every rank: the view MPI gives, the local split too
    std::printf("rank %d: init_launch says rank %d of %d, local %d of %d\n", rank, li.rank,
                li.world_size, li.local_rank, li.local_size);
    MPI_Finalize();
    return li.rank == rank && li.world_size == 4 && li.local_size == 4 ? 0 : 1;
  }
  // As strata-train and strata-prof do: their swap-file clean-up is installed first, and the
  // launcher's SIGTERM must still print the note (the two handlers chain).
  remove_swap_files_on_interrupt();
  try {
    const LaunchInfo li = init_launch();
    auto dev = make_host_device({});
    auto comm = make_communicator(*dev);
    auto s = dev->create_stream("comm");
    const std::size_t n = 1000;
    Buffer x = dev->alloc(n * 4);
    s->fill(tensor(x, DType::kF32, n), 1.0f);
    if (mode == "truncate") {
      const DType t = li.rank == 3 ? DType::kBF16 : DType::kF32;
      Buffer out = dev->alloc(4 * n * std::size_t(li.world_size));
      comm->all_gather(tensor(x, t, n), tensor(out, t, n * std::size_t(li.world_size)), *s);
      s->synchronize();
      std::this_thread::sleep_for(
          std::chrono::seconds(120));  // the failing rank ends the job first
      return 0;
    }
    for (int i = 0;; ++i) {
      if (i == 50 && li.rank == 2 && kill_mode) ::raise(SIGKILL);
      if (i == 50 && li.rank == 1 && !kill_mode)
        std::this_thread::sleep_for(std::chrono::seconds(120));
      comm->all_reduce(tensor(x, DType::kF32, n), ReduceOp::kMax, *s);
      if (i % 10 == 0) s->synchronize();
      // Bounded, should the fault somehow not end the job: then this exits 0 and the check fails.
      if (i == 2000000) break;
    }
  } catch (const Error& e) {
    std::fprintf(stderr, "comm_fault_test: %s\n", e.what());
    return 1;
  }
  return 0;
}
