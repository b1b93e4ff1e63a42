// questkv: the command-line front end. Dispatches to a subcommand.
#include <cstdio>
#include <cstring>

#include "runtime/cli/commands.h"

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

int main(int argc, char** argv) {
  if (argc < 2) {
    Usage(stderr);
    return 2;
  }
  const char* cmd = argv[1];
  if (!std::strcmp(cmd, "run")) return questkv::cli::RunMain(argc - 1, argv + 1);
  if (!std::strcmp(cmd, "attend")) return questkv::cli::AttendMain(argc - 1, argv + 1);
  if (!std::strcmp(cmd, "probe")) return questkv::cli::ProbeMain(argc - 1, argv + 1);
  if (!std::strcmp(cmd, "--help") || !std::strcmp(cmd, "help")) {
    Usage(stdout);
    return 0;
  }
  std::fprintf(stderr, "questkv: unknown command '%s'\n", cmd);
  Usage(stderr);
  return 2;
}
