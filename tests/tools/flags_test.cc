// The CLI's flag parser: sizes that would wrap past 64 bits and integers with
// spaces or a '+' are refused with a message naming the flag and the value.
#include "tools/cli/flags.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "tools/cli/commands.h"
#include "tests/tools/cli_test_files.h"

namespace questkv::cli {
namespace {

// Flags parsed from {"cmd", "--name", value}.
Flags ParseOne(const std::string& name, const std::string& value) {
  Flags f({"n", "x", "list", "size"}, {});
  std::vector<std::string> args = {"cmd", "--" + name, value};
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  EXPECT_TRUE(f.Parse(int(argv.size()), argv.data()).ok());
  return f;
}

void ExpectRefused(const Status& s, const std::string& flag, const std::string& value) {
  EXPECT_EQ(s.code(), Code::kInvalidArgument) << flag << " " << value;
  EXPECT_NE(s.message().find("--" + flag), std::string::npos) << s.message();
  EXPECT_NE(s.message().find(value), std::string::npos) << s.message();
}

TEST(Flags, SizesThatWrapPast64BitsAreRefused) {
  for (const char* text : {"16777216T", "17179869184G", "8388608T", "8589934592G", "9007199254740992K",
                           "18446744073709551615", "18446744073709551616", "99999999999999999999T"}) {
    Result<uint64_t> r = ParseOne("size", text).Bytes("size", 0);
    ASSERT_FALSE(r.ok()) << text << " parsed as " << *r;
    ExpectRefused(r.status(), "size", text);
  }
}

TEST(Flags, SizesUpToTheLimitAreExact) {
  const std::vector<std::pair<std::string, uint64_t>> cases = {
      {"0", 0},
      {"0T", 0},
      {"1", 1},
      {"16k", 16u << 10},
      {"3M", 3u << 20},
      {"2G", uint64_t(2) << 30},
      {"8388607T", uint64_t(8388607) << 40},
      {"9223372036854775807", uint64_t(9223372036854775807)},
      {"9007199254740991K", uint64_t(9007199254740991) << 10},
  };
  for (const auto& [text, want] : cases) {
    Result<uint64_t> r = ParseOne("size", text).Bytes("size", 7);
    ASSERT_TRUE(r.ok()) << text << ": " << r.status().ToString();
    EXPECT_EQ(*r, want) << text;
  }
}

TEST(Flags, SpacesSignsAndJunkAreNotIntegers) {
  for (const char* text : {" 16", "16 ", "\t16", "16\n", "+16", "1 6", "0x10", "16.0", "-", "--1", "1e3"}) {
    Result<int64_t> i = ParseOne("n", text).Int("n", 0, -100, 100);
    ASSERT_FALSE(i.ok()) << "'" << text << "' parsed as " << *i;
    ExpectRefused(i.status(), "n", text);
    Result<std::vector<int64_t>> l = ParseOne("list", text).IntList("list", {});
    EXPECT_FALSE(l.ok()) << "'" << text << "'";
    Result<uint64_t> b = ParseOne("size", std::string(text) + "K").Bytes("size", 0);
    EXPECT_FALSE(b.ok()) << "'" << text << "K'";
  }
  for (const char* text : {"0, 1", " 0,1", "0,1 ", "0,+1", "0,,1", "0,", ",0"}) {
    Result<std::vector<int64_t>> l = ParseOne("list", text).IntList("list", {});
    ASSERT_FALSE(l.ok()) << "'" << text << "'";
    ExpectRefused(l.status(), "list", text);
  }
  for (const char* text : {" 16K", "16K ", "+16K", "16 K", "K", "16KB"}) {
    Result<uint64_t> b = ParseOne("size", text).Bytes("size", 0);
    ASSERT_FALSE(b.ok()) << "'" << text << "'";
    ExpectRefused(b.status(), "size", text);
  }
}

TEST(Flags, PlainIntegersStillParse) {
  EXPECT_EQ(*ParseOne("n", "-1").Int("n", 0, -100, 100), -1);
  EXPECT_EQ(*ParseOne("n", "0").Int("n", 5, -100, 100), 0);
  EXPECT_EQ(*ParseOne("n", "-9223372036854775808").Int("n", 0, INT64_MIN, 0), INT64_MIN);
  EXPECT_EQ(*ParseOne("list", "0,1,-1").IntList("list", {}), (std::vector<int64_t>{0, 1, -1}));
  EXPECT_TRUE(ParseOne("list", "none").IntList("list", {9})->empty());
  EXPECT_FALSE(ParseOne("n", "9223372036854775808").Int("n", 0, INT64_MIN, INT64_MAX).ok());
}

TEST(Flags, RealsAreParsedWholeAndWithinTheirRange) {
  EXPECT_EQ(*ParseOne("x", "0.25").Double("x", 1, 0, 1), 0.25);
  EXPECT_EQ(*ParseOne("x", "1e-3").Double("x", 1, 0, 1), 1e-3);
  EXPECT_EQ(*ParseOne("x", "-2").Double("x", 1, -5, 5), -2);
  EXPECT_EQ(*Flags({"x"}, {}).Double("x", 0.5, 0, 1), 0.5);  // unset: the fallback
  for (const char* text : {"", " 0.5", "0.5 ", "+0.5", "0.5x", "nan", "inf", "0,5", "1e999"}) {
    Result<double> d = ParseOne("x", text).Double("x", 0, -10, 10);
    ASSERT_FALSE(d.ok()) << "'" << text << "' parsed as " << *d;
    EXPECT_NE(d.status().message().find("--x: '" + std::string(text) + "' is not a number"), std::string::npos)
        << d.status().ToString();
  }
  Result<double> out = ParseOne("x", "1.5").Double("x", 0, 0, 1);
  ASSERT_FALSE(out.ok());
  EXPECT_NE(out.status().message().find("--x = 1.5 is outside 0..1"), std::string::npos) << out.status().ToString();
}

// End to end: sizes past the limit are usage errors of `questkv run` naming
// the flag and the value as given.
TEST(Flags, RunRefusesWrappedSizes) {
  test::Outcome r = test::RunCommand(RunMain, "run", {"--hbm-bytes", "16777216T", "--no-progress"});
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("--hbm-bytes 16777216T"), std::string::npos) << r.err;
  r = test::RunCommand(RunMain, "run", {"--disk-dir", "/nonexistent", "--disk-bytes", "17179869184G", "--no-progress"});
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("--disk-bytes 17179869184G"), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("needs --disk-bytes"), std::string::npos) << r.err;
  r = test::RunCommand(RunMain, "run", {"--page-size", " 16", "--no-progress"});
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("--page-size: ' 16' is not an integer"), std::string::npos) << r.err;
  r = test::RunCommand(RunMain, "run", {"--deadline-skip-limit", "0.1", "--no-progress"});
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("--deadline-skip-limit needs --cold-miss deadline"), std::string::npos) << r.err;
}

}  // namespace
}  // namespace questkv::cli
