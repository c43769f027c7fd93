# strata-prof: the step-time model and search on synthetic measurements, and the command line
# end to end (its recommendation accepted by strata-train; an impossible request explained).
strata_add_test(prof_test SOURCES prof_test.cpp LABELS unit
                DEFINES STRATA_PROF_BIN="$<TARGET_FILE:strata-prof>" STRATA_TRAIN_BIN="$<TARGET_FILE:strata-train>")
add_dependencies(prof_test strata-prof strata-train)
