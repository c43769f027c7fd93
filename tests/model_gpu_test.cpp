// The CUDA transformer kernels against the CPU reference: the same tiny models (Llama with
// GQA and q/k/v biases, GPT-2; fp32 and bf16) run forward and backward on the CPU-emulated
// device and on CUDA from the same weights; logits, loss and every gradient must agree to
// fp32 (2e-4 of each tensor's scale) or bf16 (3e-2) tolerance. Skipped where no GPU is usable.
#include <cmath>
#include <random>

#include <gtest/gtest.h>

#include "strata/model.h"

namespace strata {
namespace {

const char* kQwen2 = R"({"model_type": "qwen2", "vocab_size": 97, "hidden_size": 64, "intermediate_size": 96,
  "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64})";
const char* kGpt2 = R"({"model_type": "gpt2", "vocab_size": 113, "n_embd": 48, "n_layer": 2, "n_head": 3,
  "n_positions": 32})";

struct Out {
  std::vector<float> logits;
  float loss;
  std::vector<std::vector<float>> grads;
};

Out run(Device& dev, const char* json, DType dt) {
  auto s = dev.create_stream("model");
  const ModelConfig cfg = parse_model_config(json, "cfg");
  ModelOptions mo;
  mo.micro_batch = 2;
  mo.seq_len = 17;
  mo.compute = dt;
  mo.loss_chunk_rows = 9;
  Model m(cfg, dev, *s, mo);
  ResidentWeights w(m, *s);
  w.init_random(5, 0.3f);
  std::mt19937_64 rng(3);
  Batch b;
  for (int i = 0; i < 34; ++i) {
    b.tokens.push_back(static_cast<std::int32_t>(rng() % cfg.vocab_size));
    b.targets.push_back(static_cast<std::int32_t>(rng() % cfg.vocab_size));
  }
  Out o;
  o.logits = m.logits(b.tokens, w);
  w.zero_grads();
  o.loss = m.forward(b, w);
  m.backward(w);
  for (const auto& u : w.units())
    for (const auto& p : u.params) o.grads.push_back(w.grad(p.name));
  return o;
}

double rel(const std::vector<float>& a, const std::vector<float>& r) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < r.size(); ++i) {
    num = std::max(num, std::fabs(double(a[i]) - r[i]));
    den = std::max(den, std::fabs(double(r[i])));
  }
  return num / std::max(den, 1e-30);
}

class ModelGpu : public ::testing::TestWithParam<std::pair<const char*, DType>> {};

TEST_P(ModelGpu, MatchesCpuReference) {
  const CudaProbe p = probe_cuda();
  if (p.device_count == 0) GTEST_SKIP() << "no usable GPU: " << p.reason;
  const auto [json, dt] = GetParam();
  auto cpu = make_host_device();
  auto gpu = make_cuda_device();
  const Out ref = run(*cpu, json, dt), got = run(*gpu, json, dt);
  const double tol = dt == DType::kBF16 ? 3e-2 : 2e-4;
  EXPECT_LT(rel(got.logits, ref.logits), tol);
  EXPECT_NEAR(got.loss, ref.loss, tol * ref.loss);
  ASSERT_EQ(got.grads.size(), ref.grads.size());
  for (std::size_t i = 0; i < ref.grads.size(); ++i) EXPECT_LT(rel(got.grads[i], ref.grads[i]), 3 * tol) << i;
}

INSTANTIATE_TEST_SUITE_P(Families, ModelGpu,
                         ::testing::Values(std::make_pair(kQwen2, DType::kF32), std::make_pair(kGpt2, DType::kF32),
                                           std::make_pair(kQwen2, DType::kBF16)),
                         [](const auto& i) {
                           return std::string(i.index == 1 ? "gpt2" : "qwen2") +
                                  (i.param.second == DType::kBF16 ? "_bf16" : "_fp32");
                         });

}  // namespace
}  // namespace strata
