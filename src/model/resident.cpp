// ResidentWeights: the simplest UnitProvider — every unit's weights and fp32 gradients live
// on the device for the whole run. Used by tests, benches and strata-train until the engine
// drives the model. Host-side accessors synchronize the stream (they are for setup and checks).
#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>

#include <array>
#include <cmath>
#include <cstring>
#include <random>

#include "strata/error.h"
#include "strata/model.h"

namespace strata {

ResidentWeights::ResidentWeights(const Model& model, Stream& stream)
    : ResidentWeights(model.config(), model.options().compute, stream.device(), stream,
                      model.tensor_parallel()) {}

ResidentWeights::ResidentWeights(const ModelConfig& cfg, DType dtype, Device& device,
                                 Stream& stream, TensorParallel tp)
    : cfg_(cfg), dtype_(dtype), stream_(stream), units_(model_units(cfg, tp)) {
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
  STRATA_THROW(kInvalidArgument, "model has no parameter '{}' ({} {} layers)", name,
               cfg_.model_type, cfg_.num_layers);
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
  STRATA_REQUIRE(bytes == p->numel * es, "parameter '{}': {} bytes given, {} expected ({} x {})",
                 name, bytes, p->numel * es, p->numel, dtype_name(dtype_));
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
      const bool norm =
          p.name.find("norm") != std::string::npos || p.name.find(".ln_") != std::string::npos;
      const bool bias = p.name.ends_with(".bias");
      // The whole tensor's draws, then this rank's slice of them (TP): the same values on any
      // tensor-parallel layout.
      std::size_t full = 1;
      for (auto d : p.full_shape) full *= std::size_t(d);
      std::vector<float> v(full);
      for (auto& x : v) x = value(p, norm, bias, nd(rng));
      w.set(p.name, p.split() ? tp_slice(p, v) : v);
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
  for (const UnitSpec& u : units())
    for (const ParamSpec& p : u.params) {
      std::vector<float> v(p.numel);
      init_hf_values(cfg_, p, seed, 0, p.numel, v.data());
      set(p.name, v);
    }
}

namespace {

// Philox-4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11): four
// 32-bit outputs of a 128-bit counter under a 64-bit key.
std::array<std::uint32_t, 4> philox(std::array<std::uint32_t, 4> c,
                                    std::array<std::uint32_t, 2> k) {
  constexpr std::uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u, kW0 = 0x9E3779B9u,
                          kW1 = 0xBB67AE85u;
  for (int round = 0; round < 10; ++round) {
    const std::uint64_t p0 = std::uint64_t(kM0) * c[0], p1 = std::uint64_t(kM1) * c[2];
    c = {std::uint32_t(p1 >> 32) ^ c[1] ^ k[0], std::uint32_t(p1),
         std::uint32_t(p0 >> 32) ^ c[3] ^ k[1], std::uint32_t(p0)};
    k = {k[0] + kW0, k[1] + kW1};
  }
  return c;
}

// FNV-1a: a parameter name's part of the key, the same on every machine (std::hash is not).
std::uint64_t name_hash(const std::string& s) {
  std::uint64_t h = 0xcbf29ce484222325ull;
  for (const unsigned char ch : s) h = (h ^ ch) * 0x100000001b3ull;
  return h;
}

}  // namespace

void init_hf_values(const ModelConfig& cfg, const ParamSpec& p, std::uint64_t seed,
                    std::size_t first, std::size_t count, float* out) {
  STRATA_REQUIRE(first + count <= p.numel,
                 "init_hf_values: elements [{}, {}) of '{}', which has {}", first, first + count,
                 p.name, p.numel);
  const bool norm =
      p.name.find("norm") != std::string::npos || p.name.find(".ln_") != std::string::npos;
  if (p.name.ends_with(".bias") || norm) {
    std::fill_n(out, count, p.name.ends_with(".bias") ? 0.0f : 1.0f);
    return;
  }
  const double range = cfg.initializer_range;
  // GPT-2 scales its residual projections by 1/sqrt(2 n_layer) (GPT2PreTrainedModel._init_weights).
  const double stdev = cfg.arch == ModelArch::kGpt2 && p.name.ends_with("c_proj.weight")
                           ? range / std::sqrt(2.0 * double(cfg.num_layers))
                           : range;
  const std::uint64_t key = seed ^ name_hash(p.name);
  const std::array<std::uint32_t, 2> k = {std::uint32_t(key), std::uint32_t(key >> 32)};
  const auto values = [&](std::size_t from, std::size_t to) {
    for (std::size_t j = from; j < to; ++j) {
      const std::uint64_t i = p.full_index(first + j);  // the same value on any TP layout
      const auto r = philox({std::uint32_t(i), std::uint32_t(i >> 32), 0x5eed, 0}, k);
      // Box-Muller: u1 in (0, 1] (its log is finite), u2 in [0, 1).
      const double u1 = (double(r[0]) + 1.0) * 0x1p-32, u2 = double(r[1]) * 0x1p-32;
      out[j] =
          static_cast<float>(stdev * std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * M_PI * u2));
    }
  };
  // Each value is a function of its index alone: on every core, the same bits (tens of ns an
  // element on one core made a billion-parameter model's start a minute of one core's work).
  constexpr std::size_t kBlock = std::size_t(1) << 16;
  if (count <= kBlock) return values(0, count);
  tbb::parallel_for(tbb::blocked_range<std::size_t>(0, count, kBlock),
                    [&](const tbb::blocked_range<std::size_t>& b) { values(b.begin(), b.end()); });
}

}  // namespace strata
