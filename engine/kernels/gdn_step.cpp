// The Gated DeltaNet decode step of one layer, fused: per sequence, the causal conv over its
// window (conv state + the new input, state shifted in place), SiLU, the l2-normalised q and k
// heads, and the recurrence per value head on its pooled state (in place). gdn_decode_gated_f32
// also computes the gates (sigmoid, softplus) from the raw projections and applies the output's
// GatedRMSNorm, so that the layer's decode runs no torch op between its two GEMMs.
//
// Per head, with e = exp(g), the state S [Dk, Dv] becomes S' = e S + k delta^T where
// delta = beta (v - k^T (e S)), and the output is q^T S' = q^T (e S) + (q . k) delta.
// The tensor form makes five passes over S (scale, read, rank-1 update: read + write each);
// here S is read from memory once and written once: Dv is taken 4 vectors (32 columns with
// AVX2, 64 with AVX-512; then 2 and 1 for what is left) at a time, one sweep over the rows
// scales them and accumulates k^T (e S) and q^T (e S), a second sweep (from L1: 64 rows x 128
// or 256 bytes) writes e S + k delta^T. Vector code through vec.h: AVX2 or AVX-512.
#include <math.h>
#include <stdint.h>

#include "vec.h"

#include <vector>

namespace {

constexpr int W = vec::W;

inline float dot(const float* a, const float* b, int64_t n) {
    float sum = 0.0f;
    for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
    return sum;
}

// Columns [c, c + NV W) of one head (see head_step): the first sweep accumulates k^T S and q^T S
// (and prefetches ``per_row`` lines of the next state per row), the second writes e S + k delta^T.
template <int NV>
inline void head_block(float* S, const float* q, const float* k, const float* v, float decay, float beta, float qk,
                       int64_t dk, int64_t dv, int64_t c, float* out, const float* next, int64_t next_lines,
                       int64_t per_row, int64_t& prefetched) {
    const vec::V e = vec::set1(decay);
    // k^T (e S) = e (k^T S) and q^T (e S) = e (q^T S): the decay multiplies the sums, not each element.
    vec::V ks[NV], qs[NV];
    for (int j = 0; j < NV; ++j) ks[j] = qs[j] = vec::zero();
    for (int64_t i = 0; i < dk; ++i) {
        const float* row = S + i * dv + c;
        for (int64_t l = 0; l < per_row && prefetched < next_lines; ++l, ++prefetched)
            vec::prefetch(next + prefetched * 16);
        const vec::V ki = vec::set1(k[i]), qi = vec::set1(q[i]);
        for (int j = 0; j < NV; ++j) {
            const vec::V s = vec::load(row + W * j);
            ks[j] = vec::fmadd(ki, s, ks[j]);
            qs[j] = vec::fmadd(qi, s, qs[j]);
        }
    }
    vec::V delta[NV];
    const vec::V b = vec::set1(beta), dot_qk = vec::set1(qk);
    for (int j = 0; j < NV; ++j) {
        delta[j] = vec::mul(vec::fnmadd(e, ks[j], vec::load(v + c + W * j)), b);
        vec::store(out + c + W * j, vec::fmadd(dot_qk, delta[j], vec::mul(e, qs[j])));
    }
    for (int64_t i = 0; i < dk; ++i) {
        float* row = S + i * dv + c;
        const vec::V ki = vec::set1(k[i]);
        for (int j = 0; j < NV; ++j)
            vec::store(row + W * j, vec::fmadd(ki, delta[j], vec::mul(vec::load(row + W * j), e)));
    }
}

// One value head: S [Dk, Dv] (in place), q, k [Dk], v [Dv] -> out [Dv]. ``next`` is the state
// this call's caller reads after this one (the next head's, or the next row's first head), or
// null: its lines are prefetched during the first sweeps, so memory keeps streaming while this
// head's second sweeps and its read-out run from L1 (without it, each head's first sweep waited
// on memory and memory then idled through the rest of the head).
void head_step(float* S, const float* q, const float* k, const float* v, float g, float beta,
               int64_t dk, int64_t dv, float* out, const float* next) {
    const float decay = expf(g);
    const float qk = dot(q, k, dk);
    // The blocks: 4 vectors wide while they fit, then one of 2 and one of 1 for what is left.
    const int64_t wide = dv / (4 * W), rest = dv % (4 * W);
    const int64_t blocks = wide + (rest >= 2 * W ? 1 : 0) + (rest % (2 * W) >= W ? 1 : 0);
    // The next state's 64-byte lines, spread over this head's first-sweep rows (Dk per block).
    const int64_t next_lines = next != nullptr ? dk * dv / 16 : 0;
    const int64_t per_row = blocks > 0 ? (next_lines + blocks * dk - 1) / (blocks * dk) : 0;
    int64_t prefetched = 0;
    int64_t c = 0;
    for (; c + 4 * W <= dv; c += 4 * W)
        head_block<4>(S, q, k, v, decay, beta, qk, dk, dv, c, out, next, next_lines, per_row, prefetched);
    if (c + 2 * W <= dv) {
        head_block<2>(S, q, k, v, decay, beta, qk, dk, dv, c, out, next, next_lines, per_row, prefetched);
        c += 2 * W;
    }
    if (c + W <= dv) {
        head_block<1>(S, q, k, v, decay, beta, qk, dk, dv, c, out, next, next_lines, per_row, prefetched);
        c += W;
    }
    for (; c < dv; ++c) {  // columns left over when Dv is not a multiple of W
        float ks = 0.0f, qs = 0.0f;
        for (int64_t i = 0; i < dk; ++i) {
            const float s = S[i * dv + c] * decay;
            ks += k[i] * s;
            qs += q[i] * s;
        }
        const float delta = (v[c] - ks) * beta;
        out[c] = qs + qk * delta;
        for (int64_t i = 0; i < dk; ++i) S[i * dv + c] = S[i * dv + c] * decay + k[i] * delta;
    }
}

// x = SiLU(x) in place: a vector at a time (a scalar expf per channel was ~10 us per 1,024-channel
// row, about a third of a batch-8 layer's native step on an AVX2 EPYC).
void silu_inplace(float* x, int64_t n) {
    int64_t i = 0;
    for (; i + W <= n; i += W) vec::store(x + i, vec::silu(vec::load(x + i)));
    for (; i < n; ++i) x[i] = vec::silu(x[i]);
}

// x * rsqrt(sum(x^2) + 1e-6) * scale, as gdn.py's _l2norm (then the query's Dk^-0.5).
void l2norm(float* x, int64_t n, float scale) {
    float sum = 0.0f;
    for (int64_t i = 0; i < n; ++i) sum += x[i] * x[i];
    const float factor = 1.0f / sqrtf(sum + 1e-6f);
    for (int64_t i = 0; i < n; ++i) x[i] = x[i] * factor * scale;
}

// The depthwise causal conv for one row: window = [state (K-1 values), input], out = SiLU(window . w)
// (the SiLU in one vector pass after the conv); the state then drops its oldest value and keeps the input.
// KEPT = K-1 as a template argument for the models' K = 4 (straight-line code per channel, ~5x
// faster than the loops over a runtime K, which were ~40% of this kernel's time at batch 8);
// KEPT < 0 takes it from ``kernel``.
template <int KEPT>
void conv_row(const float* input, float* state, const float* weight, int64_t channels, int64_t kernel, float* out) {
    const int64_t kept = KEPT >= 0 ? KEPT : kernel - 1;
    for (int64_t c = 0; c < channels; ++c) {
        float* st = state + c * kept;
        const float* w = weight + c * (kept + 1);
        const float x = input[c];
        float acc = 0.0f;
        for (int64_t j = 0; j < kept; ++j) acc += st[j] * w[j];
        acc += x * w[kept];
        for (int64_t j = 0; j + 1 < kept; ++j) st[j] = st[j + 1];
        if (kept > 0) st[kept - 1] = x;
        out[c] = acc;
    }
    silu_inplace(out, channels);
}

// The gates of one row, as gdn.py's tensor path: beta = sigmoid(b), g = neg_rate * softplus(a + dt_bias)
// (torch's softplus: linear above 20).
void gates_row(const float* a, const float* b, const float* neg_rate, const float* dt_bias, int64_t heads,
               float* g, float* beta) {
    for (int64_t h = 0; h < heads; ++h) {
        const float x = a[h] + dt_bias[h];
        g[h] = neg_rate[h] * (x > 20.0f ? x : log1pf(expf(x)));
        beta[h] = vec::sigmoid(b[h]);
    }
}

// GatedRMSNorm of one head's output in place: o * rsqrt(mean(o^2) + eps) * weight * silu(z).
void gated_rms_norm(float* o, const float* z, const float* weight, float eps, int64_t n) {
    float sum = 0.0f;
    for (int64_t i = 0; i < n; ++i) sum += o[i] * o[i];
    const float factor = 1.0f / sqrtf(sum / (float)n + eps);
    const vec::V f = vec::set1(factor);
    int64_t i = 0;
    for (; i + W <= n; i += W) {
        const vec::V normed = vec::mul(vec::load(weight + i), vec::mul(vec::load(o + i), f));
        vec::store(o + i, vec::mul(normed, vec::silu(vec::load(z + i))));
    }
    for (; i < n; ++i) o[i] = weight[i] * (o[i] * factor) * vec::silu(z[i]);
}

struct Gated {  // the raw gate inputs and the output norm, for gdn_decode_gated_f32
    const float *a, *b, *z;
    int64_t ld_ab, ld_z;
    const float *neg_rate, *dt_bias, *norm_weight;
    float eps;
};

void decode_rows(const float* mixed, int64_t ld_mixed, float* conv_states, const float* conv_weight, int64_t kernel,
                 float* rec_states, const int64_t* slots, const float* g, const float* beta, int64_t ldg,
                 const Gated* gated, int64_t batch, int64_t num_k_heads, int64_t num_v_heads, int64_t dk,
                 int64_t dv, float* out) {
    const int64_t key_dim = num_k_heads * dk, channels = 2 * key_dim + num_v_heads * dv;
    const int64_t group = num_v_heads / num_k_heads;
    const float q_scale = 1.0f / sqrtf((float)dk);
    std::vector<float> conv_out(channels);  // [q | k | v] of one row
    std::vector<float> row_gates(2 * num_v_heads);  // [g | beta] of one row, when computed here
    for (int64_t b = 0; b < batch; ++b) {
        float* conv_state = conv_states + slots[b] * channels * (kernel - 1);
        if (kernel == 4)
            conv_row<3>(mixed + b * ld_mixed, conv_state, conv_weight, channels, kernel, conv_out.data());
        else
            conv_row<-1>(mixed + b * ld_mixed, conv_state, conv_weight, channels, kernel, conv_out.data());
        float* q = conv_out.data();
        float* k = q + key_dim;
        const float* v = k + key_dim;
        for (int64_t h = 0; h < num_k_heads; ++h) {
            l2norm(q + h * dk, dk, q_scale);
            l2norm(k + h * dk, dk, 1.0f);
        }
        const float *g_row, *beta_row;
        if (gated != nullptr) {
            gates_row(gated->a + b * gated->ld_ab, gated->b + b * gated->ld_ab, gated->neg_rate, gated->dt_bias,
                      num_v_heads, row_gates.data(), row_gates.data() + num_v_heads);
            g_row = row_gates.data();
            beta_row = g_row + num_v_heads;
        } else {
            g_row = g + b * ldg;
            beta_row = beta + b * ldg;
        }
        float* state = rec_states + slots[b] * num_v_heads * dk * dv;
        const float* next_row = b + 1 < batch ? rec_states + slots[b + 1] * num_v_heads * dk * dv : nullptr;
        for (int64_t h = 0; h < num_v_heads; ++h) {
            const int64_t kh = h / group;
            float* o = out + (b * num_v_heads + h) * dv;
            const float* next = h + 1 < num_v_heads ? state + (h + 1) * dk * dv : next_row;
            head_step(state + h * dk * dv, q + kh * dk, k + kh * dk, v + h * dv, g_row[h], beta_row[h], dk, dv, o,
                      next);
            if (gated != nullptr)
                gated_rms_norm(o, gated->z + b * gated->ld_z + h * dv, gated->norm_weight, gated->eps, dv);
        }
    }
}

}  // namespace

// mixed: [B, C] pre-conv q|k|v inputs (row stride ld_mixed), C = 2 Hk Dk + Hv Dv;
// conv_states: the layer's conv pool [S, C, K-1]; conv_weight: [C, K]; rec_states: the layer's
// recurrent pool [S, Hv, Dk, Dv]; slots: [B] each row's pool slot (distinct); g, beta: [B, Hv]
// (row stride ldg); out: [B, Hv, Dv]. All contiguous float32 but mixed / g / beta rows. Value
// head h reads key head h / (Hv / Hk).
extern "C" void gdn_decode_f32(const float* mixed, int64_t ld_mixed, float* conv_states, const float* conv_weight,
                               int64_t kernel, float* rec_states, const int64_t* slots, const float* g,
                               const float* beta, int64_t ldg, int64_t batch, int64_t num_k_heads,
                               int64_t num_v_heads, int64_t dk, int64_t dv, float* out) {
    decode_rows(mixed, ld_mixed, conv_states, conv_weight, kernel, rec_states, slots, g, beta, ldg, nullptr, batch,
                num_k_heads, num_v_heads, dk, dv, out);
}

// As gdn_decode_f32, with the gates computed from the raw projections a, b [B, Hv] (row stride
// ld_ab) and the constants neg_rate = -exp(A_log), dt_bias [Hv], and each head's output passed
// through the GatedRMSNorm (weight [Dv], eps) gated by z [B, Hv * Dv] (row stride ld_z):
// out [B, Hv, Dv] is what the layer's out_proj reads.
extern "C" void gdn_decode_gated_f32(const float* mixed, int64_t ld_mixed, float* conv_states,
                                     const float* conv_weight, int64_t kernel, float* rec_states,
                                     const int64_t* slots, const float* a, const float* b, int64_t ld_ab,
                                     const float* neg_rate, const float* dt_bias, const float* z, int64_t ld_z,
                                     const float* norm_weight, float eps, int64_t batch, int64_t num_k_heads,
                                     int64_t num_v_heads, int64_t dk, int64_t dv, float* out) {
    const Gated gated{a, b, z, ld_ab, ld_z, neg_rate, dt_bias, norm_weight, eps};
    decode_rows(mixed, ld_mixed, conv_states, conv_weight, kernel, rec_states, slots, nullptr, nullptr, 0, &gated,
                batch, num_k_heads, num_v_heads, dk, dv, out);
}
