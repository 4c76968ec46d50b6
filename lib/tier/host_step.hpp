// The optimizer step on the host: AdamW over optimizer states that live in pinned host
// memory, run by the CPU cores of the GPU's NUMA node.
//
// Note [Stepped on the host]: under a tight budget the optimizer states live on the host
// tier. Stepping them on the device bounces each window's states through device scratch:
// their bytes cross PCIe twice (in and out), twelve bytes each way per fp32 parameter with
// AdamW (the parameter and both moments). Stepping them where they are moves only the
// gradient to the host (four bytes) and leaves the parameter there, the next forward
// fetching it as it fetches any evicted parameter: a third of the traffic, in one direction
// each. The cost moves to the host's memory bandwidth (28 bytes read or written per
// parameter), which the cores of one NUMA node stream at tens of GB/s.
//
// The update is torch.optim.AdamW's (amsgrad off), element by element in fp32 with the
// scalar factors computed in double as PyTorch computes them; it is not bit for bit the
// device's (fused or foreach kernels contract and order operations differently): the
// difference is rounding, a few ulps per step (tests/tier/host_step_test.cpp states the
// tolerance). So it runs only where asked (ZEROALLOC_HOST_STEP), and the step's figures say
// which windows ran where.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace zeroalloc {

/// torch.optim.AdamW's hyperparameters for one step of one parameter group. `step` is the
/// step count after this step's increment (1 on the first step), as PyTorch's bias
/// corrections read it.
struct adamw_settings {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 1e-2;
  std::int64_t step = 1;
  bool maximize = false;
};

/// Contiguous runs of one parameter's tensors, `count` elements each: fp32 parameter and
/// moments, and the gradient in fp32 (`gradient`) or, for master weights, in bf16
/// (`bf16_gradient`, read instead when set together with `bf16_copy`). With `bf16_copy` set, the
/// updated parameter is also written there rounded to bf16 (to nearest, ties to even: PyTorch's
/// cast), the working copy the device computes with (Note [Master weights] in
/// bindings/python/zeroalloc/torch/_master_weights.py).
struct adamw_span {
  float* parameter = nullptr;
  const float* gradient = nullptr;
  float* exp_avg = nullptr;
  float* exp_avg_sq = nullptr;
  std::size_t count = 0;
  const std::uint16_t* bf16_gradient = nullptr;
  std::uint16_t* bf16_copy = nullptr;
};

/// bf16 <-> fp32 as PyTorch converts them (NaN stays NaN).
[[nodiscard]] float bf16_to_float(std::uint16_t bits);
[[nodiscard]] std::uint16_t float_to_bf16(float value);

/// One AdamW update of `span` on the calling thread (vectorised where the CPU allows).
void adamw_update(const adamw_span& span, const adamw_settings& settings);

/// The CPUs a host step runs on: those of NUMA node `node` that this process may use, else
/// (no such node, or none of its CPUs allowed) every CPU the process may use.
[[nodiscard]] std::vector<int> host_step_cpus(int node);

/// A fixed set of threads, each bound to one CPU, that run the tasks of one call at a time.
class host_workers {
 public:
  /// One thread per CPU in `cpus` (the caller's thread works too, so one fewer is made);
  /// an empty list: the caller's thread alone.
  explicit host_workers(const std::vector<int>& cpus);
  ~host_workers();
  host_workers(const host_workers&) = delete;
  host_workers& operator=(const host_workers&) = delete;

  /// Runs task(0) ... task(tasks - 1) on the workers and the caller's thread, returning when
  /// all have run. Calls are serialised. A task must not throw.
  void run(std::size_t tasks, const std::function<void(std::size_t)>& task);
  [[nodiscard]] std::size_t threads() const { return threads_.size() + 1; }

 private:
  void work(std::size_t index);
  void take_tasks();

  std::mutex call_;  // one run at a time
  std::mutex mutex_;
  std::condition_variable wake_;
  std::condition_variable done_;
  const std::function<void(std::size_t)>* task_ = nullptr;
  std::size_t tasks_ = 0;
  std::size_t next_ = 0;      // the next task to take, under mutex_
  std::size_t finished_ = 0;  // tasks finished, under mutex_
  std::uint64_t round_ = 0;   // run calls so far, under mutex_
  bool stopping_ = false;
  std::vector<std::thread> threads_;
};

/// Note [Copies streamed past the cache]: with master weights each parameter's update reads
/// and writes 28 bytes of host memory, and the step is bound by the host's memory, not by
/// its arithmetic. The bf16 copy is the one write to a line the update has not read, so an
/// ordinary store first reads that line (2 more bytes a parameter). Streamed, the copies
/// are stored past the cache (non-temporal stores) and that read goes. Off by default until
/// measured on the GPU machine's CPUs: bench/tier/host_step_bench --masters runs both.
void set_streamed_copies(bool on);

/// Steps every span, spread over `workers` in pieces of about a megabyte per tensor.
void adamw_on_host(host_workers& workers, const std::vector<adamw_span>& spans,
                   const adamw_settings& settings);

/// Note [The host step's rate]: parameters a second that `workers` step with master weights
/// (fp32 masters and moments, bf16 gradients in, bf16 copies out), over `parameters` of
/// them in buffers the workers touched first (so their pages lie on the workers' node). The
/// best of three passes after one that warms up. Holds 16 bytes a parameter during the call.
[[nodiscard]] double adamw_rate(host_workers& workers, std::size_t parameters);

}  // namespace zeroalloc
