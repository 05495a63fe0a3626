// y[M, N] = x[M, K] . W[N, K]^T (+ bias[N]) for few rows M (decode), float32, one thread; AVX2 + FMA
// or AVX-512 (vec.h).
//
// The weight is packed once (pack_weight_f32) into panels of NR = 16 output columns, each panel
// K-major: packed[p][k][j] = W[p * 16 + j, k], N zero-padded up to a multiple of 16. A panel is
// one contiguous stream and each k step reads exactly one 64-byte line of it.
//
// Outer-product register tile of MR input rows x two vectors (with AVX2: MR <= 6, one panel of
// 16 columns): per k step two weight vectors are loaded and each of the MR input values is
// broadcast against both, so 2 + MR loads feed 2 * MR FMAs, and no horizontal sums. 12
// accumulators + 2 weight vectors + 1 broadcast = 15 ymm: no spills in the k loops (checked with
// g++ -S). Rows beyond MR loop the tile over even row groups (8 rows: 4 + 4) while the panel is
// hot in L1/L2, so the weight is read from memory once per call whatever the batch. Each k step
// prefetches one line of the panels PREFETCH_TILES tiles ahead, the lines spread evenly over all
// row groups and k steps: prefetches issued in a burst (the first k/groups steps of each group)
// left memory idle while the later groups computed (bench/decode_gemm.py, AVX2 EPYC Zen 3, 30
// weights of 3072x576, batch 8: 8.3 GB/s bursty, 11-12.6 spread; the dot-product kernel this
// replaced, reading W in its own layout: 7.7).
//
// swiglu_gemm_f32 is the same loop over the MLP's gate and up weights packed in pairs (each panel
// 8 gate + the matching 8 up columns): the tile applies SiLU(gate) * up to its accumulators, so
// the [M, 2 I] projection, its split and the two elementwise ops of the torch path never exist.
//
// Width-generic (vec.h): W = 8 lanes (AVX2) or 16 (AVX-512). The packed layout is the same for
// both, so a packed copy serves either build: a tile is always two vectors wide, i.e. one panel
// with 8 lanes and two adjacent panels with 16 (the last tile of an odd panel count: one vector).
// Each output is one FMA chain over k in the same order in both widths: the two builds agree
// bit for bit (tests/engine/kernels/test_kernel_isa.py). bf16 weights (the *_bf16 entry points
// below) take the same tiles over panels with a k pair per column per line.
// With 16 lanes and 32 registers a tile takes up to 12 rows (24 accumulators + 2 weights + 1
// broadcast), so a batch of 8 rows is one pass over the weight and 32 rows three (AMD EPYC Zen 4,
// 30 weights of 3072x576: batch 8 14.5-15 GB/s against 9-10 with 8 lanes; prefetching 1-4 tiles
// ahead: the same within the noise).
#include <stdint.h>
#include <string.h>

#include "vec.h"

#include <vector>

namespace {

constexpr int NR = 16;                           // columns per panel (the packed layout; any width)
constexpr int TILE_COLS = 2 * vec::W;            // columns per tile: 1 panel (W = 8) or 2 (W = 16)
constexpr int MAX_MR = vec::W == 16 ? 12 : 6;    // rows per register tile
// Tiles ahead: two panels ahead in either width. With 8 lanes (1-panel tiles), 1 and 3-4 panels or hints
// T1 / NTA were no better, within the noise; with 16 lanes (2-panel tiles) 1 tile beat 2 at 32 rows (AMD
// EPYC Zen 5, all of smol's decode weights, thread time, interleaved: 1 / 2 / 4 tiles 38.2 / 39.3 / 41.3 ms
// at load 15; 1 / 2 / 3 tiles 40.2 / 41.9 / 43.7 and 40.5 / 42.8 / 43.4 ms at load 2.6), equal at 8 rows.
constexpr int64_t PREFETCH_TILES = vec::W == 16 ? 1 : 2;

// The two weight element kinds a panel holds, one 64-byte line per step: float32 (one k per
// step: x is read as floats) or bf16 pairs (k = 2i and 2i + 1 per step, vec.h's PairW: x is read
// as 32-bit words of the same pairs, prepared by gemm()).
template <typename E> struct Kind;
template <> struct Kind<float> {
    using X = float;
    static constexpr int PER_COL = 1;  // elements per column per step
    static vec::V load(const float* p) { return vec::load(p); }
    static vec::V madd(vec::V w, const float* x, vec::V acc) { return vec::fmadd(w, vec::broadcast(x), acc); }
};
template <> struct Kind<uint16_t> {
    using X = uint32_t;
    static constexpr int PER_COL = 2;
    static vec::PairW load(const uint16_t* p) { return vec::load_pairs(p); }
    static vec::V madd(const vec::PairW& w, const uint32_t* x, vec::V acc) { return vec::pair_fma(w, *x, acc); }
};

// The tile of MR rows by VECS vectors starting at packed column c0 (a multiple of TILE_COLS):
// vector v covers packed columns [c0 + v W, c0 + (v + 1) W), which lie in panel (c0 + v W) / 16;
// a panel is ``steps`` lines of 16 columns. SWIGLU: the panels hold 8 gate columns then the same
// 8 up columns (pack_swiglu_weight_*) and the tile writes their SiLU(gate) * up, VECS * W / 2
// columns per row; else its VECS * W plain columns, as float32 sums. Each prefetch step touches
// one line of each of the ``prefetch_panels`` panels at ``prefetch``.
template <int MR, int VECS, bool SWIGLU, typename E>
inline void tile(const E* packed, int64_t c0, const typename Kind<E>::X* x, int64_t ldx, int64_t steps, float* out,
                 int64_t ldo, const E* prefetch, int64_t prefetch_panels, int64_t prefetch_lines, int64_t every) {
    constexpr int LINE = NR * Kind<E>::PER_COL;  // elements per line
    const E* base[VECS];
    for (int v = 0; v < VECS; ++v)
        base[v] = packed + ((c0 + v * vec::W) / NR) * steps * LINE + (c0 + v * vec::W) % NR * Kind<E>::PER_COL;
    vec::V acc[VECS][MR];
    for (int v = 0; v < VECS; ++v)
        for (int m = 0; m < MR; ++m) acc[v][m] = vec::zero();
    int64_t countdown = 1;
    for (int64_t i = 0; i < steps; ++i) {
        decltype(Kind<E>::load(base[0])) w[VECS];
        for (int v = 0; v < VECS; ++v) w[v] = Kind<E>::load(base[v] + i * LINE);
        if (prefetch_lines > 0 && --countdown == 0) {
            countdown = every;
            for (int64_t p = 0; p < prefetch_panels; ++p) vec::prefetch(prefetch + p * steps * LINE);
            prefetch += LINE;
            --prefetch_lines;
        }
        for (int m = 0; m < MR; ++m)
            for (int v = 0; v < VECS; ++v) acc[v][m] = Kind<E>::madd(w[v], x + m * ldx + i, acc[v][m]);
    }
    for (int m = 0; m < MR; ++m) {
        if (SWIGLU) {
            vec::V gate, up;
            vec::split_pairs(acc[0][m], acc[VECS - 1][m], gate, up);  // one vector: its own halves (W = 16)
            vec::store(out + m * ldo, vec::mul(vec::silu(gate), up));
        } else {
            for (int v = 0; v < VECS; ++v) vec::store(out + m * ldo + v * vec::W, acc[v][m]);
        }
    }
}

template <int VECS, bool SWIGLU, typename E>
inline void tile_rows(int rows, const E* packed, int64_t c0, const typename Kind<E>::X* x, int64_t ldx, int64_t steps,
                      float* out, int64_t ldo, const E* prefetch, int64_t prefetch_panels, int64_t prefetch_lines,
                      int64_t every) {
#define CS_TILE(MR) \
    tile<MR, VECS, SWIGLU, E>(packed, c0, x, ldx, steps, out, ldo, prefetch, prefetch_panels, prefetch_lines, every)
    switch (rows) {
#if CHUNKSCOPE_VEC_WIDTH == 16
        case 12: CS_TILE(12); break;
        case 11: CS_TILE(11); break;
        case 10: CS_TILE(10); break;
        case 9: CS_TILE(9); break;
        case 8: CS_TILE(8); break;
        case 7: CS_TILE(7); break;
#endif
        case 6: CS_TILE(6); break;
        case 5: CS_TILE(5); break;
        case 4: CS_TILE(4); break;
        case 3: CS_TILE(3); break;
        case 2: CS_TILE(2); break;
        default: CS_TILE(1); break;
    }
#undef CS_TILE
}

// float32 -> bf16, rounded to nearest even (as torch's), NaN kept a quiet NaN.
inline uint16_t to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u);
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

inline float from_bf16(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

// Where a tile's sums go: float32 y as it is (edge tiles through a buffer), or bf16 y, rounded
// once from the float32 sums (+ bias), always through the buffer.
inline void write_out(float* y, int64_t i, float v) { y[i] = v; }
inline void write_out(uint16_t* y, int64_t i, float v) { y[i] = to_bf16(v); }
inline float bias_at(const float* bias, int64_t j) { return bias[j]; }
inline float bias_at(const uint16_t* bias, int64_t j) { return from_bf16(bias[j]); }

// The tile loop of every kind: y [m_rows, n_out] (row stride ldy) from x [m_rows, ldx] (as the
// kind reads it: floats, or the bf16 pairs) and the packed panels of ``steps`` lines; a panel
// yields 16 plain columns, or 8 SwiGLU ones. Y and B: float32 (E = float) or bf16 (uint16_t).
template <bool SWIGLU, typename E, typename Y, typename B>
void gemm(const typename Kind<E>::X* x, int64_t ldx, const E* packed, const B* bias, Y* y, int64_t ldy,
          int64_t m_rows, int64_t n_out, int64_t steps) {
    constexpr int LINE = NR * Kind<E>::PER_COL;
    constexpr bool DIRECT = sizeof(Y) == sizeof(float);  // float32 output: whole tiles written in place
    constexpr int PANEL_OUT = SWIGLU ? NR / 2 : NR;  // output columns per panel
    const int64_t panels = (n_out + PANEL_OUT - 1) / PANEL_OUT;
    constexpr int TILE_PANELS = TILE_COLS / NR;
    const int64_t tiles = (panels + TILE_PANELS - 1) / TILE_PANELS;
    const int64_t groups = (m_rows + MAX_MR - 1) / MAX_MR;
    // Even row groups (8 rows: 4 + 4, not 6 + 2): the short tile is the load-bound one.
    const int64_t base_rows = m_rows / groups, extra = m_rows % groups;
    float edge[MAX_MR * TILE_COLS];  // a tile's output when its columns run past n_out (or y is bf16)
    for (int64_t t = 0; t < tiles; ++t) {
        const int64_t p0 = t * TILE_PANELS;
        const int64_t tile_panels = panels - p0 < TILE_PANELS ? panels - p0 : TILE_PANELS;
        const int64_t c0 = p0 * NR, n0 = p0 * PANEL_OUT;
        const int64_t out_cols = tile_panels * PANEL_OUT, cols = n_out - n0 < out_cols ? n_out - n0 : out_cols;
        // The tile PREFETCH_TILES ahead, one line of each of its panels per prefetch step; group g
        // takes lines [g * steps / groups, (g + 1) * steps / groups), one every `groups` steps.
        const int64_t ahead_panel = p0 + PREFETCH_TILES * TILE_PANELS;
        const E* ahead = ahead_panel < panels ? packed + ahead_panel * steps * LINE : nullptr;
        const int64_t ahead_panels = ahead && panels - ahead_panel < TILE_PANELS ? panels - ahead_panel : TILE_PANELS;
        const bool whole = DIRECT && cols == out_cols && tile_panels == TILE_PANELS;  // else through `edge`
        int64_t m = 0;
        for (int64_t g = 0; g < groups; ++g) {
            const int rows = (int)(base_rows + (g < extra ? 1 : 0));
            const int64_t first_line = g * steps / groups, lines = ahead ? (g + 1) * steps / groups - first_line : 0;
            const E* pf = ahead ? ahead + first_line * LINE : nullptr;
            const auto* xg = x + m * ldx;
            float* out = whole ? reinterpret_cast<float*>(y) + m * ldy + n0 : edge;
            const int64_t ldo = whole ? ldy : TILE_COLS;
            if constexpr (TILE_PANELS == 1)
                tile_rows<2, SWIGLU, E>(rows, packed, c0, xg, ldx, steps, out, ldo, pf, ahead_panels, lines, groups);
            else if (tile_panels == TILE_PANELS)
                tile_rows<2, SWIGLU, E>(rows, packed, c0, xg, ldx, steps, out, ldo, pf, ahead_panels, lines, groups);
            else  // the last tile of an odd panel count: one vector, one panel
                tile_rows<1, SWIGLU, E>(rows, packed, c0, xg, ldx, steps, out, ldo, pf, ahead_panels, lines, groups);
            if (whole) {
                if (bias)
                    for (int r = 0; r < rows; ++r)
                        for (int64_t j = 0; j < cols; ++j) out[r * ldy + j] += bias_at(bias, n0 + j);
            } else {
                for (int r = 0; r < rows; ++r)
                    for (int64_t j = 0; j < cols; ++j)
                        write_out(y, (m + r) * ldy + n0 + j,
                                  edge[r * TILE_COLS + j] + (bias ? bias_at(bias, n0 + j) : 0.0f));
            }
            m += rows;
        }
    }
}

// x [m_rows, k] bf16 (row stride ldx) as the 32-bit pairs the bf16 tiles read: [m_rows, ceil(k / 2)],
// the odd k's last pair padded with a zero.
std::vector<uint32_t> x_pairs(const uint16_t* x, int64_t ldx, int64_t m_rows, int64_t k) {
    const int64_t pairs = (k + 1) / 2;
    std::vector<uint32_t> out((size_t)(m_rows * pairs));
    for (int64_t m = 0; m < m_rows; ++m)
        for (int64_t i = 0; i < pairs; ++i) {
            const uint32_t lo = x[m * ldx + 2 * i], hi = 2 * i + 1 < k ? x[m * ldx + 2 * i + 1] : 0;
            out[(size_t)(m * pairs + i)] = lo | (hi << 16);
        }
    return out;
}

// packed[p][i][j * per_col + h] = row(p, j)[i * per_col + h]: panels of 16 columns, ``per_col``
// consecutive k of a column per line (zero past k), ``row(p, j)`` the weight row of panel column
// j or null for a zero column.
template <typename E, typename Row>
void pack_panels(int64_t panels, int64_t k, int per_col, E* packed, Row row) {
    const int64_t steps = (k + per_col - 1) / per_col, line = (int64_t)NR * per_col;
    for (int64_t p = 0; p < panels; ++p) {
        E* panel = packed + p * steps * line;
        for (int j = 0; j < NR; ++j) {
            const E* source = row(p, j);
            for (int64_t i = 0; i < steps * per_col; ++i)
                panel[(i / per_col) * line + j * per_col + i % per_col] = source && i < k ? source[i] : (E)0;
        }
    }
}

// The column ``n`` of a SwiGLU panel pair layout: panel p's column j is gate row p * 8 + j (j < 8)
// or up row p * 8 + j - 8, or null past ``inter``.
template <typename E>
const E* swiglu_row(const E* gate_up, int64_t ldw, int64_t inter, int64_t p, int j) {
    constexpr int HALF = NR / 2;
    const int64_t n = p * HALF + j % HALF;
    return n < inter ? gate_up + (j < HALF ? n : inter + n) * ldw : nullptr;
}

}  // namespace

// x: [m_rows, k] (row stride ldx), packed: [ceil(n_cols / 16), k, 16], bias: [n_cols] or null,
// y: [m_rows, n_cols] (row stride ldy). All float32, unit stride along k and n.
extern "C" void packed_gemm_f32(const float* x, int64_t ldx, const float* packed, const float* bias, float* y,
                                int64_t ldy, int64_t m_rows, int64_t n_cols, int64_t k) {
    gemm<false, float>(x, ldx, packed, bias, y, ldy, m_rows, n_cols, k);
}

// SwiGLU's first half: y = SiLU(x . G^T) * (x . U^T) for the MLP's gate G and up U [inter, k], from
// the packing below. x: [m_rows, k] (row stride ldx); y: [m_rows, inter] (row stride ldy). The
// [m_rows, 2 inter] projection is never written: SiLU and the product run on the accumulators.
extern "C" void swiglu_gemm_f32(const float* x, int64_t ldx, const float* packed, float* y, int64_t ldy,
                                int64_t m_rows, int64_t inter, int64_t k) {
    gemm<true, float>(x, ldx, packed, (const float*)nullptr, y, ldy, m_rows, inter, k);
}

// packed[p][i][j] = w[(p * 16 + j) * ldw + i] for p < ceil(n_cols / 16), zero where p * 16 + j >= n_cols.
extern "C" void pack_weight_f32(const float* w, int64_t ldw, int64_t n_cols, int64_t k, float* packed) {
    pack_panels<float>((n_cols + NR - 1) / NR, k, 1, packed, [&](int64_t p, int j) {
        return p * NR + j < n_cols ? w + (p * NR + j) * ldw : nullptr;
    });
}

// gate_up: [2 inter, k] (row stride ldw), the gate rows then the up rows. packed[p][i][j] =
// gate[p * 8 + j][i] and packed[p][i][8 + j] = up[p * 8 + j][i] for p < ceil(inter / 8), zero past
// inter: each panel pairs 8 gate columns with their 8 up columns, so one tile holds both factors.
extern "C" void pack_swiglu_weight_f32(const float* gate_up, int64_t ldw, int64_t inter, int64_t k, float* packed) {
    pack_panels<float>((inter + NR / 2 - 1) / (NR / 2), k, 1, packed,
                       [&](int64_t p, int j) { return swiglu_row(gate_up, ldw, inter, p, j); });
}

// The bf16 forms (weights, x, bias and y bfloat16, as uint16 bits; float32 sums, y rounded once
// to nearest even): the same panels with a k pair per line, packed[p][i][2 j + h] =
// W[p * 16 + j][2 i + h], [ceil(n / 16), ceil(k / 2), 16, 2], k zero-padded to even. With
// AVX512-BF16 (the avx512-bf16 and SIMDe builds) each pair is one vdpbf16ps, elsewhere it is
// widened to two float32 FMAs (vec.h's PairW).
extern "C" void packed_gemm_bf16(const uint16_t* x, int64_t ldx, const uint16_t* packed, const uint16_t* bias,
                                 uint16_t* y, int64_t ldy, int64_t m_rows, int64_t n_cols, int64_t k) {
    const std::vector<uint32_t> pairs = x_pairs(x, ldx, m_rows, k);
    gemm<false, uint16_t>(pairs.data(), (k + 1) / 2, packed, bias, y, ldy, m_rows, n_cols, (k + 1) / 2);
}

extern "C" void swiglu_gemm_bf16(const uint16_t* x, int64_t ldx, const uint16_t* packed, uint16_t* y, int64_t ldy,
                                 int64_t m_rows, int64_t inter, int64_t k) {
    const std::vector<uint32_t> pairs = x_pairs(x, ldx, m_rows, k);
    gemm<true, uint16_t>(pairs.data(), (k + 1) / 2, packed, (const uint16_t*)nullptr, y, ldy, m_rows, inter,
                         (k + 1) / 2);
}

extern "C" void pack_weight_bf16(const uint16_t* w, int64_t ldw, int64_t n_cols, int64_t k, uint16_t* packed) {
    pack_panels<uint16_t>((n_cols + NR - 1) / NR, k, 2, packed, [&](int64_t p, int j) {
        return p * NR + j < n_cols ? w + (p * NR + j) * ldw : nullptr;
    });
}

extern "C" void pack_swiglu_weight_bf16(const uint16_t* gate_up, int64_t ldw, int64_t inter, int64_t k,
                                        uint16_t* packed) {
    pack_panels<uint16_t>((inter + NR / 2 - 1) / (NR / 2), k, 2, packed,
                          [&](int64_t p, int j) { return swiglu_row(gate_up, ldw, inter, p, j); });
}
