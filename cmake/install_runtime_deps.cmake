# Install-time part of cmake/package.cmake: copies every shared library strata's binaries load
# (transitively) into lib/, except the base system and the CUDA libraries, each under its
# soname, and gives each copy RUNPATH $ORIGIN so its own dependencies resolve in lib/.
# Inputs (set by the install(CODE) that includes this file): strata_dep_executables,
# strata_dep_libraries, strata_dep_modules (built files), strata_build_dir, strata_patchelf.
if(NOT strata_patchelf)
  message(FATAL_ERROR "strata: installing the package needs patchelf to set the bundled libraries' RUNPATH; "
                      "install it (scripts/setup.sh does: apt-get install patchelf) and configure again")
endif()
set(strata_lib_dir "$ENV{DESTDIR}${CMAKE_INSTALL_PREFIX}/lib")

file(GET_RUNTIME_DEPENDENCIES
  EXECUTABLES ${strata_dep_executables}
  LIBRARIES ${strata_dep_libraries}
  MODULES ${strata_dep_modules}
  RESOLVED_DEPENDENCIES_VAR strata_deps
  UNRESOLVED_DEPENDENCIES_VAR strata_unresolved
  # By name, before resolving: the base system (every Debian 12 minbase root has these) and the
  # CUDA libraries (found on the target by the CUDA loader).
  PRE_EXCLUDE_REGEXES
    "^linux-vdso\\.so" "^ld-linux.*\\.so" "^lib(c|m|dl|rt|pthread|resolv|util|anl|mvec)\\.so"
    "^libstdc\\+\\+\\.so" "^libgcc_s\\.so" "^libz\\.so" "^libudev\\.so"
    "^libcuda\\.so" "^libcudart\\.so" "^libcublas\\.so" "^libcublasLt\\.so" "^libnccl\\.so"
  )
if(strata_unresolved)
  message(FATAL_ERROR "strata: unresolved dependencies of the package: ${strata_unresolved}")
endif()

list(SORT strata_deps)
foreach(dep IN LISTS strata_deps)
  # strata's own libraries (found in the build tree) are installed as targets, with their
  # install RUNPATH.
  string(FIND "${dep}" "${strata_build_dir}/" in_build)
  if(in_build EQUAL 0)
    continue()
  endif()
  get_filename_component(name "${dep}" NAME)     # the soname the binaries ask for
  file(REAL_PATH "${dep}" real)                  # the file behind the soname link
  set(copy "${strata_lib_dir}/${name}")
  message(STATUS "Installing: ${copy} (from ${real})")
  file(MAKE_DIRECTORY "${strata_lib_dir}")
  file(COPY_FILE "${real}" "${copy}")
  file(CHMOD "${copy}" PERMISSIONS OWNER_READ OWNER_WRITE GROUP_READ WORLD_READ)
  execute_process(COMMAND "${strata_patchelf}" --set-rpath "$ORIGIN" "${copy}" RESULT_VARIABLE rc
                  ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "strata: patchelf --set-rpath failed on ${copy}: ${err}")
  endif()
endforeach()
