// ds_config.json -> EngineConfig: DeepSpeed's keys and defaults (shared/DS_CONFIG.md), checked
// once, before anything is allocated, so a bad config stops with a message naming the key.
//
// What this file owns: the mapping from DeepSpeed's vocabulary (offload_param.device,
// offload_optimizer.ratio, ...) to strata's Placement fractions, and every validity rule a
// config alone can decide. What it must never do: guess silently. A key strata does not use
// warns once (ds_configs carry many: steps_per_print, wall_clock_breakdown, ...); a value it
// cannot honour throws strata::Error (kInvalidArgument) with the key and the allowed values.
//
// Where strata's reading differs from DeepSpeed's, on purpose:
//   - zero_optimization.stage 0 (DeepSpeed's default when absent) is refused: strata has no
//     plain data-parallel mode.
//   - optimizer "Adam" and "AdamW" both run AdamW (decoupled weight decay). That is also what
//     DeepSpeed does by default (adam_w_mode defaults to true for both). "Adam" with
//     "adam_w_mode": false asks for L2-regularised Adam, which strata refuses; "AdamW" with
//     "adam_w_mode": false is AdamW in DeepSpeed too, so it is accepted.
//   - A string "auto" (Hugging Face Trainer's placeholder, normally filled in before DeepSpeed
//     sees the file) counts as "not given": the default or derived value applies, with a
//     warning. The "aio" block is exempt: "auto" is a real value there.
//   - With neither train_batch_size nor train_micro_batch_size_per_gpu given, the DS_CONFIG.md
//     defaults (micro batch 1, grad accumulation 1) apply where DeepSpeed would refuse.
//
// strata's own keys (DeepSpeed ignores them; strata documents them in docs/configuration.md):
//   zero_optimization.offload_grads       "none" | "cpu" | "nvme": where the fp32 gradient shard
//                                          lives. Default "cpu" when offload_optimizer.device
//                                          is cpu or nvme (the optimizer runs on the host and
//                                          reads its gradients there), else "none". "nvme"
//                                          keeps them under the optimizer's nvme_path (the
//                                          parameters' when only those are on NVMe).
//   zero_optimization.offload_grads_ratio with offload_grads "cpu": the fraction of the gradient
//                                          shard on the host (last units in order), the rest on
//                                          the device. Default 1.
//   zero_optimization.offload_grads_host_fraction  with offload_grads "nvme": the fraction kept
//                                          in pinned host memory (first units), the rest on NVMe.
//                                          Default 0.
//   zero_optimization.offload_param.ratio with device "cpu": the same for the weight shard, as
//                                          offload_optimizer.ratio is for the optimizer state.
//   zero_optimization.offload_param.host_fraction      with device "nvme": the fraction of
//   zero_optimization.offload_optimizer.host_fraction  the piece kept in pinned host memory
//                                          (first units in order), the rest on NVMe. Default 0.
//   strata.host_budget_bytes              pinned host memory the engine may hold (default 0 =
//                                          default_host_budget(): 80% of RAM over the node's
//                                          ranks).
//   strata.overlap_optimizer              true | false: the host optimizer steps each unit
//                                          while backward runs, into a second copy of its
//                                          state (Engine::set_next_lr). Default: on when the
//                                          memory plan fits with the second copies.
//   strata.optimizer_threads              threads of the host CPU AdamW (default 0 = every core).
//   strata.optimizer_isa                  "auto" | "avx512" | "avx2" | "scalar": the host CPU
//                                          AdamW's code path (default "auto": the widest the
//                                          CPU has). Checked against the CPU when the engine is
//                                          made.
//   strata.device_grad_norm               true | false: a host-tier gradient's norm part taken
//                                          on the device (one micro-batch a step). Default: on,
//                                          off on the CPU-emulated device.
//   strata.weight_decay_exempt            "norms_and_biases" | "none": what weight decay skips
//                                          (default "norms_and_biases", as the Hugging Face
//                                          Trainer's AdamW; "none": every parameter decays, as
//                                          DeepSpeed's optimizer over model.parameters()).
// These sit beside the DeepSpeed key they refine (as aio's strata keys do), except engine-wide
// settings, which go in the top-level "strata" object.
#include <algorithm>
#include <cctype>
#include <cmath>
#include <limits>
#include <numbers>
#include <set>

#include "core/json_config.h"
#include "strata/engine_config.h"
#include "strata/error.h"
#include "strata/log.h"

namespace strata {

const char* weight_decay_exempt_name(bool norms_and_biases) {
  return norms_and_biases ? "norms_and_biases" : "none";
}

const char* tier_name(Tier t) {
  switch (t) {
    case Tier::kDevice:
      return "device";
    case Tier::kHost:
      return "host";
    case Tier::kNvme:
      return "nvme";
  }
  return "?";
}

Tier Placement::tier_at(double pos, double total) const {
  // An empty piece has no bytes to place; report the first tier it would use.
  if (!(total > 0))
    return device_fraction > 0 ? Tier::kDevice : host_fraction > 0 ? Tier::kHost : Tier::kNvme;
  const double f = pos / total;
  if (f < device_fraction) return Tier::kDevice;
  if (f < device_fraction + host_fraction) return Tier::kHost;
  return Tier::kNvme;
}

double scheduled_lr(const LrScheduleConfig& s, double optimizer_lr, std::int64_t step) {
  if (s.type.empty()) return optimizer_lr;
  const std::int64_t it = step - 2;  // DeepSpeed's last_batch_iteration during this step
  const double warm = double(std::max<std::int64_t>(2, s.warmup_num_steps));
  const auto warmup = [&] {
    return s.warmup_type == "log" ? std::log(double(it + 1)) / std::log(warm) : double(it) / warm;
  };
  if (s.type == "WarmupCosineLR") {
    if (it < 0) return 0.0;
    if (double(it) < warm)
      return optimizer_lr * (s.warmup_min_ratio + warmup() * (1.0 - s.warmup_min_ratio));
    const double span = double(s.total_num_steps) - warm;
    const double cosine =
        span > 0 ? (1.0 + std::cos(std::numbers::pi * (double(it) - warm + 1.0) / span)) / 2.0
                 : 0.0;
    return optimizer_lr * std::max(0.0, s.cos_min_ratio + (1.0 - s.cos_min_ratio) * cosine);
  }
  const double max_lr = s.warmup_max_lr < 0 ? optimizer_lr : s.warmup_max_lr;
  if (it < 0) return s.warmup_min_lr;
  double gamma = 1.0;
  if (double(it) < warm)
    gamma = warmup();
  else if (s.type == "WarmupDecayLR")
    gamma = std::max(0.0, (double(s.total_num_steps) - double(it)) /
                              std::max(1.0, double(s.total_num_steps) - warm));
  return s.warmup_min_lr + (max_lr - s.warmup_min_lr) * gamma;
}

EngineConfig default_engine_config() {
  EngineConfig c;
  c.stage = 3;
  c.overlap_comm = true;
  return c;
}

namespace {

using config::Json;
using config::Section;

// Removes every "auto" string value (outside "aio"), warning once per key, so the typed
// getters below see "not given"; `dropped` collects their full keys (the scheduler reads two of
// them as Hugging Face fills them in: the learning rate and the run's total steps).
void drop_auto_values(Json& obj, const std::string& path, std::set<std::string>& dropped) {
  if (!obj.is_object()) return;
  for (auto it = obj.begin(); it != obj.end();) {
    const std::string key = path.empty() ? it.key() : path + "." + it.key();
    if (it->is_string() && it->get<std::string>() == "auto") {
      // Three are read as the Trainer fills them in (parse_scheduler); the rest are not given.
      const char* as =
          key == "scheduler.params.warmup_max_lr"
              ? "the learning rate (--lr, else optimizer.params.lr)"
          : key == "scheduler.params.total_num_steps"  ? "the run's steps (strata-train's --steps)"
          : key == "scheduler.params.warmup_num_steps" ? "0 warmup steps, the Trainer's default"
          : key == "gradient_clipping"                 ? "1.0, the Trainer's max_grad_norm default"
          : key == "optimizer.params.lr"
              ? "the Trainer's default learning rate, 5e-5 (--lr sets another)"
          : key == "optimizer.params.weight_decay"
              ? "the Trainer's default, 0 (--weight-decay sets another)"
          : key == "bf16.enabled" || key == "bfloat16.enabled"
              ? "the model's dtype: bf16 when its config.json says torch_dtype bfloat16, else "
                "fp32 (--dtype decides when given)"
          : key == "fp16.enabled" ? "false, the Trainer's default (strata computes in fp32 or bf16)"
                                  : nullptr;
      log::warn_once(
          "config.auto." + key,
          as ? fmt::format(
                   "config key '{}' is \"auto\" (a Hugging Face Trainer placeholder): read as {}",
                   key, as)
             : fmt::format("config key '{}' is \"auto\" (a Hugging Face Trainer placeholder): "
                           "treated as not given, so strata's default or derived value applies",
                           key));
      dropped.insert(key);
      it = obj.erase(it);
      continue;
    }
    if (it->is_object() && !(path.empty() && it.key() == "aio"))
      drop_auto_values(*it, key, dropped);
    ++it;
  }
}

std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char ch) { return std::tolower(ch); });
  return s;
}

double get_fraction(const Section& s, std::string_view key, double def) {
  const double v = s.get_double(key, def);
  STRATA_REQUIRE(v >= 0 && v <= 1, "config key '{}' = {}: must be a fraction from 0 to 1",
                 s.key_path(key), v);
  return v;
}

// A host/device split (`ratio_key`, a fraction) given while `device_key` is not "cpu": warned
// once as ignored, naming the host/NVMe split key (`nvme_key`) when the device is "nvme".
void warn_unused_split(const Section& s, std::string_view ratio_key, std::string_view device_key,
                       const std::string& device, std::string_view what,
                       std::string_view nvme_key) {
  if (!s.has(ratio_key) || device == "cpu") return;
  log::warn_once(
      "config.unused." + s.key_path(ratio_key),
      fmt::format("config key '{}' is ignored: it splits {} between host and device, "
                  "and {} is \"{}\", not \"cpu\"{}",
                  s.key_path(ratio_key), what, s.key_path(device_key), device,
                  device == "nvme" ? fmt::format(" (for host and NVMe: {})", s.key_path(nvme_key))
                                   : std::string()));
}

std::uint64_t get_positive(const Section& s, std::string_view key, std::uint64_t def) {
  return s.get_uint(key, def, 1);
}

int get_int_in(const Section& s, std::string_view key, int def, int lo, int hi) {
  const std::int64_t v = s.get_int(key, def);
  STRATA_REQUIRE(v >= lo && v <= hi, "config key '{}' = {}: must be from {} to {}", s.key_path(key),
                 v, lo, hi);
  return static_cast<int>(v);
}

double get_nonnegative(const Section& s, std::string_view key, double def) {
  const double v = s.get_double(key, def);
  STRATA_REQUIRE(std::isfinite(v) && v >= 0, "config key '{}' = {}: must be a finite number >= 0",
                 s.key_path(key), v);
  return v;
}

// A hyper-parameter the optimizer holds as a float: finite and >= 0 as a float too (1e39 is
// infinite there), and with `positive` a normal float (1e-50 is 0 there, and 1e-40 is 0 where the
// SIMD code flushes subnormals).
float get_float_nonnegative(const Section& s, std::string_view key, float def, bool positive) {
  const double v = get_nonnegative(s, key, def);
  const float f = static_cast<float>(v);
  STRATA_REQUIRE(std::isfinite(f),
                 "config key '{}' = {}: too large for the optimizer's fp32 (at "
                 "most 3.4e38)",
                 s.key_path(key), v);
  STRATA_REQUIRE(!positive || f >= std::numeric_limits<float>::min(),
                 "config key '{}' = {}: must be above 0{} (it keeps the update finite where a "
                 "gradient is 0; DeepSpeed's default is 1e-8)",
                 s.key_path(key), v, v > 0 ? " as an fp32 (at least 1.2e-38)" : "");
  return f;
}

// nvme_path: one directory, or a list that strata stripes across.
std::vector<std::string> get_paths(const Section& s) {
  std::vector<std::string> out;
  const Json* v = s.raw("nvme_path");
  if (!v) return out;
  const std::string key = s.key_path("nvme_path");
  if (v->is_string()) {
    out.push_back(v->get<std::string>());
  } else {
    STRATA_REQUIRE(v->is_array() && !v->empty(),
                   "config key '{}' must be a directory path or a non-empty list of them, got {}",
                   key, v->dump());
    for (const Json& p : *v) {
      STRATA_REQUIRE(p.is_string(),
                     "config key '{}' lists {}: every entry must be a directory path (a string)",
                     key, p.dump());
      out.push_back(p.get<std::string>());
    }
  }
  for (const std::string& p : out) {
    STRATA_REQUIRE(!p.empty(),
                   "config key '{}' holds an empty path: give an existing, writable directory",
                   key);
  }
  return out;
}

// Fills the three batch sizes from whichever were given (train = micro x accum x world).
void resolve_batch(const Section& top, int world_size, EngineConfig& c) {
  const bool has_train = top.has("train_batch_size");
  const bool has_micro = top.has("train_micro_batch_size_per_gpu");
  const bool has_accum = top.has("gradient_accumulation_steps");
  const std::int64_t train =
      has_train ? static_cast<std::int64_t>(get_positive(top, "train_batch_size", 1)) : 0;
  std::int64_t micro =
      has_micro ? static_cast<std::int64_t>(get_positive(top, "train_micro_batch_size_per_gpu", 1))
                : 1;
  std::int64_t accum =
      has_accum ? static_cast<std::int64_t>(get_positive(top, "gradient_accumulation_steps", 1))
                : 1;
  const std::int64_t w = world_size;
  const auto rule = [&] {
    return fmt::format(
        "train_batch_size ({}) must equal train_micro_batch_size_per_gpu ({}) x "
        "gradient_accumulation_steps ({}) x data-parallel ranks ({})",
        has_train ? std::to_string(train) : "not given",
        has_micro ? std::to_string(micro) : "not given",
        has_accum ? std::to_string(accum) : "not given", w);
  };
  if (has_train && !(has_micro && has_accum)) {
    // Derive the missing one(s); with only train_batch_size, accumulation stays 1 (DeepSpeed).
    const std::int64_t known = has_micro ? micro * w : has_accum ? accum * w : w;
    STRATA_REQUIRE(
        train % known == 0,
        "config keys 'train_batch_size', 'train_micro_batch_size_per_gpu' and "
        "'gradient_accumulation_steps' do not divide: {}; change one so it divides exactly",
        rule());
    if (has_micro) {
      accum = train / known;
    } else {
      micro = train / known;
    }
  }
  STRATA_REQUIRE(!has_train || train == micro * accum * w,
                 "config keys 'train_batch_size', 'train_micro_batch_size_per_gpu' and "
                 "'gradient_accumulation_steps' "
                 "disagree: {} = {}; fix one, or give only two of them",
                 rule(), micro * accum * w);
  c.train_batch_size = micro * accum * w;
  c.micro_batch_per_gpu = micro;
  c.gradient_accumulation_steps = accum;
}

void parse_precision(const Section& top, EngineConfig& c) {
  // DeepSpeed still reads the old spelling "bfloat16"; one of the two, not both.
  STRATA_REQUIRE(!(top.has("bf16") && top.has("bfloat16")),
                 "config keys 'bf16' and 'bfloat16' are the same setting: give one ('bf16')");
  const Section bf = top.child(top.has("bfloat16") ? "bfloat16" : "bf16");
  bf.warn_unknown({"enabled"});
  const bool bf16 = bf.get_bool("enabled", false);

  const Section fp = top.child("fp16");
  fp.warn_unknown({"enabled", "loss_scale", "initial_scale_power", "loss_scale_window",
                   "hysteresis", "min_loss_scale"});
  LossScaleConfig& ls = c.fp16;
  ls.enabled = fp.get_bool("enabled", false);
  ls.loss_scale = fp.get_double("loss_scale", ls.loss_scale);
  STRATA_REQUIRE(std::isfinite(ls.loss_scale) && ls.loss_scale >= 0,
                 "config key '{}' = {}: must be 0 (dynamic loss scaling) or a fixed scale > 0",
                 fp.key_path("loss_scale"), ls.loss_scale);
  ls.initial_scale_power = get_int_in(fp, "initial_scale_power", ls.initial_scale_power, 0, 64);
  ls.loss_scale_window = get_int_in(fp, "loss_scale_window", ls.loss_scale_window, 1, 1 << 30);
  ls.hysteresis = get_int_in(fp, "hysteresis", ls.hysteresis, 1, 1 << 30);
  ls.min_loss_scale = fp.get_double("min_loss_scale", ls.min_loss_scale);
  STRATA_REQUIRE(std::isfinite(ls.min_loss_scale) && ls.min_loss_scale > 0,
                 "config key '{}' = {}: must be a number > 0", fp.key_path("min_loss_scale"),
                 ls.min_loss_scale);

  STRATA_REQUIRE(
      !(bf16 && ls.enabled),
      "config keys 'bf16.enabled' and 'fp16.enabled' are both true: choose one compute precision "
      "(set the other's \"enabled\" false)");
  c.compute_dtype = bf16 ? DType::kBF16 : ls.enabled ? DType::kF16 : DType::kF32;
}

void parse_optimizer(const Section& top, EngineConfig& c) {
  const Section opt = top.child("optimizer");
  opt.warn_unknown({"type", "params"});
  if (opt.has("type")) {
    const std::string type = opt.get_string("type", "");
    const std::string t = lower(type);
    STRATA_REQUIRE(
        t == "adam" || t == "adamw",
        "config key '{}' is \"{}\": strata supports \"Adam\" and \"AdamW\" (both run AdamW)",
        opt.key_path("type"), type);
    c.optimizer_type = t == "adam" ? "Adam" : "AdamW";
  }
  const Section p = opt.child("params");
  p.warn_unknown({"lr", "betas", "eps", "weight_decay", "bias_correction", "adam_w_mode",
                  "torch_adam", "amsgrad"});
  AdamWOptions& a = c.adamw;
  a.lr = get_float_nonnegative(p, "lr", a.lr, false);
  if (const Json* b = p.raw("betas")) {
    STRATA_REQUIRE(
        b->is_array() && b->size() == 2 && (*b)[0].is_number() && (*b)[1].is_number(),
        "config key '{}' must be a list of two numbers [beta1, beta2], each in [0, 1), got {}",
        p.key_path("betas"), b->dump());
    const double b1 = (*b)[0].get<double>(), b2 = (*b)[1].get<double>();
    STRATA_REQUIRE(b1 >= 0 && b1 < 1 && b2 >= 0 && b2 < 1,
                   "config key '{}' = [{}, {}]: each beta must be in [0, 1)", p.key_path("betas"),
                   b1, b2);
    // The optimizer holds them as fp32: 0.99999999 rounds to 1 there.
    STRATA_REQUIRE(static_cast<float>(b1) < 1 && static_cast<float>(b2) < 1,
                   "config key '{}' = [{}, {}]: a beta rounds to 1 in the optimizer's fp32: give "
                   "at most 0.9999999",
                   p.key_path("betas"), b1, b2);
    a.beta1 = static_cast<float>(b1);
    a.beta2 = static_cast<float>(b2);
  }
  a.eps = get_float_nonnegative(p, "eps", a.eps, true);
  a.weight_decay = get_float_nonnegative(p, "weight_decay", a.weight_decay, false);
  a.bias_correction = p.get_bool("bias_correction", a.bias_correction);
  // DeepSpeed: AdamW whenever the type is AdamW or adam_w_mode is true (its default).
  STRATA_REQUIRE(
      !(c.optimizer_type == "Adam" && !p.get_bool("adam_w_mode", true)),
      "config key '{}' = false asks for Adam with L2 regularisation, which strata does not "
      "implement: "
      "remove it (strata runs AdamW, decoupled weight decay, as DeepSpeed does by default)",
      p.key_path("adam_w_mode"));
  p.get_bool("torch_adam", false);  // which implementation DeepSpeed picks; strata has one
  STRATA_REQUIRE(!p.get_bool("amsgrad", false),
                 "config key '{}' = true: AMSGrad is not supported; remove it",
                 p.key_path("amsgrad"));
}

void parse_scheduler(const Section& top, EngineConfig& c, const std::set<std::string>& auto_keys) {
  const Section s = top.child("scheduler");
  if (!top.has("scheduler")) return;
  s.warn_unknown({"type", "params"});
  STRATA_REQUIRE(s.has("type"),
                 "config key '{}' is required in a scheduler block: use one of \"WarmupLR\", "
                 "\"WarmupDecayLR\", \"WarmupCosineLR\"",
                 s.key_path("type"));
  LrScheduleConfig& l = c.scheduler;
  l.type = s.get_choice("type", "", {"WarmupLR", "WarmupDecayLR", "WarmupCosineLR"});
  const Section p = s.child("params");
  const bool cosine = l.type == "WarmupCosineLR";
  if (cosine) {
    p.warn_unknown({"total_num_steps", "warmup_num_steps", "warmup_min_ratio", "cos_min_ratio",
                    "warmup_type"});
  } else if (l.type == "WarmupDecayLR") {
    p.warn_unknown(
        {"warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type", "total_num_steps"});
  } else {
    p.warn_unknown({"warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type"});
  }
  // "auto": the Trainer's warmup steps, 0 unless it is told otherwise (strata's default, 1000,
  // would be no one's choice here).
  if (auto_keys.count("scheduler.params.warmup_num_steps"))
    l.warmup_num_steps = 0;
  else
    l.warmup_num_steps = p.get_int("warmup_num_steps", l.warmup_num_steps);
  STRATA_REQUIRE(l.warmup_num_steps >= 0, "config key '{}' = {}: must be >= 0",
                 p.key_path("warmup_num_steps"), l.warmup_num_steps);
  l.warmup_type = p.get_choice("warmup_type", l.warmup_type, {"log", "linear"});
  if (cosine) {
    l.warmup_min_ratio = get_fraction(p, "warmup_min_ratio", l.warmup_min_ratio);
    l.cos_min_ratio = get_fraction(p, "cos_min_ratio", l.cos_min_ratio);
  } else {
    l.warmup_min_lr = get_nonnegative(p, "warmup_min_lr", l.warmup_min_lr);
    // Without a maximum, DeepSpeed's default 0.001 for either type: DeepSpeed makes the schedule
    // from the block's own params alone. "auto": the learning rate, as Hugging Face fills it.
    l.warmup_max_lr_given = auto_keys.count("scheduler.params.warmup_max_lr") > 0;
    if (l.warmup_max_lr_given)
      l.warmup_max_lr = -1;
    else
      l.warmup_max_lr = get_nonnegative(p, "warmup_max_lr", l.warmup_max_lr);
    l.warmup_max_lr_given = l.warmup_max_lr_given || p.has("warmup_max_lr");
    // (DeepSpeed checks nothing: a minimum above its default maximum warms down to it.)
    STRATA_REQUIRE(
        !l.warmup_max_lr_given || l.warmup_max_lr < 0 || l.warmup_max_lr >= l.warmup_min_lr,
        "config keys '{}' ({}) and '{}' ({}): the maximum is below the minimum",
        p.key_path("warmup_max_lr"), l.warmup_max_lr, p.key_path("warmup_min_lr"), l.warmup_min_lr);
  }
  if (l.type != "WarmupLR" && auto_keys.count("scheduler.params.total_num_steps")) {
    l.total_num_steps =
        0;  // "auto": the run's steps, as Hugging Face fills it (strata-train: --steps)
  } else if (l.type != "WarmupLR") {
    STRATA_REQUIRE(p.has("total_num_steps"),
                   "config key '{}' is required for scheduler type \"{}\": the run's total "
                   "optimizer steps (\"auto\": "
                   "strata-train's --steps)",
                   p.key_path("total_num_steps"), l.type);
    l.total_num_steps = p.get_int("total_num_steps", 0);
    STRATA_REQUIRE(l.total_num_steps >= 1 && l.total_num_steps >= l.warmup_num_steps,
                   "config key '{}' = {}: must be >= 1 and >= warmup_num_steps ({})",
                   p.key_path("total_num_steps"), l.total_num_steps, l.warmup_num_steps);
  }
}

// zero_optimization.stage, and DeepSpeed's legacy spellings that move state somewhere.
void parse_zero_stage(const Section& z, EngineConfig& c) {
  STRATA_REQUIRE(!z.has("stage") || z.raw("stage")->is_number(),
                 "config key '{}' = {}: use 1, 2 or 3 (a number)", z.key_path("stage"),
                 z.raw("stage") ? z.raw("stage")->dump() : "");
  const std::int64_t stage = z.get_int("stage", 0);
  STRATA_REQUIRE(
      stage != 0,
      "config key '{}' is 0{}: stage 0 means plain data parallel, which strata does not implement; "
      "use 1, 2 or 3",
      z.key_path("stage"), z.has("stage") ? "" : " (DeepSpeed's default when it is not given)");
  STRATA_REQUIRE(stage >= 1 && stage <= 3, "config key '{}' = {}: use 1, 2 or 3",
                 z.key_path("stage"), stage);
  c.stage = static_cast<int>(stage);
  // DeepSpeed's legacy spellings move state somewhere: refuse rather than ignore them.
  STRATA_REQUIRE(!z.get_bool("cpu_offload", false),
                 "config key '{}' is DeepSpeed's deprecated spelling: use \"offload_optimizer\": "
                 "{{\"device\": \"cpu\"}}",
                 z.key_path("cpu_offload"));
  STRATA_REQUIRE(!z.get_bool("cpu_offload_params", false),
                 "config key '{}' is DeepSpeed's deprecated spelling: use \"offload_param\": "
                 "{{\"device\": \"cpu\"}}",
                 z.key_path("cpu_offload_params"));
}

// The buckets, the sub-groups and the stage-3 gathering (prefetch, live budget, persistence).
void parse_zero_sizes(const Section& z, EngineConfig& c) {
  c.overlap_comm = z.get_bool("overlap_comm", c.stage == 3);
  c.contiguous_gradients = z.get_bool("contiguous_gradients", true);
  c.reduce_bucket_size = get_positive(z, "reduce_bucket_size", 500'000'000);
  c.reduce_bucket_size_given = z.has("reduce_bucket_size");
  c.sub_group_size_given = z.has("sub_group_size");
  c.allgather_bucket_size = get_positive(z, "allgather_bucket_size", 500'000'000);
  c.sub_group_size = z.get_uint("sub_group_size", 1'000'000'000);
  c.sub_group_per_tensor = c.sub_group_size == 0;
  // DeepSpeed reads these under either name (the "stage3_" one is the alias).
  const auto stage3 = [&](const char* name, std::uint64_t def) {
    const std::string alias = std::string("stage3_") + name;
    STRATA_REQUIRE(!(z.has(name) && z.has(alias)) || z.get_uint(name, 0) == z.get_uint(alias, 0),
                   "config keys '{}' and '{}' are the same setting with different values: give one",
                   z.key_path(alias), z.key_path(name));
    return z.has(name) ? z.get_uint(name, def) : z.get_uint(alias, def);
  };
  c.prefetch_bucket_size = stage3("prefetch_bucket_size", 50'000'000);
  c.max_live_parameters = stage3("max_live_parameters", 1'000'000'000);
  c.max_reuse_distance = stage3("max_reuse_distance", 1'000'000'000);
  c.param_persistence_threshold = stage3("param_persistence_threshold", 100'000);
  // DeepSpeed's field and its two aliases (the stage3_ one, and the older fp16 name): one of them.
  const char* gather = nullptr;
  for (const char* name :
       {"gather_16bit_weights_on_model_save", "stage3_gather_16bit_weights_on_model_save",
        "stage3_gather_fp16_weights_on_model_save"}) {
    if (!z.has(name)) continue;
    STRATA_REQUIRE(gather == nullptr, "config keys '{}' and '{}' are the same setting: give one",
                   z.key_path(gather ? gather : ""), z.key_path(name));
    gather = name;
  }
  if (gather == nullptr) gather = "stage3_gather_16bit_weights_on_model_save";
  c.gather_16bit_weights_on_model_save = z.get_bool(gather, false);
  // DeepSpeed saves a ZeRO-3 model's shards unless this is true; strata always gathers it.
  if (z.has(gather) && !c.gather_16bit_weights_on_model_save)
    log::warn_once(std::string("config.") + gather,
                   fmt::format("config key '{}' is false: strata writes the whole model, "
                               "gathered, at strata-train --out either way (in the compute "
                               "dtype; strata-export writes any checkpoint in fp32 or bf16)",
                               z.key_path(gather)));
}

// offload_param: the compute-weight shard. Returns its device.
std::string parse_offload_param(const Section& z, EngineConfig& c) {
  const Section op = z.child("offload_param");
  op.warn_unknown({"device", "nvme_path", "buffer_count", "buffer_size", "max_in_cpu", "pin_memory",
                   "host_fraction", "ratio"});
  const std::string pdev = op.get_choice("device", "none", {"none", "cpu", "nvme"});
  STRATA_REQUIRE(
      pdev == "none" || c.stage == 3,
      "config key '{}' is \"{}\" with zero_optimization.stage {}: parameter offload needs stage 3 "
      "(set stage 3, or offload_param.device \"none\")",
      op.key_path("device"), pdev, c.stage);
  c.param_nvme_paths = get_paths(op);
  STRATA_REQUIRE(pdev != "nvme" || !c.param_nvme_paths.empty(),
                 "config key '{}' is required when {} is \"nvme\"", op.key_path("nvme_path"),
                 op.key_path("device"));
  if (pdev != "nvme" && !c.param_nvme_paths.empty()) {
    log::warn_once("config.unused." + op.key_path("nvme_path"),
                   fmt::format("config key '{}' is ignored: {} is \"{}\"", op.key_path("nvme_path"),
                               op.key_path("device"), pdev));
  }
  c.param_buffer_count = get_int_in(op, "buffer_count", c.param_buffer_count, 1, 1024);
  c.param_buffer_size = get_positive(op, "buffer_size", c.param_buffer_size);
  c.param_max_in_cpu = op.get_uint("max_in_cpu", c.param_max_in_cpu);
  if (op.has("max_in_cpu"))
    log::warn_once(
        "config.unused." + op.key_path("max_in_cpu"),
        fmt::format(
            "config key '{}' has no effect in strata; to keep a share of the weights in host "
            "memory next to NVMe, set '{}' (a fraction of the offloaded weights)",
            op.key_path("max_in_cpu"), op.key_path("host_fraction")));
  const double p_host = get_fraction(op, "host_fraction", 0.0);
  STRATA_REQUIRE(!op.has("host_fraction") || pdev == "nvme",
                 "config key '{}' splits parameters between host and NVMe: it needs {} \"nvme\" "
                 "(it is \"{}\")",
                 op.key_path("host_fraction"), op.key_path("device"), pdev);
  const double p_ratio = get_fraction(op, "ratio", 1.0);
  warn_unused_split(op, "ratio", "device", pdev, "the weights", "host_fraction");
  c.params = pdev == "none"  ? Placement{1.0, 0.0}
             : pdev == "cpu" ? Placement{1.0 - p_ratio, p_ratio}
                             : Placement{0.0, p_host};
  return pdev;
}

// offload_optimizer: fp32 master, m, v. Returns its device.
std::string parse_offload_optimizer(const Section& z, EngineConfig& c) {
  const Section oo = z.child("offload_optimizer");
  oo.warn_unknown({"device", "nvme_path", "buffer_count", "pin_memory", "pipeline_read",
                   "pipeline_write", "ratio", "host_fraction"});
  const std::string odev = oo.get_choice("device", "none", {"none", "cpu", "nvme"});
  STRATA_REQUIRE(odev != "nvme" || c.stage == 3,
                 "config key '{}' is \"nvme\" with zero_optimization.stage {}: NVMe optimizer "
                 "offload needs stage 3 "
                 "(set stage 3, or offload_optimizer.device \"cpu\")",
                 oo.key_path("device"), c.stage);
  c.optimizer_nvme_paths = get_paths(oo);
  STRATA_REQUIRE(odev != "nvme" || !c.optimizer_nvme_paths.empty(),
                 "config key '{}' is required when {} is \"nvme\"", oo.key_path("nvme_path"),
                 oo.key_path("device"));
  if (odev != "nvme" && !c.optimizer_nvme_paths.empty()) {
    log::warn_once("config.unused." + oo.key_path("nvme_path"),
                   fmt::format("config key '{}' is ignored: {} is \"{}\"", oo.key_path("nvme_path"),
                               oo.key_path("device"), odev));
  }
  c.optimizer_buffer_count = get_int_in(oo, "buffer_count", c.optimizer_buffer_count, 1, 1024);
  c.pipeline_read = oo.get_bool("pipeline_read", false);
  c.pipeline_write = oo.get_bool("pipeline_write", false);
  const double ratio = get_fraction(oo, "ratio", 1.0);
  if (oo.has("ratio") && odev != "cpu") {
    log::warn_once(
        "config.unused." + oo.key_path("ratio"),
        fmt::format(
            "config key '{}' is ignored: it splits optimizer work between CPU and device, and "
            "{} is \"{}\", not \"cpu\"",
            oo.key_path("ratio"), oo.key_path("device"), odev));
  }
  const double o_host = get_fraction(oo, "host_fraction", 0.0);
  STRATA_REQUIRE(!oo.has("host_fraction") || odev == "nvme",
                 "config key '{}' splits optimizer state between host and NVMe: it needs {} "
                 "\"nvme\" (it is \"{}\"; "
                 "for cpu use offload_optimizer.ratio)",
                 oo.key_path("host_fraction"), oo.key_path("device"), odev);
  c.optimizer = odev == "none"  ? Placement{1.0, 0.0}
                : odev == "cpu" ? Placement{1.0 - ratio, ratio}
                                : Placement{0.0, o_host};
  return odev;
}

// offload_grads (strata): the fp32 gradient shard, beside the optimizer state or the weights on
// NVMe.
void parse_offload_grads(const Section& z, EngineConfig& c, const std::string& odev,
                         const std::string& pdev) {
  const std::string gdev =
      z.get_choice("offload_grads", odev == "none" ? "none" : "cpu", {"none", "cpu", "nvme"});
  const double g_ratio = get_fraction(z, "offload_grads_ratio", 1.0);
  warn_unused_split(z, "offload_grads_ratio", "offload_grads", gdev, "the gradients",
                    "offload_grads_host_fraction");
  const double g_host = get_fraction(z, "offload_grads_host_fraction", 0.0);
  STRATA_REQUIRE(!z.has("offload_grads_host_fraction") || gdev == "nvme",
                 "config key '{}' splits the gradients between host and NVMe: it needs {} \"nvme\" "
                 "(it is \"{}\"; "
                 "for host and device use {})",
                 z.key_path("offload_grads_host_fraction"), z.key_path("offload_grads"), gdev,
                 z.key_path("offload_grads_ratio"));
  if (gdev == "nvme") {
    // The gradients swap beside the optimizer state (they are read with it), else beside the
    // weights: no directory of their own.
    STRATA_REQUIRE(
        c.stage == 3,
        "config key '{}' is \"nvme\" with zero_optimization.stage {}: NVMe offload needs stage 3 "
        "(set "
        "stage 3 and put the optimizer state or the parameters on NVMe, or set {} \"cpu\")",
        z.key_path("offload_grads"), c.stage, z.key_path("offload_grads"));
    STRATA_REQUIRE(odev == "nvme" || pdev == "nvme",
                   "config key '{}' is \"nvme\", but neither offload_optimizer.device nor "
                   "offload_param.device is "
                   "\"nvme\": gradient shards go under the optimizer's nvme_path (or the "
                   "parameters'); put one of "
                   "them on NVMe, or set {} \"cpu\"",
                   z.key_path("offload_grads"), z.key_path("offload_grads"));
    c.grad_nvme_paths = odev == "nvme" ? c.optimizer_nvme_paths : c.param_nvme_paths;
  }
  c.grads = gdev == "none"  ? Placement{1.0, 0.0}
            : gdev == "cpu" ? Placement{1.0 - g_ratio, g_ratio}
                            : Placement{0.0, g_host};
}

void parse_zero(const Section& top, EngineConfig& c) {
  const Section z = top.child("zero_optimization");
  z.warn_unknown({"stage",
                  "overlap_comm",
                  "contiguous_gradients",
                  "reduce_bucket_size",
                  "allgather_bucket_size",
                  "sub_group_size",
                  "stage3_prefetch_bucket_size",
                  "stage3_max_live_parameters",
                  "stage3_max_reuse_distance",
                  "stage3_param_persistence_threshold",
                  "prefetch_bucket_size",
                  "max_live_parameters",
                  "max_reuse_distance",
                  "param_persistence_threshold",
                  "stage3_gather_16bit_weights_on_model_save",
                  "gather_16bit_weights_on_model_save",
                  "stage3_gather_fp16_weights_on_model_save",
                  "offload_param",
                  "offload_optimizer",
                  "offload_grads",
                  "offload_grads_ratio",
                  "offload_grads_host_fraction",
                  "cpu_offload",
                  "cpu_offload_params"});
  parse_zero_stage(z, c);
  parse_zero_sizes(z, c);
  const std::string pdev = parse_offload_param(z, c);
  const std::string odev = parse_offload_optimizer(z, c);
  // One pin_memory for the engine: host state is pinned unless either block says otherwise.
  c.pin_memory = z.child("offload_param").get_bool("pin_memory", true) &&
                 z.child("offload_optimizer").get_bool("pin_memory", true);
  parse_offload_grads(z, c, odev, pdev);

  for (const Placement* pl : {&c.params, &c.grads, &c.optimizer}) {
    STRATA_CHECK(pl->device_fraction >= 0 && pl->host_fraction >= 0 &&
                     pl->device_fraction + pl->host_fraction <= 1.0 + 1e-12,
                 "placement fractions device {} host {} do not sum to at most 1",
                 pl->device_fraction, pl->host_fraction);
  }
}

}  // namespace

std::string resolve_auto_dtype(EngineConfig& c, const std::string& model_torch_dtype) {
  if (!c.bf16_auto) return {};
  c.bf16_auto = false;
  if (c.fp16.enabled) return {};  // fp16.enabled true beside it: refused as fp16 is
  c.compute_dtype = model_torch_dtype == "bfloat16" ? DType::kBF16 : DType::kF32;
  return fmt::format(
      "config key 'bf16.enabled' \"auto\": {}, as the model's config.json says "
      "torch_dtype {}",
      c.compute_dtype == DType::kBF16 ? "bf16" : "fp32",
      model_torch_dtype.empty() ? std::string("nothing (fp32)") : "\"" + model_torch_dtype + "\"");
}

std::string resolve_per_tensor_sub_groups(EngineConfig& c, std::uint64_t largest_tensor,
                                          int world_size) {
  if (!c.sub_group_per_tensor) return {};
  c.sub_group_per_tensor = false;
  const std::uint64_t w = std::uint64_t(std::max(1, world_size));
  c.sub_group_size = std::max<std::uint64_t>(1, (largest_tensor + w - 1) / w);
  return fmt::format(
      "config key 'zero_optimization.sub_group_size' 0 (DeepSpeed: each parameter tensor's "
      "partition a sub-group of its own): sub-groups of {} elements, the largest tensor's "
      "partition over {} rank(s)",
      c.sub_group_size, w);
}

int config_tensor_parallel(std::string_view json_text, const std::string& what) {
  const Json doc = config::parse(json_text, what);
  if (!doc.is_object() || !doc.contains("tensor_parallel")) return 0;
  const Section tp = Section(&doc, "").child("tensor_parallel");
  // "auto" is not given, as every "auto" outside aio (parse_engine_config warns of it).
  if (const Json* v = tp.raw("autotp_size"); v && v->is_string() && v->get<std::string>() == "auto")
    return 0;
  return tp.has("autotp_size") ? get_int_in(tp, "autotp_size", 1, 1, 1 << 20) : 0;
}

EngineConfig parse_engine_config(std::string_view json_text, int world_size) {
  STRATA_REQUIRE(world_size >= 1, "world_size = {}: must be at least 1", world_size);
  Json doc = config::parse(json_text, "ds_config");
  STRATA_REQUIRE(doc.is_object(), "the ds_config must be a JSON object {{...}}, got {}",
                 doc.type_name());
  std::set<std::string> auto_keys;
  drop_auto_values(doc, "", auto_keys);
  const Section top(&doc, "");
  top.warn_unknown({"train_batch_size", "train_micro_batch_size_per_gpu",
                    "gradient_accumulation_steps", "gradient_clipping", "bf16", "bfloat16", "fp16",
                    "optimizer", "scheduler", "zero_optimization", "aio", "strata",
                    "tensor_parallel"});
  top.child("tensor_parallel").warn_unknown({"autotp_size"});

  EngineConfig c = default_engine_config();
  resolve_batch(top, world_size, c);
  c.train_batch_size_given = top.has("train_batch_size");
  c.gradient_clipping_given = top.has("gradient_clipping");
  c.gradient_clipping = top.get_double("gradient_clipping", 0.0);
  STRATA_REQUIRE(
      std::isfinite(c.gradient_clipping) && c.gradient_clipping >= 0,
      "config key 'gradient_clipping' = {}: must be 0 (off) or a maximum global norm > 0",
      c.gradient_clipping);
  parse_precision(top, c);
  parse_optimizer(top, c);
  parse_scheduler(top, c, auto_keys);
  parse_zero(top, c);
  // "auto" as the Hugging Face Trainer fills it in (its TrainingArguments' defaults).
  if (auto_keys.count("gradient_clipping")) c.gradient_clipping = 1.0;
  if (auto_keys.count("optimizer.params.lr")) c.adamw.lr = 5e-5;
  if (auto_keys.count("optimizer.params.weight_decay")) c.adamw.weight_decay = 0;
  c.bf16_auto = auto_keys.count("bf16.enabled") || auto_keys.count("bfloat16.enabled");

  // The aio block, inside an object of its own: never mistaken for anything else.
  c.aio = parse_aio_config(doc.contains("aio") ? R"({"aio": )" + doc["aio"].dump() + "}"
                                               : std::string("{}"));

  const Section st = top.child("strata");
  st.warn_unknown({"host_budget_bytes", "overlap_optimizer", "optimizer_threads", "optimizer_isa",
                   "device_grad_norm", "weight_decay_exempt"});
  c.host_budget_bytes = st.get_uint("host_budget_bytes", 0);
  STRATA_REQUIRE(
      c.host_budget_bytes == 0 || c.host_budget_bytes >= (std::uint64_t(2) << 20),
      "config key 'strata.host_budget_bytes' = {}: use 0 (80% of RAM) or at least 2 MiB (2097152): "
      "pinned memory is committed in 2 MiB steps",
      c.host_budget_bytes);
  if (st.has("overlap_optimizer")) c.overlap_optimizer = st.get_bool("overlap_optimizer", true);
  if (st.has("device_grad_norm")) c.device_grad_norm = st.get_bool("device_grad_norm", true);
  const std::uint64_t threads = st.get_uint("optimizer_threads", 0);
  STRATA_REQUIRE(threads <= 4096,
                 "config key 'strata.optimizer_threads' = {}: use 0 (every core) or a thread count",
                 threads);
  c.optimizer_threads = int(threads);
  c.optimizer_isa =
      parse_isa(st.get_choice("optimizer_isa", "auto", {"auto", "avx512", "avx2", "scalar"}));
  c.decay_exempt_norms_and_biases =
      st.get_choice("weight_decay_exempt", weight_decay_exempt_name(true),
                    {weight_decay_exempt_name(true), weight_decay_exempt_name(false)}) ==
      weight_decay_exempt_name(true);
  return c;
}

}  // namespace strata
