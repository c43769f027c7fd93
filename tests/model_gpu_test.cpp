// The CUDA transformer kernels against the CPU reference: the same tiny models (Llama with
// GQA and q/k/v biases, GPT-2; fp32 and bf16) run forward and backward on the CPU-emulated
// device and on CUDA from the same weights; logits, loss, every gradient and the logits of
// decoding with the key/value cache (Model::decode) must agree to
// fp32 (2e-4 of each tensor's scale) or bf16 (3e-2) tolerance, with the simple kernels and
// again with the tiled ones (KernelVariant::kTiled). Then the two variants against each other,
// op by op, on odd shapes (partial tiles, columns not a multiple of 32): attention within the
// bf16 tolerance where the tiled kernels apply and bit-equal where they fall back (fp32, a head
// dim they do not take); the column reductions within fp32 summation-order tolerance; the
// embedding's backward bit-equal; and every tiled result bit for bit the same on a second run.
// Skipped where no GPU is usable.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <random>

#include "gpu/model_kernels.h"
#include "model/ops.h"
#include "strata/model.h"

namespace strata {
namespace {

const char* kQwen2 =
    R"({"model_type": "qwen2", "vocab_size": 97, "hidden_size": 64, "intermediate_size": 96,
  "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64})";
const char* kGpt2 =
    R"({"model_type": "gpt2", "vocab_size": 113, "n_embd": 48, "n_layer": 2, "n_head": 3,
  "n_positions": 32})";

struct Out {
  std::vector<float> logits;
  std::vector<float> decoded;  // Model::decode's logits, the first sequence fed 5, then 1 by 1
  float loss;
  std::vector<std::vector<float>> grads;
  // The same batch as packed rows (row 0 three documents, row 1 one) with masked targets.
  float packed_loss;
  std::vector<std::vector<float>> packed_grads;
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
  {
    const std::vector<std::int32_t> first(b.tokens.begin(), b.tokens.begin() + 17);
    std::vector<float> l = m.decode({first.begin(), first.begin() + 5}, w);
    o.decoded = l;
    for (std::size_t i = 5; i < first.size(); ++i) {
      l = m.decode({first[i]}, w);
      o.decoded.insert(o.decoded.end(), l.begin(), l.end());
    }
    m.reset_decode();
  }
  w.zero_grads();
  o.loss = m.forward(b, w);
  m.backward(w);
  for (const auto& u : w.units())
    for (const auto& p : u.params) o.grads.push_back(w.grad(p.name));
  for (int len : {6, 5, 6})
    for (int i = 0; i < len; ++i) b.positions.push_back(i);
  for (int i = 0; i < 17; ++i) b.positions.push_back(i);
  for (std::size_t i = 0; i < b.targets.size(); i += 3) b.targets[i] = kIgnoreTarget;
  w.zero_grads();
  o.packed_loss = m.forward(b, w);
  m.backward(w);
  for (const auto& u : w.units())
    for (const auto& p : u.params) o.packed_grads.push_back(w.grad(p.name));
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

using gpu::model::KernelVariant;

// The CUDA module's kernel variant for a scope (the one it found put back after).
class VariantScope {
 public:
  explicit VariantScope(KernelVariant v) : saved_(gpu::model::kernels().kernel_variant()) {
    use(v);
  }
  ~VariantScope() { use(saved_); }
  VariantScope(const VariantScope&) = delete;
  VariantScope& operator=(const VariantScope&) = delete;
  static void use(KernelVariant v) { gpu::model::kernels().set_kernel_variant(v); }

 private:
  KernelVariant saved_;
};

class ModelGpu : public ::testing::TestWithParam<std::pair<const char*, DType>> {
 protected:
  void matches_cpu_reference(KernelVariant v) {
    const CudaProbe p = probe_cuda();
    if (p.device_count == 0) GTEST_SKIP() << "no usable GPU: " << p.reason;
    const VariantScope variant(v);
    const auto [json, dt] = GetParam();
    auto cpu = make_host_device();
    auto gpu = make_cuda_device();
    const Out ref = run(*cpu, json, dt), got = run(*gpu, json, dt);
    const double tol = dt == DType::kBF16 ? 3e-2 : 2e-4;
    EXPECT_LT(rel(got.logits, ref.logits), tol);
    ASSERT_EQ(got.decoded.size(), ref.decoded.size());
    EXPECT_LT(rel(got.decoded, ref.decoded), tol) << "decoding with the key/value cache";
    EXPECT_NEAR(got.loss, ref.loss, tol * ref.loss);
    ASSERT_EQ(got.grads.size(), ref.grads.size());
    for (std::size_t i = 0; i < ref.grads.size(); ++i)
      EXPECT_LT(rel(got.grads[i], ref.grads[i]), 3 * tol) << i;
    EXPECT_NEAR(got.packed_loss, ref.packed_loss, tol * ref.packed_loss) << "packed, masked";
    ASSERT_EQ(got.packed_grads.size(), ref.packed_grads.size());
    for (std::size_t i = 0; i < ref.packed_grads.size(); ++i)
      EXPECT_LT(rel(got.packed_grads[i], ref.packed_grads[i]), 3 * tol) << "packed, masked: " << i;
  }
};

TEST_P(ModelGpu, MatchesCpuReference) { matches_cpu_reference(KernelVariant::kSimple); }
TEST_P(ModelGpu, MatchesCpuReferenceTiled) { matches_cpu_reference(KernelVariant::kTiled); }

INSTANTIATE_TEST_SUITE_P(Families, ModelGpu,
                         ::testing::Values(std::make_pair(kQwen2, DType::kF32),
                                           std::make_pair(kGpt2, DType::kF32),
                                           std::make_pair(kQwen2, DType::kBF16)),
                         [](const auto& i) {
                           return std::string(i.index == 1 ? "gpt2" : "qwen2") +
                                  (i.param.second == DType::kBF16 ? "_bf16" : "_fp32");
                         });

// Device buffers from and to host vectors, on one stream of the GPU.
struct Gpu {
  std::unique_ptr<Device> dev = make_cuda_device();
  std::unique_ptr<Stream> s = dev->create_stream("variants");

  template <class T>
  Buffer up(const std::vector<T>& h) {
    Buffer b = dev->alloc(h.size() * sizeof(T), s.get());
    s->copy(b.ref(), host_ref(h.data(), h.size() * sizeof(T)));
    s->synchronize();
    return b;
  }
  // `b` set to `h` again (an accumulating kernel's starting values).
  void set(const Buffer& b, const std::vector<float>& h) {
    s->copy(b.ref(), host_ref(h.data(), h.size() * 4));
    s->synchronize();
  }
  Buffer zeros(std::size_t n) {
    Buffer b = dev->alloc(n * 4, s.get());
    s->fill(tensor(b, DType::kF32), 0.0f);
    return b;
  }
  std::vector<float> down(const Buffer& b) {
    std::vector<float> h(b.size() / 4);
    s->copy(host_ref(h.data(), b.size()), b.ref());
    s->synchronize();
    return h;
  }
};

std::vector<float> uniform(std::size_t n, std::uint64_t seed, float lo, float hi) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(lo, hi);
  std::vector<float> v(n);
  for (auto& x : v) x = u(rng);
  return v;
}

bool bit_equal(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * 4) == 0;
}

// Columns [c0, c1) of every row of a [rows, cols] matrix.
std::vector<float> columns(const std::vector<float>& m, std::size_t cols, std::size_t c0,
                           std::size_t c1) {
  std::vector<float> out;
  for (std::size_t r = 0; r < m.size() / cols; ++r)
    out.insert(out.end(), m.begin() + std::ptrdiff_t(r * cols + c0),
               m.begin() + std::ptrdiff_t(r * cols + c1));
  return out;
}

struct AttentionCase {
  std::int64_t b, t, nh, nkv, hd;
  bool bf16;
  bool tiled;  // the tiled kernels take it (bf16, hd a multiple of 16 up to 128); else they fall
               // back
};

struct AttentionOut {
  std::vector<float> o, lse, dqkv;
};

TEST(ModelGpuVariants, AttentionTiledMatchesSimple) {
  const CudaProbe p = probe_cuda();
  if (p.device_count == 0) GTEST_SKIP() << "no usable GPU: " << p.reason;
  const VariantScope restore(KernelVariant::kSimple);
  Gpu g;
  // t = 77 and 130: partial tiles (64 rows); groups of 1, 2 and 4 heads; hd 80 takes five 16-wide
  // chunks; hd 72 and fp32 fall back to the simple kernels.
  const AttentionCase cases[] = {{2, 77, 4, 2, 64, true, true},  {1, 130, 4, 1, 16, true, true},
                                 {2, 77, 4, 2, 80, true, true},  {1, 77, 2, 2, 128, true, true},
                                 {2, 77, 4, 2, 72, true, false}, {2, 77, 4, 2, 64, false, false}};
  for (const AttentionCase& k : cases) {
    SCOPED_TRACE(::testing::Message() << "b " << k.b << " t " << k.t << " heads " << k.nh << "/"
                                      << k.nkv << " hd " << k.hd << (k.bf16 ? " bf16" : " fp32"));
    const std::size_t width = std::size_t((k.nh + 2 * k.nkv) * k.hd), n = std::size_t(k.b * k.t);
    const std::size_t o_n = n * std::size_t(k.nh * k.hd), lse_n = std::size_t(k.b * k.nh * k.t);
    const double scale = 1.0 / std::sqrt(double(k.hd));
    const DType gemm = k.bf16 ? DType::kBF16 : DType::kF32;
    Buffer qkv = g.up(uniform(n * width, 1, -1.5f, 1.5f)),
           dout = g.up(uniform(o_n, 2, -1.0f, 1.0f));
    Buffer o = g.zeros(o_n), lse = g.zeros(lse_n), o_in = g.zeros(o_n), lse_in = g.zeros(lse_n),
           dqkv = g.zeros(n * width);
    auto f = [](const Buffer& b) { return static_cast<float*>(b.data()); };
    VariantScope::use(KernelVariant::kSimple);  // the backward's inputs, the same for both variants
    model_ops::attention_forward(*g.s, f(qkv), f(o_in), nullptr, f(lse_in), k.b, k.t, k.nh, k.nkv,
                                 k.hd, scale, gemm);
    auto run = [&](KernelVariant v) {
      VariantScope::use(v);
      g.s->fill(tensor(dqkv, DType::kF32), 0.0f);
      model_ops::attention_forward(*g.s, f(qkv), f(o), nullptr, f(lse), k.b, k.t, k.nh, k.nkv, k.hd,
                                   scale, gemm);
      model_ops::attention_backward(*g.s, f(qkv), f(o_in), f(dout), f(lse_in), f(dqkv), k.b, k.t,
                                    k.nh, k.nkv, k.hd, scale, gemm);
      return AttentionOut{g.down(o), g.down(lse), g.down(dqkv)};
    };
    const AttentionOut ref = run(KernelVariant::kSimple), got = run(KernelVariant::kTiled),
                       again = run(KernelVariant::kTiled);
    EXPECT_TRUE(bit_equal(got.o, again.o) && bit_equal(got.lse, again.lse) &&
                bit_equal(got.dqkv, again.dqkv))
        << "the tiled variant is not bit-reproducible";
    if (!k.tiled) {
      EXPECT_TRUE(bit_equal(got.o, ref.o) && bit_equal(got.lse, ref.lse) &&
                  bit_equal(got.dqkv, ref.dqkv))
          << "the tiled variant should have run the simple kernels";
      continue;
    }
    EXPECT_LT(rel(got.o, ref.o), 3e-2);
    EXPECT_LT(rel(got.lse, ref.lse),
              1e-5);  // fp32 throughout: only the order of the row's sum differs
    const std::size_t q_end = std::size_t(k.nh * k.hd), k_end = q_end + std::size_t(k.nkv * k.hd);
    EXPECT_LT(rel(columns(got.dqkv, width, 0, q_end), columns(ref.dqkv, width, 0, q_end)), 3e-2)
        << "dq";
    EXPECT_LT(rel(columns(got.dqkv, width, q_end, k_end), columns(ref.dqkv, width, q_end, k_end)),
              3e-2)
        << "dk";
    EXPECT_LT(rel(columns(got.dqkv, width, k_end, width), columns(ref.dqkv, width, k_end, width)),
              3e-2)
        << "dv";
  }
}

TEST(ModelGpuVariants, ColumnReductionsTiledMatchSimpleAndRepeat) {
  const CudaProbe p = probe_cuda();
  if (p.device_count == 0) GTEST_SKIP() << "no usable GPU: " << p.reason;
  const VariantScope restore(KernelVariant::kSimple);
  Gpu g;
  // Row counts below, at and past the 16 row groups; columns not a multiple of the 32 per block.
  for (const auto& [n, c] :
       {std::pair<std::int64_t, std::int64_t>{333, 200}, {5, 37}, {1024, 64}}) {
    SCOPED_TRACE(::testing::Message() << n << " x " << c);
    const std::size_t nc = std::size_t(n * c), cs = std::size_t(c);
    Buffer dout = g.up(uniform(nc, 3, -1.0f, 1.0f)), x = g.up(uniform(nc, 4, -1.0f, 1.0f));
    Buffer w = g.up(uniform(cs, 5, 0.5f, 1.5f)),
           rstd = g.up(uniform(std::size_t(n), 6, 0.5f, 2.0f)),
           mean = g.up(uniform(std::size_t(n), 7, -0.1f, 0.1f));
    // The gradients accumulate: each run starts from the same non-zero values.
    const std::vector<float> dx0 = uniform(nc, 8, -1.0f, 1.0f), dw0 = uniform(cs, 9, -1.0f, 1.0f),
                             db0 = uniform(cs, 10, -1.0f, 1.0f);
    Buffer dx = g.up(dx0), dw = g.up(dw0), db = g.up(db0);
    auto f = [](const Buffer& b) { return static_cast<float*>(b.data()); };
    const model_ops::Weight wt{w.data(), DType::kF32};
    struct Op {
      const char* name;
      std::function<void()> run;
      std::vector<const Buffer*> out;  // the reduction's outputs
      bool writes_dx;
    };
    const std::vector<Op> ops = {
        {"rmsnorm_backward",
         [&] { model_ops::rmsnorm_backward(*g.s, f(dout), f(x), wt, f(rstd), f(dx), f(dw), n, c); },
         {&dw},
         true},
        {"layernorm_backward",
         [&] {
           model_ops::layernorm_backward(*g.s, f(dout), f(x), wt, f(mean), f(rstd), f(dx), f(dw),
                                         f(db), n, c);
         },
         {&dw, &db},
         true},
        {"bias_backward",
         [&] { model_ops::bias_backward(*g.s, f(dout), f(db), n, c); },
         {&db},
         false},
    };
    for (const Op& op : ops) {
      SCOPED_TRACE(op.name);
      auto run = [&](KernelVariant v) {
        VariantScope::use(v);
        g.set(dx, dx0);
        g.set(dw, dw0);
        g.set(db, db0);
        op.run();
        std::vector<std::vector<float>> r;
        for (const Buffer* b : op.out) r.push_back(g.down(*b));
        r.push_back(g.down(dx));
        return r;
      };
      const auto ref = run(KernelVariant::kSimple), got = run(KernelVariant::kTiled),
                 again = run(KernelVariant::kTiled);
      for (std::size_t i = 0; i < got.size(); ++i) {
        EXPECT_TRUE(bit_equal(got[i], again[i]))
            << "output " << i << ": the tiled variant is not bit-reproducible";
        if (i + 1 < got.size()) {
          EXPECT_LT(rel(got[i], ref[i]), 1e-4)
              << "output " << i;  // fp32: only the summation order differs
        } else if (op.writes_dx) {
          EXPECT_TRUE(bit_equal(got[i], ref[i])) << "dx has one kernel in both variants";
        }
      }
    }
  }
}

TEST(ModelGpuVariants, EmbeddingBackwardTiledIsBitEqualToSimple) {
  const CudaProbe p = probe_cuda();
  if (p.device_count == 0) GTEST_SKIP() << "no usable GPU: " << p.reason;
  const VariantScope restore(KernelVariant::kSimple);
  Gpu g;
  // 1100 rows: more than one 512-token chunk; t does not divide the rows; a small vocabulary,
  // so tokens repeat.
  const std::int64_t n = 1100, t = 77, c = 200, vocab = 37;
  std::vector<std::int32_t> tokens(static_cast<std::size_t>(n));
  std::mt19937_64 rng(11);
  for (auto& tk : tokens) tk = std::int32_t(rng() % std::uint64_t(vocab));
  Buffer tok = g.up(tokens), dout = g.up(uniform(std::size_t(n * c), 12, -1.0f, 1.0f));
  const std::vector<float> wte0 = uniform(std::size_t(vocab * c), 13, -1.0f, 1.0f),
                           wpe0 = uniform(std::size_t(t * c), 14, -1.0f, 1.0f);
  Buffer dwte = g.up(wte0), dwpe = g.up(wpe0);
  for (const bool with_wpe : {true, false}) {
    SCOPED_TRACE(with_wpe ? "wte and wpe" : "wte only");
    auto run = [&](KernelVariant v) {
      VariantScope::use(v);
      g.set(dwte, wte0);
      g.set(dwpe, wpe0);
      model_ops::embedding_backward(*g.s, static_cast<const std::int32_t*>(tok.data()),
                                    static_cast<const float*>(dout.data()),
                                    static_cast<float*>(dwte.data()),
                                    with_wpe ? static_cast<float*>(dwpe.data()) : nullptr, n, t, c);
      return std::make_pair(g.down(dwte), g.down(dwpe));
    };
    const auto ref = run(KernelVariant::kSimple), got = run(KernelVariant::kTiled),
               again = run(KernelVariant::kTiled);
    EXPECT_TRUE(bit_equal(got.first, ref.first)) << "dwte";
    EXPECT_TRUE(bit_equal(got.second, ref.second)) << "dwpe";
    EXPECT_TRUE(bit_equal(got.first, again.first) && bit_equal(got.second, again.second));
  }
}

}  // namespace
}  // namespace strata
