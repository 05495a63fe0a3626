// y[M, N] = x[M, K] . W[N, K]^T (+ bias[N]) for few rows M (decode), AVX2 + FMA, float32, one thread.
//
// The weight is packed once (pack_weight_f32) into panels of NR = 16 output columns, each panel
// K-major: packed[p][k][j] = W[p * 16 + j, k], N zero-padded up to a multiple of 16. A panel is
// one contiguous stream and each k step reads exactly one 64-byte line of it.
//
// Outer-product register tile of MR (<= 6) input rows x 16 columns: per k step two weight
// vectors are loaded and each of the MR input values is broadcast against both, so 2 + MR loads
// feed 2 * MR FMAs, and no horizontal sums. 12 accumulators + 2 weight vectors + 1 broadcast =
// 15 ymm: no spills in the k loops (checked with g++ -S). Rows beyond 6 loop the tile over even
// row groups (8 rows: 4 + 4) while the panel is hot in L1/L2, so the weight is read from memory
// once per call whatever the batch. Each k step prefetches one line of the panel PREFETCH_PANELS
// ahead, the lines spread evenly over all row groups and k steps: prefetches issued in a burst
// (the first k/groups steps of each group) left memory idle while the later groups computed
// (bench/decode_gemm.py, AVX2 EPYC, 30 weights of 3072x576, batch 8: 8.3 GB/s bursty, 11-12.6
// spread; the dot-product kernel this replaced, reading W in its own layout: 7.7).
//
// swiglu_gemm_f32 is the same loop over the MLP's gate and up weights packed in pairs (each panel
// 8 gate + the matching 8 up columns): the tile applies SiLU(gate) * up to its accumulators, so
// the [M, 2 I] projection, its split and the two elementwise ops of the torch path never exist.
#include <immintrin.h>
#include <stdint.h>

#include "avx2_math.h"

namespace {

constexpr int NR = 16;          // columns per panel (two ymm)
constexpr int MAX_MR = 6;       // rows per register tile
constexpr int64_t PREFETCH_PANELS = 2;  // 1 and 3-4 panels, or hints T1 / NTA: no better, within the noise

// SWIGLU: the panel holds 8 gate columns then the same 8 up columns (pack_swiglu_weight_f32) and
// the tile writes their SiLU(gate) * up, 8 columns per row; else the 16 plain columns.
template <int MR, bool SWIGLU>
inline void tile(const float* panel, const float* x, int64_t ldx, int64_t k, float* out, int64_t ldo,
                 const float* prefetch, int64_t prefetch_lines, int64_t every) {
    __m256 acc0[MR], acc1[MR];
    for (int m = 0; m < MR; ++m) acc0[m] = acc1[m] = _mm256_setzero_ps();
    int64_t countdown = 1;
    for (int64_t i = 0; i < k; ++i) {
        const __m256 w0 = _mm256_loadu_ps(panel + i * NR);
        const __m256 w1 = _mm256_loadu_ps(panel + i * NR + 8);
        if (prefetch_lines > 0 && --countdown == 0) {
            countdown = every;
            _mm_prefetch((const char*)prefetch, _MM_HINT_T0);
            prefetch += NR;
            --prefetch_lines;
        }
        for (int m = 0; m < MR; ++m) {
            const __m256 xv = _mm256_broadcast_ss(x + m * ldx + i);
            acc0[m] = _mm256_fmadd_ps(w0, xv, acc0[m]);
            acc1[m] = _mm256_fmadd_ps(w1, xv, acc1[m]);
        }
    }
    for (int m = 0; m < MR; ++m) {
        if (SWIGLU) {
            _mm256_storeu_ps(out + m * ldo, _mm256_mul_ps(avx2::silu(acc0[m]), acc1[m]));
        } else {
            _mm256_storeu_ps(out + m * ldo, acc0[m]);
            _mm256_storeu_ps(out + m * ldo + 8, acc1[m]);
        }
    }
}

template <bool SWIGLU>
inline void tile_rows(int rows, const float* panel, const float* x, int64_t ldx, int64_t k, float* out,
                      int64_t ldo, const float* prefetch, int64_t prefetch_lines, int64_t every) {
    switch (rows) {
        case 6: tile<6, SWIGLU>(panel, x, ldx, k, out, ldo, prefetch, prefetch_lines, every); break;
        case 5: tile<5, SWIGLU>(panel, x, ldx, k, out, ldo, prefetch, prefetch_lines, every); break;
        case 4: tile<4, SWIGLU>(panel, x, ldx, k, out, ldo, prefetch, prefetch_lines, every); break;
        case 3: tile<3, SWIGLU>(panel, x, ldx, k, out, ldo, prefetch, prefetch_lines, every); break;
        case 2: tile<2, SWIGLU>(panel, x, ldx, k, out, ldo, prefetch, prefetch_lines, every); break;
        default: tile<1, SWIGLU>(panel, x, ldx, k, out, ldo, prefetch, prefetch_lines, every); break;
    }
}

// The panel loop of both kinds: y [m_rows, n_out] (row stride ldy) from x [m_rows, k] and the
// packed panels; each panel yields OUT = 16 plain columns, or 8 SwiGLU ones.
template <bool SWIGLU>
void gemm(const float* x, int64_t ldx, const float* packed, const float* bias, float* y, int64_t ldy,
          int64_t m_rows, int64_t n_out, int64_t k) {
    constexpr int OUT = SWIGLU ? NR / 2 : NR;
    const int64_t panels = (n_out + OUT - 1) / OUT;
    const int64_t groups = (m_rows + MAX_MR - 1) / MAX_MR;
    // Even row groups (8 rows: 4 + 4, not 6 + 2): the short tile is the load-bound one.
    const int64_t base_rows = m_rows / groups, extra = m_rows % groups;
    float edge[MAX_MR * NR];  // the last panel's tile when n_out is not a multiple of OUT
    for (int64_t p = 0; p < panels; ++p) {
        const float* panel = packed + p * k * NR;
        const int64_t n0 = p * OUT, cols = n_out - n0 < OUT ? n_out - n0 : OUT;
        const float* ahead = p + PREFETCH_PANELS < panels ? packed + (p + PREFETCH_PANELS) * k * NR : nullptr;
        // Group g prefetches lines [g * k / groups, (g + 1) * k / groups) of the panel ahead, one every `groups` k steps.
        int64_t m = 0;
        for (int64_t g = 0; g < groups; ++g) {
            const int rows = (int)(base_rows + (g < extra ? 1 : 0));
            const int64_t first_line = g * k / groups, lines = ahead ? (g + 1) * k / groups - first_line : 0;
            const float* pf = ahead ? ahead + first_line * NR : nullptr;
            const float* xg = x + m * ldx;
            if (cols == OUT) {
                float* out = y + m * ldy + n0;
                tile_rows<SWIGLU>(rows, panel, xg, ldx, k, out, ldy, pf, lines, groups);
                if (bias)
                    for (int r = 0; r < rows; ++r)
                        for (int j = 0; j < OUT; ++j) out[r * ldy + j] += bias[n0 + j];
            } else {
                tile_rows<SWIGLU>(rows, panel, xg, ldx, k, edge, NR, pf, lines, groups);
                for (int r = 0; r < rows; ++r)
                    for (int j = 0; j < cols; ++j) y[(m + r) * ldy + n0 + j] = edge[r * NR + j] + (bias ? bias[n0 + j] : 0.0f);
            }
            m += rows;
        }
    }
}

}  // namespace

// x: [m_rows, k] (row stride ldx), packed: [ceil(n_cols / 16), k, 16], bias: [n_cols] or null,
// y: [m_rows, n_cols] (row stride ldy). All float32, unit stride along k and n.
extern "C" void packed_gemm_f32(const float* x, int64_t ldx, const float* packed, const float* bias, float* y,
                                int64_t ldy, int64_t m_rows, int64_t n_cols, int64_t k) {
    gemm<false>(x, ldx, packed, bias, y, ldy, m_rows, n_cols, k);
}

// SwiGLU's first half: y = SiLU(x . G^T) * (x . U^T) for the MLP's gate G and up U [inter, k], from
// the packing below. x: [m_rows, k] (row stride ldx); y: [m_rows, inter] (row stride ldy). The
// [m_rows, 2 inter] projection is never written: SiLU and the product run on the accumulators.
extern "C" void swiglu_gemm_f32(const float* x, int64_t ldx, const float* packed, float* y, int64_t ldy,
                                int64_t m_rows, int64_t inter, int64_t k) {
    gemm<true>(x, ldx, packed, nullptr, y, ldy, m_rows, inter, k);
}

// packed[p][i][j] = w[(p * 16 + j) * ldw + i] for p < ceil(n_cols / 16), zero where p * 16 + j >= n_cols.
extern "C" void pack_weight_f32(const float* w, int64_t ldw, int64_t n_cols, int64_t k, float* packed) {
    const int64_t panels = (n_cols + NR - 1) / NR;
    for (int64_t p = 0; p < panels; ++p) {
        float* panel = packed + p * k * NR;
        for (int j = 0; j < NR; ++j) {
            const int64_t n = p * NR + j;
            if (n < n_cols) {
                const float* row = w + n * ldw;
                for (int64_t i = 0; i < k; ++i) panel[i * NR + j] = row[i];
            } else {
                for (int64_t i = 0; i < k; ++i) panel[i * NR + j] = 0.0f;
            }
        }
    }
}

// gate_up: [2 inter, k] (row stride ldw), the gate rows then the up rows. packed[p][i][j] =
// gate[p * 8 + j][i] and packed[p][i][8 + j] = up[p * 8 + j][i] for p < ceil(inter / 8), zero past
// inter: each panel pairs 8 gate columns with their 8 up columns, so one tile holds both factors.
extern "C" void pack_swiglu_weight_f32(const float* gate_up, int64_t ldw, int64_t inter, int64_t k, float* packed) {
    constexpr int HALF = NR / 2;
    const int64_t panels = (inter + HALF - 1) / HALF;
    for (int64_t p = 0; p < panels; ++p) {
        float* panel = packed + p * k * NR;
        for (int j = 0; j < NR; ++j) {
            const int64_t n = p * HALF + j % HALF;
            if (n < inter) {
                const float* row = gate_up + (j < HALF ? n : inter + n) * ldw;
                for (int64_t i = 0; i < k; ++i) panel[i * NR + j] = row[i];
            } else {
                for (int64_t i = 0; i < k; ++i) panel[i * NR + j] = 0.0f;
            }
        }
    }
}
