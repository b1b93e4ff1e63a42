// questkv's dispatch to a subcommand, and the boundary no exception crosses.
#include <cstdio>
#include <cstring>
#include <exception>
#include <new>

#include "tools/cli/commands.h"

namespace questkv::cli {

namespace {
void Usage(FILE* out) {
  std::fprintf(out,
               "usage: questkv <command> [flags]\n"
               "  run      long-context decode workload: selection, sparse attention, recall, traffic\n"
               "  attend   replay one decode query over K/V from .npy files\n"
               "  probe    topology, and host memory, disk and host<->GPU bandwidth\n"
               "'questkv <command> --help' lists a command's flags.\n");
}
}  // namespace

int GuardedMain(const char* name, int (*main_fn)(int, char**), int argc, char** argv) {
  try {
    return main_fn(argc, argv);
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr, "questkv %s: out of memory (an allocation failed; compare the inputs' sizes with the "
                         "memory available and ulimit -v)\n", name);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "questkv %s: internal error: %s\n", name, e.what());
  } catch (...) {
    std::fprintf(stderr, "questkv %s: internal error: an unknown exception\n", name);
  }
  return 1;
}

int Main(int argc, char** argv) {
  if (argc < 2) {
    Usage(stderr);
    return 2;
  }
  const char* cmd = argv[1];
  if (!std::strcmp(cmd, "run")) return GuardedMain(cmd, RunMain, argc - 1, argv + 1);
  if (!std::strcmp(cmd, "attend")) return GuardedMain(cmd, AttendMain, argc - 1, argv + 1);
  if (!std::strcmp(cmd, "probe")) return GuardedMain(cmd, ProbeMain, argc - 1, argv + 1);
  if (!std::strcmp(cmd, "--help") || !std::strcmp(cmd, "help")) {
    Usage(stdout);
    return 0;
  }
  std::fprintf(stderr, "questkv: unknown command '%s'\n", cmd);
  Usage(stderr);
  return 2;
}

}  // namespace questkv::cli
