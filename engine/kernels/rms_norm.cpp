// y = x / sqrt(mean(x^2) + eps) * scale over the last dim of decode-sized rows: float32, AVX2 or AVX-512 (vec.h).
//
// The torch path is ~8 ops per norm (pow, sum, div_ with its scalar conversion, add, rsqrt, two
// muls) on tensors of a few KB, ~75 norms per SmolLM-size decode step: per-op dispatch, not
// arithmetic, was its cost (bench/forward.py profile at batch 8: ~1/3 of the step's time
// outside its GEMMs). Here each row is read twice (sum of squares, then the scaled write).
#include <math.h>
#include <stdint.h>

#include "vec.h"

namespace {

void norm_row(const float* x, const float* scale, float* y, int64_t dim, float eps) {
    constexpr int W = vec::W;
    vec::V acc0 = vec::zero(), acc1 = vec::zero();
    int64_t i = 0;
    for (; i + 2 * W <= dim; i += 2 * W) {
        const vec::V a = vec::load(x + i), b = vec::load(x + i + W);
        acc0 = vec::fmadd(a, a, acc0);
        acc1 = vec::fmadd(b, b, acc1);
    }
    for (; i + W <= dim; i += W) {
        const vec::V a = vec::load(x + i);
        acc0 = vec::fmadd(a, a, acc0);
    }
    float sum = vec::hsum(vec::add(acc0, acc1));
    for (; i < dim; ++i) sum += x[i] * x[i];
    const float inv = 1.0f / sqrtf(sum / (float)dim + eps);
    const vec::V inv_v = vec::set1(inv);
    i = 0;
    for (; i + W <= dim; i += W)
        vec::store(y + i, vec::mul(vec::mul(vec::load(x + i), inv_v), vec::load(scale + i)));
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
