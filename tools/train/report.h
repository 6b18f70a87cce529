#pragma once

// apex-train's outputs for people: the side-by-side table of --compare and the SVG loss chart.

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "train/trainer.h"

namespace apex::train {

/// The comparison table: samples/s, speed-up over the first row, peak memory, final train loss,
/// held-out accuracy, skipped steps, final loss scale. `speedups`, where given (one per run), is
/// printed in place of samples/s over the first row's (the medians of --rounds).
std::string compare_table(const std::vector<Summary>& runs,
                          const std::vector<double>& speedups = {});

/// Samples/s of several levels timed in rounds (apex-train --compare --rounds, apex-bench train
/// --rounds): [level][round] rates, and each over level 0's of the same round.
struct Rounds {
  std::vector<std::vector<double>> rate;
  std::vector<std::vector<double>> ratio;
  double median_rate(size_t level) const;   ///< of two middle values, their mean
  double median_ratio(size_t level) const;  ///< likewise
};

/// Runs every one of `levels` levels once per round (run(level) returns its samples/s), each round
/// starting one level later, so that no level always runs first or right after the same one (a
/// machine that drifts between rounds moves both sides of a round's ratio alike); after_round,
/// where given, sees the rounds so far after each.
Rounds run_in_rounds(size_t levels, int64_t rounds, const std::function<double(size_t)>& run,
                     const std::function<void(int64_t, const Rounds&)>& after_round = {});

/// An SVG chart of the train-loss curves of every run, one polyline per level, with axes and a
/// legend; written atomically (write_file_atomic).
void write_svg(const std::string& path, const std::vector<Summary>& runs);

}  // namespace apex::train
