// Sequential write, then read, of N chunks of 64 MiB through the NVMe tier's disk store,
// beside what plain O_DIRECT pwrite/pread of 16 MiB blocks (as `dd oflag=direct bs=16M`)
// gets from the same directories in the same run. Prints a table (GB/s, 1e9 bytes/s).
//
//   disk_store_bench [--path DIR[:DIR...]] [--chunks N] [--rounds R] [--queue-depth Q]
//                    [--request-mib M] [--window W]
//
// The store keeps W chunks in flight (their host buffers registered as fixed buffers, as
// the engine's pinned chunks would be); the plain loop does one 16 MiB request at a time
// per directory in turn, as dd would.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/utsname.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "tier/disk_store.hpp"

namespace {

using namespace zeroalloc;
using clock_type = std::chrono::steady_clock;

constexpr std::size_t chunk_bytes = 64 * MiB;
constexpr std::size_t plain_block_bytes = 16 * MiB;

double seconds_since(clock_type::time_point start) {
  return std::chrono::duration<double>(clock_type::now() - start).count();
}

char* map_host(std::size_t bytes) {
  void* mapped = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (mapped == MAP_FAILED) {
    std::perror("mmap");
    std::exit(1);
  }
  std::memset(mapped, 0x5a, bytes);  // touched: no page faults inside the timed loops
  return static_cast<char*>(mapped);
}

struct rates {
  double write_gbps = 0;
  double read_gbps = 0;
};

rates through_store(disk_store& store, const std::vector<char*>& buffers, int chunks) {
  std::vector<disk_slot> slots;
  for (int index = 0; index < chunks; ++index) slots.push_back(store.allocate(chunk_bytes));
  const std::size_t window = buffers.size();
  rates measured;
  for (const bool is_write : {true, false}) {
    std::vector<disk_store::ticket> pending(window);
    const auto start = clock_type::now();
    for (int index = 0; index < chunks; ++index) {
      disk_store::ticket& slot_ticket = pending[index % window];
      if (slot_ticket.valid()) store.wait(slot_ticket);
      char* host = buffers[index % window];
      slot_ticket = is_write ? store.write(slots[index], host, chunk_bytes)
                             : store.read(slots[index], host, chunk_bytes);
    }
    for (const auto& left : pending) {
      if (left.valid()) store.wait(left);
    }
    const double gbps = double(chunks) * chunk_bytes / seconds_since(start) / 1e9;
    (is_write ? measured.write_gbps : measured.read_gbps) = gbps;
  }
  for (disk_slot slot : slots) store.release(slot);
  return measured;
}

// dd-like: one O_DIRECT file per directory (no name, as the store's), 16 MiB blocks, one
// request at a time, directories in turn.
rates through_plain_io(const std::vector<std::string>& directories, char* buffer, int chunks) {
  const std::uint64_t total = std::uint64_t(chunks) * chunk_bytes;
  const std::uint64_t per_file = round_up(total / directories.size(), plain_block_bytes);
  std::vector<int> files;
  for (const std::string& directory : directories) {
    const int file = ::open(directory.c_str(), O_TMPFILE | O_RDWR | O_DIRECT, 0600);
    if (file < 0 || ::fallocate(file, 0, 0, static_cast<off_t>(per_file)) != 0) {
      std::perror(directory.c_str());
      std::exit(1);
    }
    files.push_back(file);
  }
  rates measured;
  for (const bool is_write : {true, false}) {
    const auto start = clock_type::now();
    for (std::uint64_t done = 0, block = 0; done < total; done += plain_block_bytes, ++block) {
      const int file = files[block % files.size()];
      const auto offset = static_cast<off_t>(block / files.size() * plain_block_bytes);
      const ssize_t moved = is_write ? ::pwrite(file, buffer, plain_block_bytes, offset)
                                     : ::pread(file, buffer, plain_block_bytes, offset);
      if (moved != static_cast<ssize_t>(plain_block_bytes)) {
        std::perror(is_write ? "pwrite" : "pread");
        std::exit(1);
      }
    }
    const double gbps = double(total) / seconds_since(start) / 1e9;
    (is_write ? measured.write_gbps : measured.read_gbps) = gbps;
  }
  for (int file : files) ::close(file);
  return measured;
}

}  // namespace

int main(int argc, char** argv) {
  std::string path = "/tmp";
  int chunks = 16;
  int rounds = 3;
  unsigned queue_depth = 32;
  std::size_t request_mib = 1;
  std::size_t window = 4;
  for (int index = 1; index + 1 < argc; index += 2) {
    const std::string flag = argv[index];
    const char* value = argv[index + 1];
    if (flag == "--path") path = value;
    if (flag == "--chunks") chunks = std::atoi(value);
    if (flag == "--rounds") rounds = std::atoi(value);
    if (flag == "--queue-depth") queue_depth = static_cast<unsigned>(std::atoi(value));
    if (flag == "--request-mib") request_mib = static_cast<std::size_t>(std::atoi(value));
    if (flag == "--window") window = static_cast<std::size_t>(std::atoi(value));
  }

  disk_store_options options;
  options.directories = split_directories(path);
  options.capacity_bytes = std::uint64_t(chunks) * chunk_bytes;
  options.queue_depth = queue_depth;
  options.request_bytes = request_mib * MiB;
  options.stripe_bytes = std::max<std::size_t>(2 * MiB, options.request_bytes);
  std::vector<char*> buffers;
  std::vector<iovec> registered;
  for (std::size_t index = 0; index < window; ++index) {
    buffers.push_back(map_host(chunk_bytes));
    registered.push_back({buffers.back(), chunk_bytes});
  }

  utsname machine{};
  ::uname(&machine);
  std::printf("disk_store_bench: %d chunks of 64 MiB (%.2f GB) in %s; Linux %s, %ld cores\n",
              chunks, double(chunks) * chunk_bytes / 1e9, path.c_str(), machine.release,
              ::sysconf(_SC_NPROCESSORS_ONLN));
  std::printf(
      "store: %zu MiB requests, queue depth %u, %zu MiB stripe unit, %zu chunks in "
      "flight; plain: one %zu MiB O_DIRECT request at a time\n",
      request_mib, queue_depth, options.stripe_bytes / MiB, window, plain_block_bytes / MiB);
  try {
    disk_store store(options);
    const bool fixed = store.register_host_buffers(registered);
    std::printf("fixed buffers: %s\n\n", fixed ? "registered" : "refused (plain requests)");
    std::printf(
        "| round | store write | plain write | ratio | store read | plain read | ratio |\n");
    std::printf("|---|---|---|---|---|---|---|\n");
    for (int round = 1; round <= rounds; ++round) {
      const rates store_rates = through_store(store, buffers, chunks);
      const rates plain_rates = through_plain_io(options.directories, buffers[0], chunks);
      std::printf("| %d | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f |\n", round,
                  store_rates.write_gbps, plain_rates.write_gbps,
                  store_rates.write_gbps / plain_rates.write_gbps, store_rates.read_gbps,
                  plain_rates.read_gbps, store_rates.read_gbps / plain_rates.read_gbps);
    }
    const disk_store_figures figures = store.figures();
    std::printf(
        "\nstore figures: %llu bytes written in %llu requests, %llu read in %llu, "
        "%llu from fixed buffers, %.2f s writing and %.2f s reading (summed per chunk)\n",
        static_cast<unsigned long long>(figures.bytes_written),
        static_cast<unsigned long long>(figures.write_requests),
        static_cast<unsigned long long>(figures.bytes_read),
        static_cast<unsigned long long>(figures.read_requests),
        static_cast<unsigned long long>(figures.fixed_buffer_requests), figures.write_time_us / 1e6,
        figures.read_time_us / 1e6);
  } catch (const std::exception& failed) {
    std::fprintf(stderr, "disk_store_bench: %s\n", failed.what());
    return 1;
  }
  return 0;
}
