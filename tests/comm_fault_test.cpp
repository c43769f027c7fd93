// The failure half of the collectives suite, run by comm_fault.sh under mpirun -np 4:
//   kill  rank 2 SIGKILLs itself in the middle of a stream of all-reduces; the launcher ends
//         the job and every survivor says which collective it was in, its rank and for how long.
//   hang  rank 1 stops issuing collectives (alive, but stuck); the others' watchdogs fire after
//         STRATA_COMM_TIMEOUT_S and end the job with the collective, the rank and the elapsed time.
// Either way the job must end non-zero within 60 s: never a silent hang.
#include <signal.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <thread>
#include <vector>

#include "strata/comm.h"
#include "strata/device.h"
#include "strata/error.h"
#include "strata/nvme.h"

int main(int argc, char** argv) {
  using namespace strata;
  if (argc != 2 || (std::strcmp(argv[1], "kill") != 0 && std::strcmp(argv[1], "hang") != 0)) {
    std::fprintf(stderr, "usage: comm_fault_test kill|hang (under mpirun -np 4)\n");
    return 2;
  }
  const bool kill_mode = std::strcmp(argv[1], "kill") == 0;
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
    for (int i = 0;; ++i) {
      if (i == 50 && li.rank == 2 && kill_mode) ::raise(SIGKILL);
      if (i == 50 && li.rank == 1 && !kill_mode) std::this_thread::sleep_for(std::chrono::seconds(120));
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
