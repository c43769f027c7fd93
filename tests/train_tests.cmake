# strata-train: the model <-> engine bridge, and the command line end to end.
strata_add_test(train_bridge_test SOURCES train_bridge_test.cpp LABELS unit)
target_link_libraries(train_bridge_test PRIVATE strata_trainer)
# Checkpoints and resume: in process (Engine::save_state/load_state) and end to end (the
# strata-train binary killed with SIGKILL, crashing mid-checkpoint, resumed).
strata_add_test(train_checkpoint_test SOURCES train_checkpoint_test.cpp LABELS unit
                DEFINES STRATA_TRAIN_BIN="$<TARGET_FILE:strata-train>")
target_link_libraries(train_checkpoint_test PRIVATE strata_trainer)
add_dependencies(train_checkpoint_test strata-train)
