// Tool-call value conversion by JSON-schema type (see output_parser_values.h).
#include "tokenizer/output_parser_values.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <vector>

#include "tokenizer/json_py.h"

namespace lily {

namespace {

using OJson = nlohmann::ordered_json;

std::string trim(std::string_view s) {
  size_t b = 0, e = s.size();
  while (b < e && std::isspace(static_cast<unsigned char>(s[b]))) ++b;
  while (e > b && std::isspace(static_cast<unsigned char>(s[e - 1]))) --e;
  return std::string(s.substr(b, e - b));
}

// JSON-schema types a parameter accepts: "type" (string or list) or the types of anyOf/oneOf.
std::vector<std::string> schema_types(const nlohmann::json& schema) {
  std::vector<std::string> out;
  auto add = [&](const nlohmann::json& t) {
    if (t.is_string()) out.push_back(t.get<std::string>());
    else if (t.is_array())
      for (const auto& e : t)
        if (e.is_string()) out.push_back(e.get<std::string>());
  };
  if (auto it = schema.find("type"); it != schema.end()) add(*it);
  for (const char* key : {"anyOf", "oneOf"})
    if (auto it = schema.find(key); it != schema.end() && it->is_array())
      for (const auto& sub : *it)
        if (sub.is_object() && sub.contains("type")) add(sub["type"]);
  return out;
}

bool has(const std::vector<std::string>& v, const char* s) { return std::find(v.begin(), v.end(), s) != v.end(); }

// Escapes raw control characters inside JSON strings so a strict parser accepts them.
std::string escape_controls_in_strings(std::string_view s) {
  std::string out;
  bool in_str = false, esc = false;
  for (char c : s) {
    unsigned char u = static_cast<unsigned char>(c);
    if (in_str && !esc && u < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", u);
      out += buf;
      continue;
    }
    out += c;
    if (esc) esc = false;
    else if (in_str && c == '\\') esc = true;
    else if (c == '"') in_str = !in_str;
  }
  return out;
}

// A Python literal (dict/list/tuple/str/number/True/False/None) rewritten as JSON text.
std::optional<std::string> python_literal_to_json(std::string_view s) {
  std::string out;
  for (size_t i = 0; i < s.size();) {
    char c = s[i];
    if (c == '\'' || c == '"') {
      std::string val;
      size_t j = i + 1;
      for (; j < s.size() && s[j] != c; ++j) {
        if (s[j] != '\\' || j + 1 >= s.size()) {
          val += s[j];
          continue;
        }
        char e = s[++j];
        val += e == 'n' ? '\n' : e == 't' ? '\t' : e == 'r' ? '\r' : e == '0' ? '\0' : e;
      }
      if (j >= s.size()) return std::nullopt;   // unterminated string
      out += json_py_dumps(val);
      i = j + 1;
    } else if (std::isdigit(static_cast<unsigned char>(c))) {
      size_t j = i;   // a number, exponent included (1e-05)
      while (j < s.size() && (std::isalnum(static_cast<unsigned char>(s[j])) || s[j] == '.' ||
                              ((s[j] == '-' || s[j] == '+') && (s[j - 1] == 'e' || s[j - 1] == 'E'))))
        ++j;
      out += s.substr(i, j - i);
      i = j;
    } else if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
      size_t j = i;
      while (j < s.size() && (std::isalnum(static_cast<unsigned char>(s[j])) || s[j] == '_')) ++j;
      std::string_view word = s.substr(i, j - i);
      if (word == "True") out += "true";
      else if (word == "False") out += "false";
      else if (word == "None") out += "null";
      else return std::nullopt;   // a name: not a literal
      i = j;
    } else {
      out += c == '(' ? '[' : c == ')' ? ']' : c;
      ++i;
    }
  }
  return out;
}

std::optional<OJson> parse_strict(std::string_view text) {
  OJson v = OJson::parse(text, nullptr, false);
  if (v.is_discarded()) return std::nullopt;
  return v;
}

}  // namespace

std::optional<OJson> parse_json_lenient(std::string_view text) {
  if (auto v = parse_strict(escape_controls_in_strings(text))) return v;
  if (auto lit = python_literal_to_json(text)) return parse_strict(*lit);
  return std::nullopt;
}

std::string convert_tool_value(const std::string& raw, const nlohmann::json* schema) {
  if (!schema || !schema->is_object()) return json_py_dumps(raw);
  const std::vector<std::string> types = schema_types(*schema);
  const std::string t = trim(raw);
  if ((t == "null" || t == "None") && (has(types, "null") || !has(types, "string"))) return "null";
  if (types.empty()) {
    // No declared type: structured JSON is taken as such, anything else stays text (mlx-lm does so).
    auto v = parse_strict(escape_controls_in_strings(t));
    return v && (v->is_object() || v->is_array()) ? json_py_dumps(*v) : json_py_dumps(raw);
  }
  for (const std::string& type : types) {
    if (type == "string") return json_py_dumps(raw);
    if (type == "boolean") {
      std::string low = t;
      for (char& c : low) c = char(std::tolower(static_cast<unsigned char>(c)));
      if (low == "true" || low == "false") return low;
    } else if (type == "integer" || type == "number") {
      auto v = parse_strict(t);
      if (!v || !v->is_number()) continue;
      if (v->is_number_float()) {
        // Integral floats become ints (2.0 -> 2), as the reference parsers do.
        double d = v->get<double>();
        if (std::abs(d) < 9007199254740992.0 && d == std::trunc(d)) return std::to_string(int64_t(d));
        if (type == "integer") continue;
      }
      return json_py_dumps(*v);
    } else if (type == "object" || type == "array") {
      auto v = parse_json_lenient(t);
      if (v && (type == "object" ? v->is_object() : v->is_array())) return json_py_dumps(*v);
    }
  }
  return json_py_dumps(raw);
}

}  // namespace lily
