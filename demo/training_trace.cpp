#include "training_trace.hpp"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <sstream>
#include <stdexcept>
#include <tuple>

namespace zeroalloc::demo {

namespace {

using tensor = std::uint32_t;
constexpr tensor no_tensor = std::numeric_limits<tensor>::max();
constexpr int fp32_bytes = 4;
constexpr int int64_bytes = 8;
constexpr int compute_stream = 0;
constexpr int copy_stream = 1;

// Issues events with PyTorch's ownership rules: a tensor is freed when its last reference
// goes, and autograd's saved tensors are references like any other. Most of the realism of
// the trace comes from getting those lifetimes right, so they are counted, not guessed.
class event_recorder {
 public:
  tensor allocate(std::uint64_t bytes, zeroalloc_class allocation_class = ZEROALLOC_CLASS_OTHER,
                  int stream = compute_stream) {
    const auto id = static_cast<tensor>(references_.size());
    references_.push_back(1);
    events_.push_back({trace_event::allocate, id, bytes, stream, allocation_class});
    return id;
  }

  tensor retain(tensor id) {
    check_live(id);
    ++references_[id];
    return id;
  }

  void release(tensor id) {
    check_live(id);
    if (--references_[id] == 0) events_.push_back({trace_event::free, id, 0, 0, {}});
  }

  void record_stream(tensor id, int stream) {
    check_live(id);
    events_.push_back({trace_event::record_stream, id, 0, stream, {}});
  }

  void end_step() { events_.push_back({trace_event::step_end, 0, 0, 0, {}}); }

  std::vector<trace_event> take() { return std::move(events_); }

 private:
  void check_live(tensor id) const {
    if (id >= references_.size() || references_[id] == 0) {
      throw std::logic_error("training trace: tensor " + std::to_string(id) + " is not live");
    }
  }

  std::vector<trace_event> events_;
  std::vector<std::uint32_t> references_;
};

struct parameter {
  tensor weight = no_tensor;
  std::uint64_t elements = 0;
  tensor gradient = no_tensor;
  tensor exp_avg = no_tensor;
  tensor exp_avg_sq = no_tensor;
};

// Indices into the parameter list of one decoder layer, in HF's module order (which is
// both the order `.to("cuda")` allocates them and the order of model.parameters()).
enum layer_parameter : int {
  q_proj,
  k_proj,
  v_proj,
  o_proj,
  gate_proj,
  up_proj,
  down_proj,
  input_norm,
  post_attention_norm,
  parameters_per_layer
};

struct rmsnorm_saved {
  tensor input_fp32 = no_tensor;   // saved by pow and by the mul with the inverse RMS
  tensor inverse_rms = no_tensor;  // [tokens, 1]
  tensor normalized = no_tensor;   // saved by the mul with the weight
};

struct linear_saved {
  tensor input = no_tensor;   // the bf16 copy autocast made, which the matmul keeps
  tensor weight = no_tensor;  // autocast's bf16 copy of the weight
};

struct layer_saved {
  rmsnorm_saved input_norm, post_attention_norm;
  linear_saved q, k, v, o, gate, up, down;
  // Attention inputs as the kernel saw them (bf16; heads repeated for grouped-query).
  tensor query = no_tensor, key = no_tensor, value = no_tensor;
  tensor attention_output = no_tensor;  // fused kernel only; o_proj keeps its own reference
  tensor logsumexp = no_tensor;         // fused kernel only
  tensor probabilities_fp32 = no_tensor, probabilities = no_tensor;  // eager only
  tensor gate_output = no_tensor, up_output = no_tensor, activation = no_tensor;
};

struct data_batch {
  tensor input_ids = no_tensor, attention_mask = no_tensor, labels = no_tensor;
};

std::uint64_t round_up(std::uint64_t value, std::uint64_t multiple) {
  return (value + multiple - 1) / multiple * multiple;
}

class training_run {
 public:
  explicit training_run(const trace_shape& shape)
      : shape_(shape),
        activation_bytes_(shape.activation_bytes_per_element),
        state_bytes_(shape.state_bytes_per_element),
        // A bf16 activation times an fp32 tensor (RoPE's cos/sin, the mask, the residual)
        // promotes to fp32: autocast does not cover elementwise ops.
        promoted_bytes_(std::max(activation_bytes_, state_bytes_)),
        hidden_(static_cast<std::uint64_t>(shape.hidden)),
        intermediate_(static_cast<std::uint64_t>(shape.intermediate)),
        heads_(static_cast<std::uint64_t>(shape.heads)),
        head_dim_(hidden_ / heads_),
        kv_width_(static_cast<std::uint64_t>(shape.kv_heads == 0 ? shape.heads : shape.kv_heads) *
                  head_dim_),
        vocab_(static_cast<std::uint64_t>(shape.vocab)),
        batch_(static_cast<std::uint64_t>(shape.batch)) {}

  std::vector<trace_event> run() {
    create_model();
    data_batch next;
    if (shape_.steps > 0) next = load_batch(sequence_length(0));
    for (int step = 0; step < shape_.steps; ++step) {
      set_sequence_length(sequence_length(step));
      const data_batch current = next;
      // The copy ran on the side stream; compute now uses the tensors, so their memory
      // must not be reused until compute is done with them (Tensor.record_stream).
      for (tensor t : {current.input_ids, current.attention_mask, current.labels}) {
        recorder_.record_stream(t, compute_stream);
      }
      // The prefetcher starts copying the next batch before this step's compute.
      if (step + 1 < shape_.steps) next = load_batch(sequence_length(step + 1));

      const tensor loss = forward(current);
      backward();
      const tensor total_norm = shape_.clip_grad_norm ? clip_grad_norm() : no_tensor;
      adamw_step();
      if (shape_.gradients_set_to_none) zero_grad_set_to_none();

      // `batch = next_batch`, `loss = ...` and `norm = ...` rebind in the next iteration.
      for (tensor t : {current.input_ids, current.attention_mask, current.labels}) {
        recorder_.release(t);
      }
      recorder_.release(loss);
      if (total_norm != no_tensor) recorder_.release(total_norm);
      recorder_.end_step();
    }
    return recorder_.take();
  }

 private:
  std::uint64_t sequence_length(int step) const {
    const auto& lengths = shape_.sequence_lengths;
    return static_cast<std::uint64_t>(lengths[static_cast<std::size_t>(step) % lengths.size()]);
  }

  void set_sequence_length(std::uint64_t sequence) {
    sequence_ = sequence;
    tokens_ = batch_ * sequence;
  }

  tensor allocate(std::uint64_t bytes) { return recorder_.allocate(bytes); }
  void release(tensor t) { recorder_.release(t); }

  // x.to(dtype): the same tensor (another reference) when the dtype does not change.
  tensor convert(tensor t, std::uint64_t elements, int from_bytes, int to_bytes) {
    if (from_bytes == to_bytes) return recorder_.retain(t);
    return allocate(elements * static_cast<std::uint64_t>(to_bytes));
  }

  parameter& layer_param(int layer, layer_parameter which) {
    return parameters_[1 + static_cast<std::size_t>(layer) * parameters_per_layer + which];
  }
  parameter& embedding() { return parameters_.front(); }
  parameter& final_norm() { return parameters_[parameters_.size() - 2]; }
  parameter& lm_head() { return parameters_.back(); }

  void create_model() {
    auto add = [&](std::uint64_t elements) {
      parameters_.push_back(
          {recorder_.allocate(elements * state_bytes(), ZEROALLOC_CLASS_PARAMETER), elements});
    };
    add(vocab_ * hidden_);
    for (int layer = 0; layer < shape_.layers; ++layer) {
      add(hidden_ * hidden_);
      add(kv_width_ * hidden_);
      add(kv_width_ * hidden_);
      add(hidden_ * hidden_);
      add(intermediate_ * hidden_);
      add(intermediate_ * hidden_);
      add(hidden_ * intermediate_);
      add(hidden_);
      add(hidden_);
    }
    add(hidden_);
    // The rotary embedding's inv_freq buffer: fp32, not a parameter, lives as long as one.
    inverse_frequencies_ = allocate(head_dim_ / 2 * fp32_bytes);
    add(vocab_ * hidden_);
  }

  std::uint64_t state_bytes() const { return static_cast<std::uint64_t>(state_bytes_); }

  data_batch load_batch(std::uint64_t sequence) {
    const std::uint64_t bytes = batch_ * sequence * int64_bytes;
    data_batch loaded;
    loaded.input_ids = recorder_.allocate(bytes, ZEROALLOC_CLASS_OTHER, copy_stream);
    loaded.attention_mask = recorder_.allocate(bytes, ZEROALLOC_CLASS_OTHER, copy_stream);
    loaded.labels = recorder_.allocate(bytes, ZEROALLOC_CLASS_OTHER, copy_stream);
    return loaded;
  }

  // Autocast casts each fp32 weight to bf16 once per forward pass and caches the copy
  // until the autocast region ends; the matmul's saved reference keeps it until backward.
  tensor weight_for_matmul(const parameter& weight) {
    if (activation_bytes_ == state_bytes_) return recorder_.retain(weight.weight);
    const tensor copy = allocate(weight.elements * static_cast<std::uint64_t>(activation_bytes_));
    autocast_weight_cache_.push_back(copy);
    return recorder_.retain(copy);
  }

  void ensure_blas_workspace() {
    // cuBLAS takes its workspace from the caching allocator on the first matmul of a
    // stream and keeps it (about 8 MiB on Hopper with PyTorch's default configuration).
    if (blas_workspace_ == no_tensor) blas_workspace_ = allocate((8u << 20) + (128u << 10));
  }

  linear_saved linear_forward(tensor input, int input_bytes, std::uint64_t in_features,
                              const parameter& weight, std::uint64_t out_features, tensor& output) {
    linear_saved saved;
    saved.input = convert(input, tokens_ * in_features, input_bytes, activation_bytes_);
    saved.weight = weight_for_matmul(weight);
    ensure_blas_workspace();
    output = allocate(tokens_ * out_features * static_cast<std::uint64_t>(activation_bytes_));
    return saved;
  }

  zeroalloc_class gradient_class(const parameter& weight) const {
    return weight.gradient == no_tensor ? ZEROALLOC_CLASS_GRADIENT : ZEROALLOC_CLASS_OTHER;
  }

  // AccumulateGrad: the first gradient becomes .grad as it is; later ones are added in place.
  void accumulate_gradient(parameter& weight, tensor gradient) {
    if (weight.gradient == no_tensor) {
      weight.gradient = gradient;
    } else {
      release(gradient);
    }
  }

  // Takes ownership of `output_gradient`; returns the gradient of the (bf16) input.
  tensor linear_backward(const linear_saved& saved, tensor output_gradient,
                         std::uint64_t in_features, parameter& weight, std::uint64_t out_features) {
    const auto activation = static_cast<std::uint64_t>(activation_bytes_);
    const tensor input_gradient = allocate(tokens_ * in_features * activation);
    const bool becomes_gradient = activation_bytes_ == state_bytes_;
    const tensor weight_gradient =
        recorder_.allocate(in_features * out_features * activation,
                           becomes_gradient ? gradient_class(weight) : ZEROALLOC_CLASS_OTHER);
    release(saved.input);
    release(saved.weight);
    release(output_gradient);
    if (becomes_gradient) {
      accumulate_gradient(weight, weight_gradient);
    } else {
      // The backward of autocast's weight cast turns the bf16 gradient into fp32.
      const tensor full =
          recorder_.allocate(weight.elements * state_bytes(), gradient_class(weight));
      release(weight_gradient);
      accumulate_gradient(weight, full);
    }
    return input_gradient;
  }

  // Hugging Face's LlamaRMSNorm, which computes in fp32 whatever the input dtype:
  //   x = x.to(float32); var = x.pow(2).mean(-1, keepdim=True)
  //   x = x * rsqrt(var + eps); return weight * x.to(input_dtype)
  rmsnorm_saved rmsnorm_forward(tensor input, tensor& output) {
    const std::uint64_t elements = tokens_ * hidden_;
    rmsnorm_saved saved;
    saved.input_fp32 = convert(input, elements, state_bytes_, fp32_bytes);
    const tensor squares = allocate(elements * fp32_bytes);
    const tensor variance = allocate(tokens_ * fp32_bytes);
    release(squares);
    const tensor shifted = allocate(tokens_ * fp32_bytes);
    release(variance);
    saved.inverse_rms = allocate(tokens_ * fp32_bytes);
    release(shifted);
    const tensor normalized = allocate(elements * fp32_bytes);
    saved.normalized = convert(normalized, elements, fp32_bytes, state_bytes_);
    release(normalized);
    output = allocate(elements * state_bytes());
    return saved;
  }

  void norm_weight_gradient(parameter& weight, std::uint64_t elements) {
    // sum over tokens of (grad * normalized): a full-size product, then the reduction.
    const tensor product = allocate(elements * state_bytes());
    const tensor gradient = recorder_.allocate(hidden_ * state_bytes(), gradient_class(weight));
    release(product);
    accumulate_gradient(weight, gradient);
  }

  // Takes ownership of `output_gradient`; returns the gradient of the input.
  tensor rmsnorm_backward(const rmsnorm_saved& saved, tensor output_gradient, parameter& weight) {
    const std::uint64_t elements = tokens_ * hidden_;
    const std::uint64_t full_fp32 = elements * fp32_bytes;
    const std::uint64_t row_fp32 = tokens_ * fp32_bytes;
    norm_weight_gradient(weight, elements);
    const tensor normalized_gradient = allocate(elements * state_bytes());
    release(output_gradient);
    release(saved.normalized);
    const tensor normalized_gradient_fp32 =
        convert(normalized_gradient, elements, state_bytes_, fp32_bytes);
    release(normalized_gradient);
    // x * inverse_rms: both factors need a gradient.
    const tensor input_gradient = allocate(full_fp32);
    const tensor product = allocate(full_fp32);
    const tensor inverse_rms_gradient = allocate(row_fp32);
    release(product);
    release(normalized_gradient_fp32);
    // rsqrt backward: -0.5 * grad * result^3.
    const tensor cubed = allocate(row_fp32);
    const tensor variance_gradient = allocate(row_fp32);
    release(cubed);
    release(inverse_rms_gradient);
    release(saved.inverse_rms);
    // mean backward expands to the full shape; pow(2) backward is grad * 2 * x.
    const tensor squares_gradient = allocate(full_fp32);
    release(variance_gradient);
    const tensor power = allocate(full_fp32);
    const tensor scaled = allocate(full_fp32);
    release(power);
    const tensor second_gradient = allocate(full_fp32);
    release(scaled);
    release(squares_gradient);
    // Autograd adds the second gradient into the first in place.
    release(second_gradient);
    release(saved.input_fp32);
    const tensor result = convert(input_gradient, elements, fp32_bytes, state_bytes_);
    release(input_gradient);
    return result;
  }

  // q * cos + rotate_half(q) * sin, in the promoted dtype. Saves only cos and sin (they
  // need no gradient), so q itself is not kept.
  tensor rope_forward(std::uint64_t width) {
    const std::uint64_t elements = tokens_ * width;
    const auto activation = static_cast<std::uint64_t>(activation_bytes_);
    const auto promoted = static_cast<std::uint64_t>(promoted_bytes_);
    const tensor times_cos = allocate(elements * promoted);
    const tensor negated_half = allocate(elements / 2 * activation);
    const tensor rotated = allocate(elements * activation);
    release(negated_half);
    const tensor times_sin = allocate(elements * promoted);
    release(rotated);
    const tensor embedded = allocate(elements * promoted);
    release(times_cos);
    release(times_sin);
    recorder_.retain(rope_cos_);
    recorder_.retain(rope_sin_);
    return embedded;
  }

  // Takes ownership of `gradient` (promoted dtype); returns the gradient of q (bf16).
  tensor rope_backward(tensor gradient, std::uint64_t width) {
    const std::uint64_t elements = tokens_ * width;
    const auto activation = static_cast<std::uint64_t>(activation_bytes_);
    const auto promoted = static_cast<std::uint64_t>(promoted_bytes_);
    const tensor sin_product = allocate(elements * promoted);
    const tensor rotated_gradient =
        convert(sin_product, elements, promoted_bytes_, activation_bytes_);
    release(sin_product);
    // cat backward gives views; neg and the two slices each materialise a gradient.
    const tensor negated = allocate(elements / 2 * activation);
    const tensor second_half = allocate(elements * activation);
    release(negated);
    const tensor first_half = allocate(elements * activation);
    release(rotated_gradient);
    const tensor cos_product = allocate(elements * promoted);
    const tensor result = convert(cos_product, elements, promoted_bytes_, activation_bytes_);
    release(cos_product);
    release(gradient);
    release(second_half);
    release(first_half);
    release(rope_cos_);
    release(rope_sin_);
    return result;
  }

  // HF's repeat_kv for grouped-query attention: expand + reshape, a copy of every head.
  tensor repeat_heads(tensor t, int element_bytes) {
    if (kv_width_ == hidden_) return recorder_.retain(t);
    return allocate(tokens_ * hidden_ * static_cast<std::uint64_t>(element_bytes));
  }

  tensor attention_forward(tensor query_embedded, tensor key_embedded, tensor value,
                           layer_saved& saved) {
    const std::uint64_t elements = tokens_ * hidden_;
    const auto activation = static_cast<std::uint64_t>(activation_bytes_);
    const tensor key_repeated = repeat_heads(key_embedded, promoted_bytes_);
    const tensor value_repeated = repeat_heads(value, activation_bytes_);
    // SDPA (and eager's matmul) run in bf16 under autocast: q and k are cast back down.
    saved.query = convert(query_embedded, elements, promoted_bytes_, activation_bytes_);
    saved.key = convert(key_repeated, elements, promoted_bytes_, activation_bytes_);
    saved.value = value_repeated;
    release(key_repeated);
    tensor output = no_tensor;
    if (!shape_.eager_attention) {
      // Flash attention: the output and one fp32 log-sum-exp per row, nothing quadratic.
      output = allocate(elements * activation);
      saved.logsumexp = allocate(batch_ * heads_ * sequence_ * fp32_bytes);
      saved.attention_output = recorder_.retain(output);
    } else {
      const std::uint64_t scores = batch_ * heads_ * sequence_ * sequence_;
      const auto promoted = static_cast<std::uint64_t>(promoted_bytes_);
      ensure_blas_workspace();
      const tensor products = allocate(scores * activation);
      const tensor scaled = allocate(scores * activation);
      release(products);
      const tensor masked = allocate(scores * promoted);  // + the fp32 causal mask
      release(scaled);
      saved.probabilities_fp32 = allocate(scores * fp32_bytes);  // softmax(dtype=float32)
      release(masked);
      saved.probabilities =
          convert(saved.probabilities_fp32, scores, fp32_bytes, activation_bytes_);
      const tensor context = allocate(elements * activation);
      output = allocate(elements * activation);  // transpose(1, 2).contiguous()
      release(context);
    }
    return output;
  }

  // Takes ownership of `output_gradient`; sets the bf16 gradients of q, k and v (all heads).
  void attention_backward(layer_saved& saved, tensor output_gradient, tensor& query_gradient,
                          tensor& key_gradient, tensor& value_gradient) {
    const std::uint64_t elements = tokens_ * hidden_;
    const auto activation = static_cast<std::uint64_t>(activation_bytes_);
    if (!shape_.eager_attention) {
      query_gradient = allocate(elements * activation);
      key_gradient = allocate(elements * activation);
      value_gradient = allocate(elements * activation);
      // Flash backward's fp32 workspaces, rows rounded up to 128, head size to 32.
      const std::uint64_t rows = round_up(sequence_, 128);
      const tensor softmax_delta = allocate(batch_ * heads_ * rows * fp32_bytes);
      const tensor query_accumulator =
          allocate(batch_ * heads_ * rows * round_up(head_dim_, 32) * fp32_bytes);
      release(query_accumulator);
      release(softmax_delta);
      release(output_gradient);
      for (tensor t :
           {saved.query, saved.key, saved.value, saved.attention_output, saved.logsumexp}) {
        release(t);
      }
      return;
    }
    const std::uint64_t scores = batch_ * heads_ * sequence_ * sequence_;
    const auto promoted = static_cast<std::uint64_t>(promoted_bytes_);
    // context = probabilities @ v
    const tensor probabilities_gradient = allocate(scores * activation);
    value_gradient = allocate(elements * activation);
    release(output_gradient);
    release(saved.probabilities);
    release(saved.value);
    const tensor probabilities_gradient_fp32 =
        convert(probabilities_gradient, scores, activation_bytes_, fp32_bytes);
    release(probabilities_gradient);
    const tensor masked_gradient = allocate(scores * promoted);
    release(probabilities_gradient_fp32);
    release(saved.probabilities_fp32);
    const tensor scaled_gradient =
        convert(masked_gradient, scores, promoted_bytes_, activation_bytes_);
    release(masked_gradient);
    const tensor products_gradient = allocate(scores * activation);
    release(scaled_gradient);
    query_gradient = allocate(elements * activation);
    key_gradient = allocate(elements * activation);
    release(products_gradient);
    release(saved.query);
    release(saved.key);
  }

  // x is the residual stream (the parameters' dtype under autocast); returns the next one.
  tensor layer_forward(int layer, tensor x, layer_saved& saved) {
    const auto activation = static_cast<std::uint64_t>(activation_bytes_);
    tensor normalized = no_tensor;
    saved.input_norm = rmsnorm_forward(x, normalized);
    tensor query = no_tensor, key = no_tensor, value = no_tensor;
    saved.q = linear_forward(normalized, state_bytes_, hidden_, layer_param(layer, q_proj), hidden_,
                             query);
    saved.k = linear_forward(normalized, state_bytes_, hidden_, layer_param(layer, k_proj),
                             kv_width_, key);
    saved.v = linear_forward(normalized, state_bytes_, hidden_, layer_param(layer, v_proj),
                             kv_width_, value);
    release(normalized);
    const tensor query_embedded = rope_forward(hidden_);
    release(query);
    const tensor key_embedded = rope_forward(kv_width_);
    release(key);
    const tensor attention = attention_forward(query_embedded, key_embedded, value, saved);
    release(query_embedded);
    release(key_embedded);
    release(value);
    tensor projected = no_tensor;
    saved.o = linear_forward(attention, activation_bytes_, hidden_, layer_param(layer, o_proj),
                             hidden_, projected);
    release(attention);
    const tensor after_attention = allocate(tokens_ * hidden_ * state_bytes());
    release(projected);

    saved.post_attention_norm = rmsnorm_forward(after_attention, normalized);
    tensor gate = no_tensor, up = no_tensor;
    saved.gate = linear_forward(normalized, state_bytes_, hidden_, layer_param(layer, gate_proj),
                                intermediate_, gate);
    saved.up = linear_forward(normalized, state_bytes_, hidden_, layer_param(layer, up_proj),
                              intermediate_, up);
    release(normalized);
    saved.gate_output = gate;
    saved.up_output = up;
    saved.activation = allocate(tokens_ * intermediate_ * activation);  // silu(gate)
    const tensor product = allocate(tokens_ * intermediate_ * activation);
    tensor down = no_tensor;
    saved.down = linear_forward(product, activation_bytes_, intermediate_,
                                layer_param(layer, down_proj), hidden_, down);
    release(product);
    const tensor next = allocate(tokens_ * hidden_ * state_bytes());
    release(down);
    release(after_attention);  // still saved by the post-attention norm
    return next;
  }

  // Takes ownership of `gradient` (of the layer's output); returns that of its input.
  tensor layer_backward(int layer, layer_saved& saved, tensor gradient) {
    const std::uint64_t elements = tokens_ * hidden_;
    const auto activation = static_cast<std::uint64_t>(activation_bytes_);
    const std::uint64_t ffn_bytes = tokens_ * intermediate_ * activation;
    // The residual add hands `gradient` on unchanged and a bf16 copy to the MLP branch.
    const tensor down_gradient = convert(gradient, elements, state_bytes_, activation_bytes_);
    const tensor product_gradient = linear_backward(saved.down, down_gradient, intermediate_,
                                                    layer_param(layer, down_proj), hidden_);
    const tensor activation_gradient = allocate(ffn_bytes);
    const tensor up_gradient = allocate(ffn_bytes);
    release(product_gradient);
    release(saved.activation);
    release(saved.up_output);
    const tensor gate_gradient = allocate(ffn_bytes);  // silu backward
    release(activation_gradient);
    release(saved.gate_output);
    const tensor up_input_gradient =
        linear_backward(saved.up, up_gradient, hidden_, layer_param(layer, up_proj), intermediate_);
    const tensor normalized_gradient =
        convert(up_input_gradient, elements, activation_bytes_, state_bytes_);
    release(up_input_gradient);
    const tensor gate_input_gradient = linear_backward(
        saved.gate, gate_gradient, hidden_, layer_param(layer, gate_proj), intermediate_);
    const tensor gate_part =
        convert(gate_input_gradient, elements, activation_bytes_, state_bytes_);
    release(gate_input_gradient);
    release(gate_part);  // added in place into normalized_gradient
    const tensor residual_gradient = rmsnorm_backward(
        saved.post_attention_norm, normalized_gradient, layer_param(layer, post_attention_norm));
    release(gradient);  // added in place into residual_gradient

    const tensor attention_output_gradient =
        convert(residual_gradient, elements, state_bytes_, activation_bytes_);
    const tensor attention_gradient = linear_backward(saved.o, attention_output_gradient, hidden_,
                                                      layer_param(layer, o_proj), hidden_);
    tensor query_gradient = no_tensor, key_gradient = no_tensor, value_gradient = no_tensor;
    attention_backward(saved, attention_gradient, query_gradient, key_gradient, value_gradient);
    // Back through autocast's casts to the promoted dtype, then through repeat_kv.
    const tensor query_embedded_gradient =
        convert(query_gradient, elements, activation_bytes_, promoted_bytes_);
    release(query_gradient);
    const tensor key_repeated_gradient =
        convert(key_gradient, elements, activation_bytes_, promoted_bytes_);
    release(key_gradient);
    tensor key_embedded_gradient = key_repeated_gradient;
    tensor value_projection_gradient = value_gradient;
    if (kv_width_ != hidden_) {
      key_embedded_gradient =
          allocate(tokens_ * kv_width_ * static_cast<std::uint64_t>(promoted_bytes_));
      release(key_repeated_gradient);
      value_projection_gradient = allocate(tokens_ * kv_width_ * activation);
      release(value_gradient);
    }
    const tensor key_projection_gradient = rope_backward(key_embedded_gradient, kv_width_);
    const tensor query_projection_gradient = rope_backward(query_embedded_gradient, hidden_);
    const tensor value_input_gradient = linear_backward(saved.v, value_projection_gradient, hidden_,
                                                        layer_param(layer, v_proj), kv_width_);
    const tensor input_gradient =
        convert(value_input_gradient, elements, activation_bytes_, state_bytes_);
    release(value_input_gradient);
    for (auto [projection_saved, projection_gradient, which] :
         {std::tuple{&saved.k, key_projection_gradient, k_proj},
          std::tuple{&saved.q, query_projection_gradient, q_proj}}) {
      const std::uint64_t width = which == k_proj ? kv_width_ : hidden_;
      const tensor part = linear_backward(*projection_saved, projection_gradient, hidden_,
                                          layer_param(layer, which), width);
      const tensor part_converted = convert(part, elements, activation_bytes_, state_bytes_);
      release(part);
      release(part_converted);  // added in place into input_gradient
    }
    const tensor result =
        rmsnorm_backward(saved.input_norm, input_gradient, layer_param(layer, input_norm));
    release(residual_gradient);  // added in place into result
    return result;
  }

  // HF's LlamaRotaryEmbedding: computed once per forward in fp32, returned in the dtype of
  // the hidden states (fp32 here, since the embedding is not autocast).
  void rotary_embedding_forward() {
    const std::uint64_t half = head_dim_ / 2;
    const tensor positions = allocate(sequence_ * fp32_bytes);  // position_ids.float()
    const tensor frequencies = allocate(half * sequence_ * fp32_bytes);
    release(positions);
    const tensor doubled = allocate(sequence_ * head_dim_ * fp32_bytes);  // cat((f, f), -1)
    release(frequencies);
    tensor cos_sin[2];
    for (tensor& result : cos_sin) {
      const tensor raw = allocate(sequence_ * head_dim_ * fp32_bytes);
      const tensor scaled = allocate(sequence_ * head_dim_ * fp32_bytes);  // * attention_scaling
      release(raw);
      result = convert(scaled, sequence_ * head_dim_, fp32_bytes, state_bytes_);
      release(scaled);
    }
    release(doubled);
    rope_cos_ = cos_sin[0];
    rope_sin_ = cos_sin[1];
  }

  tensor causal_mask_forward() {
    // Only the eager path materialises the mask; SDPA runs with is_causal=True.
    const std::uint64_t square = sequence_ * sequence_;
    const tensor full = allocate(square * state_bytes());
    const tensor upper = allocate(square * state_bytes());  // triu
    release(full);
    const tensor mask = allocate(batch_ * square * state_bytes());  // expand(...).clone()
    release(upper);
    const tensor padding = allocate(batch_ * square);  // the padding merge's boolean mask
    release(padding);
    return mask;
  }

  // Runs the model and the loss under autocast; returns the loss (a scalar).
  tensor forward(const data_batch& batch) {
    const std::uint64_t logits_elements = tokens_ * vocab_;
    tensor x = allocate(tokens_ * hidden_ * state_bytes());  // embedding: fp32, not autocast
    saved_input_ids_ = recorder_.retain(batch.input_ids);
    const tensor cache_position = allocate(sequence_ * int64_bytes);
    const tensor causal_mask = shape_.eager_attention ? causal_mask_forward() : no_tensor;
    rotary_embedding_forward();

    saved_layers_.assign(static_cast<std::size_t>(shape_.layers), layer_saved{});
    for (int layer = 0; layer < shape_.layers; ++layer) {
      const tensor next = layer_forward(layer, x, saved_layers_[static_cast<std::size_t>(layer)]);
      release(x);  // saved by the layer's input norm
      x = next;
    }
    tensor normalized = no_tensor;
    saved_final_norm_ = rmsnorm_forward(x, normalized);
    release(x);
    tensor logits = no_tensor;
    saved_lm_head_ = linear_forward(normalized, state_bytes_, hidden_, lm_head(), vocab_, logits);
    release(normalized);

    // HF's ForCausalLMLoss: logits.float(), labels shifted by one, cross_entropy (mean).
    const tensor logits_fp32 = convert(logits, logits_elements, activation_bytes_, fp32_bytes);
    const tensor padded_labels = allocate(batch_ * (sequence_ + 1) * int64_bytes);
    saved_shifted_labels_ = allocate(tokens_ * int64_bytes);
    release(padded_labels);
    saved_log_probabilities_ = allocate(logits_elements * fp32_bytes);
    release(logits_fp32);
    const tensor loss = allocate(fp32_bytes);
    saved_total_weight_ = allocate(fp32_bytes);

    // Leaving the model and the autocast region drops the caches and the locals;
    // `loss = model(**batch).loss` drops the bf16 logits with the output object.
    release(logits);
    for (tensor t : autocast_weight_cache_) release(t);
    autocast_weight_cache_.clear();
    release(cache_position);
    if (causal_mask != no_tensor) release(causal_mask);
    release(rope_cos_);  // still saved by every layer's RoPE
    release(rope_sin_);
    return loss;
  }

  // loss.backward(), in the order autograd's engine runs the nodes.
  void backward() {
    const std::uint64_t logits_elements = tokens_ * vocab_;
    const tensor seed = allocate(fp32_bytes);  // torch.ones_like(loss)
    const tensor log_probabilities_gradient = allocate(logits_elements * fp32_bytes);
    release(seed);
    release(saved_shifted_labels_);
    release(saved_total_weight_);
    const tensor logits_fp32_gradient = allocate(logits_elements * fp32_bytes);
    release(log_probabilities_gradient);
    release(saved_log_probabilities_);
    const tensor logits_gradient =
        convert(logits_fp32_gradient, logits_elements, fp32_bytes, activation_bytes_);
    release(logits_fp32_gradient);
    const tensor normalized_gradient =
        linear_backward(saved_lm_head_, logits_gradient, hidden_, lm_head(), vocab_);
    const tensor normalized_gradient_state =
        convert(normalized_gradient, tokens_ * hidden_, activation_bytes_, state_bytes_);
    release(normalized_gradient);
    tensor gradient = rmsnorm_backward(saved_final_norm_, normalized_gradient_state, final_norm());

    for (int layer = shape_.layers - 1; layer >= 0; --layer) {
      gradient = layer_backward(layer, saved_layers_[static_cast<std::size_t>(layer)], gradient);
    }

    // embedding_dense_backward: sort the ids (with CUB scratch), segment them, then write
    // a dense fp32 gradient as large as the embedding.
    const std::uint64_t ids_bytes = tokens_ * int64_bytes;
    const tensor sorted_ids = allocate(ids_bytes);
    const tensor original_positions = allocate(ids_bytes);
    const tensor sort_scratch = allocate(2 * ids_bytes + 4096);
    release(sort_scratch);
    const tensor segment_offsets = allocate(ids_bytes);
    const tensor partial_offsets = allocate(ids_bytes);
    const tensor embedding_gradient =
        recorder_.allocate(embedding().elements * state_bytes(), gradient_class(embedding()));
    release(partial_offsets);
    release(segment_offsets);
    release(original_positions);
    release(sorted_ids);
    accumulate_gradient(embedding(), embedding_gradient);
    release(gradient);
    release(saved_input_ids_);
  }

  // torch.nn.utils.clip_grad_norm_ (foreach): one norm per gradient, stacked, reduced;
  // the gradients are then scaled in place. Returns the total norm, which the loop keeps.
  tensor clip_grad_norm() {
    const std::uint64_t scalar = state_bytes();
    std::vector<tensor> norms, norms_of_norms;
    for (std::size_t i = 0; i < parameters_.size(); ++i) norms.push_back(allocate(scalar));
    for (std::size_t i = 0; i < parameters_.size(); ++i) {
      norms_of_norms.push_back(allocate(scalar));
    }
    const tensor stacked = allocate(parameters_.size() * scalar);
    for (tensor t : norms_of_norms) release(t);
    const tensor total_norm = allocate(scalar);
    release(stacked);
    const tensor shifted = allocate(scalar);  // total_norm + 1e-6
    const tensor coefficient = allocate(scalar);
    release(shifted);
    const tensor clamped = allocate(scalar);
    release(coefficient);
    release(clamped);
    for (tensor t : norms) release(t);
    return total_norm;
  }

  // torch.optim.AdamW (foreach, the default on CUDA). Its state is created lazily in the
  // first step; the update is in place apart from one temporary per parameter (the square
  // root of exp_avg_sq), all allocated by one foreach call and freed together.
  void adamw_step() {
    for (parameter& weight : parameters_) {
      if (weight.exp_avg != no_tensor) continue;
      const std::uint64_t bytes = weight.elements * state_bytes();
      weight.exp_avg = recorder_.allocate(bytes, ZEROALLOC_CLASS_OPTIMIZER_STATE);
      weight.exp_avg_sq = recorder_.allocate(bytes, ZEROALLOC_CLASS_OPTIMIZER_STATE);
    }
    std::vector<tensor> square_roots;
    for (const parameter& weight : parameters_) {
      square_roots.push_back(allocate(weight.elements * state_bytes()));
    }
    for (tensor t : square_roots) release(t);
  }

  void zero_grad_set_to_none() {
    for (parameter& weight : parameters_) {
      if (weight.gradient == no_tensor) continue;
      release(weight.gradient);
      weight.gradient = no_tensor;
    }
  }

  const trace_shape& shape_;
  const int activation_bytes_;
  const int state_bytes_;
  const int promoted_bytes_;
  const std::uint64_t hidden_, intermediate_, heads_, head_dim_, kv_width_, vocab_, batch_;
  std::uint64_t sequence_ = 0;
  std::uint64_t tokens_ = 0;

  event_recorder recorder_;
  std::vector<parameter> parameters_;
  tensor inverse_frequencies_ = no_tensor;
  tensor blas_workspace_ = no_tensor;
  std::vector<tensor> autocast_weight_cache_;
  tensor rope_cos_ = no_tensor, rope_sin_ = no_tensor;

  // What autograd holds between forward and backward.
  std::vector<layer_saved> saved_layers_;
  rmsnorm_saved saved_final_norm_;
  linear_saved saved_lm_head_;
  tensor saved_input_ids_ = no_tensor;
  tensor saved_shifted_labels_ = no_tensor;
  tensor saved_total_weight_ = no_tensor;
  tensor saved_log_probabilities_ = no_tensor;
};

const char* class_name(int allocation_class) {
  switch (allocation_class) {
    case ZEROALLOC_CLASS_PARAMETER:
      return "parameter";
    case ZEROALLOC_CLASS_GRADIENT:
      return "gradient";
    case ZEROALLOC_CLASS_OPTIMIZER_STATE:
      return "optimizer_state";
    default:
      return "other";
  }
}

}  // namespace

std::vector<int> varying_sequence_lengths(int steps, int shortest, int longest,
                                          std::uint64_t seed) {
  if (shortest < 1 || longest < shortest) {
    throw std::invalid_argument("sequence lengths: need 1 <= shortest <= longest, got " +
                                std::to_string(shortest) + " and " + std::to_string(longest));
  }
  std::vector<int> lengths;
  std::uint64_t state = seed;
  for (int step = 0; step < steps; ++step) {
    // splitmix64: the same numbers on every platform, unlike std::uniform_int_distribution.
    state += 0x9e3779b97f4a7c15ULL;
    std::uint64_t mixed = state;
    mixed = (mixed ^ (mixed >> 30)) * 0xbf58476d1ce4e5b9ULL;
    mixed = (mixed ^ (mixed >> 27)) * 0x94d049bb133111ebULL;
    mixed ^= mixed >> 31;
    const auto span = static_cast<std::uint64_t>(longest - shortest) + 1;
    auto length =
        static_cast<int>(round_up(static_cast<std::uint64_t>(shortest) + mixed % span, 8));
    if (step == 1 || steps == 1) length = longest;
    lengths.push_back(std::min(length, longest));
  }
  return lengths;
}

std::uint64_t parameter_count(const trace_shape& shape) {
  const auto hidden = static_cast<std::uint64_t>(shape.hidden);
  const auto head_dim = hidden / static_cast<std::uint64_t>(shape.heads);
  const auto kv_width =
      static_cast<std::uint64_t>(shape.kv_heads == 0 ? shape.heads : shape.kv_heads) * head_dim;
  const auto ffn = static_cast<std::uint64_t>(shape.intermediate);
  const std::uint64_t per_layer =
      2 * hidden * hidden + 2 * kv_width * hidden + 3 * hidden * ffn + 2 * hidden;
  return 2 * static_cast<std::uint64_t>(shape.vocab) * hidden +
         static_cast<std::uint64_t>(shape.layers) * per_layer + hidden;
}

void validate(const trace_shape& shape) {
  auto require = [](bool holds, const char* what) {
    if (!holds) throw std::invalid_argument(std::string("trace shape: ") + what);
  };
  require(shape.layers >= 1, "layers must be at least 1");
  require(shape.hidden >= 2, "hidden must be at least 2");
  require(shape.intermediate >= 1, "intermediate must be at least 1");
  require(shape.heads >= 1 && shape.hidden % shape.heads == 0,
          "heads must be at least 1 and divide hidden");
  require((shape.hidden / std::max(shape.heads, 1)) % 2 == 0,
          "the head size (hidden / heads) must be even for rotary embeddings");
  require(shape.kv_heads >= 0 && (shape.kv_heads == 0 || (shape.kv_heads <= shape.heads &&
                                                          shape.heads % shape.kv_heads == 0)),
          "kv_heads must be 0 (as many as heads) or divide heads");
  require(shape.vocab >= 1, "vocab must be at least 1");
  require(shape.batch >= 1, "batch must be at least 1");
  require(shape.steps >= 0, "steps must not be negative");
  require(shape.steps == 0 || !shape.sequence_lengths.empty(),
          "sequence_lengths must not be empty");
  for (int length : shape.sequence_lengths) {
    require(length >= 1, "every sequence length must be at least 1");
  }
  require(shape.activation_bytes_per_element >= 1 && shape.activation_bytes_per_element <= 8,
          "activation_bytes_per_element must be 1 to 8");
  require(shape.state_bytes_per_element >= 1 && shape.state_bytes_per_element <= 8,
          "state_bytes_per_element must be 1 to 8");
}

std::vector<trace_event> make_training_trace(const trace_shape& shape) {
  validate(shape);
  return training_run(shape).run();
}

trace_summary summarize(const std::vector<trace_event>& events) {
  enum : std::uint8_t { unseen, live, freed };
  trace_summary summary;
  std::vector<std::uint8_t> state_of;
  std::vector<std::uint64_t> bytes_of;
  std::vector<std::uint8_t> class_of;
  std::uint64_t live_bytes = 0;
  std::array<std::uint64_t, ZEROALLOC_CLASS_COUNT> live_by_class{};
  auto require_live = [&](std::uint32_t id, const char* what) {
    if (id >= state_of.size() || state_of[id] != live) {
      throw std::invalid_argument(std::string("trace: ") + what + " of allocation " +
                                  std::to_string(id) + ", which is not live");
    }
  };
  for (const trace_event& event : events) {
    ++summary.events;
    summary.streams = std::max(summary.streams, event.stream + 1);
    switch (event.event_kind) {
      case trace_event::allocate: {
        if (event.id >= state_of.size()) {
          state_of.resize(event.id + std::size_t{1}, unseen);
          bytes_of.resize(event.id + std::size_t{1}, 0);
          class_of.resize(event.id + std::size_t{1}, 0);
        }
        if (state_of[event.id] != unseen) {
          throw std::invalid_argument("trace: allocation " + std::to_string(event.id) +
                                      " is allocated twice");
        }
        const auto cls = static_cast<std::size_t>(event.allocation_class);
        state_of[event.id] = live;
        bytes_of[event.id] = event.bytes;
        class_of[event.id] = static_cast<std::uint8_t>(cls);
        ++summary.allocations;
        live_bytes += event.bytes;
        live_by_class[cls] += event.bytes;
        summary.peak_live_bytes = std::max(summary.peak_live_bytes, live_bytes);
        summary.peak_live_bytes_by_class[cls] =
            std::max(summary.peak_live_bytes_by_class[cls], live_by_class[cls]);
        summary.largest_allocation_bytes = std::max(summary.largest_allocation_bytes, event.bytes);
        break;
      }
      case trace_event::free:
        require_live(event.id, "free");
        ++summary.frees;
        state_of[event.id] = freed;
        live_bytes -= bytes_of[event.id];
        live_by_class[class_of[event.id]] -= bytes_of[event.id];
        break;
      case trace_event::record_stream:
        require_live(event.id, "record_stream");
        ++summary.record_streams;
        break;
      case trace_event::step_end:
        ++summary.steps;
        break;
    }
  }
  summary.live_bytes_at_end = live_bytes;
  summary.live_bytes_at_end_by_class = live_by_class;
  return summary;
}

void write_trace(const std::string& path, const std::vector<trace_event>& events,
                 const std::string& description) {
  std::FILE* file = std::fopen(path.c_str(), "w");
  if (file == nullptr) {
    throw std::runtime_error("cannot write trace " + path + ": " + std::strerror(errno));
  }
  std::fprintf(file, "# zeroalloc allocation trace v1%s%s\n", description.empty() ? "" : ": ",
               description.c_str());
  std::fprintf(file,
               "# a <id> <bytes> <stream> <class>, f <id>, r <id> <stream>, s (step end); "
               "classes: 0 %s, 1 %s, 2 %s, 3 %s\n",
               class_name(0), class_name(1), class_name(2), class_name(3));
  for (const trace_event& event : events) {
    switch (event.event_kind) {
      case trace_event::allocate:
        std::fprintf(file, "a %u %llu %d %d\n", event.id,
                     static_cast<unsigned long long>(event.bytes), event.stream,
                     static_cast<int>(event.allocation_class));
        break;
      case trace_event::free:
        std::fprintf(file, "f %u\n", event.id);
        break;
      case trace_event::record_stream:
        std::fprintf(file, "r %u %d\n", event.id, event.stream);
        break;
      case trace_event::step_end:
        std::fputs("s\n", file);
        break;
    }
  }
  const bool failed = std::ferror(file) != 0;
  if (std::fclose(file) != 0 || failed) {
    throw std::runtime_error("cannot write trace " + path + ": " + std::strerror(errno));
  }
}

std::vector<trace_event> read_trace(const std::string& path) {
  std::ifstream file(path);
  if (!file) throw std::runtime_error("cannot read trace " + path + ": " + std::strerror(errno));
  std::vector<trace_event> events;
  std::string line;
  for (std::size_t line_number = 1; std::getline(file, line); ++line_number) {
    const auto fail = [&](const std::string& why) {
      return std::runtime_error(path + ":" + std::to_string(line_number) + ": " + why + ": \"" +
                                line + "\"");
    };
    std::istringstream fields(line);
    std::string kind;
    if (!(fields >> kind) || kind[0] == '#') continue;
    trace_event event;
    long long id = 0, bytes = 0, stream = 0, allocation_class = 0;
    bool parsed = false;
    if (kind == "a") {
      parsed = static_cast<bool>(fields >> id >> bytes >> stream >> allocation_class);
      event.event_kind = trace_event::allocate;
      if (parsed &&
          (bytes < 0 || allocation_class < 0 || allocation_class >= ZEROALLOC_CLASS_COUNT)) {
        throw fail("negative size or unknown class");
      }
    } else if (kind == "f") {
      parsed = static_cast<bool>(fields >> id);
      event.event_kind = trace_event::free;
    } else if (kind == "r") {
      parsed = static_cast<bool>(fields >> id >> stream);
      event.event_kind = trace_event::record_stream;
    } else if (kind == "s") {
      parsed = true;
      event.event_kind = trace_event::step_end;
    } else {
      throw fail("unknown event (expected a, f, r or s)");
    }
    std::string extra;
    if (!parsed || fields >> extra) throw fail("malformed event");
    if (id < 0 || id > std::numeric_limits<std::uint32_t>::max() || stream < 0 || stream > 63) {
      throw fail("id or stream out of range");
    }
    event.id = static_cast<std::uint32_t>(id);
    event.bytes = static_cast<std::uint64_t>(bytes);
    event.stream = static_cast<int>(stream);
    event.allocation_class = static_cast<zeroalloc_class>(allocation_class);
    events.push_back(event);
  }
  if (file.bad()) throw std::runtime_error("cannot read trace " + path + ": read error");
  return events;
}

}  // namespace zeroalloc::demo
