// The host step's pinned buffers (Note [Pinned buffers made ahead] in
// lib/tier/pinned_buffers.hpp): bytes the CPUs write reach the device and come back, a
// released buffer outlives the copies queued on its stream, and a buffer the host cannot
// spare is refused, saying so. Over every device.
#include "tier/pinned_buffers.hpp"

#include <gtest/gtest.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <future>
#include <thread>
#include <vector>

#include "core/host_memory.hpp"
#include "device/cuda_driver.hpp"
#include "support/faulty_device.hpp"
#include "support/test_device.hpp"
#include "tier/host_pool.hpp"

namespace zeroalloc {
namespace {

using testing::faulty_device;
using testing::read_back;

// Until `done` holds, or 10 s.
template <typename Condition>
bool eventually(Condition done) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!done() && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return done();
}

// The NUMA node of the page at `address` (get_mempolicy), or -1 when the host does not say.
int node_of(const void* address) {
  constexpr unsigned long kNodeOfAddress = 3;  // MPOL_F_NODE | MPOL_F_ADDR
  int node = -1;
  if (::syscall(SYS_get_mempolicy, &node, nullptr, 0, address, kNodeOfAddress) != 0) return -1;
  return node;
}

class PinnedBuffersTest : public ::testing::Test {
 protected:
  void SetUp() override { ZA_OPEN_TEST_DEVICE_OR_SKIP(device_, 0, 1 * GiB); }

  // Device memory of `bytes` (a multiple of the granularity), mapped; freed by the fixture.
  void* device_memory(std::size_t bytes) {
    const physical_handle handle = device_->create_physical(bytes, memory_location::device);
    const std::uintptr_t address = device_->reserve_addresses(bytes, device_->granularity());
    device_->map(address, handle);
    mapped_.push_back({address, bytes, handle});
    return reinterpret_cast<void*>(address);
  }

  void TearDown() override {
    for (const auto& each : mapped_) {
      device_->unmap(each.address, each.bytes);
      device_->free_addresses(each.address, each.bytes);
      device_->release_physical(each.handle);
    }
  }

  struct mapping {
    std::uintptr_t address;
    std::size_t bytes;
    physical_handle handle;
  };
  std::unique_ptr<device> device_;
  std::vector<mapping> mapped_;
};

TEST_F(PinnedBuffersTest, BytesTheCpusWriteReachTheDeviceAndComeBack) {
  pinned_buffers buffers(*device_);
  constexpr std::size_t kBytes = 3 * MiB + 5;  // not a whole number of pages
  auto* out = static_cast<std::uint8_t*>(buffers.create(kBytes));
  auto* in = static_cast<std::uint8_t*>(buffers.create(kBytes));
  const std::size_t page = host_page_bytes();
  EXPECT_EQ(buffers.held_bytes(), 2 * ((kBytes + page - 1) / page * page));
  for (std::size_t i = 0; i < kBytes; ++i) out[i] = static_cast<std::uint8_t>(i * 7 + 3);
  void* on_device = device_memory(4 * MiB);
  const stream_handle stream = device_->create_stream();
  device_->copy_async(on_device, out, kBytes, stream);
  device_->copy_async(in, on_device, kBytes, stream);
  device_->synchronize_stream(stream);
  EXPECT_EQ(std::memcmp(in, out, kBytes), 0);
  // The pages lie on the device's node, and on CUDA the driver knows them as pinned host
  // memory (unregistered memory has no memory type).
  const int node = node_of(out);
  if (node >= 0 && !device_->is_simulated()) {
    EXPECT_EQ(node, device_->host_numa_node());
  }
  if (!device_->is_simulated()) {
    unsigned int type = 0;
    ASSERT_EQ(cuda_driver_table().pfn_cuPointerGetAttribute(&type, CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
                                                            reinterpret_cast<CUdeviceptr>(out)),
              CUDA_SUCCESS);
    EXPECT_EQ(type, CU_MEMORYTYPE_HOST);
  }
  buffers.release(out, stream);
  buffers.release(in, stream);
  EXPECT_TRUE(eventually([&] { return buffers.held_bytes() == 0; })) << buffers.held_bytes();
  EXPECT_EQ(buffers.pending(), 0U);
  device_->destroy_stream(stream);
}

TEST_F(PinnedBuffersTest, AReleasedBufferOutlivesTheCopiesQueuedOnItsStream) {
  auto faulty = std::make_unique<faulty_device>(std::move(device_));
  faulty_device& held = *faulty;
  device_ = std::move(faulty);
  pinned_buffers buffers(*device_);
  auto* buffer = static_cast<std::uint8_t*>(buffers.create(1 * MiB));
  const std::size_t bytes = buffers.held_bytes();
  std::memset(buffer, 0x5C, 1 * MiB);
  void* on_device = device_memory(2 * MiB);
  const stream_handle stream = device_->create_stream();
  std::promise<void> go;
  held.hold_copy([&](const void* destination) { return destination == on_device; },
                 go.get_future().share());
  device_->copy_async(on_device, buffer, 1 * MiB, stream);  // waits for `go`
  buffers.release(buffer, stream);
  // The copy has not run: the buffer is still pinned, and counted.
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_EQ(buffers.pending(), 1U);
  EXPECT_EQ(buffers.held_bytes(), bytes);
  EXPECT_FALSE(buffers.owns(buffer));  // the caller's no more
  go.set_value();
  device_->synchronize_stream(stream);
  EXPECT_EQ(read_back(*device_, on_device, 1 * MiB), std::vector<std::uint8_t>(1 * MiB, 0x5C));
  EXPECT_TRUE(eventually([&] { return buffers.pending() == 0; }));
  EXPECT_EQ(buffers.held_bytes(), 0U);
  device_->destroy_stream(stream);
}

TEST_F(PinnedBuffersTest, ABufferTheHostCannotSpareIsRefusedNamingItsReserve) {
  pinned_buffers buffers(*device_);
  const std::uint64_t too_much = host_available_bytes() + (std::uint64_t{1} << 30);
  try {
    (void)buffers.create(too_much);
    FAIL() << "a buffer larger than the host's memory was made";
  } catch (const host_memory_exhausted& refused) {
    EXPECT_NE(std::string(refused.what()).find("reserve"), std::string::npos) << refused.what();
  }
  EXPECT_EQ(buffers.held_bytes(), 0U);
  EXPECT_THROW((void)buffers.create(0), invalid_argument);
}

TEST_F(PinnedBuffersTest, ABufferLeavesWhatTheHostTierMayStillTake) {
  pinned_buffers buffers(*device_);
  // The host tier may still grow by all the host has: not even a page is left.
  buffers.set_kept([] { return host_available_bytes(); });
  try {
    (void)buffers.create(4096);
    FAIL() << "a buffer was made in the room the host tier may still take";
  } catch (const host_memory_exhausted& refused) {
    EXPECT_NE(std::string(refused.what()).find("host tier may still take"), std::string::npos)
        << refused.what();
  }
  EXPECT_EQ(buffers.held_bytes(), 0U);
  buffers.set_kept([] { return std::uint64_t{0}; });  // the tier at its limit: room again
  void* made = buffers.create(4096);
  EXPECT_TRUE(buffers.owns(made));
  buffers.release(made, nullptr);
}

TEST_F(PinnedBuffersTest, ReleasingWhatIsNotABufferOrReleasedTwiceIsRefused) {
  pinned_buffers buffers(*device_);
  void* buffer = buffers.create(4096);
  std::vector<std::uint8_t> elsewhere(4096);
  EXPECT_THROW(buffers.release(elsewhere.data(), nullptr), invalid_argument);
  EXPECT_TRUE(buffers.owns(buffer));
  buffers.release(buffer, nullptr);
  EXPECT_FALSE(buffers.owns(buffer));
  EXPECT_THROW(buffers.release(buffer, nullptr), invalid_argument);
}

}  // namespace
}  // namespace zeroalloc
