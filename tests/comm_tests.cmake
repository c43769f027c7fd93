# Collectives (src/comm). comm_test runs as one plain process (local backend), under
# mpirun with 2 and 4 ranks (MPI backend on the CPU-emulated device) and as 2 and 4 ranks
# started the way torchrun starts them (torchrun_ranks.sh: Gloo over the TCP rendezvous);
# comm_fault_test kills or stalls one of 4 ranks and checks that the others end with a clear
# error quickly, under both launchers. comm_gpu_test: NCCL with one rank, label gpu, skipped
# without a GPU. launch_test: the launchers' variables and the rendezvous, in one process.
find_package(MPI COMPONENTS C)
find_package(Gloo CONFIG QUIET)

strata_add_test(launch_test SOURCES launch_test.cpp LABELS "unit;comm")

add_executable(comm_test comm_test.cpp)
target_include_directories(comm_test PRIVATE ${PROJECT_SOURCE_DIR}/src)
target_link_libraries(comm_test PRIVATE strata GTest::gtest)
add_test(NAME comm_local COMMAND comm_test)
set_tests_properties(comm_local PROPERTIES LABELS "unit;comm" TIMEOUT 120)

strata_add_test(comm_gpu_test SOURCES comm_test.cpp LABELS gpu DEFINES STRATA_TEST_CUDA=1)
if(TARGET comm_gpu_test)
  # The suite has its own main (MPI-aware); gtest_main's is not used.
  target_link_libraries(comm_gpu_test PRIVATE GTest::gtest)
endif()

if(MPI_C_FOUND AND MPIEXEC_EXECUTABLE)
  # Root in a container is common here; OpenMPI refuses it without these two variables.
  set(strata_mpi_env OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 STRATA_COMM_TIMEOUT_S=60)
  if(STRATA_SANITIZE)
    # OpenMPI 4.1 leaks its own start-up allocations (opal/ompi frames only, none of ours):
    # LeakSanitizer stays on everywhere else; ASan and UBSan stay on here.
    list(APPEND strata_mpi_env ASAN_OPTIONS=detect_leaks=0)
  endif()
  foreach(np 2 4)
    add_test(NAME comm_mpi_${np}
             COMMAND ${MPIEXEC_EXECUTABLE} -np ${np} --oversubscribe $<TARGET_FILE:comm_test>)
    set_tests_properties(comm_mpi_${np} PROPERTIES LABELS "unit;comm;mpi" TIMEOUT 180
                         ENVIRONMENT "${strata_mpi_env}" PROCESSORS ${np})
  endforeach()

  if(TARGET gloo)
    foreach(np 2 4)
      add_test(NAME comm_gloo_${np}
               COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/torchrun_ranks.sh ${np} $<TARGET_FILE:comm_test>)
      set_tests_properties(comm_gloo_${np} PROPERTIES LABELS "unit;comm;gloo" TIMEOUT 180
                           ENVIRONMENT "STRATA_COMM_TIMEOUT_S=60" PROCESSORS ${np})
    endforeach()
    # The same as the tasks of a Slurm step without --mpi (srun): rank 0's host from the node list.
    add_test(NAME comm_gloo_slurm_2
             COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/torchrun_ranks.sh 2 $<TARGET_FILE:comm_test>)
    set_tests_properties(comm_gloo_slurm_2 PROPERTIES LABELS "unit;comm;gloo" TIMEOUT 180
                         ENVIRONMENT "STRATA_COMM_TIMEOUT_S=60;STRATA_TEST_LAUNCHER=slurm"
                         PROCESSORS 2)
    # Two ranks on "two nodes" (a host name of each one's own: a UTS namespace; root): tensor
    # parallelism across them is refused. Skipped (77) where unshare cannot make the namespace.
    add_test(NAME comm_gloo_tp_across_nodes
             COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/torchrun_ranks.sh 2 sh -c
                     "unshare -u true 2>/dev/null || exit 77; exec unshare -u sh -c 'hostname strata-host-$RANK && exec \"$0\" --gtest_filter=Collectives.ProcessGroups*' \"$0\""
                     $<TARGET_FILE:comm_test>)
    set_tests_properties(comm_gloo_tp_across_nodes PROPERTIES LABELS "unit;comm;gloo" TIMEOUT 180
                         ENVIRONMENT "STRATA_COMM_TIMEOUT_S=60;STRATA_TEST_HOST_PER_RANK=1"
                         PROCESSORS 2 SKIP_RETURN_CODE 77)
  endif()

  add_executable(comm_fault_test comm_fault_test.cpp)
  target_link_libraries(comm_fault_test PRIVATE strata MPI::MPI_C)
  target_compile_definitions(comm_fault_test PRIVATE OMPI_SKIP_MPICXX=1 MPICH_SKIP_MPICXX=1)
  foreach(mode kill hang truncate owned)
    add_test(NAME comm_fault_${mode}
             COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/comm_fault.sh ${MPIEXEC_EXECUTABLE}
                     $<TARGET_FILE:comm_fault_test> ${mode})
    set_tests_properties(comm_fault_${mode} PROPERTIES LABELS "unit;comm;mpi" TIMEOUT 120
                         ENVIRONMENT "${strata_mpi_env}"
                         PROCESSORS 4)
  endforeach()
  if(TARGET gloo)
    foreach(mode kill hang)
      add_test(NAME comm_fault_gloo_${mode}
               COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/comm_fault.sh
                       ${CMAKE_CURRENT_SOURCE_DIR}/torchrun_ranks.sh
                       $<TARGET_FILE:comm_fault_test> ${mode})
      set_tests_properties(comm_fault_gloo_${mode} PROPERTIES LABELS "unit;comm;gloo" TIMEOUT 120
                           PROCESSORS 4)
    endforeach()
    # Gloo's hang waits out the watchdog with every rank asleep (0.7 CPU-s in its 15 s, AMD EPYC
    # Zen 5 2-core VM, 2026-12-06): it takes no CPU from the tests beside it. (MPI's spins.)
    set_tests_properties(comm_fault_gloo_hang PROPERTIES PROCESSORS 1)
  endif()
endif()
