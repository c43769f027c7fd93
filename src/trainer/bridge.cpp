// EngineWeights and the model <-> engine plumbing around it (include/strata/trainer.h).
//
// Weights enter the engine once: from scratch through a source the engine asks for this rank's
// slices (fresh_model_source: counter-based, nothing of the model held whole), or as fp32 flat
// unit buffers built on a host-staged ResidentWeights (a Hugging Face folder); they leave it the
// second way for a save. The staging device is a CPU-emulated device sized to the fp32 weights,
// so neither step ever needs room on the training device, whose cap may be far below the model.
#include <algorithm>
#include <cstring>
#include <memory>

#include "strata/error.h"
#include "strata/model_io.h"
#include "strata/trainer.h"

namespace strata {

EngineWeights::EngineWeights(Engine& engine, Stream& compute, const std::vector<UnitSpec>& units)
    : engine_(engine), compute_(compute), num_units_(units.size()) {
  for (std::size_t i = 0; i < units.size(); ++i)
    STRATA_REQUIRE(engine.unit_numel(int(i)) == units[i].numel,
                   "EngineWeights: engine unit {} has {} elements, model unit '{}' {}", i,
                   engine.unit_numel(int(i)), units[i].name, units[i].numel);
}

TensorRef EngineWeights::acquire_weights(std::size_t unit) {
  STRATA_REQUIRE(unit < num_units_, "EngineWeights: unit {} of {}", unit, num_units_);
  return engine_.fetch(int(unit), compute_);
}

void EngineWeights::release_weights(std::size_t unit) { engine_.release(int(unit), compute_); }

TensorRef EngineWeights::acquire_grads(std::size_t unit) {
  STRATA_REQUIRE(unit < num_units_, "EngineWeights: unit {} of {}", unit, num_units_);
  return engine_.grad_buffer(int(unit), compute_);
}

void EngineWeights::release_grads(std::size_t unit) { engine_.reduce_grad(int(unit), compute_); }

void add_model_units(Engine& engine, const std::vector<UnitSpec>& units,
                     const std::vector<std::vector<float>>& flat_init) {
  STRATA_REQUIRE(units.size() == flat_init.size(), "add_model_units: {} units but {} initial buffers",
                 units.size(), flat_init.size());
  for (std::size_t i = 0; i < units.size(); ++i) {
    STRATA_REQUIRE(flat_init[i].size() == units[i].numel, "add_model_units: unit '{}' has {} elements, {} given",
                   units[i].name, units[i].numel, flat_init[i].size());
    // One engine parameter per unit: the model's flat layout, alignment gaps included.
    const int id = engine.add_unit({units[i].name, {{"flat", units[i].numel, flat_init[i].data()}}});
    STRATA_REQUIRE(id == int(i), "add_model_units: the engine already held {} units", id);
  }
}

void add_model_units(Engine& engine, const std::vector<UnitSpec>& units, ModelSource source) {
  STRATA_REQUIRE(bool(source), "add_model_units: no source of initial values");
  for (std::size_t i = 0; i < units.size(); ++i) {
    const int id = engine.add_unit({units[i].name,
                                    {{"flat", units[i].numel, nullptr}},
                                    [source, i](std::size_t first, std::size_t count, float* out) {
                                      source(i, first, count, out);
                                    }});
    STRATA_REQUIRE(id == int(i), "add_model_units: the engine already held {} units", id);
  }
}

ModelSource fresh_model_source(const ModelConfig& cfg, std::uint64_t seed) {
  auto units = std::make_shared<const std::vector<UnitSpec>>(model_units(cfg));
  return [cfg, seed, units](std::size_t unit, std::size_t first, std::size_t count, float* out) {
    const UnitSpec& u = units->at(unit);
    STRATA_REQUIRE(first + count <= u.numel, "model source: elements [{}, {}) of unit '{}', which has {}", first,
                   first + count, u.name, u.numel);
    std::fill_n(out, count, 0.0f);  // the alignment gaps
    for (const ParamSpec& p : u.params) {
      const std::size_t lo = std::max(first, p.offset), hi = std::min(first + count, p.offset + p.numel);
      if (lo < hi) init_hf_values(cfg, p, seed, lo - p.offset, hi - lo, out + (lo - first));
    }
  };
}

namespace {

std::unique_ptr<Device> staging_device(const std::vector<UnitSpec>& units) {
  std::size_t bytes = 0;
  for (const UnitSpec& u : units) bytes += u.numel * 8;  // fp32 weights + fp32 grads
  HostDeviceOptions o;
  o.capacity_bytes = bytes + (std::size_t(64) << 20);
  o.poison = false;
  return make_host_device(o);
}

}  // namespace

std::vector<std::vector<float>> initial_unit_weights(const ModelConfig& cfg, const std::string& hf_dir,
                                                     std::uint64_t seed) {
  const std::vector<UnitSpec> units = model_units(cfg);
  auto dev = staging_device(units);
  auto s = dev->create_stream("staging");
  ResidentWeights w(cfg, DType::kF32, *dev, *s);
  if (hf_dir.empty()) w.init_hf(seed);  // as Hugging Face initialises a model from its config
  else load_hf_weights(hf_dir, w);
  std::vector<std::vector<float>> out;
  for (const UnitSpec& u : units) {
    std::vector<float> flat(u.numel, 0.0f);
    for (const ParamSpec& p : u.params) {
      const std::vector<float> v = w.get(p.name);
      std::copy(v.begin(), v.end(), flat.begin() + std::ptrdiff_t(p.offset));
    }
    out.push_back(std::move(flat));
  }
  return out;
}

void save_engine_weights(Engine& engine, const ModelConfig& cfg, DType dtype, const std::string& dir, int rank,
                         std::size_t max_shard_bytes) {
  const std::vector<UnitSpec> units = model_units(cfg);
  std::vector<std::vector<float>> flat;
  for (std::size_t i = 0; i < units.size(); ++i) flat.push_back(engine.gather_master(int(i)));
  if (rank != 0) return;
  auto dev = staging_device(units);
  auto s = dev->create_stream("staging");
  ResidentWeights w(cfg, dtype, *dev, *s);
  for (std::size_t i = 0; i < units.size(); ++i) {
    STRATA_REQUIRE(flat[i].size() == units[i].numel, "save: unit '{}' gathered {} of {} elements", units[i].name,
                   flat[i].size(), units[i].numel);
    for (const ParamSpec& p : units[i].params)
      w.set(p.name, std::vector<float>(flat[i].begin() + std::ptrdiff_t(p.offset),
                                       flat[i].begin() + std::ptrdiff_t(p.offset + p.numel)));
  }
  save_hf_weights(dir, w, max_shard_bytes);
}

}  // namespace strata
