# CPU AdamW (issue #4): every ISA path against a double-precision reference.
strata_add_test(adamw_test SOURCES adamw_test.cpp LABELS unit)
if(STRATA_SANITIZE)
  # Its double-precision references over millions of elements are the hot loops: they keep -O2
  # where the sanitizer build compiles the other tests at -O0 (5x slower here otherwise).
  set_source_files_properties(adamw_test.cpp PROPERTIES COMPILE_OPTIONS -O2)
endif()
