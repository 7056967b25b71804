#!/usr/bin/env python3
"""Builds tiny random-weight qwen3_5_moe checkpoints with mlx-lm's own code and records mlx-lm logits.

Pipeline per model (the same steps as `mlx_lm.convert`, minus the tokenizer):
  1. random weights in the raw Hugging Face layout (zero-centred norms, conv1d [C,1,K], fused
     experts gate_up_proj/down_proj) are written to a scratch HF checkpoint;
  2. mlx_lm.utils.load_model reads it through qwen3_5_moe's sanitize (norm +1 fold, conv axis move,
     expert split);
  3. the convert cast (cast_predicate keeps A_log in its source dtype), then mlx_lm.utils.quantize_model
     with the model's quant_predicate (router and shared_expert_gate 8-bit, the rest 4-bit, group 64);
  4. mlx_lm.utils.save_model + save_config write OUT_DIR/NAME/.
The reference run then reloads OUT_DIR/NAME with mlx-lm and writes OUT_DIR/NAME-ref/:
  logits.npy [P + N - 1, vocab] f32 (one row per prompt position, then one per decode step),
  prompt_ids.npy, generated_ids.npy (N greedy ids), meta.json.

Usage: make_tiny_models.py OUT_DIR [--models a,b] [--mutation NAME]
"""
import argparse
import json
import pathlib
import sys
import tempfile
import time

import numpy as np

import mlx.core as mx
from mlx.utils import tree_map_with_path
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load_model, quantize_model, save_config, save_model

import mlx_lm.models.qwen3_5 as mlx_qwen3_5

# Per-head dims are the real ones (head_dim 256, linear key/value 128, group 64); counts are shrunk.
SPECS = {
    "tiny-bf16": dict(dtype="bfloat16", hidden=256, layers=4, heads=2, kv_heads=1, lin_k=2, lin_v=4,
                      experts=16, top_k=4, moe_inter=128, shared_inter=128, vocab=2048, seed=11),
    "tiny-f32": dict(dtype="float32", hidden=256, layers=4, heads=2, kv_heads=1, lin_k=2, lin_v=4,
                     experts=16, top_k=4, moe_inter=128, shared_inter=128, vocab=2048, seed=12),
    "tiny-f32-h512": dict(dtype="float32", hidden=512, layers=8, heads=4, kv_heads=2, lin_k=4,
                          lin_v=8, experts=8, top_k=2, moe_inter=64, shared_inter=192, vocab=1536,
                          seed=13),
    # Benchmark model (scripts/bench_cpu_vs_mlx.py): the real hidden size, head counts and expert
    # shapes of Qwen3.6-35B-A3B, with 4 layers, 32 experts and a 16K vocabulary.
    "mini-bf16": dict(dtype="bfloat16", hidden=2048, layers=4, heads=16, kv_heads=2, lin_k=16,
                      lin_v=32, experts=32, top_k=8, moe_inter=512, shared_inter=512, vocab=16384,
                      seed=14),
}
DEFAULT_MODELS = ["tiny-bf16", "tiny-f32", "tiny-f32-h512"]
PROMPT_LEN = 320
DECODE_STEPS = 20
REFERENCE_CHUNK = 64


def text_config(spec):
    n = spec["layers"]
    layer_types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)]
    return {
        "model_type": "qwen3_5_moe_text",
        "hidden_size": spec["hidden"],
        "num_hidden_layers": n,
        "layer_types": layer_types,
        "full_attention_interval": 4,
        "num_attention_heads": spec["heads"],
        "num_key_value_heads": spec["kv_heads"],
        "head_dim": 256,
        "attn_output_gate": True,
        "attention_bias": False,
        "linear_num_key_heads": spec["lin_k"],
        "linear_num_value_heads": spec["lin_v"],
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "num_experts": spec["experts"],
        "num_experts_per_tok": spec["top_k"],
        "moe_intermediate_size": spec["moe_inter"],
        "shared_expert_intermediate_size": spec["shared_inter"],
        "vocab_size": spec["vocab"],
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "max_position_embeddings": 262144,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000,
                            "partial_rotary_factor": 0.25, "mrope_interleaved": True,
                            "mrope_section": [11, 11, 10]},
        "partial_rotary_factor": 0.25,
        "tie_word_embeddings": False,
        "mamba_ssm_dtype": "float32",
        "eos_token_id": spec["vocab"] - 1,
        "dtype": spec["dtype"],
    }


def hf_config(spec):
    return {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5_moe",
        "tie_word_embeddings": False,
        "torch_dtype": spec["dtype"],
        "text_config": text_config(spec),
    }


def hf_weights(spec, rng):
    """Random weights named and shaped as in a raw HF qwen3_5_moe checkpoint (float32 numpy)."""
    H, V = spec["hidden"], spec["vocab"]
    nh, nkv, hd = spec["heads"], spec["kv_heads"], 256
    nk, nv, dk, dv = spec["lin_k"], spec["lin_v"], 128, 128
    E, I, Is = spec["experts"], spec["moe_inter"], spec["shared_inter"]
    conv_dim = 2 * nk * dk + nv * dv

    def lin(out, inp, gain=1.0):
        # std gain/sqrt(in) keeps every projection's output near unit scale.
        return (rng.standard_normal((out, inp)) * gain / np.sqrt(inp)).astype(np.float32)

    def zc_norm(n):
        # HF stores these zero-centred (effective gain 1 + w); +-0.1 exercises the +1 convention.
        return (rng.standard_normal(n) * 0.1).astype(np.float32)

    w = {}
    p = "model.language_model."
    w[p + "embed_tokens.weight"] = rng.standard_normal((V, H)).astype(np.float32)
    w["lm_head.weight"] = lin(V, H, 3.0)
    w[p + "norm.weight"] = zc_norm(H)
    for i in range(spec["layers"]):
        q = f"{p}layers.{i}."
        w[q + "input_layernorm.weight"] = zc_norm(H)
        w[q + "post_attention_layernorm.weight"] = zc_norm(H)
        if (i + 1) % 4 == 0:
            a = q + "self_attn."
            w[a + "q_proj.weight"] = lin(nh * hd * 2, H)
            w[a + "k_proj.weight"] = lin(nkv * hd, H)
            w[a + "v_proj.weight"] = lin(nkv * hd, H)
            w[a + "o_proj.weight"] = lin(H, nh * hd, 0.7)
            w[a + "q_norm.weight"] = zc_norm(hd)
            w[a + "k_norm.weight"] = zc_norm(hd)
        else:
            g = q + "linear_attn."
            w[g + "in_proj_qkv.weight"] = lin(conv_dim, H)
            w[g + "in_proj_z.weight"] = lin(nv * dv, H)
            w[g + "in_proj_a.weight"] = lin(nv, H)
            w[g + "in_proj_b.weight"] = lin(nv, H, 1.5)
            w[g + "conv1d.weight"] = (rng.standard_normal((conv_dim, 1, 4)) * 0.5).astype(np.float32)
            # Decay rates spread from long to short memory: A in [0.3, 8], dt_bias in [-3, 1].
            w[g + "A_log"] = np.log(rng.uniform(0.3, 8.0, nv)).astype(np.float32)
            w[g + "dt_bias"] = rng.uniform(-3.0, 1.0, nv).astype(np.float32)
            w[g + "norm.weight"] = (1.0 + rng.standard_normal(dv) * 0.1).astype(np.float32)
            w[g + "out_proj.weight"] = lin(H, nv * dv, 0.7)
        m = q + "mlp."
        w[m + "gate.weight"] = lin(E, H, 2.0)
        w[m + "experts.gate_up_proj"] = np.stack([lin(2 * I, H) for _ in range(E)])
        w[m + "experts.down_proj"] = np.stack([lin(H, I, 0.7) for _ in range(E)])
        w[m + "shared_expert.gate_proj.weight"] = lin(Is, H)
        w[m + "shared_expert.up_proj.weight"] = lin(Is, H)
        w[m + "shared_expert.down_proj.weight"] = lin(H, Is, 0.7)
        w[m + "shared_expert_gate.weight"] = lin(1, H, 2.0)
    return w


def build_model(name, out_dir):
    """Writes OUT_DIR/NAME as mlx-lm's convert would from a raw HF checkpoint of these weights."""
    spec = SPECS[name]
    dtype = getattr(mx, spec["dtype"])
    rng = np.random.default_rng(spec["seed"])
    weights = {k: mx.array(v).astype(dtype) for k, v in hf_weights(spec, rng).items()}
    with tempfile.TemporaryDirectory() as src:
        src = pathlib.Path(src)
        (src / "config.json").write_text(json.dumps(hf_config(spec), indent=2))
        mx.save_safetensors(str(src / "model.safetensors"), weights)
        model, config = load_model(src)
    cast_predicate = getattr(model, "cast_predicate", lambda _: True)

    def set_dtype(k, v):
        if cast_predicate(k) and mx.issubdtype(v.dtype, mx.floating):
            return v.astype(dtype)
        return v

    model.update(tree_map_with_path(set_dtype, model.parameters()))
    model, config = quantize_model(model, config, 64, 4, mode="affine")
    dst = pathlib.Path(out_dir) / name
    save_model(dst, model)
    save_config(config, config_path=dst / "config.json")
    return dst


# ---- Deliberately wrong references: each reproduces a bug implementers of this model hit
# (shared/design/MODEL.md section 7), so the tests can show their bounds reject it.

def _text_layers(model):
    return model.language_model.model.layers


def _mut_norm_plus_one(model):
    # "+1 applied twice": the MLX file already stores 1 + w for the five zero-centred norms.
    lm = model.language_model.model
    lm.norm.weight = lm.norm.weight + 1.0
    for layer in _text_layers(model):
        layer.input_layernorm.weight = layer.input_layernorm.weight + 1.0
        layer.post_attention_layernorm.weight = layer.post_attention_layernorm.weight + 1.0
        if not layer.is_linear:
            layer.self_attn.q_norm.weight = layer.self_attn.q_norm.weight + 1.0
            layer.self_attn.k_norm.weight = layer.self_attn.k_norm.weight + 1.0


def _mut_gated_norm_plus_one(model):
    # The GDN gated norm is a plain gain; shifting it too is a separate known bug.
    for layer in _text_layers(model):
        if layer.is_linear:
            layer.linear_attn.norm.weight = layer.linear_attn.norm.weight + 1.0


def _mut_rope_adjacent(model):
    # GPT-J style adjacent pairs (2i, 2i+1) instead of NeoX pairs (i, i + 32).
    for layer in _text_layers(model):
        if not layer.is_linear:
            layer.self_attn.rope.traditional = True


def _mut_attn_scale(model):
    # 1/sqrt(hidden/heads) instead of 1/sqrt(head_dim).
    for layer in _text_layers(model):
        if not layer.is_linear:
            attn = layer.self_attn
            attn.scale = (model.language_model.args.hidden_size / attn.num_attention_heads) ** -0.5


def _mut_qgate_halves(model):
    # q_proj output split into two flat halves instead of per-head [query | gate]: the same as
    # the right code on q_proj rows permuted (quantisation is per row, so rows move intact).
    for layer in _text_layers(model):
        if layer.is_linear:
            continue
        attn = layer.self_attn
        nh, hd = attn.num_attention_heads, attn.head_dim
        order = []
        for h in range(nh):
            order += list(range(h * hd, (h + 1) * hd)) + list(range((nh + h) * hd, (nh + h + 1) * hd))
        idx = mx.array(order)
        for key in ("weight", "scales", "biases"):
            setattr(attn.q_proj, key, getattr(attn.q_proj, key)[idx])


def _mut_no_topk_renorm(model):
    for layer in _text_layers(model):
        layer.mlp.norm_topk_prob = False


def _mut_conv_reversed(model):
    # Tap order reversed (tap 0 applied to the current token).
    for layer in _text_layers(model):
        if layer.is_linear:
            layer.linear_attn.conv1d.weight = layer.linear_attn.conv1d.weight[:, ::-1, :]


def _patch_delta_rule(step):
    """Replaces the recurrence used by qwen3_5's GatedDeltaNet (this process only)."""
    original = mlx_qwen3_5.gated_delta_update

    def patched(q, k, v, a, b, A_log, dt_bias, state=None, mask=None, **kw):
        return step(q, k, v, a, b, A_log, dt_bias, state, original)

    mlx_qwen3_5.gated_delta_update = patched


def _mut_gdn_tiled_heads(model):
    # Value head j reads key head j % nk (llama.cpp's reordered layout) instead of j // (nv/nk).
    def step(q, k, v, a, b, A_log, dt_bias, state, original):
        r = v.shape[-2] // q.shape[-2]
        return original(mx.tile(q, (1, 1, r, 1)), mx.tile(k, (1, 1, r, 1)), v, a, b, A_log,
                        dt_bias, state, use_kernel=False)
    _patch_delta_rule(step)


def _sequential_delta_rule(read_before_decay=False, bf16_state=False):
    """A plain per-token recurrence with one deliberate deviation switched on."""
    def step(q, k, v, a, b, A_log, dt_bias, state, original):
        B, T, Hk, Dk = q.shape
        Hv, Dv = v.shape[-2:]
        r = Hv // Hk
        q, k = mx.repeat(q, r, -2).astype(mx.float32), mx.repeat(k, r, -2).astype(mx.float32)
        beta = mx.sigmoid(b.astype(mx.float32))
        g = mx.exp(-mx.exp(A_log.astype(mx.float32)) * mx.logaddexp(a + dt_bias, 0.0))
        if state is None:
            state = mx.zeros((B, Hv, Dv, Dk), dtype=mx.float32)
        ys = []
        for t in range(T):
            decayed = state * g[:, t, :, None, None]
            kv_mem = ((state if read_before_decay else decayed) * k[:, t, :, None, :]).sum(-1)
            delta = (v[:, t].astype(mx.float32) - kv_mem) * beta[:, t, :, None]
            state = decayed + delta[..., None] * k[:, t, :, None, :]
            if bf16_state:
                state = state.astype(mx.bfloat16).astype(mx.float32)
            ys.append((state * q[:, t, :, None, :]).sum(-1))
        return mx.stack(ys, axis=1).astype(v.dtype), state
    return step


def _mut_gdn_read_before_decay(model):
    # Reads S k with the undecayed state, then decays: plausible-looking but wrong order.
    _patch_delta_rule(_sequential_delta_rule(read_before_decay=True))


def _mut_gdn_state_bf16(model):
    # Recurrent state stored in bf16 between tokens (a precision bug, not a formula bug).
    _patch_delta_rule(_sequential_delta_rule(bf16_state=True))


def _mut_rope_theta_1e6(model):
    # RoPE base 1e6 (the Qwen3 value) instead of this model's 1e7.
    for layer in _text_layers(model):
        if not layer.is_linear:
            layer.self_attn.rope.base = 1e6


MUTATIONS = {
    "norm_plus_one": _mut_norm_plus_one,
    "gated_norm_plus_one": _mut_gated_norm_plus_one,
    "rope_adjacent": _mut_rope_adjacent,
    "attn_scale": _mut_attn_scale,
    "qgate_halves": _mut_qgate_halves,
    "no_topk_renorm": _mut_no_topk_renorm,
    "conv_reversed": _mut_conv_reversed,
    "gdn_tiled_heads": _mut_gdn_tiled_heads,
    "gdn_read_before_decay": _mut_gdn_read_before_decay,
    "gdn_state_bf16": _mut_gdn_state_bf16,
    "rope_theta_1e6": _mut_rope_theta_1e6,
}


def apply_mutation(model, name):
    MUTATIONS[name](model)
    mx.eval(model.parameters())


def upcast_to_f32(model):
    """Same weights (codes, scales, biases, small tensors) in float32, so mlx computes in f32."""
    model.update(tree_map_with_path(
        lambda k, v: v.astype(mx.float32) if mx.issubdtype(v.dtype, mx.floating) else v,
        model.parameters()))
    mx.eval(model.parameters())


def run_reference(model, prompt, steps, chunk=None):
    """Prompt logits through mlx-lm's cache (whole prompt or in chunks), then greedy decode."""
    cache = make_prompt_cache(model)
    rows = []
    if chunk is None:
        rows.append(model(mx.array(prompt)[None], cache=cache)[0])
    else:
        for s in range(0, len(prompt), chunk):
            rows.append(model(mx.array(prompt[s:s + chunk])[None], cache=cache)[0])
            mx.eval(rows[-1])
    logits = [np.array(mx.concatenate(rows, axis=0).astype(mx.float32))]
    generated = [int(np.argmax(logits[0][-1]))]
    for _ in range(steps - 1):
        out = model(mx.array([[generated[-1]]]), cache=cache)[0]
        logits.append(np.array(out.astype(mx.float32)))
        generated.append(int(np.argmax(logits[-1][-1])))
    return np.concatenate(logits, axis=0), generated


def prompt_ids(name):
    spec = SPECS[name]
    rng = np.random.default_rng(1000 + spec["seed"])
    return rng.integers(0, spec["vocab"], PROMPT_LEN).astype(np.int64).tolist()


def record_reference(name, out_dir, mutation=None, check_chunked=False, f32_compute=False):
    """Reloads OUT_DIR/NAME with mlx-lm and writes OUT_DIR/NAME-ref[-f32compute][-MUTATION]."""
    model_dir = pathlib.Path(out_dir) / name
    model, _ = load_model(model_dir)
    if f32_compute:
        upcast_to_f32(model)
    if mutation:
        apply_mutation(model, mutation)
    prompt = prompt_ids(name)
    t0 = time.time()
    logits, generated = run_reference(model, prompt, DECODE_STEPS)
    seconds = time.time() - t0
    scale = float(np.abs(logits).max())
    top2 = np.sort(logits, axis=1)[:, -2:]
    meta = {
        "model": name,
        "mutation": mutation,
        "f32_compute": f32_compute,
        "dtype": SPECS[name]["dtype"],
        "rows": int(logits.shape[0]),
        "vocab": int(logits.shape[1]),
        "prompt_tokens": len(prompt),
        "generated": generated,
        "reference_seconds": round(seconds, 2),
        "logit_std": float(logits.std()),
        "logit_absmax": scale,
        "min_top1_margin": float((top2[:, 1] - top2[:, 0]).min()),
    }
    if check_chunked:
        # mlx-lm fed in chunks of 64 through its cache must give the same logits as one call.
        chunked, chunked_gen = run_reference(model, prompt, DECODE_STEPS, chunk=REFERENCE_CHUNK)
        meta["chunked_vs_whole_max_abs"] = float(np.abs(chunked - logits).max())
        meta["chunked_same_tokens"] = chunked_gen == generated
    ref = pathlib.Path(out_dir) / (f"{name}-ref" + ("-f32compute" if f32_compute else "")
                                   + (f"-{mutation}" if mutation else ""))
    ref.mkdir(parents=True, exist_ok=True)
    np.save(ref / "logits.npy", logits.astype(np.float32))
    np.save(ref / "prompt_ids.npy", np.array(prompt, dtype=np.int64))
    np.save(ref / "generated_ids.npy", np.array(generated, dtype=np.int64))
    (ref / "meta.json").write_text(json.dumps(meta, indent=2))
    return ref, meta


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir")
    ap.add_argument("--models", default=",".join(DEFAULT_MODELS),
                    help=f"comma list from {sorted(SPECS)}")
    ap.add_argument("--mutation", default=None, choices=sorted(MUTATIONS),
                    help="record a deliberately wrong reference (model must already exist)")
    ap.add_argument("--f32-compute", action="store_true",
                    help="reference with every float parameter upcast to f32 (model must exist)")
    ap.add_argument("--check-chunked", action="store_true",
                    help="also run mlx-lm in chunks of 64 and record the difference in meta.json")
    args = ap.parse_args()
    mx.set_default_device(mx.cpu)
    for name in args.models.split(","):
        if name not in SPECS:
            sys.exit(f"unknown model {name!r}; choose from {sorted(SPECS)}")
        if not (args.mutation or args.f32_compute):
            build_model(name, args.out_dir)
        ref, meta = record_reference(name, args.out_dir, args.mutation, args.check_chunked,
                                     args.f32_compute)
        print(json.dumps({k: v for k, v in meta.items() if k != "generated"}))


if __name__ == "__main__":
    main()
