// OpenAI-style API error: {"error": {"message", "type", "param", "code"}} with an HTTP status.
#pragma once
#include <stdexcept>
#include <string>

#include <nlohmann/json.hpp>

namespace lily {

struct ApiError : std::runtime_error {
  int status;
  std::string type, param, code;
  ApiError(int status_, std::string message, std::string param_ = "", std::string code_ = "",
           std::string type_ = "")
      : std::runtime_error(std::move(message)), status(status_), param(std::move(param_)),
        code(std::move(code_)) {
    type = !type_.empty()          ? std::move(type_)
           : status == 401         ? "authentication_error"
           : status == 404         ? "not_found_error"
           : status == 503         ? "service_unavailable"
           : status >= 500         ? "server_error"
                                   : "invalid_request_error";
  }
  nlohmann::ordered_json body() const {
    nlohmann::ordered_json e;
    e["message"] = what();
    e["type"] = type;
    e["param"] = param.empty() ? nlohmann::ordered_json() : nlohmann::ordered_json(param);
    e["code"] = code.empty() ? nlohmann::ordered_json() : nlohmann::ordered_json(code);
    return {{"error", e}};
  }
};

// 400 invalid_request_error naming the offending parameter.
inline ApiError bad_request(const std::string& param, const std::string& message,
                            const std::string& code = "") {
  return ApiError(400, message, param, code);
}

}  // namespace lily
