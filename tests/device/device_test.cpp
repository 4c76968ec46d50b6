// The device layer's promises that the allocator and the offload engine build on, run over
// every device: a remap swaps the bytes behind a stable address; streams run in order;
// events order one stream after another.
#include "device/device.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <thread>

#include "support/test_device.hpp"

namespace zeroalloc {
namespace {

using testing::read_back;

class DeviceTest : public ::testing::Test {
 protected:
  void SetUp() override { ZA_OPEN_TEST_DEVICE_OR_SKIP(device_); }

  // One granule of device memory, mapped at reserved addresses for the test's duration.
  struct mapped_granule {
    device& owner;
    std::size_t bytes = owner.granularity();
    std::uintptr_t address = owner.reserve_addresses(bytes, bytes);
    physical_handle handle = owner.create_physical(bytes, memory_location::device);
    explicit mapped_granule(device& on) : owner(on) { owner.map(address, handle); }
    ~mapped_granule() {
      owner.unmap(address, bytes);
      owner.release_physical(handle);
      owner.free_addresses(address, bytes);
    }
    [[nodiscard]] void* pointer() const { return reinterpret_cast<void*>(address); }
  };

  // Holds `stream` up for a tenth of a second, as a long kernel would.
  void delay(stream_handle stream) {
    device_->host_function_async(
        [] { std::this_thread::sleep_for(std::chrono::milliseconds(100)); }, stream);
  }

  std::unique_ptr<device> device_;
};

TEST_F(DeviceTest, RemapSwapsTheBytesBehindAStableAddress) {
  const std::size_t bytes = device_->granularity();
  const std::uintptr_t address = device_->reserve_addresses(bytes, bytes);
  auto* pointer = reinterpret_cast<void*>(address);
  const physical_handle first = device_->create_physical(bytes, memory_location::device);
  const physical_handle second = device_->create_physical(bytes, memory_location::device);

  device_->map(address, first);
  device_->fill_async(pointer, 0x11, bytes, nullptr);
  device_->synchronize_stream(nullptr);
  device_->unmap(address, bytes);
  device_->map(address, second);
  device_->fill_async(pointer, 0x22, bytes, nullptr);
  device_->synchronize_stream(nullptr);
  device_->unmap(address, bytes);

  device_->map(address, first);  // the first handle's bytes come back at the same address
  EXPECT_EQ(read_back(*device_, pointer, bytes), std::vector<std::uint8_t>(bytes, 0x11));
  device_->unmap(address, bytes);
  device_->map(address, second);
  EXPECT_EQ(read_back(*device_, pointer, bytes), std::vector<std::uint8_t>(bytes, 0x22));
  device_->unmap(address, bytes);

  device_->release_physical(first);
  device_->release_physical(second);
  device_->free_addresses(address, bytes);
}

TEST_F(DeviceTest, HostLocatedMemoryIsMappableAndKeepsItsBytes) {
  const std::size_t bytes = device_->granularity();
  const std::uintptr_t address = device_->reserve_addresses(bytes, bytes);
  const physical_handle host = device_->create_physical(bytes, memory_location::host);
  device_->map(address, host);
  device_->fill_async(reinterpret_cast<void*>(address), 0x5A, bytes, nullptr);
  EXPECT_EQ(read_back(*device_, reinterpret_cast<void*>(address), bytes),
            std::vector<std::uint8_t>(bytes, 0x5A));
  device_->unmap(address, bytes);
  device_->release_physical(host);
  device_->free_addresses(address, bytes);
}

TEST_F(DeviceTest, ASliceOfAHostAllocationMapsItsOwnBytes) {
  if (!device_->maps_slices()) GTEST_SKIP() << "skipped: this driver maps only whole allocations";
  const std::size_t granule = device_->granularity();
  const physical_handle whole = device_->create_physical(3 * granule, memory_location::host);
  const std::uintptr_t everything = device_->reserve_addresses(3 * granule, granule);
  const std::uintptr_t middle = device_->reserve_addresses(granule, granule);
  device_->map(everything, whole);
  device_->fill_async(reinterpret_cast<void*>(everything), 0x00, 3 * granule, nullptr);
  physical_handle slice = whole;
  slice.offset = granule;
  slice.bytes = granule;
  device_->map(middle, slice);
  device_->fill_async(reinterpret_cast<void*>(middle), 0x77, granule, nullptr);
  std::vector<std::uint8_t> expected(3 * granule, 0x00);
  std::fill(expected.begin() + static_cast<std::ptrdiff_t>(granule),
            expected.begin() + static_cast<std::ptrdiff_t>(2 * granule), 0x77);
  EXPECT_EQ(read_back(*device_, reinterpret_cast<void*>(everything), 3 * granule), expected)
      << "the slice's writes must land in its part of the allocation, and only there";
  device_->unmap(middle, granule);
  device_->unmap(everything, 3 * granule);
  device_->release_physical(whole);
  device_->free_addresses(middle, granule);
  device_->free_addresses(everything, 3 * granule);
}

TEST_F(DeviceTest, DeviceMemoryIsAccountedInQueryMemory) {
  const memory_info before = device_->query_memory();
  const std::size_t bytes = 8 * device_->granularity();
  const physical_handle handle = device_->create_physical(bytes, memory_location::device);
  const memory_info during = device_->query_memory();
  EXPECT_LE(during.free_bytes + bytes,
            before.free_bytes + 64 * MiB);  // other processes may move it
  EXPECT_LT(during.free_bytes, before.free_bytes);
  device_->release_physical(handle);
  EXPECT_EQ(device_->query_memory().total_bytes, before.total_bytes);
}

TEST_F(DeviceTest, StreamWaitEventOrdersOneStreamAfterAnother) {
  mapped_granule memory(*device_);
  stream_handle slow = device_->create_stream();
  stream_handle fast = device_->create_stream();
  event_handle done = device_->create_event();
  // The slow stream is held up, then writes; the fast stream must write after it.
  delay(slow);
  device_->fill_async(memory.pointer(), 0xAA, memory.bytes, slow);
  device_->record_event(done, slow);
  EXPECT_FALSE(device_->event_completed(done));
  device_->stream_wait_event(fast, done);
  device_->fill_async(memory.pointer(), 0xBB, memory.bytes, fast);
  device_->synchronize_stream(fast);
  EXPECT_TRUE(device_->event_completed(done));
  EXPECT_EQ(read_back(*device_, memory.pointer(), memory.bytes, fast),
            std::vector<std::uint8_t>(memory.bytes, 0xBB));
  device_->destroy_event(done);
  device_->destroy_stream(slow);
  device_->destroy_stream(fast);
}

TEST_F(DeviceTest, AWaitKeepsItsRecordingWhenTheEventIsRecordedAgain) {
  mapped_granule memory(*device_);
  stream_handle slow = device_->create_stream();
  stream_handle waiting = device_->create_stream();
  stream_handle idle = device_->create_stream();
  event_handle fence = device_->create_event();
  delay(slow);
  device_->fill_async(memory.pointer(), 0xAA, memory.bytes, slow);
  device_->record_event(fence, slow);
  device_->stream_wait_event(waiting, fence);
  device_->record_event(fence, idle);  // reused at once, as the allocator reuses its fences
  device_->fill_async(memory.pointer(), 0xBB, memory.bytes, waiting);
  device_->synchronize_stream(waiting);
  device_->synchronize_stream(slow);
  EXPECT_EQ(read_back(*device_, memory.pointer(), memory.bytes),
            std::vector<std::uint8_t>(memory.bytes, 0xBB));
  device_->destroy_event(fence);
  for (stream_handle stream : {slow, waiting, idle}) device_->destroy_stream(stream);
}

TEST_F(DeviceTest, HostFunctionsRunInStreamOrder) {
  stream_handle stream = device_->create_stream();
  std::atomic<int> order{0};
  int first = -1;
  int second = -1;
  device_->host_function_async(
      [&] {
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
        first = order++;
      },
      stream);
  device_->host_function_async([&] { second = order++; }, stream);
  device_->synchronize_stream(stream);
  EXPECT_EQ(first, 0);
  EXPECT_EQ(second, 1);
  device_->destroy_stream(stream);
}

TEST_F(DeviceTest, MisuseIsReportedNotIgnored) {
  const std::size_t bytes = device_->granularity();
  const std::uintptr_t address = device_->reserve_addresses(2 * bytes, bytes);
  const physical_handle handle = device_->create_physical(bytes, memory_location::device);
  device_->map(address, handle);
  EXPECT_THROW(device_->map(address, handle), device_error);  // already mapped
  if (device_->is_simulated()) {
    // The CUDA driver accepts this silently; the simulated device is stricter on purpose.
    EXPECT_THROW(device_->unmap(address + bytes, bytes), device_error);  // never mapped
  }
  device_->unmap(address, bytes);
  device_->release_physical(handle);
  device_->free_addresses(address, 2 * bytes);
}

}  // namespace
}  // namespace zeroalloc
