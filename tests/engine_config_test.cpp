// ds_config parsing (DeepSpeed keys and defaults, errors naming the key) and the memory
// planner (bytes per tier against hand-computed values for a small synthetic model).
#include "strata/engine_config.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "core/json_config.h"
#include "strata/error.h"
#include "strata/model.h"

namespace strata {
namespace {

std::string error_of(const std::string& json, int world_size = 1) {
  try {
    parse_engine_config(json, world_size);
  } catch (const Error& e) {
    return e.what();
  }
  return "(accepted)";
}

// ---- defaults ----

TEST(EngineConfig, DefaultsMatchDeepSpeed) {
  const EngineConfig c = parse_engine_config(R"({"zero_optimization": {"stage": 3}})", 2);
  EXPECT_EQ(c.train_batch_size, 2);  // 1 x 1 x 2 ranks
  EXPECT_EQ(c.micro_batch_per_gpu, 1);
  EXPECT_EQ(c.gradient_accumulation_steps, 1);
  EXPECT_EQ(c.gradient_clipping, 0.0);
  EXPECT_EQ(c.compute_dtype, DType::kF32);
  EXPECT_FALSE(c.fp16.enabled);
  EXPECT_EQ(c.fp16.loss_scale, 0.0);
  EXPECT_EQ(c.fp16.initial_scale_power, 16);
  EXPECT_EQ(c.fp16.loss_scale_window, 1000);
  EXPECT_EQ(c.fp16.hysteresis, 2);
  EXPECT_EQ(c.fp16.min_loss_scale, 1.0);
  EXPECT_EQ(c.optimizer_type, "AdamW");
  EXPECT_FLOAT_EQ(c.adamw.lr, 1e-3f);
  EXPECT_FLOAT_EQ(c.adamw.beta1, 0.9f);
  EXPECT_FLOAT_EQ(c.adamw.beta2, 0.999f);
  EXPECT_FLOAT_EQ(c.adamw.eps, 1e-8f);
  EXPECT_EQ(c.adamw.weight_decay, 0.0f);
  EXPECT_TRUE(c.adamw.bias_correction);
  EXPECT_EQ(c.scheduler.type, "");
  EXPECT_EQ(c.stage, 3);
  EXPECT_TRUE(c.overlap_comm);  // stage 3's default
  EXPECT_TRUE(c.contiguous_gradients);
  EXPECT_EQ(c.reduce_bucket_size, 500'000'000u);
  EXPECT_EQ(c.allgather_bucket_size, 500'000'000u);
  EXPECT_EQ(c.sub_group_size, 1'000'000'000u);
  EXPECT_EQ(c.prefetch_bucket_size, 50'000'000u);
  EXPECT_EQ(c.max_live_parameters, 1'000'000'000u);
  EXPECT_EQ(c.max_reuse_distance, 1'000'000'000u);
  EXPECT_EQ(c.param_persistence_threshold, 100'000u);
  EXPECT_FALSE(c.gather_16bit_weights_on_model_save);
  EXPECT_EQ(c.params.device_fraction, 1.0);
  EXPECT_EQ(c.grads.device_fraction, 1.0);
  EXPECT_EQ(c.optimizer.device_fraction, 1.0);
  EXPECT_EQ(c.param_buffer_count, 5);
  EXPECT_EQ(c.param_buffer_size, 100'000'000u);
  EXPECT_EQ(c.param_max_in_cpu, 1'000'000'000u);
  EXPECT_EQ(c.optimizer_buffer_count, 4);
  EXPECT_TRUE(c.pin_memory);
  EXPECT_FALSE(c.pipeline_read);
  EXPECT_FALSE(c.pipeline_write);
  EXPECT_EQ(c.aio.block_size, 1u << 20);
  EXPECT_EQ(c.aio.queue_depth, 8);
  EXPECT_EQ(c.host_budget_bytes, 0u);
  EXPECT_FALSE(c.overlap_optimizer.has_value());  // the planner decides
  EXPECT_EQ(c.optimizer_threads, 0);
  EXPECT_EQ(c.optimizer_isa, Isa::kAuto);
  EXPECT_TRUE(c.decay_exempt_norms_and_biases);
  const EngineConfig s = parse_engine_config(
      R"({"zero_optimization": {"stage": 3}, "strata": {"overlap_optimizer": false, "optimizer_threads": 3,
          "optimizer_isa": "scalar", "weight_decay_exempt": "none"}})");
  EXPECT_EQ(s.overlap_optimizer, std::optional<bool>(false));
  EXPECT_EQ(s.optimizer_threads, 3);
  EXPECT_EQ(s.optimizer_isa, Isa::kScalar);
  EXPECT_FALSE(s.decay_exempt_norms_and_biases);
  EXPECT_TRUE(parse_engine_config(R"({"zero_optimization": {"stage": 3},
                                      "strata": {"weight_decay_exempt": "norms_and_biases"}})")
                  .decay_exempt_norms_and_biases);

  // overlap_comm defaults to false below stage 3 (DeepSpeed).
  EXPECT_FALSE(parse_engine_config(R"({"zero_optimization": {"stage": 2}})").overlap_comm);
  const EngineConfig d = default_engine_config();
  EXPECT_EQ(d.stage, 3);
  EXPECT_TRUE(d.overlap_comm);
  EXPECT_EQ(d.params.device_fraction, 1.0);
  EXPECT_EQ(d.optimizer.device_fraction, 1.0);
}

// ---- a realistic ZeRO-Infinity config ----

TEST(EngineConfig, ZeroInfinityConfigParses) {
  const char* kJson = R"({
    "train_batch_size": 64,
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 2,
    "gradient_clipping": 1.0,
    "steps_per_print": 100,
    "wall_clock_breakdown": false,
    "zero_allow_untested_optimizer": true,
    "bf16": {"enabled": true},
    "optimizer": {"type": "AdamW",
                  "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}},
    "scheduler": {"type": "WarmupLR",
                  "params": {"warmup_min_lr": 0, "warmup_max_lr": 3e-4, "warmup_num_steps": 2000,
                             "warmup_type": "linear"}},
    "zero_optimization": {
      "stage": 3,
      "overlap_comm": true,
      "contiguous_gradients": true,
      "reduce_bucket_size": 2e8,
      "allgather_bucket_size": 500000000,
      "sub_group_size": 1e8,
      "stage3_prefetch_bucket_size": 1.5e7,
      "stage3_max_live_parameters": 3e8,
      "stage3_max_reuse_distance": 2e8,
      "stage3_param_persistence_threshold": 1e6,
      "stage3_gather_16bit_weights_on_model_save": true,
      "round_robin_gradients": true,
      "offload_param": {"device": "nvme", "nvme_path": "/local_nvme", "pin_memory": true,
                        "buffer_count": 6, "buffer_size": 2e8, "max_in_cpu": 1e9},
      "offload_optimizer": {"device": "nvme", "nvme_path": ["/nvme0", "/nvme1"], "pin_memory": true,
                            "buffer_count": 8, "pipeline_read": true, "pipeline_write": false,
                            "fast_init": false}
    },
    "aio": {"block_size": 262144, "queue_depth": 32, "thread_count": 2, "single_submit": false,
            "overlap_events": true},
    "activation_checkpointing": {"partition_activations": true}
  })";
  testing::internal::CaptureStderr();
  const EngineConfig c = parse_engine_config(kJson, 8);
  const std::string warnings = testing::internal::GetCapturedStderr();
  EXPECT_EQ(c.train_batch_size, 64);
  EXPECT_EQ(c.micro_batch_per_gpu, 4);
  EXPECT_EQ(c.gradient_accumulation_steps, 2);
  EXPECT_EQ(c.gradient_clipping, 1.0);
  EXPECT_EQ(c.compute_dtype, DType::kBF16);
  EXPECT_FALSE(c.fp16.enabled);
  EXPECT_EQ(c.optimizer_type, "AdamW");
  EXPECT_FLOAT_EQ(c.adamw.lr, 3e-4f);
  EXPECT_FLOAT_EQ(c.adamw.beta1, 0.9f);
  EXPECT_FLOAT_EQ(c.adamw.beta2, 0.95f);
  EXPECT_FLOAT_EQ(c.adamw.eps, 1e-8f);
  EXPECT_FLOAT_EQ(c.adamw.weight_decay, 0.1f);
  EXPECT_EQ(c.scheduler.type, "WarmupLR");
  EXPECT_EQ(c.scheduler.warmup_min_lr, 0.0);
  EXPECT_DOUBLE_EQ(c.scheduler.warmup_max_lr, 3e-4);
  EXPECT_EQ(c.scheduler.warmup_num_steps, 2000);
  EXPECT_EQ(c.scheduler.warmup_type, "linear");
  EXPECT_EQ(c.stage, 3);
  EXPECT_TRUE(c.overlap_comm);
  EXPECT_EQ(c.reduce_bucket_size, 200'000'000u);
  EXPECT_EQ(c.allgather_bucket_size, 500'000'000u);
  EXPECT_EQ(c.sub_group_size, 100'000'000u);
  EXPECT_EQ(c.prefetch_bucket_size, 15'000'000u);
  EXPECT_EQ(c.max_live_parameters, 300'000'000u);
  EXPECT_EQ(c.max_reuse_distance, 200'000'000u);
  EXPECT_EQ(c.param_persistence_threshold, 1'000'000u);
  EXPECT_TRUE(c.gather_16bit_weights_on_model_save);
  // Both pieces entirely on NVMe (host_fraction defaults to 0); gradients on the host.
  EXPECT_EQ(c.params.device_fraction, 0.0);
  EXPECT_EQ(c.params.host_fraction, 0.0);
  EXPECT_EQ(c.params.nvme_fraction(), 1.0);
  EXPECT_EQ(c.optimizer.nvme_fraction(), 1.0);
  EXPECT_EQ(c.grads.host_fraction, 1.0);
  EXPECT_EQ(c.param_nvme_paths, std::vector<std::string>{"/local_nvme"});
  EXPECT_EQ(c.optimizer_nvme_paths, (std::vector<std::string>{"/nvme0", "/nvme1"}));
  EXPECT_EQ(c.param_buffer_count, 6);
  EXPECT_EQ(c.param_buffer_size, 200'000'000u);
  EXPECT_EQ(c.param_max_in_cpu, 1'000'000'000u);
  EXPECT_EQ(c.optimizer_buffer_count, 8);
  EXPECT_TRUE(c.pin_memory);
  EXPECT_TRUE(c.pipeline_read);
  EXPECT_FALSE(c.pipeline_write);
  EXPECT_EQ(c.aio.block_size, 262144u);
  EXPECT_EQ(c.aio.queue_depth, 32);
  EXPECT_EQ(c.aio.thread_count, 2);
  // Keys strata does not use warn, naming the full key, and do not fail.
  for (const char* key :
       {"'steps_per_print'", "'wall_clock_breakdown'", "'zero_allow_untested_optimizer'",
        "'zero_optimization.round_robin_gradients'",
        "'zero_optimization.offload_optimizer.fast_init'", "'activation_checkpointing'"}) {
    EXPECT_NE(warnings.find(key), std::string::npos) << key << " not warned in:\n" << warnings;
  }
  EXPECT_EQ(warnings.find("'gradient_clipping'"), std::string::npos) << warnings;
}

TEST(EngineConfig, OptimizerAndPrecisionVariants) {
  EngineConfig c = parse_engine_config(
      R"({"zero_optimization": {"stage": 1}, "optimizer": {"type": "adam", "params": {"weight_decay": 0.01,
          "bias_correction": false, "torch_adam": true}},
          "fp16": {"enabled": true, "loss_scale": 0, "initial_scale_power": 12, "loss_scale_window": 500,
                   "hysteresis": 4, "min_loss_scale": 0.5}})");
  EXPECT_EQ(c.optimizer_type, "Adam");  // runs AdamW, as DeepSpeed's default adam_w_mode does
  EXPECT_FLOAT_EQ(c.adamw.weight_decay, 0.01f);
  EXPECT_FALSE(c.adamw.bias_correction);
  EXPECT_EQ(c.compute_dtype, DType::kF16);
  EXPECT_TRUE(c.fp16.enabled);
  EXPECT_EQ(c.fp16.initial_scale_power, 12);
  EXPECT_EQ(c.fp16.loss_scale_window, 500);
  EXPECT_EQ(c.fp16.hysteresis, 4);
  EXPECT_EQ(c.fp16.min_loss_scale, 0.5);
  EXPECT_EQ(c.stage, 1);
  // "AdamW" with adam_w_mode false is still AdamW in DeepSpeed: accepted.
  c = parse_engine_config(R"({"zero_optimization": {"stage": 3}, "optimizer": {"type": "ADAMW",
                              "params": {"adam_w_mode": false}}})");
  EXPECT_EQ(c.optimizer_type, "AdamW");
  c = parse_engine_config(R"({"zero_optimization": {"stage": 3}, "bfloat16": {"enabled": true},
      "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 1e4, "warmup_num_steps": 100,
                    "cos_min_ratio": 0.1, "warmup_min_ratio": 0.01}}})");
  EXPECT_EQ(c.compute_dtype, DType::kBF16);
  EXPECT_EQ(c.scheduler.type, "WarmupCosineLR");
  EXPECT_EQ(c.scheduler.total_num_steps, 10000);
  EXPECT_EQ(c.scheduler.warmup_num_steps, 100);
  EXPECT_EQ(c.scheduler.cos_min_ratio, 0.1);
  EXPECT_EQ(c.scheduler.warmup_min_ratio, 0.01);
  EXPECT_EQ(c.scheduler.warmup_type, "log");
  c = parse_engine_config(R"({"zero_optimization": {"stage": 3},
      "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 500, "warmup_num_steps": 50,
                    "warmup_max_lr": 0.01}}})");
  EXPECT_EQ(c.scheduler.type, "WarmupDecayLR");
  EXPECT_EQ(c.scheduler.total_num_steps, 500);
  EXPECT_EQ(c.scheduler.warmup_num_steps, 50);
  EXPECT_EQ(c.scheduler.warmup_max_lr, 0.01);
  EXPECT_EQ(c.scheduler.warmup_min_lr, 0.0);
}

// Hugging Face's "auto" (the Trainer fills it in before DeepSpeed reads the file): the values the
// Trainer gives where they are known here — clipping its max_grad_norm 1.0, lr its learning_rate
// 5e-5, weight decay 0, bf16 the model's dtype (resolve_auto_dtype) — and "not given" for the
// rest, each said in a warning.
TEST(EngineConfig, HuggingFaceAutoValuesAreWhatTheTrainerFillsIn) {
  testing::internal::CaptureStderr();
  EngineConfig c = parse_engine_config(
      R"({"train_batch_size": 16, "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
          "gradient_clipping": "auto", "bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"},
          "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto",
                                                    "betas": "auto", "eps": "auto"}},
          "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto"},
          "aio": {"engine": "auto"}})",
      4);
  const std::string warnings = testing::internal::GetCapturedStderr();
  // tensor_parallel.autotp_size "auto" too (it was "must be a number, got string").
  EXPECT_EQ(config_tensor_parallel(R"({"tensor_parallel": {"autotp_size": "auto"}})"), 0);
  EXPECT_EQ(config_tensor_parallel(R"({"tensor_parallel": {"autotp_size": 2}})"), 2);
  EXPECT_EQ(c.micro_batch_per_gpu, 4);
  EXPECT_EQ(c.gradient_accumulation_steps, 1);
  EXPECT_EQ(c.gradient_clipping, 1.0);
  // The batch is the file's (16 over 4 ranks); the clipping the Trainer's, not the file's.
  EXPECT_TRUE(c.train_batch_size_given);
  EXPECT_FALSE(c.gradient_clipping_given);
  EXPECT_FLOAT_EQ(c.adamw.lr, 5e-5f);
  EXPECT_EQ(c.adamw.weight_decay, 0.0f);
  EXPECT_FLOAT_EQ(c.adamw.beta1, 0.9f);
  EXPECT_FLOAT_EQ(c.adamw.beta2, 0.999f);
  EXPECT_FLOAT_EQ(c.adamw.eps, 1e-8f);
  EXPECT_FALSE(c.fp16.enabled);
  EXPECT_TRUE(c.bf16_auto);
  EXPECT_EQ(c.compute_dtype, DType::kF32);  // until the model says
  EXPECT_EQ(c.reduce_bucket_size, 500'000'000u);
  EXPECT_EQ(c.aio.engine, IoBackend::kAuto);  // a real value there, not a placeholder
  for (const char* said :
       {"'optimizer.params.lr' is \"auto\" (a Hugging Face Trainer placeholder): read as the "
        "Trainer's default learning rate, 5e-5",
        "'gradient_clipping' is \"auto\" (a Hugging Face Trainer placeholder): read as 1.0",
        "'bf16.enabled' is \"auto\" (a Hugging Face Trainer placeholder): read as the model's "
        "dtype",
        "'optimizer.params.weight_decay' is \"auto\"", "'fp16.enabled' is \"auto\"",
        "'zero_optimization.reduce_bucket_size' is \"auto\" (a Hugging Face Trainer placeholder): "
        "treated as not "
        "given"})
    EXPECT_NE(warnings.find(said), std::string::npos) << said << "\n" << warnings;
  EXPECT_EQ(warnings.find("aio.engine"), std::string::npos) << warnings;

  // bf16 "auto": the model's saved dtype decides, once.
  EngineConfig b = c;
  EXPECT_EQ(resolve_auto_dtype(b, "bfloat16"),
            "config key 'bf16.enabled' \"auto\": bf16, as the model's config.json says "
            "torch_dtype \"bfloat16\"");
  EXPECT_EQ(b.compute_dtype, DType::kBF16);
  EXPECT_EQ(resolve_auto_dtype(b, "float32"), "");  // resolved already
  EXPECT_EQ(b.compute_dtype, DType::kBF16);
  b = c;
  EXPECT_NE(resolve_auto_dtype(b, "").find("fp32, as the model's config.json says torch_dtype "
                                           "nothing"),
            std::string::npos);
  EXPECT_EQ(b.compute_dtype, DType::kF32);
  // Given, not "auto": the file's value stands whatever the model says.
  EngineConfig given =
      parse_engine_config(R"({"bf16": {"enabled": false}, "zero_optimization": {"stage": 3}})", 1);
  EXPECT_EQ(resolve_auto_dtype(given, "bfloat16"), "");
  EXPECT_EQ(given.compute_dtype, DType::kF32);
  EXPECT_FALSE(given.train_batch_size_given);
  EXPECT_FALSE(given.gradient_clipping_given);
  // null is not given either; a value is, 0 (clipping off) included.
  testing::internal::CaptureStderr();
  const EngineConfig nulls = parse_engine_config(
      R"({"train_batch_size": null, "gradient_clipping": null, "zero_optimization": {"stage": 3}})",
      1);
  const EngineConfig values = parse_engine_config(
      R"({"train_batch_size": 2, "train_micro_batch_size_per_gpu": 1, "gradient_clipping": 0, "zero_optimization": {"stage": 3}})",
      1);
  testing::internal::GetCapturedStderr();
  EXPECT_FALSE(nulls.train_batch_size_given);
  EXPECT_FALSE(nulls.gradient_clipping_given);
  EXPECT_TRUE(values.train_batch_size_given);
  EXPECT_TRUE(values.gradient_clipping_given);
  EXPECT_EQ(values.gradient_clipping, 0.0);
}

// sub_group_size 0, as axolotl's stock ZeRO-3 files give it: DeepSpeed makes every parameter
// tensor's partition a sub-group; strata sizes its sub-groups as the largest one, from the model.
TEST(EngineConfig, SubGroupSizeZeroIsOneTensorsPartition) {
  EngineConfig c = parse_engine_config(
      R"({"zero_optimization": {"stage": 3, "sub_group_size": 0, "offload_optimizer": {"device": "cpu"}}})",
      1);
  EXPECT_TRUE(c.sub_group_per_tensor);
  EXPECT_EQ(resolve_per_tensor_sub_groups(c, 1000, 3),
            "config key 'zero_optimization.sub_group_size' 0 (DeepSpeed: each parameter tensor's "
            "partition a sub-group of its own): sub-groups of 334 elements, the largest tensor's "
            "partition over 3 rank(s)");
  EXPECT_EQ(c.sub_group_size, 334u);
  EXPECT_EQ(resolve_per_tensor_sub_groups(c, 5000, 1), "");  // once
  EXPECT_EQ(c.sub_group_size, 334u);
  EngineConfig given =
      parse_engine_config(R"({"zero_optimization": {"stage": 3, "sub_group_size": 1e6}})", 1);
  EXPECT_EQ(resolve_per_tensor_sub_groups(given, 5000, 1), "");
  EXPECT_EQ(given.sub_group_size, 1'000'000u);
  // A Llama's largest tensor: here the embedding (256 x 64) over the MLP's (128 x 64) ones.
  const ModelConfig m = parse_model_config(
      R"({"model_type": "llama", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
          "num_hidden_layers": 2, "num_attention_heads": 4})",
      "test");
  EXPECT_EQ(largest_tensor(model_units(m)), 256u * 64u);
}

// A ZeRO-3 file in the shape the fine-tuning frameworks ship (everything offloaded to the CPU,
// bf16, sub_group_size 0, a live window of 0, the Trainer's "auto"s, keys of theirs strata does
// not use): read key by key as DeepSpeed + the Hugging Face Trainer read it.
TEST(EngineConfig, AStockOffloadZero3FileMeansWhatItMeansInDeepSpeed) {
  testing::internal::CaptureStderr();
  EngineConfig c = parse_engine_config(R"({
    "zero_force_ds_cpu_optimizer": false,
    "zero_optimization": {"stage": 3,
      "offload_optimizer": {"device": "cpu", "pin_memory": true},
      "offload_param": {"device": "cpu", "pin_memory": true},
      "overlap_comm": true, "contiguous_gradients": true, "sub_group_size": 0,
      "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
      "stage3_param_persistence_threshold": "auto", "max_live_parameters": 0,
      "max_reuse_distance": 0, "gather_16bit_weights_on_model_save": true},
    "bf16": {"enabled": true},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": false})",
                                       2);
  const std::string warnings = testing::internal::GetCapturedStderr();
  EXPECT_EQ(c.stage, 3);
  EXPECT_EQ(c.compute_dtype, DType::kBF16);
  EXPECT_EQ(c.gradient_clipping, 1.0);  // "auto": the Trainer's max_grad_norm
  EXPECT_EQ(c.params.device_fraction, 0.0);
  EXPECT_EQ(c.params.host_fraction, 1.0);
  EXPECT_EQ(c.optimizer.device_fraction, 0.0);
  EXPECT_EQ(c.optimizer.host_fraction, 1.0);
  EXPECT_TRUE(c.overlap_comm);
  EXPECT_EQ(c.max_live_parameters, 0u);
  EXPECT_EQ(c.max_reuse_distance, 0u);
  EXPECT_TRUE(c.gather_16bit_weights_on_model_save);
  EXPECT_EQ(c.micro_batch_per_gpu, 1);  // "auto": strata-train's --micro-batch, else 1
  EXPECT_EQ(c.gradient_accumulation_steps, 1);
  EXPECT_EQ(c.reduce_bucket_size, 500'000'000u);  // "auto": not given
  EXPECT_TRUE(c.sub_group_per_tensor);
  EXPECT_NE(resolve_per_tensor_sub_groups(c, 4096 * 4096, 2), "");
  EXPECT_EQ(c.sub_group_size, 4096u * 4096u / 2);
  for (const char* key : {"zero_force_ds_cpu_optimizer", "wall_clock_breakdown"})
    EXPECT_NE(warnings.find(std::string("'") + key + "' is not used by strata"), std::string::npos)
        << key << "\n"
        << warnings;
}

// stage3_gather_16bit_weights_on_model_save false (DeepSpeed then saves shards only) cannot be
// honoured: strata always writes the gathered model; said, not silently different.
TEST(EngineConfig, GatherOnSaveFalseIsSaidNotIgnored) {
  testing::internal::CaptureStderr();
  const EngineConfig c = parse_engine_config(
      R"({"zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": false}})",
      1);
  const std::string warnings = testing::internal::GetCapturedStderr();
  EXPECT_FALSE(c.gather_16bit_weights_on_model_save);
  EXPECT_NE(warnings.find("'zero_optimization.stage3_gather_16bit_weights_on_model_save' is "
                          "false: strata writes the whole model, gathered"),
            std::string::npos)
      << warnings;
  testing::internal::CaptureStderr();
  parse_engine_config(
      R"({"zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": true}})",
      1);
  EXPECT_EQ(testing::internal::GetCapturedStderr().find("gather"), std::string::npos);
}

// ---- batch sizes ----

TEST(EngineConfig, BatchSizesDeriveTheMissingOne) {
  struct Case {
    const char* json;
    int world;
    std::int64_t train, micro, accum;
  };
  const Case cases[] = {
      {R"("train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3)", 4, 24, 2, 3},
      {R"("train_batch_size": 32, "train_micro_batch_size_per_gpu": 2)", 4, 32, 2, 4},
      {R"("train_batch_size": 32, "gradient_accumulation_steps": 2)", 4, 32, 4, 2},
      {R"("train_batch_size": 32)", 4, 32, 8, 1},
      {R"("train_micro_batch_size_per_gpu": 3)", 2, 6, 3, 1},
      {R"("gradient_accumulation_steps": 5)", 2, 10, 1, 5},
      {R"("train_batch_size": 24, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3)",
       4, 24, 2, 3},
      {R"("train_batch_size": 2.4e1, "train_micro_batch_size_per_gpu": 6)", 4, 24, 6, 1},
  };
  for (const Case& t : cases) {
    const std::string json = std::string("{") + t.json + R"(, "zero_optimization": {"stage": 3}})";
    const EngineConfig c = parse_engine_config(json, t.world);
    EXPECT_EQ(c.train_batch_size, t.train) << json;
    EXPECT_EQ(c.micro_batch_per_gpu, t.micro) << json;
    EXPECT_EQ(c.gradient_accumulation_steps, t.accum) << json;
  }
}

TEST(EngineConfig, BatchSizeMismatchNamesTheValuesAndTheRule) {
  const std::string e = error_of(
      R"({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3,
          "zero_optimization": {"stage": 3}})",
      2);
  EXPECT_NE(e.find("disagree"), std::string::npos) << e;
  EXPECT_NE(e.find("train_batch_size (10)"), std::string::npos) << e;
  EXPECT_NE(e.find("train_micro_batch_size_per_gpu (2)"), std::string::npos) << e;
  EXPECT_NE(e.find("gradient_accumulation_steps (3)"), std::string::npos) << e;
  EXPECT_NE(e.find("data-parallel ranks (2)"), std::string::npos) << e;
  EXPECT_NE(e.find("= 12"), std::string::npos) << e;
  const std::string d = error_of(R"({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4,
                                      "zero_optimization": {"stage": 3}})",
                                 4);
  EXPECT_NE(d.find("do not divide"), std::string::npos) << d;
  EXPECT_NE(d.find("train_batch_size (30)"), std::string::npos) << d;
  EXPECT_NE(d.find("gradient_accumulation_steps (not given)"), std::string::npos) << d;
  EXPECT_NE(error_of(R"({"train_batch_size": 0, "zero_optimization": {"stage": 3}})")
                .find("'train_batch_size'"),
            std::string::npos);
  EXPECT_NE(error_of(R"({"zero_optimization": {"stage": 3}})", 0).find("world_size"),
            std::string::npos);
}

// ---- every error names its key ----

TEST(EngineConfig, ErrorsNameTheKeyAndTheAllowedValues) {
  struct Case {
    const char* json;
    std::vector<const char*> needles;
  };
  const Case cases[] = {
      {R"([1, 2])", {"JSON object"}},
      {R"({"train_batch_size": )", {"not valid JSON"}},
      {R"({})", {"'zero_optimization.stage' is 0", "DeepSpeed's default", "1, 2 or 3"}},
      {R"({"zero_optimization": {"stage": 0}})",
       {"'zero_optimization.stage' is 0:", "plain data parallel", "1, 2 or 3"}},
      {R"({"zero_optimization": {"stage": 4}})", {"'zero_optimization.stage' = 4", "1, 2 or 3"}},
      {R"({"zero_optimization": {"stage": "3"}})",
       {"'zero_optimization.stage'", "use 1, 2 or 3 (a number)"}},
      {R"({"zero_optimization": 3})", {"'zero_optimization' must be an object"}},
      {R"({"gradient_clipping": -1, "zero_optimization": {"stage": 3}})", {"'gradient_clipping'"}},
      {R"({"bf16": {"enabled": true}, "fp16": {"enabled": true}})",
       {"'bf16.enabled'", "'fp16.enabled'", "choose one"}},
      {R"({"bf16": {"enabled": "yes"}})", {"'bf16.enabled'", "true or false"}},
      {R"({"bf16": {"enabled": true}, "bfloat16": {"enabled": true}})", {"'bfloat16'"}},
      {R"({"fp16": {"enabled": true, "initial_scale_power": 100}})",
       {"'fp16.initial_scale_power'", "0 to 64"}},
      {R"({"fp16": {"enabled": true, "hysteresis": 0}})", {"'fp16.hysteresis'"}},
      {R"({"fp16": {"enabled": true, "loss_scale": -2}})", {"'fp16.loss_scale'"}},
      {R"({"fp16": {"enabled": true, "min_loss_scale": 0}})", {"'fp16.min_loss_scale'"}},
      {R"({"optimizer": {"type": "Lamb"}})",
       {"'optimizer.type'", "\"Lamb\"", "\"Adam\" and \"AdamW\""}},
      {R"({"optimizer": {"type": "Adam", "params": {"adam_w_mode": false}}})",
       {"'optimizer.params.adam_w_mode'", "L2"}},
      {R"({"optimizer": {"type": "AdamW", "params": {"betas": [0.9]}}})",
       {"'optimizer.params.betas'", "two numbers"}},
      {R"({"optimizer": {"type": "AdamW", "params": {"betas": [0.9, 1.0]}}})",
       {"'optimizer.params.betas'", "[0, 1)"}},
      {R"({"optimizer": {"type": "AdamW", "params": {"lr": "fast"}}})",
       {"'optimizer.params.lr'", "must be a number"}},
      {R"({"optimizer": {"type": "AdamW", "params": {"eps": -1e-8}}})", {"'optimizer.params.eps'"}},
      {R"({"optimizer": {"type": "AdamW", "params": {"amsgrad": true}}})",
       {"'optimizer.params.amsgrad'"}},
      {R"({"scheduler": {"type": "OneCycle"}})", {"'scheduler.type'", "\"WarmupCosineLR\""}},
      {R"({"scheduler": {"params": {}}})", {"'scheduler.type' is required"}},
      {R"({"scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 10}}})",
       {"'scheduler.params.total_num_steps' is required"}},
      {R"({"scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 5, "warmup_num_steps": 10}}})",
       {"'scheduler.params.total_num_steps' = 5"}},
      {R"({"scheduler": {"type": "WarmupLR", "params": {"warmup_type": "cubic"}}})",
       {"'scheduler.params.warmup_type'", "\"linear\""}},
      {R"({"scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.1, "warmup_max_lr": 0.01}}})",
       {"'scheduler.params.warmup_max_lr'"}},
      {R"({"scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 10, "cos_min_ratio": 2}}})",
       {"'scheduler.params.cos_min_ratio'", "0 to 1"}},
      {R"({"zero_optimization": {"stage": 3, "reduce_bucket_size": "big"}})",
       {"'zero_optimization.reduce_bucket_size'", "must be a number"}},
      {R"({"zero_optimization": {"stage": 3, "reduce_bucket_size": 0}})",
       {"'zero_optimization.reduce_bucket_size'", "at least 1"}},
      {R"({"zero_optimization": {"stage": 3, "sub_group_size": 1.5}})",
       {"'zero_optimization.sub_group_size' must be a whole number of at least 0", "got 1.5"}},
      // Below the least: the message names the least (it said ">= 0" for -1, and 0 is refused too).
      {R"({"zero_optimization": {"stage": 3, "sub_group_size": -1}})",
       {"'zero_optimization.sub_group_size' must be a whole number of at least 0", "got -1"}},
      {R"({"zero_optimization": {"stage": 3, "sub_group_size": 1e30}})",
       {"'zero_optimization.sub_group_size' = 1e+30 is too large (at most 1.8e19)"}},
      {R"({"zero_optimization": {"stage": 3, "cpu_offload": true}})",
       {"'zero_optimization.cpu_offload'", "offload_optimizer"}},
      {R"({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}})",
       {"'zero_optimization.offload_param.device'", "stage 3"}},
      {R"({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": "/x"}}})",
       {"'zero_optimization.offload_optimizer.device'", "stage 3"}},
      {R"({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme"}}})",
       {"offload_optimizer.nvme_path' is required when zero_optimization.offload_optimizer.device "
        "is \"nvme\""}},
      {R"({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}})",
       {"offload_param.nvme_path' is required when zero_optimization.offload_param.device is "
        "\"nvme\""}},
      {R"({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": []}}})",
       {"'zero_optimization.offload_param.nvme_path'", "non-empty list"}},
      {R"({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": ["/a", 7]}}})",
       {"'zero_optimization.offload_param.nvme_path'", "a string"}},
      {R"({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": ""}}})",
       {"'zero_optimization.offload_param.nvme_path'", "empty path"}},
      {R"({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "disk"}}})",
       {"'zero_optimization.offload_optimizer.device'", "\"none\", \"cpu\", \"nvme\""}},
      {R"({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 1.5}}})",
       {"'zero_optimization.offload_optimizer.ratio'", "0 to 1"}},
      {R"({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "ratio": -0.5}}})",
       {"'zero_optimization.offload_param.ratio'", "0 to 1"}},
      {R"({"zero_optimization": {"stage": 3, "offload_grads_ratio": 2}})",
       {"'zero_optimization.offload_grads_ratio'", "0 to 1"}},
      {R"({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "host_fraction": 0.5}}})",
       {"'zero_optimization.offload_param.host_fraction'", "\"nvme\""}},
      {R"({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/x",
           "host_fraction": -0.1}}})",
       {"'zero_optimization.offload_optimizer.host_fraction'", "0 to 1"}},
      {R"({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "buffer_count": 0}}})",
       {"'zero_optimization.offload_param.buffer_count'"}},
      {R"({"zero_optimization": {"stage": 3, "offload_grads": "disk"}})",
       {"'zero_optimization.offload_grads'", "\"none\", \"cpu\", \"nvme\""}},
      {R"({"zero_optimization": {"stage": 2, "offload_grads": "nvme"}})",
       {"'zero_optimization.offload_grads' is \"nvme\" with zero_optimization.stage 2",
        "needs stage 3"}},
      {R"({"zero_optimization": {"stage": 3, "offload_grads": "nvme"}})",
       {"'zero_optimization.offload_grads' is \"nvme\"",
        "neither offload_optimizer.device nor offload_param.device", "offload_grads \"cpu\""}},
      {R"({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_grads": "cpu",
           "offload_grads_host_fraction": 0.5}})",
       {"'zero_optimization.offload_grads_host_fraction'",
        "needs zero_optimization.offload_grads \"nvme\"", "zero_optimization.offload_grads_ratio"}},
      {R"({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/o"},
           "offload_grads": "nvme", "offload_grads_host_fraction": 1.5}})",
       {"'zero_optimization.offload_grads_host_fraction'", "0 to 1"}},
      {R"({"zero_optimization": {"stage": 3}, "aio": {"block_size": 3000}})",
       {"'aio.block_size'", "power of two"}},
      {R"({"zero_optimization": {"stage": 3}, "strata": {"host_budget_bytes": -5}})",
       {"'strata.host_budget_bytes'"}},
      {R"({"zero_optimization": {"stage": 3}, "strata": {"host_budget_bytes": 1000000}})",
       {"'strata.host_budget_bytes' = 1000000", "at least 2 MiB"}},
      {R"({"zero_optimization": {"stage": 3}, "strata": {"overlap_optimizer": "yes"}})",
       {"'strata.overlap_optimizer'"}},
      {R"({"zero_optimization": {"stage": 3}, "strata": {"optimizer_threads": -1}})",
       {"'strata.optimizer_threads'"}},
      {R"({"zero_optimization": {"stage": 3}, "strata": {"optimizer_isa": "avx3"}})",
       {"'strata.optimizer_isa' is \"avx3\"",
        "use one of \"auto\", \"avx512\", \"avx2\", \"scalar\""}},
      {R"({"zero_optimization": {"stage": 3}, "strata": {"optimizer_isa": 2}})",
       {"'strata.optimizer_isa'"}},
      {R"({"zero_optimization": {"stage": 3}, "strata": {"weight_decay_exempt": "norms"}})",
       {"'strata.weight_decay_exempt' is \"norms\"", "use one of \"norms_and_biases\", \"none\""}},
      // A key a typo away from one strata reads would leave that setting at its default.
      {R"({"zero_optimisation": {"stage": 3}})",
       {"'zero_optimisation'", "did you mean 'zero_optimization'"}},
      // Beside the key it is a typo of: not "would keep its default", since that key is given.
      {R"({"zero_optimization": {"stage": 3}, "zero_optimization_x": 1})",
       {"'zero_optimization_x' is not a key strata knows, a typo away from 'zero_optimization', "
        "which is given too"}},
      {R"({"zero_optimization": {"stage": 3, "offload_optimzer": {"device": "cpu"}}})",
       {"'zero_optimization.offload_optimzer'",
        "did you mean 'zero_optimization.offload_optimizer'"}},
      {R"({"zero_optimization": {"stage": 3, "Overlap_Comm": false}})",
       {"did you mean 'zero_optimization.overlap_comm'"}},
      {R"({"zero_optimization": {"stage": 3}, "aio": {"block_size": 1048576, "queue_dpeth": 8}})",
       {"'aio.queue_dpeth'", "did you mean 'aio.queue_depth'"}},
      {R"({"zero_optimization": {"stage": 3, "max_live_parameters": 5, "stage3_max_live_parameters": 6}})",
       {"'zero_optimization.stage3_max_live_parameters'", "'zero_optimization.max_live_parameters'",
        "same setting"}},
      {R"({"zero_optimization": {"stage": "three"}})", {"'zero_optimization.stage'", "1, 2 or 3"}},
      // The optimizer holds these as fp32: eps 0 (or one that rounds to 0) made 0/0 where a
      // gradient was 0 and the run went on with NaN weights; 1e39 is infinite; 0.99999999 is 1.
      {R"({"optimizer": {"params": {"eps": 0}}, "zero_optimization": {"stage": 3}})",
       {"'optimizer.params.eps' = 0: must be above 0 (it keeps the update finite"}},
      {R"({"optimizer": {"params": {"eps": 1e-50}}, "zero_optimization": {"stage": 3}})",
       {"'optimizer.params.eps' = 1e-50: must be above 0 as an fp32"}},
      {R"({"optimizer": {"params": {"lr": 1e39}}, "zero_optimization": {"stage": 3}})",
       {"'optimizer.params.lr' = 1e+39: too large for the optimizer's fp32"}},
      {R"({"optimizer": {"params": {"betas": [0.9, 0.99999999]}}, "zero_optimization": {"stage": 3}})",
       {"'optimizer.params.betas' = [0.9, 0.99999999]: a beta rounds to 1 in the optimizer's "
        "fp32"}},
      // A key twice: the last silently won (the offload below was dropped).
      {R"({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
           "zero_optimization": {"stage": 3}})",
       {"the key 'zero_optimization' is given twice: keep one"}},
      {R"({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "device": "nvme"}}})",
       {"the key 'device' is given twice in zero_optimization.offload_param: keep one"}},
      {R"({"optimizer": {"params": {"lr": 1e400}}})", {"not valid JSON", "number overflow"}},
  };
  for (const Case& t : cases) {
    const std::string e = error_of(t.json);
    for (const char* needle : t.needles) {
      EXPECT_NE(e.find(needle), std::string::npos)
          << "config: " << t.json << "\nerror: " << e << "\nmissing: " << needle;
    }
  }
}

// DeepSpeed's other spellings are read; keys strata does not use, however close to each other
// (DeepSpeed's "amp" is one edit from "aio"), only warn.
TEST(EngineConfig, DeepSpeedAliasesAreReadAndUnusedKeysOnlyWarn) {
  const EngineConfig c = parse_engine_config(R"({"amp": {"enabled": false}, "steps_per_print": 10,
      "zero_optimization": {"stage": 3, "prefetch_bucket_size": 1e6, "max_live_parameters": 2e6,
                            "max_reuse_distance": 3e6, "param_persistence_threshold": 4e3,
                            "round_robin_gradients": true, "stage3_model_persistence_threshold": 1e9}})");
  EXPECT_EQ(c.prefetch_bucket_size, 1'000'000u);
  EXPECT_EQ(c.max_live_parameters, 2'000'000u);
  EXPECT_EQ(c.max_reuse_distance, 3'000'000u);
  EXPECT_EQ(c.param_persistence_threshold, 4'000u);
  // Both names with one value: fine.
  EXPECT_EQ(
      parse_engine_config(
          R"({"zero_optimization": {"stage": 3, "max_live_parameters": 7, "stage3_max_live_parameters": 7}})")
          .max_live_parameters,
      7u);
}

// Nesting deeper than kMaxJsonDepth is refused before anything walks it (a copy or dump() of a
// value 100k deep overflowed the stack: a segfault on a damaged file); a key twice is named with
// the keys to its object, arrays between them too; an object of 300k keys parses (the check was
// quadratic in them: minutes).
TEST(JsonParse, DepthIsBoundedDuplicatesNamedAndManyKeysRead) {
  const auto nested = [](int depth) {
    return std::string(std::size_t(depth), '[') + std::string(std::size_t(depth), ']');
  };
  const int max = config::kMaxJsonDepth;
  EXPECT_NO_THROW(config::parse(nested(max), "ok.json"));
  EXPECT_TRUE(config::try_parse(nested(max)).has_value());
  // Brackets inside strings are not nesting.
  EXPECT_NO_THROW(config::parse("{\"a\": \"" + std::string(5000, '[') + "\\\"\"}", "s.json"));
  for (bool last_wins : {false, true}) {
    try {
      config::parse("{\"x\": " + nested(100000) + "}", "deep.json", last_wins);
      ADD_FAILURE() << "100000 levels were parsed";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
      EXPECT_NE(e.message().find(fmt::format("deep.json: arrays and objects nested more than {} "
                                             "deep",
                                             max)),
                std::string::npos)
          << e.message();
    }
  }
  EXPECT_FALSE(config::try_parse(nested(max + 1)).has_value());
  EXPECT_FALSE(config::try_parse("{oops").has_value());
  EXPECT_TRUE(config::nested_too_deep(nested(max + 1)));
  EXPECT_FALSE(config::nested_too_deep(nested(max)));
  try {
    config::parse(R"({"a": [{"x": 1}, {"b": {"y": 1, "y": 2}}]})", "dup.json");
    ADD_FAILURE() << "a key twice was taken";
  } catch (const Error& e) {
    EXPECT_NE(e.message().find("dup.json: the key 'y' is given twice in a.b: keep one"),
              std::string::npos)
        << e.message();
  }
  EXPECT_EQ(config::parse(R"({"y": 1, "y": 2})", "last.json", /*duplicates_last_wins=*/true)["y"],
            2);
  std::string many = "{";
  for (int i = 0; i < 300000; ++i) many += fmt::format("{}\"t{}\": [{}]", i ? "," : "", i, i);
  many += "}";
  const config::Json j = config::parse(many, "many.json");
  EXPECT_EQ(j.size(), 300000u);
  EXPECT_EQ(j["t299999"][0], 299999);
}

TEST(EngineConfig, NearMissFindsTyposOnly) {
  EXPECT_EQ(config::near_miss("queue_dpeth", {"block_size", "queue_depth"}),
            "queue_depth");  // swapped letters
  EXPECT_EQ(config::near_miss("nvme_paths", {"nvme_path", "device"}), "nvme_path");
  EXPECT_EQ(config::near_miss("Pin-Memory", {"pin_memory"}), "pin_memory");
  EXPECT_EQ(config::near_miss("amp", {"aio"}), "");  // too short to guess
  EXPECT_EQ(config::near_miss("ratios", {"ratio"}), "ratio");
  EXPECT_EQ(config::near_miss("radius", {"ratio"}), "");  // two edits on a short key
  EXPECT_EQ(config::near_miss("reduce_scatter", {"reduce_bucket_size"}), "");
  EXPECT_EQ(config::near_miss("stage3_model_persistence_threshold",
                              {"stage3_param_persistence_threshold"}),
            "");
}

// DeepSpeed's schedules, by hand from lr_schedules.py: step t runs with iteration t - 2.
TEST(EngineConfig, ScheduledLrFollowsDeepSpeedsSchedules) {
  auto sched = [](const char* type, const char* params) {
    return parse_engine_config(std::string(R"({"zero_optimization": {"stage": 3},
        "optimizer": {"type": "AdamW", "params": {"lr": 2e-3}}, "scheduler": {"type": ")") +
                               type + R"(", "params": )" + params + "}}");
  };
  EngineConfig c =
      sched("WarmupLR", R"({"warmup_min_lr": 0, "warmup_max_lr": 1e-3, "warmup_num_steps": 10})");
  EXPECT_EQ(scheduled_lr(c.scheduler, c.adamw.lr, 1), 0.0);  // iteration -1: the minimum
  EXPECT_EQ(scheduled_lr(c.scheduler, c.adamw.lr, 2), 0.0);  // log(1) = 0
  EXPECT_NEAR(scheduled_lr(c.scheduler, c.adamw.lr, 3), 1e-3 * std::log(2.0) / std::log(10.0),
              1e-15);
  EXPECT_DOUBLE_EQ(scheduled_lr(c.scheduler, c.adamw.lr, 12), 1e-3);
  EXPECT_DOUBLE_EQ(scheduled_lr(c.scheduler, c.adamw.lr, 5000), 1e-3);
  // No maximum: DeepSpeed's default 0.001, not the optimizer's lr (2e-3 here): DeepSpeed makes the
  // schedule from the block's own params (it ran at the optimizer's).
  c = sched("WarmupLR", R"({"warmup_num_steps": 10, "warmup_type": "linear"})");
  EXPECT_DOUBLE_EQ(scheduled_lr(c.scheduler, c.adamw.lr, 7), 1e-3 * 0.5);
  EXPECT_DOUBLE_EQ(scheduled_lr(c.scheduler, c.adamw.lr, 12), 1e-3);
  // A minimum above that default is DeepSpeed's to run (it warms down to 0.001), not refused.
  c = sched("WarmupLR", R"({"warmup_min_lr": 0.002, "warmup_num_steps": 10})");
  EXPECT_DOUBLE_EQ(scheduled_lr(c.scheduler, c.adamw.lr, 12), 1e-3);
  c = sched("WarmupLR", R"({"warmup_max_lr": "auto", "warmup_num_steps": 10,
                            "warmup_type": "linear"})");  // "auto": the optimizer's lr
  const double lr = c.adamw.lr;                           // 2e-3 as a float
  EXPECT_DOUBLE_EQ(scheduled_lr(c.scheduler, c.adamw.lr, 7), lr * 0.5);
  EXPECT_DOUBLE_EQ(scheduled_lr(c.scheduler, c.adamw.lr, 12), lr);
  c = sched("WarmupDecayLR",
            R"({"warmup_max_lr": 1e-2, "warmup_num_steps": 10, "total_num_steps": 110,
                                 "warmup_type": "linear"})");
  EXPECT_DOUBLE_EQ(scheduled_lr(c.scheduler, c.adamw.lr, 12), 1e-2);
  EXPECT_DOUBLE_EQ(scheduled_lr(c.scheduler, c.adamw.lr, 62), 5e-3);
  EXPECT_EQ(scheduled_lr(c.scheduler, c.adamw.lr, 200), 0.0);
  c = sched("WarmupCosineLR", R"({"warmup_num_steps": 10, "total_num_steps": 110})");
  EXPECT_EQ(scheduled_lr(c.scheduler, c.adamw.lr, 1), 0.0);
  EXPECT_NEAR(scheduled_lr(c.scheduler, c.adamw.lr, 61), lr * (1e-4 + (1 - 1e-4) * 0.5),
              1e-15);  // halfway
  EXPECT_NEAR(scheduled_lr(c.scheduler, c.adamw.lr, 111), lr * 1e-4,
              1e-15);                                                 // the end: cos_min_ratio
  EXPECT_DOUBLE_EQ(scheduled_lr(LrScheduleConfig{}, 3e-4, 7), 3e-4);  // no scheduler: constant
  // Hugging Face's "auto" as it fills them: warmup_max_lr is the learning rate (WarmupDecayLR ran
  // at its 0.001 default), total_num_steps the run's steps (0 here, strata-train's --steps; it
  // was refused as missing).
  c = sched("WarmupDecayLR",
            R"({"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": 10,
                                 "total_num_steps": "auto", "warmup_type": "linear"})");
  EXPECT_LT(c.scheduler.warmup_max_lr, 0);
  EXPECT_EQ(c.scheduler.total_num_steps, 0);
  c.scheduler.total_num_steps = 110;
  EXPECT_DOUBLE_EQ(scheduled_lr(c.scheduler, c.adamw.lr, 12), lr);
  c = sched("WarmupCosineLR", R"({"warmup_num_steps": 10, "total_num_steps": "auto"})");
  EXPECT_EQ(c.scheduler.total_num_steps, 0);
  // Left out (not "auto") it is still required, naming what it is.
  try {
    sched("WarmupDecayLR", R"({"warmup_num_steps": 10})");
    ADD_FAILURE() << "WarmupDecayLR without total_num_steps was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("the run's total optimizer steps"), std::string::npos)
        << e.what();
  }
}

// ---- placements ----

TEST(EngineConfig, PlacementsFromOffloadDevices) {
  auto parse_zero = [](const std::string& zero) {
    return parse_engine_config(R"({"zero_optimization": {"stage": 3, )" + zero + "}}");
  };
  EngineConfig c =
      parse_zero(R"("offload_param": {"device": "none"}, "offload_optimizer": {"device": "none"})");
  EXPECT_EQ(c.params.device_fraction, 1.0);
  EXPECT_EQ(c.optimizer.device_fraction, 1.0);
  EXPECT_EQ(c.grads.device_fraction, 1.0);

  c = parse_zero(R"("offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"})");
  EXPECT_EQ(c.params.device_fraction, 0.0);
  EXPECT_EQ(c.params.host_fraction, 1.0);
  EXPECT_EQ(c.optimizer.host_fraction, 1.0);  // ratio defaults to 1: all on the CPU
  EXPECT_EQ(c.optimizer.device_fraction, 0.0);
  EXPECT_EQ(c.grads.host_fraction, 1.0);  // the host optimizer wants its gradients there

  c = parse_zero(
      R"("offload_optimizer": {"device": "cpu", "ratio": 0.3}, "offload_grads": "none")");
  EXPECT_DOUBLE_EQ(c.optimizer.device_fraction, 0.7);
  EXPECT_DOUBLE_EQ(c.optimizer.host_fraction, 0.3);
  EXPECT_NEAR(c.optimizer.nvme_fraction(), 0.0, 1e-12);
  EXPECT_EQ(c.grads.device_fraction, 1.0);

  c = parse_zero(R"("offload_param": {"device": "nvme", "nvme_path": "/p", "host_fraction": 0.25},
                    "offload_optimizer": {"device": "nvme", "nvme_path": "/o", "host_fraction": 0.5, "pin_memory": false})");
  EXPECT_EQ(c.params.device_fraction, 0.0);
  EXPECT_EQ(c.params.host_fraction, 0.25);
  EXPECT_EQ(c.params.nvme_fraction(), 0.75);
  EXPECT_EQ(c.optimizer.host_fraction, 0.5);
  EXPECT_EQ(c.optimizer.nvme_fraction(), 0.5);
  EXPECT_EQ(c.grads.host_fraction, 1.0);
  EXPECT_FALSE(c.pin_memory);

  // ratio only means something with device "cpu": warned and ignored for nvme.
  c = parse_zero(R"("offload_optimizer": {"device": "nvme", "nvme_path": "/o", "ratio": 0.5})");
  EXPECT_EQ(c.optimizer.nvme_fraction(), 1.0);

  // Every piece takes a device / host split: the weights by offload_param.ratio, the gradients
  // by offload_grads_ratio (strata's), as the optimizer state by offload_optimizer.ratio.
  c = parse_zero(
      R"("offload_param": {"device": "cpu", "ratio": 0.25}, "offload_optimizer": {"device": "cpu"},
                    "offload_grads_ratio": 0.6)");
  EXPECT_DOUBLE_EQ(c.params.device_fraction, 0.75);
  EXPECT_DOUBLE_EQ(c.params.host_fraction, 0.25);
  EXPECT_DOUBLE_EQ(c.grads.device_fraction, 0.4);
  EXPECT_DOUBLE_EQ(c.grads.host_fraction, 0.6);
  EXPECT_NEAR(c.grads.nvme_fraction(), 0.0, 1e-12);
  // Ignored, with a warning naming the key that does split them, where the piece is not on "cpu".
  testing::internal::CaptureStderr();
  c = parse_zero(
      R"("offload_param": {"device": "nvme", "nvme_path": "/p", "ratio": 0.5}, "offload_grads": "none",
                    "offload_grads_ratio": 0.5)");
  const std::string said = testing::internal::GetCapturedStderr();
  EXPECT_EQ(c.params.nvme_fraction(), 1.0);
  EXPECT_EQ(c.grads.device_fraction, 1.0);
  EXPECT_NE(said.find("'zero_optimization.offload_param.ratio' is ignored"), std::string::npos)
      << said;
  EXPECT_NE(said.find("(for host and NVMe: zero_optimization.offload_param.host_fraction)"),
            std::string::npos)
      << said;
  EXPECT_NE(said.find("'zero_optimization.offload_grads_ratio' is ignored"), std::string::npos)
      << said;

  // Gradients on NVMe: beside the optimizer state (its nvme_path), else beside the weights; a
  // share kept on the host by offload_grads_host_fraction.
  c = parse_zero(R"("offload_param": {"device": "nvme", "nvme_path": "/p"},
                    "offload_optimizer": {"device": "nvme", "nvme_path": "/o"}, "offload_grads": "nvme")");
  EXPECT_EQ(c.grads.nvme_fraction(), 1.0);
  EXPECT_EQ(c.grad_nvme_paths, std::vector<std::string>{"/o"});
  c = parse_zero(
      R"("offload_param": {"device": "nvme", "nvme_path": "/p"}, "offload_optimizer": {"device": "cpu"},
                    "offload_grads": "nvme", "offload_grads_host_fraction": 0.25)");
  EXPECT_EQ(c.grads.device_fraction, 0.0);
  EXPECT_EQ(c.grads.host_fraction, 0.25);
  EXPECT_EQ(c.grad_nvme_paths, std::vector<std::string>{"/p"});
  c = parse_zero(
      R"("offload_optimizer": {"device": "nvme", "nvme_path": "/o"}, "offload_grads": "nvme",
                    "offload_grads_ratio": 0.5)");  // (ignored: warned once per process, above)
  EXPECT_EQ(c.grads.nvme_fraction(), 1.0);
  // Not asked for, never there.
  c = parse_zero(R"("offload_optimizer": {"device": "nvme", "nvme_path": "/o"})");
  EXPECT_EQ(c.grads.host_fraction, 1.0);
  EXPECT_TRUE(c.grad_nvme_paths.empty());
}

TEST(EngineConfig, TierAtFollowsUnitOrder) {
  const Placement p{0.25, 0.5};
  EXPECT_EQ(p.tier_at(0, 100), Tier::kDevice);
  EXPECT_EQ(p.tier_at(24.9, 100), Tier::kDevice);
  EXPECT_EQ(p.tier_at(25, 100), Tier::kHost);
  EXPECT_EQ(p.tier_at(74.9, 100), Tier::kHost);
  EXPECT_EQ(p.tier_at(75, 100), Tier::kNvme);
  EXPECT_EQ(p.tier_at(99.9, 100), Tier::kNvme);
  EXPECT_EQ((Placement{0.0, 1.0}).tier_at(99.9, 100), Tier::kHost);
  EXPECT_EQ((Placement{0.0, 0.0}).tier_at(0, 100), Tier::kNvme);
  EXPECT_STREQ(tier_name(Tier::kDevice), "device");
  EXPECT_STREQ(tier_name(Tier::kHost), "host");
  EXPECT_STREQ(tier_name(Tier::kNvme), "nvme");
}

// ---- the memory planner ----
//
// The synthetic model, 2 ranks (padding to multiples of 2 x 2048 = 4096 elements):
//   unit   numel     padded    shard
//   u0     819200    819200    409600
//   u1     819201    823296    411648   (one element over: a whole 4096 more)
//   u2     100       4096      2048     (persistent: <= 100000)
//   u3     409600    409600    204800
//   total            2056192   1028096; largest padded 823296, largest shard 411648
// bf16 (c = 2), stage3_max_live_parameters 1e6, reduce_bucket_size 1.5e6 (749568 elements a
// rank: every unit reduced in one bucket), activations 1e7.
PlanInputs synthetic_inputs() {
  PlanInputs in;
  in.units = {{"u0", 819200}, {"u1", 819201}, {"u2", 100}, {"u3", 409600}};
  in.world_size = 2;
  in.device_capacity = 1ull << 30;
  in.host_capacity = 1ull << 30;
  in.nvme_capacity = 1ull << 30;
  in.activation_bytes = 10'000'000;
  return in;
}

// `zero_extra` (", key: value, ..."): keys of zero_optimization beside the two below, a key of
// theirs replacing it (a config may not give a key twice).
EngineConfig synthetic_config(const std::string& zero_extra, int world_size = 2) {
  nlohmann::json doc = nlohmann::json::parse(
      R"({"bf16": {"enabled": true}, "zero_optimization": {"stage3_max_live_parameters": 1e6,
                                 "reduce_bucket_size": 1.5e6}})");
  const std::size_t comma = zero_extra.find(',');
  if (comma != std::string::npos)
    doc["zero_optimization"].update(
        nlohmann::json::parse("{" + zero_extra.substr(comma + 1) + "}"));
  return parse_engine_config(doc.dump(), world_size);
}

std::uint64_t line(const MemoryPlan& plan, const std::string& prefix, Tier tier) {
  std::uint64_t sum = 0;
  for (const PlanLine& l : plan.lines) {
    if (l.tier == tier && l.what.rfind(prefix, 0) == 0) sum += l.bytes;
  }
  return sum;
}

TEST(MemoryPlan, Stage3NoOffload) {
  const MemoryPlan p = plan_memory(synthetic_config(R"(, "stage": 3)"), synthetic_inputs());
  // u2 is persistent: its gathered weights, no shard of its own.
  EXPECT_EQ(line(p, "compute weights", Tier::kDevice), (1028096u - 2048) * 2);
  EXPECT_EQ(line(p, "persistent units", Tier::kDevice), 4096u * 2);
  EXPECT_EQ(line(p, "gathered units", Tier::kDevice),
            1'000'000u * 2);  // min(max_live, 2052096) > largest
  EXPECT_EQ(line(p, "prefetch", Tier::kDevice), 823296u * 2);
  EXPECT_EQ(line(p, "gradient shard", Tier::kDevice), 1028096u * 4);
  EXPECT_EQ(line(p, "optimizer state", Tier::kDevice), 1028096u * 12);
  EXPECT_EQ(line(p, "unit gradients", Tier::kDevice),
            823'296u * 4 * 2);  // the largest unit, overlap_comm
  // reduce_bucket_size 1.5e6 is 749568 elements a rank, more than the largest shard: each unit
  // is reduced in one bucket, into one shard-sized output.
  EXPECT_EQ(line(p, "reduce-scatter output (411648 elements", Tier::kDevice), 411'648u * 4);
  EXPECT_EQ(line(p, "reduce-scatter bucket", Tier::kDevice), 0u);
  EXPECT_EQ(line(p, "activations", Tier::kDevice), 10'000'000u);
  EXPECT_EQ(p.device_bytes, 38'742'784u + 1'646'592u);
  EXPECT_EQ(p.host_bytes, 0u);  // nothing leaves the device: no staging either
  EXPECT_EQ(p.nvme_bytes, 0u);
  EXPECT_TRUE(p.fits);
  EXPECT_TRUE(p.problems.empty());
}

TEST(MemoryPlan, OptimizerOnCpu) {
  const MemoryPlan p =
      plan_memory(synthetic_config(R"(, "stage": 3, "offload_optimizer": {"device": "cpu"})"),
                  synthetic_inputs());
  EXPECT_EQ(p.device_bytes,
            2'052'096u + 8'192u + 2'000'000u + 1'646'592u + 6'586'368u + 1'646'592u + 10'000'000u);
  EXPECT_EQ(line(p, "gradient shard", Tier::kHost), 1028096u * 4);
  EXPECT_EQ(line(p, "optimizer state", Tier::kHost), 1028096u * 12);
  EXPECT_EQ(line(p, "gradient D2H staging", Tier::kHost), 2u * 411648 * 4);
  // The CPU optimizer's new bf16 weights on their way to the device: two at a time.
  EXPECT_EQ(line(p, "new compute-weight staging", Tier::kHost), 2u * 411648 * 2);
  // The early optimizer step (on by default): a second copy of the host state, and every
  // unit's new bf16 weights held until the unit switches to them (end of step() or its
  // next fetch).
  EXPECT_TRUE(p.early_optimizer_step);
  EXPECT_EQ(line(p, "early optimizer step: 2nd copy of host optimizer state", Tier::kHost),
            1028096u * 12);
  EXPECT_EQ(line(p, "early optimizer step: new device weights until switched", Tier::kHost),
            1028096u * 2);
  EXPECT_EQ(p.host_bytes,
            4'112'384u + 12'337'152u + 3'293'184u + 1'646'592u + 12'337'152u + 2'056'192u);
  EXPECT_EQ(p.nvme_bytes, 0u);
  EXPECT_TRUE(p.fits);
  EXPECT_TRUE(p.notes.empty());

  // Gradients half on the device (u0, u1: by position), half on the host (u2, u3): the early
  // step takes only the units whose gradients are on the host, and only theirs have second copies
  // (it counted every unit's: 2.5x the host bytes the run holds).
  const MemoryPlan half = plan_memory(
      synthetic_config(
          R"(, "stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_grads_ratio": 0.5)"),
      synthetic_inputs());
  EXPECT_TRUE(half.early_optimizer_step);
  EXPECT_EQ(line(half, "gradient shard", Tier::kDevice), (409600u + 411648u) * 4);
  EXPECT_EQ(line(half, "gradient shard", Tier::kHost), (2048u + 204800u) * 4);
  EXPECT_EQ(line(half, "early optimizer step: 2nd copy of host optimizer state", Tier::kHost),
            (2048u + 204800u) * 12);
  EXPECT_EQ(line(half, "early optimizer step: new device weights until switched", Tier::kHost),
            (2048u + 204800u) * 2);

  // sub_group_size below a unit: the host optimizer steps it a sub-group (here one page of 2048
  // elements, the least) at a time, so two sub-groups' new weights are staged, not two shards'.
  // reduce_bucket_size below a unit: the reducer works a bucket (here 2048 elements of each of
  // the two ranks' shards) at a time, so its output and host staging hold that much; the unit's
  // whole gradient the model writes is still planned, and the notes say so.
  const MemoryPlan small = plan_memory(
      synthetic_config(
          R"(, "stage": 3, "offload_optimizer": {"device": "cpu"}, "sub_group_size": 1000,
                          "reduce_bucket_size": 1000)"),
      synthetic_inputs());
  EXPECT_EQ(line(small, "new compute-weight staging (2 x 2048 elements)", Tier::kHost),
            2u * 2048 * 2);
  EXPECT_EQ(line(small, "gradient D2H staging (2 x 2048 elements", Tier::kHost), 2u * 2048 * 4);
  EXPECT_EQ(small.host_bytes,
            p.host_bytes - 1'646'592u + 2u * 2048 * 2 - 3'293'184u + 2u * 2048 * 4);
  EXPECT_EQ(line(small, "reduce-scatter output (2048 elements", Tier::kDevice), 2048u * 4);
  EXPECT_EQ(line(small, "reduce-scatter bucket (2 x 2048 elements", Tier::kDevice), 2u * 2048 * 4);
  EXPECT_EQ(line(small, "unit gradients", Tier::kDevice), line(p, "unit gradients", Tier::kDevice));
  ASSERT_EQ(small.notes.size(), 2u) << small.table();
  EXPECT_NE(small.notes[0].find(
                "zero_optimization.reduce_bucket_size 1000 is below the largest unit (819201 "
                "elements): gradients are accumulated in buckets of 2048 elements a rank (whole "
                "pages) and the largest reduce-scattered bucket by bucket, but the model writes a "
                "unit's whole fp32 gradient"),
            std::string::npos)
      << small.notes[0];
  EXPECT_NE(small.notes[1].find("zero_optimization.sub_group_size 1000 is used as 2048 elements"),
            std::string::npos)
      << small.notes[1];
  // Not given, the defaults (5e8, 1e9 elements) are no one's choice: nothing said (a Llama-3-8B's
  // 525M-element embedding drew the note from a config without the key).
  const EngineConfig dflt = parse_engine_config(
      R"({"bf16": {"enabled": true}, "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}})",
      1);
  PlanInputs big = synthetic_inputs();
  big.world_size = 1;
  big.units = {{"embedding", 600'000'000}, {"layer", 1000}};
  big.host_capacity = big.device_capacity = std::uint64_t(1) << 40;
  const MemoryPlan quiet = plan_memory(dflt, big);
  EXPECT_TRUE(quiet.notes.empty()) << quiet.table();

  EngineConfig off = synthetic_config(R"(, "stage": 3, "offload_optimizer": {"device": "cpu"})");
  off.overlap_optimizer = false;
  const MemoryPlan q = plan_memory(off, synthetic_inputs());
  EXPECT_FALSE(q.early_optimizer_step);
  EXPECT_EQ(q.host_bytes, 4'112'384u + 12'337'152u + 3'293'184u + 1'646'592u);

  // Left unset and short of host memory for the second copy: off, with a note.
  EngineConfig tight = synthetic_config(R"(, "stage": 3, "offload_optimizer": {"device": "cpu"})");
  tight.host_budget_bytes = 25'000'000;
  const MemoryPlan t = plan_memory(tight, synthetic_inputs());
  EXPECT_TRUE(t.fits) << t.table();
  EXPECT_FALSE(t.early_optimizer_step);
  ASSERT_EQ(t.notes.size(), 1u);
  // 35782656 bytes needed, in whole 2 MiB pieces of the pinned pool: 18 of them.
  EXPECT_NE(t.notes[0].find("strata.host_budget_bytes to 37748736"), std::string::npos)
      << t.notes[0];
  EXPECT_NE(t.table().find("note: strata.overlap_optimizer is off"), std::string::npos)
      << t.table();
  // Asked for: refused, naming the way out.
  tight.overlap_optimizer = true;
  const MemoryPlan f = plan_memory(tight, synthetic_inputs());
  EXPECT_FALSE(f.fits);
  ASSERT_EQ(f.problems.size(), 1u);
  EXPECT_NE(f.problems[0].find("strata.overlap_optimizer false"), std::string::npos)
      << f.problems[0];
  // The host optimizer stages new weights a sub-group at a time: a smaller one is a way too.
  EXPECT_NE(f.problems[0].find(
                "a smaller zero_optimization.sub_group_size (the new weights are staged 411648 "
                "elements at a time)"),
            std::string::npos)
      << f.problems[0];
}

TEST(MemoryPlan, OptimizerRatioSplitsWholeUnitsInOrder) {
  // ratio 0.5: per-unit optimizer bytes 4915200, 4939776, 24576, 2457600 (total 12337152).
  // u1 starts at 0.398 of the total (device), u2 at 0.799 (host).
  const MemoryPlan p = plan_memory(
      synthetic_config(
          R"(, "stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0.5}, "offload_grads": "none")"),
      synthetic_inputs());
  EXPECT_EQ(line(p, "optimizer state", Tier::kDevice), 4'915'200u + 4'939'776u);
  EXPECT_EQ(line(p, "optimizer state", Tier::kHost), 24'576u + 2'457'600u);
  EXPECT_EQ(line(p, "gradient shard", Tier::kDevice), 1028096u * 4);
  // The host optimizer still reads gradients on the host: staging is budgeted.
  EXPECT_EQ(line(p, "gradient D2H staging", Tier::kHost), 2u * 411648 * 4);
}

TEST(MemoryPlan, ParamsAndOptimizerOnNvme) {
  const MemoryPlan p = plan_memory(synthetic_config(R"(, "stage": 3, "sub_group_size": 1e5,
          "offload_param": {"device": "nvme", "nvme_path": "/p"},
          "offload_optimizer": {"device": "nvme", "nvme_path": ["/o1", "/o2"]})"),
                                   synthetic_inputs());
  EXPECT_EQ(line(p, "compute weights", Tier::kDevice), 0u);
  EXPECT_EQ(p.device_bytes,
            8'192u + 2'000'000u + 1'646'592u + 6'586'368u + 1'646'592u + 10'000'000u);
  // offload_param.buffer_count (5) whole shards read ahead (buffer_size is stored).
  EXPECT_EQ(line(p, "parameter swap buffers", Tier::kHost), 5u * 411648 * 2);
  // offload_optimizer.buffer_count (4): one read ahead, one stepping, two written behind, each
  // one sub-group's state: sub_group_size 1e5 in whole pages of 2048 elements is 98304.
  EXPECT_EQ(line(p, "optimizer swap buffers (4 x 98304 elements' state", Tier::kHost),
            4u * 98304 * 12);
  EXPECT_EQ(line(p, "new compute-weight staging (2 x 98304 elements)", Tier::kHost),
            2u * 98304 * 2);
  // u2's new weights (persistent: on the device) wait in host memory until it switches.
  EXPECT_EQ(line(p, "early optimizer step: new device weights until switched", Tier::kHost),
            2048u * 2);
  EXPECT_EQ(p.host_bytes, 4'112'384u + 3'293'184u + 4'116'480u + 4'718'592u + 393'216u + 4'096u);
  EXPECT_EQ(line(p, "compute weights", Tier::kNvme), (1028096u - 2048) * 2);  // not u2's
  EXPECT_EQ(line(p, "optimizer state", Tier::kNvme), 1028096u * 12);
  // The early optimizer step writes its second copies to NVMe too.
  EXPECT_EQ(line(p, "early optimizer step: 2nd copy of NVMe optimizer state", Tier::kNvme),
            1028096u * 12);
  EXPECT_EQ(line(p, "early optimizer step: 2nd copy of NVMe compute weights", Tier::kNvme),
            (1028096u - 2048) * 2);
  // Two swap stores (the paths differ), each growing its files by whole 1 MiB stripes:
  // 4104192 -> 4 MiB, 24674304 -> 24 MiB.
  EXPECT_EQ(line(p, "swap files: rounded up", Tier::kNvme),
            (4u << 20) - 4'104'192u + (24u << 20) - 24'674'304u);
  EXPECT_EQ(p.nvme_bytes, (28u << 20));
  EXPECT_TRUE(p.fits);

  // host_fraction 0.5 keeps the first half of the optimizer state (whole units) in host memory.
  const MemoryPlan h = plan_memory(
      synthetic_config(
          R"(, "stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/o", "host_fraction": 0.5})"),
      synthetic_inputs());
  EXPECT_EQ(line(h, "optimizer state", Tier::kHost), 4'915'200u + 4'939'776u);
  EXPECT_EQ(line(h, "optimizer state", Tier::kNvme), 24'576u + 2'457'600u);
  EXPECT_EQ(line(h, "optimizer swap buffers", Tier::kHost), 4u * 411648 * 12);
}

// One rank: a unit whose compute-weight shard is on the device is the whole unit, kept
// resident (Engine::finalize): no gathered copy, no prefetch. Offloaded ones are gathered.
TEST(MemoryPlan, OneRankGathersOnlyOffloadedUnits) {
  PlanInputs in = synthetic_inputs();
  in.world_size = 1;  // padding to 2048: u0 819200, u1 821248, u2 2048 (persistent), u3 409600
  const MemoryPlan dev = plan_memory(synthetic_config(R"(, "stage": 3)", 1), in);
  EXPECT_EQ(line(dev, "compute weights", Tier::kDevice), (819200u + 821248u + 409600u) * 2);
  EXPECT_EQ(line(dev, "gathered units", Tier::kDevice), 0u) << dev.table();
  EXPECT_EQ(line(dev, "prefetch", Tier::kDevice), 0u) << dev.table();
  const MemoryPlan host =
      plan_memory(synthetic_config(R"(, "stage": 3, "offload_param": {"device": "cpu"})", 1), in);
  EXPECT_EQ(line(host, "gathered units", Tier::kDevice), 1'000'000u * 2);  // min(max_live, 2050048)
  EXPECT_EQ(line(host, "prefetch", Tier::kDevice), 821248u * 2);
}

TEST(MemoryPlan, Stage2KeepsFullWeights) {
  const MemoryPlan p = plan_memory(synthetic_config(R"(, "stage": 2)"), synthetic_inputs());
  EXPECT_EQ(line(p, "full weights", Tier::kDevice), 2'056'192u * 2);
  EXPECT_EQ(line(p, "compute weights", Tier::kDevice), 0u);
  EXPECT_EQ(line(p, "gathered units", Tier::kDevice), 0u);
  EXPECT_EQ(line(p, "unit gradient (", Tier::kDevice),
            823'296u * 4);  // overlap_comm off at stage 2
  EXPECT_EQ(p.device_bytes,
            4'112'384u + 4'112'384u + 12'337'152u + 3'293'184u + 1'646'592u + 10'000'000u);
  EXPECT_EQ(p.host_bytes, 0u);
}

// The model writes a unit's whole gradient whatever reduce_bucket_size says, and the reducer's
// buckets are never larger than the largest shard (DeepSpeed's default 5e8 elements planned 4 GB
// of device memory the engine never takes).
TEST(MemoryPlan, BucketsAreAtMostTheLargestShardAndFp32PlansWith4Bytes) {
  EngineConfig c = synthetic_config(R"(, "stage": 3, "overlap_comm": false)");
  for (std::uint64_t size : {std::uint64_t(1000), std::uint64_t(500'000'000)}) {
    c.reduce_bucket_size = size;
    const MemoryPlan p = plan_memory(c, synthetic_inputs());
    EXPECT_EQ(line(p, "unit gradient (", Tier::kDevice), 823'296u * 4) << size;
    EXPECT_EQ(line(p, "reduce-scatter output", Tier::kDevice),
              (size == 1000 ? 2048u : 411'648u) * 4)
        << size;
    EXPECT_EQ(line(p, "reduce-scatter bucket", Tier::kDevice), size == 1000 ? 2u * 2048 * 4 : 0u)
        << size;
  }
  c.compute_dtype = DType::kF32;
  const MemoryPlan p = plan_memory(c, synthetic_inputs());
  EXPECT_EQ(line(p, "compute weights", Tier::kDevice), (1028096u - 2048) * 4);
  EXPECT_EQ(line(p, "prefetch", Tier::kDevice), 823296u * 4);
}

// A piece already split between device and host: the fix named is its ratio, not a setting it
// already has ("keep gradient shards on the host (offload_grads \"cpu\")" with offload_grads cpu).
TEST(MemoryPlan, ASplitPieceIsFixedByItsRatio) {
  PlanInputs in = synthetic_inputs();
  in.device_capacity = 4'000'000;
  const MemoryPlan p = plan_memory(
      synthetic_config(R"(, "stage": 3, "offload_param": {"device": "cpu", "ratio": 0.5},
                          "offload_optimizer": {"device": "cpu"}, "offload_grads_ratio": 0.5)"),
      in);
  ASSERT_FALSE(p.fits);
  ASSERT_FALSE(p.problems.empty());
  const std::string& d = p.problems[0];
  EXPECT_EQ(d.rfind("device:", 0), 0u) << d;
  EXPECT_NE(d.find("raise zero_optimization.offload_grads_ratio (now 0.5"), std::string::npos) << d;
  EXPECT_NE(d.find("raise offload_param.ratio (now 0.5"), std::string::npos) << d;
  EXPECT_EQ(d.find("offload_grads \"cpu\""), std::string::npos) << d;
  in = synthetic_inputs();
  in.host_capacity = 4u << 20;
  const MemoryPlan h = plan_memory(
      synthetic_config(
          R"(, "stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_grads_ratio": 0.5)"),
      in);
  ASSERT_FALSE(h.fits);
  std::string all;
  for (const auto& q : h.problems) all += q + "\n";
  EXPECT_NE(all.find("lower zero_optimization.offload_grads_ratio (now 0.5"), std::string::npos)
      << all;
  EXPECT_EQ(all.find("offload_grads \"none\""), std::string::npos) << all;
}

// Gradient shards on NVMe: their bytes on the NVMe tier, the reducer's staging (two buckets in
// flight, each with what its keys held) and the optimizer's read-ahead buffers on the host; a
// host shortfall with host gradients names the move to NVMe.
TEST(MemoryPlan, GradientsOnNvme) {
  PlanInputs in = synthetic_inputs();
  EngineConfig host =
      synthetic_config(R"(, "stage": 3, "reduce_bucket_size": 16384, "sub_group_size": 16384,
      "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"})");
  EngineConfig nv =
      synthetic_config(R"(, "stage": 3, "reduce_bucket_size": 16384, "sub_group_size": 16384,
      "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"}, "offload_grads": "nvme")");
  host.overlap_optimizer = nv.overlap_optimizer = false;  // (no second copies to drop when short)
  const MemoryPlan h = plan_memory(host, in), n = plan_memory(nv, in);
  const std::uint64_t grads = line(h, "gradient shard", Tier::kHost);
  ASSERT_GT(grads, 0u);
  EXPECT_EQ(line(n, "gradient shard", Tier::kHost), 0u);
  EXPECT_EQ(line(n, "gradient shard", Tier::kNvme), grads);
  EXPECT_EQ(line(n, "gradient NVMe staging", Tier::kHost), 4u * 8192 * 4) << n.table();
  EXPECT_EQ(line(n, "gradient swap buffers", Tier::kHost), 2u * 16384 * 4) << n.table();
  EXPECT_EQ(line(h, "gradient NVMe staging", Tier::kHost), 0u);
  // No host gradients, no device gradients for the host optimizer: no D2H staging (it planned 2
  // bucket shares nothing used).
  EXPECT_EQ(line(n, "gradient D2H staging", Tier::kHost), 0u) << n.table();
  // One directory spelled two ways is one store: its files rounded up to whole stripes once.
  EngineConfig one = nv;
  one.aio.block_size = std::size_t(64) << 20;  // (neither piece a whole number of these stripes)
  EngineConfig spelled = one;
  spelled.grad_nvme_paths = {"/tmp/"};
  const std::uint64_t slack = line(plan_memory(one, in), "swap files", Tier::kNvme);
  EXPECT_GT(slack, 0u);
  EXPECT_EQ(line(plan_memory(spelled, in), "swap files", Tier::kNvme), slack);
  EXPECT_FALSE(n.early_optimizer_step);  // (it takes units with host gradients)
  in.host_capacity = h.host_bytes - 1;
  const MemoryPlan short_h = plan_memory(host, in);
  ASSERT_FALSE(short_h.fits);
  std::string all;
  for (const auto& q : short_h.problems) all += q + "\n";
  EXPECT_NE(all.find("move the gradient shards to NVMe (zero_optimization.offload_grads \"nvme\""),
            std::string::npos)
      << all;
  // Half kept on the host: the fix is that share.
  nv.grads.host_fraction = 0.5;
  in.host_capacity = 4u << 20;
  const MemoryPlan short_n = plan_memory(nv, in);
  ASSERT_FALSE(short_n.fits);
  all.clear();
  for (const auto& q : short_n.problems) all += q + "\n";
  EXPECT_NE(all.find("lower zero_optimization.offload_grads_host_fraction (now 0.5"),
            std::string::npos)
      << all;
  EXPECT_NE(all.find("the gradient NVMe staging holds 4 x"), std::string::npos) << all;
  // No directory for them: refused naming the keys.
  nv.grad_nvme_paths.clear();
  try {
    plan_memory(nv, synthetic_inputs());
    ADD_FAILURE() << "gradients on NVMe without a path were planned";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("offload_optimizer.nvme_path"), std::string::npos)
        << e.what();
  }
}

TEST(MemoryPlan, ImpossibleRequestNamesTierAndMissingBytes) {
  PlanInputs in = synthetic_inputs();
  in.device_capacity = 36'000'000;  // the no-offload plan needs 40389376
  const MemoryPlan p = plan_memory(synthetic_config(R"(, "stage": 3)"), in);
  EXPECT_FALSE(p.fits);
  ASSERT_EQ(p.problems.size(), 1u);
  EXPECT_EQ(p.problems[0].rfind("device:", 0), 0u) << p.problems[0];
  EXPECT_NE(p.problems[0].find("4389376 bytes missing"), std::string::npos) << p.problems[0];
  EXPECT_NE(p.problems[0].find("offload_optimizer.device"), std::string::npos) << p.problems[0];
  EXPECT_NE(p.problems[0].find("stage3_max_live_parameters"), std::string::npos) << p.problems[0];

  // Host over its strata budget and NVMe over its free space, at once.
  in = synthetic_inputs();
  in.nvme_capacity = 14'000'000;
  const EngineConfig nv = parse_engine_config(
      R"({"bf16": {"enabled": true}, "strata": {"host_budget_bytes": 15e6},
          "zero_optimization": {"stage": 3, "stage3_max_live_parameters": 1e6, "reduce_bucket_size": 1.5e6,
          "sub_group_size": 1e5, "offload_param": {"device": "nvme", "nvme_path": "/p"},
          "offload_optimizer": {"device": "nvme", "nvme_path": "/o"}}})",
      2);
  const MemoryPlan q = plan_memory(nv, in);
  EXPECT_FALSE(q.fits);
  // strata.host_budget_bytes wins over the machine, in the whole 2 MiB pieces the pinned pool
  // commits.
  EXPECT_EQ(q.host_capacity, 15'000'000u / (2 << 20) * (2 << 20));
  ASSERT_EQ(q.problems.size(), 2u);
  EXPECT_EQ(q.problems[0].rfind("host:", 0), 0u) << q.problems[0];
  EXPECT_NE(
      q.problems[0].find(
          "has 14.00 MiB (the budget of 15000000 bytes in whole 2 MiB pieces, as the pinned pool "
          "commits it; 1.86 MiB = 1953792 bytes missing)"),
      std::string::npos)
      << q.problems[0];
  EXPECT_NE(
      q.problems[0].find(
          "a smaller zero_optimization.reduce_bucket_size (the gradient D2H staging holds 2 x "
          "411648 elements, 3.14 MiB)"),
      std::string::npos)
      << q.problems[0];
  EXPECT_NE(q.problems[0].find("offload_optimizer.buffer_count (now 4"), std::string::npos)
      << q.problems[0];
  EXPECT_NE(q.problems[0].find("offload_param.buffer_count (now 5"), std::string::npos)
      << q.problems[0];
  EXPECT_NE(
      q.problems[0].find(
          "a smaller zero_optimization.sub_group_size (the optimizer's swap buffers hold 98304 "
          "elements' state each, 1.12 MiB)"),
      std::string::npos)
      << q.problems[0];
  EXPECT_NE(q.problems[0].find("strata.host_budget_bytes"), std::string::npos) << q.problems[0];
  EXPECT_EQ(q.problems[1].rfind("nvme:", 0), 0u) << q.problems[1];
  // 14389248 bytes of state in two stores, whole 1 MiB stripes each: 2 + 12 MiB.
  EXPECT_NE(q.problems[1].find("680064 bytes missing"), std::string::npos) << q.problems[1];
  EXPECT_NE(q.problems[1].find("nvme_path"), std::string::npos) << q.problems[1];
  EXPECT_EQ(q.problems[1].find("ranks on this node"), std::string::npos) << q.problems[1];
  // Several ranks on one node: the message says the capacity is this rank's share.
  in.ranks_on_node = 4;
  const MemoryPlan shared = plan_memory(nv, in);
  ASSERT_EQ(shared.problems.size(), 2u);
  EXPECT_NE(shared.problems[1].find("the 4 ranks on this node split each drive's free space"),
            std::string::npos)
      << shared.problems[1];
}

// A plan that does not fit offers only the fixes that would shrink it: more ranks where the
// device holds shards (with none there, a plan for more ranks only grew), the gradients back on a
// device with room for them (a full device was offered them), more in host memory where the
// host has room (an over-budget host was offered more).
TEST(MemoryPlan, OnlyFixesThatShrinkThePlanAreOffered) {
  const auto problems = [](const EngineConfig& c, const PlanInputs& in) {
    std::string all;
    for (const auto& q : plan_memory(c, in).problems) all += q + "\n";
    return all;
  };
  const std::string ranks = "more data-parallel ranks", none = "offload_grads \"none\"";
  PlanInputs in = synthetic_inputs();
  in.device_capacity = 2'000'000;
  const std::string offloaded =
      problems(synthetic_config(R"(, "stage": 3, "offload_param": {"device": "cpu"},
                          "offload_optimizer": {"device": "cpu"}, "offload_grads": "cpu")"),
               in);
  EXPECT_NE(offloaded.find("device:"), std::string::npos) << offloaded;
  EXPECT_EQ(offloaded.find(ranks), std::string::npos) << offloaded;
  in.device_capacity = 36'000'000;
  const std::string resident = problems(synthetic_config(R"(, "stage": 3)"), in);
  EXPECT_NE(resident.find(ranks), std::string::npos) << resident;
  // Host over its budget with the gradients there: back on the device only where they fit.
  in = synthetic_inputs();
  in.host_capacity = 4u << 20;
  const EngineConfig grads_on_host = synthetic_config(
      R"(, "stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_grads": "cpu")");
  const std::string roomy = problems(grads_on_host, in);
  EXPECT_NE(roomy.find(none), std::string::npos) << roomy;
  in.device_capacity = plan_memory(grads_on_host, in).device_bytes + 1000;
  const std::string full = problems(grads_on_host, in);
  EXPECT_NE(full.find("host:"), std::string::npos) << full;
  EXPECT_EQ(full.find(none), std::string::npos) << full;
  // NVMe over its free space: more in host memory only where the host has room.
  in = synthetic_inputs();
  in.nvme_capacity = 1'000'000;
  const EngineConfig on_nvme = synthetic_config(
      R"(, "stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/p"},
         "offload_optimizer": {"device": "nvme", "nvme_path": "/o"})");
  const std::string host_free = problems(on_nvme, in);
  EXPECT_NE(host_free.find("keep more in host memory (offload_*.host_fraction; the host has "),
            std::string::npos)
      << host_free;
  in.host_capacity = 2u << 20;
  const std::string host_full = problems(on_nvme, in);
  EXPECT_NE(host_full.find("host:"), std::string::npos) << host_full;
  EXPECT_EQ(host_full.find("keep more in host memory"), std::string::npos) << host_full;
}

// Values the engine uses otherwise than the config wrote them are said in the plan's notes (a
// sub_group_size below a page became a page, a buffer_count of 1 became 3, a live budget below
// the largest unit became that unit — silently), and nothing is said when they are used as written.
TEST(MemoryPlan, ValuesUsedOtherwiseThanWrittenAreSaid) {
  const PlanInputs in = synthetic_inputs();
  auto notes = [&](const std::string& zero) {
    std::string all;
    const EngineConfig c = parse_engine_config(
        R"({"bf16": {"enabled": true}, "zero_optimization": {"stage": 3, "reduce_bucket_size": 1.5e6,
            "offload_optimizer": {"device": "nvme", "nvme_path": "/o")" +
            zero + "}}",
        2);
    for (const std::string& n : plan_memory(c, in).notes) all += n + "\n";
    return all;
  };
  const std::string changed =
      notes(R"(, "buffer_count": 1}, "sub_group_size": 100, "stage3_max_live_parameters": 1)");
  EXPECT_NE(changed.find("zero_optimization.sub_group_size 100 is used as 2048 elements"),
            std::string::npos)
      << changed;
  EXPECT_NE(changed.find("offload_optimizer.buffer_count 1: 3 swap buffers are used"),
            std::string::npos)
      << changed;
  EXPECT_NE(changed.find("stage3_max_live_parameters 1 is below the largest gathered unit (823296 "
                         "elements, padded)"),
            std::string::npos)
      << changed;
  const std::string as_written =
      notes(R"(, "buffer_count": 4}, "sub_group_size": 4096, "stage3_max_live_parameters": 1e6)");
  EXPECT_EQ(as_written.find("sub_group_size"), std::string::npos) << as_written;
  EXPECT_EQ(as_written.find("buffer_count"), std::string::npos) << as_written;
  EXPECT_EQ(as_written.find("stage3_max_live_parameters"), std::string::npos) << as_written;
}

// Stage 1 or 2 with the optimizer state on the host, short of host memory: the fix offered is one
// that stage takes (NVMe optimizer state needs stage 3, and said so when followed).
TEST(MemoryPlan, AHostShortfallBelowStage3OffersWhatThatStageTakes) {
  PlanInputs in = synthetic_inputs();
  in.host_capacity = 2 << 20;
  for (const int stage : {1, 2, 3}) {
    const EngineConfig c = parse_engine_config(
        fmt::format(
            R"({{"zero_optimization": {{"stage": {}, "offload_optimizer": {{"device": "cpu"}}}}}})",
            stage),
        1);
    const MemoryPlan p = plan_memory(c, in);
    ASSERT_FALSE(p.fits) << "stage " << stage;
    ASSERT_EQ(p.problems[0].rfind("host:", 0), 0u) << p.problems[0];
    EXPECT_EQ(p.problems[0].find("offload_optimizer.device \"nvme\"") != std::string::npos,
              stage == 3)
        << p.problems[0];
    EXPECT_EQ(p.problems[0].find("offload_optimizer.ratio below 1") != std::string::npos, stage < 3)
        << p.problems[0];
  }
}

// strata.host_budget_bytes left at 0: 80% of RAM, split among the ranks of the node.
TEST(MemoryPlan, GibFlagsAreBytesUpTo64Bits) {
  EXPECT_EQ(gib_to_bytes("--device-mem-gb", 80), 80ull << 30);
  EXPECT_EQ(gib_to_bytes("--device-mem-gb", 0.5), 512ull << 20);
  EXPECT_EQ(gib_to_bytes("--device-mem-gb", 0), 0u);  // not given
  EXPECT_EQ(gib_to_bytes("--host-mem-gb", 8589934592.0), 1ull << 63);
  for (double bad : {8589934593.0, 1e30, std::numeric_limits<double>::infinity(),
                     std::numeric_limits<double>::quiet_NaN()}) {
    std::string e = "(accepted)";
    try {
      gib_to_bytes("--host-mem-gb", bad);
    } catch (const Error& x) {
      e = x.what();
    }
    EXPECT_NE(e.find(": --host-mem-gb "), std::string::npos) << e;
    EXPECT_NE(e.find("give the memory in GiB, e.g. 80"), std::string::npos) << e;
  }
}

TEST(MemoryPlan, DefaultHostBudgetIsSplitAmongTheNodesRanks) {
  const std::uint64_t ram =
      std::uint64_t(::sysconf(_SC_PHYS_PAGES)) * std::uint64_t(::sysconf(_SC_PAGESIZE));
  const std::uint64_t one = default_host_budget(), two = default_host_budget(2),
                      eight = default_host_budget(8);
  // In whole 2 MiB pieces, as the pinned pool commits memory.
  const double piece = double(2 << 20);
  EXPECT_NEAR(double(one), 0.8 * double(ram), piece);
  EXPECT_NEAR(double(two), double(one) / 2, piece);
  EXPECT_NEAR(double(eight), double(one) / 8, piece);
  for (const std::uint64_t b : {one, two, eight}) EXPECT_EQ(b % (2 << 20), 0u) << b;
  EXPECT_EQ(default_host_budget(0), one) << "a nonsense count is one rank";
}

TEST(MemoryPlan, TableShowsLinesTotalsAndVerdict) {
  PlanInputs in = synthetic_inputs();
  in.device_capacity = 40'000'000;
  const MemoryPlan p =
      plan_memory(synthetic_config(R"(, "stage": 3, "offload_optimizer": {"device": "cpu"})"), in);
  const std::string t = p.table();
  EXPECT_TRUE(p.fits);
  for (const PlanLine& l : p.lines)
    EXPECT_NE(t.find(l.what), std::string::npos) << l.what << "\n" << t;
  EXPECT_NE(t.find(std::to_string(p.device_bytes)), std::string::npos) << t;
  EXPECT_NE(t.find(std::to_string(p.host_bytes)), std::string::npos) << t;
  EXPECT_NE(t.find("40000000 bytes"), std::string::npos) << t;
  EXPECT_NE(t.find("verdict: fits"), std::string::npos) << t;
  // Device lines come before host lines.
  EXPECT_LT(t.find("activations"), t.find("optimizer state")) << t;

  in.device_capacity = 1'000'000;
  const MemoryPlan q = plan_memory(synthetic_config(R"(, "stage": 3)"), in);
  const std::string u = q.table();
  EXPECT_NE(u.find("verdict: does not fit"), std::string::npos) << u;
  EXPECT_NE(u.find("OVER by"), std::string::npos) << u;
  EXPECT_NE(u.find(q.problems.at(0)), std::string::npos) << u;
}

}  // namespace
}  // namespace strata
