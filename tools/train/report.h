#pragma once

// apex-train's outputs for people: the side-by-side table of --compare and the SVG loss chart.

#include <string>
#include <vector>

#include "train/trainer.h"

namespace apex::train {

/// The comparison table: samples/s, speed-up over the first row, peak memory, final train loss,
/// held-out accuracy, skipped steps, final loss scale. `speedups`, where given (one per run), is
/// printed in place of samples/s over the first row's (the medians of --rounds).
std::string compare_table(const std::vector<Summary>& runs,
                          const std::vector<double>& speedups = {});

/// An SVG chart of the train-loss curves of every run, one polyline per level, with axes and a
/// legend; written atomically (write_file_atomic).
void write_svg(const std::string& path, const std::vector<Summary>& runs);

}  // namespace apex::train
