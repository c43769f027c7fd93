// EngineWeights and the model <-> engine plumbing around it (include/strata/trainer.h).
//
// Weights enter the engine once, through a source the engine asks for this rank's slices, a
// sub-group at a time: from scratch (fresh_model_source: counter-based) or a Hugging Face folder
// (hf_model_source: byte ranges of its safetensors, pages dropped once read). They leave it one
// unit at a time into the safetensors shards (save_engine_weights). No step holds the model
// whole in host memory, nor needs room for it on the training device.
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
  STRATA_REQUIRE(units.size() == flat_init.size(),
                 "add_model_units: {} units but {} initial buffers", units.size(),
                 flat_init.size());
  for (std::size_t i = 0; i < units.size(); ++i) {
    STRATA_REQUIRE(flat_init[i].size() == units[i].numel,
                   "add_model_units: unit '{}' has {} elements, {} given", units[i].name,
                   units[i].numel, flat_init[i].size());
    // One engine parameter per unit: the model's flat layout, alignment gaps included.
    const int id =
        engine.add_unit({units[i].name, {{"flat", units[i].numel, flat_init[i].data()}}});
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

namespace {

// A ModelSource over per-parameter values: value(p, first, count, out) for the part of each
// parameter a slice of the unit's flat layout covers; the alignment gaps zero.
template <class Value>
ModelSource per_parameter(const ModelConfig& cfg, TensorParallel tp, Value value) {
  auto units = std::make_shared<const std::vector<UnitSpec>>(model_units(cfg, tp));
  return [units, value](std::size_t unit, std::size_t first, std::size_t count, float* out) {
    const UnitSpec& u = units->at(unit);
    STRATA_REQUIRE(first + count <= u.numel,
                   "model source: elements [{}, {}) of unit '{}', which has {}", first,
                   first + count, u.name, u.numel);
    std::fill_n(out, count, 0.0f);
    for (const ParamSpec& p : u.params) {
      const std::size_t lo = std::max(first, p.offset),
                        hi = std::min(first + count, p.offset + p.numel);
      if (lo < hi) value(p, lo - p.offset, hi - lo, out + (lo - first));
    }
  };
}

}  // namespace

ModelSource fresh_model_source(const ModelConfig& cfg, std::uint64_t seed, TensorParallel tp) {
  return per_parameter(
      cfg, tp, [cfg, seed](const ParamSpec& p, std::size_t first, std::size_t count, float* out) {
        init_hf_values(cfg, p, seed, first, count, out);
      });
}

ModelSource hf_model_source(const ModelConfig& cfg, const std::string& dir, TensorParallel tp) {
  auto reader = std::make_shared<const HfWeightsReader>(dir, cfg);  // checks the whole folder now
  return per_parameter(
      cfg, tp, [reader](const ParamSpec& p, std::size_t first, std::size_t count, float* out) {
        if (!p.split()) return reader->read(p, first, count, out);
        // A TP slice: the runs of it that are contiguous in the full tensor, each read alone.
        ParamSpec whole = p;
        whole.shape = p.full_shape;
        for (std::size_t i = first; i < first + count;) {
          const std::size_t run = std::min(p.contiguous_from(i), first + count - i);
          reader->read(whole, p.full_index(i), run, out + (i - first));
          i += run;
        }
      });
}

std::vector<Engine::Ranges> tensor_parallel_counted(const std::vector<UnitSpec>& units,
                                                    int tp_rank) {
  std::vector<Engine::Ranges> out;
  for (const UnitSpec& u : units) {
    out.emplace_back();
    if (tp_rank == 0) {
      out.back().push_back({0, u.numel});
      continue;
    }
    for (const ParamSpec& p : u.params)
      if (p.split()) out.back().push_back({p.offset, p.numel});
  }
  return out;
}

std::vector<Engine::Ranges> weight_decay_exempt_ranges(const std::vector<UnitSpec>& units) {
  std::vector<Engine::Ranges> out;
  for (const UnitSpec& u : units) {
    out.emplace_back();
    for (const ParamSpec& p : u.params)
      if (p.shape.size() == 1) out.back().push_back({p.offset, p.numel});
  }
  return out;
}

std::vector<std::vector<float>> initial_unit_weights(const ModelConfig& cfg,
                                                     const std::string& hf_dir,
                                                     std::uint64_t seed) {
  const ModelSource source =
      hf_dir.empty() ? fresh_model_source(cfg, seed) : hf_model_source(cfg, hf_dir);
  std::vector<std::vector<float>> out;
  const std::vector<UnitSpec> units = model_units(cfg);
  for (std::size_t u = 0; u < units.size(); ++u) {
    out.emplace_back(units[u].numel);
    source(u, 0, units[u].numel, out.back().data());
  }
  return out;
}

namespace {

// The TP ranks' slices of unit `u` (`mine`: this rank's, gathered over its DP group) as the whole
// unit, on TP rank 0 (empty elsewhere): gathered through the communicator's device a piece at a
// time, each rank's slice padded to the largest, then tp_unit_whole.
std::vector<float> gather_tp_unit(Communicator& tp, const ModelConfig& cfg, std::size_t u,
                                  const std::vector<float>& mine) {
  const int n = tp.world_size();
  std::size_t most = 0;
  for (int k = 0; k < n; ++k) most = std::max(most, model_units(cfg, {n, k})[u].numel);
  const bool root = tp.rank() == 0;
  std::vector<std::vector<float>> slices(root ? std::size_t(n) : 0, std::vector<float>(most));
  Device& dev = tp.device();
  auto s = dev.create_stream("tp-gather");
  constexpr std::size_t kPiece = std::size_t(16) << 20;  // elements a collective
  const std::size_t piece = std::min(kPiece, most);
  Buffer in = dev.alloc(piece * 4, s.get()),
         all = root ? dev.alloc(n * piece * 4, s.get()) : Buffer{};
  std::vector<float> staging(piece), got(root ? n * piece : 0);
  for (std::size_t first = 0; first < most; first += piece) {
    const std::size_t count = std::min(piece, most - first);
    std::fill(staging.begin(), staging.end(), 0.0f);
    if (first < mine.size())
      std::copy_n(mine.begin() + std::ptrdiff_t(first), std::min(count, mine.size() - first),
                  staging.begin());
    s->copy(in.ref(0, count * 4), host_ref(staging.data(), count * 4));
    // Every rank's `count` values side by side on the root.
    tp.gather(TensorRef{in.ref(0, count * 4), DType::kF32, count},
              root ? TensorRef{all.ref(0, n * count * 4), DType::kF32, n * count} : TensorRef{}, 0,
              *s);
    if (root) s->copy(host_ref(got.data(), n * count * 4), all.ref(0, n * count * 4));
    s->synchronize();
    if (root)
      for (int k = 0; k < n; ++k)
        std::copy_n(got.begin() + std::ptrdiff_t(k * count), count,
                    slices[std::size_t(k)].begin() + std::ptrdiff_t(first));
  }
  if (!root) return {};
  return tp_unit_whole(cfg, u, slices);
}

}  // namespace

std::vector<std::string> save_engine_weights(Engine& engine, const ModelConfig& cfg, DType dtype,
                                             const std::string& dir, int rank, Communicator* tp,
                                             std::size_t max_shard_bytes,
                                             const std::string& side_files_from) {
  const std::vector<UnitSpec> units = model_units(cfg);
  std::unique_ptr<HfWeightsWriter> out;
  if (rank == 0) out = std::make_unique<HfWeightsWriter>(dir, cfg, dtype, max_shard_bytes);
  // Under TP each DP group (a TP slice's) gathers its units on its DP rank 0: job ranks 0..tp-1,
  // the first TP group, whose ranks then gather the slices on job rank 0.
  const bool tp_gathers = tp && tp->world_size() > 1 && rank < tp->world_size();
  for (std::size_t i = 0; i < units.size(); ++i) {
    // Collective: every rank, one unit at a time, gathered on rank 0 alone.
    std::vector<float> flat = engine.gather_master_to(int(i), 0);
    if (tp_gathers) flat = gather_tp_unit(*tp, cfg, i, flat);
    if (!out) continue;
    STRATA_REQUIRE(flat.size() == units[i].numel, "save: unit '{}' gathered {} of {} elements",
                   units[i].name, flat.size(), units[i].numel);
    out->write_unit(i, flat.data());
  }
  return out ? out->finish(side_files_from) : std::vector<std::string>{};
}

}  // namespace strata
