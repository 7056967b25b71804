// `lily` entry point: dispatches to the registered subcommands (serve, chat, run, bench, ...).
#include <cstdio>
#include <cstring>
#include <exception>

#include "command.h"
#include "core/common.h"

namespace lily {
std::vector<Command>& commands() {
  static std::vector<Command> c;
  return c;
}
}  // namespace lily

static void usage() {
  std::fprintf(stderr, "usage: lily <command> [options]   (lily <command> --help for details)\n\ncommands:\n");
  for (const auto& c : lily::commands()) std::fprintf(stderr, "  %-12s %s\n", c.name.c_str(), c.summary.c_str());
}

int main(int argc, char** argv) {
  if (argc < 2 || !std::strcmp(argv[1], "-h") || !std::strcmp(argv[1], "--help")) {
    usage();
    return argc < 2 ? 2 : 0;
  }
  for (const auto& c : lily::commands()) {
    if (c.name != argv[1]) continue;
    try {
      return c.run(argc - 2, argv + 2);
    } catch (const lily::Error& e) {
      std::fprintf(stderr, "lily %s: error: %s\n", argv[1], e.what());
      return 1;
    } catch (const std::exception& e) {
      std::fprintf(stderr, "lily %s: unexpected error: %s\n", argv[1], e.what());
      return 1;
    }
  }
  std::fprintf(stderr, "lily: unknown command '%s'\n", argv[1]);
  usage();
  return 2;
}
