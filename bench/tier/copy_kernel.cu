// A copy done by the GPU's cores instead of its copy engines: 16-byte loads and stores, a
// grid-stride loop with eight loads in flight per thread. Used by remap_bench to ask
// whether a remap waits for the copy engines' work (Note [What a remap costs]).
#include <cstdint>

extern "C" __global__ void __launch_bounds__(512)
    zeroalloc_copy_16(uint4* __restrict__ target, const uint4* __restrict__ source,
                      unsigned long long count) {
  constexpr int kInFlight = 8;
  const unsigned long long stride = static_cast<unsigned long long>(gridDim.x) * blockDim.x;
  unsigned long long i = static_cast<unsigned long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (; i + (kInFlight - 1) * stride < count; i += kInFlight * stride) {
    uint4 values[kInFlight];
#pragma unroll
    for (int k = 0; k < kInFlight; ++k) values[k] = __ldcs(source + i + k * stride);
#pragma unroll
    for (int k = 0; k < kInFlight; ++k) __stcs(target + i + k * stride, values[k]);
  }
  for (; i < count; i += stride) target[i] = source[i];
}
