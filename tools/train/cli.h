#pragma once

// apex-train's command line: flags into TrainOptions, with one-line errors for bad input.

#include <string>
#include <vector>

#include "train/trainer.h"

namespace apex::train {

struct Cli {
  TrainOptions train;
  std::vector<std::string> compare;  ///< levels to run side by side; empty: one run
  /// --rounds: how many times --compare runs its levels (in rotating order; medians reported).
  int64_t rounds = 1;
  std::string plot;         ///< SVG path
  std::string summary_out;  ///< (internal) where a --compare child writes its summary
  bool help = false;
  /// --nproc: ranks to start on this machine (0: none; train in this process).
  int64_t nproc = 0;
  /// The arguments as given (for --nproc's ranks).
  std::vector<std::string> args;
  /// Said before training when the built-in default was narrowed (see parse_cli); else empty.
  std::string note;
  /// The arguments every --compare child gets (all but --compare/--opt-level/--plot/--metrics/
  /// --checkpoint, which the parent sets per level).
  std::vector<std::string> child_args;
};

/// Parses argv[1..]. No arguments: --model transformer --compare O0,O1,O2 on built-in data.
/// Throws c10::Error "apex-train: ..." on unknown flags or values.
Cli parse_cli(const std::vector<std::string>& args);

/// --help text: every flag with its default.
std::string usage();

}  // namespace apex::train
