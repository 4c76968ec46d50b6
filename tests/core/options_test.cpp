// The options table: values users write are read as they mean them, and every bad value is
// refused with a message naming the variable, the value and the accepted form.
#include "core/options.hpp"

#include <gtest/gtest.h>

#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "core/errors.hpp"

namespace zeroalloc {
namespace {

options parse_with(const std::map<std::string, std::string>& environment) {
  std::vector<std::string> names;
  for (const auto& [name, value] : environment) names.push_back(name);
  return options::parse(
      [&](const char* name) -> const char* {
        auto found = environment.find(name);
        return found == environment.end() ? nullptr : found->second.c_str();
      },
      names);
}

std::string error_of(const std::map<std::string, std::string>& environment) {
  try {
    parse_with(environment);
  } catch (const config_error& failure) {
    return failure.what();
  }
  return "(accepted)";
}

TEST(ByteSize, ReadsBinaryAndDecimalUnits) {
  EXPECT_EQ(parse_byte_size("512MiB"), 512ull << 20);
  EXPECT_EQ(parse_byte_size("80GB"), 80'000'000'000ull);
  EXPECT_EQ(parse_byte_size("2m"), 2ull << 20);
  EXPECT_EQ(parse_byte_size("1.5GiB"), 3ull << 29);
  EXPECT_EQ(parse_byte_size("1048576"), 1048576ull);
  EXPECT_EQ(parse_byte_size(" 4 KiB "), 4096ull);
  EXPECT_EQ(parse_byte_size("16.1KB"), 16100ull);  // whole, though not exact in binary
}

TEST(ByteSize, RefusesGarbageNegativeFractionalBytesAndOverflow) {
  EXPECT_FALSE(parse_byte_size("lots"));
  EXPECT_FALSE(parse_byte_size("-5MiB"));
  EXPECT_FALSE(parse_byte_size("12 parsecs"));
  EXPECT_FALSE(parse_byte_size("1.3"));  // a fraction of a byte
  EXPECT_FALSE(parse_byte_size("99999999999TiB"));
  EXPECT_FALSE(parse_byte_size(""));
}

TEST(Options, DefaultsWhenNothingIsSet) {
  const options parsed = parse_with({});
  EXPECT_EQ(parsed.device, "auto");
  EXPECT_FALSE(parsed.limit.is_set());
  EXPECT_EQ(parsed.chunk_bytes, 64ull << 20);
  EXPECT_EQ(parsed.log_level, "warn");
  EXPECT_EQ(parsed.sim_device_count, 2);
}

TEST(Options, MemoryLimitAsBytesOrShare) {
  EXPECT_EQ(*parse_with({{"ZEROALLOC_MEMORY_LIMIT", "512MiB"}}).limit.bytes, 512ull << 20);
  EXPECT_DOUBLE_EQ(*parse_with({{"ZEROALLOC_MEMORY_LIMIT", "0.9"}}).limit.share, 0.9);
  EXPECT_DOUBLE_EQ(*parse_with({{"ZEROALLOC_MEMORY_LIMIT", "75%"}}).limit.share, 0.75);
  EXPECT_EQ(parse_with({{"ZEROALLOC_MEMORY_LIMIT", "0.5"}}).limit.resolve(8ull << 30), 4ull << 30);
  EXPECT_EQ(parse_with({{"ZEROALLOC_MEMORY_LIMIT", "1GiB"}}).limit.resolve(8ull << 30), 1ull << 30);
}

TEST(Options, OffloadSettings) {
  const options defaults = parse_with({});
  EXPECT_EQ(defaults.offload, "none");
  EXPECT_DOUBLE_EQ(*defaults.host_limit.share, 0.5);  // never all of the host's memory
  EXPECT_FALSE(defaults.verify);
  EXPECT_EQ(defaults.offload_gradients, "auto");
  EXPECT_FALSE(defaults.limit.is_set()) << "the host limit must not leak into the device's";
  const options chosen = parse_with({{"ZEROALLOC_OFFLOAD", "host"},
                                     {"ZEROALLOC_HOST_LIMIT", "24GiB"},
                                     {"ZEROALLOC_VERIFY", "on"},
                                     {"ZEROALLOC_OFFLOAD_GRADIENTS", "1"}});
  EXPECT_EQ(chosen.offload, "host");
  EXPECT_EQ(chosen.offload_gradients, "1");
  EXPECT_EQ(parse_with({{"ZEROALLOC_OFFLOAD_GRADIENTS", " On "}}).offload_gradients, "1");
  EXPECT_EQ(parse_with({{"ZEROALLOC_OFFLOAD_GRADIENTS", "no"}}).offload_gradients, "0");
  EXPECT_EQ(parse_with({{"ZEROALLOC_OFFLOAD_GRADIENTS", "AUTO"}}).offload_gradients, "auto");
  EXPECT_NE(error_of({{"ZEROALLOC_OFFLOAD_GRADIENTS", "maybe"}})
                .find("ZEROALLOC_OFFLOAD_GRADIENTS='maybe' is not valid: expected auto, 1 or 0"),
            std::string::npos);
  EXPECT_EQ(*chosen.host_limit.bytes, 24ull << 30);
  EXPECT_TRUE(chosen.verify);
  const std::string message = error_of({{"ZEROALLOC_HOST_LIMIT", "lots"}});
  EXPECT_NE(message.find("ZEROALLOC_HOST_LIMIT='lots' is not valid"), std::string::npos);
  EXPECT_NE(message.find("share of the host's memory"), std::string::npos) << message;
  EXPECT_NE(error_of({{"ZEROALLOC_OFFLOAD", "nvme"}}).find("one of none|host"), std::string::npos);
}

TEST(Options, BadValuesNameTheVariableTheValueAndTheForm) {
  const std::string garbage = error_of({{"ZEROALLOC_MEMORY_LIMIT", "lots"}});
  EXPECT_NE(garbage.find("ZEROALLOC_MEMORY_LIMIT='lots' is not valid"), std::string::npos)
      << garbage;
  EXPECT_NE(garbage.find("512MiB"), std::string::npos) << garbage;

  EXPECT_NE(error_of({{"ZEROALLOC_MEMORY_LIMIT", "-1GB"}}).find("ZEROALLOC_MEMORY_LIMIT='-1GB'"),
            std::string::npos);
  EXPECT_NE(error_of({{"ZEROALLOC_MEMORY_LIMIT", "1.7"}}).find("between 0 and 1"),
            std::string::npos);
  EXPECT_NE(error_of({{"ZEROALLOC_MEMORY_LIMIT", "0"}}).find("ZEROALLOC_MEMORY_LIMIT='0'"),
            std::string::npos);
  EXPECT_NE(error_of({{"ZEROALLOC_CHUNK_SIZE", "3MiB"}}).find("multiple of 2MiB"),
            std::string::npos);
  EXPECT_NE(error_of({{"ZEROALLOC_CHUNK_SIZE", "99999999999999TiB"}}).find("ZEROALLOC_CHUNK_SIZE="),
            std::string::npos);
  EXPECT_NE(error_of({{"ZEROALLOC_DEVICE", "tpu"}}).find("one of auto|cuda|sim"),
            std::string::npos);
  EXPECT_NE(error_of({{"ZEROALLOC_SIM_DEVICES", "-2"}}).find("whole number"), std::string::npos);
  // As many simulated devices as the library drives, and no more (one more was accepted, then
  // every allocation on it failed).
  EXPECT_EQ(parse_with({{"ZEROALLOC_SIM_DEVICES", "64"}}).sim_device_count, 64);
  EXPECT_NE(error_of({{"ZEROALLOC_SIM_DEVICES", "65"}}).find("from 1 to 64"), std::string::npos);
  EXPECT_NE(error_of({{"ZEROALLOC_LOG_LEVEL", "loud"}}).find("trace|debug|info|warn|error|off"),
            std::string::npos);
}

TEST(Options, EmptyValueIsRefusedNotTreatedAsUnset) {
  const std::string message = error_of({{"ZEROALLOC_MEMORY_LIMIT", ""}});
  EXPECT_NE(message.find("ZEROALLOC_MEMORY_LIMIT is set but empty"), std::string::npos) << message;
}

TEST(Options, UnknownZeroallocVariableIsRefused) {
  const std::string message = error_of({{"ZEROALLOC_MEMORY_LIMT", "1GB"}});
  EXPECT_NE(message.find("ZEROALLOC_MEMORY_LIMT is not a zeroalloc variable"), std::string::npos)
      << message;
}

TEST(Options, EveryVariableHasHelpAndAnAcceptedDefault) {
  for (const option_spec& spec : option_table()) {
    EXPECT_FALSE(spec.help.empty()) << spec.name;
  }
  EXPECT_NO_THROW(parse_with({}));
}

// ZEROALLOC_DISABLE (the hooks), ZEROALLOC_TORCH (the Python package): read elsewhere, but a
// bad value stops the start here too, named with the value as it was written.
TEST(Options, VariablesReadElsewhereAreCheckedToo) {
  EXPECT_NE(error_of({{"ZEROALLOC_DISABLE", "perhaps"}}).find("ZEROALLOC_DISABLE='perhaps'"),
            std::string::npos);
  EXPECT_NE(error_of({{"ZEROALLOC_TORCH", "both"}}).find("one of native|zeroalloc"),
            std::string::npos);
  EXPECT_NO_THROW(parse_with({{"ZEROALLOC_TORCH", " ZeroAlloc "}, {"ZEROALLOC_DISABLE", "on"}}));
  EXPECT_NE(
      error_of({{"ZEROALLOC_MEMORY_LIMIT", " lots "}}).find("ZEROALLOC_MEMORY_LIMIT=' lots '"),
      std::string::npos);
  EXPECT_NE(error_of({{"ZEROALLOC_HOST_STEP", "sometimes"}}).find("ZEROALLOC_HOST_STEP="),
            std::string::npos);
  EXPECT_NE(error_of({{"ZEROALLOC_MASTER_WEIGHTS", "fp16"}}).find("one of none|bf16"),
            std::string::npos);
}

// docs/settings.md (python -m zeroalloc settings) lists the variables the library reads (its
// rows begin "| `ZEROALLOC_"): the same, in the table's order, with the same defaults. A
// default the table leaves empty reads as words there ("unset"), never as a value. The page
// is generated: regenerate it when the table changes.
TEST(Options, TheSettingsPageListsEveryVariableWithItsDefault) {
  std::ifstream readme(ZEROALLOC_SETTINGS_PAGE);
  ASSERT_TRUE(readme) << "cannot read " << ZEROALLOC_SETTINGS_PAGE;
  struct row {
    std::string name;
    std::string default_column;
  };
  std::vector<row> listed;
  for (std::string line; std::getline(readme, line);) {
    if (line.rfind("| `ZEROALLOC_", 0) != 0) continue;
    const std::size_t name_end = line.find('`', 3);
    const std::size_t column = line.find('|', name_end);
    const std::size_t column_end = line.find('|', column + 1);
    ASSERT_NE(column_end, std::string::npos) << line;
    std::string cell = line.substr(column + 1, column_end - column - 1);
    cell.erase(0, cell.find_first_not_of(' '));
    cell.erase(cell.find_last_not_of(' ') + 1);
    listed.push_back({line.substr(3, name_end - 3), cell});
  }
  std::vector<std::string> table_names;
  std::vector<std::string> readme_names;
  for (const option_spec& spec : option_table()) table_names.emplace_back(spec.name);
  for (const row& each : listed) readme_names.push_back(each.name);
  ASSERT_EQ(readme_names, table_names)
      << "docs/settings.md and the options table list different variables, or in another order "
         "(regenerate it: python -m zeroalloc settings > docs/settings.md)";
  for (std::size_t i = 0; i < listed.size(); ++i) {
    const option_spec& spec = option_table()[i];
    if (spec.default_value.empty()) {
      EXPECT_EQ(listed[i].default_column.find('`'), std::string::npos)
          << spec.name << " has no default, but docs/settings.md gives "
          << listed[i].default_column;
    } else {
      EXPECT_EQ(listed[i].default_column, "`" + std::string(spec.default_value) + "`") << spec.name;
    }
  }
}

}  // namespace
}  // namespace zeroalloc
