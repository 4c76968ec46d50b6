#include "device/sim_device.hpp"

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <thread>

#include "core/errors.hpp"
#include "core/host_memory.hpp"
#include "core/units.hpp"

namespace zeroalloc {

namespace {

constexpr std::size_t kGranularity = 2 * MiB;

[[noreturn]] void throw_errno(const char* call, int error_number) {
  throw device_error(
      detail::concat("simulated device: ", call, " failed: ", std::strerror(error_number)),
      error_number);
}

// A point in a stream's queue: reached once the work before it has run.
struct sim_recording {
  std::mutex mutex;
  std::condition_variable reached_signal;
  bool reached = false;
  std::chrono::steady_clock::time_point reached_at;

  void mark_reached() {
    {
      std::lock_guard lock(mutex);
      reached = true;
      reached_at = std::chrono::steady_clock::now();
    }
    reached_signal.notify_all();
  }
  void wait() {
    std::unique_lock lock(mutex);
    reached_signal.wait(lock, [this] { return reached; });
  }
  bool is_reached() {
    std::lock_guard lock(mutex);
    return reached;
  }
};

// An event names its latest recording, as in CUDA: a wait or a query captures the recording
// current at the call, so re-recording the event (even on an idle stream) never releases a
// wait on an earlier point. Queued work holds its own reference to its recording, so
// destroying an event with work still queued is legal, as with cudaEventDestroy.
struct sim_event {
  std::mutex mutex;
  std::shared_ptr<sim_recording> latest;  // null until first recorded: counts as complete

  std::shared_ptr<sim_recording> current() {
    std::lock_guard lock(mutex);
    return latest;
  }
};

sim_event& state_of(event_handle event) { return *static_cast<sim_event*>(event); }

}  // namespace

// One worker thread running its queue in order, like a CUDA stream.
class sim_stream {
 public:
  sim_stream() : worker_([this] { run(); }) {}
  ~sim_stream() {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    wake_.notify_all();
    worker_.join();
  }

  void enqueue(std::function<void()> work) {
    {
      std::lock_guard lock(mutex_);
      queue_.push_back(std::move(work));
      ++enqueued_;
    }
    wake_.notify_all();
  }

  // Waits for the work enqueued before the call, not for the queue to drain: other threads
  // may keep enqueuing.
  void synchronize() {
    std::unique_lock lock(mutex_);
    const std::uint64_t target = enqueued_;
    progressed_.wait(lock, [&] { return completed_ >= target; });
  }

 private:
  void run() {
    std::unique_lock lock(mutex_);
    for (;;) {
      wake_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, and everything queued has run
      std::function<void()> work = std::move(queue_.front());
      queue_.pop_front();
      lock.unlock();
      work();
      lock.lock();
      ++completed_;
      progressed_.notify_all();
    }
  }

  std::mutex mutex_;
  std::condition_variable wake_;
  std::condition_variable progressed_;
  std::deque<std::function<void()>> queue_;
  std::uint64_t enqueued_ = 0;
  std::uint64_t completed_ = 0;
  bool stopping_ = false;
  std::thread worker_;
};

sim_device::sim_device(int ordinal, std::uint64_t capacity_bytes)
    : ordinal_(ordinal),
      capacity_bytes_(capacity_bytes / kGranularity * kGranularity),
      default_stream_(std::make_unique<sim_stream>()) {}

sim_device::~sim_device() {
  default_stream_.reset();
  for (auto& [start, mapping] : mappings_) {
    ::munmap(reinterpret_cast<void*>(start), mapping.bytes);
  }
  for (auto& [start, bytes] : reservations_) ::munmap(reinterpret_cast<void*>(start), bytes);
  for (auto& [id, record] : handles_) ::close(record.memfd);
}

std::string sim_device::name() const {
  return detail::concat("simulated device ", ordinal_, " (", format_bytes(capacity_bytes_), ")");
}

std::size_t sim_device::granularity() const { return kGranularity; }

memory_info sim_device::query_memory() const {
  std::lock_guard lock(mutex_);
  return {capacity_bytes_ - used_bytes_, capacity_bytes_};
}

physical_handle sim_device::create_physical(std::size_t bytes, memory_location location) {
  if (bytes == 0 || bytes % kGranularity != 0) {
    throw device_error(detail::concat("simulated device: create_physical(", bytes,
                                      ") is not a multiple of the 2 MiB granularity"),
                       EINVAL);
  }
  std::lock_guard lock(mutex_);
  if (location == memory_location::device && used_bytes_ + bytes > capacity_bytes_) {
    throw device_error(detail::concat("simulated device ", ordinal_, ": out of memory creating ",
                                      format_bytes(bytes), " (", format_bytes(used_bytes_), " of ",
                                      format_bytes(capacity_bytes_), " in use)"),
                       kDeviceOutOfMemoryCode);
  }
  const int memfd = ::memfd_create("zeroalloc-sim", MFD_CLOEXEC);
  if (memfd < 0) throw_errno("memfd_create", errno);
  if (::ftruncate(memfd, static_cast<off_t>(bytes)) != 0) {
    const int error_number = errno;
    ::close(memfd);
    throw_errno("ftruncate", error_number);
  }
  const std::uint64_t id = next_handle_++;
  handles_[id] = handle_record{memfd, bytes, location, 0};
  if (location == memory_location::device) used_bytes_ += bytes;
  return {id, bytes, location};
}

void sim_device::release_physical(physical_handle handle) {
  std::lock_guard lock(mutex_);
  auto found = handles_.find(handle.value);
  if (found == handles_.end()) throw_errno("release_physical (unknown handle)", EINVAL);
  if (found->second.released) throw_errno("release_physical (released twice)", EINVAL);
  // As with cuMemRelease, a handle still mapped somewhere is freed by its last unmap.
  found->second.released = true;
  if (found->second.mappings == 0) destroy_handle_locked(found->first);
}

void sim_device::destroy_handle_locked(std::uint64_t id) {
  auto found = handles_.find(id);
  ::close(found->second.memfd);
  if (found->second.location == memory_location::device) used_bytes_ -= found->second.bytes;
  handles_.erase(found);
}

std::uintptr_t sim_device::reserve_addresses(std::size_t bytes, std::size_t alignment) {
  alignment = std::max(alignment, kGranularity);
  const std::size_t padded = bytes + alignment;
  void* raw =
      ::mmap(nullptr, padded, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (raw == MAP_FAILED) throw_errno("reserve_addresses (mmap)", errno);
  const auto start = reinterpret_cast<std::uintptr_t>(raw);
  const std::uintptr_t aligned = round_up(start, alignment);
  if (aligned > start) ::munmap(raw, aligned - start);
  const std::uintptr_t end = start + padded;
  if (end > aligned + bytes)
    ::munmap(reinterpret_cast<void*>(aligned + bytes), end - aligned - bytes);
  std::lock_guard lock(mutex_);
  reservations_[aligned] = bytes;
  return aligned;
}

void sim_device::free_addresses(std::uintptr_t address, std::size_t bytes) {
  std::lock_guard lock(mutex_);
  auto found = reservations_.find(address);
  if (found == reservations_.end() || found->second != bytes) {
    throw_errno("free_addresses (not a reservation)", EINVAL);
  }
  auto inside = mappings_.lower_bound(address);
  if (inside != mappings_.end() && inside->first < address + bytes) {
    throw_errno("free_addresses (range still mapped)", EBUSY);
  }
  ::munmap(reinterpret_cast<void*>(address), bytes);
  reservations_.erase(found);
}

void sim_device::map(std::uintptr_t address, physical_handle handle) {
  std::lock_guard lock(mutex_);
  auto record = handles_.find(handle.value);
  if (record == handles_.end() || record->second.released)
    throw_errno("map (unknown handle)", EINVAL);
  const std::size_t bytes = handle.bytes == 0 ? record->second.bytes : handle.bytes;
  if (handle.offset % kGranularity != 0 || bytes % kGranularity != 0 ||
      handle.offset + bytes > record->second.bytes) {
    throw_errno("map (slice beyond its allocation)", EINVAL);
  }
  if (!maps_slices_ && (handle.offset != 0 || bytes != record->second.bytes)) {
    throw_errno("map (a slice, which this device maps only whole)", ENOTSUP);
  }
  auto reservation = reservations_.upper_bound(address);
  if (reservation == reservations_.begin() || address % kGranularity != 0) {
    throw_errno("map (address not reserved)", EINVAL);
  }
  --reservation;
  if (address + bytes > reservation->first + reservation->second) {
    throw_errno("map (range beyond its reservation)", EINVAL);
  }
  auto next = mappings_.lower_bound(address);
  const bool overlaps_next = next != mappings_.end() && next->first < address + bytes;
  const bool overlaps_previous =
      next != mappings_.begin() && std::prev(next)->first + std::prev(next)->second.bytes > address;
  if (overlaps_next || overlaps_previous) throw_errno("map (range already mapped)", EBUSY);
  void* mapped =
      ::mmap(reinterpret_cast<void*>(address), bytes,
             handle.inaccessible ? PROT_NONE : PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED,
             record->second.memfd, static_cast<off_t>(handle.offset));
  if (mapped == MAP_FAILED) throw_errno("map (mmap)", errno);
  mappings_[address] = mapping_record{bytes, handle.value};
  ++record->second.mappings;
}

void* sim_device::create_pinned(std::size_t bytes) {
  void* address = map_host_pages(bytes, -1);
  if (address == nullptr) {
    const int code = errno;
    throw device_error(detail::concat("simulated device: mapping ", format_bytes(bytes),
                                      " of host memory to pin failed (", std::strerror(code), ")"),
                       code);
  }
  return address;
}

void sim_device::release_pinned(void* address, std::size_t bytes) {
  unmap_host_pages(address, bytes);
}

void sim_device::unmap(std::uintptr_t address, std::size_t bytes) {
  std::lock_guard lock(mutex_);
  // The range must be exactly a run of whole mappings, as cuMemUnmap requires.
  std::uintptr_t cursor = address;
  auto mapping = mappings_.find(address);
  while (cursor < address + bytes) {
    if (mapping == mappings_.end() || mapping->first != cursor) {
      throw_errno("unmap (range is not mapped)", EINVAL);
    }
    cursor += mapping->second.bytes;
    ++mapping;
  }
  if (cursor != address + bytes) throw_errno("unmap (range splits a mapping)", EINVAL);
  void* restored = ::mmap(reinterpret_cast<void*>(address), bytes, PROT_NONE,
                          MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
  if (restored == MAP_FAILED) throw_errno("unmap (mmap)", errno);
  for (auto it = mappings_.find(address); it != mappings_.end() && it->first < address + bytes;) {
    handle_record& record = handles_.at(it->second.handle);
    if (--record.mappings == 0 && record.released) destroy_handle_locked(it->second.handle);
    it = mappings_.erase(it);
  }
}

sim_stream& sim_device::resolve(stream_handle stream) {
  return stream == nullptr ? *default_stream_ : *static_cast<sim_stream*>(stream);
}

stream_handle sim_device::create_stream() {
  auto stream = std::make_unique<sim_stream>();
  std::lock_guard lock(streams_mutex_);
  streams_.insert(stream.get());
  return stream.release();
}

void sim_device::destroy_stream(stream_handle stream) {
  if (stream == nullptr) return;
  {
    std::lock_guard lock(streams_mutex_);
    streams_.erase(static_cast<sim_stream*>(stream));
  }
  {
    std::lock_guard capture(capture_mutex_);
    capturing_.erase(static_cast<sim_stream*>(stream));
  }
  delete static_cast<sim_stream*>(stream);
}

void sim_device::synchronize_device() {
  {
    std::lock_guard capture(capture_mutex_);
    if (!capturing_.empty()) {
      throw device_error(
          "synchronizing the simulated device: operation not permitted when stream is "
          "capturing",
          EBUSY);
    }
  }
  std::lock_guard lock(streams_mutex_);
  default_stream_->synchronize();
  for (sim_stream* stream : streams_) stream->synchronize();
}

bool sim_device::stream_is_capturing(stream_handle stream) {
  std::lock_guard lock(capture_mutex_);
  return capturing_.contains(&resolve(stream));
}

void sim_device::begin_capture(stream_handle stream) {
  std::lock_guard lock(capture_mutex_);
  capturing_.insert(&resolve(stream));
}

void sim_device::end_capture(stream_handle stream) {
  std::lock_guard lock(capture_mutex_);
  capturing_.erase(&resolve(stream));
}

event_handle sim_device::create_event() {
  ++events_alive_;
  return new sim_event();
}

void sim_device::destroy_event(event_handle event) {
  if (event == nullptr) return;
  --events_alive_;
  delete static_cast<sim_event*>(event);
}

event_handle sim_device::create_timing_event() { return create_event(); }

bool sim_device::maps_slices() { return maps_slices_; }

float sim_device::elapsed_ms(event_handle start, event_handle end) {
  const std::shared_ptr<sim_recording> from = state_of(start).current();
  const std::shared_ptr<sim_recording> to = state_of(end).current();
  ZA_REQUIRE(from != nullptr && to != nullptr && from->is_reached() && to->is_reached(),
             "elapsed_ms needs two completed recordings");
  std::lock_guard lock_from(from->mutex);
  const auto started = from->reached_at;
  std::lock_guard lock_to(to->mutex);
  return std::chrono::duration<float, std::milli>(to->reached_at - started).count();
}

void sim_device::record_event(event_handle event, stream_handle stream) {
  auto recording = std::make_shared<sim_recording>();
  {
    sim_event& state = state_of(event);
    std::lock_guard lock(state.mutex);
    state.latest = recording;
  }
  resolve(stream).enqueue([recording] { recording->mark_reached(); });
}

bool sim_device::event_completed(event_handle event) {
  const std::shared_ptr<sim_recording> recording = state_of(event).current();
  return recording == nullptr || recording->is_reached();
}

void sim_device::synchronize_event(event_handle event) {
  if (const std::shared_ptr<sim_recording> recording = state_of(event).current()) recording->wait();
}

void sim_device::stream_wait_event(stream_handle stream, event_handle event) {
  const std::shared_ptr<sim_recording> recording = state_of(event).current();
  if (recording == nullptr) return;
  resolve(stream).enqueue([recording] { recording->wait(); });
}

void sim_device::synchronize_stream(stream_handle stream) { resolve(stream).synchronize(); }

void sim_device::copy_async(void* destination, const void* source, std::size_t bytes,
                            stream_handle stream) {
  resolve(stream).enqueue([=] { std::memcpy(destination, source, bytes); });
}

void sim_device::fill_async(void* destination, std::uint8_t value, std::size_t bytes,
                            stream_handle stream) {
  resolve(stream).enqueue([=] { std::memset(destination, value, bytes); });
}

void sim_device::host_function_async(std::function<void()> function, stream_handle stream) {
  resolve(stream).enqueue(std::move(function));
}

}  // namespace zeroalloc
