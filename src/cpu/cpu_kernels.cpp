// Element-wise kernels work tile by tile: load a tile of each input as fp32, compute,
// store with round-to-nearest-even. The compiler vectorises the fp32 loops; bf16 conversions
// run the AVX-512 / AVX2 casts of model_simd.h where the CPU has them, which round exactly as
// the scalar routines of strata/dtype.h (used otherwise, and for fp16), so every backend
// rounds identically. Large arrays are split across OpenMP threads (element-wise work) or
// oneTBB workers (sum_squares).
#include "cpu/cpu_kernels.h"

#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>
#include <tbb/parallel_reduce.h>

#include <algorithm>
#include <map>
#include <oneapi/dnnl/dnnl.hpp>
#include <tuple>
#include <vector>

#include "cpu/gemm_path.h"
#include "cpu/model_simd.h"
#include "cpu/parallel_rows.h"
#include "strata/error.h"

namespace strata::cpu {

using i64 = std::int64_t;

namespace {

constexpr std::size_t kTile = 2048;
constexpr std::size_t kGrain = 64 * 1024;  // elements per parallel task
static_assert(kTile % 16 == 0 && kGrain % kTile == 0);

void load(DType t, const void* p, std::size_t off, std::size_t n, float* out) {
  switch (t) {
    case DType::kF32:
      std::copy_n(static_cast<const float*>(p) + off, n, out);
      return;
    case DType::kBF16: {
      const auto* s = static_cast<const std::uint16_t*>(p) + off;
      if (const simd::Kernels* k = simd::kernels()) return k->bf16_to_f32(s, out, std::int64_t(n));
      for (std::size_t i = 0; i < n; ++i) out[i] = bf16_to_f32(s[i]);
      return;
    }
    case DType::kF16: {
      const auto* s = static_cast<const std::uint16_t*>(p) + off;
      for (std::size_t i = 0; i < n; ++i) out[i] = f16_to_f32(s[i]);
      return;
    }
    case DType::kF64: {
      const auto* s = static_cast<const double*>(p) + off;
      for (std::size_t i = 0; i < n; ++i) out[i] = static_cast<float>(s[i]);
      return;
    }
  }
}

void store(DType t, void* p, std::size_t off, std::size_t n, const float* in) {
  switch (t) {
    case DType::kF32:
      std::copy_n(in, n, static_cast<float*>(p) + off);
      return;
    case DType::kBF16: {
      auto* d = static_cast<std::uint16_t*>(p) + off;
      if (const simd::Kernels* k = simd::kernels()) return k->f32_to_bf16(in, d, std::int64_t(n));
      for (std::size_t i = 0; i < n; ++i) d[i] = f32_to_bf16(in[i]);
      return;
    }
    case DType::kF16: {
      auto* d = static_cast<std::uint16_t*>(p) + off;
      for (std::size_t i = 0; i < n; ++i) d[i] = f32_to_f16(in[i]);
      return;
    }
    case DType::kF64: {
      auto* d = static_cast<double*>(p) + off;
      for (std::size_t i = 0; i < n; ++i) d[i] = in[i];
      return;
    }
  }
}

// Runs body(offset, count) over [0, n) in tiles, in parallel for large n. On OpenMP, oneDNN's
// runtime (parallel_rows): these kernels sit between matmuls, and a second runtime's workers
// would spin on the cores the matmul's team wants (and the other way round).
template <class Body>
void for_tiles(std::size_t n, Body body) {
  auto range = [&](std::size_t lo, std::size_t hi) {
    for (std::size_t off = lo; off < hi; off += kTile) body(off, std::min(kTile, hi - off));
  };
  if (n <= kGrain) {
    range(0, n);
    return;
  }
  parallel_rows(static_cast<i64>((n + kGrain - 1) / kGrain), i64(kGrain), [&](i64 g) {
    range(std::size_t(g) * kGrain, std::min(n, std::size_t(g + 1) * kGrain));
  });
}

}  // namespace

void fill(DType t, void* x, std::size_t n, float value) {
  for_tiles(n, [&](std::size_t off, std::size_t cnt) {
    float tile[kTile];
    std::fill_n(tile, cnt, value);
    store(t, x, off, cnt, tile);
  });
}

void axpy(float alpha, DType tx, const void* x, DType ty, void* y, std::size_t n) {
  for_tiles(n, [&](std::size_t off, std::size_t cnt) {
    float a[kTile], b[kTile];
    load(tx, x, off, cnt, a);
    load(ty, y, off, cnt, b);
    for (std::size_t i = 0; i < cnt; ++i) b[i] += alpha * a[i];
    store(ty, y, off, cnt, b);
  });
}

void scale(float alpha, DType t, void* x, std::size_t n) {
  for_tiles(n, [&](std::size_t off, std::size_t cnt) {
    float a[kTile];
    load(t, x, off, cnt, a);
    for (std::size_t i = 0; i < cnt; ++i) a[i] *= alpha;
    store(t, x, off, cnt, a);
  });
}

void add(DType ta, const void* a, DType tb, const void* b, DType to, void* out, std::size_t n) {
  for_tiles(n, [&](std::size_t off, std::size_t cnt) {
    float x[kTile], y[kTile];
    load(ta, a, off, cnt, x);
    load(tb, b, off, cnt, y);
    for (std::size_t i = 0; i < cnt; ++i) x[i] += y[i];
    store(to, out, off, cnt, x);
  });
}

void cast(DType ts, const void* src, DType td, void* dst, std::size_t n) {
  // fp32 <-> bf16 straight from source to destination, without the fp32 tile in between.
  if (const simd::Kernels* k = simd::kernels(); k && ts == DType::kF32 && td == DType::kBF16) {
    for_tiles(n, [&](std::size_t off, std::size_t cnt) {
      k->f32_to_bf16(static_cast<const float*>(src) + off, static_cast<std::uint16_t*>(dst) + off,
                     std::int64_t(cnt));
    });
    return;
  }
  if (const simd::Kernels* k = simd::kernels(); k && ts == DType::kBF16 && td == DType::kF32) {
    for_tiles(n, [&](std::size_t off, std::size_t cnt) {
      k->bf16_to_f32(static_cast<const std::uint16_t*>(src) + off, static_cast<float*>(dst) + off,
                     std::int64_t(cnt));
    });
    return;
  }
  for_tiles(n, [&](std::size_t off, std::size_t cnt) {
    float x[kTile];
    load(ts, src, off, cnt, x);
    store(td, dst, off, cnt, x);
  });
}

// Sum of squares of a run of fp32 values: 16 fp64 accumulators, element i of the run going to
// accumulator i % 16, combined pairwise at the end. The squares are exact in fp64, so the
// order is the only thing that decides the bits, and it is fixed here whatever the compiler
// makes of the loop (16 independent chains vectorise; one chain would be bound by the
// latency of an fp64 add: 0.66 ms per million elements here, against 0.27 for this loop at
// the baseline ISA and 0.16 for model_simd's AVX2 / AVX-512 build of it).
constexpr std::size_t kSumLanes = 16;
void accumulate_squares(const float* a, std::size_t n, double* acc) {
  if (const simd::Kernels* k = simd::kernels()) return k->sum_squares_16(a, std::int64_t(n), acc);
  std::size_t i = 0;
  for (; i + kSumLanes <= n; i += kSumLanes)
    for (std::size_t j = 0; j < kSumLanes; ++j) acc[j] += double(a[i + j]) * double(a[i + j]);
  for (std::size_t j = 0; i < n; ++i, ++j) acc[j] += double(a[i]) * double(a[i]);
}
double combine_lanes(double* acc) {
  for (std::size_t w = kSumLanes / 2; w > 0; w /= 2)
    for (std::size_t j = 0; j < w; ++j) acc[j] += acc[j + w];
  return acc[0];
}

float sum_squares(DType t, const void* x, std::size_t n) {
  auto chunk_sum = [&](std::size_t lo, std::size_t hi) {
    double acc[kSumLanes] = {};
    if (t == DType::kF32) {
      accumulate_squares(static_cast<const float*>(x) + lo, hi - lo, acc);
    } else {
      float a[kTile];  // kTile is a multiple of kSumLanes: tiles keep each element's lane
      for (std::size_t off = lo; off < hi; off += kTile) {
        const std::size_t cnt = std::min(kTile, hi - off);
        load(t, x, off, cnt, a);
        accumulate_squares(a, cnt, acc);
      }
    }
    return combine_lanes(acc);
  };
  if (n <= kGrain) return static_cast<float>(chunk_sum(0, n));
  // Deterministic: fixed chunks summed in a fixed order.
  const std::size_t chunks = (n + kGrain - 1) / kGrain;
  std::vector<double> partial(chunks);
  tbb::parallel_for(std::size_t(0), chunks, [&](std::size_t c) {
    partial[c] = chunk_sum(c * kGrain, std::min(n, (c + 1) * kGrain));
  });
  double s = 0;
  for (double p : partial) s += p;
  return static_cast<float>(s);
}

void SumSquares::add(const float* x, std::size_t n) {
  static_assert(std::size(SumSquares{}.acc_) == kSumLanes);
  while (n > 0) {
    // A run that ends off a multiple of the lanes continues at the lane after its last value
    // (accumulate_squares starts each call at lane 0): fill up to the boundary one at a time.
    const std::size_t lane = in_chunk_ % kSumLanes;
    if (lane != 0) {
      const std::size_t k = std::min(n, kSumLanes - lane);
      for (std::size_t j = 0; j < k; ++j) acc_[lane + j] += double(x[j]) * double(x[j]);
      x += k;
      n -= k;
      in_chunk_ += k;
    } else {
      const std::size_t k = std::min(n, kGrain - in_chunk_);
      accumulate_squares(x, k, acc_);
      x += k;
      n -= k;
      in_chunk_ += k;
    }
    if (in_chunk_ == kGrain) {  // a whole chunk: its lanes combined, added in order
      total_ += combine_lanes(acc_);
      std::fill(std::begin(acc_), std::end(acc_), 0.0);
      in_chunk_ = 0;
      ++chunks_;
    }
  }
}

float SumSquares::result() const {
  if (in_chunk_ == 0) return static_cast<float>(total_);
  double acc[kSumLanes];
  std::copy(std::begin(acc_), std::end(acc_), acc);
  const double last = combine_lanes(acc);
  // sum_squares of at most one chunk returns that chunk's sum as is (0 + x is x anyway).
  return static_cast<float>(chunks_ == 0 ? last : total_ + last);
}

// ---- matmul ----
// Primitives are kept by shape (a training step issues the same few shapes again and again),
// so a call costs only binding the three pointers; the cache is per Matmul, i.e. per stream
// worker, like the oneDNN stream.
//
// Operands whose dtype oneDNN has no matmul for here (gemm_path.h) are widened to fp32, and a
// bf16 output of an fp32 GEMM is accumulated in fp32 and rounded once: both in blocks of C
// (rows x columns, each over the whole of k) whose widened operands and accumulator fit
// `stage_bytes`, so a weight of any size is widened a block at a time. The blocks follow from
// the shape alone: the same call gives the same bits.
struct Matmul::Impl {
  // m, n, k, trans_a, trans_b, lda, ldb, ldc, input dtype, output dtype, alpha, beta
  using Key = std::tuple<i64, i64, i64, bool, bool, i64, i64, i64, int, int, float, float>;
  struct Prim {
    dnnl::matmul prim;
    dnnl::memory a, b, c;
  };
  std::size_t stage_bytes;
  dnnl::engine engine{dnnl::engine::kind::cpu, 0};
  dnnl::stream stream{engine};
  std::map<Key, Prim> prims;
  std::vector<float> stage;  // widened blocks and the fp32 accumulator; at most stage_bytes

  // C[m, n] (ldc apart) = alpha * op(A) op(B) + beta * C, A and B of `in` with leading
  // dimensions lda and ldb as stored.
  void gemm(i64 m, i64 n, i64 k, bool ta, bool tb, i64 lda, i64 ldb, i64 ldc, DType in, DType out,
            float alpha, float beta, const void* a, const void* b, void* c);
};

Matmul::Matmul(std::size_t stage_bytes) : impl_(std::make_unique<Impl>()) {
  gemm_route(DType::kF32);  // oneDNN's ISA cap and the routes, before this Matmul's first primitive
  impl_->stage_bytes = stage_bytes;
}
Matmul::~Matmul() = default;

static dnnl::memory::data_type dnnl_type(DType t) {
  switch (t) {
    case DType::kF32:
      return dnnl::memory::data_type::f32;
    case DType::kBF16:
      return dnnl::memory::data_type::bf16;
    case DType::kF16:
      return dnnl::memory::data_type::f16;
    case DType::kF64:
      break;
  }
  STRATA_THROW(kUnsupported, "matmul: {} has no oneDNN type", dtype_name(t));
}

void Matmul::Impl::gemm(i64 m, i64 n, i64 k, bool ta, bool tb, i64 lda, i64 ldb, i64 ldc, DType in,
                        DType out, float alpha, float beta, const void* a, const void* b, void* c) {
  using dims = dnnl::memory::dims;
  try {
    const Key key{m, n, k, ta, tb, lda, ldb, ldc, int(in), int(out), alpha, beta};
    auto it = prims.find(key);
    if (it == prims.end()) {
      const dnnl::memory::desc a_md({m, k}, dnnl_type(in), ta ? dims{1, lda} : dims{lda, 1});
      const dnnl::memory::desc b_md({k, n}, dnnl_type(in), tb ? dims{1, ldb} : dims{ldb, 1});
      const dnnl::memory::desc c_md({m, n}, dnnl_type(out), dims{ldc, 1});
      dnnl::primitive_attr attr;
      if (alpha != 1.0f) attr.set_output_scales(0, {alpha});
      if (beta != 0.0f) {
        dnnl::post_ops po;
        po.append_sum(beta);
        attr.set_post_ops(po);
      }
      const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(a_md, b_md, c_md), attr, engine);
      if (prims.size() >= 512) prims.clear();  // a caller cycling through many shapes
      it = prims
               .emplace(key, Prim{dnnl::matmul(pd), dnnl::memory(a_md, engine, nullptr),
                                  dnnl::memory(b_md, engine, nullptr),
                                  dnnl::memory(c_md, engine, nullptr)})
               .first;
    }
    Prim& p = it->second;
    p.a.set_data_handle(const_cast<void*>(a));
    p.b.set_data_handle(const_cast<void*>(b));
    p.c.set_data_handle(c);
    p.prim.execute(stream, {{DNNL_ARG_SRC, p.a}, {DNNL_ARG_WEIGHTS, p.b}, {DNNL_ARG_DST, p.c}});
    stream.wait();
  } catch (const dnnl::error& e) {
    STRATA_THROW(kInternal, "oneDNN matmul {}x{}x{} ({} -> {}) failed: {} (status {})", m, n, k,
                 dtype_name(in), dtype_name(out), e.what(), static_cast<int>(e.status));
  }
}

namespace {

const void* at(const void* p, DType t, i64 elems) {
  return static_cast<const char*>(p) + std::size_t(elems) * dtype_size(t);
}
void* at(void* p, DType t, i64 elems) {
  return static_cast<char*>(p) + std::size_t(elems) * dtype_size(t);
}

// rows x cols of `src` (rows ld apart, from element `off`) -> dense fp32 at dst.
void widen_block(DType t, const void* src, i64 off, i64 ld, i64 rows, i64 cols, float* dst) {
  if (ld == cols) return cast(t, at(src, t, off), DType::kF32, dst, std::size_t(rows * cols));
  for (i64 r = 0; r < rows; ++r)
    cast(t, at(src, t, off + r * ld), DType::kF32, dst + r * cols, std::size_t(cols));
}

}  // namespace

MatmulBlocks matmul_blocks(i64 m, i64 n, i64 k, bool widen, bool stage_c, std::size_t stage_bytes) {
  const auto need = [&](i64 mb, i64 nb) {
    return std::size_t((widen ? mb * k + k * nb : 0) + (stage_c ? mb * nb : 0)) * 4;
  };
  MatmulBlocks blk{m, n};
  while (need(blk.rows, blk.cols) > stage_bytes && (blk.rows > 1 || blk.cols > 1)) {
    i64& side = blk.cols >= blk.rows ? blk.cols : blk.rows;  // halve the longer side
    side = (side + 1) / 2;
  }
  return blk;
}

void Matmul::run(const MatmulDesc& d) {
  const i64 m = d.m, n = d.n, k = d.k;
  const DType in = d.a.dtype, out = d.c.dtype;
  const bool widen = gemm_route(in) == GemmRoute::kWidened;
  const DType gemm_in = widen ? DType::kF32 : in;
  // oneDNN has no fp32 x fp32 -> bf16 matmul: accumulate into fp32, then round once.
  const bool stage_c = gemm_in == DType::kF32 && out == DType::kBF16;
  const i64 lda = d.trans_a ? m : k, ldb = d.trans_b ? k : n;
  if (!widen && !stage_c)
    return impl_->gemm(m, n, k, d.trans_a, d.trans_b, lda, ldb, n, in, out, d.alpha, d.beta,
                       d.a.mem.ptr, d.b.mem.ptr, d.c.mem.ptr);

  const MatmulBlocks blk = matmul_blocks(m, n, k, widen, stage_c, impl_->stage_bytes);
  const i64 a_elems = widen ? blk.rows * k : 0, b_elems = widen ? k * blk.cols : 0;
  impl_->stage.resize(std::size_t(a_elems + b_elems + (stage_c ? blk.rows * blk.cols : 0)));
  float* wa = impl_->stage.data();
  float* wb = wa + a_elems;
  float* c32 = wb + b_elems;
  for (i64 j0 = 0; j0 < n; j0 += blk.cols) {
    const i64 nb = std::min(blk.cols, n - j0);
    // B's columns [j0, j0 + nb): stored [k, n] (or [n, k] transposed), widened as [k, nb] ([nb,
    // k]).
    const void* b = at(d.b.mem.ptr, in, d.trans_b ? j0 * k : j0);
    i64 ldb_blk = ldb;
    if (widen) {
      if (d.trans_b)
        widen_block(in, d.b.mem.ptr, j0 * k, k, nb, k, wb);
      else
        widen_block(in, d.b.mem.ptr, j0, n, k, nb, wb);
      b = wb;
      ldb_blk = d.trans_b ? k : nb;
    }
    for (i64 i0 = 0; i0 < m; i0 += blk.rows) {
      const i64 mb = std::min(blk.rows, m - i0);
      // A's rows [i0, i0 + mb): stored [m, k] (or [k, m] transposed); once when one block holds
      // them all.
      const void* a = at(d.a.mem.ptr, in, d.trans_a ? i0 : i0 * k);
      i64 lda_blk = lda;
      if (widen) {
        if (j0 == 0 || blk.rows < m) {
          if (d.trans_a)
            widen_block(in, d.a.mem.ptr, i0, m, k, mb, wa);
          else
            widen_block(in, d.a.mem.ptr, i0 * k, k, mb, k, wa);
        }
        a = wa;
        lda_blk = d.trans_a ? mb : k;
      }
      void* c = at(d.c.mem.ptr, out, i0 * n + j0);
      if (!stage_c) {
        impl_->gemm(mb, nb, k, d.trans_a, d.trans_b, lda_blk, ldb_blk, n, gemm_in, out, d.alpha,
                    d.beta, a, b, c);
        continue;
      }
      if (d.beta != 0.0f) widen_block(out, d.c.mem.ptr, i0 * n + j0, n, mb, nb, c32);
      impl_->gemm(mb, nb, k, d.trans_a, d.trans_b, lda_blk, ldb_blk, nb, gemm_in, DType::kF32,
                  d.alpha, d.beta, a, b, c32);
      for (i64 r = 0; r < mb; ++r)
        cast(DType::kF32, c32 + r * nb, out, at(d.c.mem.ptr, out, (i0 + r) * n + j0),
             std::size_t(nb));
    }
  }
}

}  // namespace strata::cpu
