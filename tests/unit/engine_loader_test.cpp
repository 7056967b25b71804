// load_model (serve / chat): the prefill chunk it gives the model — the backend's default, an explicit --chunk, and
// the default capped by the caller's context (no workspace for tokens that can never come).
#include <gtest/gtest.h>

#include "engine/model_loader.h"
#include "loader_fixture.h"
#include "model/demo_model.h"
#include "model/qwen36.h"

namespace lily::loader_test {
namespace {

int chunk_of(const std::string& dir, int chunk, int max_context) {
  ModelLoadOptions o;
  o.dir = dir;
  o.backend = "cpu";
  o.threads = 1;
  o.chunk = chunk;
  o.max_context = max_context;
  o.progress = false;
  return load_model(o)->lm().max_chunk();
}

TEST(EngineLoader, PrefillChunkDefaultExplicitAndCappedByContext) {
  TmpDir d;
  write_demo_model(d.str(), 3);
  const int def = default_prefill_chunk("cpu");
  EXPECT_EQ(chunk_of(d.str(), 0, 0), def);
  EXPECT_EQ(chunk_of(d.str(), 0, def * 4), def);        // a context above the chunk leaves it alone
  EXPECT_EQ(chunk_of(d.str(), 0, 100), 100);            // the default never exceeds the context
  EXPECT_EQ(chunk_of(d.str(), 1000, 100), 1000);        // an explicit chunk is the user's choice
  EXPECT_EQ(default_prefill_chunk("cuda"), 16384);      // session 32's sweep (docs/CUDA.md)
}

}  // namespace
}  // namespace lily::loader_test
