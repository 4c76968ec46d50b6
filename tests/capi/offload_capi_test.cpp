// The offload part of the C ABI, as a program sees it with ZEROALLOC_OFFLOAD=host (CTest sets
// it, with a 256 MiB host limit and 8 MiB chunks): an allocation moves to the host and back
// at the same address, the statistics say where the bytes went, hints are accepted, and bad
// calls fail with a message.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>
#include <linux/io_uring.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "zeroalloc/zeroalloc.h"

namespace {

constexpr std::size_t kMiB = 1 << 20;

std::string stats() {
  std::vector<char> buffer(static_cast<std::size_t>(zeroalloc_stats_json(0, nullptr, 0)) + 1);
  zeroalloc_stats_json(0, buffer.data(), buffer.size());
  return buffer.data();
}

// A figure of the "offload" section; 0 before the engine exists (it starts in the background,
// and has moved nothing then), -1 for a key the section lacks.
long long offload_figure(const std::string& key) {
  const std::string text = stats();
  const std::size_t section = text.find("\"offload\":{");
  if (section == std::string::npos) return 0;
  const std::size_t at = text.find("\"" + key + "\":", section);
  if (at == std::string::npos) return -1;
  return std::atoll(text.c_str() + at + key.size() + 3);
}

TEST(OffloadCapi, AnAllocationMovesToTheHostAndBackAtTheSameAddress) {
  const long long states_out = offload_figure("bytes_to_host_optimizer_state");
  const long long states_in = offload_figure("bytes_to_device_optimizer_state");
  const long long parameters_out = offload_figure("bytes_to_host_parameter");
  void* pointer = zeroalloc_malloc_class(24 * kMiB, 0, nullptr, ZEROALLOC_CLASS_OPTIMIZER_STATE);
  ASSERT_NE(pointer, nullptr) << zeroalloc_last_error();
  EXPECT_EQ(zeroalloc_residency(pointer), ZEROALLOC_ON_DEVICE);
  ASSERT_EQ(zeroalloc_offload(pointer, /*wait=*/1), 0) << zeroalloc_last_error();
  EXPECT_EQ(offload_figure("bytes_to_host_optimizer_state") - states_out,
            static_cast<long long>(24 * kMiB))
      << "what moved, by class";
  EXPECT_EQ(offload_figure("bytes_to_host_parameter"), parameters_out);
  EXPECT_EQ(zeroalloc_residency(pointer), ZEROALLOC_ON_HOST);
  EXPECT_EQ(offload_figure("host_resident_bytes"), static_cast<long long>(24 * kMiB));
  EXPECT_EQ(offload_figure("bytes_to_host"), static_cast<long long>(24 * kMiB));
  EXPECT_EQ(offload_figure("host_limit_bytes"), static_cast<long long>(256 * kMiB));
  ASSERT_EQ(zeroalloc_fetch(pointer, 1), 0) << zeroalloc_last_error();
  EXPECT_EQ(zeroalloc_residency(pointer), ZEROALLOC_ON_DEVICE);
  EXPECT_EQ(offload_figure("host_resident_bytes"), 0);
  EXPECT_EQ(offload_figure("bytes_to_device_optimizer_state") - states_in,
            static_cast<long long>(24 * kMiB));
  zeroalloc_free(pointer, 24 * kMiB, 0, nullptr);
}

TEST(OffloadCapi, TheBytesOfAClassMovedAreACheapReadOfTheStatistics) {
  std::uint64_t out_before = 0, in_before = 0, other_out = 0, other_in = 0;
  ASSERT_EQ(zeroalloc_moved_bytes(0, ZEROALLOC_CLASS_GRADIENT, &out_before, &in_before), 0)
      << zeroalloc_last_error();
  ASSERT_EQ(zeroalloc_moved_bytes(0, ZEROALLOC_CLASS_OTHER, &other_out, &other_in), 0);
  void* pointer = zeroalloc_malloc_class(16 * kMiB, 0, nullptr, ZEROALLOC_CLASS_GRADIENT);
  ASSERT_NE(pointer, nullptr) << zeroalloc_last_error();
  ASSERT_EQ(zeroalloc_offload(pointer, /*wait=*/1), 0) << zeroalloc_last_error();
  ASSERT_EQ(zeroalloc_fetch(pointer, /*wait=*/1), 0) << zeroalloc_last_error();
  std::uint64_t out = 0, in = 0;
  ASSERT_EQ(zeroalloc_moved_bytes(0, ZEROALLOC_CLASS_GRADIENT, &out, &in), 0);
  EXPECT_EQ(out - out_before, 16 * kMiB);
  EXPECT_EQ(in - in_before, 16 * kMiB);
  EXPECT_EQ(static_cast<long long>(out),
            offload_figure("bytes_to_host_gradient"));  // what the statistics say
  std::uint64_t other_out_after = 0, other_in_after = 0;
  ASSERT_EQ(zeroalloc_moved_bytes(0, ZEROALLOC_CLASS_OTHER, &other_out_after, &other_in_after), 0);
  EXPECT_EQ(other_out_after, other_out) << "another class's bytes are not this one's";
  zeroalloc_free(pointer, 16 * kMiB, 0, nullptr);

  EXPECT_EQ(zeroalloc_moved_bytes(0, ZEROALLOC_CLASS_OTHER, nullptr, &in), -1);
  EXPECT_NE(std::string(zeroalloc_last_error()).find("to_host and to_device must not be NULL"),
            std::string::npos)
      << zeroalloc_last_error();
  EXPECT_EQ(zeroalloc_moved_bytes(999, ZEROALLOC_CLASS_OTHER, &out, &in), -1);
}

TEST(OffloadCapi, HintsAreAcceptedForAnyPointer) {
  void* pointer = zeroalloc_malloc_class(8 * kMiB, 0, nullptr, ZEROALLOC_CLASS_PARAMETER);
  ASSERT_NE(pointer, nullptr);
  const long long uses = offload_figure("uses");
  zeroalloc_use_begins(pointer, nullptr);
  zeroalloc_use_ends(pointer, nullptr);
  // An offloaded state used in place stays on the host, and is not counted as a fetch use.
  void* state = zeroalloc_malloc_class(8 * kMiB, 0, nullptr, ZEROALLOC_CLASS_OPTIMIZER_STATE);
  ASSERT_NE(state, nullptr);
  ASSERT_EQ(zeroalloc_offload(state, 1), 0) << zeroalloc_last_error();
  const long long in_place = offload_figure("in_place_uses");
  zeroalloc_use_in_place(state, nullptr);
  EXPECT_EQ(zeroalloc_residency(state), ZEROALLOC_ON_HOST);
  EXPECT_EQ(offload_figure("in_place_uses"), in_place + 1);
  EXPECT_EQ(offload_figure("chunks_in_use"), 1);
  zeroalloc_use_ends(state, nullptr);
  EXPECT_EQ(offload_figure("chunks_in_use"), 0);
  zeroalloc_step_boundary();
  EXPECT_EQ(offload_figure("uses"), uses + 1);
  EXPECT_GE(offload_figure("steps"), 1);
  int on_the_stack = 0;
  zeroalloc_use_begins(&on_the_stack, nullptr);  // not zeroalloc's: ignored, no crash
  zeroalloc_use_in_place(&on_the_stack, nullptr);
  zeroalloc_use_ends(&on_the_stack, nullptr);
  zeroalloc_free(state, 8 * kMiB, 0, nullptr);
  zeroalloc_free(pointer, 8 * kMiB, 0, nullptr);
}

TEST(OffloadCapi, HintsForSeveralAllocationsAtOnceAreOneUseEach) {
  // Two parameters small enough to share a chunk, and a pointer zeroalloc does not own
  // between them: begun together, ended one by one, the chunk stays in use until both end.
  void* first = zeroalloc_malloc_class(1 * kMiB, 0, nullptr, ZEROALLOC_CLASS_PARAMETER);
  void* second = zeroalloc_malloc_class(1 * kMiB, 0, nullptr, ZEROALLOC_CLASS_PARAMETER);
  ASSERT_NE(first, nullptr);
  ASSERT_NE(second, nullptr);
  int on_the_stack = 0;
  const void* together[] = {first, &on_the_stack, second};
  const long long uses = offload_figure("uses");
  zeroalloc_use_begins_many(together, 3, nullptr);
  EXPECT_EQ(offload_figure("uses"), uses + 2);
  EXPECT_GE(offload_figure("chunks_in_use"), 1);
  const void* just_first[] = {first};
  zeroalloc_use_ends_many(just_first, 1, nullptr);
  EXPECT_GE(offload_figure("chunks_in_use"), 1) << "the second allocation's use is still open";
  const void* just_second[] = {second};
  zeroalloc_use_ends_many(just_second, 1, nullptr);
  EXPECT_EQ(offload_figure("chunks_in_use"), 0);

  // States used in place together stay where they are, each counted.
  void* states[] = {zeroalloc_malloc_class(8 * kMiB, 0, nullptr, ZEROALLOC_CLASS_OPTIMIZER_STATE),
                    zeroalloc_malloc_class(8 * kMiB, 0, nullptr, ZEROALLOC_CLASS_OPTIMIZER_STATE)};
  for (void* state : states) {
    ASSERT_NE(state, nullptr);
    ASSERT_EQ(zeroalloc_offload(state, 1), 0) << zeroalloc_last_error();
  }
  const long long in_place = offload_figure("in_place_uses");
  const void* pinned[] = {states[0], states[1]};
  zeroalloc_use_in_place_many(pinned, 2, nullptr);
  EXPECT_EQ(offload_figure("in_place_uses"), in_place + 2);
  EXPECT_EQ(offload_figure("chunks_in_use"), 2);
  EXPECT_EQ(zeroalloc_residency(states[0]), ZEROALLOC_ON_HOST);
  EXPECT_EQ(zeroalloc_residency(states[1]), ZEROALLOC_ON_HOST);
  zeroalloc_use_ends_many(pinned, 2, nullptr);
  EXPECT_EQ(offload_figure("chunks_in_use"), 0);

  zeroalloc_use_begins_many(nullptr, 0, nullptr);  // nothing to do
  zeroalloc_use_begins_many(nullptr, 2, nullptr);  // bad: logged and reported, no crash
  EXPECT_NE(std::string(zeroalloc_last_error()).find("pointers is NULL"), std::string::npos)
      << zeroalloc_last_error();
  for (void* state : states) zeroalloc_free(state, 8 * kMiB, 0, nullptr);
  zeroalloc_free(second, 1 * kMiB, 0, nullptr);
  zeroalloc_free(first, 1 * kMiB, 0, nullptr);
}

TEST(OffloadCapi, BadCallsFailWithAMessage) {
  int on_the_stack = 0;
  EXPECT_EQ(zeroalloc_offload(&on_the_stack, 1), -1);
  EXPECT_NE(std::string(zeroalloc_last_error()).find("is not memory zeroalloc allocated"),
            std::string::npos)
      << zeroalloc_last_error();
  EXPECT_EQ(zeroalloc_residency(&on_the_stack), -1);
  void* pointer = zeroalloc_malloc_class(8 * kMiB, 0, nullptr, ZEROALLOC_CLASS_PARAMETER);
  EXPECT_EQ(zeroalloc_offload(static_cast<char*>(pointer) + 512, 1), -1);
  EXPECT_NE(std::string(zeroalloc_last_error()).find("not the start of a live allocation"),
            std::string::npos)
      << zeroalloc_last_error();
  zeroalloc_free(pointer, 8 * kMiB, 0, nullptr);
}

// Bytes between the program and memory zeroalloc allocated: on CUDA through the runtime, on
// the simulated device (host memory) directly.
bool on_cuda() {
  const char* kind = std::getenv("ZEROALLOC_DEVICE");
  return kind != nullptr && std::string(kind) == "cuda";
}

void copy_bytes(void* to, const void* from, std::size_t bytes) {
  if (on_cuda()) {
    ASSERT_EQ(cudaMemcpy(to, from, bytes, cudaMemcpyDefault), cudaSuccess);
  } else {
    std::memcpy(to, from, bytes);
  }
}

std::vector<float> random_floats(std::size_t count, float scale, unsigned seed) {
  std::mt19937 generator(seed);
  std::normal_distribution<float> normal(0.0F, scale);
  std::vector<float> values(count);
  for (float& value : values) value = normal(generator);
  return values;
}

// torch.optim.AdamW's update (amsgrad off) in double, for one element.
void adamw_reference(double& p, double g, double& m, double& v, const zeroalloc_adamw_settings& s) {
  p *= 1.0 - s.lr * s.weight_decay;
  m += (1.0 - s.beta1) * (g - m);
  v = v * s.beta2 + (1.0 - s.beta2) * g * g;
  const double step = static_cast<double>(s.step);
  const double denominator = std::sqrt(v) / std::sqrt(1.0 - std::pow(s.beta2, step)) + s.eps;
  p -= s.lr / (1.0 - std::pow(s.beta1, step)) * m / denominator;
}

// Note [Stepped on the host] (lib/tier/host_step.hpp): with a parameter and both moments on
// the host (12 MiB each: two 8 MiB chunks and part of a third), AdamW steps them there, on the
// CPUs, from a gradient in the program's host memory and then from one the library offloaded;
// the values match AdamW computed in double to fp32 rounding, and the memory never moves.
TEST(OffloadCapi, AdamWStepsStatesOnTheHostWhereTheyAre) {
  constexpr std::size_t kCount = 3 * kMiB;  // floats
  constexpr std::size_t kBytes = kCount * sizeof(float);
  void* parameter = zeroalloc_malloc_class(kBytes, 0, nullptr, ZEROALLOC_CLASS_PARAMETER);
  void* exp_avg = zeroalloc_malloc_class(kBytes, 0, nullptr, ZEROALLOC_CLASS_OPTIMIZER_STATE);
  void* exp_avg_sq = zeroalloc_malloc_class(kBytes, 0, nullptr, ZEROALLOC_CLASS_OPTIMIZER_STATE);
  void* gradient = zeroalloc_malloc_class(kBytes, 0, nullptr, ZEROALLOC_CLASS_GRADIENT);
  ASSERT_TRUE(parameter && exp_avg && exp_avg_sq && gradient) << zeroalloc_last_error();
  std::vector<float> p = random_floats(kCount, 1.0F, 1);
  std::vector<float> m = random_floats(kCount, 0.01F, 2);
  std::vector<float> v = random_floats(kCount, 0.001F, 3);
  for (float& each : v) each = each * each;
  const std::vector<float> g1 = random_floats(kCount, 0.1F, 4);
  const std::vector<float> g2 = random_floats(kCount, 0.1F, 5);
  copy_bytes(parameter, p.data(), kBytes);
  copy_bytes(exp_avg, m.data(), kBytes);
  copy_bytes(exp_avg_sq, v.data(), kBytes);
  copy_bytes(gradient, g2.data(), kBytes);
  std::vector<double> rp(p.begin(), p.end()), rm(m.begin(), m.end()), rv(v.begin(), v.end());
  zeroalloc_adamw_settings settings{1e-3, 0.9, 0.999, 1e-8, 0.01, 1, 0};
  void* parameters[] = {parameter};
  void* exp_avgs[] = {exp_avg};
  void* exp_avg_sqs[] = {exp_avg_sq};
  const std::size_t counts[] = {kCount};

  // A state on the device: nothing is stepped, and the caller is told so.
  const void* host_gradient[] = {g1.data()};
  ASSERT_EQ(zeroalloc_offload(parameter, 1), 0) << zeroalloc_last_error();
  ASSERT_EQ(zeroalloc_offload(exp_avg, 1), 0) << zeroalloc_last_error();
  EXPECT_EQ(zeroalloc_adamw_on_host(parameters, host_gradient, exp_avgs, exp_avg_sqs, counts, 1,
                                    &settings, nullptr),
            0)
      << zeroalloc_last_error();
  std::vector<float> unchanged(kCount);
  copy_bytes(unchanged.data(), parameter, kBytes);
  EXPECT_EQ(unchanged, p) << "a refused step changed the parameter";

  ASSERT_EQ(zeroalloc_offload(exp_avg_sq, 1), 0) << zeroalloc_last_error();
  const long long moved_out = offload_figure("bytes_to_host");
  const long long moved_in = offload_figure("bytes_to_device");
  ASSERT_EQ(zeroalloc_adamw_on_host(parameters, host_gradient, exp_avgs, exp_avg_sqs, counts, 1,
                                    &settings, nullptr),
            1)
      << zeroalloc_last_error();
  for (std::size_t i = 0; i < kCount; ++i) adamw_reference(rp[i], g1[i], rm[i], rv[i], settings);
  // Step 2 reads its gradient from an allocation the library moved to the host.
  ASSERT_EQ(zeroalloc_offload(gradient, 1), 0) << zeroalloc_last_error();
  const void* offloaded_gradient[] = {gradient};
  settings.step = 2;
  ASSERT_EQ(zeroalloc_adamw_on_host(parameters, offloaded_gradient, exp_avgs, exp_avg_sqs, counts,
                                    1, &settings, nullptr),
            1)
      << zeroalloc_last_error();
  for (std::size_t i = 0; i < kCount; ++i) adamw_reference(rp[i], g2[i], rm[i], rv[i], settings);
  EXPECT_EQ(zeroalloc_residency(parameter), ZEROALLOC_ON_HOST);
  EXPECT_EQ(zeroalloc_residency(exp_avg_sq), ZEROALLOC_ON_HOST);
  EXPECT_EQ(offload_figure("bytes_to_device"), moved_in) << "the step fetched something";
  EXPECT_EQ(offload_figure("bytes_to_host"), moved_out + static_cast<long long>(kBytes))
      << "only the gradient should have moved";

  // Read back through the device's addresses: what the device sees is what the CPUs wrote.
  std::vector<float> stepped(kCount), first(kCount), second(kCount);
  copy_bytes(stepped.data(), parameter, kBytes);
  copy_bytes(first.data(), exp_avg, kBytes);
  copy_bytes(second.data(), exp_avg_sq, kBytes);
  std::size_t moved = 0;
  for (std::size_t i = 0; i < kCount; ++i) {
    // fp32 rounding over two steps: a few ulps of each value, or of the terms (about 0.01)
    // where a gradient cancels a moment.
    EXPECT_NEAR(stepped[i], rp[i], 4e-6 * std::abs(rp[i]) + 1e-7) << "parameter " << i;
    EXPECT_NEAR(first[i], rm[i], 4e-6 * std::abs(rm[i]) + 1e-8) << "exp_avg " << i;
    EXPECT_NEAR(second[i], rv[i], 4e-6 * std::abs(rv[i]) + 1e-15) << "exp_avg_sq " << i;
    if (stepped[i] != p[i]) ++moved;
    if (HasFailure()) break;
  }
  EXPECT_GT(moved, kCount * 99 / 100) << "the step changed almost nothing";

  // A count past the allocation's end would write a neighbour's bytes: refused, named.
  const std::size_t too_many[] = {kCount + 4096};
  EXPECT_EQ(zeroalloc_adamw_on_host(parameters, offloaded_gradient, exp_avgs, exp_avg_sqs, too_many,
                                    1, &settings, nullptr),
            -1);
  EXPECT_NE(std::string(zeroalloc_last_error()).find("fewer than its count"), std::string::npos)
      << zeroalloc_last_error();
  settings.beta2 = 1.0;
  EXPECT_EQ(zeroalloc_adamw_on_host(parameters, offloaded_gradient, exp_avgs, exp_avg_sqs, counts,
                                    1, &settings, nullptr),
            -1);
  EXPECT_NE(std::string(zeroalloc_last_error()).find("beta2=1"), std::string::npos)
      << zeroalloc_last_error();
  for (void* each : {parameter, exp_avg, exp_avg_sq, gradient}) {
    zeroalloc_free(each, kBytes, 0, nullptr);
  }
}

std::uint16_t bf16_of(float value) {  // PyTorch's cast: to nearest, ties to even
  std::uint32_t bits = 0;
  std::memcpy(&bits, &value, sizeof(bits));
  bits += ((bits >> 16U) & 1U) + 0x7FFFU;
  return static_cast<std::uint16_t>(bits >> 16U);
}

float float_of(std::uint16_t bf16) {
  const std::uint32_t bits = static_cast<std::uint32_t>(bf16) << 16U;
  float value = 0.0F;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}

// Note [Master weights] (bindings/python/zeroalloc/torch/_master_weights.py): fp32 masters
// and moments the engine holds on the host (three chunks each, so the runs split at chunk
// edges) step from a bf16 gradient in the program's memory, and each updated master comes
// back rounded into the program's bf16 copy at the same element.
TEST(OffloadCapi, MasterWeightsStepOnTheHostFromBf16GradientsIntoBf16Copies) {
  constexpr std::size_t kCount = 3 * kMiB;  // floats
  constexpr std::size_t kBytes = kCount * sizeof(float);
  void* master = zeroalloc_malloc_class(kBytes, 0, nullptr, ZEROALLOC_CLASS_OPTIMIZER_STATE);
  void* exp_avg = zeroalloc_malloc_class(kBytes, 0, nullptr, ZEROALLOC_CLASS_OPTIMIZER_STATE);
  void* exp_avg_sq = zeroalloc_malloc_class(kBytes, 0, nullptr, ZEROALLOC_CLASS_OPTIMIZER_STATE);
  ASSERT_TRUE(master && exp_avg && exp_avg_sq) << zeroalloc_last_error();
  const std::vector<float> p = random_floats(kCount, 1.0F, 11);
  const std::vector<float> zeros(kCount, 0.0F);
  const std::vector<float> g = random_floats(kCount, 0.1F, 12);
  std::vector<std::uint16_t> gradient(kCount), copies(kCount, 0);
  for (std::size_t i = 0; i < kCount; ++i) gradient[i] = bf16_of(g[i]);
  copy_bytes(master, p.data(), kBytes);
  copy_bytes(exp_avg, zeros.data(), kBytes);
  copy_bytes(exp_avg_sq, zeros.data(), kBytes);
  for (void* each : {master, exp_avg, exp_avg_sq}) {
    ASSERT_EQ(zeroalloc_offload(each, 1), 0) << zeroalloc_last_error();
  }
  const zeroalloc_adamw_settings settings{1e-3, 0.9, 0.999, 1e-8, 0.01, 1, 0};
  void* masters[] = {master};
  void* exp_avgs[] = {exp_avg};
  void* exp_avg_sqs[] = {exp_avg_sq};
  const void* gradients[] = {gradient.data()};
  void* copy_pointers[] = {copies.data()};
  const std::size_t counts[] = {kCount};
  ASSERT_EQ(zeroalloc_adamw_on_host_bf16(masters, gradients, exp_avgs, exp_avg_sqs, copy_pointers,
                                         counts, 1, &settings, nullptr),
            1)
      << zeroalloc_last_error();
  std::vector<float> stepped(kCount);
  copy_bytes(stepped.data(), master, kBytes);
  std::size_t moved = 0;
  for (std::size_t i = 0; i < kCount; ++i) {
    double rp = p[i], rm = 0, rv = 0;
    adamw_reference(rp, float_of(gradient[i]), rm, rv, settings);
    ASSERT_NEAR(stepped[i], rp, 4e-6 * std::abs(rp) + 1e-7) << "master " << i;
    ASSERT_EQ(copies[i], bf16_of(stepped[i])) << "copy " << i;
    if (stepped[i] != p[i]) ++moved;
  }
  EXPECT_GT(moved, kCount * 99 / 100) << "the step changed almost nothing";
  EXPECT_EQ(zeroalloc_residency(master), ZEROALLOC_ON_HOST);

  // A gradient in the library's memory is not the caller's bf16 host memory: refused, named.
  const void* managed[] = {exp_avg};
  EXPECT_EQ(zeroalloc_adamw_on_host_bf16(masters, managed, exp_avgs, exp_avg_sqs, copy_pointers,
                                         counts, 1, &settings, nullptr),
            -1);
  EXPECT_NE(std::string(zeroalloc_last_error()).find("not host memory of the caller's"),
            std::string::npos)
      << zeroalloc_last_error();
  EXPECT_EQ(zeroalloc_adamw_on_host_bf16(masters, gradients, exp_avgs, exp_avg_sqs, nullptr, counts,
                                         1, &settings, nullptr),
            -1);
  for (void* each : {master, exp_avg, exp_avg_sq}) zeroalloc_free(each, kBytes, 0, nullptr);
}

// Whether this kernel lets the process use io_uring (the NVMe tier needs it).
bool io_uring_usable() {
  io_uring_params params{};
  const long ring = syscall(__NR_io_uring_setup, 1, &params);
  if (ring < 0) return false;
  close(static_cast<int>(ring));
  return true;
}

// The NVMe tier with no code change: ZEROALLOC_NVME_PATH and ZEROALLOC_NVME_SIZE beside
// ZEROALLOC_OFFLOAD=host. States beyond the device's and the host tier's limits go to the
// swap file and come back for their hinted uses; the statistics say so. In a fresh process
// (the library reads its variables once).
TEST(OffloadCapi, StatesBeyondTheHostLimitGoToTheNvmeTierAndComeBackForTheirUses) {
  if (!io_uring_usable()) GTEST_SKIP() << "skipped: io_uring is not available here";
  char directory[] = "/tmp/offload_capi_nvme-XXXXXX";
  ASSERT_NE(mkdtemp(directory), nullptr);
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        setenv("ZEROALLOC_MEMORY_LIMIT", "32MiB", 1);
        setenv("ZEROALLOC_HOST_LIMIT", "16MiB", 1);
        setenv("ZEROALLOC_NVME_PATH", directory, 1);
        setenv("ZEROALLOC_NVME_SIZE", "64MiB", 1);
        setenv("ZEROALLOC_ACCESS", "hinted", 1);
        std::vector<void*> states;
        for (int i = 0; i < 8; ++i) {  // 64 MiB: 32 on the device, 16 on the host, 16 on disk
          void* state =
              zeroalloc_malloc_class(8 * kMiB, 0, nullptr, ZEROALLOC_CLASS_OPTIMIZER_STATE);
          if (state == nullptr) {
            std::fprintf(stderr, "allocation %d failed: %s\n", i, zeroalloc_last_error());
            std::exit(1);
          }
          zeroalloc_use_begins(state, nullptr);
          zeroalloc_use_ends(state, nullptr);
          states.push_back(state);
        }
        zeroalloc_step_boundary();
        const long long to_disk = offload_figure("chunks_to_disk");
        int on_disk = 0;
        for (void* state : states) on_disk += zeroalloc_residency(state) == ZEROALLOC_ON_DISK;
        bool all_back = true;
        for (void* state : states) {
          zeroalloc_use_begins(state, nullptr);
          const int where = zeroalloc_residency(state);
          all_back = all_back && where != ZEROALLOC_ON_DISK && where >= 0;
          zeroalloc_use_ends(state, nullptr);
        }
        std::fprintf(stderr, "to disk %lld, on disk %d, from disk %lld, capacity %lld, back %d\n",
                     to_disk, on_disk, offload_figure("chunks_from_disk"),
                     offload_figure("disk_capacity_bytes"), all_back ? 1 : 0);
        for (void* state : states) zeroalloc_free(state, 8 * kMiB, 0, nullptr);
        std::filesystem::remove_all(directory);  // the child's own (it ran mkdtemp again)
        std::exit(to_disk >= 2 && on_disk >= 2 && all_back ? 0 : 1);
      },
      ::testing::ExitedWithCode(0), "capacity 67108864, back 1");
  std::filesystem::remove_all(directory);
}

// ZEROALLOC_NVME_PATH alone cannot size the swap files: the library does not start, and
// says which variable is missing.
TEST(OffloadCapi, AnNvmePathWithoutASizeStopsTheLibraryNamingBoth) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        setenv("ZEROALLOC_NVME_PATH", "/tmp", 1);
        unsetenv("ZEROALLOC_NVME_SIZE");
        void* pointer = zeroalloc_malloc(64, 0, nullptr);
        std::fprintf(stderr, "last error: %s\n", zeroalloc_last_error());
        std::exit(pointer == nullptr ? 0 : 1);
      },
      ::testing::ExitedWithCode(0),
      "ZEROALLOC_NVME_PATH=/tmp is set but ZEROALLOC_NVME_SIZE is not");
}

// Under the default ZEROALLOC_ACCESS=any, any kernel may read any state at any time, and a
// state on disk has no readable bytes behind its addresses: the NVMe tier does not start
// there, and the library says which variable to set.
TEST(OffloadCapi, AnNvmePathUnderAnyAccessStopsTheLibraryNamingHintedAccess) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        setenv("ZEROALLOC_NVME_PATH", "/tmp", 1);
        setenv("ZEROALLOC_NVME_SIZE", "64MiB", 1);
        unsetenv("ZEROALLOC_ACCESS");
        void* pointer = zeroalloc_malloc(64, 0, nullptr);
        std::fprintf(stderr, "last error: %s\n", zeroalloc_last_error());
        std::exit(pointer == nullptr ? 0 : 1);
      },
      ::testing::ExitedWithCode(0), "ZEROALLOC_NVME_PATH=/tmp needs ZEROALLOC_ACCESS=hinted");
}

// The NVMe tier is the offload engine's: a path given without ZEROALLOC_OFFLOAD=host is not
// used, and the library says so rather than leaving the user to believe states go to disk.
TEST(OffloadCapi, AnNvmePathWithoutTheOffloadEngineIsIgnoredWithAWarning) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        setenv("ZEROALLOC_NVME_PATH", "/tmp", 1);
        setenv("ZEROALLOC_NVME_SIZE", "64MiB", 1);
        unsetenv("ZEROALLOC_OFFLOAD");
        void* pointer = zeroalloc_malloc(64, 0, nullptr);
        std::exit(pointer != nullptr ? 0 : 1);
      },
      ::testing::ExitedWithCode(0),
      "ZEROALLOC_NVME_PATH=/tmp is ignored: the NVMe tier belongs to the offload engine");
}

// Parking needs hinted access: asked for under the default any, it is ignored, and the
// library says so rather than leaving the user to believe parameters are parked.
TEST(OffloadCapi, ParkingAskedForUnderAnyAccessIsIgnoredWithAWarning) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        setenv("ZEROALLOC_PARK_PARAMETERS", "1", 1);
        unsetenv("ZEROALLOC_ACCESS");
        void* pointer = zeroalloc_malloc(64, 0, nullptr);
        std::exit(pointer != nullptr ? 0 : 1);
      },
      ::testing::ExitedWithCode(0),
      "ZEROALLOC_PARK_PARAMETERS=1 is ignored under ZEROALLOC_ACCESS=any");
}

}  // namespace
