// The vector layer every kernel of this package is written against: a float32 vector V of W lanes
// and the few operations the kernels use, in two widths chosen at build time by CHUNKSCOPE_VEC_WIDTH
// (native.py's variants):
//   8   AVX2 + FMA (__m256), the variant of every x86-64 CPU since 2013;
//   16  AVX-512F (__m512), natively (-mavx512f), or with CHUNKSCOPE_SIMDE through SIMDe (SIMD
//       Everywhere, Debian's libsimde-dev: header-only, the same _mm512 operations implemented on
//       AVX2), so that the 16-lane code and its tails, pair splits and horizontal sums run in the
//       tests of a machine without AVX-512.
// SIMDe is called by its simde_ names, not through its native aliases: 0.7.4 defines
// simde_mm512_shuffle_f32x4 but no _mm512_shuffle_f32x4 alias. Only operations both sides have
// are used (0.7.4 lacks _mm512_cvttps_epi32, _mm512_reduce_add_ps and the masked loads and
// stores, hence the float trick in pow2n, the fold to 256 bits in the sums and the scalar tails).
// Everything that differs between the widths is in this file; the kernels use W, never a width.
// native.py hashes this header into every build: a change here rebuilds every kernel.
#pragma once

#include <math.h>
#include <stdint.h>
#include <string.h>

#ifndef CHUNKSCOPE_VEC_WIDTH
#define CHUNKSCOPE_VEC_WIDTH 8
#endif

#if CHUNKSCOPE_VEC_WIDTH == 16 && defined(CHUNKSCOPE_SIMDE)
#include <simde/x86/avx512.h>
#define CS512(op) simde_mm512_##op
#define CS256(op) simde_mm256_##op
#define CS128(op) simde_mm_##op
#define CS_ROUND_DOWN (SIMDE_MM_FROUND_TO_NEG_INF | SIMDE_MM_FROUND_NO_EXC)
typedef simde__m512 cs_m512;
typedef simde__m512i cs_m512i;
typedef simde__m512bh cs_m512bh;
typedef simde__m256 cs_m256;
typedef simde__m256i cs_m256i;
typedef simde__m128 cs_m128;
typedef simde__m128i cs_m128i;
#define CS_HINT_T0 SIMDE_MM_HINT_T0
#define CS_HINT_T1 SIMDE_MM_HINT_T1
#else
#include <immintrin.h>
#define CS512(op) _mm512_##op
#define CS256(op) _mm256_##op
#define CS128(op) _mm_##op
#define CS_ROUND_DOWN (_MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC)
typedef __m256 cs_m256;
typedef __m256i cs_m256i;
typedef __m128 cs_m128;
typedef __m128i cs_m128i;
#if CHUNKSCOPE_VEC_WIDTH == 16
typedef __m512 cs_m512;
typedef __m512i cs_m512i;
#if defined(CHUNKSCOPE_BF16_DOT)
typedef __m512bh cs_m512bh;
#endif
#endif
#define CS_HINT_T0 _MM_HINT_T0
#define CS_HINT_T1 _MM_HINT_T1
#endif

namespace vec {

constexpr int W = CHUNKSCOPE_VEC_WIDTH;
static_assert(W == 8 || W == 16, "CHUNKSCOPE_VEC_WIDTH is 8 (AVX2) or 16 (AVX-512)");

inline void prefetch(const void* p) { CS128(prefetch)((const char*)p, CS_HINT_T0); }
// Into L2 only: data wanted a while later, too much of it for L1.
inline void prefetch_l2(const void* p) { CS128(prefetch)((const char*)p, CS_HINT_T1); }

// The sum of an 8-lane vector's lanes, and the eight sums of eight 8-lane vectors as one vector
// [sum(a0), .., sum(a7)]: the 256-bit steps both widths end with.
inline float hsum256(cs_m256 v) {
    cs_m128 s = CS128(add_ps)(CS256(castps256_ps128)(v), CS256(extractf128_ps)(v, 1));
    s = CS128(add_ps)(s, CS128(movehl_ps)(s, s));
    s = CS128(add_ss)(s, CS128(movehdup_ps)(s));
    return CS128(cvtss_f32)(s);
}

inline cs_m256 hsum8_256(const cs_m256* a) {
    const cs_m256 s01 = CS256(hadd_ps)(a[0], a[1]), s23 = CS256(hadd_ps)(a[2], a[3]);
    const cs_m256 s45 = CS256(hadd_ps)(a[4], a[5]), s67 = CS256(hadd_ps)(a[6], a[7]);
    const cs_m256 s0123 = CS256(hadd_ps)(s01, s23), s4567 = CS256(hadd_ps)(s45, s67);
    return CS256(add_ps)(CS256(permute2f128_ps)(s0123, s4567, 0x20), CS256(permute2f128_ps)(s0123, s4567, 0x31));
}

#if CHUNKSCOPE_VEC_WIDTH == 8

using V = cs_m256;
inline V zero() { return CS256(setzero_ps)(); }
inline V set1(float x) { return CS256(set1_ps)(x); }
inline V load(const float* p) { return CS256(loadu_ps)(p); }
inline V broadcast(const float* p) { return CS256(broadcast_ss)(p); }
inline void store(float* p, V v) { CS256(storeu_ps)(p, v); }
inline V add(V a, V b) { return CS256(add_ps)(a, b); }
inline V sub(V a, V b) { return CS256(sub_ps)(a, b); }
inline V mul(V a, V b) { return CS256(mul_ps)(a, b); }
inline V div(V a, V b) { return CS256(div_ps)(a, b); }
inline V min(V a, V b) { return CS256(min_ps)(a, b); }
inline V max(V a, V b) { return CS256(max_ps)(a, b); }
inline V fmadd(V a, V b, V c) { return CS256(fmadd_ps)(a, b, c); }   // a * b + c
inline V fnmadd(V a, V b, V c) { return CS256(fnmadd_ps)(a, b, c); } // c - a * b
inline V floor(V a) { return CS256(floor_ps)(a); }
inline float hsum(V v) { return hsum256(v); }
// out[j] = scale * sum(a[j]) for j < 8.
inline void hsum8_scaled(const V* a, float scale, float* out) {
    store(out, mul(hsum8_256(a), set1(scale)));
}
// 2^n for integral n in [-127, 128] (n + 127 + 2^23 is exact and holds n + 127 in its low
// mantissa bits; shifted to the exponent field they are 2^n, 0 for n = -127, inf for 128).
inline V pow2n(V n) {
    const cs_m256i bits = CS256(castps_si256)(CS256(add_ps)(n, set1(8388735.0f)));
    return CS256(castsi256_ps)(CS256(slli_epi32)(bits, 23));
}
// SwiGLU panels (skinny_gemm.cpp) hold 8 gate columns then their 8 up columns: with 8 lanes a
// tile's two vectors are the gate and the up halves as they are.
inline void split_pairs(V a, V b, V& gate, V& up) {
    gate = a;
    up = b;
}
// 8 consecutive bf16 widened to float32 (bf16 is a float32's high half).
inline V load_bf16(const uint16_t* p) {
    const cs_m256i words = CS256(cvtepu16_epi32)(CS128(loadu_si128)((const cs_m128i*)p));
    return CS256(castsi256_ps)(CS256(slli_epi32)(words, 16));
}
// bf16 pairs of 8 columns (see PairW below) widened to float32.
struct PairW {
    V even, odd;
};
inline PairW load_pairs(const uint16_t* p) {
    const cs_m256i words = CS256(loadu_si256)((const cs_m256i*)p);
    return {CS256(castsi256_ps)(CS256(slli_epi32)(words, 16)),
            CS256(castsi256_ps)(CS256(and_si256)(words, CS256(set1_epi32)((int)0xffff0000u)))};
}

#else  // W == 16

using V = cs_m512;
inline V zero() { return CS512(setzero_ps)(); }
inline V set1(float x) { return CS512(set1_ps)(x); }
inline V load(const float* p) { return CS512(loadu_ps)(p); }
inline V broadcast(const float* p) { return CS512(set1_ps)(*p); }
inline void store(float* p, V v) { CS512(storeu_ps)(p, v); }
inline V add(V a, V b) { return CS512(add_ps)(a, b); }
inline V sub(V a, V b) { return CS512(sub_ps)(a, b); }
inline V mul(V a, V b) { return CS512(mul_ps)(a, b); }
inline V div(V a, V b) { return CS512(div_ps)(a, b); }
inline V min(V a, V b) { return CS512(min_ps)(a, b); }
inline V max(V a, V b) { return CS512(max_ps)(a, b); }
inline V fmadd(V a, V b, V c) { return CS512(fmadd_ps)(a, b, c); }
inline V fnmadd(V a, V b, V c) { return CS512(fnmadd_ps)(a, b, c); }
inline V floor(V a) { return CS512(roundscale_ps)(a, CS_ROUND_DOWN); }
// The low and high 8 lanes added: 16 lanes folded to 8 (AVX-512F has no 256-bit float extract
// without DQ, hence the detour through the double view).
inline cs_m256 fold(V v) {
    const cs_m256 high = CS256(castpd_ps)(CS512(extractf64x4_pd)(CS512(castps_pd)(v), 1));
    return CS256(add_ps)(CS512(castps512_ps256)(v), high);
}
inline float hsum(V v) { return hsum256(fold(v)); }
inline void hsum8_scaled(const V* a, float scale, float* out) {
    cs_m256 folded[8];
    for (int j = 0; j < 8; ++j) folded[j] = fold(a[j]);
    CS256(storeu_ps)(out, CS256(mul_ps)(hsum8_256(folded), CS256(set1_ps)(scale)));
}
inline V pow2n(V n) {
    const cs_m512i bits = CS512(castps_si512)(CS512(add_ps)(n, set1(8388735.0f)));
    return CS512(castsi512_ps)(CS512(slli_epi32)(bits, 23));
}
// 16 consecutive bf16 widened to float32, as two 8-lane halves (SIMDe 0.7.4 has no _mm512_cvtepu16_epi32).
inline V load_bf16(const uint16_t* p) {
    const cs_m256i low = CS256(cvtepu16_epi32)(CS128(loadu_si128)((const cs_m128i*)p));
    const cs_m256i high = CS256(cvtepu16_epi32)(CS128(loadu_si128)((const cs_m128i*)(p + 8)));
    const cs_m512i words = CS512(inserti64x4)(CS512(castsi256_si512)(low), high, 1);
    return CS512(castsi512_ps)(CS512(slli_epi32)(words, 16));
}
// 16 lanes span two SwiGLU panels, a = [gate 8 | up 8] of one and b of the next: the gate halves
// (128-bit lanes 0, 1 of each) and the up halves (lanes 2, 3) gathered, in column order.
inline void split_pairs(V a, V b, V& gate, V& up) {
    gate = CS512(shuffle_f32x4)(a, b, 0x44);  // [a.0, a.1, b.0, b.1]
    up = CS512(shuffle_f32x4)(a, b, 0xEE);    // [a.2, a.3, b.2, b.3]
}
#if defined(CHUNKSCOPE_BF16_DOT)
// AVX512-BF16 (natively, or SIMDe's): the 16 columns' bf16 pairs as they are, for vdpbf16ps.
using PairW = cs_m512bh;
inline PairW load_pairs(const uint16_t* p) {
    const cs_m512i words = CS512(loadu_si512)((const void*)p);
    PairW pairs;
    memcpy(&pairs, &words, sizeof pairs);
    return pairs;
}
// acc + w.even * x.even + w.odd * x.odd per lane, both products exact in float32, in one instruction.
inline V pair_fma(const PairW& w, uint32_t x, V acc) {
    const cs_m512i words = CS512(set1_epi32)((int)x);
    PairW xs;
    memcpy(&xs, &words, sizeof xs);
    return CS512(dpbf16_ps)(acc, w, xs);
}
#else
struct PairW {
    V even, odd;
};
inline PairW load_pairs(const uint16_t* p) {
    const cs_m512i words = CS512(loadu_si512)((const void*)p);
    return {CS512(castsi512_ps)(CS512(slli_epi32)(words, 16)),
            CS512(castsi512_ps)(CS512(and_si512)(words, CS512(set1_epi32)((int)0xffff0000u)))};
}
#endif

#endif

// bf16 weights packed in pairs along k (skinny_gemm.cpp): each 32-bit lane holds a column's bf16
// of k = 2i in its low half and of k = 2i + 1 in its high half; x comes as the same pairs, one
// 32-bit word. Without AVX512-BF16 the pairs are widened (PairW {even, odd}) and each adds two
// FMAs: the products of two bf16 are exact in float32, as the dot instruction's.
#if !(CHUNKSCOPE_VEC_WIDTH == 16 && defined(CHUNKSCOPE_BF16_DOT))
inline V pair_fma(const PairW& w, uint32_t x, V acc) {
    const uint32_t even_bits = x << 16, odd_bits = x & 0xffff0000u;
    float even, odd;
    memcpy(&even, &even_bits, 4);
    memcpy(&odd, &odd_bits, 4);
    return fmadd(w.odd, set1(odd), fmadd(w.even, set1(even), acc));
}
#endif

// exp(x) (Cephes' expf: x = n ln2 + r, |r| <= ln2 / 2, a degree-6 polynomial in r, 2^n through
// the exponent bits; within ~2 ulp of expf). Inputs are clamped to +-88.38, where expf leaves
// the normal range: exp of less comes out 0 (a softmax weight or a SiLU of a large negative
// input, where 0 is what float32 would round to anyway). Lane for lane the same in both widths.
inline V exp(V x) {
    x = max(min(x, set1(88.3762626647949f)), set1(-88.3762626647949f));
    const V n = floor(fmadd(x, set1(1.44269504088896341f), set1(0.5f)));
    V r = fnmadd(n, set1(0.693359375f), x);  // ln2 in two parts: r stays exact
    r = fnmadd(n, set1(-2.12194440e-4f), r);
    V y = set1(1.9875691500e-4f);
    y = fmadd(y, r, set1(1.3981999507e-3f));
    y = fmadd(y, r, set1(8.3334519073e-3f));
    y = fmadd(y, r, set1(4.1665795894e-2f));
    y = fmadd(y, r, set1(1.6666665459e-1f));
    y = fmadd(y, r, set1(5.0000001201e-1f));
    y = add(fmadd(y, mul(r, r), r), set1(1.0f));
    return mul(y, pow2n(n));
}

// sigmoid(x) = 1 / (1 + exp(-x)).
inline V sigmoid(V x) { return div(set1(1.0f), add(set1(1.0f), exp(sub(zero(), x)))); }

// SiLU(x) = x / (1 + exp(-x)) (one division, as torch's silu).
inline V silu(V x) { return div(x, add(set1(1.0f), exp(sub(zero(), x)))); }

// The scalar forms, for the tails shorter than a vector.
inline float silu(float x) { return x / (1.0f + expf(-x)); }
inline float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

}  // namespace vec
