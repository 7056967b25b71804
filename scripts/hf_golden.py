#!/usr/bin/env python3
"""Builds a tiny random Qwen3.5/3.6-MoE text model with Hugging Face transformers' own code, saves it
with save_pretrained (bf16 safetensors) and records reference logits from the HF forward pass.

Run where torch + transformers (>= 5.x with qwen3_5_moe) are installed (the H200 device machine):
  hf_golden.py OUT_DIR
Writes (the layout of tests/fixtures/hf_tiny/):
  OUT_DIR/config.json, OUT_DIR/model.safetensors: save_pretrained(save_original_format=False), i.e.
    fused experts mlp.experts.gate_up_proj / down_proj as in the published Qwen3.5/3.6 checkpoints;
  OUT_DIR/golden.npz: prompt_ids, and for each compute dtype D in (f32, bf16): logits_D
    [P + N - 1, vocab] float32 (one row per prompt position, then one per greedy decode step) and
    generated_D [N]. f32 = the bf16 weights reloaded from disk, model upcast to float32; bf16 = the
    same weights computing in bf16 (for information);
  OUT_DIR/golden.json: versions, summary figures, and the tensor names of both saves;
  OUT_DIR-default/: the default save_pretrained output, for the record (transformers 5.17 writes
    per-expert mlp.experts.E.{gate,up,down}_proj.weight there).
"""
import argparse
import json
import pathlib
import platform
import sys

import numpy as np
import torch
import transformers
from safetensors import safe_open

SEED = 1234
PROMPT_LEN = 96      # crosses HF's GDN chunk of 64 and lily's --chunk 64
DECODE_STEPS = 16


def make_config():
    from transformers import Qwen3_5MoeTextConfig
    layer_types = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]
    return Qwen3_5MoeTextConfig(
        vocab_size=512,
        hidden_size=64,
        num_hidden_layers=4,
        layer_types=layer_types,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=256,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        rms_norm_eps=1e-6,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0,
                         "partial_rotary_factor": 0.25, "mrope_interleaved": True,
                         "mrope_section": [11, 11, 10]},
        tie_word_embeddings=False,
        eos_token_id=511,
    )


@torch.no_grad()
def randomise(model, gen):
    """Sensible random scales: unit-scale activations, non-flat logits, non-trivial norms/gates."""
    def normal(shape, std):
        return torch.randn(shape, generator=gen) * std

    for name, p in model.named_parameters():
        shape = p.shape
        if name.endswith("A_log"):
            val = torch.empty(shape).uniform_(0.3, 8.0, generator=gen).log()
        elif name.endswith("dt_bias"):
            val = torch.empty(shape).uniform_(-3.0, 1.0, generator=gen)
        elif name.endswith("linear_attn.norm.weight"):
            val = 1.0 + normal(shape, 0.1)                 # gated norm: plain gain
        elif name.endswith("norm.weight"):
            val = (torch.rand(shape, generator=gen) * 2 - 1) * 0.1   # zero-centred, +-0.1
        elif name.endswith("conv1d.weight"):
            val = normal(shape, 0.5)
        elif name.endswith("embed_tokens.weight"):
            val = normal(shape, 1.0)
        elif name.endswith("experts.gate_up_proj"):
            val = normal(shape, shape[-1] ** -0.5)
        elif name.endswith("experts.down_proj"):
            val = normal(shape, 0.7 * shape[-1] ** -0.5)
        elif name.endswith("lm_head.weight"):
            val = normal(shape, 3.0 * shape[-1] ** -0.5)
        elif name.endswith("mlp.gate.weight") or name.endswith("shared_expert_gate.weight"):
            val = normal(shape, 2.0 * shape[-1] ** -0.5)
        elif p.dim() == 2:
            gain = 0.7 if name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight")) else 1.0
            val = normal(shape, gain * shape[-1] ** -0.5)
        else:
            raise RuntimeError(f"no init rule for parameter {name} {tuple(shape)}")
        p.copy_(val.to(p.dtype))


def cache_of(out):
    for attr in ("past_key_values", "cache"):
        c = getattr(out, attr, None)
        if c is not None:
            return c
    raise RuntimeError("forward output carries no cache")


@torch.no_grad()
def reference(model, prompt, steps):
    """Whole-prompt forward with a cache, then greedy decode one token at a time."""
    out = model(input_ids=torch.tensor([prompt]), use_cache=True)
    rows = [out.logits[0].float()]
    cache = cache_of(out)
    generated = [int(rows[0][-1].argmax())]
    for _ in range(steps - 1):
        out = model(input_ids=torch.tensor([[generated[-1]]]), past_key_values=cache, use_cache=True)
        cache = cache_of(out)
        rows.append(out.logits[0].float())
        generated.append(int(rows[-1][-1].argmax()))
    return torch.cat(rows).numpy(), generated


def tensor_names(path):
    with safe_open(str(path), "pt") as f:
        return {k: [list(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()] for k in f.keys()}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir")
    args = ap.parse_args()
    out = pathlib.Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(SEED)
    from transformers import Qwen3_5MoeForCausalLM

    config = make_config()
    model = Qwen3_5MoeForCausalLM(config).eval()
    randomise(model, torch.Generator().manual_seed(SEED))
    model = model.to(torch.bfloat16)
    default_dir = out.parent / (out.name + "-default")
    model.save_pretrained(default_dir, safe_serialization=True)
    model.save_pretrained(out, safe_serialization=True, save_original_format=False)
    (out / "generation_config.json").unlink(missing_ok=True)
    names = tensor_names(out / "model.safetensors")
    default_names = tensor_names(default_dir / "model.safetensors")

    prompt = np.random.default_rng(SEED).integers(0, config.vocab_size, PROMPT_LEN).tolist()
    results = {"prompt_ids": np.array(prompt, dtype=np.int64)}
    info = {"saved_with": "save_pretrained(save_original_format=False)",
            "transformers": transformers.__version__, "torch": torch.__version__,
            "python": platform.python_version(), "class": "Qwen3_5MoeForCausalLM",
            "prompt_tokens": PROMPT_LEN, "decode_steps": DECODE_STEPS,
            "tensors": names, "default_save_tensors": default_names}
    for tag, dtype in (("f32", torch.float32), ("bf16", torch.bfloat16)):
        # Reload what was written, so the reference runs on the bytes on disk.
        m = Qwen3_5MoeForCausalLM.from_pretrained(out, dtype=torch.bfloat16,
                                                  attn_implementation="eager").eval()
        m = m.to(dtype)
        logits, generated = reference(m, prompt, DECODE_STEPS)
        results[f"logits_{tag}"] = logits.astype(np.float32)
        results[f"generated_{tag}"] = np.array(generated, dtype=np.int64)
        sorted_l = np.sort(logits, axis=1)
        info[tag] = {"generated": generated, "logit_std": float(logits.std()),
                     "logit_absmax": float(np.abs(logits).max()),
                     "min_top1_margin": float((sorted_l[:, -1] - sorted_l[:, -2]).min())}
    f, b = results["logits_f32"], results["logits_bf16"]
    info["bf16_vs_f32_max_abs"] = float(np.abs(f - b).max())
    info["bf16_vs_f32_same_tokens"] = info["f32"]["generated"] == info["bf16"]["generated"]
    np.savez_compressed(out / "golden.npz", **results)
    (out / "golden.json").write_text(json.dumps(info, indent=1))
    print(json.dumps({k: v for k, v in info.items() if "tensors" not in k}, indent=1))
    print("tensors:", len(names), "default save:", len(default_names))


if __name__ == "__main__":
    sys.exit(main())
