// CPU kernels behind HostDevice: element-wise ops over fp32/bf16/fp16 (computed in fp32)
// and matmul through oneDNN. They take raw pointers; HostDevice has validated sizes.
#pragma once

#include <cstddef>
#include <memory>

#include "strata/device.h"
#include "strata/dtype.h"
#include "strata/kernels.h"

namespace strata::cpu {

void fill(DType t, void* x, std::size_t n, float value);
void axpy(float alpha, DType tx, const void* x, DType ty, void* y, std::size_t n);
void scale(float alpha, DType t, void* x, std::size_t n);
void add(DType ta, const void* a, DType tb, const void* b, DType to, void* out, std::size_t n);
void cast(DType ts, const void* src, DType td, void* dst, std::size_t n);
// sum_squares (strata/kernels.h) of fp32 values that arrive in runs, in order (a gradient
// written to NVMe a piece at a time): bit for bit sum_squares over their concatenation, for runs
// of any length (the same chunks, lanes and order of additions; serial, where sum_squares splits
// large inputs across threads).
class SumSquares {
 public:
  void add(const float* x, std::size_t n);
  float result() const;

 private:
  double acc_[16] = {};       // the current chunk's lanes
  double total_ = 0;          // the whole chunks so far
  std::size_t in_chunk_ = 0;  // values of the current chunk added
  std::size_t chunks_ = 0;    // whole chunks in total_
};

// oneDNN matmul, one per thread that runs kernels (oneDNN streams are not thread-safe). Operands
// oneDNN has no matmul for on this host are widened to fp32 a block of C at a time (the route:
// cpu/gemm_path.h), with at most `stage_bytes` of scratch (more only where one row and one column
// of k exceed it); fp32 accumulation and one rounding of a bf16 output on every route.
class Matmul {
 public:
  static constexpr std::size_t kStageBytes = std::size_t(32) << 20;
  explicit Matmul(std::size_t stage_bytes = kStageBytes);
  ~Matmul();
  void run(const MatmulDesc& d);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// The blocks of C a widened or fp32-accumulated matmul runs in: the longer side halved until the
// widened rows of A, columns of B and the block's fp32 accumulator fit stage_bytes.
struct MatmulBlocks {
  std::int64_t rows, cols;
};
MatmulBlocks matmul_blocks(std::int64_t m, std::int64_t n, std::int64_t k, bool widen, bool stage_c,
                           std::size_t stage_bytes);

}  // namespace strata::cpu
