#include "tier/disk_store.hpp"

#include <fcntl.h>
#include <liburing.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>

#include "core/log.hpp"

namespace zeroalloc {
namespace {

constexpr std::size_t direct_alignment = 4 * KiB;  // O_DIRECT's, on any drive

std::string describe_errno(int code) { return std::strerror(code); }

std::uint64_t checksum_of(const char* bytes, std::size_t count) {
  std::uint64_t hash = 0x9E3779B97F4A7C15ULL;
  for (std::size_t at = 0; at + sizeof(std::uint64_t) <= count; at += sizeof(std::uint64_t)) {
    std::uint64_t word;
    std::memcpy(&word, bytes + at, sizeof word);
    hash = (hash ^ word) * 0x100000001B3ULL;
    hash ^= hash >> 29;
  }
  return hash;
}

// Opens a swap file in `private_directory` that has no name (Note [Swap files leave no
// name]); -1 with errno set when the file system refuses.
int open_nameless(const std::string& private_directory, int flags) {
  const int descriptor = ::open(private_directory.c_str(), O_TMPFILE | flags, 0600);
  if (descriptor >= 0 || (errno != EOPNOTSUPP && errno != EISDIR)) return descriptor;
  // No O_TMPFILE here: a name, for as long as it takes to remove it.
  const std::string named = private_directory + "/swap";
  const int created = ::open(named.c_str(), O_CREAT | O_EXCL | flags, 0600);
  if (created >= 0) ::unlink(named.c_str());
  return created;
}

}  // namespace

struct disk_store::transfer {
  disk_slot slot = 0;
  bool is_write = false;
  char* host = nullptr;
  std::size_t bytes = 0;
  std::size_t requests_left = 0;
  std::uint64_t checksum = 0;  // of the bytes written (verify)
  bool failed = false;
  int error_code = 0;
  std::string error_message;
  std::chrono::steady_clock::time_point started;
};

std::vector<std::string> split_directories(const std::string& nvme_path) {
  std::vector<std::string> directories;
  std::size_t start = 0;
  while (start <= nvme_path.size()) {
    const std::size_t end = std::min(nvme_path.find(':', start), nvme_path.size());
    if (end > start) directories.push_back(nvme_path.substr(start, end - start));
    start = end + 1;
  }
  return directories;
}

disk_store::disk_store(disk_store_options options) : options_(std::move(options)) {
  ZA_REQUIRE(!options_.directories.empty(),
             "the NVMe tier needs at least one directory "
             "(ZEROALLOC_NVME_PATH, separated by ':')");
  ZA_REQUIRE(options_.capacity_bytes > 0, "the NVMe tier needs a capacity above 0 bytes");
  ZA_REQUIRE(options_.stripe_bytes > 0 && options_.stripe_bytes % direct_alignment == 0,
             "the stripe unit (", options_.stripe_bytes, " bytes) must be a multiple of 4 KiB");
  ZA_REQUIRE(options_.request_bytes > 0 && options_.request_bytes % direct_alignment == 0 &&
                 options_.stripe_bytes % options_.request_bytes == 0,
             "the request size (", options_.request_bytes,
             " bytes) must be a multiple of 4 KiB that divides the stripe unit (",
             options_.stripe_bytes, " bytes)");
  ZA_REQUIRE(options_.queue_depth > 0 && options_.queue_depth <= 4096, "the queue depth (",
             options_.queue_depth, ") must lie in 1..4096");
  const std::uint64_t files = options_.directories.size();
  const std::uint64_t units_per_file =
      (options_.capacity_bytes + files * options_.stripe_bytes - 1) /
      (files * options_.stripe_bytes);
  units_ = units_per_file * files;
  figures_.capacity_bytes = units_ * options_.stripe_bytes;
  free_units_.give_back(0, units_);
  try {
    open_files();
    start_ring();
  } catch (...) {
    for (const swap_file& file : files_) ::close(file.descriptor);
    throw;
  }
  completion_thread_ = std::thread([this] { reap_completions(); });
}

void disk_store::open_files() {
  const std::uint64_t bytes_per_file = units_ / options_.directories.size() * options_.stripe_bytes;
  for (const std::string& directory : options_.directories) {
    struct stat status {};
    const int stat_error = ::stat(directory.c_str(), &status) != 0 ? errno
                           : S_ISDIR(status.st_mode)               ? 0
                                                                   : ENOTDIR;
    if (stat_error != 0) {
      ZA_THROW(config_error, "ZEROALLOC_NVME_PATH: '", directory, "' is not a usable directory (",
               describe_errno(stat_error),
               "); create it on the drive to swap to, or correct the variable");
    }
    std::string private_directory = directory + "/zeroalloc-swap-XXXXXX";
    if (::mkdtemp(private_directory.data()) == nullptr) {  // mode 0700
      ZA_THROW(config_error, "ZEROALLOC_NVME_PATH: cannot create a swap file in '", directory,
               "' (", describe_errno(errno),
               "); the directory must be writable by this process, or name another one");
    }
    int descriptor = open_nameless(private_directory, O_RDWR | O_DIRECT | O_CLOEXEC);
    const int open_error = errno;
    bool refuses_direct = false;
    if (descriptor < 0 && open_error == EINVAL) {
      const int buffered = open_nameless(private_directory, O_RDWR);
      refuses_direct = buffered >= 0;
      if (buffered >= 0) ::close(buffered);
    }
    ::rmdir(private_directory.c_str());
    if (descriptor < 0 && refuses_direct) {
      ZA_THROW(config_error, "ZEROALLOC_NVME_PATH: the file system of '", directory,
               "' refuses O_DIRECT, which the NVMe tier needs to bypass the page cache "
               "(ramfs, tmpfs before Linux 6.6, some FUSE and network file systems); name a "
               "directory on a local drive");
    }
    if (descriptor < 0) {
      ZA_THROW(config_error, "ZEROALLOC_NVME_PATH: cannot create a swap file in '", directory,
               "' (", describe_errno(open_error), ")");
    }
    files_.push_back({directory + " (swap file, no name)", descriptor, bytes_per_file});

    struct statvfs space {};
    const bool known = ::fstatvfs(descriptor, &space) == 0;
    const std::uint64_t free_bytes = known ? std::uint64_t{space.f_bavail} * space.f_frsize : 0;
    auto no_room = [&] {
      ZA_THROW(config_error, "ZEROALLOC_NVME_PATH: '", directory, "' needs ",
               format_bytes(bytes_per_file), " (", bytes_per_file,
               " bytes) for its share of the NVMe tier's capacity, but its file system has ",
               format_bytes(free_bytes),
               " free; free space there, lower the tier's capacity, or add directories on "
               "other drives to ZEROALLOC_NVME_PATH");
    };
    if (known && free_bytes < bytes_per_file) no_room();
    if (::fallocate(descriptor, 0, 0, static_cast<off_t>(bytes_per_file)) != 0) {
      if (errno == ENOSPC) no_room();
      if (errno != EOPNOTSUPP) {
        ZA_THROW(config_error, "ZEROALLOC_NVME_PATH: cannot reserve ", format_bytes(bytes_per_file),
                 " in '", directory, "' (", describe_errno(errno), ")");
      }
      // No preallocation on this file system: the space is claimed by the first writes.
      if (::ftruncate(descriptor, static_cast<off_t>(bytes_per_file)) != 0) {
        ZA_THROW(config_error, "ZEROALLOC_NVME_PATH: cannot size the swap file in '", directory,
                 "' (", describe_errno(errno), ")");
      }
      log().warn(
          "the file system of '{}' cannot preallocate: a full drive shows as a failed "
          "write, not at start",
          directory);
    }
  }
}

void disk_store::start_ring() {
  ring_ = std::make_unique<io_uring>();
  const int started = io_uring_queue_init(options_.queue_depth, ring_.get(), 0);
  if (started < 0) {
    if (started == -ENOSYS || started == -EPERM) {
      throw io_uring_unavailable(
          detail::concat("io_uring is not available in this process (", describe_errno(-started),
                         "): the kernel lacks it or kernel.io_uring_disabled or a seccomp "
                         "filter refuses it; the NVMe tier needs it"),
          -started);
    }
    ZA_THROW(error, "io_uring_queue_init(", options_.queue_depth,
             ") failed: ", describe_errno(-started));
  }
  ring_started_ = true;
  if (options_.register_files) {
    std::vector<int> descriptors;
    for (const swap_file& file : files_) descriptors.push_back(file.descriptor);
    if (io_uring_register_files(ring_.get(), descriptors.data(),
                                static_cast<unsigned>(descriptors.size())) < 0) {
      options_.register_files = false;  // plain descriptors work everywhere
    }
  }
}

disk_store::~disk_store() {
  if (completion_thread_.joinable()) {
    std::unique_lock lock(mutex_);
    transfer_ended_.wait(lock, [&] { return in_flight_ == 0 && waiting_.empty(); });
    stopping_ = true;
    io_uring_sqe* stop = io_uring_get_sqe(ring_.get());
    io_uring_prep_nop(stop);
    io_uring_sqe_set_data(stop, nullptr);
    io_uring_submit(ring_.get());
    lock.unlock();
    completion_thread_.join();
  }
  if (ring_started_) io_uring_queue_exit(ring_.get());
  for (const swap_file& file : files_) ::close(file.descriptor);
}

bool disk_store::register_host_buffers(const std::vector<iovec>& buffers) {
  std::lock_guard lock(mutex_);
  ZA_REQUIRE(fixed_buffers_.empty(), "host buffers are registered once");
  ZA_REQUIRE(in_flight_ == 0 && waiting_.empty(), "host buffers are registered before transfers");
  if (buffers.empty()) return false;
  const int registered =
      io_uring_register_buffers(ring_.get(), buffers.data(), static_cast<unsigned>(buffers.size()));
  if (registered < 0) {
    log().info("io_uring refused {} host buffers as fixed buffers ({}): plain requests",
               buffers.size(), describe_errno(-registered));
    return false;
  }
  fixed_buffers_ = buffers;
  return true;
}

int disk_store::fixed_buffer_index(const char* host, std::size_t bytes) const {
  for (std::size_t index = 0; index < fixed_buffers_.size(); ++index) {
    const char* base = static_cast<const char*>(fixed_buffers_[index].iov_base);
    if (host >= base && host + bytes <= base + fixed_buffers_[index].iov_len) {
      return static_cast<int>(index);
    }
  }
  return -1;
}

disk_slot disk_store::allocate(std::size_t bytes, std::uint64_t leave_free) {
  ZA_REQUIRE(bytes > 0, "a disk slot of 0 bytes");
  const std::uint64_t wanted = (bytes + options_.stripe_bytes - 1) / options_.stripe_bytes;
  std::lock_guard lock(mutex_);
  const std::uint64_t free_bytes = figures_.capacity_bytes - figures_.used_bytes;
  if (wanted * options_.stripe_bytes + leave_free > free_bytes) {
    ZA_THROW(disk_space_exhausted, "the NVMe tier has no room for ", format_bytes(bytes), ": ",
             format_bytes(figures_.used_bytes), " of its ", format_bytes(figures_.capacity_bytes),
             " hold other chunks",
             leave_free == 0 ? std::string()
                             : " and " + format_bytes(leave_free) +
                                   " stay free for bringing chunks back from it");
  }
  slot_record record;
  record.bytes = bytes;
  std::uint64_t left = wanted;
  std::uint64_t piece = wanted;
  while (left > 0) {
    piece = std::min(piece, left);
    while (piece > 0 && !free_units_.fits(piece)) piece /= 2;
    if (piece == 0) {
      for (const unit_run& run : record.runs) free_units_.give_back(run.first_unit, run.units);
      ZA_THROW(disk_space_exhausted, "the NVMe tier has no room for ", format_bytes(bytes), ": ",
               format_bytes(figures_.used_bytes), " of its ", format_bytes(figures_.capacity_bytes),
               " hold other chunks");
    }
    // A contiguous run of units is already striped over every file (Note [Striping]).
    record.runs.push_back({*free_units_.take_first_fit(piece), piece});
    left -= piece;
  }
  figures_.used_bytes += wanted * options_.stripe_bytes;
  const disk_slot slot = next_slot_++;
  slots_.emplace(slot, std::move(record));
  return slot;
}

void disk_store::release(disk_slot slot) {
  std::lock_guard lock(mutex_);
  const auto found = slots_.find(slot);
  ZA_REQUIRE(found != slots_.end(), "disk slot ", slot, " is not held");
  for (const unit_run& run : found->second.runs) {
    free_units_.give_back(run.first_unit, run.units);
    figures_.used_bytes -= run.units * options_.stripe_bytes;
  }
  slots_.erase(found);
}

disk_store::ticket disk_store::write(disk_slot slot, const void* host, std::size_t bytes) {
  return start(slot, static_cast<char*>(const_cast<void*>(host)), bytes, true);
}

disk_store::ticket disk_store::read(disk_slot slot, void* host, std::size_t bytes) {
  return start(slot, static_cast<char*>(host), bytes, false);
}

disk_store::ticket disk_store::start(disk_slot slot, char* host, std::size_t bytes, bool is_write) {
  ZA_REQUIRE(reinterpret_cast<std::uintptr_t>(host) % direct_alignment == 0 && bytes > 0 &&
                 bytes % direct_alignment == 0,
             "disk transfers need a 4 KiB-aligned host address and a multiple of 4 KiB (got ",
             static_cast<const void*>(host), ", ", bytes, " bytes): O_DIRECT requires it");
  auto state = std::make_shared<transfer>();
  state->slot = slot;
  state->is_write = is_write;
  state->host = host;
  state->bytes = bytes;
  state->started = std::chrono::steady_clock::now();
  if (is_write && options_.verify) state->checksum = checksum_of(host, bytes);

  std::lock_guard lock(mutex_);
  const auto found = slots_.find(slot);
  ZA_REQUIRE(found != slots_.end(), "disk slot ", slot, " is not held");
  ZA_REQUIRE(bytes <= found->second.bytes, "a transfer of ", bytes, " bytes into disk slot ", slot,
             " of ", found->second.bytes, " bytes");
  const std::uint64_t files = files_.size();
  std::size_t done_bytes = 0;
  for (const unit_run& run : found->second.runs) {
    for (std::uint64_t unit = run.first_unit;
         unit < run.first_unit + run.units && done_bytes < bytes; ++unit) {
      const std::uint64_t unit_offset = unit / files * options_.stripe_bytes;
      for (std::size_t within = 0; within < options_.stripe_bytes && done_bytes < bytes;
           within += options_.request_bytes) {
        auto piece = std::make_unique<request>();
        piece->owner = state;
        piece->file = static_cast<unsigned>(unit % files);
        piece->offset = unit_offset + within;
        piece->host = host + done_bytes;
        piece->bytes = std::min(options_.request_bytes, bytes - done_bytes);
        piece->buffer_index = fixed_buffer_index(piece->host, piece->bytes);
        if (piece->buffer_index >= 0) ++figures_.fixed_buffer_requests;
        done_bytes += piece->bytes;
        waiting_.push_back(std::move(piece));
        ++state->requests_left;
      }
    }
  }
  (is_write ? figures_.write_requests : figures_.read_requests) += state->requests_left;
  submit_waiting_locked();
  return ticket(std::move(state));
}

void disk_store::submit_waiting_locked() {
  unsigned prepared = 0;
  while (!waiting_.empty() && in_flight_ < options_.queue_depth) {
    std::unique_ptr<request> next = std::move(waiting_.front());
    waiting_.pop_front();
    if (next->owner->failed) {  // the rest of a failed transfer is not attempted
      if (--next->owner->requests_left == 0) transfer_ended_.notify_all();
      continue;
    }
    io_uring_sqe* entry = io_uring_get_sqe(ring_.get());
    if (entry == nullptr) {  // cannot happen: entries >= queue depth; try again later
      waiting_.push_front(std::move(next));
      break;
    }
    const int file =
        options_.register_files ? static_cast<int>(next->file) : files_[next->file].descriptor;
    const auto bytes = static_cast<unsigned>(next->bytes);
    const auto offset = static_cast<off_t>(next->offset);
    if (next->owner->is_write && next->buffer_index >= 0) {
      io_uring_prep_write_fixed(entry, file, next->host, bytes, offset, next->buffer_index);
    } else if (next->owner->is_write) {
      io_uring_prep_write(entry, file, next->host, bytes, offset);
    } else if (next->buffer_index >= 0) {
      io_uring_prep_read_fixed(entry, file, next->host, bytes, offset, next->buffer_index);
    } else {
      io_uring_prep_read(entry, file, next->host, bytes, offset);
    }
    if (options_.register_files) entry->flags |= IOSQE_FIXED_FILE;
    io_uring_sqe_set_data(entry, next.release());
    ++in_flight_;
    ++prepared;
  }
  if (prepared > 0) {
    // The kernel takes what is in the submission queue; an error here leaves the entries
    // there for the next submission.
    const int submitted = io_uring_submit(ring_.get());
    if (submitted < 0) log().warn("io_uring_submit failed: {}", describe_errno(-submitted));
  }
}

void disk_store::reap_completions() {
  for (;;) {
    io_uring_cqe* completion = nullptr;
    const int waited = io_uring_wait_cqe(ring_.get(), &completion);
    if (waited == -EINTR || waited == -EAGAIN) continue;
    if (waited < 0) {
      log().error("io_uring_wait_cqe failed: {}; the NVMe tier stops", describe_errno(-waited));
      return;
    }
    auto* done = static_cast<request*>(io_uring_cqe_get_data(completion));
    const int result = completion->res;
    // Under the lock: the request was written under it by the submitting thread.
    std::lock_guard lock(mutex_);
    io_uring_cqe_seen(ring_.get(), completion);
    if (done == nullptr) {
      if (stopping_) return;
      continue;
    }
    --in_flight_;
    complete_locked(done, result);
    submit_waiting_locked();
  }
}

void disk_store::complete_locked(request* done, int result) {
  std::unique_ptr<request> owned(done);
  transfer& owner = *done->owner;
  if (result > 0 && static_cast<std::size_t>(result) < done->bytes && !owner.failed) {
    // A partial transfer: the rest goes again, first.
    owned->host += result;
    owned->offset += static_cast<std::uint64_t>(result);
    owned->bytes -= static_cast<std::size_t>(result);
    (owner.is_write ? figures_.bytes_written : figures_.bytes_read) += result;
    waiting_.push_front(std::move(owned));
    return;
  }
  if (result <= 0 && !owner.failed) {
    fail_locked(owner, *done, result);
  } else if (result > 0) {
    (owner.is_write ? figures_.bytes_written : figures_.bytes_read) += result;
  }
  if (--owner.requests_left > 0) return;
  const auto elapsed_us = std::chrono::duration_cast<std::chrono::microseconds>(
                              std::chrono::steady_clock::now() - owner.started)
                              .count();
  (owner.is_write ? figures_.write_time_us : figures_.read_time_us) += elapsed_us;
  if (owner.is_write && !owner.failed && options_.verify) {
    const auto slot = slots_.find(owner.slot);
    if (slot != slots_.end()) {
      slot->second.checksum = owner.checksum;
      slot->second.checksum_bytes = owner.bytes;
    }
  }
  transfer_ended_.notify_all();
}

void disk_store::fail_locked(transfer& owner, const request& failed, int result) {
  owner.failed = true;
  owner.error_code = -result;
  ++figures_.failed_transfers;
  const char* operation = owner.is_write ? "write" : "read";
  owner.error_message = detail::concat(
      "NVMe tier: ", operation, " of ", failed.bytes, " bytes at offset ", failed.offset, " of ",
      files_[failed.file].name, " failed: ",
      result == 0 ? std::string(owner.is_write ? "nothing written (short write)"
                                               : "end of file (short read)")
                  : describe_errno(-result),
      owner.is_write ? "; the chunk stays in host memory and its disk slot is released"
                     : "; the slot's bytes cannot be read back");
}

void disk_store::wait(const ticket& pending) {
  ZA_REQUIRE(pending.valid(), "waiting on an empty disk ticket");
  transfer& state = *pending.state_;
  std::unique_lock lock(mutex_);
  transfer_ended_.wait(lock, [&] { return state.requests_left == 0; });
  if (state.failed) {
    if (state.is_write) {
      const auto found = slots_.find(state.slot);
      if (found != slots_.end()) {
        for (const unit_run& run : found->second.runs) {
          free_units_.give_back(run.first_unit, run.units);
          figures_.used_bytes -= run.units * options_.stripe_bytes;
        }
        slots_.erase(found);
      }
    }
    throw disk_io_error(state.error_message, state.error_code);
  }
  if (state.is_write || !options_.verify) return;
  const auto found = slots_.find(state.slot);
  if (found == slots_.end() || found->second.checksum_bytes != state.bytes) return;
  const std::uint64_t expected = found->second.checksum;
  lock.unlock();
  if (checksum_of(state.host, state.bytes) != expected) {
    throw disk_io_error(
        detail::concat("NVMe tier (ZEROALLOC_VERIFY): the ", state.bytes,
                       " bytes read from disk slot ", state.slot, " differ from those written"),
        EIO);
  }
}

bool disk_store::done(const ticket& pending) const {
  std::lock_guard lock(mutex_);
  return pending.valid() && pending.state_->requests_left == 0;
}

disk_store_figures disk_store::figures() const {
  std::lock_guard lock(mutex_);
  return figures_;
}

std::vector<std::string> disk_store::file_names() const {
  std::vector<std::string> names;
  for (const swap_file& file : files_) names.push_back(file.name);
  return names;
}

}  // namespace zeroalloc
