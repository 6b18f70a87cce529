#include "train/json.h"

#include <c10/util/Exception.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <sstream>

#include "train/trainer.h"

namespace apex::train::json {

std::string quote(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof(buf), "\\u%04x", c);
          out += buf;
        } else {
          out += c;
        }
    }
  }
  return out + "\"";
}

std::string num(double v) {
  if (!std::isfinite(v)) return "null";
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.10g", v);
  return buf;
}

namespace {
// Position just after `"key":` and any spaces.
size_t value_pos(const std::string& object, const std::string& key) {
  const std::string pattern = quote(key) + ":";
  const size_t at = object.find(pattern);
  TORCH_CHECK(at != std::string::npos, "apex-train: JSON record has no \"", key,
              "\": ", object.substr(0, 80));
  size_t p = at + pattern.size();
  while (p < object.size() && object[p] == ' ') ++p;
  return p;
}
}  // namespace

std::string get_string(const std::string& object, const std::string& key) {
  size_t p = value_pos(object, key);
  TORCH_CHECK(p < object.size() && object[p] == '"', "apex-train: JSON \"", key,
              "\" is not a string");
  std::string out;
  for (++p; p < object.size() && object[p] != '"'; ++p) {
    if (object[p] == '\\' && p + 1 < object.size()) {
      ++p;
      if (object[p] == 'u' && p + 4 < object.size()) {
        // Only what quote() writes: \u00XX for control characters.
        out += static_cast<char>(std::strtol(object.substr(p + 1, 4).c_str(), nullptr, 16));
        p += 4;
      } else {
        out += object[p] == 'n' ? '\n' : object[p] == 't' ? '\t' : object[p];
      }
    } else {
      out += object[p];
    }
  }
  TORCH_CHECK(p < object.size(), "apex-train: JSON \"", key, "\" is an unterminated string");
  return out;
}

double get_number(const std::string& object, const std::string& key) {
  const size_t p = value_pos(object, key);
  if (object.compare(p, 4, "null") == 0) return std::nan("");
  char* end = nullptr;
  const double v = std::strtod(object.c_str() + p, &end);
  TORCH_CHECK(end != object.c_str() + p, "apex-train: JSON \"", key, "\" is not a number");
  return v;
}

std::string step_record(const std::string& level, const StepRecord& r) {
  std::ostringstream out;
  out << "{\"level\": " << quote(level) << ", \"step\": " << r.step << ", \"loss\": " << num(r.loss)
      << ", \"loss_scale\": " << num(r.loss_scale) << ", \"lr\": " << num(r.lr)
      << ", \"samples_per_s\": " << num(r.samples_per_s) << ", \"elapsed_s\": " << num(r.elapsed_s)
      << "}";
  return out.str();
}

StepRecord step_from_json(const std::string& line) {
  StepRecord r;
  r.step = static_cast<int64_t>(get_number(line, "step"));
  r.loss = get_number(line, "loss");
  r.loss_scale = get_number(line, "loss_scale");
  r.lr = get_number(line, "lr");
  r.samples_per_s = get_number(line, "samples_per_s");
  r.elapsed_s = get_number(line, "elapsed_s");
  return r;
}

}  // namespace apex::train::json
