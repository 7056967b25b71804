// Conversion of tool-call parameter values (raw text from the model) to JSON by the parameter's
// JSON-schema type, as the Qwen3-Coder reference parser does (FRONTEND.md §3.4).
#pragma once
#include <optional>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

namespace lily {

// JSON text (json.dumps style) of one parameter value. schema: the parameter's schema from the
// request's tools, or null when the function or parameter is unknown (the value stays a string).
std::string convert_tool_value(const std::string& raw, const nlohmann::json* schema);

// JSON text parsed leniently: raw control characters inside strings are accepted (Python's
// json.loads(strict=False)), then a Python literal ('single quotes', True/False/None, tuples).
// nullopt when neither reads.
std::optional<nlohmann::ordered_json> parse_json_lenient(std::string_view text);

}  // namespace lily
