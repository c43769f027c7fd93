// The DeepSpeed-style loop in 16 lanes (AVX-512F): compiled with -mavx512f -mfma, called only
// where strata's AVX-512 kernels may run.
#include <immintrin.h>

#include "adam_ds_style_simd.h"

STRATA_DS_STYLE_ISA(ds_style_adamw_avx512, __m512, 16, _mm512)
