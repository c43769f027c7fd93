// The model's fp32 causal attention on the CPU: flash-style tiles, each product a oneDNN matmul.
//
// A first pass over the rows of qkv (and of dO in the backward) packs, per (batch, kv head),
// its k and v as [T, hd] and its group's queries as [T * group, hd] (row = position * group +
// head in group, so a block of positions is a block of consecutive rows). Then one task per
// (batch, kv head) walks blocks of query positions: a block [t0, t0 + tb) sees keys [0, t0 + tb)
// only (causal), so its scores S = Q_blk K^T are one matmul over that key prefix; a row pass
// turns them into probabilities (an exact softmax over the row: a row sees all its keys at
// once, so no online rescaling is needed) and O_blk = P V is one more matmul. The backward
// recomputes S, takes dP = dO_blk V^T, forms dS in a row pass and runs dQ_blk = dS K,
// dK += dS^T Q_blk and dV += P^T dO_blk, from the last block (which covers every key, so it
// writes dK and dV) down to the first. A last pass unpacks the results into rows. A block's S,
// P and dS are at most 128 rows by T keys and stay in the core's cache; nothing of size T^2
// per head exists, so memory is linear in T.
//
// Every matmul is 2-D and dense, which oneDNN's AMX / AVX-512 brgemm kernels need (a strided
// operand sends oneDNN to a kernel half as fast). Tasks run on the OpenMP team (oneDNN's
// runtime in this build), so each matmul runs on the one thread that issued it, with that
// thread's stream and scratchpad.
//
// With bf16_gemm, the matmul inputs (q, k, v, do, P, dS) are rounded to bf16 as the model's
// other GEMMs are in bf16 compute; S, dP, the softmax, the logsumexp and every output stay fp32.
// Where oneDNN has no bf16 matmul on this host (cpu/gemm_path.h), each product's bf16 operands
// are widened to fp32 (exact) into the thread's scratch and run through the fp32 GEMM: the same
// rounded operands, fp32 accumulation. Results are deterministic: each head's work is one task,
// in a fixed order. A primitive that cannot be made or run is a strata::Error from the call
// (parallel_rows carries it out of the OpenMP team).
//
// Owns: per thread, a cache of oneDNN primitives keyed by shape and scratch that only grows
// (the calling thread's also holds the packed tensors), so a training step allocates nothing
// here after its first call.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <new>
#include <oneapi/dnnl/dnnl.hpp>
#include <tuple>

#include "cpu/cpu_kernels.h"
#include "cpu/gemm_path.h"
#include "cpu/model_kernels.h"
#include "cpu/model_simd.h"
#include "cpu/parallel_rows.h"
#include "strata/error.h"

namespace strata::cpu {
namespace {

// One product C (+)= op(A) op(B), all three dense row-major matrices; A [m, k] or, with trans_a,
// stored [k, m]; B [k, n] or, with trans_b, stored [n, k]. A and B bf16 or fp32, C fp32.
struct Gemm {
  i64 m, n, k;
  bool trans_a, trans_b, bf16, accumulate;
  auto key() const { return std::make_tuple(m, n, k, trans_a, trans_b, bf16, accumulate); }
};

// What one thread keeps: its oneDNN stream, the primitives it has used, and scratch.
class Workspace {
 public:
  void gemm(Gemm g, const void* a, const void* b, float* c) {
    if (g.bf16 && gemm_route(DType::kBF16) == GemmRoute::kWidened) {
      float* wa = static_cast<float*>(scratch(kWidenA, std::size_t(g.m * g.k) * 4));
      float* wb = static_cast<float*>(scratch(kWidenB, std::size_t(g.k * g.n) * 4));
      cast(DType::kBF16, a, DType::kF32, wa, std::size_t(g.m * g.k));
      cast(DType::kBF16, b, DType::kF32, wb, std::size_t(g.k * g.n));
      a = wa;
      b = wb;
      g.bf16 = false;
    }
    auto it = prims_.find(g.key());
    if (it == prims_.end()) {
      if (prims_.size() >= 256) prims_.clear();  // a process that cycles through many shapes
      it = prims_.emplace(g.key(), make(g)).first;
    }
    Prim& p = it->second;
    p.a.set_data_handle(const_cast<void*>(a));
    p.b.set_data_handle(const_cast<void*>(b));
    p.c.set_data_handle(c);
    p.pad.set_data_handle(scratch(kPadSlot, p.pad_bytes));
    try {
      if (failures_to_inject.load() > 0 && failures_to_inject.fetch_sub(1) > 0)
        throw dnnl::error(dnnl_runtime_error, "a failure injected by a test");
      p.prim.execute(stream_, {{DNNL_ARG_SRC, p.a},
                               {DNNL_ARG_WEIGHTS, p.b},
                               {DNNL_ARG_DST, p.c},
                               {DNNL_ARG_SCRATCHPAD, p.pad}});
      stream_.wait();
    } catch (const dnnl::error& e) {
      STRATA_THROW(kInternal, "attention: oneDNN matmul {}x{}x{} failed: {} (status {})", g.m, g.n,
                   g.k, e.what(), static_cast<int>(e.status));
    }
  }

  // Scratch slot `i` (< kPadSlot) with at least `bytes`, 64-byte aligned; contents not kept.
  void* scratch(int i, std::size_t bytes) {
    Slot& s = slots_[i];
    if (s.bytes < bytes) {
      s.p.reset(static_cast<char*>(::operator new (bytes, std::align_val_t{64})));
      s.bytes = bytes;
    }
    return s.p.get();
  }
  static inline std::atomic<int> failures_to_inject{0};  // fail_attention_gemms_for_testing
  static constexpr int kWidenA = 11, kWidenB = 12, kPadSlot = 14;

 private:
  struct Prim {
    dnnl::matmul prim;
    dnnl::memory a, b, c, pad;
    std::size_t pad_bytes;
  };
  Prim make(const Gemm& g) {
    using dims = dnnl::memory::dims;
    const auto in = g.bf16 ? dnnl::memory::data_type::bf16 : dnnl::memory::data_type::f32;
    const dnnl::memory::desc a_md({g.m, g.k}, in, g.trans_a ? dims{1, g.m} : dims{g.k, 1});
    const dnnl::memory::desc b_md({g.k, g.n}, in, g.trans_b ? dims{1, g.k} : dims{g.n, 1});
    const dnnl::memory::desc c_md({g.m, g.n}, dnnl::memory::data_type::f32, dims{g.n, 1});
    dnnl::primitive_attr attr;
    attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);  // per thread: tasks run concurrently
    if (g.accumulate) {
      dnnl::post_ops po;
      po.append_sum(1.0f);
      attr.set_post_ops(po);
    }
    try {
      const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(a_md, b_md, c_md), attr, engine_);
      const dnnl::memory::desc pad_md = pd.scratchpad_desc();
      return Prim{dnnl::matmul(pd),
                  dnnl::memory(a_md, engine_, nullptr),
                  dnnl::memory(b_md, engine_, nullptr),
                  dnnl::memory(c_md, engine_, nullptr),
                  dnnl::memory(pad_md, engine_, nullptr),
                  std::max<std::size_t>(pad_md.get_size(), 64)};
    } catch (const dnnl::error& e) {
      STRATA_THROW(kInternal, "attention: oneDNN matmul {}x{}x{} ({}) unavailable: {} (status {})",
                   g.m, g.n, g.k, g.bf16 ? "bf16" : "fp32", e.what(), static_cast<int>(e.status));
    }
  }
  struct Slot {
    struct Free {
      void operator()(char* p) const { ::operator delete (p, std::align_val_t{64}); }
    };
    std::unique_ptr<char, Free> p;
    std::size_t bytes = 0;
  };
  GemmRoute f32_route_ =
      gemm_route(DType::kF32);  // oneDNN's ISA cap, before the engine and primitives
  dnnl::engine engine_{dnnl::engine::kind::cpu, 0};
  dnnl::stream stream_{engine_};
  std::map<decltype(Gemm{}.key()), Prim> prims_;
  Slot slots_[kPadSlot + 1];
};

Workspace& workspace() {
  thread_local Workspace ws;
  return ws;
}

// x (n fp32) -> y as fp32 or bf16.
void put(const float* x, void* y, i64 n, bool bf16, const simd::Kernels* k) {
  if (!bf16) {
    std::memcpy(y, x, std::size_t(n) * 4);
  } else if (k) {
    k->f32_to_bf16(x, static_cast<std::uint16_t*>(y), n);
  } else {
    auto* d = static_cast<std::uint16_t*>(y);
    for (i64 i = 0; i < n; ++i) d[i] = f32_to_bf16(x[i]);
  }
}

// dst[r, :cols] = src[r, :cols] (fp32 or bf16 dst), strided rows.
void pack(const float* src, i64 src_stride, void* dst, bool bf16, i64 dst_stride, i64 rows,
          i64 cols, const simd::Kernels* k) {
  if (k) return k->pack_2d(src, src_stride, dst, bf16, dst_stride, rows, cols);
  const std::size_t es = bf16 ? 2 : 4;
  for (i64 r = 0; r < rows; ++r)
    put(src + r * src_stride, static_cast<char*>(dst) + std::size_t(r * dst_stride) * es, cols,
        bf16, nullptr);
}

// out[r * out_stride] = sum(a[r, :] * b[r, :]).
void rowdot(const float* a, i64 a_stride, const float* b, i64 b_stride, float* out, i64 out_stride,
            i64 rows, i64 cols, const simd::Kernels* k) {
  if (k) return k->rowdot_2d(a, a_stride, b, b_stride, out, out_stride, rows, cols);
  for (i64 r = 0; r < rows; ++r) {
    float s = 0;
    for (i64 i = 0; i < cols; ++i) s += a[r * a_stride + i] * b[r * b_stride + i];
    out[r * out_stride] = s;
  }
}

// The row passes without a SIMD table (see model_simd.h for the contract).
float fwd_row(float* s, i64 kn, i64 valid, float scale, void* p, bool bf16) {
  float mx = -std::numeric_limits<float>::infinity();
  for (i64 j = 0; j < valid; ++j) mx = std::max(mx, s[j] * scale);
  float sum = 0;
  for (i64 j = 0; j < valid; ++j) {
    s[j] = std::exp(s[j] * scale - mx);
    sum += s[j];
  }
  const float inv = 1.0f / sum;
  for (i64 j = 0; j < kn; ++j) {
    const float v = j < valid ? s[j] * inv : 0.0f;
    if (bf16)
      static_cast<std::uint16_t*>(p)[j] = f32_to_bf16(v);
    else
      static_cast<float*>(p)[j] = v;
  }
  return mx + std::log(sum);
}

void bwd_row(const float* s, const float* dp, i64 kn, i64 valid, float scale, float lse, float dsum,
             void* p, void* ds, bool bf16) {
  for (i64 j = 0; j < kn; ++j) {
    const float pv = j < valid ? std::exp(s[j] * scale - lse) : 0.0f;
    const float dv = pv * (dp[j] - dsum) * scale;
    if (bf16) {
      static_cast<std::uint16_t*>(p)[j] = f32_to_bf16(pv);
      static_cast<std::uint16_t*>(ds)[j] = f32_to_bf16(dv);
    } else {
      static_cast<float*>(p)[j] = pv;
      static_cast<float*>(ds)[j] = dv;
    }
  }
}

// The layouts shared by forward and backward. Packed tensors hold, per (batch, kv head) `bk`,
// its k or v as [t, hd] and its group's queries (or dO, o, dq) as [t * group, hd].
struct Geo {
  i64 b, t, nh, nkv, hd, group, stride, bq;
  bool bf16;
  std::size_t es;  // bytes per packed bf16 / fp32 element of q, k, v, do
  Geo(i64 b_, i64 t_, i64 nh_, i64 nkv_, i64 hd_, bool bf16_)
      : b(b_),
        t(t_),
        nh(nh_),
        nkv(nkv_),
        hd(hd_),
        group(nh_ / nkv_),
        stride((nh_ + 2 * nkv_) * hd_),
        bq(std::clamp<i64>(128 / (nh_ / nkv_), 1, t_)),  // about 128 matrix rows per block
        bf16(bf16_),
        es(bf16_ ? 2 : 4) {}
  i64 kv_size() const { return t * hd; }         // elements per bk of k or v
  i64 q_size() const { return t * group * hd; }  // elements per bk of q-shaped tensors
  // Offsets (elements) of position ti of batch bi, kv head 0, in the packed tensors; kv head h
  // adds h * kv_size() / h * q_size().
  i64 kv_at(i64 bi, i64 ti) const { return (bi * nkv * t + ti) * hd; }
  i64 q_at(i64 bi, i64 ti) const { return (bi * nkv * t + ti) * group * hd; }
};

// Packs the rows of qkv (and of dout, with dsum, in the backward) into per-head tensors: one
// pass over contiguous rows (packing per head would read 256-byte pieces 9 KiB apart).
void pack_inputs(const Geo& g, const float* qkv, char* qp, char* kp, char* vp, const float* dout,
                 const float* o, char* dop, float* dsum, const simd::Kernels* k) {
  parallel_rows(g.b * g.t, g.stride, [&](i64 r) {
    const i64 bi = r / g.t, ti = r % g.t;
    const float* row = qkv + r * g.stride;
    const i64 gh = g.group * g.hd;
    pack(row, gh, qp + std::size_t(g.q_at(bi, ti)) * g.es, g.bf16, g.q_size(), g.nkv, gh, k);
    pack(row + g.nh * g.hd, g.hd, kp + std::size_t(g.kv_at(bi, ti)) * g.es, g.bf16, g.kv_size(),
         g.nkv, g.hd, k);
    pack(row + (g.nh + g.nkv) * g.hd, g.hd, vp + std::size_t(g.kv_at(bi, ti)) * g.es, g.bf16,
         g.kv_size(), g.nkv, g.hd, k);
    if (dout) {
      const float* drow = dout + r * g.nh * g.hd;
      pack(drow, gh, dop + std::size_t(g.q_at(bi, ti)) * g.es, g.bf16, g.q_size(), g.nkv, gh, k);
      const float* orow = o + r * g.nh * g.hd;
      for (i64 h = 0; h < g.nkv; ++h)  // sum_j P dP = sum_i dO o, per query row
        rowdot(drow + h * gh, g.hd, orow + h * gh, g.hd,
               dsum + (g.q_at(bi, ti) + h * g.q_size()) / g.hd, 1, g.group, g.hd, k);
    }
  });
}

// The inverse, for fp32 results in q layout: packed [bk][t * group, hd] -> rows of y (y_stride,
// heads from column 0), and optionally the same rounded to bf16 into y_bf16 (same layout).
void unpack_q(const Geo& g, const float* packed, float* y, i64 y_stride, bf16_t* y_bf16,
              const simd::Kernels* k) {
  parallel_rows(g.b * g.t, g.nh * g.hd, [&](i64 r) {
    const i64 bi = r / g.t, ti = r % g.t, gh = g.group * g.hd;
    pack(packed + g.q_at(bi, ti), g.q_size(), y + r * y_stride, false, gh, g.nkv, gh, k);
    if (y_bf16)
      pack(packed + g.q_at(bi, ti), g.q_size(), y_bf16 + r * y_stride, true, gh, g.nkv, gh, k);
  });
}

// One (batch, kv head) task's pointers into the packed tensors.
struct Head {
  i64 bi, kvh, q, kv;  // q, kv: element offsets of this head's q-shaped and k/v-shaped tensors
  Head(const Geo& g, i64 task)
      : bi(task / g.nkv),
        kvh(task % g.nkv),
        q(g.q_at(task / g.nkv, 0) + (task % g.nkv) * g.q_size()),
        kv(g.kv_at(task / g.nkv, 0) + (task % g.nkv) * g.kv_size()) {}
  i64 lse_at(const Geo& g, i64 ti, i64 gi) const {
    return (bi * g.nh + kvh * g.group + gi) * g.t + ti;
  }
};

}  // namespace

void fail_attention_gemms_for_testing(int count) { Workspace::failures_to_inject = count; }

void attention_forward_fast(const float* qkv, float* o, bf16_t* o_bf16, float* lse, i64 b, i64 t,
                            i64 nh, i64 nkv, i64 hd, double scale, bool bf16_gemm) {
  const Geo g(b, t, nh, nkv, hd, bf16_gemm);
  const simd::Kernels* k = simd::kernels();
  const float sc = static_cast<float>(scale);
  Workspace& shared =
      workspace();  // the calling thread's: its packed tensors are read by every task
  const i64 nq = b * nkv * g.q_size(), nkvs = b * nkv * g.kv_size();
  char* qp = static_cast<char*>(shared.scratch(0, std::size_t(nq) * g.es));
  char* kp = static_cast<char*>(shared.scratch(1, std::size_t(nkvs) * g.es));
  char* vp = static_cast<char*>(shared.scratch(2, std::size_t(nkvs) * g.es));
  float* op = static_cast<float*>(shared.scratch(3, std::size_t(nq) * 4));
  pack_inputs(g, qkv, qp, kp, vp, nullptr, nullptr, nullptr, nullptr, k);
  parallel_rows(b * nkv, t * t * hd * g.group, [&](i64 task) {
    const Head h(g, task);
    Workspace& ws = workspace();
    const i64 rows_max = g.bq * g.group;
    float* s = static_cast<float*>(ws.scratch(7, std::size_t(rows_max * t) * 4));
    char* p = static_cast<char*>(ws.scratch(8, std::size_t(rows_max * t) * g.es));
    const char* kh = kp + std::size_t(h.kv) * g.es;
    const char* vh = vp + std::size_t(h.kv) * g.es;
    for (i64 t0 = 0; t0 < t; t0 += g.bq) {
      const i64 tb = std::min(g.bq, t - t0), rows = tb * g.group, kn = t0 + tb;
      const i64 qoff = h.q + t0 * g.group * hd;
      ws.gemm({rows, kn, hd, false, true, bf16_gemm, false}, qp + std::size_t(qoff) * g.es, kh,
              s);  // S = Q K^T
      for (i64 i = 0; i < rows; ++i) {
        const i64 ti = t0 + i / g.group;
        float* srow = s + i * kn;
        void* prow = p + std::size_t(i * kn) * g.es;
        lse[h.lse_at(g, ti, i % g.group)] =
            k ? k->attn_fwd_row(srow, kn, ti + 1, sc, prow, bf16_gemm)
              : fwd_row(srow, kn, ti + 1, sc, prow, bf16_gemm);
      }
      ws.gemm({rows, hd, kn, false, false, bf16_gemm, false}, p, vh, op + qoff);  // O = P V
    }
  });
  unpack_q(g, op, o, nh * hd, o_bf16, k);
}

void attention_backward_fast(const float* qkv, const float* o, const float* dout, const float* lse,
                             float* dqkv, i64 b, i64 t, i64 nh, i64 nkv, i64 hd, double scale,
                             bool bf16_gemm) {
  const Geo g(b, t, nh, nkv, hd, bf16_gemm);
  const simd::Kernels* k = simd::kernels();
  const float sc = static_cast<float>(scale);
  Workspace& shared = workspace();
  const i64 nq = b * nkv * g.q_size(), nkvs = b * nkv * g.kv_size();
  char* qp = static_cast<char*>(shared.scratch(0, std::size_t(nq) * g.es));
  char* kp = static_cast<char*>(shared.scratch(1, std::size_t(nkvs) * g.es));
  char* vp = static_cast<char*>(shared.scratch(2, std::size_t(nkvs) * g.es));
  float* dqp = static_cast<float*>(shared.scratch(3, std::size_t(nq) * 4));
  char* dop = static_cast<char*>(shared.scratch(4, std::size_t(nq) * g.es));
  float* dkp = static_cast<float*>(shared.scratch(5, std::size_t(2 * nkvs) * 4));
  float* dvp = dkp + nkvs;
  float* dsum = static_cast<float*>(shared.scratch(6, std::size_t(nq / hd) * 4));
  pack_inputs(g, qkv, qp, kp, vp, dout, o, dop, dsum, k);
  parallel_rows(b * nkv, 3 * t * t * hd * g.group, [&](i64 task) {
    const Head h(g, task);
    Workspace& ws = workspace();
    const i64 rows_max = g.bq * g.group;
    float* s = static_cast<float*>(ws.scratch(7, std::size_t(rows_max * t) * 4));
    char* p = static_cast<char*>(ws.scratch(8, std::size_t(rows_max * t) * g.es));
    float* dp = static_cast<float*>(ws.scratch(9, std::size_t(rows_max * t) * 4));
    char* ds = static_cast<char*>(ws.scratch(10, std::size_t(rows_max * t) * g.es));
    const char* kh = kp + std::size_t(h.kv) * g.es;
    const char* vh = vp + std::size_t(h.kv) * g.es;
    float* dk = dkp + h.kv;
    float* dv = dvp + h.kv;
    const i64 last = (t - 1) / g.bq * g.bq;
    for (i64 t0 = last; t0 >= 0; t0 -= g.bq) {  // the last block first: it writes all of dK and dV
      const i64 tb = std::min(g.bq, t - t0), rows = tb * g.group, kn = t0 + tb;
      const bool acc = t0 != last;
      const i64 qoff = h.q + t0 * g.group * hd;
      const char* qb = qp + std::size_t(qoff) * g.es;
      const char* dob = dop + std::size_t(qoff) * g.es;
      ws.gemm({rows, kn, hd, false, true, bf16_gemm, false}, qb, kh, s);    // S = Q K^T
      ws.gemm({rows, kn, hd, false, true, bf16_gemm, false}, dob, vh, dp);  // dP = dO V^T
      for (i64 i = 0; i < rows; ++i) {
        const i64 ti = t0 + i / g.group;
        const float l = lse[h.lse_at(g, ti, i % g.group)];
        const float d = dsum[qoff / hd + i];
        void* prow = p + std::size_t(i * kn) * g.es;
        void* dsrow = ds + std::size_t(i * kn) * g.es;
        if (k)
          k->attn_bwd_row(s + i * kn, dp + i * kn, kn, ti + 1, sc, l, d, prow, dsrow, bf16_gemm);
        else
          bwd_row(s + i * kn, dp + i * kn, kn, ti + 1, sc, l, d, prow, dsrow, bf16_gemm);
      }
      ws.gemm({rows, hd, kn, false, false, bf16_gemm, false}, ds, kh, dqp + qoff);  // dQ = dS K
      ws.gemm({kn, hd, rows, true, false, bf16_gemm, acc}, ds, qb, dk);  // dK (+)= dS^T Q
      ws.gemm({kn, hd, rows, true, false, bf16_gemm, acc}, p, dob, dv);  // dV (+)= P^T dO
    }
  });
  unpack_q(g, dqp, dqkv, g.stride, nullptr, k);
  parallel_rows(b * t, 2 * nkv * hd, [&](i64 r) {
    const i64 bi = r / t, ti = r % t;
    float* row = dqkv + r * g.stride;
    pack(dkp + g.kv_at(bi, ti), g.kv_size(), row + nh * hd, false, hd, nkv, hd, k);
    pack(dvp + g.kv_at(bi, ti), g.kv_size(), row + (nh + nkv) * hd, false, hd, nkv, hd, k);
  });
}

}  // namespace strata::cpu
