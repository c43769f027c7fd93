# The relocatable package: `cmake --install <build> --prefix DIR` or `cpack` (the `package`
# target) lay out
#   bin/  strata-info, strata-train, strata-export, strata-generate, strata-plot, strata-bench,
#         strata-prof, strata-prep, gpu-check.sh
#   lib/  strata's shared libraries, the CUDA module, and every shared library they load that a
#         minimal Debian 12 root (debootstrap --variant=minbase) does not have
#   include/strata/  the public headers (include/strata/ of the source tree)
# so unpacking it anywhere is enough: strata's binaries carry RUNPATH $ORIGIN/../lib (set at
# link time, CMAKE_INSTALL_RPATH), the bundled libraries RUNPATH $ORIGIN (set with patchelf on
# the copies, so their own dependencies resolve inside lib/ too).
#
# Not shipped:
#  - the CUDA runtime, cuBLAS and NCCL: found on the target at run time (src/gpu/cuda_loader.cpp);
#  - the base system every glibc distribution has and minbase holds: glibc (libc, libm, libdl,
#    librt, libpthread, ld-linux), libstdc++, libgcc_s, zlib, libudev. tests/package_test.sh
#    checks in a minbase root that every dependency of the package resolves.
include_guard(GLOBAL)

# strata's own shared libraries and modules: every one defined under src/.
function(strata_collect_libraries dir out)
  get_property(targets DIRECTORY ${dir} PROPERTY BUILDSYSTEM_TARGETS)
  set(libs "")
  foreach(t IN LISTS targets)
    get_target_property(type ${t} TYPE)
    if(type STREQUAL "SHARED_LIBRARY" OR type STREQUAL "MODULE_LIBRARY")
      list(APPEND libs ${t})
    endif()
  endforeach()
  get_property(subdirs DIRECTORY ${dir} PROPERTY SUBDIRECTORIES)
  foreach(sub IN LISTS subdirs)
    strata_collect_libraries(${sub} sub_libs)
    list(APPEND libs ${sub_libs})
  endforeach()
  set(${out} ${libs} PARENT_SCOPE)
endfunction()
strata_collect_libraries(${PROJECT_SOURCE_DIR}/src strata_package_libraries)

set(strata_package_tools strata-info strata-train strata-export strata-generate strata-plot
    strata-bench strata-prof strata-prep)
install(TARGETS ${strata_package_tools} RUNTIME DESTINATION bin)
install(TARGETS ${strata_package_libraries} LIBRARY DESTINATION lib)
install(PROGRAMS ${PROJECT_SOURCE_DIR}/tools/gpu-check.sh DESTINATION bin)
# The public headers, for programs built against the package (they also need the fmt and
# nlohmann_json headers, which the package does not ship).
install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/strata DESTINATION include)

# The third-party libraries, resolved from the built files at install time.
find_program(STRATA_PATCHELF patchelf)
set(strata_dep_executables "")
foreach(t IN LISTS strata_package_tools)
  list(APPEND strata_dep_executables "$<TARGET_FILE:${t}>")
endforeach()
set(strata_dep_libraries "")
set(strata_dep_modules "")
foreach(t IN LISTS strata_package_libraries)
  get_target_property(type ${t} TYPE)
  if(type STREQUAL "MODULE_LIBRARY")
    list(APPEND strata_dep_modules "$<TARGET_FILE:${t}>")
  else()
    list(APPEND strata_dep_libraries "$<TARGET_FILE:${t}>")
  endif()
endforeach()
install(CODE "
  set(strata_dep_executables \"${strata_dep_executables}\")
  set(strata_dep_libraries \"${strata_dep_libraries}\")
  set(strata_dep_modules \"${strata_dep_modules}\")
  set(strata_build_dir \"${PROJECT_BINARY_DIR}\")
  set(strata_patchelf \"${STRATA_PATCHELF}\")
  include(\"${CMAKE_CURRENT_LIST_DIR}/install_runtime_deps.cmake\")
")

# ---- CPack: one .tar.gz with a top-level folder named like the file ----
set(strata_package_suffix "")
if(STRATA_HAVE_CUDA)
  set(strata_package_suffix "-cuda${CUDAToolkit_VERSION_MAJOR}")
endif()
set(CPACK_GENERATOR TGZ)
set(CPACK_PACKAGE_NAME strata)
set(CPACK_PACKAGE_VENDOR strata)
set(CPACK_PACKAGE_VERSION ${PROJECT_VERSION})
set(CPACK_PACKAGE_FILE_NAME "strata-${PROJECT_VERSION}-linux-${CMAKE_SYSTEM_PROCESSOR}${strata_package_suffix}")
set(CPACK_INCLUDE_TOPLEVEL_DIRECTORY ON)
set(CPACK_STRIP_FILES ON)  # strata's binaries and libraries; the bundled ones come stripped
set(CPACK_PACKAGE_DIRECTORY ${PROJECT_BINARY_DIR}/package)
include(CPack)
