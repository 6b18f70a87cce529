#pragma once

// The small JSON apex-train reads and writes: flat objects of strings and numbers, one per line.

#include <string>

namespace apex::train {
struct StepRecord;
}

namespace apex::train::json {

/// A JSON string literal.
std::string quote(const std::string& s);
/// A JSON number (non-finite values as null).
std::string num(double v);
/// The value of "key" in a flat object; throws c10::Error naming the key when absent or mistyped.
std::string get_string(const std::string& object, const std::string& key);
double get_number(const std::string& object, const std::string& key);
/// One metrics line for a logged step, and back.
std::string step_record(const std::string& level, const StepRecord& r);
StepRecord step_from_json(const std::string& line);

}  // namespace apex::train::json
