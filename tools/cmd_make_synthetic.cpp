// `lily make-synthetic`: writes the synthetic full-size model (real Qwen3.6-35B-A3B config and tensor
// shapes, random zero-mean 4-bit weights; src/model/synthetic.h) as an MLX checkpoint directory, so the
// real load path (mmap, validation, upload) can be exercised and timed at full size (~19.5 GB).
#include <chrono>
#include <cstdio>

#include "command.h"
#include "core/common.h"
#include "core/options.h"
#include "model/checkpoint_writer.h"
#include "model/synthetic.h"

namespace lily {
namespace {

int make_synthetic_main(int argc, char** argv) {
  Options o("make-synthetic", "Write the synthetic full-size model as an MLX 4-bit checkpoint directory.",
            {{"out", "", "output directory (created if needed)"},
             {"layers", "40", "layers (the first N of the real pattern; every 4th is attention)"},
             {"vocab", "0", "vocabulary rows (0 = the real 248,320)"},
             {"seed", "1", "random seed (the same seed gives the weights `--synthetic` benchmarks use)"},
             {"shard-gb", "4", "shard size in GB"}});
  if (!o.parse(argc, argv)) return 0;
  if (o.str("out").empty()) throw Error("--out DIR is required");
  const auto t0 = std::chrono::steady_clock::now();
  auto secs = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(); };
  SyntheticOptions so;
  so.layers = o.num("layers");
  so.vocab = o.num("vocab");
  so.seed = uint64_t(o.i64("seed"));
  const ModelWeights w = make_synthetic_weights(so);
  std::fprintf(stderr, "make-synthetic: %d layers built in %.1f s, writing %s\n", so.layers, secs(), o.str("out").c_str());
  CheckpointWriteOptions wo;
  wo.shard_bytes = int64_t(o.real("shard-gb") * 1e9);
  if (wo.shard_bytes < (int64_t(1) << 20)) throw Error("--shard-gb must be at least 0.001");
  wo.progress = [&](int64_t done, int64_t total) {
    std::fprintf(stderr, "make-synthetic: %.2f / %.2f GB (%.0f s)\n", double(done) / 1e9, double(total) / 1e9, secs());
  };
  const int64_t bytes = write_mlx_checkpoint(w, o.str("out"), wo);
  std::printf("wrote synthetic model to %s: %d layers, vocab %d, %.2f GB of tensors, %.1f s\n", o.str("out").c_str(),
              so.layers, w.config.vocab_size, double(bytes) / 1e9, secs());
  return 0;
}

const RegisterCommand kRegister({"make-synthetic", "write the synthetic full-size model as an MLX checkpoint",
                                 make_synthetic_main});

}  // namespace
}  // namespace lily
