// Subcommand registry of the `lily` binary: each tools/cmd_*.cpp registers one command.
#pragma once
#include <functional>
#include <string>
#include <vector>

namespace lily {

struct Command {
  std::string name;
  std::string summary;
  std::function<int(int argc, char** argv)> run;   // argv excludes "lily" and the command name
};

std::vector<Command>& commands();

struct RegisterCommand {
  RegisterCommand(Command c) { commands().push_back(std::move(c)); }
};

}  // namespace lily
