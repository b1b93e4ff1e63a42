// questkv probe in-process on tiny sizes: exit codes, the JSON fields, the
// table's rows, the page size derived from a geometry.
#include <gtest/gtest.h>

#include <cstdio>
#include <string>
#include <vector>

#include "tools/cli/commands.h"
#include "tests/tools/cli_test_files.h"

namespace questkv {
namespace {

using test::ScratchDir;

using test::Outcome;

Outcome Probe(std::vector<std::string> args) { return test::RunCommand(cli::ProbeMain, "probe", std::move(args)); }

// Small enough to finish in about a second on two cores.
std::vector<std::string> Tiny(const ScratchDir& dir, std::vector<std::string> more = {}) {
  std::vector<std::string> args = {"--disk-dir",     dir / "probe", "--disk-file-bytes", "64M", "--seconds", "0.1",
                                   "--memcpy-bytes", "8M",          "--gpu-bytes",       "8M"};
  args.insert(args.end(), more.begin(), more.end());
  return args;
}

TEST(ProbeCmd, JsonHasEveryField) {
  ScratchDir dir;
  const Outcome o = Probe(Tiny(dir, {"--json"}));
  ASSERT_EQ(o.code, 0) << o.err << o.out;
  const std::string& json = o.out;
  EXPECT_EQ(json.front(), '{');
  EXPECT_EQ(json.substr(json.size() - 2), "}\n");
  for (const char* key :
       {"\"command\":\"probe\"", "\"topology\":{\"summary\":", "\"numa_nodes\":", "\"nodes\":[{\"os_index\":",
        "\"memory_bytes\":", "\"gpus\":[", "\"block_devices\":[", "\"settings\":{", "\"page_bytes\":16384",
        "\"queue_depth\":64", "\"seconds\":0.1", "\"disk_file_bytes\":67108864", "\"memcpy\":{",
        "\"single_thread_gb_per_s\":", "\"all_threads_gb_per_s\":", "\"disk\":{\"block_bytes\":16384",
        "\"host_gpu\":{\"available\":"})
    EXPECT_NE(json.find(key), std::string::npos) << key << " missing in " << json;
  // Each disk figure, or why it is missing (io_uring may be unavailable).
  for (const char* key : {"\"raw_uring_gb_per_s", "\"raw_uring_touched_gb_per_s", "\"tier_uring_gb_per_s",
                          "\"tier_pread_gb_per_s", "\"tier_write_gb_per_s"})
    EXPECT_NE(json.find(key), std::string::npos) << key << " missing in " << json;
  if (json.find("\"available\":false") != std::string::npos) {
    EXPECT_NE(json.find("\"reason\":\""), std::string::npos) << json;
    EXPECT_NE(json.find("\"h2d_gb_per_s_error\":\"no GPU\""), std::string::npos) << json;
  } else {
    EXPECT_NE(json.find("\"gpu0_h2d_gb_per_s\":"), std::string::npos) << json;
  }
}

TEST(ProbeCmd, TableHasTopologyThenEveryRow) {
  ScratchDir dir;
  const Outcome o = Probe(Tiny(dir));
  ASSERT_EQ(o.code, 0) << o.err << o.out;
  for (const char* text : {"NUMA node", "node 0:", "measurement", "GB/s", "host memcpy, 1 thread",
                           "host memcpy, all ",
                           "disk read, raw io_uring", "disk read, disk tier over io_uring",
                           "disk read, disk tier over pread pool", "GPU"})
    EXPECT_NE(o.out.find(text), std::string::npos) << text << " missing in\n" << o.out;
  EXPECT_LT(o.out.find("NUMA node"), o.out.find("measurement"));
}

TEST(ProbeCmd, PageBytesComeFromTheGeometry) {
  ScratchDir dir;
  // 2 (K,V) x 8 heads x 16 tokens x 128 dims x 2 bytes.
  const Outcome o = Probe(Tiny(dir, {"--json", "--kv-heads", "8", "--head-dim", "128", "--dtype", "f16"}));
  ASSERT_EQ(o.code, 0) << o.err << o.out;
  EXPECT_NE(o.out.find("\"page_bytes\":65536"), std::string::npos) << o.out;
  const Outcome p = Probe(Tiny(dir, {"--json", "--page-bytes", "64K"}));
  ASSERT_EQ(p.code, 0) << p.err << p.out;
  EXPECT_NE(p.out.find("\"page_bytes\":65536"), std::string::npos) << p.out;
}

TEST(ProbeCmd, BadFlagsAreUsageErrors) {
  const std::vector<std::vector<std::string>> bad = {
      {"--no-such-flag"},
      {"--seconds", "0"},
      {"--seconds", "fast"},
      {"--seconds", "-1"},
      {"--seconds", " 0.1"},
      {"--seconds", "+0.1"},
      {"--queue-depth", " 8"},
      {"--disk-file-bytes", "16777216T"},
      {"--queue-depth", "0"},
      {"--page-bytes", "16K", "--kv-heads", "4"},
      {"--page-bytes", "0"},
      {"--dtype", "f8"},
      {"--disk-file-bytes", "4K"},
      {"--memcpy-bytes", "1K"},
      {"stray"},
  };
  for (const auto& args : bad) {
    const Outcome o = Probe(args);
    EXPECT_EQ(o.code, 2) << args[0] << ": " << o.err;
    EXPECT_FALSE(o.err.empty()) << args[0];
    EXPECT_TRUE(o.out.empty()) << args[0];
  }
}

TEST(ProbeCmd, HelpListsTheFlags) {
  const Outcome o = Probe({"--help"});
  EXPECT_EQ(o.code, 0);
  for (const char* flag : {"--disk-dir", "--disk-file-bytes", "--page-bytes", "--queue-depth", "--seconds", "--json"})
    EXPECT_NE(o.out.find(flag), std::string::npos) << flag;
}

}  // namespace
}  // namespace questkv
