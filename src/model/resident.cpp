// ResidentWeights: the simplest UnitProvider — every unit's weights and fp32 gradients live
// on the device for the whole run. Used by tests, benches and strata-train until the engine
// drives the model. Host-side accessors synchronize the stream (they are for setup and checks).
#include <cmath>
#include <cstring>
#include <random>

#include "strata/error.h"
#include "strata/model.h"

namespace strata {

ResidentWeights::ResidentWeights(const Model& model, Stream& stream)
    : ResidentWeights(model.config(), model.options().compute, stream.device(), stream) {}

ResidentWeights::ResidentWeights(const ModelConfig& cfg, DType dtype, Device& device, Stream& stream)
    : cfg_(cfg), dtype_(dtype), stream_(stream), units_(model_units(cfg)) {
  STRATA_REQUIRE(dtype == DType::kF32 || dtype == DType::kBF16,
                 "ResidentWeights: dtype must be fp32 or bf16, got {}", dtype_name(dtype));
  for (const UnitSpec& u : units_) {
    weights_.push_back(device.alloc(u.numel * dtype_size(dtype), &stream));
    grads_.push_back(device.alloc(u.numel * 4, &stream));
    // Alignment padding is never read as a parameter, but keep it finite for norms of the buffer.
    stream.fill(tensor(weights_.back(), dtype), 0.0f);
    stream.fill(tensor(grads_.back(), DType::kF32), 0.0f);
  }
}

TensorRef ResidentWeights::acquire_weights(std::size_t unit) {
  STRATA_REQUIRE(unit < units_.size(), "ResidentWeights: unit {} of {}", unit, units_.size());
  return tensor(weights_[unit], dtype_);
}

TensorRef ResidentWeights::acquire_grads(std::size_t unit) {
  STRATA_REQUIRE(unit < units_.size(), "ResidentWeights: unit {} of {}", unit, units_.size());
  return tensor(grads_[unit], DType::kF32);
}

void ResidentWeights::zero_grads() {
  for (auto& g : grads_) stream_.fill(tensor(g, DType::kF32), 0.0f);
}

std::pair<std::size_t, const ParamSpec*> ResidentWeights::find(const std::string& name) const {
  for (std::size_t u = 0; u < units_.size(); ++u)
    for (const ParamSpec& p : units_[u].params)
      if (p.name == name) return {u, &p};
  STRATA_THROW(kInvalidArgument, "model has no parameter '{}' ({} {} layers)", name, cfg_.model_type,
               cfg_.num_layers);
}

std::vector<std::uint8_t> ResidentWeights::get_bytes(const std::string& name) const {
  const auto [u, p] = find(name);
  const std::size_t es = dtype_size(dtype_);
  std::vector<std::uint8_t> out(p->numel * es);
  stream_.copy(host_ref(out.data(), out.size()), weights_[u].ref(p->offset * es, out.size()));
  stream_.synchronize();
  return out;
}

void ResidentWeights::set_bytes(const std::string& name, const void* data, std::size_t bytes) {
  const auto [u, p] = find(name);
  const std::size_t es = dtype_size(dtype_);
  STRATA_REQUIRE(bytes == p->numel * es, "parameter '{}': {} bytes given, {} expected ({} x {})", name, bytes,
                 p->numel * es, p->numel, dtype_name(dtype_));
  stream_.copy(weights_[u].ref(p->offset * es, bytes), host_ref(data, bytes));
  stream_.synchronize();
}

std::vector<float> ResidentWeights::get(const std::string& name) const {
  const std::vector<std::uint8_t> b = get_bytes(name);
  std::vector<float> out(b.size() / dtype_size(dtype_));
  if (dtype_ == DType::kF32) {
    std::memcpy(out.data(), b.data(), b.size());
  } else {
    for (std::size_t i = 0; i < out.size(); ++i) {
      std::uint16_t h;
      std::memcpy(&h, b.data() + 2 * i, 2);
      out[i] = bf16_to_f32(h);
    }
  }
  return out;
}

void ResidentWeights::set(const std::string& name, const std::vector<float>& values) {
  if (dtype_ == DType::kF32) {
    set_bytes(name, values.data(), values.size() * 4);
    return;
  }
  std::vector<std::uint16_t> h(values.size());
  for (std::size_t i = 0; i < h.size(); ++i) h[i] = f32_to_bf16(values[i]);
  set_bytes(name, h.data(), h.size() * 2);
}

std::vector<float> ResidentWeights::grad(const std::string& name) const {
  const auto [u, p] = find(name);
  std::vector<float> out(p->numel);
  stream_.copy(host_ref(out.data(), out.size() * 4), grads_[u].ref(p->offset * 4, out.size() * 4));
  stream_.synchronize();
  return out;
}

namespace {

// Sets every parameter of `w`, in layout order, element by element to value(p, norm, bias, r)
// with r drawn from N(0, 1) by one generator seeded with `seed`. norm: a norm's weight or bias.
template <class Value>
void fill_params(ResidentWeights& w, std::uint64_t seed, Value value) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (const UnitSpec& u : w.units()) {
    for (const ParamSpec& p : u.params) {
      const bool norm = p.name.find("norm") != std::string::npos || p.name.find(".ln_") != std::string::npos;
      const bool bias = p.name.ends_with(".bias");
      std::vector<float> v(p.numel);
      for (auto& x : v) x = value(p, norm, bias, nd(rng));
      w.set(p.name, v);
    }
  }
}

}  // namespace

void ResidentWeights::init_random(std::uint64_t seed, float std) {
  fill_params(*this, seed, [std](const ParamSpec&, bool norm, bool bias, float r) {
    return norm && !bias ? 1.0f + 0.1f * r : (bias ? 0.1f * r : std * r);
  });
}

void ResidentWeights::init_hf(std::uint64_t seed) {
  const float range = static_cast<float>(cfg_.initializer_range);
  // GPT-2 scales its residual projections by 1/sqrt(2 n_layer) (GPT2PreTrainedModel._init_weights).
  const float residual =
      cfg_.arch == ModelArch::kGpt2 ? range / std::sqrt(2.0f * static_cast<float>(cfg_.num_layers)) : range;
  fill_params(*this, seed, [&](const ParamSpec& p, bool norm, bool bias, float r) {
    if (bias) return 0.0f;
    if (norm) return 1.0f;
    return (p.name.ends_with("c_proj.weight") ? residual : range) * r;
  });
}

}  // namespace strata
