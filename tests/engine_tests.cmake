strata_add_test(engine_test SOURCES engine_test.cpp LABELS unit)
