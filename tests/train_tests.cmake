# strata-train: the model <-> engine bridge, and the command line end to end.
strata_add_test(train_bridge_test SOURCES train_bridge_test.cpp LABELS unit)
target_link_libraries(train_bridge_test PRIVATE strata_trainer)
