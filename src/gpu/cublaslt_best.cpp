// The best cuBLASLt algorithm for one GEMM: the reference strata-bench gpu holds
// Stream::matmul against (cuda_module.h, CudaModule::best_cublaslt_gemm).
//
// The GEMM is exactly Stream::matmul's (row-major C = alpha op(A) op(B) + beta C, computed as
// the column-major C^T = op(B)^T op(A)^T, fp32 compute), so the two differ only in the
// algorithm: cublasGemmEx's default choice against each of cuBLASLt's heuristic candidates
// (with a 64 MiB workspace), each timed with CUDA events over `iters` calls after one warm-up
// call; the fastest is returned. Blocks until the timing is done. The calling thread's current
// CUDA device must be the stream's (cuda:0 in a process that uses one GPU).
#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <vector>

#include "gpu/cuda_check.h"
#include "gpu/cuda_module.h"

namespace strata::gpu::backend {
namespace {

// Destroys the cuBLASLt and CUDA objects of one timing, whatever happens.
struct LtObjects {
  cublasLtHandle_t lt = nullptr;
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  cudaEvent_t t0 = nullptr, t1 = nullptr;
  ~LtObjects() {
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    if (c) cublasLtMatrixLayoutDestroy(c);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (op) cublasLtMatmulDescDestroy(op);
    if (lt) cublasLtDestroy(lt);
    if (t0) cudaEventDestroy(t0);
    if (t1) cudaEventDestroy(t1);
  }
};

}  // namespace

GemmBest best_cublaslt_gemm(Stream& stream, const MatmulDesc& d, int max_candidates, int iters) {
  STRATA_REQUIRE(stream.device().kind() == DeviceKind::kCuda && stream.native_handle() != nullptr,
                 "best_cublaslt_gemm needs a CUDA stream, got one of {}", stream.device().name());
  STRATA_REQUIRE(max_candidates > 0 && iters > 0,
                 "best_cublaslt_gemm: max_candidates and iters must be > 0");
  STRATA_REQUIRE(d.m > 0 && d.n > 0 && d.k > 0 && d.a.dtype == d.b.dtype,
                 "best_cublaslt_gemm: sizes must be > 0 and A, B of one dtype");
  stream.synchronize();  // the operands are written
  auto s = static_cast<cudaStream_t>(stream.native_handle());
  const std::size_t ws_bytes = std::size_t(64) << 20;
  Buffer ws = stream.device().alloc(ws_bytes, &stream);

  LtObjects o;
  const cublasOperation_t op_b = d.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;  // cuBLASLt's A
  const cublasOperation_t op_a = d.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;  // cuBLASLt's B
  const cudaDataType_t ab = gpu::detail::cuda_data_type(d.a.dtype),
                       ct = gpu::detail::cuda_data_type(d.c.dtype);
  STRATA_CUBLAS_CHECK(cublasLtCreate(&o.lt));
  STRATA_CUBLAS_CHECK(cublasLtMatmulDescCreate(&o.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  STRATA_CUBLAS_CHECK(
      cublasLtMatmulDescSetAttribute(o.op, CUBLASLT_MATMUL_DESC_TRANSA, &op_b, sizeof op_b));
  STRATA_CUBLAS_CHECK(
      cublasLtMatmulDescSetAttribute(o.op, CUBLASLT_MATMUL_DESC_TRANSB, &op_a, sizeof op_a));
  // Stored (column-major) shapes: B is [n,k] (N) or [k,n] (T); A is [k,m] (N) or [m,k] (T).
  const auto n = std::uint64_t(d.n), m = std::uint64_t(d.m), k = std::uint64_t(d.k);
  STRATA_CUBLAS_CHECK(d.trans_b ? cublasLtMatrixLayoutCreate(&o.a, ab, k, n, std::int64_t(k))
                                : cublasLtMatrixLayoutCreate(&o.a, ab, n, k, std::int64_t(n)));
  STRATA_CUBLAS_CHECK(d.trans_a ? cublasLtMatrixLayoutCreate(&o.b, ab, m, k, std::int64_t(m))
                                : cublasLtMatrixLayoutCreate(&o.b, ab, k, m, std::int64_t(k)));
  STRATA_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&o.c, ct, n, m, std::int64_t(n)));
  STRATA_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&o.pref));
  STRATA_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
      o.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes, sizeof ws_bytes));
  std::vector<cublasLtMatmulHeuristicResult_t> found(static_cast<std::size_t>(max_candidates));
  int returned = 0;
  STRATA_CUBLAS_CHECK(cublasLtMatmulAlgoGetHeuristic(o.lt, o.op, o.a, o.b, o.c, o.c, o.pref,
                                                     max_candidates, found.data(), &returned));
  STRATA_CUDA_CHECK(cudaEventCreate(&o.t0));
  STRATA_CUDA_CHECK(cudaEventCreate(&o.t1));

  GemmBest best;
  auto call = [&](const cublasLtMatmulHeuristicResult_t& r) {
    return cublasLtMatmul(o.lt, o.op, &d.alpha, d.b.mem.ptr, o.a, d.a.mem.ptr, o.b, &d.beta,
                          d.c.mem.ptr, o.c, d.c.mem.ptr, o.c, &r.algo, ws.data(), ws_bytes, s);
  };
  for (int i = 0; i < returned; ++i) {
    const cublasLtMatmulHeuristicResult_t& r = found[std::size_t(i)];
    if (r.state != CUBLAS_STATUS_SUCCESS || r.workspaceSize > ws_bytes) continue;
    if (call(r) != CUBLAS_STATUS_SUCCESS) continue;  // a candidate that cannot run is skipped
    STRATA_CUDA_CHECK(cudaEventRecord(o.t0, s));
    bool ok = true;
    for (int it = 0; it < iters && ok; ++it) ok = call(r) == CUBLAS_STATUS_SUCCESS;
    STRATA_CUDA_CHECK(cudaEventRecord(o.t1, s));
    STRATA_CUDA_CHECK(cudaEventSynchronize(o.t1));
    if (!ok) continue;
    float ms = 0;
    STRATA_CUDA_CHECK(cudaEventElapsedTime(&ms, o.t0, o.t1));
    ++best.candidates;
    const double sec = double(ms) * 1e-3 / iters;
    if (best.seconds == 0 || sec < best.seconds) {
      best.seconds = sec;
      best.candidate = i;
      best.workspace_bytes = r.workspaceSize;
    }
  }
  stream.synchronize();
  STRATA_CHECK(best.candidates > 0,
               "cuBLASLt offered no runnable algorithm for {}x{}x{} ({} of {} candidates)", d.m,
               d.n, d.k, returned, max_candidates);
  return best;
}

}  // namespace strata::gpu::backend
