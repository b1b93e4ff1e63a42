// Subcommands of the `questkv` CLI. Each takes the arguments after its name
// (argv[0] is the subcommand) and returns the process exit code: 0 success,
// 1 runtime failure, 2 usage error. Messages go to stderr, results to stdout.
#pragma once

namespace questkv::cli {

int RunMain(int argc, char** argv);     // questkv run
int AttendMain(int argc, char** argv);  // questkv attend
int ProbeMain(int argc, char** argv);   // questkv probe

// Runs a subcommand's main; an exception escaping it (std::bad_alloc above
// all: an allocation no status reports) becomes a message on stderr naming
// the command, and exit code 1 instead of std::terminate's abort.
int GuardedMain(const char* name, int (*main_fn)(int, char**), int argc, char** argv);

// The whole of `questkv`: argv[1] names the subcommand, run guarded.
int Main(int argc, char** argv);

}  // namespace questkv::cli
