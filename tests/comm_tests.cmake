# Collectives (src/comm). comm_test runs as one plain process (local backend) and under
# mpirun with 2 and 4 ranks (MPI backend on the CPU-emulated device); comm_fault_test
# kills or stalls one of 4 ranks and checks that the others end with a clear error quickly.
# comm_gpu_test: NCCL with one rank, label gpu, skipped without a GPU.
find_package(MPI COMPONENTS C)

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
endif()
