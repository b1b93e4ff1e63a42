// Subcommands of the `questkv` CLI. Each takes the arguments after its name
// (argv[0] is the subcommand) and returns the process exit code: 0 success,
// 1 runtime failure, 2 usage error. Messages go to stderr, results to stdout.
#pragma once

namespace questkv::cli {

int RunMain(int argc, char** argv);     // questkv run
int AttendMain(int argc, char** argv);  // questkv attend
int ProbeMain(int argc, char** argv);   // questkv probe

}  // namespace questkv::cli
