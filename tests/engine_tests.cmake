strata_add_test(engine_test SOURCES engine_test.cpp LABELS unit)
# The same suite on CudaDevice (1 rank, local communicator): skipped without a GPU.
strata_add_test(engine_gpu_test SOURCES engine_test.cpp LABELS gpu DEFINES STRATA_TEST_CUDA=1)

# Across ranks: mpirun with 2 and 4 ranks against one rank with the whole batch.
find_package(MPI COMPONENTS C)
add_executable(engine_mpi_test engine_mpi_test.cpp)
target_include_directories(engine_mpi_test PRIVATE ${CMAKE_CURRENT_SOURCE_DIR})
target_link_libraries(engine_mpi_test PRIVATE strata strata_trainer GTest::gtest)
add_test(NAME engine_ranks_1 COMMAND engine_mpi_test)
set_tests_properties(engine_ranks_1 PROPERTIES LABELS "unit;engine" TIMEOUT 300)
if(MPI_C_FOUND AND MPIEXEC_EXECUTABLE)
  set(strata_engine_mpi_env OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 STRATA_COMM_TIMEOUT_S=120)
  if(STRATA_SANITIZE)
    list(APPEND strata_engine_mpi_env ASAN_OPTIONS=detect_leaks=0)  # OpenMPI's own leaks (see comm_tests.cmake)
  endif()
  foreach(np 2 4)
    add_test(NAME engine_ranks_${np}
             COMMAND ${MPIEXEC_EXECUTABLE} -np ${np} --oversubscribe $<TARGET_FILE:engine_mpi_test>)
    set_tests_properties(engine_ranks_${np} PROPERTIES LABELS "unit;engine;mpi" TIMEOUT 300
                         ENVIRONMENT "${strata_engine_mpi_env}" PROCESSORS ${np})
  endforeach()
endif()
