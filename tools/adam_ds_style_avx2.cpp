// The DeepSpeed-style loop in 8 lanes (AVX2 + FMA): compiled with -mavx2 -mfma, called only
// where strata's AVX2 kernels may run.
#include <immintrin.h>

#include "adam_ds_style_simd.h"

STRATA_DS_STYLE_ISA(ds_style_adamw_avx2, __m256, 8, _mm256)
