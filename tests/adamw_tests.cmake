# CPU AdamW (issue #4): every ISA path against a double-precision reference.
strata_add_test(adamw_test SOURCES adamw_test.cpp LABELS unit)
