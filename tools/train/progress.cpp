#include "train/progress.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>

#include "train/trainer.h"

namespace apex::train {

Progress::Progress(std::string label, int64_t first_step, int64_t total_steps, bool enabled)
    : label_(std::move(label)),
      first_(first_step),
      total_(std::max<int64_t>(total_steps, first_step + 1)),
      enabled_(enabled),
      tty_(isatty(STDERR_FILENO) != 0) {}

void Progress::update(const StepRecord& r) {
  if (!enabled_) return;
  const double done = static_cast<double>(r.step) / static_cast<double>(total_);
  // Elapsed time counts from this process's first step (a resumed run starts later).
  const double run_done =
      static_cast<double>(r.step - first_) / static_cast<double>(total_ - first_);
  const double eta = run_done > 0 ? r.elapsed_s * (1.0 - run_done) / run_done : 0.0;
  const int eta_s = static_cast<int>(eta + 0.5);
  if (tty_) {
    constexpr int kWidth = 24;
    const int filled = static_cast<int>(done * kWidth);
    std::string bar(static_cast<size_t>(filled), '#');
    bar.resize(kWidth, '.');
    std::fprintf(
        stderr, "\r%-5s [%s] step %lld/%lld  loss %.4f  scale %-8g %8.0f samples/s  ETA %d:%02d ",
        label_.c_str(), bar.c_str(), static_cast<long long>(r.step), static_cast<long long>(total_),
        r.loss, r.loss_scale, r.samples_per_s, eta_s / 60, eta_s % 60);
    open_ = true;
  } else {
    std::fprintf(stderr, "%s step %lld/%lld loss %.4f scale %g %.0f samples/s eta %ds\n",
                 label_.c_str(), static_cast<long long>(r.step), static_cast<long long>(total_),
                 r.loss, r.loss_scale, r.samples_per_s, eta_s);
  }
  std::fflush(stderr);
}

void Progress::finish() {
  if (open_) std::fprintf(stderr, "\n");
  open_ = false;
}

}  // namespace apex::train
