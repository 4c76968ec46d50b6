// The allocation trace of training a decoder-only transformer, as PyTorch would issue it.
//
// The trace follows, allocation by allocation, what PyTorch's caching allocator sees when
// Hugging Face's LlamaForCausalLM (eager RMSNorm, SDPA or eager attention) trains under
// torch.autocast(bfloat16) with fp32 parameters, AdamW (foreach) and clip_grad_norm_:
//
//   for batch in loader:                   # a CUDA prefetcher copies the next batch on a
//     with torch.autocast("cuda", torch.bfloat16):          # side stream (stream 1)
//       loss = model(**batch).loss
//     loss.backward()
//     torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
//     optimizer.step()
//     optimizer.zero_grad()                # set_to_none=True: gradients are freed
//
// What shapes memory is modelled because an allocator is judged on it: parameters,
// gradients and optimizer states that live for the whole run (or from the first step on),
// activations that autograd saves in the forward pass and releases node by node in the
// backward pass, the many short-lived temporaries of both passes (fp32 copies made by
// autocast and by dtype promotion, attention scores, loss buffers as large as
// tokens x vocabulary), batch tensors allocated on one stream and used on another, and
// sequence lengths that change from step to step as they do with real data.
//
// The same trace is replayed through zeroalloc (demo/replay.hpp) and, from its text form,
// through PyTorch's own allocator (bench/python/replay_trace_torch.py), so the two can be
// compared on exactly the same requests.
#pragma once

#include <zeroalloc/zeroalloc.h>

#include <array>
#include <cstdint>
#include <string>
#include <vector>

namespace zeroalloc::demo {

/// One request an allocator sees. Allocation ids are dense, from 0, never reused.
struct trace_event {
  enum kind : std::uint8_t {
    allocate,       ///< `bytes` on `stream`, class `allocation_class`, named `id`
    free,           ///< `id` is freed (on the stream it was allocated on)
    record_stream,  ///< `id` is used on `stream` too (Tensor.record_stream)
    step_end,       ///< a training step ended: a point to read statistics
  };
  kind event_kind = step_end;
  std::uint32_t id = 0;
  std::uint64_t bytes = 0;
  int stream = 0;
  zeroalloc_class allocation_class = ZEROALLOC_CLASS_OTHER;
};

/// The model and the training run. Defaults: a Llama-style model of about 270M parameters.
struct trace_shape {
  int layers = 16;
  int hidden = 1024;
  int intermediate = 2816;  ///< FFN width; Llama: 8/3 x hidden, rounded up to 256
  int heads = 16;
  int kv_heads = 0;  ///< key/value heads (grouped-query attention); 0: as many as `heads`
  int vocab = 32000;
  int batch = 2;
  /// Step i runs at sequence_lengths[i % size]: the longest sequence of its batch, as with
  /// dynamic padding, so the shapes of most activations change from step to step.
  std::vector<int> sequence_lengths{512, 1024, 256, 768};
  int steps = 4;
  /// Activations (autocast's compute dtype): 2 for bf16.
  int activation_bytes_per_element = 2;
  /// Parameters, gradients and optimizer states: 4 for fp32 master weights. With 2 (pure
  /// bf16 training) autocast's casts disappear and the residual stream is bf16.
  int state_bytes_per_element = 4;
  /// false: SDPA's fused (flash) kernel, which never holds batch x heads x seq x seq scores.
  /// true: attn_implementation="eager", which saves the attention probabilities.
  bool eager_attention = false;
  /// zero_grad(set_to_none=True), PyTorch's default: gradients are freed after every step
  /// and allocated again in the next backward pass.
  bool gradients_set_to_none = true;
  bool clip_grad_norm = true;
};

/// `steps` lengths in [shortest, longest], multiples of 8 (pad_to_multiple_of=8), from a
/// fixed pseudo-random sequence so that a seed gives the same trace everywhere. The second
/// step gets `longest`, so the peak falls in a step where optimizer states already exist.
std::vector<int> varying_sequence_lengths(int steps, int shortest, int longest,
                                          std::uint64_t seed = 1);

/// Number of parameters of the model (embedding, layers, final norm, LM head).
std::uint64_t parameter_count(const trace_shape& shape);

/// Throws std::invalid_argument naming the field when the shape cannot describe a model.
void validate(const trace_shape& shape);

/// The whole run: parameters first, then `steps` steps, each ending with a step_end.
/// Parameters and optimizer states are never freed; everything else is freed by the end
/// of its step (or, for a prefetched batch, by the end of the step that uses it).
std::vector<trace_event> make_training_trace(const trace_shape& shape);

/// What a trace asks of an allocator, independent of any allocator.
struct trace_summary {
  std::uint64_t events = 0;
  std::uint64_t allocations = 0;
  std::uint64_t frees = 0;
  std::uint64_t record_streams = 0;
  std::uint64_t steps = 0;
  int streams = 0;                    ///< 1 + the highest stream used
  std::uint64_t peak_live_bytes = 0;  ///< the most bytes live at once: a lower bound
  std::uint64_t live_bytes_at_end = 0;
  std::uint64_t largest_allocation_bytes = 0;
  std::array<std::uint64_t, ZEROALLOC_CLASS_COUNT> peak_live_bytes_by_class{};
  std::array<std::uint64_t, ZEROALLOC_CLASS_COUNT> live_bytes_at_end_by_class{};
};

/// Throws std::invalid_argument when the trace frees or records an id that is not live,
/// or allocates an id twice.
trace_summary summarize(const std::vector<trace_event>& events);

/// Text form, one event per line, so that other programs can replay the same requests:
///   a <id> <bytes> <stream> <class>   class: 0 other, 1 parameter, 2 gradient,
///   f <id>                                   3 optimizer state (zeroalloc_class)
///   r <id> <stream>
///   s
/// Lines starting with '#' are comments; write_trace puts `description` in the first one.
/// Both throw std::runtime_error naming the file (and the line, when reading).
void write_trace(const std::string& path, const std::vector<trace_event>& events,
                 const std::string& description = "");
std::vector<trace_event> read_trace(const std::string& path);

}  // namespace zeroalloc::demo
