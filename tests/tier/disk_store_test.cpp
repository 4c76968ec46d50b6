// The NVMe tier's disk store, on real files under a temporary directory through the kernel's
// io_uring: bytes intact after a round trip, clear errors for unusable directories, and
// failures that lose nothing. No GPU: any page-aligned host memory stands in for pinned
// chunks.
#include "tier/disk_store.hpp"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/statvfs.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstddef>
#include <cstring>
#include <filesystem>
#include <optional>
#include <random>
#include <thread>

namespace zeroalloc {
namespace {

namespace fs = std::filesystem;

// Page-aligned anonymous memory, as pinned host chunks are (and as fixed buffers must be).
class host_buffer {
 public:
  explicit host_buffer(std::size_t bytes) : bytes_(bytes) {
    void* mapped =
        ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (mapped == MAP_FAILED) throw std::bad_alloc();
    data_ = static_cast<char*>(mapped);
  }
  ~host_buffer() { ::munmap(data_, bytes_); }
  host_buffer(const host_buffer&) = delete;
  host_buffer& operator=(const host_buffer&) = delete;
  char* data() const { return data_; }
  std::size_t size() const { return bytes_; }
  void fill(std::uint64_t seed) const {
    std::mt19937_64 random(seed);
    for (std::size_t at = 0; at < bytes_; at += sizeof(std::uint64_t)) {
      const std::uint64_t word = random();
      std::memcpy(data_ + at, &word, sizeof word);
    }
  }

 private:
  char* data_ = nullptr;
  std::size_t bytes_ = 0;
};

bool same_bytes(const host_buffer& left, const host_buffer& right, std::size_t bytes) {
  return std::memcmp(left.data(), right.data(), bytes) == 0;
}

// The store's file descriptors: the open files whose path lies under `root`.
std::vector<int> descriptors_under(const fs::path& root) {
  std::vector<int> found;
  for (const auto& entry : fs::directory_iterator("/proc/self/fd")) {
    std::error_code ignored;
    const std::string target = fs::read_symlink(entry.path(), ignored).string();
    if (target.rfind(root.string(), 0) == 0) found.push_back(std::stoi(entry.path().filename()));
  }
  return found;
}

class DiskStoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char pattern[] = "/tmp/disk_store_test-XXXXXX";
    ASSERT_NE(::mkdtemp(pattern), nullptr);
    root_ = pattern;
  }
  void TearDown() override {
    std::error_code ignored;
    fs::permissions(root_, fs::perms::owner_all, ignored);
    fs::remove_all(root_, ignored);
  }

  std::vector<std::string> make_directories(int count) {
    std::vector<std::string> directories;
    for (int index = 0; index < count; ++index) {
      const fs::path directory = root_ / ("drive" + std::to_string(index));
      fs::create_directory(directory);
      directories.push_back(directory);
    }
    return directories;
  }

  disk_store_options options_for(int directories, std::uint64_t capacity_bytes) {
    disk_store_options options;
    options.directories = make_directories(directories);
    options.capacity_bytes = capacity_bytes;
    return options;
  }

  // Fills the optional with a store, or says why the test cannot run here.
  static void open_store(std::optional<disk_store>& store, const disk_store_options& options) {
    try {
      store.emplace(options);
    } catch (const io_uring_unavailable& unavailable) {
      GTEST_SKIP() << "skipped: io_uring not available here (" << unavailable.what() << ")";
    }
  }

  // The message of the config_error that constructing a store with `options` throws.
  static std::string config_error_of(const disk_store_options& options) {
    try {
      disk_store store(options);
    } catch (const config_error& thrown) {
      return thrown.what();
    } catch (const io_uring_unavailable&) {
      return "io_uring unavailable";
    }
    return "no error";
  }

  fs::path root_;
};

#define ZA_OPEN_STORE_OR_SKIP(store, options) \
  std::optional<disk_store> store;            \
  open_store(store, options);                 \
  if (!store) return

TEST_F(DiskStoreTest, BytesSurviveARoundTripOverSeveralDirectoriesWithManyRequestsInFlight) {
  disk_store_options options = options_for(3, 512 * MiB);
  options.queue_depth = 16;
  ZA_OPEN_STORE_OR_SKIP(store, options);
  const std::vector<std::size_t> sizes = {
      4 * KiB, 1 * MiB, 2 * MiB, 6 * MiB, 64 * MiB, 10 * MiB, 3 * MiB + 12 * KiB, 32 * MiB};
  std::vector<std::unique_ptr<host_buffer>> written, read_back;
  std::vector<disk_slot> slots;
  std::vector<disk_store::ticket> tickets;
  for (std::size_t index = 0; index < sizes.size(); ++index) {
    written.push_back(std::make_unique<host_buffer>(sizes[index]));
    written.back()->fill(index + 1);
    slots.push_back(store->allocate(sizes[index]));
    tickets.push_back(store->write(slots.back(), written.back()->data(), sizes[index]));
  }
  for (const auto& pending : tickets) store->wait(pending);
  tickets.clear();
  for (std::size_t index = 0; index < sizes.size(); ++index) {
    read_back.push_back(std::make_unique<host_buffer>(sizes[index]));
    tickets.push_back(store->read(slots[index], read_back.back()->data(), sizes[index]));
  }
  for (const auto& pending : tickets) store->wait(pending);
  std::uint64_t total = 0;
  for (std::size_t index = 0; index < sizes.size(); ++index) {
    EXPECT_TRUE(same_bytes(*written[index], *read_back[index], sizes[index]))
        << sizes[index] << " bytes";
    total += sizes[index];
  }
  const disk_store_figures figures = store->figures();
  EXPECT_EQ(figures.bytes_written, total);
  EXPECT_EQ(figures.bytes_read, total);
  EXPECT_GE(figures.write_requests, total / MiB);
  EXPECT_EQ(figures.failed_transfers, 0u);
  for (disk_slot slot : slots) store->release(slot);
  EXPECT_EQ(store->figures().used_bytes, 0u);
}

TEST_F(DiskStoreTest, BytesSurviveAtEveryQueueDepthAndRequestSize) {
  struct setting {
    unsigned queue_depth;
    std::size_t request_bytes;
    std::size_t stripe_bytes;
  };
  for (const setting& tried : {setting{1, 1 * MiB, 2 * MiB}, setting{2, 4 * KiB, 2 * MiB},
                               setting{64, 8 * MiB, 8 * MiB}, setting{32, 2 * MiB, 4 * MiB}}) {
    SCOPED_TRACE(testing::Message() << "queue depth " << tried.queue_depth << ", requests of "
                                    << tried.request_bytes << " bytes");
    disk_store_options options = options_for(2, 128 * MiB);
    options.queue_depth = tried.queue_depth;
    options.request_bytes = tried.request_bytes;
    options.stripe_bytes = tried.stripe_bytes;
    ZA_OPEN_STORE_OR_SKIP(store, options);
    host_buffer first(24 * MiB), second(6 * MiB), back(24 * MiB);
    first.fill(tried.queue_depth);
    second.fill(tried.request_bytes);
    const disk_slot first_slot = store->allocate(first.size());
    const disk_slot second_slot = store->allocate(second.size());
    const auto first_written = store->write(first_slot, first.data(), first.size());
    const auto second_written = store->write(second_slot, second.data(), second.size());
    store->wait(second_written);
    store->wait(first_written);
    store->wait(store->read(first_slot, back.data(), first.size()));
    EXPECT_TRUE(same_bytes(first, back, first.size()));
    store->wait(store->read(second_slot, back.data(), second.size()));
    EXPECT_TRUE(same_bytes(second, back, second.size()));
  }
}

TEST_F(DiskStoreTest, SeveralThreadsShareTheStore) {
  disk_store_options options = options_for(2, 256 * MiB);
  options.queue_depth = 8;
  options.verify = true;
  ZA_OPEN_STORE_OR_SKIP(store, options);
  std::vector<std::thread> threads;
  std::atomic<int> intact{0};
  for (int thread = 0; thread < 4; ++thread) {
    threads.emplace_back([&, thread] {
      host_buffer chunk(8 * MiB), back(8 * MiB);
      for (int round = 0; round < 4; ++round) {
        chunk.fill(thread * 100 + round);
        const disk_slot slot = store->allocate(chunk.size());
        store->wait(store->write(slot, chunk.data(), chunk.size()));
        store->wait(store->read(slot, back.data(), back.size()));
        intact += same_bytes(chunk, back, chunk.size());
        store->release(slot);
      }
    });
  }
  for (std::thread& running : threads) running.join();
  EXPECT_EQ(intact.load(), 16);
  EXPECT_EQ(store->figures().used_bytes, 0u);
}

TEST_F(DiskStoreTest, AChunkIsStripedOverEveryDirectory) {
  disk_store_options options = options_for(4, 64 * MiB);
  options.register_files = false;
  ZA_OPEN_STORE_OR_SKIP(store, options);
  host_buffer chunk(8 * MiB);
  chunk.fill(7);
  const disk_slot slot = store->allocate(chunk.size());
  store->wait(store->write(slot, chunk.data(), chunk.size()));
  // Unit u of 2 MiB lies in file u % 4: each file holds one of the chunk's 2 MiB in turn.
  const std::vector<int> files = descriptors_under(root_);
  ASSERT_EQ(files.size(), 4u);
  host_buffer on_disk(2 * MiB);
  int matched = 0;
  for (int descriptor : files) {
    ASSERT_EQ(::pread(descriptor, on_disk.data(), on_disk.size(), 0), 2 * static_cast<long>(MiB));
    for (int unit = 0; unit < 4; ++unit) {
      matched += std::memcmp(on_disk.data(), chunk.data() + unit * 2 * MiB, 2 * MiB) == 0;
    }
  }
  EXPECT_EQ(matched, 4);
}

TEST_F(DiskStoreTest, RegisteredHostBuffersCarryTheTransfers) {
  ZA_OPEN_STORE_OR_SKIP(store, options_for(2, 64 * MiB));
  host_buffer source(16 * MiB), destination(16 * MiB);
  const bool registered = store->register_host_buffers(
      {{source.data(), source.size()}, {destination.data(), destination.size()}});
  if (!registered) GTEST_SKIP() << "skipped: the kernel refused fixed buffers here";
  source.fill(3);
  const disk_slot slot = store->allocate(source.size());
  store->wait(store->write(slot, source.data(), source.size()));
  store->wait(store->read(slot, destination.data(), destination.size()));
  EXPECT_TRUE(same_bytes(source, destination, source.size()));
  EXPECT_EQ(store->figures().fixed_buffer_requests, 32u);
}

TEST_F(DiskStoreTest, SpaceIsReusedAndAFullStoreSaysSo) {
  ZA_OPEN_STORE_OR_SKIP(store, options_for(2, 8 * MiB));
  std::vector<disk_slot> slots;
  for (int index = 0; index < 4; ++index) slots.push_back(store->allocate(2 * MiB));
  EXPECT_THROW(store->allocate(2 * MiB), disk_space_exhausted);
  store->release(slots[0]);
  store->release(slots[2]);
  // Two free units apart: one slot of 4 MiB takes both.
  const disk_slot fragmented = store->allocate(4 * MiB);
  host_buffer chunk(4 * MiB), back(4 * MiB);
  chunk.fill(11);
  store->wait(store->write(fragmented, chunk.data(), chunk.size()));
  store->wait(store->read(fragmented, back.data(), back.size()));
  EXPECT_TRUE(same_bytes(chunk, back, chunk.size()));
  try {
    store->allocate(1);
    ADD_FAILURE() << "a full store allocated";
  } catch (const disk_space_exhausted& full) {
    EXPECT_NE(std::string(full.what()).find("no room"), std::string::npos) << full.what();
  }
}

// A slot that must leave room free (Note [Room kept for restores] in migrator.cpp) is
// refused once taking it would eat into that room, and the message says what is kept;
// a slot asked without it may still take the room.
TEST_F(DiskStoreTest, ASlotLeavesTheRoomAskedFree) {
  ZA_OPEN_STORE_OR_SKIP(store, options_for(2, 8 * MiB));
  const disk_slot first = store->allocate(4 * MiB, 2 * MiB);
  EXPECT_NE(first, 0u);
  try {
    store->allocate(4 * MiB, 2 * MiB);
    ADD_FAILURE() << "a slot took the room it had to leave free";
  } catch (const disk_space_exhausted& full) {
    EXPECT_NE(std::string(full.what()).find("2.00 MiB stay free"), std::string::npos)
        << full.what();
  }
  EXPECT_EQ(store->figures().used_bytes, 4 * MiB) << "a refused slot kept its space";
  const disk_slot kept = store->allocate(2 * MiB, 2 * MiB);
  const disk_slot last = store->allocate(2 * MiB);  // the kept room, taken when allowed
  EXPECT_EQ(store->figures().used_bytes, 8 * MiB);
  for (disk_slot slot : {first, kept, last}) store->release(slot);
  EXPECT_EQ(store->figures().used_bytes, 0u);
}

TEST_F(DiskStoreTest, SwapFilesLeaveNoNameBehind) {
  const disk_store_options options = options_for(2, 16 * MiB);
  {
    ZA_OPEN_STORE_OR_SKIP(store, options);
    for (const std::string& directory : options.directories) {
      EXPECT_TRUE(fs::is_empty(directory)) << directory << " holds a name while the store runs";
    }
    EXPECT_EQ(descriptors_under(root_).size(), 2u);
    // A program that runs another (a data loader's worker, a shell) does not hand it the
    // swap files: each is closed on exec.
    for (const int descriptor : descriptors_under(root_)) {
      EXPECT_TRUE(::fcntl(descriptor, F_GETFD) & FD_CLOEXEC) << "descriptor " << descriptor;
    }
  }
  for (const std::string& directory : options.directories) EXPECT_TRUE(fs::is_empty(directory));
  EXPECT_TRUE(descriptors_under(root_).empty());
}

// A training process killed while the store writes (SIGKILL: no destructor, no handler
// runs) leaves no swap file: no name in the directories, and the preallocated space comes
// back to the file system (Note [Swap files leave no name]).
TEST_F(DiskStoreTest, AProcessKilledMidWriteLeavesNoSwapFileBehind) {
  const disk_store_options options = options_for(2, 512 * MiB);
  struct statvfs before {};
  ASSERT_EQ(::statvfs(root_.c_str(), &before), 0);
  int ready[2];
  ASSERT_EQ(::pipe(ready), 0);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    ::close(ready[0]);
    try {
      disk_store store(options);
      host_buffer buffer(16 * MiB);
      buffer.fill(7);
      const disk_slot slot = store.allocate(buffer.size());
      for (int written = 0;; ++written) {  // until killed
        store.wait(store.write(slot, buffer.data(), buffer.size()));
        if (written == 0) {
          const char byte = 1;
          if (::write(ready[1], &byte, 1) != 1) ::_exit(4);
        }
      }
    } catch (const io_uring_unavailable&) {
      ::_exit(3);
    } catch (...) {
      ::_exit(2);
    }
  }
  ::close(ready[1]);
  char byte = 0;
  const bool writing = ::read(ready[0], &byte, 1) == 1;  // or the child ended early
  ::close(ready[0]);
  if (writing) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  ::kill(child, SIGKILL);
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  if (!writing && WIFEXITED(status) && WEXITSTATUS(status) == 3) {
    GTEST_SKIP() << "skipped: io_uring not available here";
  }
  ASSERT_TRUE(writing) << "the child could not open the store and write (status " << status << ")";
  ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << "status " << status;
  for (const std::string& directory : options.directories) {
    EXPECT_TRUE(fs::is_empty(directory)) << directory << " holds a name after the crash";
  }
  // The space comes back once the last reference to the files is gone: the kernel closes
  // the descriptors at the process's death, and tears its io_uring down a little later (in
  // the background, after the requests in flight). Other tests may use the file system
  // meanwhile, hence the margin.
  double freed_mib = 0;
  for (int waited_ms = 0; waited_ms <= 10000; waited_ms += 50) {
    struct statvfs after {};
    ASSERT_EQ(::statvfs(root_.c_str(), &after), 0);
    freed_mib = (static_cast<double>(after.f_bavail) * after.f_frsize -
                 static_cast<double>(before.f_bavail) * before.f_frsize) /
                static_cast<double>(MiB);
    if (freed_mib > -128.0) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_GT(freed_mib, -128.0) << "the 512 MiB of swap space is still held 10 s after the crash";
}

TEST_F(DiskStoreTest, AMissingDirectoryIsNamed) {
  disk_store_options options = options_for(1, 16 * MiB);
  options.directories.push_back((root_ / "no-such-drive").string());
  const std::string message = config_error_of(options);
  EXPECT_NE(message.find("no-such-drive"), std::string::npos) << message;
  EXPECT_NE(message.find("ZEROALLOC_NVME_PATH"), std::string::npos) << message;

  options.directories.back() = (root_ / "a-file").string();
  std::fclose(std::fopen(options.directories.back().c_str(), "w"));
  const std::string not_directory = config_error_of(options);
  EXPECT_NE(not_directory.find("a-file' is not a usable directory (Not a directory)"),
            std::string::npos)
      << not_directory;
}

// Runs `body` in a child process and returns what it wrote to `report`.
template <typename Body>
std::string in_child(Body body) {
  int channel[2];
  if (::pipe(channel) != 0) return "pipe failed";
  const pid_t child = ::fork();
  if (child == 0) {
    ::close(channel[0]);
    const std::string report = body();
    (void)!::write(channel[1], report.data(), report.size());
    ::_exit(0);
  }
  ::close(channel[1]);
  std::string report;
  char part[512];
  for (ssize_t got; (got = ::read(channel[0], part, sizeof part)) > 0;) report.append(part, got);
  ::close(channel[0]);
  int status = 0;
  ::waitpid(child, &status, 0);
  return report;
}

TEST_F(DiskStoreTest, AReadOnlyDirectoryIsNamed) {
  disk_store_options options = options_for(1, 16 * MiB);
  fs::permissions(root_, fs::perms::owner_all | fs::perms::group_exec | fs::perms::others_exec);
  fs::permissions(options.directories[0], fs::perms::owner_read | fs::perms::owner_exec |
                                              fs::perms::group_read | fs::perms::group_exec |
                                              fs::perms::others_read | fs::perms::others_exec);
  // Root writes anywhere: the store runs as nobody, in a child.
  const std::string message = in_child([&] {
    if (::geteuid() == 0 &&
        (::setresgid(65534, 65534, 65534) != 0 || ::setresuid(65534, 65534, 65534) != 0)) {
      return std::string("cannot become nobody");
    }
    return config_error_of(options);
  });
  EXPECT_NE(message.find(options.directories[0]), std::string::npos) << message;
  EXPECT_NE(message.find("writable"), std::string::npos) << message;
}

TEST_F(DiskStoreTest, ACapacityBeyondTheFreeSpaceIsNamedAtStart) {
  disk_store_options options = options_for(1, 0);
  struct statvfs space {};
  ASSERT_EQ(::statvfs(options.directories[0].c_str(), &space), 0);
  options.capacity_bytes = std::uint64_t{space.f_bavail} * space.f_frsize + 64 * GiB;
  const std::string message = config_error_of(options);
  EXPECT_NE(message.find(options.directories[0]), std::string::npos) << message;
  EXPECT_NE(message.find("free"), std::string::npos) << message;
  EXPECT_NE(message.find(std::to_string(round_up(options.capacity_bytes, 2 * MiB))),
            std::string::npos)
      << message;
  EXPECT_TRUE(fs::is_empty(options.directories[0]));
}

TEST_F(DiskStoreTest, AFileSystemThatRefusesDirectIoIsNamed) {
  // tmpfs accepts O_DIRECT since Linux 6.6; ramfs does not. Mount one in a private mount
  // namespace of a child, where it vanishes with the child.
  const fs::path mount_point = root_ / "ramfs";
  fs::create_directory(mount_point);
  const std::string message = in_child([&] {
    if (::unshare(CLONE_NEWNS) != 0 ||
        ::mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0 ||
        ::mount("none", mount_point.c_str(), "ramfs", 0, nullptr) != 0) {
      return std::string("skip: ") + std::strerror(errno);
    }
    disk_store_options options;
    options.directories = {mount_point.string()};
    options.capacity_bytes = 16 * MiB;
    return config_error_of(options);
  });
  if (message.rfind("skip: ", 0) == 0) {
    GTEST_SKIP() << "skipped: cannot mount a ramfs here to refuse O_DIRECT (" << message << ")";
  }
  EXPECT_NE(message.find(mount_point.string()), std::string::npos) << message;
  EXPECT_NE(message.find("O_DIRECT"), std::string::npos) << message;
}

TEST_F(DiskStoreTest, AKernelThatRefusesIoUringIsNamed) {
  const disk_store_options options = options_for(1, 16 * MiB);
  // A seccomp filter in a child answers io_uring_setup with EPERM, as
  // kernel.io_uring_disabled=2 or a container's profile does.
  const std::string report = in_child([&] {
    sock_filter refuse_io_uring[] = {
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(seccomp_data, nr)),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_io_uring_setup, 0, 1),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | EPERM),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
    };
    sock_fprog program{static_cast<unsigned short>(std::size(refuse_io_uring)), refuse_io_uring};
    if (::prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 ||
        ::prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &program) != 0) {
      return std::string("skip: ") + std::strerror(errno);
    }
    try {
      disk_store store(options);
    } catch (const io_uring_unavailable& unavailable) {
      return std::string(unavailable.what()) + " code " + std::to_string(unavailable.code());
    } catch (const std::exception& other) {
      return std::string("another error: ") + other.what();
    }
    return std::string("no error");
  });
  if (report.rfind("skip: ", 0) == 0) GTEST_SKIP() << "skipped: no seccomp here (" << report << ")";
  EXPECT_NE(report.find("io_uring is not available"), std::string::npos) << report;
  EXPECT_NE(report.find("code " + std::to_string(EPERM)), std::string::npos) << report;
  EXPECT_TRUE(fs::is_empty(options.directories[0]));
}

TEST_F(DiskStoreTest, AClosedFileFailsTheWriteNamingItAndLosesNothing) {
  disk_store_options options = options_for(1, 16 * MiB);
  options.register_files = false;  // a registered file outlives its descriptor
  ZA_OPEN_STORE_OR_SKIP(store, options);
  host_buffer chunk(4 * MiB), original(4 * MiB);
  chunk.fill(5);
  std::memcpy(original.data(), chunk.data(), chunk.size());
  const disk_slot slot = store->allocate(chunk.size());
  const std::vector<int> files = descriptors_under(root_);
  ASSERT_EQ(files.size(), 1u);
  ::close(files[0]);
  try {
    store->wait(store->write(slot, chunk.data(), chunk.size()));
    ADD_FAILURE() << "a write to a closed file succeeded";
  } catch (const disk_io_error& failed) {
    const std::string message = failed.what();
    EXPECT_EQ(failed.code(), EBADF);
    EXPECT_NE(message.find("write"), std::string::npos) << message;
    EXPECT_NE(message.find(options.directories[0]), std::string::npos) << message;
    EXPECT_NE(message.find("offset"), std::string::npos) << message;
  }
  EXPECT_TRUE(same_bytes(chunk, original, chunk.size()));
  EXPECT_EQ(store->figures().used_bytes, 0u) << "the failed write's slot is released";
  EXPECT_EQ(store->figures().failed_transfers, 1u);
  // The descriptor number the store closes at the end is a stand-in, not a reused file.
  ASSERT_EQ(::open("/dev/null", O_RDONLY), files[0]);  // what the store will close
}

TEST_F(DiskStoreTest, AWriteTheKernelRefusesLosesNothing) {
  ZA_OPEN_STORE_OR_SKIP(store, options_for(2, 32 * MiB));
  host_buffer kept(4 * MiB), chunk(4 * MiB), original(4 * MiB), back(4 * MiB);
  kept.fill(1);
  chunk.fill(2);
  std::memcpy(original.data(), chunk.data(), chunk.size());
  const disk_slot kept_slot = store->allocate(kept.size());
  store->wait(store->write(kept_slot, kept.data(), kept.size()));
  // RLIMIT_FSIZE 0: every write fails with EFBIG (as a full or failing drive would fail it).
  rlimit previous{};
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &previous), 0);
  const auto previous_handler = ::signal(SIGXFSZ, SIG_IGN);
  rlimit none = previous;
  none.rlim_cur = 0;
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &none), 0);
  const disk_slot slot = store->allocate(chunk.size());
  int code = 0;
  try {
    store->wait(store->write(slot, chunk.data(), chunk.size()));
  } catch (const disk_io_error& failed) {
    code = failed.code();
    EXPECT_NE(std::string(failed.what()).find("stays in host memory"), std::string::npos);
  }
  ::setrlimit(RLIMIT_FSIZE, &previous);
  ::signal(SIGXFSZ, previous_handler);
  EXPECT_EQ(code, EFBIG);
  EXPECT_TRUE(same_bytes(chunk, original, chunk.size()));
  EXPECT_THROW(store->release(slot), invalid_argument) << "released by the failed write";
  // What was written before is untouched.
  store->wait(store->read(kept_slot, back.data(), back.size()));
  EXPECT_TRUE(same_bytes(kept, back, kept.size()));
}

TEST_F(DiskStoreTest, ATruncatedFileIsAShortReadNamingIt) {
  const disk_store_options options = options_for(1, 16 * MiB);
  ZA_OPEN_STORE_OR_SKIP(store, options);
  host_buffer chunk(4 * MiB), back(4 * MiB);
  chunk.fill(9);
  const disk_slot slot = store->allocate(chunk.size());
  store->wait(store->write(slot, chunk.data(), chunk.size()));
  const std::vector<int> files = descriptors_under(root_);
  ASSERT_EQ(files.size(), 1u);
  ASSERT_EQ(::ftruncate(files[0], 0), 0);
  try {
    store->wait(store->read(slot, back.data(), back.size()));
    ADD_FAILURE() << "a read past the end of the file succeeded";
  } catch (const disk_io_error& failed) {
    const std::string message = failed.what();
    EXPECT_NE(message.find("short read"), std::string::npos) << message;
    EXPECT_NE(message.find(options.directories[0]), std::string::npos) << message;
  }
  // The slot stays held: its owner decides what a lost chunk means.
  store->release(slot);
}

TEST_F(DiskStoreTest, VerifyCatchesBytesChangedOnDisk) {
  disk_store_options options = options_for(1, 16 * MiB);
  options.verify = true;
  ZA_OPEN_STORE_OR_SKIP(store, options);
  host_buffer chunk(4 * MiB), back(4 * MiB), garbage(4 * KiB);
  chunk.fill(4);
  garbage.fill(99);
  const disk_slot slot = store->allocate(chunk.size());
  store->wait(store->write(slot, chunk.data(), chunk.size()));
  store->wait(store->read(slot, back.data(), back.size()));  // intact: no error
  const std::vector<int> files = descriptors_under(root_);
  ASSERT_EQ(files.size(), 1u);
  ASSERT_EQ(::pwrite(files[0], garbage.data(), garbage.size(), 0),
            static_cast<ssize_t>(garbage.size()));
  try {
    store->wait(store->read(slot, back.data(), back.size()));
    ADD_FAILURE() << "changed bytes passed the check";
  } catch (const disk_io_error& changed) {
    EXPECT_NE(std::string(changed.what()).find("differ"), std::string::npos) << changed.what();
  }
}

TEST_F(DiskStoreTest, BadSettingsAndTransfersAreRefused) {
  disk_store_options options = options_for(1, 16 * MiB);
  options.request_bytes = 3 * MiB;  // does not divide the 2 MiB stripe unit
  EXPECT_THROW(disk_store{options}, invalid_argument);
  options.request_bytes = 1 * MiB;
  ZA_OPEN_STORE_OR_SKIP(store, options);
  host_buffer chunk(4 * MiB);
  const disk_slot slot = store->allocate(2 * MiB);
  EXPECT_THROW(store->write(slot, chunk.data() + 512, 4 * KiB), invalid_argument);
  EXPECT_THROW(store->write(slot, chunk.data(), 4 * MiB), invalid_argument);
  EXPECT_THROW(store->read(slot + 1, chunk.data(), 4 * KiB), invalid_argument);
}

TEST(SplitDirectories, ColonsSeparateAndEmptyPartsVanish) {
  EXPECT_EQ(split_directories("/a:/b::/c:"), (std::vector<std::string>{"/a", "/b", "/c"}));
  EXPECT_TRUE(split_directories("").empty());
}

}  // namespace
}  // namespace zeroalloc
