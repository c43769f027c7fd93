// The model reaches its kernels through the device it runs on (Device::model_kernels(),
// strata/model_ops.h), never a backend by name: a device of one's own with a backend of its own
// runs the model's ops there, after the model's argument checks; a device without one is refused
// with an error that names it; the emulated device's backend is the CPU kernels.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "cpu/model_kernels.h"
#include "model/ops.h"
#include "strata/device.h"
#include "strata/error.h"
#include "strata/model_ops.h"

namespace strata {
namespace {

using model_ops::i64;
using model_ops::Out;
using model_ops::Weight;

// A backend that records which op was asked for, on which stream.
class RecordingKernels final : public model_ops::Backend {
 public:
  mutable std::vector<std::string> calls;
  void note(Stream& s, const char* op) const { calls.push_back(s.name() + ":" + op); }

  void embedding_forward(Stream& s, const std::int32_t*, Weight, Weight, float*, i64, i64,
                         i64) const override {
    note(s, "embedding_forward");
  }
  void embedding_backward(Stream& s, const std::int32_t*, const float*, float*, float*, i64, i64,
                          i64) const override {
    note(s, "embedding_backward");
  }
  void rmsnorm_forward(Stream& s, const float*, Weight, Out, float*, i64, i64,
                       double) const override {
    note(s, "rmsnorm_forward");
  }
  void rmsnorm_backward(Stream& s, const float*, const float*, Weight, const float*, float*, float*,
                        i64, i64, void*) const override {
    note(s, "rmsnorm_backward");
  }
  void layernorm_forward(Stream& s, const float*, Weight, Weight, Out, float*, float*, i64, i64,
                         double) const override {
    note(s, "layernorm_forward");
  }
  void layernorm_backward(Stream& s, const float*, const float*, Weight, const float*, const float*,
                          float*, float*, float*, i64, i64) const override {
    note(s, "layernorm_backward");
  }
  void rope(Stream& s, float*, i64, i64, i64, i64, i64, i64, const float*, const float*,
            bool) const override {
    note(s, "rope");
  }
  void attention_forward(Stream& s, const float*, float*, void*, float*, i64, i64, i64, i64, i64,
                         double, bool) const override {
    note(s, "attention_forward");
  }
  void attention_backward(Stream& s, const float*, const float*, const float*, const float*, float*,
                          i64, i64, i64, i64, i64, double, bool) const override {
    note(s, "attention_backward");
  }
  void swiglu_forward(Stream& s, const float*, Out, i64, i64) const override {
    note(s, "swiglu_forward");
  }
  void swiglu_backward(Stream& s, const float*, const float*, Out, i64, i64) const override {
    note(s, "swiglu_backward");
  }
  void gelu_forward(Stream& s, const float*, Out, i64) const override { note(s, "gelu_forward"); }
  void gelu_backward(Stream& s, const float*, const float*, float*, i64) const override {
    note(s, "gelu_backward");
  }
  void bias_add(Stream& s, float*, Weight, i64, i64) const override { note(s, "bias_add"); }
  void bias_backward(Stream& s, const float*, float*, i64, i64) const override {
    note(s, "bias_backward");
  }
  void cross_entropy(Stream& s, float*, const std::int32_t*, float*, i64, i64, double,
                     Out) const override {
    note(s, "cross_entropy");
  }
};

// A stream that runs nothing: the ops' arguments are never dereferenced here.
class InertStream final : public Stream {
 public:
  InertStream(Device* d, std::string name) : Stream(d, std::move(name)) {}
  ~InertStream() override { mark_destroyed(); }

 protected:
  void do_copy(MemRef, MemRef) override {}
  Event do_record() override { return {}; }
  void do_wait(const Event&) override {}
  void do_synchronize() override {}
  void do_host_fn(std::function<void()>, const char*, std::uint64_t) override {}
  void do_fill(TensorRef, float) override {}
  void do_axpy(float, TensorRef, TensorRef) override {}
  void do_scale(float, TensorRef) override {}
  void do_add(TensorRef, TensorRef, TensorRef) override {}
  void do_cast(TensorRef, TensorRef) override {}
  void do_sum_squares(TensorRef, TensorRef) override {}
  void do_matmul(const MatmulDesc&) override {}
  void do_adamw(const AdamWDesc&) override {}
};

// A device of one's own whose model kernels are `kernels` (none when null).
class OwnDevice final : public Device {
 public:
  explicit OwnDevice(const model_ops::Backend* kernels) : kernels_(kernels) {}
  DeviceKind kind() const override { return DeviceKind::kCuda; }
  std::string name() const override { return "own-accelerator"; }
  std::unique_ptr<Stream> create_stream(std::string name) override {
    return std::make_unique<InertStream>(this, std::move(name));
  }
  DeviceStats stats() const override { return {}; }
  void reset_peak_stats() override {}
  void synchronize() override {}
  const model_ops::Backend* model_kernels() const override { return kernels_; }

 protected:
  void* do_alloc(std::size_t, Stream*, void**) override { return nullptr; }
  void do_free(void*) noexcept override {}

 private:
  const model_ops::Backend* kernels_;
};

TEST(ModelDispatch, TheOpsRunOnTheDevicesOwnKernelsAfterTheModelsChecks) {
  RecordingKernels k;
  OwnDevice dev(&k);
  auto s = dev.create_stream("compute");
  float x[4] = {};
  const Weight w{x, DType::kF32};
  model_ops::rmsnorm_forward(*s, x, w, Out(x), x, 1, 4, 1e-5);
  model_ops::gelu_backward(*s, x, x, x, 4);
  model_ops::attention_forward(*s, x, x, nullptr, x, 1, 1, 2, 1, 2, 0.5, DType::kBF16);
  model_ops::cross_entropy(*s, x, nullptr, x, 1, 4, 1.0, Out(x));
  EXPECT_EQ(k.calls,
            (std::vector<std::string>{"compute:rmsnorm_forward", "compute:gelu_backward",
                                      "compute:attention_forward", "compute:cross_entropy"}));

  // The model's checks come first: a refused op never reaches the backend.
  k.calls.clear();
  EXPECT_THROW(model_ops::rmsnorm_forward(*s, x, Weight{x, DType::kF16}, Out(x), x, 1, 4, 1e-5),
               Error);
  EXPECT_THROW(model_ops::cross_entropy(*s, x, nullptr, x, 1, 4, 1.0, Out(x + 1)), Error);
  EXPECT_THROW(model_ops::attention_forward(*s, x, x, nullptr, x, 1, 1, 3, 2, 2, 0.5, DType::kF32),
               Error);
  EXPECT_TRUE(k.calls.empty()) << k.calls.front();
}

TEST(ModelDispatch, ADeviceWithoutModelKernelsIsRefusedByName) {
  OwnDevice dev(nullptr);
  auto s = dev.create_stream("compute");
  float x[4] = {};
  try {
    model_ops::gelu_backward(*s, x, x, x, 4);
    FAIL() << "a device without model kernels ran an op";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kUnsupported);
    const std::string m = e.message();
    EXPECT_NE(m.find("device own-accelerator has no model kernels"), std::string::npos) << m;
    EXPECT_NE(m.find("Device::model_kernels()"), std::string::npos) << m;
  }
}

TEST(ModelDispatch, TheEmulatedDevicesKernelsAreTheCpuKernels) {
  auto dev = make_host_device({});
  ASSERT_NE(dev->model_kernels(), nullptr);
  EXPECT_EQ(dev->model_kernels(), &cpu::host_model_ops());
  auto s = dev->create_stream("compute");
  const i64 n = 37;
  Buffer b = dev->alloc(3 * n * sizeof(float));
  float* dout = static_cast<float*>(b.data());
  float* x = dout + n;
  float* dx = x + n;
  std::vector<float> want(n);
  for (i64 i = 0; i < n; ++i) {
    dout[i] = 0.25f + 0.01f * float(i);
    x[i] = -2.0f + 0.1f * float(i);
  }
  model_ops::gelu_backward(*s, dout, x, dx, n);
  s->synchronize();
  cpu::gelu_backward<float>(dout, x, want.data(), n);
  for (i64 i = 0; i < n; ++i) ASSERT_EQ(dx[i], want[i]) << i;
  EXPECT_NE(dx[n / 2], 0.0f);
}

}  // namespace
}  // namespace strata
