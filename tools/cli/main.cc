// questkv: the command-line front end (dispatch.cc holds the dispatch, so
// tests can call it in-process).
#include "tools/cli/commands.h"

int main(int argc, char** argv) { return questkv::cli::Main(argc, argv); }
