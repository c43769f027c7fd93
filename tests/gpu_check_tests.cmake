# gpu_check_skipped (label unit): tools/gpu-check.sh where no GPU is usable must run what it can
# (the gpu test binaries, strata-bench gpu), report SKIPPED for each part and write a
# well-formed gpu-check.json; seconds, no root, no network, so it is a unit test. Skipped
# (exit 77) where a GPU is usable: there the check itself is run, not this test.
# gpu_check_verdicts (label unit): its verdicts on fake GPU machines (tests/gpu_check_fake_test.sh).
add_test(NAME gpu_check_verdicts COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/gpu_check_fake_test.sh ${PROJECT_SOURCE_DIR})
set_tests_properties(gpu_check_verdicts PROPERTIES LABELS unit SKIP_RETURN_CODE 77 TIMEOUT 120)
if(NOT STRATA_HAVE_CUDA)
  return()  # no gpu test binaries to run
endif()
add_test(NAME gpu_check_skipped
         COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/gpu_check_test.sh ${PROJECT_BINARY_DIR} ${PROJECT_SOURCE_DIR})
set_tests_properties(gpu_check_skipped PROPERTIES LABELS unit SKIP_RETURN_CODE 77 TIMEOUT 300)
