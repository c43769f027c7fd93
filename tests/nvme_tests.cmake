strata_add_test(nvme_test SOURCES nvme_test.cpp LABELS unit)
