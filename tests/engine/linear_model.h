// A small deep linear network on the device kernels, driven through the Engine: each layer
// is one fetch unit (weight [out, in]); loss = 0.5 * sum((y - t)^2) / B. It exercises every
// engine path (gather, prefetch, release, reduce-scatter, step) with exact, deterministic
// kernels, so results can be compared bit for bit across placements.
#pragma once

#include <cmath>
#include <exception>
#include <random>
#include <vector>

#include "strata/engine.h"

namespace strata::testing {

struct LinearModel {
  std::vector<int> dims;  // dims[0] = input width, dims[l+1] = output width of layer l
  int batch = 4;          // rows per micro-batch on this rank
  // How the backward asks for its gradient buffers: its matmul (beta 0) writes all of them.
  GradInit grad_init = GradInit::kZeroed;
  std::vector<std::vector<float>> init;  // per layer, [out, in]

  LinearModel(std::vector<int> d, int b, std::uint64_t seed) : dims(std::move(d)), batch(b) {
    std::mt19937_64 rng(seed);
    for (std::size_t l = 0; l + 1 < dims.size(); ++l) {
      std::normal_distribution<float> nd(0.0f, 1.0f / std::sqrt(float(dims[l])));
      std::vector<float> w(std::size_t(dims[l]) * std::size_t(dims[l + 1]));
      for (auto& x : w) x = nd(rng);
      init.push_back(std::move(w));
    }
  }
  int layers() const { return int(dims.size()) - 1; }

  void register_units(Engine& e) const {
    for (int l = 0; l < layers(); ++l)
      e.add_unit({"layer" + std::to_string(l),
                  {{"weight", init[std::size_t(l)].size(), init[std::size_t(l)].data()}}});
  }

  // Deterministic data for global micro-batch `mb`: rows [row0, row0 + rows) of it.
  static std::vector<float> data(int width, int rows, int row0, int mb, std::uint64_t salt) {
    std::vector<float> v(std::size_t(rows) * std::size_t(width));
    for (int r = 0; r < rows; ++r) {
      std::mt19937_64 rng(salt * 1000003ull + std::uint64_t(mb) * 7919ull +
                          std::uint64_t(row0 + r));
      std::uniform_real_distribution<float> u(-1.0f, 1.0f);
      for (int c = 0; c < width; ++c)
        v[std::size_t(r) * std::size_t(width) + std::size_t(c)] = u(rng);
    }
    return v;
  }

  // One micro-batch through the engine; returns this rank's loss (unscaled mean).
  double micro_batch(Engine& e, Device& dev, Stream& s, const std::vector<float>& x,
                     const std::vector<float>& t) const {
    // Host memory the stream's copies use (the caller's x, the negated target, the loss) must
    // outlive them when the engine throws half-way (an I/O error of the early optimizer step
    // surfaces at a fetch): the guard, destroyed before them, drains the stream first.
    std::vector<float> nt(t.size());
    float sumsq = 0;
    struct Drain {
      Stream& s;
      ~Drain() {
        if (std::uncaught_exceptions() == 0) return;
        try {
          s.synchronize();
        } catch (...) {  // the error already in flight is the one to report
        }
      }
    } drain{s};
    const DType ct = e.compute_dtype();
    const std::size_t cs = dtype_size(ct);
    const int L = layers();
    const std::size_t B = std::size_t(batch);
    // activations: h[l] in compute dtype (input of layer l), and the fp32 output
    std::vector<Buffer> h(std::size_t(L) + 1);
    auto to_ct = [&](const Buffer& f32, std::size_t n) {
      Buffer out = dev.alloc(n * cs, &s);
      if (ct == DType::kF32)
        s.copy(out.ref(), f32.ref(0, n * 4));
      else
        s.cast(tensor(f32, DType::kF32, n), tensor(out, ct, n));
      return out;
    };
    {
      Buffer x32 = dev.alloc(x.size() * 4, &s);
      s.copy(x32.ref(), host_ref(x.data(), x.size() * 4));
      h[0] = to_ct(x32, x.size());
    }
    Buffer y;
    for (int l = 0; l < L; ++l) {
      const std::size_t in = std::size_t(dims[std::size_t(l)]),
                        out = std::size_t(dims[std::size_t(l) + 1]);
      TensorRef w = e.fetch(l, s);
      Buffer o = dev.alloc(B * out * 4, &s);
      s.matmul({std::int64_t(B), std::int64_t(out), std::int64_t(in), false, true, 1.0f, 0.0f,
                tensor(h[std::size_t(l)], ct, B * in), w, tensor(o, DType::kF32, B * out)});
      e.release(l, s);
      if (l + 1 < L)
        h[std::size_t(l) + 1] = to_ct(o, B * out);
      else
        y = std::move(o);
    }
    // diff = y - t; loss = 0.5 * |diff|^2 / B
    const std::size_t out = std::size_t(dims.back());
    Buffer tneg = dev.alloc(B * out * 4, &s);
    for (std::size_t i = 0; i < t.size(); ++i) nt[i] = -t[i];
    s.copy(tneg.ref(), host_ref(nt.data(), nt.size() * 4));
    Buffer diff = dev.alloc(B * out * 4, &s);
    s.add(tensor(y, DType::kF32), tensor(tneg, DType::kF32), tensor(diff, DType::kF32));
    Buffer sq = dev.alloc(4, &s);
    s.sum_squares(tensor(diff, DType::kF32), tensor(sq, DType::kF32, 1));
    s.copy(host_ref(&sumsq, 4), sq.ref());
    // backward: dy = diff * loss_scale / B
    s.scale(e.loss_scale() / float(B), tensor(diff, DType::kF32));
    Buffer dy = std::move(diff);
    for (int l = L - 1; l >= 0; --l) {
      const std::size_t in = std::size_t(dims[std::size_t(l)]),
                        outl = std::size_t(dims[std::size_t(l) + 1]);
      Buffer dy_c = to_ct(dy, B * outl);
      TensorRef w = e.fetch(l, s);
      TensorRef g = e.grad_buffer(l, s, grad_init);
      // dW[out, in] = dy^T [out, B] x h [B, in]
      s.matmul({std::int64_t(outl), std::int64_t(in), std::int64_t(B), true, false, 1.0f, 0.0f,
                tensor(dy_c, ct, B * outl), tensor(h[std::size_t(l)], ct, B * in), g});
      e.reduce_grad(l, s);
      if (l > 0) {
        // dh[B, in] = dy [B, out] x W [out, in]
        Buffer dh = dev.alloc(B * in * 4, &s);
        s.matmul({std::int64_t(B), std::int64_t(in), std::int64_t(outl), false, false, 1.0f, 0.0f,
                  tensor(dy_c, ct, B * outl), w, tensor(dh, DType::kF32, B * in)});
        dy = std::move(dh);
      }
      e.release(l, s);
    }
    s.synchronize();
    return 0.5 * double(sumsq) / double(B);
  }
};

}  // namespace strata::testing
