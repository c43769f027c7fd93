// The vectorised fp32 row kernels behind the transformer's CPU ops (src/cpu/model_kernels.cpp,
// src/cpu/model_attention.cpp) and the fp32 <-> bf16 casts of src/cpu/cpu_kernels.cpp.
//
// One source (model_simd_impl.h) is compiled once per ISA, each in its own translation unit
// with that ISA's target flags (src/cpu/CMakeLists.txt): model_simd_avx512.cpp (16 lanes,
// avx512f/bw/vl) and model_simd_avx2.cpp (8 lanes, avx2/fma). A table is only handed out after
// cpuid said the CPU has the ISA; without either, callers run their portable loops. The
// tables are picked once per process (STRATA_MODEL_ISA=avx512|avx2|scalar forces one, an error
// where the CPU lacks it); tests switch them with set_model_isa.
//
// Every kernel here works on one row (or one run of elements) and is deterministic: the same
// ISA gives the same bits for the same inputs, whatever the thread count. Different ISAs may
// differ in the last bits (lane counts change the order of in-row sums; exp is a polynomial,
// within 2 ulp of the correctly rounded value). The casts are exact and identical on every
// path: round to nearest even, NaNs quieted, exactly strata::f32_to_bf16.
#pragma once

#include <cstdint>

// Nothing but <cstdint> here: the ISA translation units include this header, and an inline
// function they instantiated from a shared header could become the copy every caller links
// to (see src/cpu/adamw_kernels.h).
namespace strata {
enum class Isa;  // strata/adamw.h
}

namespace strata::cpu::simd {

using i64 = std::int64_t;

struct Kernels {
  // Exact casts of n elements.
  void (*f32_to_bf16)(const float* x, std::uint16_t* y, i64 n);
  void (*bf16_to_f32)(const std::uint16_t* x, float* y, i64 n);

  // Outputs flagged *_bf16 are bf16 (rounded as stored), else fp32.
  // o = silu(g) * u; and the backward: dg, du written from d.
  void (*swiglu_fwd)(const float* g, const float* u, void* o, bool o_bf16, i64 n);
  void (*swiglu_bwd)(const float* d, const float* g, const float* u, void* dg, void* du,
                     bool out_bf16, i64 n);

  // RMSNorm of one row: o = x * rstd * w, returns rstd. w is fp32 or bf16 (w_bf16).
  float (*rms_fwd)(const float* x, const void* w, bool w_bf16, void* o, bool o_bf16, i64 c,
                   float eps);
  // dx += rstd * (d*w - x * rstd * mean(d*w*x*rstd)) for one row.
  // With dx_bf16, the updated dx again, rounded to bf16.
  void (*rms_bwd)(const float* d, const float* x, const void* w, bool w_bf16, float rstd, float* dx,
                  std::uint16_t* dx_bf16, i64 c);
  // acc += a * b * s (the weight-gradient row update of the norms).
  void (*mul_acc)(const float* a, const float* b, float s, float* acc, i64 n);

  // LayerNorm of one row (biased variance): o = (x - mean) * rstd * w + bias; writes mean,
  // returns rstd. w and bias share w_bf16.
  float (*ln_fwd)(const float* x, const void* w, const void* bias, bool w_bf16, void* o,
                  bool o_bf16, i64 c, float eps, float* mean);
  // dx += rstd * (d*w - mean(d*w) - xhat * mean(d*w*xhat)) for one row.
  void (*ln_bwd)(const float* d, const float* x, const void* w, bool w_bf16, float mean, float rstd,
                 float* dx, i64 c);
  // dw += d * (x - mean) * rstd, db += d (one row).
  void (*ln_acc)(const float* d, const float* x, float mean, float rstd, float* dw, float* db,
                 i64 c);

  // GPT-2's tanh GELU: o = gelu(x); dx = d * gelu'(x).
  void (*gelu_fwd)(const float* x, void* o, bool o_bf16, i64 n);
  void (*gelu_bwd)(const float* d, const float* x, float* dx, i64 n);

  // Rotary embedding of one head (pairs i and i + half) in place; sgn -1 is the inverse.
  void (*rope_head)(float* v, const float* cos, const float* sin, i64 half, float sgn);

  // Cross-entropy of one row of logits: returns logsumexp(l) - l[tgt]; with g (non-null),
  // writes (softmax(l) - onehot(tgt)) * grad_scale there, fp32 (g may be l itself) or bf16.
  float (*xent_row)(const float* l, i64 v, i64 tgt, void* g, bool g_bf16, float grad_scale);

  // Attention, one query row of scores s[0, kn) of which [0, valid) are visible (causal):
  // forward writes p = softmax(s * scale) (0 beyond valid) as fp32 or bf16 (p_bf16) and
  // returns the logsumexp of s * scale over the visible keys.
  // s is scratch: overwritten.
  float (*attn_fwd_row)(float* s, i64 kn, i64 valid, float scale, void* p, bool p_bf16);
  // Backward: p = exp(s * scale - lse), ds = p * (dp - dsum) * scale (0 beyond valid), both
  // written as fp32 or bf16.
  void (*attn_bwd_row)(const float* s, const float* dp, i64 kn, i64 valid, float scale, float lse,
                       float dsum, void* p, void* ds, bool out_bf16);
  // sum(a * b) over n elements.
  float (*dot)(const float* a, const float* b, i64 n);

  // Strided 2-D blocks (attention's packing): dst[r, :cols] = src[r, :cols] as fp32 or bf16
  // (dst_bf16), rows src_stride / dst_stride elements apart.
  void (*pack_2d)(const float* src, i64 src_stride, void* dst, bool dst_bf16, i64 dst_stride,
                  i64 rows, i64 cols);
  // out[r * out_stride] = sum(a[r, :cols] * b[r, :cols]).
  void (*rowdot_2d)(const float* a, i64 a_stride, const float* b, i64 b_stride, float* out,
                    i64 out_stride, i64 rows, i64 cols);
  // acc[i % 16] += double(a[i])^2 for i in [0, n), each lane in order of i (cpu::sum_squares).
  // The squares are exact in fp64, so every ISA gives the portable loop's bits.
  void (*sum_squares_16)(const float* a, i64 n, double* acc);
};

// The table of `isa` (kAvx512 or kAvx2); callers check isa_supported first.
const Kernels& avx512_kernels();
const Kernels& avx2_kernels();

// The table in use: nullptr on the portable path (Isa::kScalar or a CPU with neither ISA).
const Kernels* kernels();
// The ISA in use (kAvx512, kAvx2 or kScalar).
Isa model_isa();
// Switches the model kernels to `isa` (kAuto: STRATA_MODEL_ISA, else the best the CPU has);
// throws strata::Error (kUnsupported) when this CPU lacks it. Not thread-safe against running
// kernels: for tests and start-up.
void set_model_isa(Isa isa);

}  // namespace strata::cpu::simd
