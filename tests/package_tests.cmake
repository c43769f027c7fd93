# The relocatable package (cmake/package.cmake) unpacked into a minimal Debian 12 root and run
# there through chroot (tests/package_test.sh): label `package`. Needs root and the Debian
# mirror the first time (the root is cached in /var/cache/strata); reports Skipped otherwise.
# Not in sanitizer builds: the package is a release artifact.
if(NOT STRATA_SANITIZE)
  get_property(strata_cuda_sonames GLOBAL PROPERTY STRATA_CUDA_SONAMES)
  get_property(strata_cuda_lib_dirs GLOBAL PROPERTY STRATA_CUDA_LIB_DIRS)
  add_test(NAME package_debootstrap
           COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/package_test.sh ${PROJECT_BINARY_DIR}
                   "${strata_cuda_sonames}" "${strata_cuda_lib_dirs}")
  set_tests_properties(package_debootstrap PROPERTIES LABELS package SKIP_RETURN_CODE 77 TIMEOUT 900)
endif()
