// The NVMe tier's storage: chunks' bytes kept in swap files, one per directory of
// ZEROALLOC_NVME_PATH (one directory per drive), written from and read into pinned host
// memory through io_uring with O_DIRECT. Self-contained: it knows host pointers and byte
// counts, not chunks, devices or the engine.
//
// Note [Swap files leave no name]: each file is created with O_TMPFILE in a private
// subdirectory (mode 0700) that is removed at once, or, where the file system has no
// O_TMPFILE, created and unlinked at once; the store holds the only reference, its file
// descriptor. A crash, a SIGKILL or an exception leaves nothing on the drives to clean up,
// and nobody else can open the bytes. Each file is preallocated with fallocate at start, so
// a drive without room for the capacity is a clear error at start, not an ENOSPC in the
// middle of training.
//
// Note [Striping]: the store's space is a sequence of stripe units (stripe_bytes each); unit
// u lies in file u % files at offset (u / files) * stripe_bytes. A slot takes a run of
// consecutive units (several runs only when the space is fragmented), so one chunk's bytes
// are spread round-robin over every drive and a chunk's transfer runs on all of them at
// once. Each unit is transferred in requests of request_bytes (DeepSpeed's aio block size is
// 1 MiB), at most queue_depth in flight over all drives.
//
// Note [A failed write loses nothing]: a write copies host bytes to the disk; the caller
// keeps its host copy until the write's ticket completes without an error. When a request
// fails (EIO, ENOSPC, a short write), wait() releases the slot and throws disk_io_error
// naming the file, the offset and the operation: the chunk is still wholly in host memory,
// where the caller left it, and it may try again or keep it there.
#pragma once

#include <sys/uio.h>

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "core/errors.hpp"
#include "core/free_ranges.hpp"
#include "core/units.hpp"

struct io_uring;

namespace zeroalloc {

/// An I/O request of the store failed. The message names the file, the offset, the
/// operation and the system's error; code() is the errno value (EIO, ENOSPC, ...), or 0 for
/// a short transfer.
class disk_io_error : public coded_error {
 public:
  using coded_error::coded_error;
};

/// The store has no free space left for a slot of the requested size.
class disk_space_exhausted : public error {
 public:
  using error::error;
};

/// io_uring cannot be used in this process; code() is ENOSYS (an old kernel) or EPERM
/// (disabled by kernel.io_uring_disabled or a seccomp filter).
class io_uring_unavailable : public coded_error {
 public:
  using coded_error::coded_error;
};

struct disk_store_options {
  std::vector<std::string> directories;  ///< one per drive (ZEROALLOC_NVME_PATH)
  std::uint64_t capacity_bytes = 0;      ///< over all directories, rounded up to whole units
  std::size_t stripe_bytes = 2 * MiB;    ///< Note [Striping]; a multiple of 4 KiB
  std::size_t request_bytes = 1 * MiB;   ///< one I/O request at most; divides stripe_bytes
  unsigned queue_depth = 32;             ///< requests in flight over all files
  bool register_files = true;            ///< io_uring registered files (tests turn it off)
  bool verify = false;  ///< checksum each slot on write, check it on read (ZEROALLOC_VERIFY)
};

/// Parses ZEROALLOC_NVME_PATH's form: directories separated by ':', empty parts ignored.
std::vector<std::string> split_directories(const std::string& nvme_path);

/// A slot of the store: where one chunk's bytes live on disk. 0 is no slot.
using disk_slot = std::uint64_t;

/// What the store has done, for reports.
struct disk_store_figures {
  std::uint64_t capacity_bytes = 0;
  std::uint64_t used_bytes = 0;  ///< held by slots
  std::uint64_t bytes_written = 0;
  std::uint64_t bytes_read = 0;
  std::uint64_t write_requests = 0;  ///< io_uring requests, not calls of write()
  std::uint64_t read_requests = 0;
  std::uint64_t fixed_buffer_requests = 0;  ///< of those, from registered buffers
  std::uint64_t write_time_us = 0;          ///< summed from each write() to its last completion
  std::uint64_t read_time_us = 0;
  std::uint64_t failed_transfers = 0;
};

class disk_store {
  struct transfer;

 public:
  /// What write() and read() return: wait on it with disk_store::wait. Cheap to copy.
  class ticket {
   public:
    ticket() = default;
    [[nodiscard]] bool valid() const { return state_ != nullptr; }

   private:
    friend class disk_store;
    explicit ticket(std::shared_ptr<transfer> state) : state_(std::move(state)) {}
    std::shared_ptr<transfer> state_;
  };

  /// Creates and preallocates one swap file per directory (Note [Swap files leave no
  /// name]) and starts the completion thread. Throws config_error naming the directory
  /// when one is missing, not writable, refuses O_DIRECT or lacks room for its share of
  /// the capacity (with the bytes needed and free), and io_uring_unavailable when the
  /// kernel refuses io_uring.
  explicit disk_store(disk_store_options options);
  /// Waits for every request in flight, then closes the files (their space returns to the
  /// file systems).
  ~disk_store();
  disk_store(const disk_store&) = delete;
  disk_store& operator=(const disk_store&) = delete;

  /// Registers host memory (pinned chunks' slabs) as io_uring fixed buffers, so that
  /// requests into it skip the kernel's page pinning. Once, before any transfer; at most
  /// 1 GiB per buffer, anonymous memory, charged to RLIMIT_MEMLOCK. False (and transfers
  /// use plain requests) when the kernel refuses them.
  bool register_host_buffers(const std::vector<iovec>& buffers);

  /// A slot for `bytes` (rounded up to whole stripe units) that leaves at least
  /// `leave_free` bytes of the store free (Note [Room kept for restores]). Throws
  /// disk_space_exhausted.
  disk_slot allocate(std::size_t bytes, std::uint64_t leave_free = 0);
  /// Gives a slot's space back. Nothing may be in flight on it.
  void release(disk_slot slot);

  /// Starts copying `bytes` from `host` (4 KiB aligned, a multiple of 4 KiB, at most the
  /// slot's size) to the slot. `host` must stay unchanged until the ticket completes.
  ticket write(disk_slot slot, const void* host, std::size_t bytes);
  /// Starts copying the slot's first `bytes` into `host` (aligned as for write).
  ticket read(disk_slot slot, void* host, std::size_t bytes);
  /// Waits for a transfer. Throws disk_io_error when a request failed: for a write, the
  /// slot is released first (Note [A failed write loses nothing]); with verify, a read
  /// whose bytes differ from those written throws too.
  void wait(const ticket& pending);
  /// True once the transfer has ended, successfully or not.
  [[nodiscard]] bool done(const ticket& pending) const;

  [[nodiscard]] disk_store_figures figures() const;
  [[nodiscard]] const disk_store_options& options() const { return options_; }
  /// The swap files' paths as the messages name them.
  [[nodiscard]] std::vector<std::string> file_names() const;

 private:
  struct swap_file {
    std::string name;  // directory and file, for messages
    int descriptor = -1;
    std::uint64_t bytes = 0;
  };
  struct unit_run {
    std::uint64_t first_unit = 0;
    std::uint64_t units = 0;
  };
  struct slot_record {
    std::vector<unit_run> runs;
    std::size_t bytes = 0;
    std::uint64_t checksum = 0;  // of the bytes last written (verify)
    std::size_t checksum_bytes = 0;
  };
  struct request {
    std::shared_ptr<transfer> owner;
    unsigned file = 0;
    std::uint64_t offset = 0;
    char* host = nullptr;
    std::size_t bytes = 0;
    int buffer_index = -1;  // fixed buffer, or -1
  };

  void open_files();
  void start_ring();
  ticket start(disk_slot slot, char* host, std::size_t bytes, bool is_write);
  void submit_waiting_locked();
  void reap_completions();
  void complete_locked(request* done, int result);
  int fixed_buffer_index(const char* host, std::size_t bytes) const;
  void fail_locked(transfer& owner, const request& failed, int result);

  disk_store_options options_;
  std::vector<swap_file> files_;
  std::uint64_t units_ = 0;

  std::unique_ptr<io_uring> ring_;
  bool ring_started_ = false;
  std::vector<iovec> fixed_buffers_;

  mutable std::mutex mutex_;  // everything below, and the ring's submission queue
  std::condition_variable transfer_ended_;
  free_ranges free_units_;
  std::map<disk_slot, slot_record> slots_;
  disk_slot next_slot_ = 1;
  std::deque<std::unique_ptr<request>> waiting_;  // not yet submitted
  unsigned in_flight_ = 0;
  bool stopping_ = false;
  disk_store_figures figures_;

  std::thread completion_thread_;
};

}  // namespace zeroalloc
