#pragma once

// Training progress: a bar redrawn in place on a terminal, plain periodic lines otherwise.

#include <cstdint>
#include <string>

namespace apex::train {

struct StepRecord;

class Progress {
 public:
  /// Steps first_step..total_steps (first_step > 0 after a resume). enabled false: silent. The
  /// bar goes to stderr when stderr is a terminal.
  Progress(std::string label, int64_t first_step, int64_t total_steps, bool enabled);
  void update(const StepRecord& r);
  /// Ends the bar's line (idempotent).
  void finish();

 private:
  std::string label_;
  int64_t first_;
  int64_t total_;
  bool enabled_;
  bool tty_;
  bool open_ = false;
};

}  // namespace apex::train
