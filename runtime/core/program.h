// What the main() functions of the fp8rt programs share, so that every program answers --help and
// bad flags the same way and sets the process-wide library settings in one place.
//
// Defines:
//   ParseCommandLine               parses argv into a CLI11 App with the house exit codes.
//   DisableMutexDeadlockDetection  turns off Abseil's Mutex deadlock detection in the process.
//
// Both are for main() only, before any other thread starts.
#ifndef FP8RT_RUNTIME_CORE_PROGRAM_H_
#define FP8RT_RUNTIME_CORE_PROGRAM_H_

#include <optional>

#include "CLI/CLI.hpp"

namespace fp8rt {

// Parses the command line into `app`. Returns std::nullopt when the program goes on, or the exit
// status main() returns when parsing ended it: 0 after --help (the help printed on stdout), 2 for
// any other CLI11 parse exception, e.g. an unknown or missing flag (CLI::App::exit prints it).
[[nodiscard]] std::optional<int> ParseCommandLine(CLI::App& app, int argc, const char* const* argv);

// Debian's Abseil is built without NDEBUG, which leaves Mutex deadlock detection on: a global lock
// and a graph update in every Lock, ours and gRPC's (GraphCycles was the controller's hottest
// user-space code under `fp8rt bench controller`). The thread annotations check our lock order
// instead. For the programs that run gRPC (fp8rt-controller, and its load generator so that the
// client spends as little of the shared CPUs as it can).
void DisableMutexDeadlockDetection();

}  // namespace fp8rt

#endif  // FP8RT_RUNTIME_CORE_PROGRAM_H_
