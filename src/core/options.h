// One declarative option table per command: each flag is declared once (name, default, help,
// environment variable) and both parsing and --help come from that list.
#pragma once
#include <map>
#include <string>
#include <vector>

namespace lily {

struct OptionSpec {
  std::string name{};      // long flag without dashes, e.g. "model"
  std::string def{};       // default value as text ("" = none); flags use "false"
  std::string help{};
  std::string env{};       // environment variable read when the flag is absent ("" = none)
  bool is_flag = false;    // boolean switch: present => "true"
  char short_name = 0;     // optional one-letter alias, e.g. 'n' for -n
};

class Options {
 public:
  Options(std::string command, std::string summary, std::vector<OptionSpec> specs);
  // Parses argv (after the subcommand). Throws lily::Error on unknown flags or missing values.
  // Returns false when --help was given (help already printed).
  bool parse(int argc, char** argv);
  std::string help() const;

  const std::string& str(const std::string& name) const;
  int64_t i64(const std::string& name) const;
  int num(const std::string& name) const { return int(i64(name)); }
  double real(const std::string& name) const;
  bool flag(const std::string& name) const;
  bool given(const std::string& name) const;   // set on the command line or by env
  const std::vector<std::string>& positional() const { return positional_; }

 private:
  const OptionSpec& spec(const std::string& name) const;
  std::string command_, summary_;
  std::vector<OptionSpec> specs_;
  std::map<std::string, std::string> values_;
  std::map<std::string, bool> given_;
  std::vector<std::string> positional_;
};

// Splits "a,b,,c" into {"a","b","c"} (empty items dropped).
std::vector<std::string> split_list(const std::string& s, char sep = ',');
// Splits "1,2,3" into integers; throws lily::Error naming `what` on bad input.
std::vector<int> parse_int_list(const std::string& s, const std::string& what);

}  // namespace lily
