// Running out of memory is an error message and exit code 1, never an
// abort: the questkv binary under an address-space limit reads a valid
// 2 GiB .npy file (sparse, so it costs no disk), and the command boundary
// turns an escaping exception into a message.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <new>
#include <stdexcept>
#include <string>
#include <vector>

#include "tools/cli/commands.h"
#include "tools/npy.h"
#include "tests/tools/cli_test_files.h"

namespace questkv {
namespace {

using test::ScratchDir;

// The questkv binary beside this test's build folder (CMake puts it at the
// top of the build tree, tests in tests/).
std::string QuestkvBinary() {
  std::error_code ec;
  const std::filesystem::path self = std::filesystem::read_symlink("/proc/self/exe", ec);
  return ec ? std::string() : (self.parent_path().parent_path() / "questkv").string();
}

// A valid .npy file of `shape` whose data is a hole: its size costs no disk.
void WriteSparseNpy(const std::string& path, const std::string& descr, const std::string& shape, uint64_t data_bytes) {
  const std::string head = test::NpyFile(descr, shape, "");
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  ASSERT_GE(fd, 0) << path;
  ASSERT_EQ(::write(fd, head.data(), head.size()), ssize_t(head.size()));
  ASSERT_EQ(::ftruncate(fd, off_t(head.size() + data_bytes)), 0);
  ::close(fd);
}

struct Exit {
  bool exited = false;
  int code = -1, signal = 0;
  std::string err;
};

// Runs `binary args...` with RLIMIT_AS at `limit_bytes`, stderr captured.
Exit RunLimited(const std::string& binary, const std::vector<std::string>& args, rlim_t limit_bytes,
                const std::string& err_path) {
  const pid_t pid = ::fork();
  if (pid == 0) {
    const int err = ::open(err_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    const int null = ::open("/dev/null", O_WRONLY);
    if (err < 0 || null < 0 || ::dup2(err, 2) < 0 || ::dup2(null, 1) < 0) ::_exit(120);
    const rlimit lim{limit_bytes, limit_bytes};
    if (::setrlimit(RLIMIT_AS, &lim) != 0) ::_exit(121);
    std::vector<char*> argv = {const_cast<char*>(binary.c_str())};
    for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    ::execv(binary.c_str(), argv.data());
    ::_exit(122);
  }
  Exit e;
  int status = 0;
  if (pid < 0 || ::waitpid(pid, &status, 0) != pid) return e;
  e.exited = WIFEXITED(status);
  e.code = e.exited ? WEXITSTATUS(status) : -1;
  e.signal = WIFSIGNALED(status) ? WTERMSIG(status) : 0;
  e.err = test::ReadBytes(err_path);
  return e;
}

TEST(OutOfMemory, AttendOnKeysLargerThanTheLimitExitsOneWithAMessage) {
#if defined(__SANITIZE_ADDRESS__)
  GTEST_SKIP() << "AddressSanitizer reserves terabytes of address space; RLIMIT_AS cannot apply";
#endif
  const std::string binary = QuestkvBinary();
  ASSERT_TRUE(std::filesystem::exists(binary)) << "build the questkv target: expected the binary at " << binary;
  ScratchDir dir;
  const std::string k = dir / "k.npy", v = dir / "v.npy", q = dir / "q.npy", o = dir / "o.npy";
  const uint64_t k_bytes = uint64_t(2) << 30;  // [2, 524288, 512] float32
  WriteSparseNpy(k, "<f4", "(2, 524288, 512)", k_bytes);
  WriteSparseNpy(v, "<f4", "(2, 524288, 512)", k_bytes);
  ASSERT_TRUE(WriteNpyF32(q, std::vector<int64_t>{2, 512}, std::vector<float>(2 * 512, 1.f)).ok());
  const rlim_t limit = rlim_t(1) << 30;
  const std::vector<std::string> args = {"attend", "--keys", k, "--values", v, "--query", q, "--page-size", "16",
                                         "--token-budget", "64", "--output", o};
  Exit e = RunLimited(binary, args, limit, dir / "err.txt");
  ASSERT_TRUE(e.exited) << "killed by signal " << e.signal << "; stderr: " << e.err;
  EXPECT_EQ(e.code, 1) << e.err;
  EXPECT_NE(e.err.find("out of memory reading " + k + " (2147483648 bytes"), std::string::npos) << e.err;
  EXPECT_FALSE(std::filesystem::exists(o));

  // float16 keys widen to float32: 1 GiB on disk asks for 2 GiB.
  WriteSparseNpy(k, "<f2", "(2, 524288, 512)", k_bytes / 2);
  e = RunLimited(binary, args, limit, dir / "err.txt");
  ASSERT_TRUE(e.exited) << "killed by signal " << e.signal << "; stderr: " << e.err;
  EXPECT_EQ(e.code, 1) << e.err;
  EXPECT_NE(e.err.find("out of memory reading " + k + " (2147483648 bytes"), std::string::npos) << e.err;
}

int ThrowsBadAlloc(int, char**) { throw std::bad_alloc(); }
int ThrowsRuntimeError(int, char**) { throw std::runtime_error("widget jammed"); }
int ThrowsInt(int, char**) { throw 7; }
int ReturnsThree(int, char**) { return 3; }

TEST(OutOfMemory, CommandBoundaryTurnsExceptionsIntoExitOne) {
  const std::vector<std::pair<int (*)(int, char**), std::string>> cases = {
      {ThrowsBadAlloc, "questkv attend: out of memory"},
      {ThrowsRuntimeError, "questkv attend: internal error: widget jammed"},
      {ThrowsInt, "questkv attend: internal error: an unknown exception"}};
  for (const auto& [fn, needle] : cases) {
    testing::internal::CaptureStderr();
    char name[] = "attend";
    char* argv[] = {name, nullptr};
    const int code = cli::GuardedMain("attend", fn, 1, argv);
    const std::string err = testing::internal::GetCapturedStderr();
    EXPECT_EQ(code, 1) << needle;
    EXPECT_NE(err.find(needle), std::string::npos) << err;
  }
  char name[] = "attend";
  char* argv[] = {name, nullptr};
  EXPECT_EQ(cli::GuardedMain("attend", ReturnsThree, 1, argv), 3);
}

}  // namespace
}  // namespace questkv
