// A run's summary line (trainer.h), written as JSON by every run and read back by --compare.
#include <sstream>
#include <string>

#include "train/json.h"
#include "train/trainer.h"

namespace apex::train {

std::string to_json(const Summary& s) {
  std::ostringstream out;
  out << "{\"summary\": true, \"level\": " << json::quote(s.level)
      << ", \"model\": " << json::quote(s.model) << ", \"steps\": " << s.steps
      << ", \"samples\": " << s.samples << ", \"train_seconds\": " << json::num(s.train_seconds)
      << ", \"samples_per_s\": " << json::num(s.samples_per_s)
      << ", \"final_loss\": " << json::num(s.final_loss)
      << ", \"test_loss\": " << json::num(s.test_loss)
      << ", \"test_accuracy\": " << json::num(s.test_accuracy)
      << ", \"skipped_steps\": " << s.skipped_steps
      << ", \"loss_scale\": " << json::num(s.loss_scale)
      << ", \"peak_rss_mb\": " << json::num(s.peak_rss_mb)
      << ", \"optimizer_state_mb\": " << json::num(s.optimizer_state_mb)
      << ", \"world_size\": " << s.world_size
      << ", \"ddp_backward_compute_ms\": " << json::num(s.ddp_backward_compute_ms)
      << ", \"ddp_backward_comm_ms\": " << json::num(s.ddp_backward_comm_ms)
      << ", \"ddp_overlap_ms\": " << json::num(s.ddp_overlap_ms)
      << ", \"ddp_buckets\": " << s.ddp_buckets << "}";
  return out.str();
}

Summary summary_from_json(const std::string& line) {
  Summary s;
  s.level = json::get_string(line, "level");
  s.model = json::get_string(line, "model");
  s.steps = static_cast<int64_t>(json::get_number(line, "steps"));
  s.samples = static_cast<int64_t>(json::get_number(line, "samples"));
  s.train_seconds = json::get_number(line, "train_seconds");
  s.samples_per_s = json::get_number(line, "samples_per_s");
  s.final_loss = json::get_number(line, "final_loss");
  s.test_loss = json::get_number(line, "test_loss");
  s.test_accuracy = json::get_number(line, "test_accuracy");
  s.skipped_steps = static_cast<int64_t>(json::get_number(line, "skipped_steps"));
  s.loss_scale = json::get_number(line, "loss_scale");
  s.peak_rss_mb = json::get_number(line, "peak_rss_mb");
  s.optimizer_state_mb = json::get_number(line, "optimizer_state_mb");
  s.world_size = static_cast<int64_t>(json::get_number(line, "world_size"));
  s.ddp_backward_compute_ms = json::get_number(line, "ddp_backward_compute_ms");
  s.ddp_backward_comm_ms = json::get_number(line, "ddp_backward_comm_ms");
  s.ddp_overlap_ms = json::get_number(line, "ddp_overlap_ms");
  s.ddp_buckets = static_cast<int64_t>(json::get_number(line, "ddp_buckets"));
  return s;
}

}  // namespace apex::train
