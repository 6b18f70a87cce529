#include "train/json.h"

#include <c10/util/Exception.h>

#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <utility>

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

std::string num_exact(double v) {
  if (!std::isfinite(v)) return "null";
  char buf[40];
  std::snprintf(buf, sizeof(buf), "%.17g", v);
  return buf;
}

namespace {

class Parser {
 public:
  Parser(const std::string& text, const std::string& what) : t_(text), what_(what) {}

  Object object() {
    Object out;
    space();
    expect('{');
    space();
    if (peek() == '}') {
      ++p_;
    } else {
      while (true) {
        space();
        TORCH_CHECK(peek() == '"', what_, ": expected a key at byte ", p_);
        const std::string key = string();
        space();
        expect(':');
        space();
        Field f = value(key);
        TORCH_CHECK(out.emplace(key, std::move(f)).second, what_, ": key \"", key,
                    "\" appears twice");
        space();
        if (peek() == ',') {
          ++p_;
          continue;
        }
        expect('}');
        break;
      }
    }
    space();
    TORCH_CHECK(p_ == t_.size(), what_, ": unexpected text after the object at byte ", p_);
    return out;
  }

 private:
  char peek() const { return p_ < t_.size() ? t_[p_] : '\0'; }
  void space() {
    while (p_ < t_.size() &&
           (t_[p_] == ' ' || t_[p_] == '\n' || t_[p_] == '\r' || t_[p_] == '\t')) {
      ++p_;
    }
  }
  void expect(char c) {
    TORCH_CHECK(peek() == c, what_, ": expected '", c, "' at byte ", p_,
                p_ < t_.size() ? "" : " (the text ends there)");
    ++p_;
  }
  std::string string() {
    expect('"');
    std::string out;
    while (true) {
      TORCH_CHECK(p_ < t_.size(), what_, ": a string is not closed");
      const char c = t_[p_++];
      if (c == '"') return out;
      TORCH_CHECK(static_cast<unsigned char>(c) >= 0x20, what_,
                  ": a control character inside a string at byte ", p_ - 1);
      if (c != '\\') {
        out += c;
        continue;
      }
      TORCH_CHECK(p_ < t_.size(), what_, ": a string is not closed");
      const char e = t_[p_++];
      switch (e) {
        case '"':
        case '\\':
        case '/':
          out += e;
          break;
        case 'n':
          out += '\n';
          break;
        case 't':
          out += '\t';
          break;
        case 'r':
          out += '\r';
          break;
        case 'b':
          out += '\b';
          break;
        case 'f':
          out += '\f';
          break;
        case 'u': {
          TORCH_CHECK(p_ + 4 <= t_.size(), what_, ": a \\u escape is cut short");
          unsigned v = 0;
          for (int i = 0; i < 4; ++i) {
            const char h = t_[p_++];
            TORCH_CHECK(std::isxdigit(static_cast<unsigned char>(h)), what_, ": a bad \\u escape");
            v = v * 16 + static_cast<unsigned>(std::isdigit(static_cast<unsigned char>(h))
                                                   ? h - '0'
                                                   : (std::tolower(h) - 'a' + 10));
          }
          TORCH_CHECK(v < 0x80, what_, ": non-ASCII \\u escapes are not expected here");
          out += static_cast<char>(v);
          break;
        }
        default:
          TORCH_CHECK(false, what_, ": a bad escape '\\", e, "' in a string");
      }
    }
  }
  Field value(const std::string& key) {
    const char c = peek();
    if (c == '"') return {Field::Kind::kString, string()};
    if (c == '{' || c == '[') {
      TORCH_CHECK(false, what_, ": \"", key, "\" holds a nested value; this file is flat");
    }
    for (const auto& [word, kind] :
         {std::pair{"true", Field::Kind::kBool}, std::pair{"false", Field::Kind::kBool},
          std::pair{"null", Field::Kind::kNull}}) {
      const size_t n = std::strlen(word);
      if (t_.compare(p_, n, word) == 0) {
        p_ += n;
        return {kind, word};
      }
    }
    // A JSON number: -? (0 | [1-9][0-9]*) (. [0-9]+)? ([eE] [+-]? [0-9]+)?
    const size_t start = p_;
    if (peek() == '-') ++p_;
    auto digits = [&] {
      const size_t d = p_;
      while (std::isdigit(static_cast<unsigned char>(peek()))) ++p_;
      return p_ - d;
    };
    const size_t whole = digits();
    TORCH_CHECK(whole > 0 && !(whole > 1 && t_[p_ - whole] == '0'), what_, ": \"", key,
                "\" holds no valid value at byte ", start);
    if (peek() == '.') {
      ++p_;
      TORCH_CHECK(digits() > 0, what_, ": \"", key, "\" holds a malformed number");
    }
    if (peek() == 'e' || peek() == 'E') {
      ++p_;
      if (peek() == '+' || peek() == '-') ++p_;
      TORCH_CHECK(digits() > 0, what_, ": \"", key, "\" holds a malformed number");
    }
    return {Field::Kind::kNumber, t_.substr(start, p_ - start)};
  }

  const std::string& t_;
  const std::string& what_;
  size_t p_ = 0;
};

const Field& field_at(const Object& o, const std::string& key, const std::string& what) {
  auto it = o.find(key);
  TORCH_CHECK(it != o.end(), what, ": \"", key, "\" is missing");
  return it->second;
}

const char* kind_text(Field::Kind k) {
  switch (k) {
    case Field::Kind::kString:
      return "a string";
    case Field::Kind::kNumber:
      return "a number";
    case Field::Kind::kBool:
      return "a boolean";
    case Field::Kind::kNull:
      return "null";
  }
  return "?";
}

}  // namespace

Object parse_object(const std::string& text, const std::string& what) {
  return Parser(text, what).object();
}

std::string string_at(const Object& o, const std::string& key, const std::string& what) {
  const Field& f = field_at(o, key, what);
  TORCH_CHECK(f.kind == Field::Kind::kString, what, ": \"", key, "\" must be a string, got ",
              kind_text(f.kind), f.kind == Field::Kind::kString ? "" : " " + f.text);
  return f.text;
}

int64_t int_at(const Object& o, const std::string& key, int64_t min, int64_t max,
               const std::string& what) {
  const Field& f = field_at(o, key, what);
  TORCH_CHECK(f.kind == Field::Kind::kNumber, what, ": \"", key, "\" must be an integer, got ",
              kind_text(f.kind));
  TORCH_CHECK(f.text.find_first_of(".eE") == std::string::npos, what, ": \"", key,
              "\" must be an integer, got ", f.text);
  errno = 0;
  char* end = nullptr;
  const long long v = std::strtoll(f.text.c_str(), &end, 10);
  TORCH_CHECK(errno != ERANGE && end == f.text.c_str() + f.text.size() && v >= min && v <= max,
              what, ": \"", key, "\" must be in [", min, ", ", max, "], got ", f.text);
  return v;
}

double real_at(const Object& o, const std::string& key, const std::string& what) {
  const Field& f = field_at(o, key, what);
  TORCH_CHECK(f.kind == Field::Kind::kNumber, what, ": \"", key, "\" must be a number, got ",
              kind_text(f.kind));
  const double v = std::strtod(f.text.c_str(), nullptr);
  TORCH_CHECK(std::isfinite(v), what, ": \"", key, "\" must be finite, got ", f.text);
  return v;
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
