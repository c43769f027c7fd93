# ds_config parsing and the memory planner (src/scheduler/config.cpp, planner.cpp).
strata_add_test(engine_config_test SOURCES engine_config_test.cpp LABELS unit)
