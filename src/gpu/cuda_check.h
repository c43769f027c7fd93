// Checks for every CUDA runtime and cuBLAS call of the CUDA backend (host C++ only; the
// .cu file returns cudaError_t from its launchers and the caller checks them here).
//
// A failed check throws strata::Error (ErrorKind::kCuda) carrying the error's name and text,
// the failing call and file:line. It also clears CUDA's per-thread "last error" first, so a
// caller that catches the exception does not see the same failure again at its next check
// (as c10's C10_CUDA_CHECK does). Sticky errors (a kernel fault) cannot be cleared: every
// later call fails too, and each says so.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <string>

#include "strata/dtype.h"
#include "strata/error.h"

namespace strata::gpu::detail {

// The stream's GPU made the calling thread's current device: a kernel launched into a stream of
// another device than the current one fails ("not associated to the current device"), and a
// function attribute set (cudaFuncSetAttribute) applies to the current device only.
inline void use_device_of(void* stream) {
  int device = 0, current = 0;
  if (cudaStreamGetDevice(static_cast<cudaStream_t>(stream), &device) != cudaSuccess ||
      cudaGetDevice(&current) != cudaSuccess) {
    (void)cudaGetLastError();
    return;  // the launch itself reports what is wrong
  }
  if (current != device) (void)cudaSetDevice(device);
}

// The cuBLAS / cuBLASLt data type of a strata dtype (fp64 has none here: kUnsupported).
inline cudaDataType_t cuda_data_type(DType t) {
  switch (t) {
    case DType::kF32:
      return CUDA_R_32F;
    case DType::kBF16:
      return CUDA_R_16BF;
    case DType::kF16:
      return CUDA_R_16F;
    case DType::kF64:
      break;
  }
  STRATA_THROW(kUnsupported, "no CUDA matmul type for {}", dtype_name(t));
}

[[noreturn]] inline void throw_cuda(cudaError_t err, const char* call, const char* file, int line,
                                    std::string message = "CUDA call failed") {
  (void)cudaGetLastError();
  ::strata::detail::throw_error(ErrorKind::kCuda, file, line, call, std::move(message),
                                fmt::format("{}: {} (error {})", cudaGetErrorName(err),
                                            cudaGetErrorString(err), static_cast<int>(err)));
}

[[noreturn]] inline void throw_cublas(cublasStatus_t st, const char* call, const char* file,
                                      int line) {
  (void)cudaGetLastError();
  ::strata::detail::throw_error(ErrorKind::kCuda, file, line, call, "cuBLAS call failed",
                                fmt::format("{}: {} (status {})", cublasGetStatusName(st),
                                            cublasGetStatusString(st), static_cast<int>(st)));
}

}  // namespace strata::gpu::detail

// Throws strata::Error (kCuda) unless `expr` returns cudaSuccess.
#define STRATA_CUDA_CHECK(expr)                                                       \
  do {                                                                                \
    const cudaError_t strata_cuda_err_ = (expr);                                      \
    if (strata_cuda_err_ != cudaSuccess) [[unlikely]]                                 \
      ::strata::gpu::detail::throw_cuda(strata_cuda_err_, #expr, __FILE__, __LINE__); \
  } while (0)

// Throws strata::Error (kCuda) unless `expr` returns CUBLAS_STATUS_SUCCESS.
#define STRATA_CUBLAS_CHECK(expr)                                                        \
  do {                                                                                   \
    const cublasStatus_t strata_cublas_st_ = (expr);                                     \
    if (strata_cublas_st_ != CUBLAS_STATUS_SUCCESS) [[unlikely]]                         \
      ::strata::gpu::detail::throw_cublas(strata_cublas_st_, #expr, __FILE__, __LINE__); \
  } while (0)
