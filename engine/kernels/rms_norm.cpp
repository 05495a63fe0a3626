// y = x / sqrt(mean(x^2) + eps) * scale over the last dim of decode-sized rows: AVX2 + FMA, float32.
//
// The torch path is ~8 ops per norm (pow, sum, div_ with its scalar conversion, add, rsqrt, two
// muls) on tensors of a few KB, ~75 norms per SmolLM-size decode step: per-op dispatch, not
// arithmetic, was its cost (bench/forward.py profile at batch 8: ~1/3 of the step's time
// outside its GEMMs). Here each row is read twice (sum of squares, then the scaled write).
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "avx2_math.h"

namespace {

void norm_row(const float* x, const float* scale, float* y, int64_t dim, float eps) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= dim; i += 16) {
        const __m256 a = _mm256_loadu_ps(x + i), b = _mm256_loadu_ps(x + i + 8);
        acc0 = _mm256_fmadd_ps(a, a, acc0);
        acc1 = _mm256_fmadd_ps(b, b, acc1);
    }
    for (; i + 8 <= dim; i += 8) {
        const __m256 a = _mm256_loadu_ps(x + i);
        acc0 = _mm256_fmadd_ps(a, a, acc0);
    }
    float sum = avx2::hsum(_mm256_add_ps(acc0, acc1));
    for (; i < dim; ++i) sum += x[i] * x[i];
    const float inv = 1.0f / sqrtf(sum / (float)dim + eps);
    const __m256 inv_v = _mm256_set1_ps(inv);
    i = 0;
    for (; i + 8 <= dim; i += 8)
        _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), inv_v), _mm256_loadu_ps(scale + i)));
    for (; i < dim; ++i) y[i] = x[i] * inv * scale[i];
}

}  // namespace

// x: [outer, inner, dim] with strides (ld_outer, ld_inner, 1); scale: [dim]; y: [outer, inner, dim] contiguous.
extern "C" void rms_norm_f32(const float* x, int64_t ld_outer, int64_t ld_inner, const float* scale, float* y,
                             int64_t outer, int64_t inner, int64_t dim, float eps) {
    for (int64_t o = 0; o < outer; ++o)
        for (int64_t r = 0; r < inner; ++r)
            norm_row(x + o * ld_outer + r * ld_inner, scale, y + (o * inner + r) * dim, dim, eps);
}
