// The prefill profile's useful-FLOP counts (model/op_flops.h) on the real model's shapes, by hand.
#include <gtest/gtest.h>

#include "model/op_flops.h"

namespace lily {
namespace {

ModelConfig real_shapes() {
  ModelConfig c;
  c.hidden_size = 2048;
  c.num_attention_heads = 16;
  c.head_dim = 256;
  c.num_experts = 256;
  c.num_experts_per_tok = 8;
  c.moe_intermediate_size = 512;
  c.shared_expert_intermediate_size = 512;
  return c;
}

TEST(OpFlops, GemmBatchesSumTheirMatrices) {
  const ModelConfig c = real_shapes();
  EXPECT_DOUBLE_EQ(prefill_op_flops("gemm 2048x4096", c, 4096, 40), 2.0 * 4096 * 2048 * 4096 * 40);
  EXPECT_DOUBLE_EQ(prefill_op_flops("gemm 8192x2048+4096x2048+32x2048+32x2048", c, 4096, 30),
                   2.0 * 4096 * (8192.0 + 4096 + 32 + 32) * 2048 * 30);
  EXPECT_EQ(prefill_op_flops("gemm 8192x", c, 4096, 1), 0);        // malformed: no count
  EXPECT_EQ(prefill_op_flops("gemm.convert", c, 4096, 10), 0);     // not a GEMM
  EXPECT_EQ(prefill_op_flops("gemv 248320x2048", c, 4096, 1), 0);  // decode-style op: not counted
}

TEST(OpFlops, ExpertsCountRoutedAndShared) {
  const ModelConfig c = real_shapes();
  // 137.4 GFLOP routed + 17.2 shared per layer at T = 4,096 (docs/CUDA.md, session 13).
  EXPECT_DOUBLE_EQ(prefill_op_flops("moe_prefill.gate_up", c, 4096, 1), 2.0 * 4096 * 9 * 1024 * 2048);
  EXPECT_DOUBLE_EQ(prefill_op_flops("moe_prefill.down", c, 4096, 2), 2.0 * 4096 * 9 * 512 * 2048 * 2);
  EXPECT_DOUBLE_EQ(prefill_op_flops("moe_prefill.router.gemm", c, 4096, 1), 2.0 * 4096 * 256 * 2048);
  EXPECT_EQ(prefill_op_flops("moe_prefill.combine", c, 4096, 40), 0);
}

TEST(OpFlops, AttentionIsCausalOverThePrompt) {
  const ModelConfig c = real_shapes();
  // T = 3: query t sees t + 1 keys, 6 in all; per key 2 products of head_dim MACs per head.
  EXPECT_DOUBLE_EQ(prefill_op_flops("attn_prefill", c, 3, 1), 4.0 * 16 * 256 * 6);
  EXPECT_DOUBLE_EQ(prefill_op_flops("attn_prefill", c, 4096, 10), 4.0 * 16 * 256 * (4096.0 * 4097 / 2) * 10);
}

}  // namespace
}  // namespace lily
