# strata-train: the model <-> engine bridge, and the command line end to end.
strata_add_test(train_bridge_test SOURCES train_bridge_test.cpp LABELS unit)
target_link_libraries(train_bridge_test PRIVATE strata_trainer)
# Checkpoints and resume: in process (Engine::save_state/load_state) and end to end (the
# strata-train binary killed with SIGKILL, crashing mid-checkpoint, resumed).
strata_add_test(train_checkpoint_test SOURCES train_checkpoint_test.cpp LABELS unit
                DEFINES STRATA_TRAIN_BIN="$<TARGET_FILE:strata-train>" STRATA_EXPORT_BIN="$<TARGET_FILE:strata-export>")
target_link_libraries(train_checkpoint_test PRIVATE strata_trainer)
add_dependencies(train_checkpoint_test strata-train strata-export)
# A model strata::train saved with --out (fp32 / bf16, one file / shards, Llama / GPT-2) read from
# the folder alone by the PyTorch reference (tests/oracle/model_ref.py; skipped where
# /usr/bin/python3 cannot import torch): its logits match ours from the same folder.
strata_add_test(train_oracle_test SOURCES train_oracle_test.cpp LABELS unit
                DEFINES STRATA_SOURCE_DIR="${PROJECT_SOURCE_DIR}")
target_link_libraries(train_oracle_test PRIVATE strata_trainer)
# The command line end to end (offload on/off, bad flags, --out/--overwrite) and strata-export.
# The 2-rank comparison (TrainCli.TwoRanks*) runs only in train_cli_mpi (STRATA_TEST_MPI=1; skipped in
# the discovered entry), which spawns mpirun itself.
find_package(MPI COMPONENTS C)
set(strata_train_cli_defines STRATA_TRAIN_BIN="$<TARGET_FILE:strata-train>"
    STRATA_EXPORT_BIN="$<TARGET_FILE:strata-export>")
find_package(Gloo CONFIG QUIET)
if(TARGET gloo)
  # Ranks with torchrun's variables (no MPI): TCP rendezvous + Gloo.
  list(APPEND strata_train_cli_defines
       STRATA_TORCHRUN_RANKS="${CMAKE_CURRENT_SOURCE_DIR}/torchrun_ranks.sh")
endif()
if(MPI_C_FOUND AND MPIEXEC_EXECUTABLE)
  list(APPEND strata_train_cli_defines STRATA_MPIEXEC="${MPIEXEC_EXECUTABLE}")
endif()
strata_add_test(train_cli_test SOURCES train_cli_test.cpp LABELS unit DEFINES ${strata_train_cli_defines})
target_link_libraries(train_cli_test PRIVATE strata_trainer)
target_include_directories(train_cli_test PRIVATE ${PROJECT_SOURCE_DIR}/src)
add_dependencies(train_cli_test strata-train strata-export)
if(MPI_C_FOUND AND MPIEXEC_EXECUTABLE)
  add_test(NAME train_cli_mpi
           COMMAND train_cli_test
                   --gtest_filter=TrainCli.TwoRanks*:-TrainCli.TwoRanksReshardHoldsNoMoreMemoryThanAResume)
  set(strata_train_mpi_env STRATA_TEST_MPI=1)
  if(STRATA_SANITIZE)
    list(APPEND strata_train_mpi_env ASAN_OPTIONS=detect_leaks=0)  # OpenMPI's own leaks (see comm_tests.cmake)
  endif()
  # Its ranks wait on each other, on timeouts and on the drive more than they compute: 0.7 of a
  # core on average (15.7 CPU-s in 21-24 s, AMD EPYC Zen 5 2-core VM, 2026-12-06), so it runs
  # beside another test rather than alone.
  set_tests_properties(train_cli_mpi PROPERTIES LABELS "unit;train;mpi" TIMEOUT 300 PROCESSORS 1)
  set_tests_properties(train_cli_mpi PROPERTIES ENVIRONMENT "${strata_train_mpi_env}")
  # One 2-rank save, then six resumes of one rank with the state on NVMe, their peak RSS compared:
  # a core for the most part (21 s, a third of it busy, AMD EPYC Zen 5 2-core VM, 2026-12-06).
  add_test(NAME train_cli_mpi_reshard_rss
           COMMAND train_cli_test --gtest_filter=TrainCli.TwoRanksReshardHoldsNoMoreMemoryThanAResume)
  set_tests_properties(train_cli_mpi_reshard_rss PROPERTIES LABELS "unit;train;mpi" TIMEOUT 300
                       PROCESSORS 1 ENVIRONMENT "${strata_train_mpi_env}")
  if(TARGET gloo)
    # TrainCli.Torchrun*: 2 and 4 torchrun-style ranks (Gloo) against the same under mpirun, and
    # failed checkpoint saves (a rank's files, a leader's manifest) ending every rank.
    add_test(NAME train_cli_torchrun COMMAND train_cli_test --gtest_filter=TrainCli.Torchrun*)
    # 0.65 of a core on average (8.0-8.7 CPU-s in 12.5-12.9 s, the same VM): beside another test.
    set_tests_properties(train_cli_torchrun PROPERTIES LABELS "unit;train;gloo;mpi" TIMEOUT 600
                         PROCESSORS 1 ENVIRONMENT "${strata_train_mpi_env};STRATA_TEST_TORCHRUN=1")
  endif()
endif()
