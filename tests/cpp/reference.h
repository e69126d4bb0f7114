// Float64 references for the moelora ops, and the random-data helpers the tests and
// the benchmark share. No GoogleTest and no moelora backend in here: plain loops in
// double over dtype-rounded inputs, with no intermediate rounding, so the reference
// is the exact layer up to double rounding.
//
// Layouts: every std::vector<double> is a row-major contiguous tensor; shapes are in
// the comments as [dim0, dim1, ...]. Slot s = m * top_k + j names token m's j-th expert.
#pragma once

#include <cstdint>
#include <random>
#include <vector>

#include "moelora/ops.h"
#include "moelora/tensor.h"

namespace moelora::ref {

// ---- data in a DType, as raw bytes ----------------------------------------------------
// bf16 and fp16 are uint16_t bit patterns, fp32 a float, ints int32_t/int64_t.

// Writes `count` contiguous elements of `dtype` at `data`: normal(0, scale) draws rounded
// to the dtype (round to nearest even). Deterministic for a given rng state; consumes a
// fixed number of draws from `rng` (the work is split over threads with sub-seeds).
// Float dtypes only.
void fill_normal(DType dtype, void* data, int64_t count, std::mt19937& rng, double scale = 1.0);

// Element `index` (in elements) of a `dtype` buffer, as a double (exact for every dtype;
// int64 beyond 2^53 rounds).
double read_element(DType dtype, const void* data, int64_t index);
// Writes `value` rounded to `dtype` (floats round to nearest even; ints truncate).
void write_element(DType dtype, void* data, int64_t index, double value);
// `count` contiguous elements as doubles.
std::vector<double> to_double(DType dtype, const void* data, int64_t count);
// Rounds every value to `dtype` and back (what storing then loading does).
std::vector<double> round_to(DType dtype, const std::vector<double>& values);

// Σ x[i] · y[i] over count elements in double, in the references' fixed order of sums.
double dot_product(const double* x, const double* y, int64_t count);

// ||out - ref||_2 / ||ref||_2. +inf when out holds a NaN or an inf, or the sizes differ;
// ||out||_2 when ref is all zeros (so an all-zero reference wants an all-zero output).
double rel_error(const std::vector<double>& out, const std::vector<double>& ref);

// The tolerance on rel_error for a whole op or layer computed in `dtype` with fp32
// accumulation: fp32 1e-5, fp16 5e-3, bf16 1e-2.
double tolerance(DType dtype);

// ---- references ----------------------------------------------------------------------

// The expert GEMM of fused_moe, per slot:
//   out[s, n] = Σ_k a[s / top_k, k] · w[slot_expert[s], n, k]  (× slot_weight[s] when given)
//   out[s, :] = 0 when slot_expert[s] == -1 (dropped slot, or its expert is on another rank).
// a [num_rows, K], w [E, N, K], slot_expert [num_rows * top_k] local expert ids or -1,
// slot_weight [num_rows * top_k] or null. Returns [num_rows * top_k, N].
std::vector<double> reference_moe_gemm(const std::vector<double>& a, const std::vector<double>& w,
                                       const std::vector<int64_t>& slot_expert, const double* slot_weight,
                                       int64_t num_rows, int64_t top_k, int64_t N, int64_t K);

// Gated activation: input [rows, 2 * width] -> [rows, width].
//   kSilu:      silu(g) * u, g = input[:, :width], u = input[:, width:]
//   kGelu:      gelu_erf(g) * u (same halves)
//   kSwigluOai: g = input[:, 0::2], u = input[:, 1::2]; g = min(g, limit);
//               u = clamp(u, -limit, limit); (u + 1) * g * sigmoid(alpha * g)
std::vector<double> reference_activation(Activation activation, const std::vector<double>& input, int64_t rows,
                                         int64_t width, double alpha = 1.702, double limit = 7.0);

// input [M, top_k, H] -> [M, H]: scale * Σ_j input[m, j, :].
std::vector<double> reference_sum_reduce(const std::vector<double>& input, int64_t M, int64_t top_k, int64_t H,
                                         double scale);

// One expert GEMM's LoRA stacks in double: lora_a[c] [L, E, rank, K], lora_b[c]
// [L, E, N / num_slices, rank] for c < num_slices. Slice c holds output columns
// [c·N/S, (c+1)·N/S), or the columns n ≡ c (mod S) when interleaved.
struct RefLoraStack {
  int num_slices = 1;
  int64_t max_loras = 0, num_experts = 0, rank = 0, K = 0, N = 0;
  bool interleaved = false;
  std::vector<double> lora_a[2], lora_b[2];
};
// out_row[N] += scale · Σ_i lora_b[c][lora, expert, j, i] · Σ_k lora_a[c][lora, expert, i, k] · a_row[k]
// for every slice c and slice column j (no intermediate rounding).
void reference_lora_delta_row(const RefLoraStack& stack, int64_t lora, int64_t expert, const double* a_row,
                              double scale, double* out_row);
// A layer's adapters: the adapter of each token (-1: none; the caller resolves disabled
// slots to -1), the scale per slot, and both GEMMs' stacks.
struct RefLora {
  std::vector<int64_t> token_lora;  // [M]
  std::vector<double> scale;        // [L]
  RefLoraStack w13, w2;
};

// The whole MoE layer, as fused_experts computes it:
//   for token m, for j < top_k: e = topk_ids[m * top_k + j]
//     skip when e == -1 (dropped) or expert_map && expert_map[e] == -1 (not on this rank);
//     local = expert_map ? expert_map[e] : e;  w = topk_weights[m * top_k + j]
//     h1 = x[m] · w13[local]ᵀ                       [2I]  (× w when weight_on_input)
//     a  = activation(h1)                            [I]
//     h2 = a · w2[local]ᵀ                            [H]   (× w unless weight_on_input)
//   out[m] = routed_scaling_factor * Σ_j h2_j        [M, H]
//   no_combine: out[m, j] = h2_j (zeros for skipped slots), no scaling   [M, top_k, H]
// With lora, for a token with adapter l: h1 += delta13 (before the weight on input), and
// h2 = (a · w2[local]ᵀ + delta2) (× w).

// Quantized experts (RefQuant): w13 and w2 are the dequantized weights (element × scale),
// and the layer quantizes its activations as fused_experts does, per chunk of chunk_size
// tokens: x before GEMM1, and act (activation(h1), rounded to layer_dtype) before GEMM2,
// each by reference_quantize with the scheme's activation blocks (per token group of
// block_k, per row, or per tensor over the chunk's rows, static when given). h1 is
// rounded to layer_dtype before the activation, as on every path of the op (vLLM's
// semantics: GEMM1's output is a layer-dtype tensor).
struct RefQuant {
  DType element = DType::kFloat8E4M3;
  ScaleGranularity activation_scales = ScaleGranularity::kBlock;
  int64_t block_k = 128;
  double a13_scale = 0.0, a2_scale = 0.0;  // > 0: static per-tensor scales
  DType layer_dtype = DType::kBFloat16;
  int64_t chunk_size = 64 * 1024;
};

// values [batch, rows, cols] -> the dequantized values (q × scale) of moelora's quantize
// with blocks of block_rows x block_cols (0: the whole dim), computed in float exactly as
// the op does; scales_out (optional) gets the scales [batch, row blocks, col blocks].
// static_scale > 0: that scale for every block.
std::vector<double> reference_quantize(const std::vector<double>& values, int64_t batch, int64_t rows, int64_t cols,
                                       int64_t block_rows, int64_t block_cols, DType element,
                                       double static_scale = 0.0, std::vector<double>* scales_out = nullptr);

// values [rows, cols]: a layer's activations (x, or act by slot) -> the dequantized values
// of fused_experts' quantization of them, chunk by chunk of rows_per_chunk rows: per token
// group of quant.block_k, per row, or per tensor over the chunk's rows (static_scale > 0:
// that scale).
std::vector<double> reference_quantize_activations(const std::vector<double>& values, int64_t rows, int64_t cols,
                                                   int64_t rows_per_chunk, const RefQuant& quant, double static_scale);

// hidden_states [M, H], w13 [E_local, 2I, H] (gate rows first, then up; interleaved for
// kSwigluOai), w2 [E_local, H, I], topk_weights [M, top_k], topk_ids [M, top_k] global
// ids in [0, E_global) or -1, expert_map [E_global] (null: ids are local).
// Runs on several threads; every output element is one fixed-order sum.
std::vector<double> reference_fused_experts(const std::vector<double>& hidden_states,
                                            const std::vector<double>& w13, const std::vector<double>& w2,
                                            const std::vector<double>& topk_weights,
                                            const std::vector<int64_t>& topk_ids, int64_t M, int64_t top_k,
                                            int64_t num_local_experts, int64_t H, int64_t I,
                                            const int32_t* expert_map, Activation activation, double alpha,
                                            double limit, bool apply_router_weight_on_input, bool no_combine,
                                            double routed_scaling_factor, const RefLora* lora = nullptr,
                                            const RefQuant* quant = nullptr);

// Sparse MLA decode (sparse_mla_decode): q [T, Hq, 576], kv [S, 576], indices [T, topk].
// Entry i of token t is valid when i < topk_length[t] (when given) and indices[t, i] is in
// [0, S); duplicates count once each. For every (t, h):
//   s_i = scale · q[t, h] · kv[idx_i]   (valid i)
//   out[t, h] = Σ_i e^{s_i} kv[idx_i, :512] / (Σ_i e^{s_i} + e^{sink[h]})  (no sink term
//               without sinks; 0 when no entry is valid)
//   lse[t, h] = log Σ_i e^{s_i}  (-inf when no entry is valid)
// Returns out [T, Hq, 512]; writes lse [T, Hq] when lse is non-null.
std::vector<double> reference_sparse_mla_decode(const std::vector<double>& q, const std::vector<double>& kv,
                                                const std::vector<int64_t>& indices, int64_t T, int64_t Hq,
                                                int64_t S, int64_t topk, double scale,
                                                const std::vector<int64_t>* topk_length,
                                                const std::vector<double>* attn_sink, std::vector<double>* lse);

}  // namespace moelora::ref
