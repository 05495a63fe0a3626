// Decode attention over the paged KV store, one call per layer for all rows: each row's query
// heads attend to its own context, read block by block through its block table (no gathered
// copy of K/V), and the output is multiplied by sigmoid(gate) (Qwen3.5's per-head output gate)
// and written as [B, H * D], what o_proj reads.
//
// The torch path gathers every row's blocks into a dense [B, S, Hkv, D] copy per layer (two
// index_selects: at batch 32 and 100 tokens, 0.8 ms of the tiny model's 6 ms step) and then runs
// SDPA over it. Here, per row and KV head, the G = H / Hkv query heads sharing it each take a pass
// over the keys (scores) and a softmax over the context, then a pass over the values with the
// outputs held in registers. The next row's blocks are prefetched into L2 while a row is computed
// (a short context's scattered rows otherwise cost one memory miss after another: at smol's b32
// this was 1.9 ms a step against 0.4 ms for the bytes read), so the G passes read from cache.
// Vector code through vec.h: AVX2 or AVX-512.
#include <math.h>
#include <stdint.h>

#include "vec.h"

#include <vector>

namespace {

constexpr int W = vec::W;

// The store's elements: float32, or bf16 (a bf16 model's store) widened to float32 as they are read.
inline vec::V load_kv(const float* p) { return vec::load(p); }
inline vec::V load_kv(const uint16_t* p) { return vec::load_bf16(p); }
inline float kv_at(const float* p, int64_t i) { return p[i]; }
inline float kv_at(const uint16_t* p, int64_t i) {
    const uint32_t bits = (uint32_t)p[i] << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

template <typename S>
inline float dot(const float* a, const S* b, int64_t n) {
    int64_t i = 0;
    vec::V acc = vec::zero();
    for (; i + W <= n; i += W) acc = vec::fmadd(vec::load(a + i), load_kv(b + i), acc);
    float sum = vec::hsum(acc);
    for (; i < n; ++i) sum += a[i] * kv_at(b, i);
    return sum;
}

// s[t] = scale * q . keys[offsets[t]] for t < n: eight positions at a time share one reduction.
template <typename S>
void scores_row(const float* q, const S* keys, const int64_t* offsets, int64_t n, int64_t dim, float scale,
                float* s) {
    int64_t t = 0;
    if (dim % W == 0) {
        for (; t + 8 <= n; t += 8) {
            vec::V acc[8];
            for (int j = 0; j < 8; ++j) acc[j] = vec::zero();
            for (int64_t d = 0; d < dim; d += W) {
                const vec::V qv = vec::load(q + d);
                for (int j = 0; j < 8; ++j) acc[j] = vec::fmadd(qv, load_kv(keys + offsets[t + j] + d), acc[j]);
            }
            vec::hsum8_scaled(acc, scale, s + t);
        }
    }
    for (; t < n; ++t) s[t] = dot(q, keys + offsets[t], dim) * scale;
}

// s[0..n) = softmax(s[0..n)).
void softmax(float* s, int64_t n) {
    float top = s[0];
    for (int64_t t = 1; t < n; ++t) top = s[t] > top ? s[t] : top;
    const vec::V top_v = vec::set1(top);
    vec::V total_v = vec::zero();
    int64_t t = 0;
    for (; t + W <= n; t += W) {
        const vec::V e = vec::exp(vec::sub(vec::load(s + t), top_v));
        vec::store(s + t, e);
        total_v = vec::add(total_v, e);
    }
    float total = vec::hsum(total_v);
    for (; t < n; ++t) {
        s[t] = expf(s[t] - top);
        total += s[t];
    }
    const float inv = 1.0f / total;
    for (t = 0; t < n; ++t) s[t] *= inv;
}

// o[g] = sum_t p[g][t] * v[t] for the G query heads of a KV head (p: [G, context] softmaxed scores,
// o: [G, D]): D in chunks of up to four vectors kept in registers over the whole context, rather
// than loaded and stored back per position. Each element is still summed over t in order, from 0.
template <typename S>
void weighted_values(const float* p, int64_t context, int64_t group, const S* v_head, const int64_t* offsets,
                     int64_t dim, float* o) {
    for (int64_t g = 0; g < group; ++g) {
        const float* pg = p + g * context;
        float* og = o + g * dim;
        int64_t d = 0;
        for (; d + 4 * W <= dim; d += 4 * W) {
            vec::V a0 = vec::zero(), a1 = vec::zero(), a2 = vec::zero(), a3 = vec::zero();
            for (int64_t t = 0; t < context; ++t) {
                const S* v = v_head + offsets[t] + d;
                const vec::V w = vec::set1(pg[t]);
                a0 = vec::fmadd(w, load_kv(v), a0);
                a1 = vec::fmadd(w, load_kv(v + W), a1);
                a2 = vec::fmadd(w, load_kv(v + 2 * W), a2);
                a3 = vec::fmadd(w, load_kv(v + 3 * W), a3);
            }
            vec::store(og + d, a0);
            vec::store(og + d + W, a1);
            vec::store(og + d + 2 * W, a2);
            vec::store(og + d + 3 * W, a3);
        }
        for (; d + W <= dim; d += W) {
            vec::V a = vec::zero();
            for (int64_t t = 0; t < context; ++t) a = vec::fmadd(vec::set1(pg[t]), load_kv(v_head + offsets[t] + d), a);
            vec::store(og + d, a);
        }
        for (; d < dim; ++d) {
            float a = 0.0f;
            for (int64_t t = 0; t < context; ++t) a += pg[t] * kv_at(v_head + offsets[t], d);
            og[d] = a;
        }
    }
}

// Every line of one row's context in both stores (all KV heads: a block's positions are
// contiguous) requested into L2. Issued two rows ahead: the row's scattered blocks then arrive
// while the rows before are computed, instead of one miss at a time as its positions are read.
template <typename S>
void prefetch_row(const S* keys, const S* values, const int64_t* table, int64_t context, int64_t block_size,
                  int64_t token_stride) {
    constexpr int64_t line = 64 / sizeof(S);  // elements per cache line
    for (int64_t i = 0, t = 0; t < context; ++i, t += block_size) {
        const int64_t n = (context - t < block_size ? context - t : block_size) * token_stride;
        const S* k = keys + table[i] * block_size * token_stride;
        const S* v = values + table[i] * block_size * token_stride;
        for (int64_t e = 0; e < n; e += line) {
            vec::prefetch_l2(k + e);
            vec::prefetch_l2(v + e);
        }
        vec::prefetch_l2(k + n - 1);  // the last line, where the block does not start on a line
        vec::prefetch_l2(v + n - 1);
    }
}

// o[0..n) *= sigmoid(gate[0..n))
void gate_row(float* o, const float* gate, int64_t n) {
    int64_t i = 0;
    const vec::V one = vec::set1(1.0f);
    for (; i + W <= n; i += W) {
        const vec::V e = vec::exp(vec::sub(vec::zero(), vec::load(gate + i)));
        vec::store(o + i, vec::div(vec::load(o + i), vec::add(one, e)));
    }
    for (; i < n; ++i) o[i] *= 1.0f / (1.0f + expf(-gate[i]));
}

}  // namespace

// The new K/V of the batch's rows, written into the store before attending (null: already written),
// in the store's element type.
template <typename S>
struct NewKVOf {
    const S *keys, *values;           // [B, Hkv, D], D contiguous
    int64_t ldk_row, ldk_head, ldv_row, ldv_head;
    const int64_t* slots;             // [B] flat store slots, block * block_size + offset
};
using NewKV = NewKVOf<float>;

namespace {

// The decode attention of every row (see paged_decode_attention_f32) over a store of element S.
template <typename S>
int attend(const float* q, int64_t ldq_row, int64_t ldq_head, S* keys, S* values, int64_t num_blocks,
           int64_t block_size, const int64_t* block_tables, int64_t ld_table, int64_t table_width,
           const int64_t* context_lens, const float* gate, int64_t ldg_row, int64_t ldg_head,
           const NewKVOf<S>* new_kv, int64_t batch, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
           float scale, float* out) {
    for (int64_t b = 0; b < batch; ++b) {
        const int64_t context = context_lens[b];
        if (context < 1 || context > table_width * block_size) return -1;
        for (int64_t i = 0; i < (context + block_size - 1) / block_size; ++i) {
            const int64_t block = block_tables[b * ld_table + i];
            if (block < 0 || block >= num_blocks) return -1;
        }
        if (new_kv != nullptr && (new_kv->slots[b] < 0 || new_kv->slots[b] >= num_blocks * block_size)) return -1;
    }
    if (new_kv != nullptr) {
        for (int64_t b = 0; b < batch; ++b)
            for (int64_t kh = 0; kh < num_kv_heads; ++kh) {
                const int64_t at = (new_kv->slots[b] * num_kv_heads + kh) * head_dim;
                const S* k = new_kv->keys + b * new_kv->ldk_row + kh * new_kv->ldk_head;
                const S* v = new_kv->values + b * new_kv->ldv_row + kh * new_kv->ldv_head;
                for (int64_t d = 0; d < head_dim; ++d) {
                    keys[at + d] = k[d];
                    values[at + d] = v[d];
                }
            }
    }
    const int64_t group = num_heads / num_kv_heads;
    const int64_t token_stride = num_kv_heads * head_dim;  // floats between positions in a block
    std::vector<int64_t> offsets;  // each visible position's offset in the store (KV head 0)
    std::vector<float> scores;     // [G, context]
    // Rows prefetched ahead of the one computed: two (bench/paged_attention.py: one row ahead
    // measured ~8% slower, four no faster; a row at smol's b32 is ~60 KB, computed in ~2 us).
    constexpr int64_t ahead = 2;
    for (int64_t b = 0; b < ahead && b < batch; ++b)
        prefetch_row(keys, values, block_tables + b * ld_table, context_lens[b], block_size, token_stride);
    for (int64_t b = 0; b < batch; ++b) {
        const int64_t context = context_lens[b];
        const int64_t* table = block_tables + b * ld_table;
        if (b + ahead < batch)
            prefetch_row(keys, values, table + ahead * ld_table, context_lens[b + ahead], block_size, token_stride);
        offsets.resize((size_t)context);
        for (int64_t t = 0, i = 0; t < context; ++i)
            for (int64_t off = 0; off < block_size && t < context; ++off, ++t)
                offsets[t] = (table[i] * block_size + off) * token_stride;
        scores.resize((size_t)(group * context));
        for (int64_t kh = 0; kh < num_kv_heads; ++kh) {
            const S* k_head = keys + kh * head_dim;
            const S* v_head = values + kh * head_dim;
            float* o_group = out + (b * num_heads + kh * group) * head_dim;  // [G, D]
            for (int64_t g = 0; g < group; ++g) {
                float* s = scores.data() + g * context;
                scores_row(q + b * ldq_row + (kh * group + g) * ldq_head, k_head, offsets.data(), context, head_dim,
                           scale, s);
                softmax(s, context);
            }
            weighted_values(scores.data(), context, group, v_head, offsets.data(), head_dim, o_group);
        }
        if (gate != nullptr)
            for (int64_t h = 0; h < num_heads; ++h)
                gate_row(out + (b * num_heads + h) * head_dim, gate + b * ldg_row + h * ldg_head, head_dim);
    }
    return 0;
}

}  // namespace

// q: [B, H, D] (strides ldq_row, ldq_head; D contiguous); keys, values: the layer's store
// [num_blocks, block_size, Hkv, D] contiguous; block_tables: [B, W] (row stride ld_table);
// context_lens: [B] tokens each row sees (1 .. W * block_size); gate: [B, H, D] (strides
// ldg_row, ldg_head) or null for no gate; new_kv: the rows' own K/V to write first, or null;
// out: [B, H * D] contiguous. Query head h reads KV head h / (H / Hkv). scale multiplies the
// scores (1 / sqrt(D) for SDPA's default). Returns 0, or -1 (nothing written) when a context
// length is outside 1 .. W * block_size, a block id it reaches is outside 0 .. num_blocks - 1 or
// a new K/V slot is outside the store: a bad table is an error, never an access out of bounds.
extern "C" int paged_decode_attention_f32(const float* q, int64_t ldq_row, int64_t ldq_head, float* keys,
                                          float* values, int64_t num_blocks, int64_t block_size,
                                          const int64_t* block_tables, int64_t ld_table, int64_t table_width,
                                          const int64_t* context_lens, const float* gate, int64_t ldg_row,
                                          int64_t ldg_head, const NewKV* new_kv, int64_t batch, int64_t num_heads,
                                          int64_t num_kv_heads, int64_t head_dim, float scale, float* out) {
    return attend(q, ldq_row, ldq_head, keys, values, num_blocks, block_size, block_tables, ld_table, table_width,
                  context_lens, gate, ldg_row, ldg_head, new_kv, batch, num_heads, num_kv_heads, head_dim, scale, out);
}

// The same over a bf16 store (bits as uint16; the new K/V bf16 too, copied as they are): q, gate
// and out stay float32, each K and V element is widened as it is read.
extern "C" int paged_decode_attention_bf16(const float* q, int64_t ldq_row, int64_t ldq_head, uint16_t* keys,
                                           uint16_t* values, int64_t num_blocks, int64_t block_size,
                                           const int64_t* block_tables, int64_t ld_table, int64_t table_width,
                                           const int64_t* context_lens, const float* gate, int64_t ldg_row,
                                           int64_t ldg_head, const NewKVOf<uint16_t>* new_kv, int64_t batch,
                                           int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, float scale,
                                           float* out) {
    return attend(q, ldq_row, ldq_head, keys, values, num_blocks, block_size, block_tables, ld_table, table_width,
                  context_lens, gate, ldg_row, ldg_head, new_kv, batch, num_heads, num_kv_heads, head_dim, scale, out);
}
