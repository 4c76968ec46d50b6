#include "tier/host_step.hpp"

#include <pthread.h>
#include <sched.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>

#include "core/errors.hpp"

namespace zeroalloc {
namespace {

struct adamw_factors {
  float decay = 1.0F;            // 1 - lr * weight_decay
  float one_minus_beta1 = 0.1F;  // the lerp weight of the first moment
  float beta2 = 0.999F;
  float one_minus_beta2 = 0.001F;
  float bias_correction2_sqrt = 1.0F;
  float eps = 1e-8F;
  float negative_step_size = 0.0F;  // -lr / (1 - beta1^step)
  float gradient_sign = 1.0F;       // -1 when maximizing
};

adamw_factors factors_of(const adamw_settings& s) {
  // In double, then rounded once, as PyTorch computes the scalars of its fp32 kernels.
  const auto step = static_cast<double>(s.step);
  adamw_factors f;
  f.decay = static_cast<float>(1.0 - s.lr * s.weight_decay);
  f.one_minus_beta1 = static_cast<float>(1.0 - s.beta1);
  f.beta2 = static_cast<float>(s.beta2);
  f.one_minus_beta2 = static_cast<float>(1.0 - s.beta2);
  f.bias_correction2_sqrt = static_cast<float>(std::sqrt(1.0 - std::pow(s.beta2, step)));
  f.eps = static_cast<float>(s.eps);
  f.negative_step_size = static_cast<float>(-s.lr / (1.0 - std::pow(s.beta1, step)));
  f.gradient_sign = s.maximize ? -1.0F : 1.0F;
  return f;
}

// One element's update, in place; returns the updated parameter. Inlined into each build of
// the loops below, so that each vectorises at its width.
[[gnu::always_inline]] inline float update_element(float gradient, float& parameter, float& exp_avg,
                                                   float& exp_avg_sq, const adamw_factors& f) {
  const float g = gradient * f.gradient_sign;
  const float p = parameter * f.decay;
  const float m = exp_avg + f.one_minus_beta1 * (g - exp_avg);
  const float v = exp_avg_sq * f.beta2 + f.one_minus_beta2 * g * g;
  const float denominator = std::sqrt(v) / f.bias_correction2_sqrt + f.eps;
  exp_avg = m;
  exp_avg_sq = v;
  parameter = p + f.negative_step_size * (m / denominator);
  return parameter;
}

inline float widened(std::uint16_t bits) {
  std::uint32_t wide = static_cast<std::uint32_t>(bits) << 16U;
  float value = 0.0F;
  std::memcpy(&value, &wide, sizeof(value));
  return value;
}

inline std::uint16_t rounded(float value) {
  std::uint32_t bits = 0;
  std::memcpy(&bits, &value, sizeof(bits));
  if ((bits & 0x7FFFFFFFU) > 0x7F800000U) return 0x7FC0;  // NaN, as PyTorch writes it
  bits += ((bits >> 16U) & 1U) + 0x7FFFU;
  return static_cast<std::uint16_t>(bits >> 16U);
}

// Built for three x86-64 levels, the best one chosen at load time; the loop has no
// dependence between elements, so each build vectorises it at its width. Not under
// ThreadSanitizer: the loader runs the choice (an ifunc resolver) before TSan's runtime is
// ready, and the program crashes at load.
#if defined(__x86_64__) && !defined(__SANITIZE_THREAD__)
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#endif
void update_elements(
    float* __restrict parameter, const float* __restrict gradient, float* __restrict exp_avg,
    float* __restrict exp_avg_sq, std::size_t count, adamw_factors f) {
  for (std::size_t i = 0; i < count; ++i) {
    update_element(gradient[i], parameter[i], exp_avg[i], exp_avg_sq[i], f);
  }
}

// Master weights: the gradient arrives in bf16 and the updated parameter leaves in bf16 too
// (`copy` is never null here).
#if defined(__x86_64__) && !defined(__SANITIZE_THREAD__)
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#endif
void update_master_elements(
    float* __restrict parameter, const std::uint16_t* __restrict gradient,
    float* __restrict exp_avg, float* __restrict exp_avg_sq, std::uint16_t* __restrict copy,
    std::size_t count, adamw_factors f) {
  for (std::size_t i = 0; i < count; ++i) {
    copy[i] =
        rounded(update_element(widened(gradient[i]), parameter[i], exp_avg[i], exp_avg_sq[i], f));
  }
}

// Note [Copies streamed past the cache]: see set_streamed_copies in host_step.hpp.
std::atomic<bool> streamed_copies{false};

// `count` bf16 values from `source` (in the cache) to `destination`, past the cache where
// the CPU allows: 16-byte stores once the destination is aligned to them.
void stream_copy(std::uint16_t* destination, const std::uint16_t* source, std::size_t count) {
#if defined(__x86_64__)
  std::size_t i = 0;
  while (i < count && (reinterpret_cast<std::uintptr_t>(destination + i) & 15U) != 0) {
    destination[i] = source[i];
    ++i;
  }
  for (; i + 8 <= count; i += 8) {
    const __m128i eight = _mm_loadu_si128(reinterpret_cast<const __m128i*>(source + i));
    _mm_stream_si128(reinterpret_cast<__m128i*>(destination + i), eight);
  }
  for (; i < count; ++i) destination[i] = source[i];
#else
  std::memcpy(destination, source, count * sizeof(std::uint16_t));
#endif
}

// The master path with its copies streamed: each block's copies are made in a buffer the
// cache holds, then stored past the cache; the fence makes them visible before the worker
// reports the piece done (and so before the copy to the device is queued).
void update_master_streamed(const adamw_span& span, const adamw_factors& f) {
  constexpr std::size_t kBlock = 2048;  // 4 KiB of copies: well inside the first-level cache
  alignas(64) std::uint16_t block[kBlock];
  for (std::size_t at = 0; at < span.count; at += kBlock) {
    const std::size_t count = std::min(kBlock, span.count - at);
    update_master_elements(span.parameter + at, span.bf16_gradient + at, span.exp_avg + at,
                           span.exp_avg_sq + at, block, count, f);
    stream_copy(span.bf16_copy + at, block, count);
  }
#if defined(__x86_64__)
  _mm_sfence();
#endif
}

// One span (or piece of one) with whichever gradient it carries.
void update_span(const adamw_span& span, const adamw_factors& f) {
  if (span.bf16_gradient != nullptr && span.bf16_copy != nullptr) {
    if (streamed_copies.load(std::memory_order_relaxed)) {
      update_master_streamed(span, f);
      return;
    }
    update_master_elements(span.parameter, span.bf16_gradient, span.exp_avg, span.exp_avg_sq,
                           span.bf16_copy, span.count, f);
    return;
  }
  update_elements(span.parameter, span.gradient, span.exp_avg, span.exp_avg_sq, span.count, f);
  if (span.bf16_copy != nullptr) {
    for (std::size_t i = 0; i < span.count; ++i) span.bf16_copy[i] = rounded(span.parameter[i]);
  }
}

std::vector<int> parse_cpu_list(const std::string& text) {
  std::vector<int> cpus;
  std::stringstream items(text);
  std::string item;
  while (std::getline(items, item, ',')) {
    if (item.empty() || item == "\n") continue;
    const std::size_t dash = item.find('-');
    try {
      const int first = std::stoi(item.substr(0, dash));
      const int last = dash == std::string::npos ? first : std::stoi(item.substr(dash + 1));
      for (int cpu = first; cpu <= last; ++cpu) cpus.push_back(cpu);
    } catch (const std::exception&) {
      return {};  // not a CPU list: the caller uses every allowed CPU
    }
  }
  return cpus;
}

}  // namespace

void adamw_update(const adamw_span& span, const adamw_settings& settings) {
  update_span(span, factors_of(settings));
}

float bf16_to_float(std::uint16_t bits) { return widened(bits); }

std::uint16_t float_to_bf16(float value) { return rounded(value); }

std::vector<int> host_step_cpus(int node) {
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  std::vector<int> usable;
  if (::sched_getaffinity(0, sizeof(allowed), &allowed) != 0) return usable;
  std::ifstream list("/sys/devices/system/node/node" + std::to_string(node) + "/cpulist");
  std::string text;
  if (node >= 0 && list && std::getline(list, text)) {
    for (int cpu : parse_cpu_list(text)) {
      if (cpu >= 0 && cpu < CPU_SETSIZE && CPU_ISSET(cpu, &allowed)) usable.push_back(cpu);
    }
  }
  if (!usable.empty()) return usable;
  for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) {
    if (CPU_ISSET(cpu, &allowed)) usable.push_back(cpu);
  }
  return usable;
}

host_workers::host_workers(const std::vector<int>& cpus) {
  const std::size_t extra = cpus.empty() ? 0 : cpus.size() - 1;
  threads_.reserve(extra);
  for (std::size_t index = 0; index < extra; ++index) {
    threads_.emplace_back([this, index] { work(index); });
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(cpus[index + 1], &one);
    // Best effort: a thread that cannot be bound still works, wherever it runs.
    (void)::pthread_setaffinity_np(threads_.back().native_handle(), sizeof(one), &one);
  }
}

host_workers::~host_workers() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  for (std::thread& thread : threads_) thread.join();
}

void host_workers::take_tasks() {
  std::unique_lock lock(mutex_);
  while (next_ < tasks_) {
    const std::size_t mine = next_++;
    const auto* task = task_;
    lock.unlock();
    (*task)(mine);
    lock.lock();
    if (++finished_ == tasks_) done_.notify_all();
  }
}

void host_workers::work(std::size_t /*index*/) {
  std::uint64_t seen = 0;
  for (;;) {
    {
      std::unique_lock lock(mutex_);
      wake_.wait(lock, [&] { return stopping_ || round_ != seen; });
      if (stopping_) return;
      seen = round_;
    }
    take_tasks();
  }
}

void host_workers::run(std::size_t tasks, const std::function<void(std::size_t)>& task) {
  if (tasks == 0) return;
  std::lock_guard one_call(call_);
  {
    std::lock_guard lock(mutex_);
    task_ = &task;
    tasks_ = tasks;
    next_ = 0;
    finished_ = 0;
    ++round_;
  }
  if (tasks > 1) wake_.notify_all();
  take_tasks();
  std::unique_lock lock(mutex_);
  done_.wait(lock, [&] { return finished_ == tasks_; });
  task_ = nullptr;
  tasks_ = 0;  // a worker that wakes late finds nothing to take
}

void set_streamed_copies(bool on) { streamed_copies.store(on, std::memory_order_relaxed); }

void adamw_on_host(host_workers& workers, const std::vector<adamw_span>& spans,
                   const adamw_settings& settings) {
  // Pieces of 256 Ki elements (a megabyte of each tensor): enough to stream at full rate,
  // small enough that the last ones balance the threads.
  constexpr std::size_t kPiece = std::size_t{1} << 18;
  std::vector<adamw_span> pieces;
  for (const adamw_span& span : spans) {
    for (std::size_t at = 0; at < span.count; at += kPiece) {
      const std::size_t count = std::min(kPiece, span.count - at);
      adamw_span piece{span.parameter + at,
                       span.gradient != nullptr ? span.gradient + at : nullptr,
                       span.exp_avg + at,
                       span.exp_avg_sq + at,
                       count,
                       span.bf16_gradient != nullptr ? span.bf16_gradient + at : nullptr,
                       span.bf16_copy != nullptr ? span.bf16_copy + at : nullptr};
      pieces.push_back(piece);
    }
  }
  const adamw_factors factors = factors_of(settings);
  workers.run(pieces.size(), [&](std::size_t index) { update_span(pieces[index], factors); });
}

// Note [The host step's rate]: what the host step would cost, asked before it runs (the
// Python package's advice of the fast recipe, Note [The fast recipe, advised]). The same
// workers and update as the step, on buffers as large as a few layers' masters: far past
// the caches, so the rate is the node's memory bandwidth over the 28 bytes a parameter's
// update reads and writes, as in the step. 0 when no pass took measurable time.
double adamw_rate(host_workers& workers, std::size_t parameters) {
  ZA_REQUIRE(parameters > 0, "the host step's rate needs at least one parameter");
  constexpr std::size_t kPiece = std::size_t{1} << 18;
  auto masters = std::make_unique_for_overwrite<float[]>(parameters);
  auto exp_avgs = std::make_unique_for_overwrite<float[]>(parameters);
  auto exp_avg_sqs = std::make_unique_for_overwrite<float[]>(parameters);
  auto gradients = std::make_unique_for_overwrite<std::uint16_t[]>(parameters);
  auto copies = std::make_unique_for_overwrite<std::uint16_t[]>(parameters);
  const std::size_t pieces = (parameters + kPiece - 1) / kPiece;
  std::vector<adamw_span> spans;
  spans.push_back({masters.get(), nullptr, exp_avgs.get(), exp_avg_sqs.get(), parameters,
                   gradients.get(), copies.get()});
  // First touch on the workers: each page on the node of the CPU that steps it.
  workers.run(pieces, [&](std::size_t index) {
    const std::size_t at = index * kPiece;
    const std::size_t count = std::min(kPiece, parameters - at);
    std::fill_n(masters.get() + at, count, 0.5f);
    std::fill_n(exp_avgs.get() + at, count, 0.0f);
    std::fill_n(exp_avg_sqs.get() + at, count, 0.0f);
    std::fill_n(gradients.get() + at, count, float_to_bf16(1e-3f));
    std::fill_n(copies.get() + at, count, std::uint16_t{0});
  });
  adamw_settings settings;
  double best = 0.0;
  for (int pass = 0; pass < 4; ++pass) {
    settings.step = pass + 1;
    const auto start = std::chrono::steady_clock::now();
    adamw_on_host(workers, spans, settings);
    const std::chrono::duration<double> took = std::chrono::steady_clock::now() - start;
    if (pass > 0 && took.count() > 0) {
      best = std::max(best, static_cast<double>(parameters) / took.count());
    }
  }
  return best;
}

}  // namespace zeroalloc
