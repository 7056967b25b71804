// Python-compatible text forms of JSON values: json.dumps(x, ensure_ascii=False), float repr and
// str(), as the chat template's `tojson` filter and `{{ value }}` produce them.
#pragma once
#include <string>

#include <nlohmann/json.hpp>

namespace lily {

// json.dumps(v, ensure_ascii=False): separators ", " and ": ", object keys in stored order,
// non-ASCII kept raw, floats as Python repr (1.0, 1e+16, 1e-05).
std::string json_py_dumps(const nlohmann::ordered_json& v);

// repr(float) of CPython: shortest round-trip digits, ".0" on integral values, exponent form when
// the decimal exponent is < -4 or >= 16.
std::string py_float_repr(double d);

// str(x) of the Python value json.loads would build: strings raw, None/True/False, and repr() of
// lists and dicts (what jinja2 prints for `{{ x }}`).
std::string py_str(const nlohmann::ordered_json& v);

}  // namespace lily
