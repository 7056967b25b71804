#!/usr/bin/env python3
"""Numerical consistency (BENCHMARK.md): lily vs HF transformers, teacher-forced, on the same weights.

Runs on the device (torch + transformers with qwen3_5_moe, numpy, safetensors; no network):
  1. Random weights for a reduced-layer, full-width Qwen3.6-35B-A3B (real hidden size, heads, 256
     experts top-8, real vocabulary unless --vocab; --layers N with every 4th layer attention) are
     drawn on the GPU in the Hugging Face layout, and every matrix the MLX checkpoint quantizes is
     quantized to MLX affine (4-bit group 64; router and shared-expert gate 8-bit; bf16 scales and
     biases). Small vectors are drawn bf16-representable, so both copies hold them exactly.
  2. The codes are written as an MLX checkpoint (lily's input: language_model.* names, switch_mlp
     experts, conv1d [C, K, 1], norms with the +1 folded, small vectors in f32), and the HF model
     gets the dequantized weights (scale * q + bias in f32): HF f32 runs exactly lily's weights;
     HF bf16 runs them rounded to bf16.
  3. Reference sequence: P0 random prompt tokens, then N tokens sampled (temperature 1) from HF f32.
     Teacher-forced logits of the whole sequence from HF f32 and HF bf16 (eager attention), then
     from `lily run --dump-logits` on the CUDA backend with the whole sequence in one chunk, on CUDA
     in chunks of 64 (state carried across chunks), one token per chunk (the T = 1 kernels), and on
     the CPU backend.
  4. At the N positions that predict the continuation: top-1 agreement with HF f32 (and bf16), the
     perplexity of each engine on the continuation, max |diff| and RMS diff of the logits.
Writes OUT/consistency.json and OUT/consistency.md. Pass (BENCHMARK.md target): lily CUDA vs HF f32
top-1 >= 99% and perplexity within 0.5%.

Usage: consistency.py --config config.json --lily build/lily --out DIR [--layers 4] [--vocab 0]
"""
import argparse
import datetime
import json
import pathlib
import subprocess
import sys
import time

import numpy as np
import torch
import transformers

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import compare_logits  # noqa: E402
from hf_golden import cache_of  # noqa: E402

DEV = "cuda"   # --device cpu: a local dry run on a small config (no GPU)
ZERO_CENTRED = ("input_layernorm.weight", "post_attention_layernorm.weight", "q_norm.weight",
                "k_norm.weight")


def log(msg):
    print(f"consistency: {msg}", flush=True)


def make_text_config(path, layers, vocab):
    raw = json.load(open(path))
    tc = dict(raw.get("text_config", raw))
    tc["num_hidden_layers"] = layers
    tc["layer_types"] = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)]
    if vocab:
        tc["vocab_size"] = vocab
        tc["eos_token_id"] = vocab - 1
    tc["mtp_num_hidden_layers"] = 0
    return tc


def bits_of(name):
    """MLX quantization of an HF parameter: 0 (kept as a vector), 4 or 8 bits."""
    if name.endswith(("mlp.gate.weight", "shared_expert_gate.weight")):
        return 8
    if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
        return 4
    if name.endswith(".weight") and "norm" not in name and "conv1d" not in name:
        return 4
    return 0


def quantize(w, bits):
    """MLX affine quantization along the last dim, groups of 64: w ≈ scale * q + bias with bf16 scale
    and bias. Returns (q uint8, scale bf16, bias bf16, dequantized f32)."""
    levels = (1 << bits) - 1
    g = w.reshape(*w.shape[:-1], w.shape[-1] // 64, 64)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / levels).clamp_min(1e-8).to(torch.bfloat16)
    bias = lo.to(torch.bfloat16)
    s, b = scale.float()[..., None], bias.float()[..., None]
    q = torch.round((g - b) / s).clamp_(0, levels)
    deq = (s * q + b).reshape(w.shape)
    return q.to(torch.uint8).reshape(w.shape), scale, bias, deq


def pack(q, bits):
    """uint8 codes [..., cols] -> uint32 words [..., cols * bits / 32]; element i sits at bits
    bits * (i % per) of word i / per (the MLX layout)."""
    per = 32 // bits
    q = q.to(torch.int64).reshape(*q.shape[:-1], q.shape[-1] // per, per)
    shifts = torch.arange(per, device=q.device, dtype=torch.int64) * bits
    words = (q << shifts).sum(-1)
    return words.cpu().numpy().astype(np.uint32)


def bf16_vals(shape, gen, fn):
    """f32 tensor of bf16-representable values fn(randn/uniform)."""
    return fn(shape, gen).to(torch.bfloat16).float()


@torch.no_grad()
def build(args, tc):
    """HF f32 model holding the dequantized weights, and the MLX tensors (numpy) for lily."""
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig
    cfg_kwargs = {k: v for k, v in tc.items() if k not in ("model_type", "dtype", "torch_dtype")}
    config = Qwen3_5MoeTextConfig(**cfg_kwargs)
    with torch.device(DEV):
        model = None
        for kw in ({"attn_implementation": "eager", "experts_implementation": "eager"},
                   {"attn_implementation": "eager"}):
            try:
                model = Qwen3_5MoeForCausalLM._from_config(config, dtype=torch.float32, **kw)
                break
            except (TypeError, ValueError):
                continue
        if model is None:
            model = Qwen3_5MoeForCausalLM._from_config(config, attn_implementation="eager")
    model = model.float().eval()
    # The f32 reference needs the plain per-expert loop (grouped_mm kernels may want bf16).
    try:
        if hasattr(model, "set_experts_implementation"):
            model.set_experts_implementation("eager")
        elif hasattr(model.config, "_experts_implementation"):
            model.config._experts_implementation = "eager"
    except Exception as e:   # older transformers: whatever it has is used, and recorded
        log(f"could not select eager experts: {e}")
    gen = torch.Generator(device=DEV).manual_seed(args.seed)
    randn = lambda shape, g: torch.randn(shape, generator=g, device=DEV)          # noqa: E731
    rand = lambda shape, g: torch.rand(shape, generator=g, device=DEV)            # noqa: E731
    H = tc["hidden_size"]
    mlx = {}
    I = tc["moe_intermediate_size"]
    for name, p in model.named_parameters():
        shape = tuple(p.shape)
        fan_in = shape[-1]
        bits = bits_of(name)
        if name.endswith("A_log"):
            val = bf16_vals(shape, gen, lambda s, g: (1.0 + 15.0 * rand(s, g)).log())
        elif name.endswith("dt_bias"):
            val = bf16_vals(shape, gen, lambda s, g: -6.0 + 4.0 * rand(s, g))
        elif name.endswith("linear_attn.norm.weight"):
            val = bf16_vals(shape, gen, lambda s, g: 1.0 + 0.1 * randn(s, g))
        elif name.endswith(ZERO_CENTRED) or name == "model.norm.weight":
            val = bf16_vals(shape, gen, lambda s, g: 0.1 * randn(s, g))
        elif name.endswith("conv1d.weight"):
            val = bf16_vals(shape, gen, lambda s, g: 0.5 * randn(s, g))
        elif name.endswith("embed_tokens.weight"):
            val = randn(shape, gen)
        elif name.endswith("lm_head.weight"):
            val = randn(shape, gen) * (3.0 / fan_in ** 0.5)   # peaked next-token distributions
        elif name.endswith(("mlp.gate.weight", "shared_expert_gate.weight")):
            val = randn(shape, gen) * (2.0 / fan_in ** 0.5)
        elif p.dim() >= 2:
            gain = 0.7 if name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight", "down_proj")) else 1.0
            val = randn(shape, gen) * (gain / fan_in ** 0.5)
        else:
            raise RuntimeError(f"no init rule for {name} {shape}")
        # MLX name of this tensor.
        base = name[:-len(".weight")] if name.endswith(".weight") else name
        mname = ("language_model.lm_head" if base == "lm_head" else "language_model." + base)
        if bits:
            q, s, b, val = quantize(val, bits)
            if name.endswith("experts.gate_up_proj"):
                root = mname.replace("experts.gate_up_proj", "switch_mlp.")
                for part, sl in (("gate_proj", slice(0, I)), ("up_proj", slice(I, 2 * I))):
                    mlx[root + part + ".weight"] = pack(q[:, sl], bits)
                    mlx[root + part + ".scales"] = s[:, sl].view(torch.int16).cpu().numpy().view(np.uint16)
                    mlx[root + part + ".biases"] = b[:, sl].view(torch.int16).cpu().numpy().view(np.uint16)
            else:
                if name.endswith("experts.down_proj"):
                    mname = mname.replace("experts.down_proj", "switch_mlp.down_proj")
                mlx[mname + ".weight"] = pack(q, bits)
                mlx[mname + ".scales"] = s.view(torch.int16).cpu().numpy().view(np.uint16)
                mlx[mname + ".biases"] = b.view(torch.int16).cpu().numpy().view(np.uint16)
        else:
            m = val
            if name.endswith(ZERO_CENTRED) or name == "model.norm.weight":
                m = 1.0 + val                       # MLX files store the folded gain
            if name.endswith("conv1d.weight"):
                m = val.permute(0, 2, 1)            # [C, 1, K] -> [C, K, 1]
            mlx[mname if not name.endswith(".weight") else mname + ".weight"] = \
                m.contiguous().cpu().numpy().astype(np.float32)
        p.copy_(val)
    return model, config, mlx


def write_mlx(path, tc, tensors):
    path.mkdir(parents=True, exist_ok=True)
    save_bf16_safetensors(path / "model.safetensors", tensors)
    quant = {"group_size": 64, "bits": 4, "mode": "affine"}
    for i in range(tc["num_hidden_layers"]):
        for m in ("mlp.gate", "mlp.shared_expert_gate"):
            quant[f"language_model.model.layers.{i}.{m}"] = {"group_size": 64, "bits": 8}
    cfg = {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
           "text_config": tc, "tie_word_embeddings": False, "quantization": quant,
           "quantization_config": quant}
    (path / "config.json").write_text(json.dumps(cfg, indent=1))


def save_bf16_safetensors(path, tensors):
    """Writes a safetensors file; uint16 arrays (the bf16 scales and biases, kept as raw bits because
    numpy has no bfloat16) are declared BF16."""
    header, offset, blobs = {}, 0, []
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name])
        dtype = {np.dtype(np.uint32): "U32", np.dtype(np.float32): "F32", np.dtype(np.uint16): "BF16"}[a.dtype]
        header[name] = {"dtype": dtype, "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
        blobs.append(a)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(len(h).to_bytes(8, "little"))
        f.write(h)
        for a in blobs:
            f.write(a.tobytes())


@torch.no_grad()
def sample_sequence(model, prompt, n, seed):
    """prompt + n tokens sampled at temperature 1 from the model (its own cache)."""
    gen = torch.Generator(device=DEV).manual_seed(seed + 1)
    out = model(input_ids=torch.tensor([prompt], device=DEV), use_cache=True)
    seq = list(prompt)
    cache = cache_of(out)
    for i in range(n):
        probs = torch.softmax(out.logits[0, -1].double(), -1)
        tok = int(torch.multinomial(probs, 1, generator=gen))
        seq.append(tok)
        if i + 1 < n:
            out = model(input_ids=torch.tensor([[tok]], device=DEV), past_key_values=cache, use_cache=True)
            cache = cache_of(out)
    return seq


@torch.no_grad()
def logits_of(model, seq):
    out = model(input_ids=torch.tensor([seq], device=DEV), use_cache=False)
    return out.logits[0].float().cpu().numpy()


def run_lily(args, model_dir, seq, backend, chunk, dump):
    cmd = [args.lily, "run", "--model", str(model_dir), "--backend", backend, "--prompt-ids",
           ",".join(map(str, seq)), "-n", "1", "--chunk", str(chunk), "--dump-logits", str(dump), "--quiet"]
    t0 = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.lily_timeout)
    if p.returncode != 0:
        raise RuntimeError(f"lily {backend} chunk {chunk} failed ({p.returncode}): {p.stderr[-2000:]}")
    logits, _ = compare_logits.load_dump(dump)
    return logits, time.time() - t0


def perplexity(logits, targets):
    x = logits.astype(np.float64)
    m = x.max(axis=1, keepdims=True)
    lse = (m[:, 0] + np.log(np.exp(x - m).sum(axis=1)))
    nll = lse - x[np.arange(len(targets)), targets]
    return float(np.exp(nll.mean()))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="the published config.json (text_config is used)")
    ap.add_argument("--lily", required=True, help="lily binary (CUDA build)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--work", default="/tmp/lily-consistency", help="where the checkpoint and dumps go")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=0, help="0 = the real vocabulary")
    ap.add_argument("--prompt", type=int, default=64, help="random prompt tokens before the continuation")
    ap.add_argument("--positions", type=int, default=192, help="teacher-forced positions compared")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--lily-timeout", type=int, default=300)
    ap.add_argument("--device", default="cuda", help="torch device of the reference (cpu: local dry run)")
    ap.add_argument("--lily-backends", default="cuda,cuda64,cuda1,cpu",
                    help="lily runs: cuda (one chunk), cuda64 (chunks of 64), cuda1 (one token per chunk), cpu")
    args = ap.parse_args()
    global DEV
    DEV = args.device
    # The f32 reference must be f32: no TF32 in matmuls or in cuDNN's conv1d (the GDN conv fallback).
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    out, work = pathlib.Path(args.out), pathlib.Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    tc = make_text_config(args.config, args.layers, args.vocab)
    model, config, tensors = build(args, tc)
    V = config.vocab_size
    log(f"weights drawn and quantized in {time.time() - t0:.1f} s ({len(tensors)} MLX tensors)")
    write_mlx(work / "model", tc, tensors)
    del tensors
    log(f"MLX checkpoint written to {work / 'model'} ({time.time() - t0:.1f} s)")

    rng = np.random.default_rng(args.seed)
    prompt = rng.integers(0, V, args.prompt).tolist()
    seq = sample_sequence(model, prompt, args.positions, args.seed)
    P, N = len(seq), args.positions
    rows = np.arange(P - N - 1, P - 1)           # logits rows that predict seq[P-N:]
    targets = np.array(seq[P - N:])
    log(f"reference sequence: {args.prompt} random + {N} sampled from HF f32 ({time.time() - t0:.1f} s)")
    ref = {"hf_f32": logits_of(model, seq)}
    model = model.to(torch.bfloat16)
    ref["hf_bf16"] = logits_of(model, seq)
    del model
    if DEV == "cuda":
        torch.cuda.empty_cache()
    log(f"HF logits done ({time.time() - t0:.1f} s)")

    engines = dict(ref)
    all_runs = {"cuda": ("lily_cuda", "cuda", P), "cuda64": ("lily_cuda_chunk64", "cuda", 64),
                "cuda1": ("lily_cuda_chunk1", "cuda", 1), "cpu": ("lily_cpu", "cpu", P)}
    runs = [all_runs[k] for k in args.lily_backends.split(",") if k]
    timing, errors = {}, {}
    for tag, backend, chunk in runs:
        try:
            engines[tag], timing[tag] = run_lily(args, work / "model", seq, backend, chunk, work / f"{tag}.f32")
            log(f"{tag}: {timing[tag]:.1f} s")
        except Exception as e:   # keep going: one failing run must not hide the others
            errors[tag] = str(e)
            log(f"{tag}: FAILED {e}")

    res = {}
    ppl_ref = perplexity(ref["hf_f32"][rows], targets)
    for tag, lg in engines.items():
        ppl = perplexity(lg[rows], targets)
        r = {"perplexity": ppl, "perplexity_rel_diff_vs_hf_f32": ppl / ppl_ref - 1}
        for rname in ("hf_f32", "hf_bf16"):
            if rname == tag:
                continue
            m = compare_logits.metrics(lg[rows], ref[rname][rows])
            r[f"vs_{rname}"] = {"top1_agree_pct": 100 * m["top1_agree"], "max_abs_diff": m["max_abs"],
                                "max_rel_diff": m["max_rel"], "rms_rel_diff": m["rms_rel"],
                                "rms_abs_diff": float(np.sqrt(((lg[rows].astype(np.float64) -
                                                                ref[rname][rows]) ** 2).mean())),
                                "first_disagree_position": m["first_disagree_row"]}
        res[tag] = r
    for tag, r in res.items():
        if tag.startswith("lily"):
            r["meets_target"] = r["vs_hf_f32"]["top1_agree_pct"] >= 99.0 and \
                abs(r["perplexity_rel_diff_vs_hf_f32"]) <= 0.005
    lily_runs = [r for t, r in res.items() if t.startswith("lily")]
    passed = bool(lily_runs) and not errors and all(r["meets_target"] for r in lily_runs)
    sl = np.sort(ref["hf_f32"][rows], axis=1)
    doc = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "machine": torch.cuda.get_device_name(0) if DEV == "cuda" else "cpu", "transformers": transformers.__version__,
           "torch": torch.__version__,
           "model": f"random-weight qwen3.6-35b-a3b, {args.layers} layers (every 4th attention), full width, "
                    f"vocab {V}, MLX 4-bit affine g64 (router/shared gate 8-bit); HF given the dequantized copy",
           "sequence": {"prompt_random": args.prompt, "continuation_sampled_from_hf_f32": N, "seed": args.seed},
           "reference_logit_std": float(ref["hf_f32"][rows].std()),
           "reference_median_top1_margin": float(np.median(sl[:, -1] - sl[:, -2])),
           "hf_attn_implementation": getattr(config, "_attn_implementation", None),
           "hf_experts_implementation": getattr(config, "_experts_implementation", None),
           "engines": res, "lily_seconds": timing, "errors": errors,
           "pass": passed, "target": "every lily run vs hf_f32: top-1 >= 99%, perplexity within 0.5%",
           "seconds": round(time.time() - t0, 1)}
    (out / "consistency.json").write_text(json.dumps(doc, indent=1) + "\n")
    md = [f"# Numerical consistency: lily vs HF transformers {transformers.__version__} ({doc['date']})", "",
          f"- machine: {doc['machine']}", f"- model: {doc['model']}",
          f"- sequence: {args.prompt} random tokens + {N} tokens sampled from HF f32; teacher-forced, "
          f"{N} positions compared", f"- reference logit std {doc['reference_logit_std']:.2f}, median top-1 margin "
          f"{doc['reference_median_top1_margin']:.3f}", "",
          "| engine | perplexity | vs HF f32 ppl | top-1 vs HF f32 | max abs diff | RMS diff | top-1 vs HF bf16 | target |",
          "|---|---:|---:|---:|---:|---:|---:|---|"]
    for tag, r in res.items():
        a, b = r.get("vs_hf_f32"), r.get("vs_hf_bf16")
        md.append(f"| {tag} | {r['perplexity']:.3f} | {100 * r['perplexity_rel_diff_vs_hf_f32']:+.3f}% | "
                  + (f"{a['top1_agree_pct']:.1f}% | {a['max_abs_diff']:.2e} | {a['rms_abs_diff']:.2e} | "
                     if a else "— | — | — | ")
                  + (f"{b['top1_agree_pct']:.1f}% |" if b else "— |")
                  + {True: " met |", False: " **missed** |", None: " |"}[r.get("meets_target")])
    md += ["", f"Target ({doc['target']}): **{'PASS' if passed else 'FAIL'}**"]
    md += [f"- {k}: FAILED: {v[:300]}" for k, v in errors.items()]
    (out / "consistency.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    sys.exit(0 if passed else 1)


if __name__ == "__main__":
    main()
