// The per-dtype GEMM routes and oneDNN's ISA cap (see gemm_path.h).
#include "cpu/gemm_path.h"

#include <atomic>
#include <cstdlib>
#include <oneapi/dnnl/dnnl.hpp>

#include "strata/adamw.h"
#include "strata/error.h"
#include "strata/log.h"

namespace strata::cpu {
namespace {

// STRATA_CPU_ISA at avx2 or scalar caps oneDNN too, unless the user capped oneDNN themselves.
// oneDNN takes a cap only before its first use of the ISA, hence here, before any primitive.
void cap_onednn() {
  const Isa cap = cpu_isa_cap();
  if (cap != Isa::kAvx2 && cap != Isa::kScalar) return;
  for (const char* own : {"ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"})
    if (const char* v = std::getenv(own); v != nullptr && *v != '\0') return;
  try {
    dnnl::set_max_cpu_isa(cap == Isa::kAvx2 ? dnnl::cpu_isa::avx2 : dnnl::cpu_isa::sse41);
  } catch (const dnnl::error& e) {
    log::warn(
        "STRATA_CPU_ISA={} could not cap oneDNN ({}): its GEMMs run at {}; set ONEDNN_MAX_CPU_ISA "
        "too",
        isa_name(cap), e.what(), onednn_isa());
  }
}

// oneDNN's implementation of an `in` x `in` -> fp32 matmul of a mid-sized shape, or "" when it
// has none. Asked of the primitive descriptor only: nothing runs.
std::string probe(DType in) {
  using dt = dnnl::memory::data_type;
  const dt t = in == DType::kBF16 ? dt::bf16 : in == DType::kF16 ? dt::f16 : dt::f32;
  const dnnl::memory::dim n = 256;
  try {
    const dnnl::engine engine(dnnl::engine::kind::cpu, 0);
    const dnnl::memory::desc a({n, n}, t, dnnl::memory::dims{n, 1});
    const dnnl::memory::desc c({n, n}, dt::f32, dnnl::memory::dims{n, 1});
    const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(a, a, c), engine);
    return pd.impl_info_str();
  } catch (const dnnl::error&) {
    return {};
  }
}

struct State {
  std::string impl[3];              // fp32, bf16, fp16: "" where oneDNN has no native matmul
  std::atomic<GemmRoute> route[3];  // what runs now
  State() {
    cap_onednn();
    const DType ts[3] = {DType::kF32, DType::kBF16, DType::kF16};
    for (int i = 0; i < 3; ++i) {
      impl[i] = probe(ts[i]);
      route[i] = impl[i].empty() ? GemmRoute::kWidened : GemmRoute::kNative;
    }
    STRATA_CHECK(!impl[0].empty(), "oneDNN has no fp32 matmul on this CPU (isa {})", onednn_isa());
  }
};

State& state() {
  static State s;
  return s;
}

int slot(DType in) {
  switch (in) {
    case DType::kF32:
      return 0;
    case DType::kBF16:
      return 1;
    case DType::kF16:
      return 2;
    case DType::kF64:
      break;
  }
  STRATA_THROW(kUnsupported, "matmul: {} operands have no GEMM route; use fp32, bf16 or fp16",
               dtype_name(in));
}

}  // namespace

const char* gemm_route_name(GemmRoute r) {
  return r == GemmRoute::kNative ? "oneDNN native" : "widened to fp32";
}

GemmRoute gemm_route(DType in) { return state().route[slot(in)].load(std::memory_order_relaxed); }

bool gemm_native_available(DType in) { return !state().impl[slot(in)].empty(); }

std::vector<GemmPath> gemm_paths() {
  State& s = state();
  std::vector<GemmPath> out;
  for (DType t : {DType::kF32, DType::kBF16, DType::kF16}) {
    const GemmRoute r = s.route[slot(t)].load();
    out.push_back({t, r, r == GemmRoute::kNative ? s.impl[slot(t)] : s.impl[slot(DType::kF32)]});
  }
  return out;
}

void set_gemm_route(DType in, GemmRoute route) {
  State& s = state();
  const int i = slot(in);
  if (route == GemmRoute::kNative && s.impl[i].empty())
    STRATA_THROW(kUnsupported, "set_gemm_route: oneDNN has no {} matmul on this CPU (isa {})",
                 dtype_name(in), onednn_isa());
  if (route == GemmRoute::kWidened && in == DType::kF32)
    STRATA_THROW(kInvalidArgument, "set_gemm_route: fp32 operands are not widened");
  s.route[i] = route;
}

std::string onednn_isa() {
  switch (dnnl::get_effective_cpu_isa()) {
    case dnnl::cpu_isa::sse41:
      return "sse41";
    case dnnl::cpu_isa::avx:
      return "avx";
    case dnnl::cpu_isa::avx2:
      return "avx2";
    case dnnl::cpu_isa::avx2_vnni:
      return "avx2_vnni";
    case dnnl::cpu_isa::avx512_mic:
      return "avx512_mic";
    case dnnl::cpu_isa::avx512_mic_4ops:
      return "avx512_mic_4ops";
    case dnnl::cpu_isa::avx512_core:
      return "avx512_core";
    case dnnl::cpu_isa::avx512_core_vnni:
      return "avx512_core_vnni";
    case dnnl::cpu_isa::avx512_core_bf16:
      return "avx512_core_bf16";
    case dnnl::cpu_isa::avx512_core_amx:
      return "avx512_core_amx";
    default:
      return "other";
  }
}

}  // namespace strata::cpu
