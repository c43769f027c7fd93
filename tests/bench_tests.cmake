# strata-bench's command line: bad input refused before anything is written, --json's last line,
# a measured failure reported with its figures last (gpu --rehearse, on the CPU).
strata_add_test(bench_cli_test SOURCES bench_cli_test.cpp LABELS unit
                DEFINES STRATA_BENCH_BIN="$<TARGET_FILE:strata-bench>")
add_dependencies(bench_cli_test strata-bench)
