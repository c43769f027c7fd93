# The transformer (issue #7): per-op finite differences, the whole model against a PyTorch
# oracle (skipped where /usr/bin/python3 cannot import torch), weights I/O, data loaders, and
# the CUDA kernels against the CPU reference (label gpu: skipped where no GPU is usable).
strata_add_test(model_ops_test SOURCES model_ops_test.cpp LABELS unit)
strata_add_test(model_oracle_test SOURCES model_oracle_test.cpp LABELS unit
                DEFINES STRATA_SOURCE_DIR="${PROJECT_SOURCE_DIR}")
strata_add_test(model_test SOURCES model_test.cpp LABELS unit)
strata_add_test(model_io_test SOURCES model_io_test.cpp LABELS unit)
strata_add_test(model_gpu_test SOURCES model_gpu_test.cpp LABELS gpu)
