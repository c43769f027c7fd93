# strata-prof: the step-time model and search on synthetic measurements, and the command line
# end to end (its recommendation accepted by strata-train; an impossible request explained).
# ProfCli.*Ranks* run only in prof_mpi (STRATA_TEST_MPI=1; skipped in the discovered entry),
# which spawns mpirun itself.
find_package(MPI COMPONENTS C)
set(strata_prof_defines STRATA_PROF_BIN="$<TARGET_FILE:strata-prof>" STRATA_TRAIN_BIN="$<TARGET_FILE:strata-train>"
    STRATA_SOURCE_DIR="${PROJECT_SOURCE_DIR}")
if(MPI_C_FOUND AND MPIEXEC_EXECUTABLE)
  list(APPEND strata_prof_defines STRATA_MPIEXEC="${MPIEXEC_EXECUTABLE}")
endif()
strata_add_test(prof_test SOURCES prof_test.cpp LABELS unit DEFINES ${strata_prof_defines})
add_dependencies(prof_test strata-prof strata-train)
if(MPI_C_FOUND AND MPIEXEC_EXECUTABLE)
  add_test(NAME prof_mpi COMMAND prof_test --gtest_filter=ProfCli.*Ranks*)
  set(strata_prof_mpi_env STRATA_TEST_MPI=1)
  if(STRATA_SANITIZE)
    list(APPEND strata_prof_mpi_env ASAN_OPTIONS=detect_leaks=0)  # OpenMPI's own leaks (see comm_tests.cmake)
  endif()
  set_tests_properties(prof_mpi PROPERTIES LABELS "unit;prof;mpi" TIMEOUT 300 PROCESSORS 2
                                           ENVIRONMENT "${strata_prof_mpi_env}")
endif()
# The model held to the engine: each placement class's step traced on the emulated device and
# replayed by the model, stream by stream (see conformance_test.cpp).
strata_add_test(conformance_test SOURCES conformance_test.cpp LABELS unit)
target_link_libraries(conformance_test PRIVATE strata_trainer)
if(MPI_C_FOUND AND MPIEXEC_EXECUTABLE)
  add_test(NAME conformance_ranks_2
           COMMAND ${MPIEXEC_EXECUTABLE} -np 2 --oversubscribe $<TARGET_FILE:conformance_test>
                   --gtest_filter=Placements/ConformanceRanks.*)
  set(strata_conformance_env OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 STRATA_COMM_TIMEOUT_S=120)
  if(STRATA_SANITIZE)
    list(APPEND strata_conformance_env ASAN_OPTIONS=detect_leaks=0)  # OpenMPI's own leaks (see comm_tests.cmake)
  endif()
  set_tests_properties(conformance_ranks_2 PROPERTIES LABELS "unit;mpi" TIMEOUT 300 PROCESSORS 2
                                                      ENVIRONMENT "${strata_conformance_env}")
endif()
