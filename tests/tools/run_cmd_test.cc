// `questkv run`'s flags: defaults that adapt to a small model or a short
// context, and refusals said in the flags the user gave.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "tools/cli/commands.h"
#include "tests/tools/cli_test_files.h"

namespace questkv::cli {
namespace {

test::Outcome RunCli(std::vector<std::string> args) {
  args.push_back("--no-progress");
  return test::RunCommand(RunMain, "run", std::move(args));
}

void ExpectHas(const std::string& text, const std::string& needle) {
  EXPECT_NE(text.find(needle), std::string::npos) << "expected '" << needle << "' in: " << text;
}

// Without --dense-layers, the default {0, 1} keeps one layer sparse.
TEST(RunFlags, DefaultDenseLayersLeaveOneLayerSparse) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"1", "\"dense_layers\":[]"}, {"2", "\"dense_layers\":[0]"}, {"3", "\"dense_layers\":[0,1]"}};
  for (const auto& [layers, dense] : cases) {
    const test::Outcome r = RunCli({"--layers", layers, "--context", "64", "--steps", "2", "--json"});
    ASSERT_EQ(r.code, 0) << "--layers " << layers << ": " << r.err;
    ExpectHas(r.out, dense);
    EXPECT_EQ(r.out.find("\"samples\":0,"), std::string::npos) << "no sparse layer diagnosed: " << r.out;
  }
}

// Only a --dense-layers the user gave can name a missing layer.
TEST(RunFlags, GivenDenseLayersMustExist) {
  test::Outcome r = RunCli({"--layers", "1", "--dense-layers", "1"});
  EXPECT_EQ(r.code, 2);
  ExpectHas(r.err, "--dense-layers: 1 is not a layer of --layers 1 (0..0)");
  r = RunCli({"--layers", "1", "--dense-layers", "0", "--context", "64", "--steps", "1", "--json"});
  ASSERT_EQ(r.code, 0) << r.err;
  ExpectHas(r.out, "\"dense_layers\":[0]");
}

// --top-r unset is clipped to what the shortest context allows; set, it is
// checked against --context with a message in those terms.
TEST(RunFlags, TopRFitsAShortContext) {
  test::Outcome r = RunCli({"--context", "1", "--steps", "2", "--json"});
  ASSERT_EQ(r.code, 0) << r.err;
  ExpectHas(r.out, "\"top_r\":2,");
  r = RunCli({"--context", "20", "--batch", "3", "--steps", "1", "--json"});
  ASSERT_EQ(r.code, 0) << r.err;
  ExpectHas(r.out, "\"top_r\":7,");  // the last sequence holds 20 - 14 tokens, then one more
  r = RunCli({"--context", "1", "--steps", "2", "--top-r", "16"});
  EXPECT_EQ(r.code, 2);
  ExpectHas(r.err, "--top-r 16 is more than the 2 tokens");
  ExpectHas(r.err, "--context 1");
  EXPECT_EQ(r.err.find("top_r ="), std::string::npos) << r.err;
  r = RunCli({"--context", "1", "--steps", "2", "--top-r", "16", "--recall-every", "0", "--json"});
  EXPECT_EQ(r.code, 0) << r.err;  // nothing diagnosed, nothing to check
}

// Refusals the runtime's Config would word in its field names.
TEST(RunFlags, RefusalsNameTheFlags) {
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"--q-heads", "8", "--kv-heads", "3"}, "--q-heads 8 is not a multiple of --kv-heads 3"},
      {{"--local-pages", "0"}, "--local-pages"},
      {{"--token-budget", "16"}, "--token-budget 16 at layer 2 is 1 pages of --page-size 16"},
      {{"--layer-budgets", "1024,16,16,16"}, "--layer-budgets entry 2, 16 tokens,"},
      {{"--layer-budgets", "1024,1024"}, "--layer-budgets has 2 entries for --layers 4"},
      {{"--hbm-bytes", "100"}, "--hbm-bytes 100 holds no page"},
      {{"--host-bytes", "3K"}, "--host-bytes 3072 holds fewer than two pages"},
      {{"--context", "10", "--batch", "3"}, "--batch 3 needs --context 15 or more"},
      {{"--recall-layers", "1"}, "--recall-layers: layer 1 is dense (--dense-layers)"},
  };
  for (const auto& [args, needle] : cases) {
    const test::Outcome r = RunCli(args);
    EXPECT_EQ(r.code, 2) << args[0] << ": " << r.err;
    ExpectHas(r.err, needle);
  }
}

// --draft simulates speculative decoding: blocks verified by DecodeBlock,
// drafts accepted at random and rolled back. A tiered run (strict) prints the
// in-memory run's digest; the report counts what was drafted and kept.
TEST(RunFlags, SpeculativeDecodingThroughTieredMemoryKeepsTheDigest) {
  const std::vector<std::string> base = {"--draft", "3", "--accept-rate", "0.5", "--context", "2048", "--steps", "12",
                                         "--json"};
  test::Outcome mem = RunCli(base);
  ASSERT_EQ(mem.code, 0) << mem.err;
  std::vector<std::string> tiered = base;
  const std::string dir = ::testing::TempDir() + "questkv-spec-disk";
  for (const char* a : {"--hbm-bytes", "1M", "--host-bytes", "1M", "--disk-dir", dir.c_str(), "--disk-bytes", "64M"})
    tiered.push_back(a);
  test::Outcome disk = RunCli(tiered);
  ASSERT_EQ(disk.code, 0) << disk.err;
  auto field = [](const std::string& json, const std::string& key) {
    const auto at = json.find("\"" + key + "\":");
    EXPECT_NE(at, std::string::npos) << key << " in " << json;
    return json.substr(at, json.find_first_of(",}", at) - at);
  };
  EXPECT_EQ(field(mem.out, "output_digest"), field(disk.out, "output_digest"));
  EXPECT_EQ(field(mem.out, "drafted"), "\"drafted\":36");
  EXPECT_EQ(field(mem.out, "accepted"), field(disk.out, "accepted"));
  // Each block keeps its first token and the drafts accepted after it.
  auto count = [&](const std::string& json, const std::string& key) {
    const std::string f = field(json, key);
    return std::stoll(f.substr(f.find(':') + 1));
  };
  EXPECT_EQ(count(mem.out, "tokens"), 12 + count(mem.out, "accepted"));
  EXPECT_GT(count(mem.out, "accepted"), 0);
  EXPECT_LT(count(mem.out, "accepted"), 36);
  EXPECT_NE(field(disk.out, "disk_to_host"), "\"disk_to_host\":0") << "the tiered run never read from disk";
  // The blocks' time is their calls' time: appends, verifies, rollbacks.
  auto number = [&](const std::string& key) {
    const std::string f = field(disk.out, key);
    return std::stod(f.substr(f.find(':') + 1));
  };
  const double parts = number("append_seconds") + number("verify_seconds") + number("settle_seconds");
  EXPECT_GT(number("verify_seconds"), 0);
  EXPECT_GT(number("settle_seconds"), 0);
  EXPECT_NEAR(number("seconds"), parts, 1e-6 + 2e-5 * parts);  // (the report prints 6 digits)
  test::Outcome bad = RunCli({"--accept-rate", "0.5"});
  EXPECT_EQ(bad.code, 2);
  ExpectHas(bad.err, "--accept-rate needs --draft");
  bad = RunCli({"--draft", "2", "--accept-rate", "1.5"});
  EXPECT_EQ(bad.code, 2);
  ExpectHas(bad.err, "--accept-rate = 1.5 is outside 0..1");
}

}  // namespace
}  // namespace questkv::cli
