// `lily make-demo`: writes the built-in tiny random-weight demo model (MLX 4-bit layout + tokenizer).
#include <chrono>
#include <cstdio>

#include "command.h"
#include "core/common.h"
#include "core/options.h"
#include "model/demo_model.h"

namespace lily {
namespace {

int make_demo_main(int argc, char** argv) {
  Options o("make-demo", "Write the built-in demo model (tiny, random weights, real Qwen3.6 head dims).",
            {{"out", "", "output directory (created if needed)", ""},
             {"seed", "0", "random seed; the same seed gives byte-identical files", ""}});
  if (!o.parse(argc, argv)) return 0;
  if (o.str("out").empty()) throw Error("--out DIR is required");
  if (o.i64("seed") < 0) throw Error("--seed must be a non-negative integer");
  const auto t0 = std::chrono::steady_clock::now();
  const DemoModelInfo info = write_demo_model(o.str("out"), uint64_t(o.i64("seed")));
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("wrote demo model to %s: vocab %d (%d merges), %.1f MB of weights, %.2f s\n", o.str("out").c_str(),
              info.vocab_size, info.num_merges, double(info.weight_bytes) / 1e6, secs);
  return 0;
}

const RegisterCommand kRegister({"make-demo", "write the built-in tiny demo model", make_demo_main});

}  // namespace
}  // namespace lily
