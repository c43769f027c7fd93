// The scalar AdamW path: one element at a time, compiled for the baseline x86-64 ISA. It is
// the fallback on CPUs without AVX2, the reference the SIMD paths must equal bit for bit,
// and the "plain scalar loop" strata-bench compares against.
#include "cpu/adamw_kernels.h"

namespace strata::cpu::adamw {
namespace {

template <bool G, bool S, CopyKind C>
struct ScalarImpl {
  static std::size_t run(const detail::AdamWScalars& k, const Arrays& a, std::size_t lo,
                         std::size_t hi) {
    return update_scalar<G, S, C>(k, a, lo, hi);
  }
};

std::size_t update(const detail::AdamWScalars& k, const Arrays& a, std::size_t lo, std::size_t hi) {
  return pick<ScalarImpl>(a)(k, a, lo, hi);
}

}  // namespace

Kernels scalar_kernels() { return {&update, &count_scalar}; }

}  // namespace strata::cpu::adamw
