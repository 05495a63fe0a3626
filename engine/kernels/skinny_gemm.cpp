// y[M, N] = x[M, K] . W[N, K]^T (+ bias[N]) for few rows M: AVX2 + FMA, float32, one thread.
//
// A decode GEMM has a handful of rows and a weight far larger than the caches, so the weight
// is streamed from memory once per call and each of its elements must meet all M rows while
// it sits in registers or L1. The weight stays in its PyTorch layout ([N, K], K contiguous;
// no packed copy). A tile of NB weight rows x MB input rows accumulates NB * MB 8-lane dot
// products: each weight vector loaded feeds MB FMAs, each input vector NB. Tiles walk the
// weight rows in order, and the first input-row block of each tile prefetches the weight
// PREFETCH_AHEAD floats ahead (the hardware prefetcher alone left the FMAs waiting: batch 8
// streamed 5.4 GB/s without it, 7.1 GB/s with it, bench/decode_gemm.py on an AVX2 EPYC);
// the later blocks read the same rows from L1.
#include <immintrin.h>
#include <stdint.h>

namespace {

constexpr int NB = 3;                    // weight rows per tile (3 x 4 accumulators + 3 weight vectors + 1 input)
constexpr int MB = 4;                    // input rows per tile
constexpr int64_t PREFETCH_AHEAD = 4608;  // floats (18 KB: 8 rows of a 576-wide weight)
constexpr int64_t CHUNK_ROWS = 8;        // input rows per pass over a panel (8 x 576 floats: 18 KB of L1)
// Weight rows per panel (a multiple of NB; 120 x 576 floats: 270 KB of L2). At batch 32 the
// panels took the kernel from 2.6 to 3.2 GB/s (oneDNN packed: 2.9-3.4).
constexpr int64_t PANEL_ROWS = 120;

inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// One R x C tile: weight rows w[0..R) (stride ldw) against input rows x[0..C) (stride ldx).
template <int R, int C>
inline void tile(const float* w, int64_t ldw, const float* x, int64_t ldx, int64_t k,
                 float* y, int64_t ldy, const float* bias, bool prefetch) {
    __m256 acc[R][C];
    for (int n = 0; n < R; ++n)
        for (int m = 0; m < C; ++m) acc[n][m] = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= k; i += 8) {
        __m256 wv[R];
        for (int n = 0; n < R; ++n) wv[n] = _mm256_loadu_ps(w + n * ldw + i);
        if (prefetch && (i & 15) == 0)  // one prefetch per 64-byte line
            for (int n = 0; n < R; ++n) _mm_prefetch((const char*)(w + n * ldw + i + PREFETCH_AHEAD), _MM_HINT_T0);
        for (int m = 0; m < C; ++m) {
            const __m256 xv = _mm256_loadu_ps(x + m * ldx + i);
            for (int n = 0; n < R; ++n) acc[n][m] = _mm256_fmadd_ps(wv[n], xv, acc[n][m]);
        }
    }
    for (int n = 0; n < R; ++n) {
        for (int m = 0; m < C; ++m) {
            float sum = hsum(acc[n][m]);
            for (int64_t j = i; j < k; ++j) sum += w[n * ldw + j] * x[m * ldx + j];  // K not a multiple of 8
            y[m * ldy + n] = sum + (bias ? bias[n] : 0.0f);
        }
    }
}

// R weight rows against every input row, MB rows at a time, then the 1-3 rows left.
template <int R>
inline void weight_rows(const float* w, int64_t ldw, const float* x, int64_t ldx, int64_t m_rows, int64_t k,
                        float* y, int64_t ldy, const float* bias, bool prefetch) {
    int64_t m = 0;
    for (; m + MB <= m_rows; m += MB, prefetch = false)
        tile<R, MB>(w, ldw, x + m * ldx, ldx, k, y + m * ldy, ldy, bias, prefetch);
    x += m * ldx;
    y += m * ldy;
    switch (m_rows - m) {
        case 3: tile<R, 3>(w, ldw, x, ldx, k, y, ldy, bias, prefetch); break;
        case 2: tile<R, 2>(w, ldw, x, ldx, k, y, ldy, bias, prefetch); break;
        case 1: tile<R, 1>(w, ldw, x, ldx, k, y, ldy, bias, prefetch); break;
        default: break;
    }
}

}  // namespace

// x: [m_rows, k] (row stride ldx), w: [n_cols, k] (row stride ldw), bias: [n_cols] or null,
// y: [m_rows, n_cols] (row stride ldy). All float32, unit stride along k and n.
extern "C" void skinny_gemm_f32(const float* x, int64_t ldx, const float* w, int64_t ldw, const float* bias,
                                float* y, int64_t ldy, int64_t m_rows, int64_t n_cols, int64_t k) {
    // Over 8 input rows the rows no longer fit L1 beside the weight tile: take them 8 at a time
    // over a panel of weight rows that stays in L2, streaming each panel from memory once.
    for (int64_t panel = 0; panel < n_cols; panel += PANEL_ROWS) {
        const int64_t panel_end = panel + PANEL_ROWS < n_cols ? panel + PANEL_ROWS : n_cols;
        for (int64_t m = 0; m < m_rows; m += CHUNK_ROWS) {
            const int64_t rows = m_rows - m < CHUNK_ROWS ? m_rows - m : CHUNK_ROWS;
            const float* xm = x + m * ldx;
            float* ym = y + m * ldy;
            const bool first = m == 0;
            int64_t n = panel;
            for (; n + NB <= panel_end; n += NB)
                weight_rows<NB>(w + n * ldw, ldw, xm, ldx, rows, k, ym + n, ldy, bias ? bias + n : nullptr, first);
            for (; n < panel_end; ++n)
                weight_rows<1>(w + n * ldw, ldw, xm, ldx, rows, k, ym + n, ldy, bias ? bias + n : nullptr, first);
        }
    }
}
