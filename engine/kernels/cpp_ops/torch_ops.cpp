// The native decode kernels as torch operators with C++ CPU kernels (namespace chunkscope_native),
// so a call is a dispatcher call: no Python, no ctypes marshalling.
//
// The ctypes entry points (skinny_gemm.py, gdn_step.py, paged_attention.py) cost 10-50 us of
// Python a call (argument checks, data_ptr()s, ctypes conversion); the tiny model's b32 decode
// step makes 21 such calls (17 GEMMs, 3 GDN steps, 1 attention), as much as its arithmetic. Here
// the same checks are a few C++ comparisons. The kernels are the existing sources, compiled into
// this library beside this file and called through their extern "C" functions (declared below:
// keep them in step with the sources; tests/engine/kernels/test_torch_ops.py compares every op with the
// ctypes path). Schemas as engine/kernels/custom_ops.py's Python ops, plus skinny_linear and swiglu_linear.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <initializer_list>

extern "C" {
void packed_gemm_f32(const float* x, int64_t ldx, const float* packed, const float* bias, float* y, int64_t ldy,
                     int64_t m_rows, int64_t n_cols, int64_t k);
void swiglu_gemm_f32(const float* x, int64_t ldx, const float* packed, float* y, int64_t ldy, int64_t m_rows,
                     int64_t inter, int64_t k);
void packed_gemm_bf16(const uint16_t* x, int64_t ldx, const uint16_t* packed, const uint16_t* bias, uint16_t* y,
                      int64_t ldy, int64_t m_rows, int64_t n_cols, int64_t k);
void swiglu_gemm_bf16(const uint16_t* x, int64_t ldx, const uint16_t* packed, uint16_t* y, int64_t ldy,
                      int64_t m_rows, int64_t inter, int64_t k);
void gdn_decode_gated_f32(const float* mixed, int64_t ld_mixed, float* conv_states, const float* conv_weight,
                          int64_t kernel, float* rec_states, const int64_t* slots, const float* a, const float* b,
                          int64_t ld_ab, const float* neg_rate, const float* dt_bias, const float* z, int64_t ld_z,
                          const float* norm_weight, float eps, int64_t batch, int64_t num_k_heads,
                          int64_t num_v_heads, int64_t dk, int64_t dv, float* out);
struct NewKV {  // paged_attention.cpp's NewKV, field for field (over a bf16 store the K/V point at bf16: its NewKVOf<uint16_t>)
    const float *keys, *values;
    int64_t ldk_row, ldk_head, ldv_row, ldv_head;
    const int64_t* slots;
};
int paged_decode_attention_f32(const float* q, int64_t ldq_row, int64_t ldq_head, float* keys, float* values,
                               int64_t num_blocks, int64_t block_size, const int64_t* block_tables, int64_t ld_table,
                               int64_t table_width, const int64_t* context_lens, const float* gate, int64_t ldg_row,
                               int64_t ldg_head, const NewKV* new_kv, int64_t batch, int64_t num_heads,
                               int64_t num_kv_heads, int64_t head_dim, float scale, float* out);
int paged_decode_attention_bf16(const float* q, int64_t ldq_row, int64_t ldq_head, uint16_t* keys, uint16_t* values,
                                int64_t num_blocks, int64_t block_size, const int64_t* block_tables, int64_t ld_table,
                                int64_t table_width, const int64_t* context_lens, const float* gate, int64_t ldg_row,
                                int64_t ldg_head, const NewKV* new_kv, int64_t batch, int64_t num_heads,
                                int64_t num_kv_heads, int64_t head_dim, float scale, float* out);
}

namespace {

constexpr int64_t kPanelCols = 16;  // skinny_gemm.cpp's NR
using Tensors = std::initializer_list<const at::Tensor*>;

bool is_f32_cpu(const at::Tensor& t) { return t.scalar_type() == at::kFloat && t.device().is_cpu(); }
// The GEMMs' dtypes (skinny_gemm.py's KINDS): float32, or bf16 with a k pair per column per packed line.
bool is_gemm_cpu(const at::Tensor& t) {
    return (t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16) && t.device().is_cpu();
}
int64_t per_col(const at::Tensor& t) { return t.scalar_type() == at::kBFloat16 ? 2 : 1; }
const uint16_t* bf16_bits(const at::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr()); }

// t itself where its last dim has unit stride (what the kernels index), else a contiguous copy.
at::Tensor unit_inner(const at::Tensor& t) { return t.stride(-1) == 1 ? t : t.contiguous(); }

// Whether packed [ceil(cols / per_panel), lines, 16 * per_col] fits x [M, K] of its dtype.
bool packed_fits(const at::Tensor& packed, const at::Tensor& x, int64_t cols, int64_t per_panel) {
    const int64_t pc = per_col(x);
    return packed.scalar_type() == x.scalar_type() && packed.dim() == 3 &&
           packed.size(0) == (cols + per_panel - 1) / per_panel && packed.size(1) == (x.size(1) + pc - 1) / pc &&
           packed.size(2) == kPanelCols * pc && packed.is_contiguous();
}

// x [M, K] @ W^T (+ bias [N]) -> [M, N] from packed = skinny_gemm.pack(W): float32 [ceil(N / 16), K, 16]
// or bf16 [ceil(N / 16), ceil(K / 2), 32], x and bias of the same dtype.
at::Tensor skinny_linear(const at::Tensor& x_in, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                         int64_t out_cols) {
    TORCH_CHECK(x_in.dim() == 2 && is_gemm_cpu(x_in), "skinny_linear: x must be float32 or bf16 CPU [M, K]");
    const at::Tensor x = unit_inner(x_in);
    const int64_t rows = x.size(0), inner = x.size(1);
    TORCH_CHECK(packed_fits(packed, x, out_cols, kPanelCols), "skinny_linear: packed ", packed.sizes(),
                " does not fit x ", x.sizes(), " and ", out_cols, " columns");
    at::Tensor bias_c;
    if (bias.has_value()) {
        TORCH_CHECK(bias->scalar_type() == x.scalar_type() && bias->dim() == 1 && bias->size(0) == out_cols,
                    "skinny_linear: bad bias");
        bias_c = bias->contiguous();
    }
    at::Tensor y = at::empty({rows, out_cols}, x.options());
    if (rows == 0) return y;
    if (x.scalar_type() == at::kBFloat16)
        packed_gemm_bf16(bf16_bits(x), x.stride(0), bf16_bits(packed), bias_c.defined() ? bf16_bits(bias_c) : nullptr,
                         reinterpret_cast<uint16_t*>(y.data_ptr()), out_cols, rows, out_cols, inner);
    else
        packed_gemm_f32(x.data_ptr<float>(), x.stride(0), packed.data_ptr<float>(),
                        bias_c.defined() ? bias_c.data_ptr<float>() : nullptr, y.data_ptr<float>(), out_cols, rows,
                        out_cols, inner);
    return y;
}

// SiLU(x @ G^T) * (x @ U^T) -> [M, I] from packed = swiglu_gemm.pack(gate_up, I) ([ceil(I / 8), ...], as skinny_linear).
at::Tensor swiglu_linear(const at::Tensor& x_in, const at::Tensor& packed, int64_t intermediate) {
    TORCH_CHECK(x_in.dim() == 2 && is_gemm_cpu(x_in), "swiglu_linear: x must be float32 or bf16 CPU [M, K]");
    const at::Tensor x = unit_inner(x_in);
    const int64_t rows = x.size(0), inner = x.size(1);
    TORCH_CHECK(packed_fits(packed, x, intermediate, kPanelCols / 2), "swiglu_linear: packed ", packed.sizes(),
                " does not fit x ", x.sizes(), " and ", intermediate, " columns");
    at::Tensor y = at::empty({rows, intermediate}, x.options());
    if (rows == 0) return y;
    if (x.scalar_type() == at::kBFloat16)
        swiglu_gemm_bf16(bf16_bits(x), x.stride(0), bf16_bits(packed), reinterpret_cast<uint16_t*>(y.data_ptr()),
                         intermediate, rows, intermediate, inner);
    else
        swiglu_gemm_f32(x.data_ptr<float>(), x.stride(0), packed.data_ptr<float>(), y.data_ptr<float>(), intermediate,
                        rows, intermediate, inner);
    return y;
}

// gdn_step.decode_gated on linear layer `layer` of the whole pools conv [L, S, C, K-1] and
// recurrent [L, S, Hv, Dk, Dv], updated in place at `slots` -> [B, Hv * Dv].
at::Tensor gdn_decode_gated(const at::Tensor& mixed_in, at::Tensor& conv_pool, at::Tensor& rec_pool, int64_t layer,
                            const at::Tensor& conv_weight_in, const at::Tensor& slots_in, const at::Tensor& a_in,
                            const at::Tensor& b_in, const at::Tensor& neg_rate_in, const at::Tensor& dt_bias_in,
                            const at::Tensor& z_in, const at::Tensor& norm_weight_in, double eps, int64_t num_k_heads,
                            int64_t key_dim, int64_t value_dim) {
    for (const at::Tensor* t : Tensors{&mixed_in, &conv_pool, &rec_pool, &conv_weight_in, &a_in, &b_in, &neg_rate_in,
                                       &dt_bias_in, &z_in, &norm_weight_in})
        TORCH_CHECK(is_f32_cpu(*t), "gdn_decode_gated: float32 CPU tensors only");
    TORCH_CHECK(conv_pool.dim() == 4 && rec_pool.dim() == 5 && conv_pool.is_contiguous() && rec_pool.is_contiguous(),
                "gdn_decode_gated: the pools must be contiguous [L, S, C, K-1] and [L, S, Hv, Dk, Dv]");
    TORCH_CHECK(layer >= 0 && layer < conv_pool.size(0) && layer < rec_pool.size(0), "gdn_decode_gated: layer ",
                layer, " outside the pools");
    const at::Tensor mixed = unit_inner(mixed_in), z = unit_inner(z_in);
    // The kernel reads a and b with one row stride (both are views of the same projection output).
    at::Tensor a = unit_inner(a_in), b = unit_inner(b_in);
    if (a.strides() != b.strides()) {
        a = a.contiguous();
        b = b.contiguous();
    }
    const at::Tensor conv_weight = conv_weight_in.contiguous(), slots = slots_in.contiguous();
    const at::Tensor neg_rate = neg_rate_in.contiguous(), dt_bias = dt_bias_in.contiguous();
    const at::Tensor norm_weight = norm_weight_in.contiguous();
    const int64_t batch = mixed.size(0), channels = mixed.size(1), value_heads = rec_pool.size(2);
    const int64_t slots_total = conv_pool.size(1);
    TORCH_CHECK(mixed.dim() == 2 && channels == 2 * num_k_heads * key_dim + value_heads * value_dim &&
                    conv_pool.size(2) == channels && conv_weight.dim() == 2 && conv_weight.size(0) == channels &&
                    conv_weight.size(1) == conv_pool.size(3) + 1 && rec_pool.size(1) == slots_total &&
                    rec_pool.size(3) == key_dim && rec_pool.size(4) == value_dim && num_k_heads > 0 &&
                    value_heads % num_k_heads == 0,
                "gdn_decode_gated: shapes do not fit (mixed ", mixed.sizes(), ", conv pool ", conv_pool.sizes(),
                ", recurrent pool ", rec_pool.sizes(), ")");
    TORCH_CHECK(a.dim() == 2 && a.size(0) == batch && a.size(1) == value_heads && b.sizes() == a.sizes() &&
                    neg_rate.numel() == value_heads && dt_bias.numel() == value_heads && z.dim() == 2 &&
                    z.size(0) == batch && z.size(1) == value_heads * value_dim && norm_weight.numel() == value_dim,
                "gdn_decode_gated: gate or norm shapes do not fit");
    TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.size(0) == batch,
                "gdn_decode_gated: slots must be long [B]");
    const int64_t* slot_ids = slots.data_ptr<int64_t>();
    for (int64_t i = 0; i < batch; ++i)
        TORCH_CHECK(slot_ids[i] >= 0 && slot_ids[i] < slots_total, "gdn_decode_gated: slot ", slot_ids[i],
                    " outside the pool");
    at::Tensor out = at::empty({batch, value_heads * value_dim}, mixed.options());
    const int64_t conv_stride = conv_pool.stride(0), rec_stride = rec_pool.stride(0);
    gdn_decode_gated_f32(mixed.data_ptr<float>(), mixed.stride(0), conv_pool.data_ptr<float>() + layer * conv_stride,
                         conv_weight.data_ptr<float>(), conv_weight.size(1),
                         rec_pool.data_ptr<float>() + layer * rec_stride, slot_ids, a.data_ptr<float>(),
                         b.data_ptr<float>(), a.stride(0), neg_rate.data_ptr<float>(), dt_bias.data_ptr<float>(),
                         z.data_ptr<float>(), z.stride(0), norm_weight.data_ptr<float>(), static_cast<float>(eps),
                         batch, num_k_heads, value_heads, key_dim, value_dim, out.data_ptr<float>());
    return out;
}

// Writes new_keys / new_values [B, Hkv, D] at flat kv_slots [B] of the store keys / values
// [N, block, Hkv, D], then each row's gated attention over its context -> [B, H * D].
at::Tensor paged_decode_attention(const at::Tensor& q_in, const at::Tensor& new_keys_in,
                                  const at::Tensor& new_values_in, at::Tensor& keys, at::Tensor& values,
                                  const at::Tensor& kv_slots_in, const at::Tensor& block_tables_in,
                                  const at::Tensor& context_lens_in, const at::Tensor& gate_in) {
    // A float32 store, or a bf16 one (q and gate widened here, the output rounded back to bf16).
    const at::ScalarType dtype = keys.scalar_type();
    for (const at::Tensor* t : Tensors{&q_in, &new_keys_in, &new_values_in, &keys, &values, &gate_in})
        TORCH_CHECK(is_gemm_cpu(*t) && t->scalar_type() == dtype,
                    "paged_decode_attention: float32 or bf16 CPU tensors, all of one dtype");
    TORCH_CHECK(q_in.dim() == 3 && keys.dim() == 4 && keys.sizes() == values.sizes() && keys.is_contiguous() &&
                    values.is_contiguous() && gate_in.sizes() == q_in.sizes(),
                "paged_decode_attention: q, gate [B, H, D] and a contiguous store [N, block, Hkv, D]");
    const at::Tensor q = unit_inner(q_in.to(at::kFloat)), gate = unit_inner(gate_in.to(at::kFloat));
    const at::Tensor new_keys = unit_inner(new_keys_in), new_values = unit_inner(new_values_in);
    const at::Tensor kv_slots = kv_slots_in.contiguous(), context_lens = context_lens_in.contiguous();
    const at::Tensor block_tables = unit_inner(block_tables_in);
    const int64_t batch = q.size(0), heads = q.size(1), head_dim = q.size(2);
    const int64_t num_blocks = keys.size(0), block_size = keys.size(1), kv_heads = keys.size(2);
    TORCH_CHECK(keys.size(3) == head_dim && kv_heads > 0 && heads % kv_heads == 0,
                "paged_decode_attention: head counts or dims do not fit");
    TORCH_CHECK(new_keys.dim() == 3 && new_keys.size(0) == batch && new_keys.size(1) == kv_heads &&
                    new_keys.size(2) == head_dim && new_values.sizes() == new_keys.sizes(),
                "paged_decode_attention: new K/V must be [B, Hkv, D]");
    TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong &&
                    kv_slots.scalar_type() == at::kLong && block_tables.dim() == 2 && block_tables.size(0) == batch &&
                    context_lens.numel() == batch && kv_slots.numel() == batch,
                "paged_decode_attention: block tables [B, W], context lens [B] and slots [B], long");
    at::Tensor out = at::empty({batch, heads * head_dim}, q.options());
    // The new K/V pointers in the store's element type (the struct's fields are pointers either way).
    const NewKV write{static_cast<const float*>(new_keys.data_ptr()), static_cast<const float*>(new_values.data_ptr()),
                      new_keys.stride(0), new_keys.stride(1), new_values.stride(0), new_values.stride(1),
                      kv_slots.data_ptr<int64_t>()};
    const float scale = static_cast<float>(std::pow(static_cast<double>(head_dim), -0.5));
    const int status =
        dtype == at::kBFloat16
            ? paged_decode_attention_bf16(q.data_ptr<float>(), q.stride(0), q.stride(1),
                                          reinterpret_cast<uint16_t*>(keys.data_ptr()),
                                          reinterpret_cast<uint16_t*>(values.data_ptr()), num_blocks, block_size,
                                          block_tables.data_ptr<int64_t>(), block_tables.stride(0), block_tables.size(1),
                                          context_lens.data_ptr<int64_t>(), gate.data_ptr<float>(), gate.stride(0),
                                          gate.stride(1), &write, batch, heads, kv_heads, head_dim, scale,
                                          out.data_ptr<float>())
            : paged_decode_attention_f32(q.data_ptr<float>(), q.stride(0), q.stride(1), keys.data_ptr<float>(),
                                         values.data_ptr<float>(), num_blocks, block_size,
                                         block_tables.data_ptr<int64_t>(), block_tables.stride(0), block_tables.size(1),
                                         context_lens.data_ptr<int64_t>(), gate.data_ptr<float>(), gate.stride(0),
                                         gate.stride(1), &write, batch, heads, kv_heads, head_dim, scale,
                                         out.data_ptr<float>());
    TORCH_CHECK(status == 0, "paged decode attention: a context length outside 1 .. ", block_tables.size(1) * block_size,
                ", a block id outside 0 .. ", num_blocks - 1, " or a new K/V slot outside the store");
    return dtype == at::kFloat ? out : out.to(dtype);
}

}  // namespace

TORCH_LIBRARY(chunkscope_native, m) {
    m.def("skinny_linear(Tensor x, Tensor packed, Tensor? bias, int out_cols) -> Tensor");
    m.def("swiglu_linear(Tensor x, Tensor packed, int intermediate) -> Tensor");
    m.def("gdn_decode_gated(Tensor mixed, Tensor(a!) conv_pool, Tensor(b!) rec_pool, int layer, Tensor conv_weight, "
          "Tensor slots, Tensor a, Tensor b, Tensor neg_rate, Tensor dt_bias, Tensor z, Tensor norm_weight, "
          "float eps, int num_k_heads, int key_dim, int value_dim) -> Tensor");
    m.def("paged_decode_attention(Tensor q, Tensor new_keys, Tensor new_values, Tensor(a!) keys, Tensor(b!) values, "
          "Tensor kv_slots, Tensor block_tables, Tensor context_lens, Tensor gate) -> Tensor");
}

TORCH_LIBRARY_IMPL(chunkscope_native, CPU, m) {
    m.impl("skinny_linear", &skinny_linear);
    m.impl("swiglu_linear", &swiglu_linear);
    m.impl("gdn_decode_gated", &gdn_decode_gated);
    m.impl("paged_decode_attention", &paged_decode_attention);
}
