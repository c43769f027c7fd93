// HostDevice's model kernels (strata/model_ops.h): each op is queued with host_fn, so the CPU
// kernel (model_kernels.h) runs on the stream's worker in stream order, where the emulated
// device's compute throttle and trace see it. Only plain values are captured: the pointers stay
// valid because every buffer the model frees is freed in this stream's order, after the op ran.
#include <type_traits>

#include "cpu/model_kernels.h"
#include "strata/device.h"
#include "strata/model_ops.h"

namespace strata::cpu {
namespace {

using model_ops::Out;
using model_ops::Weight;

// Calls fn with the output pointer typed as float or bf16_t.
template <class Fn>
void with_out(Out out, Fn fn) {
  if (out.dtype == DType::kBF16)
    fn(static_cast<bf16_t*>(out.ptr));
  else
    fn(static_cast<float*>(out.ptr));
}

// Calls fn with the weight pointer typed as float or bf16_t.
template <class Fn>
void with_w(Weight w, Fn fn) {
  if (w.dtype == DType::kBF16)
    fn(static_cast<const bf16_t*>(w.ptr));
  else
    fn(static_cast<const float*>(w.ptr));
}

class HostModelOps final : public model_ops::Backend {
 public:
  void embedding_forward(Stream& s, const std::int32_t* tokens, Weight wte, Weight wpe, float* out,
                         i64 n, i64 t, i64 c) const override {
    s.host_fn(
        [=] {
          with_w(wte, [&](auto* e) {
            using W = std::remove_const_t<std::remove_pointer_t<decltype(e)>>;
            cpu::embedding_forward<float, W>(tokens, e, static_cast<const W*>(wpe.ptr), out, n, t,
                                             c);
          });
        },
        "embedding_forward");
  }

  void embedding_backward(Stream& s, const std::int32_t* tokens, const float* dout, float* dwte,
                          float* dwpe, i64 n, i64 t, i64 c) const override {
    s.host_fn([=] { cpu::embedding_backward<float>(tokens, dout, dwte, dwpe, n, t, c); },
              "embedding_backward");
  }

  void rmsnorm_forward(Stream& s, const float* x, Weight w, Out out, float* rstd, i64 n, i64 c,
                       double eps) const override {
    s.host_fn(
        [=] {
          with_w(w, [&](auto* wp) {
            with_out(out, [&](auto* op) { cpu::rmsnorm_forward(x, wp, op, rstd, n, c, eps); });
          });
        },
        "rmsnorm_forward");
  }

  void rmsnorm_backward(Stream& s, const float* dout, const float* x, Weight w, const float* rstd,
                        float* dx, float* dw, i64 n, i64 c, void* dx_bf16) const override {
    auto* db = static_cast<bf16_t*>(dx_bf16);
    s.host_fn(
        [=] {
          with_w(w, [&](auto* wp) { cpu::rmsnorm_backward(dout, x, wp, rstd, dx, dw, n, c, db); });
        },
        "rmsnorm_backward");
  }

  void layernorm_forward(Stream& s, const float* x, Weight w, Weight b, Out out, float* mean,
                         float* rstd, i64 n, i64 c, double eps) const override {
    s.host_fn(
        [=] {
          with_w(w, [&](auto* wp) {
            using W = std::remove_pointer_t<decltype(wp)>;
            with_out(out, [&](auto* op) {
              cpu::layernorm_forward(x, wp, static_cast<W*>(b.ptr), op, mean, rstd, n, c, eps);
            });
          });
        },
        "layernorm_forward");
  }

  void layernorm_backward(Stream& s, const float* dout, const float* x, Weight w, const float* mean,
                          const float* rstd, float* dx, float* dw, float* db, i64 n,
                          i64 c) const override {
    s.host_fn(
        [=] {
          with_w(w, [&](auto* wp) {
            cpu::layernorm_backward(dout, x, wp, mean, rstd, dx, dw, db, n, c);
          });
        },
        "layernorm_backward");
  }

  void rope(Stream& s, float* x, i64 n, i64 t, i64 stride, i64 col, i64 heads, i64 hd,
            const float* cos, const float* sin, bool inverse) const override {
    s.host_fn([=] { cpu::rope_apply<float>(x, n, t, stride, col, heads, hd, cos, sin, inverse); },
              "rope");
  }

  void attention_forward(Stream& s, const float* qkv, float* o, void* o_bf16, float* lse, i64 b,
                         i64 t, i64 nh, i64 nkv, i64 hd, double scale, bool bf16) const override {
    auto* ob = static_cast<bf16_t*>(o_bf16);
    s.host_fn([=] { cpu::attention_forward_fast(qkv, o, ob, lse, b, t, nh, nkv, hd, scale, bf16); },
              "attention_forward");
  }

  void attention_cached(Stream& s, const float* qkv, float* k_cache, float* v_cache, float* o,
                        void* o_bf16, i64 n, i64 p0, i64 nh, i64 nkv, i64 hd, double scale,
                        bool bf16) const override {
    auto* ob = static_cast<bf16_t*>(o_bf16);
    s.host_fn(
        [=] {
          cpu::attention_cached(qkv, k_cache, v_cache, o, ob, n, p0, nh, nkv, hd, scale, bf16);
        },
        "attention_cached");
  }

  void attention_backward(Stream& s, const float* qkv, const float* o, const float* dout,
                          const float* lse, float* dqkv, i64 b, i64 t, i64 nh, i64 nkv, i64 hd,
                          double scale, bool bf16) const override {
    s.host_fn(
        [=] {
          cpu::attention_backward_fast(qkv, o, dout, lse, dqkv, b, t, nh, nkv, hd, scale, bf16);
        },
        "attention_backward");
  }

  void swiglu_forward(Stream& s, const float* gu, Out out, i64 n, i64 inter) const override {
    s.host_fn(
        [=] { with_out(out, [&](auto* op) { cpu::swiglu_forward<float>(gu, op, n, inter); }); },
        "swiglu_forward");
  }

  void swiglu_backward(Stream& s, const float* dout, const float* gu, Out dgu, i64 n,
                       i64 inter) const override {
    s.host_fn(
        [=] {
          with_out(dgu, [&](auto* op) { cpu::swiglu_backward<float>(dout, gu, op, n, inter); });
        },
        "swiglu_backward");
  }

  void gelu_forward(Stream& s, const float* x, Out out, i64 n) const override {
    s.host_fn([=] { with_out(out, [&](auto* op) { cpu::gelu_forward<float>(x, op, n); }); },
              "gelu_forward");
  }

  void gelu_backward(Stream& s, const float* dout, const float* x, float* dx,
                     i64 n) const override {
    s.host_fn([=] { cpu::gelu_backward<float>(dout, x, dx, n); }, "gelu_backward");
  }

  void bias_add(Stream& s, float* y, Weight b, i64 n, i64 m) const override {
    s.host_fn([=] { with_w(b, [&](auto* bp) { cpu::bias_add(y, bp, n, m); }); }, "bias_add");
  }

  void bias_backward(Stream& s, const float* dy, float* db, i64 n, i64 m) const override {
    s.host_fn([=] { cpu::bias_backward<float>(dy, db, n, m); }, "bias_backward");
  }

  void cross_entropy(Stream& s, float* logits, const std::int32_t* targets, float* losses, i64 rows,
                     i64 vocab, double grad_scale, Out grad) const override {
    // The gradient over the logits (grad is the logits) or into a bf16 buffer.
    auto* gb = grad.ptr == logits ? nullptr : static_cast<bf16_t*>(grad.ptr);
    s.host_fn(
        [=] {
          cpu::cross_entropy<float, bf16_t>(logits, targets, losses, rows, vocab, grad_scale, gb);
        },
        "cross_entropy");
  }

  void cross_entropy_stats(Stream& s, const float* logits, const std::int32_t* targets,
                           float* stats, i64 rows, i64 vocab) const override {
    s.host_fn([=] { cpu::cross_entropy_stats<float>(logits, targets, stats, rows, vocab); },
              "cross_entropy_stats");
  }

  void cross_entropy_finish(Stream& s, float* logits, const std::int32_t* targets, const float* all,
                            i64 parts, float* losses, i64 rows, i64 vocab, double grad_scale,
                            Out grad) const override {
    auto* gb = grad.ptr == logits ? nullptr : static_cast<bf16_t*>(grad.ptr);
    s.host_fn(
        [=] {
          cpu::cross_entropy_finish<float, bf16_t>(logits, targets, all, parts, losses, rows, vocab,
                                                   grad_scale, gb);
        },
        "cross_entropy_finish");
  }
};

}  // namespace

const model_ops::Backend& host_model_ops() {
  static const HostModelOps ops;
  return ops;
}

}  // namespace strata::cpu
