#pragma once

// The small JSON apex-train reads and writes: flat objects of strings and numbers, one per line.

#include <cstdint>
#include <map>
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
/// A JSON number that reads back as the same double (17 significant digits).
std::string num_exact(double v);

/// One value of a parsed flat object: its kind and its text (a string's unescaped content, a
/// number's literal).
struct Field {
  enum class Kind { kString, kNumber, kBool, kNull } kind;
  std::string text;
};
using Object = std::map<std::string, Field>;
/// Parses `text` strictly: exactly one flat object of strings, numbers, booleans and nulls
/// (nothing nested, no duplicate keys, nothing after it). Errors start with `what`.
Object parse_object(const std::string& text, const std::string& what);
/// Typed fields of a parsed object; errors name the key, what it holds and what was expected.
std::string string_at(const Object& o, const std::string& key, const std::string& what);
/// An integer literal (no fraction, no exponent) in [min, max].
int64_t int_at(const Object& o, const std::string& key, int64_t min, int64_t max,
               const std::string& what);
/// A finite number.
double real_at(const Object& o, const std::string& key, const std::string& what);

/// One metrics line for a logged step, and back.
std::string step_record(const std::string& level, const StepRecord& r);
StepRecord step_from_json(const std::string& line);

}  // namespace apex::train::json
