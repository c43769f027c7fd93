# The picture of a run: the SVG, the log read back, strata-plot and strata-train --plot end to end,
# and the SVG rendered by headless Chromium into a PNG that the stdlib-only oracle
# (oracle/png_stats.py) counts (SKIPPED without chromium or python3).
strata_add_test(plot_test SOURCES plot_test.cpp LABELS unit
                DEFINES STRATA_PLOT_BIN="$<TARGET_FILE:strata-plot>"
                        STRATA_TRAIN_BIN="$<TARGET_FILE:strata-train>"
                        STRATA_PNG_ORACLE="${CMAKE_CURRENT_SOURCE_DIR}/oracle/png_stats.py")
target_link_libraries(plot_test PRIVATE strata_trainer)
add_dependencies(plot_test strata-plot strata-train)
