// The fp8rt commands that talk to fp8rt-controller (its Runs service), run inside `fp8rt`:
//
//   fp8rt runs list | runs get RUN | runs stop RUN
//   fp8rt runs token RUN [--out FILE]     a token valid for RUN only (needs the admin token)
//   fp8rt layers RUN                       the per-layer FP8 table of the latest statistics
//   fp8rt recipe get RUN | recipe set RUN [changes] [--reason TEXT]
//   fp8rt checkpoints list RUN | checkpoints save RUN
//
// Every command takes --controller HOST:PORT, --token-file F, --tls-ca F, --timeout-s S (see
// control_client.h for their defaults) and --json, which prints exactly one JSON document on
// stdout (format.h gives the mapping) instead of a table.
//
// runs list is sorted by run id; layers by layer (blocks.2 before blocks.10), then tensor
// (input, weight, grad_output), then expert, with an EXPERT column only when some site is an
// expert's. recipe set reads the newest recipe, applies the flags (--exclude replaces the list;
// --exclude-remove, then --exclude-add edit it, each repeatable or comma-separated; adding a layer
// already excluded is no change, removing one that is not excluded is an error) and sends the
// whole recipe with UpdateRecipe; without --reason the reason recorded is a summary of the
// changes. The controller validates the result (ranges, layer names). checkpoints save --json
// prints {"run_id": RUN, "save_requested": true} (the RPC's answer is empty).
//
// Exit codes: 0 done; 2 bad input (options, enum words, a recipe the controller refuses, an
// unknown run: the controller's INVALID_ARGUMENT and NOT_FOUND); 1 anything else (controller
// unreachable or refusing the token, internal errors). Errors are one line on stderr:
// `fp8rt <command>: <CODE>: <message>`.
#ifndef FP8RT_LAUNCHER_CLIENT_COMMANDS_H_
#define FP8RT_LAUNCHER_CLIENT_COMMANDS_H_

#include <string_view>

namespace fp8rt::cli {

// True for the first words of the commands above (runs, layers, recipe, checkpoints).
bool IsControlCommand(std::string_view command);

// Runs `fp8rt <command> ...` (argv[0] is fp8rt, argv[1] the command); returns the exit code.
int RunControlCommand(int argc, char** argv);

// The commands' lines of `fp8rt help`.
extern const char kControlCommandsUsage[];

}  // namespace fp8rt::cli

#endif  // FP8RT_LAUNCHER_CLIENT_COMMANDS_H_
