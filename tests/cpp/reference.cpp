#include "reference.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <thread>

#include "common/host_numeric.h"

namespace moelora::ref {
namespace {

// fn(i) for i in [0, count) on all hardware threads; indices are claimed one at a time.
template <class F>
void for_each_index(int64_t count, F fn) {
  const int64_t num_threads =
      std::min<int64_t>(count, std::max<int64_t>(1, int64_t(std::thread::hardware_concurrency())));
  if (num_threads <= 1) {
    for (int64_t i = 0; i < count; ++i) fn(i);
    return;
  }
  std::atomic<int64_t> next{0};
  auto worker = [&] {
    for (int64_t i = next++; i < count; i = next++) fn(i);
  };
  std::vector<std::thread> threads;
  for (int64_t t = 1; t < num_threads; ++t) threads.emplace_back(worker);
  worker();
  for (auto& thread : threads) thread.join();
}

// Σ x[i] y[i] in double. Four partial sums keep the adds independent (a plain double
// reduction is latency-bound); the result is still a double-precision sum.
double dot(const double* x, const double* y, int64_t count) {
  double partial[4] = {0, 0, 0, 0};
  // NOTE: the bound computed once (not i + 4 <= count) spares GCC 12 a false
  // -Waggressive-loop-optimizations warning where dot inlines with a constant count.
  const int64_t lanes_end = count - count % 4;
  int64_t i = 0;
  for (; i < lanes_end; i += 4) {
    for (int lane = 0; lane < 4; ++lane) partial[lane] += x[i + lane] * y[i + lane];
  }
  double sum = (partial[0] + partial[1]) + (partial[2] + partial[3]);
  for (; i < count; ++i) sum += x[i] * y[i];
  return sum;
}

double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

// Activation of one row: gate_up [2 * width] -> out [width].
void activate_row(Activation activation, const double* gate_up, int64_t width, double alpha, double limit,
                  double* out) {
  for (int64_t i = 0; i < width; ++i) {
    switch (activation) {
      case Activation::kSilu: {
        const double g = gate_up[i], u = gate_up[width + i];
        out[i] = g * sigmoid(g) * u;
        break;
      }
      case Activation::kGelu: {
        const double g = gate_up[i], u = gate_up[width + i];
        out[i] = 0.5 * g * (1.0 + std::erf(g / std::sqrt(2.0))) * u;
        break;
      }
      case Activation::kSwigluOai: {
        const double g = std::min(gate_up[2 * i], limit);
        const double u = std::clamp(gate_up[2 * i + 1], -limit, limit);
        out[i] = (u + 1.0) * g * sigmoid(alpha * g);
        break;
      }
    }
  }
}

}  // namespace

double dot_product(const double* x, const double* y, int64_t count) { return dot(x, y, count); }

// ---- data ----------------------------------------------------------------------------

double read_element(DType dtype, const void* data, int64_t index) {
  switch (dtype) {
    case DType::kFloat32: return static_cast<const float*>(data)[index];
    case DType::kFloat16: return host::to_float(host::fp16{static_cast<const uint16_t*>(data)[index]});
    case DType::kBFloat16: return host::to_float(host::bf16{static_cast<const uint16_t*>(data)[index]});
    case DType::kInt32: return static_cast<const int32_t*>(data)[index];
    case DType::kInt64: return double(static_cast<const int64_t*>(data)[index]);
    case DType::kFloat8E4M3: return host::to_float(host::fp8e4m3{static_cast<const uint8_t*>(data)[index]});
    case DType::kInt8: return static_cast<const int8_t*>(data)[index];
    case DType::kUInt8: return static_cast<const uint8_t*>(data)[index];
  }
  throw std::invalid_argument("read_element: unknown dtype");
}

void write_element(DType dtype, void* data, int64_t index, double value) {
  switch (dtype) {
    case DType::kFloat32: static_cast<float*>(data)[index] = float(value); return;
    case DType::kFloat16: static_cast<uint16_t*>(data)[index] = host::to_fp16(float(value)).bits; return;
    case DType::kBFloat16: static_cast<uint16_t*>(data)[index] = host::to_bf16(float(value)).bits; return;
    case DType::kInt32: static_cast<int32_t*>(data)[index] = int32_t(value); return;
    case DType::kInt64: static_cast<int64_t*>(data)[index] = int64_t(value); return;
    case DType::kFloat8E4M3: static_cast<uint8_t*>(data)[index] = host::to_fp8e4m3(float(value)).bits; return;
    case DType::kInt8: static_cast<int8_t*>(data)[index] = host::to_int8(float(value)); return;
    case DType::kUInt8: static_cast<uint8_t*>(data)[index] = uint8_t(value); return;
  }
  throw std::invalid_argument("write_element: unknown dtype");
}

void fill_normal(DType dtype, void* data, int64_t count, std::mt19937& rng, double scale) {
  if (dtype != DType::kFloat32 && dtype != DType::kFloat16 && dtype != DType::kBFloat16) {
    throw std::invalid_argument("fill_normal: float dtypes only");
  }
  // NOTE: std::normal_distribution costs ~20 ns a draw; weights of the large models are
  // hundreds of millions of elements, so chunks of 1M draws run on separate threads,
  // each from its own generator seeded from `rng` (the same data for any thread count).
  constexpr int64_t kChunk = int64_t(1) << 20;
  const int64_t num_chunks = (count + kChunk - 1) / kChunk;
  std::vector<uint32_t> seeds(static_cast<size_t>(num_chunks));
  for (auto& seed : seeds) seed = uint32_t(rng());
  for_each_index(num_chunks, [&](int64_t chunk) {
    std::mt19937 chunk_rng(seeds[size_t(chunk)]);
    std::normal_distribution<float> normal(0.0f, float(scale));
    const int64_t end = std::min(count, (chunk + 1) * kChunk);
    for (int64_t i = chunk * kChunk; i < end; ++i) write_element(dtype, data, i, normal(chunk_rng));
  });
}

std::vector<double> to_double(DType dtype, const void* data, int64_t count) {
  std::vector<double> out(static_cast<size_t>(std::max<int64_t>(count, 0)));
  for (int64_t i = 0; i < count; ++i) out[size_t(i)] = read_element(dtype, data, i);
  return out;
}

std::vector<double> round_to(DType dtype, const std::vector<double>& values) {
  std::vector<double> out(values.size());
  for (size_t i = 0; i < values.size(); ++i) {
    switch (dtype) {
      case DType::kFloat32: out[i] = double(float(values[i])); break;
      case DType::kFloat16: out[i] = host::to_float(host::to_fp16(float(values[i]))); break;
      case DType::kBFloat16: out[i] = host::to_float(host::to_bf16(float(values[i]))); break;
      case DType::kInt32:
      case DType::kInt64: out[i] = std::trunc(values[i]); break;
      case DType::kFloat8E4M3: out[i] = host::to_float(host::to_fp8e4m3(float(values[i]))); break;
      case DType::kInt8: out[i] = host::to_int8(float(values[i])); break;
      case DType::kUInt8: out[i] = double(uint8_t(values[i])); break;
    }
  }
  return out;
}

double rel_error(const std::vector<double>& out, const std::vector<double>& ref) {
  if (out.size() != ref.size()) return std::numeric_limits<double>::infinity();
  double diff2 = 0.0, ref2 = 0.0;
  for (size_t i = 0; i < out.size(); ++i) {
    if (!std::isfinite(out[i])) return std::numeric_limits<double>::infinity();
    diff2 += (out[i] - ref[i]) * (out[i] - ref[i]);
    ref2 += ref[i] * ref[i];
  }
  return ref2 > 0.0 ? std::sqrt(diff2 / ref2) : std::sqrt(diff2);
}

double tolerance(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return 1e-5;
    case DType::kFloat16: return 5e-3;
    case DType::kBFloat16: return 1e-2;
    default: return 0.0;
  }
}

// ---- references ----------------------------------------------------------------------

std::vector<double> reference_moe_gemm(const std::vector<double>& a, const std::vector<double>& w,
                                       const std::vector<int64_t>& slot_expert, const double* slot_weight,
                                       int64_t num_rows, int64_t top_k, int64_t N, int64_t K) {
  const int64_t num_slots = num_rows * top_k;
  std::vector<double> out(static_cast<size_t>(num_slots * N), 0.0);  // [num_slots, N]
  for_each_index(num_slots, [&](int64_t s) {
    const int64_t e = slot_expert[size_t(s)];
    if (e < 0) return;
    const double* a_row = &a[size_t((s / top_k) * K)];
    const double weight = slot_weight ? slot_weight[s] : 1.0;
    for (int64_t n = 0; n < N; ++n) {
      out[size_t(s * N + n)] = dot(a_row, &w[size_t((e * N + n) * K)], K) * weight;
    }
  });
  return out;
}

std::vector<double> reference_activation(Activation activation, const std::vector<double>& input, int64_t rows,
                                         int64_t width, double alpha, double limit) {
  std::vector<double> out(static_cast<size_t>(rows * width));  // [rows, width]
  for (int64_t r = 0; r < rows; ++r) {
    activate_row(activation, &input[size_t(r * 2 * width)], width, alpha, limit, &out[size_t(r * width)]);
  }
  return out;
}

std::vector<double> reference_sum_reduce(const std::vector<double>& input, int64_t M, int64_t top_k, int64_t H,
                                         double scale) {
  std::vector<double> out(static_cast<size_t>(M * H), 0.0);  // [M, H]
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t h = 0; h < H; ++h) {
      double sum = 0.0;
      for (int64_t j = 0; j < top_k; ++j) sum += input[size_t((m * top_k + j) * H + h)];
      out[size_t(m * H + h)] = scale * sum;
    }
  }
  return out;
}

void reference_lora_delta_row(const RefLoraStack& st, int64_t lora, int64_t expert, const double* a_row,
                              double scale, double* out_row) {
  const int64_t n_slice = st.N / st.num_slices;
  std::vector<double> t(static_cast<size_t>(st.rank));  // [rank]
  for (int c = 0; c < st.num_slices; ++c) {
    const double* la = &st.lora_a[c][size_t((lora * st.num_experts + expert) * st.rank * st.K)];
    const double* lb = &st.lora_b[c][size_t((lora * st.num_experts + expert) * n_slice * st.rank)];
    for (int64_t i = 0; i < st.rank; ++i) t[size_t(i)] = dot(a_row, la + i * st.K, st.K);
    for (int64_t j = 0; j < n_slice; ++j) {
      const int64_t col = st.interleaved ? j * st.num_slices + c : c * n_slice + j;
      out_row[col] += scale * dot(t.data(), lb + j * st.rank, st.rank);
    }
  }
}

std::vector<double> reference_fused_experts(const std::vector<double>& hidden_states,
                                            const std::vector<double>& w13, const std::vector<double>& w2,
                                            const std::vector<double>& topk_weights,
                                            const std::vector<int64_t>& topk_ids, int64_t M, int64_t top_k,
                                            int64_t num_local_experts, int64_t H, int64_t I,
                                            const int32_t* expert_map, Activation activation, double alpha,
                                            double limit, bool apply_router_weight_on_input, bool no_combine,
                                            double routed_scaling_factor, const RefLora* lora,
                                            const RefQuant* quant) {
  const int64_t num_slots = M * top_k;
  for (int64_t s = 0; s < num_slots; ++s) {  // checked here: the workers below must not throw
    const int64_t global = topk_ids[size_t(s)];
    const int64_t local = global == -1 ? -1 : expert_map ? expert_map[global] : global;
    if (local < -1 || local >= num_local_experts) {
      throw std::out_of_range("reference_fused_experts: slot " + std::to_string(s) + " maps to expert " +
                              std::to_string(local) + ", not in [-1, " + std::to_string(num_local_experts) + ")");
    }
  }
  // Quantized layers see x and act quantized per chunk; the others use them as they are.
  const int64_t chunk = quant ? std::max<int64_t>(quant->chunk_size, 1) : std::max<int64_t>(M, 1);
  const std::vector<double> x_used =
      quant ? reference_quantize_activations(hidden_states, M, H, chunk, *quant, quant->a13_scale) : std::vector<double>{};
  const std::vector<double>& x_in = quant ? x_used : hidden_states;
  // Per slot act first (slots are independent), then h2, then the combine in slot order.
  std::vector<double> acts(static_cast<size_t>(num_slots * I), 0.0);  // [M, top_k, I]
  auto local_of = [&](int64_t s) -> int64_t {
    const int64_t global = topk_ids[size_t(s)];
    return global == -1 ? -1 : expert_map ? expert_map[global] : global;
  };
  for_each_index(num_slots, [&](int64_t s) {
    const int64_t local = local_of(s);
    if (local == -1) return;
    const double weight = topk_weights[size_t(s)];
    const double* x = &x_in[size_t((s / top_k) * H)];
    const int64_t adapter = lora ? lora->token_lora[size_t(s / top_k)] : -1;
    // h1 = (base + delta) (× weight on input). Quantized experts round as the op does: the
    // weighted base to the layer dtype, then the sum with the delta.
    const bool round_h1 = quant != nullptr;
    const double w_in = apply_router_weight_on_input ? weight : 1.0;
    std::vector<double> h1(static_cast<size_t>(2 * I));  // [2I]
    for (int64_t n = 0; n < 2 * I; ++n) h1[size_t(n)] = dot(x, &w13[size_t((local * 2 * I + n) * H)], H) * w_in;
    if (round_h1) h1 = round_to(quant->layer_dtype, h1);
    if (adapter >= 0) {
      // Adapters see the unquantized hidden state.
      std::vector<double> delta(h1.size(), 0.0);
      reference_lora_delta_row(lora->w13, adapter, local, &hidden_states[size_t((s / top_k) * H)],
                               lora->scale[size_t(adapter)], delta.data());
      for (size_t n = 0; n < h1.size(); ++n) h1[n] += delta[n] * w_in;
      if (round_h1) h1 = round_to(quant->layer_dtype, h1);
    }
    activate_row(activation, h1.data(), I, alpha, limit, &acts[size_t(s * I)]);
  });
  std::vector<double> acts_used;
  if (quant) {
    acts_used = reference_quantize_activations(round_to(quant->layer_dtype, acts), num_slots, I, chunk * top_k, *quant,
                                               quant->a2_scale);
  }
  const std::vector<double>& act_in = quant ? acts_used : acts;
  std::vector<double> h2(static_cast<size_t>(num_slots * H), 0.0);  // [M, top_k, H]
  for_each_index(num_slots, [&](int64_t s) {
    const int64_t local = local_of(s);
    if (local == -1) return;
    const double weight = topk_weights[size_t(s)];
    const int64_t adapter = lora ? lora->token_lora[size_t(s / top_k)] : -1;
    const double* act = &act_in[size_t(s * I)];
    std::vector<double> row(static_cast<size_t>(H));  // [H]
    for (int64_t h = 0; h < H; ++h) row[size_t(h)] = dot(act, &w2[size_t((local * H + h) * I)], I);
    if (adapter >= 0) {
      // The w2 adapter sees the activation before its quantization (the layer dtype's).
      const std::vector<double> act_plain =
          quant ? round_to(quant->layer_dtype, std::vector<double>(acts.begin() + s * I, acts.begin() + (s + 1) * I))
                : std::vector<double>(act, act + I);
      reference_lora_delta_row(lora->w2, adapter, local, act_plain.data(), lora->scale[size_t(adapter)], row.data());
    }
    for (int64_t h = 0; h < H; ++h) {
      h2[size_t(s * H + h)] = apply_router_weight_on_input ? row[size_t(h)] : row[size_t(h)] * weight;
    }
  });
  if (no_combine) return h2;
  return reference_sum_reduce(h2, M, top_k, H, routed_scaling_factor);
}

std::vector<double> reference_quantize(const std::vector<double>& values, int64_t batch, int64_t rows, int64_t cols,
                                       int64_t block_rows, int64_t block_cols, DType element, double static_scale,
                                       std::vector<double>* scales_out) {
  const int64_t br = block_rows > 0 ? block_rows : std::max<int64_t>(rows, 1);
  const int64_t bc = block_cols > 0 ? block_cols : std::max<int64_t>(cols, 1);
  const int64_t row_blocks = (rows + br - 1) / br, col_blocks = (cols + bc - 1) / bc;
  const float qmax = quant_max(element);
  std::vector<double> out(values.size());
  if (scales_out) scales_out->assign(size_t(batch * row_blocks * col_blocks), 0.0);
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t rb = 0; rb < row_blocks; ++rb) {
      for (int64_t cb = 0; cb < col_blocks; ++cb) {
        const int64_t r_end = std::min(rows, (rb + 1) * br), c_end = std::min(cols, (cb + 1) * bc);
        auto at = [&](int64_t r, int64_t c) { return size_t((b * rows + r) * cols + c); };
        float scale = float(static_scale);
        if (!(static_scale > 0.0)) {
          float absmax = 0.0f;
          for (int64_t r = rb * br; r < r_end; ++r) {
            for (int64_t c = cb * bc; c < c_end; ++c) absmax = std::max(absmax, std::fabs(float(values[at(r, c)])));
          }
          scale = std::max(absmax, kQuantAbsmaxFloor) / qmax;
        }
        if (scales_out) (*scales_out)[size_t((b * row_blocks + rb) * col_blocks + cb)] = scale;
        for (int64_t r = rb * br; r < r_end; ++r) {
          for (int64_t c = cb * bc; c < c_end; ++c) {
            const float q = std::clamp(float(values[at(r, c)]) / scale, -qmax, qmax);
            const double rounded = element == DType::kInt8 ? double(host::to_int8(q))
                                                           : double(host::to_float(host::to_fp8e4m3(q)));
            out[at(r, c)] = rounded * double(scale);
          }
        }
      }
    }
  }
  return out;
}

std::vector<double> reference_quantize_activations(const std::vector<double>& values, int64_t rows, int64_t cols,
                                                   int64_t rows_per_chunk, const RefQuant& quant, double static_scale) {
  std::vector<double> out(values.size());
  const bool per_tensor = quant.activation_scales == ScaleGranularity::kTensor;
  const int64_t block_cols = quant.activation_scales == ScaleGranularity::kBlock ? quant.block_k : 0;
  for (int64_t begin = 0; begin < rows; begin += rows_per_chunk) {
    const int64_t n = std::min(rows_per_chunk, rows - begin);
    const std::vector<double> part(values.begin() + begin * cols, values.begin() + (begin + n) * cols);
    const std::vector<double> q =
        reference_quantize(part, 1, n, cols, per_tensor ? 0 : 1, block_cols, quant.element, static_scale);
    std::copy(q.begin(), q.end(), out.begin() + begin * cols);
  }
  return out;
}

std::vector<double> reference_sparse_mla_decode(const std::vector<double>& q, const std::vector<double>& kv,
                                                const std::vector<int64_t>& indices, int64_t T, int64_t Hq,
                                                int64_t S, int64_t topk, double scale,
                                                const std::vector<int64_t>* topk_length,
                                                const std::vector<double>* attn_sink, std::vector<double>* lse) {
  constexpr int64_t D = kMlaHeadDim, DV = kMlaValueDim;
  std::vector<double> out(size_t(T * Hq * DV), 0.0);
  if (lse) lse->assign(size_t(T * Hq), -std::numeric_limits<double>::infinity());
  for_each_index(T * Hq, [&](int64_t th) {
    const int64_t t = th / Hq, h = th % Hq;
    const int64_t length = topk_length ? std::clamp<int64_t>((*topk_length)[size_t(t)], 0, topk) : topk;
    std::vector<int64_t> rows;
    for (int64_t i = 0; i < length; ++i) {
      const int64_t row = indices[size_t(t * topk + i)];
      if (row >= 0 && row < S) rows.push_back(row);
    }
    if (rows.empty()) return;
    std::vector<double> logits(rows.size());
    double max_logit = -std::numeric_limits<double>::infinity();
    for (size_t j = 0; j < rows.size(); ++j) {
      logits[j] = scale * dot(&q[size_t(th * D)], &kv[size_t(rows[j] * D)], D);
      max_logit = std::max(max_logit, logits[j]);
    }
    double sum = 0.0;
    double* out_row = &out[size_t(th * DV)];
    for (size_t j = 0; j < rows.size(); ++j) {
      const double weight = std::exp(logits[j] - max_logit);
      sum += weight;
      for (int64_t d = 0; d < DV; ++d) out_row[d] += weight * kv[size_t(rows[j] * D + d)];
    }
    const double denominator = sum + (attn_sink ? std::exp((*attn_sink)[size_t(h)] - max_logit) : 0.0);
    for (int64_t d = 0; d < DV; ++d) out_row[d] /= denominator;
    if (lse) (*lse)[size_t(th)] = max_logit + std::log(sum);
  });
  return out;
}

}  // namespace moelora::ref
