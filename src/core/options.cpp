// Declarative command-line options (see options.h).
#include "core/options.h"

#include <cstdio>
#include <cstdlib>
#include <sstream>

#include "core/common.h"

namespace lily {

Options::Options(std::string command, std::string summary, std::vector<OptionSpec> specs)
    : command_(std::move(command)), summary_(std::move(summary)), specs_(std::move(specs)) {
  for (const auto& s : specs_) {
    values_[s.name] = s.is_flag && s.def.empty() ? "false" : s.def;
    if (!s.env.empty()) {
      if (const char* e = std::getenv(s.env.c_str()); e && *e) {
        values_[s.name] = e;
        given_[s.name] = true;
      }
    }
  }
}

const OptionSpec& Options::spec(const std::string& name) const {
  for (const auto& s : specs_)
    if (s.name == name) return s;
  throw Error("internal: option --" + name + " is not declared for '" + command_ + "'");
}

bool Options::parse(int argc, char** argv) {
  for (int i = 0; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "-h" || a == "--help") {
      std::fputs(help().c_str(), stdout);
      return false;
    }
    if (a.size() == 2 && a[0] == '-' && a[1] != '-') {   // short alias: -n VALUE
      for (const auto& sp : specs_)
        if (sp.short_name == a[1]) a = "--" + sp.name;
    }
    if (a.rfind("--", 0) != 0 || a.size() == 2) {
      positional_.push_back(a);
      continue;
    }
    std::string name = a.substr(2), value;
    bool has_value = false;
    if (auto eq = name.find('='); eq != std::string::npos) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
      has_value = true;
    }
    const OptionSpec* s = nullptr;
    for (const auto& sp : specs_)
      if (sp.name == name) s = &sp;
    if (!s) throw Error("unknown option --" + name + " for '" + command_ + "' (see --help)");
    if (s->is_flag) {
      values_[name] = has_value ? value : "true";
    } else {
      if (!has_value) {
        if (i + 1 >= argc) throw Error("option --" + name + " needs a value");
        value = argv[++i];
      }
      values_[name] = value;
    }
    given_[name] = true;
  }
  return true;
}

std::string Options::help() const {
  std::ostringstream o;
  o << "usage: lily " << command_ << " [options]\n" << summary_ << "\n\noptions:\n";
  for (const auto& s : specs_) {
    std::string f = std::string("  ") + (s.short_name ? std::string("-") + s.short_name + ", " : "") +
                    "--" + s.name + (s.is_flag ? "" : " VALUE");
    o << f;
    for (size_t k = f.size(); k < 28; ++k) o << ' ';
    o << s.help;
    if (!s.is_flag && !s.def.empty()) o << " (default: " << s.def << ")";
    if (!s.env.empty()) o << " [env " << s.env << "]";
    o << "\n";
  }
  return o.str();
}

const std::string& Options::str(const std::string& name) const {
  spec(name);
  return values_.at(name);
}

int64_t Options::i64(const std::string& name) const {
  const std::string& v = str(name);
  char* end = nullptr;
  long long x = std::strtoll(v.c_str(), &end, 10);
  if (v.empty() || *end) throw Error("option --" + name + " expects an integer, got '" + v + "'");
  return x;
}

double Options::real(const std::string& name) const {
  const std::string& v = str(name);
  char* end = nullptr;
  double x = std::strtod(v.c_str(), &end);
  if (v.empty() || *end) throw Error("option --" + name + " expects a number, got '" + v + "'");
  return x;
}

bool Options::flag(const std::string& name) const {
  const std::string& v = str(name);
  return v == "true" || v == "1" || v == "yes" || v == "on";
}

bool Options::given(const std::string& name) const {
  spec(name);
  auto it = given_.find(name);
  return it != given_.end() && it->second;
}

std::vector<std::string> split_list(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, sep))
    if (!item.empty()) out.push_back(item);
  return out;
}

std::vector<int> parse_int_list(const std::string& s, const std::string& what) {
  std::vector<int> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) {
    if (item.empty()) continue;
    char* end = nullptr;
    long v = std::strtol(item.c_str(), &end, 10);
    if (*end) throw Error(what + ": '" + item + "' is not an integer");
    out.push_back(int(v));
  }
  return out;
}

}  // namespace lily
