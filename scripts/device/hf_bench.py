#!/usr/bin/env python3
"""HF transformers baseline on the device: prefill and decode tok/s of Qwen3.6-35B-A3B with random bf16 weights.

The model is built from the real config (the published config.json; its text_config is used) straight
on the GPU in bf16, and every parameter is filled with zero-mean random values (torch.randn * std,
std = 1/sqrt(fan_in), so activations stay finite and routing stays spread): no checkpoint, no
network. Per length L and round: a fresh forward over L random token ids with a new cache and
logits_to_keep=1 (prefill tok/s = L / wall time to the last token's logits), then N greedy tokens
fed one at a time through that cache (decode tok/s = N / wall time). A warm-up (first length) is
discarded. Each length's failure (CUDA OOM or any error) is recorded and the longer lengths are then
skipped; a length predicted to overrun --max-seconds is skipped. Writes OUT (BENCHMARK.md shape,
engine "transformers"; failed or skipped lengths carry an "error" field).

Usage: hf_bench.py --config config.json --out hf.json [--lengths 256,...] [--rounds 3]
                   [--decode-tokens 128] [--max-seconds 120] [--layers 40]
"""
import argparse
import contextlib
import datetime
import gc
import importlib
import importlib.util
import json
import pathlib
import platform
import statistics
import sys
import time

import torch
import transformers

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from hf_golden import cache_of  # noqa: E402  (scripts/hf_golden.py: the HF cache accessor)

DEV = "cuda"   # --device cpu: a local dry run on a small config (no GPU)


def sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


def gdn_kernel_report():
    """Which gated-delta-rule / causal-conv implementation transformers will use here."""
    rep = {"fla_installed": importlib.util.find_spec("fla") is not None,
           "causal_conv1d_installed": importlib.util.find_spec("causal_conv1d") is not None}
    try:
        mod = importlib.import_module("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe")
        for name in ("is_fast_path_available", "chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule",
                     "torch_chunk_gated_delta_rule", "causal_conv1d_fn"):
            obj = getattr(mod, name, None)
            if obj is None:
                continue
            if isinstance(obj, bool):
                rep[name] = obj
            else:
                inner = getattr(obj, "__wrapped__", None)
                rep[name] = f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', '?')}" + (
                    f" (wraps {inner.__module__}.{inner.__qualname__})" if inner is not None else "")
    except Exception as e:   # report, never fail on introspection
        rep["introspection_error"] = repr(e)
    fast = rep["fla_installed"] or bool(rep.get("is_fast_path_available"))
    rep["summary"] = ("fast GDN kernels (flash-linear-attention)" if fast else
                      "torch fallback for the gated delta rule (flash-linear-attention not installed)")
    return rep


def make_config(path, layers):
    from transformers import Qwen3_5MoeTextConfig
    raw = json.load(open(path))
    tc = dict(raw.get("text_config", raw))
    for k in ("model_type", "transformers_version", "architectures", "dtype", "torch_dtype"):
        tc.pop(k, None)
    if layers and layers < tc["num_hidden_layers"]:
        tc["num_hidden_layers"] = layers
        tc["layer_types"] = tc["layer_types"][:layers]
    tc["mtp_num_hidden_layers"] = 0
    return Qwen3_5MoeTextConfig(**tc)


@contextlib.contextmanager
def no_hf_init():
    """Skips transformers' weight init where the installed version offers a switch for it."""
    ctx = None
    for modname in ("transformers.initialization", "transformers.modeling_utils"):
        try:
            ctx = getattr(__import__(modname, fromlist=["no_init_weights"]), "no_init_weights")
            break
        except (ImportError, AttributeError):
            continue
    if ctx is None:
        yield
    else:
        with ctx():
            yield


@torch.no_grad()
def build_model(config, attn, seed):
    from transformers import Qwen3_5MoeForCausalLM
    torch.manual_seed(seed)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(DEV), no_hf_init():
            try:
                model = Qwen3_5MoeForCausalLM._from_config(config, attn_implementation=attn, dtype=torch.bfloat16)
            except TypeError:
                model = Qwen3_5MoeForCausalLM._from_config(config, attn_implementation=attn,
                                                           torch_dtype=torch.bfloat16)
    finally:
        torch.set_default_dtype(old)
    for name, p in model.named_parameters():
        if name.endswith("A_log"):
            p.copy_(torch.empty_like(p, dtype=torch.float32).uniform_(1.0, 16.0).log())
        elif name.endswith("dt_bias"):
            p.copy_(torch.empty_like(p, dtype=torch.float32).uniform_(-6.0, -2.0))
        elif name.endswith("linear_attn.norm.weight"):
            p.copy_(1.0 + 0.1 * torch.randn_like(p, dtype=torch.float32))
        elif name.endswith("norm.weight"):                 # zero-centred (1 + w)
            p.copy_(0.1 * torch.randn_like(p, dtype=torch.float32))
        elif name.endswith("conv1d.weight"):
            p.copy_(0.5 * torch.randn_like(p, dtype=torch.float32))
        elif name.endswith("embed_tokens.weight"):
            p.normal_(0.0, 1.0)
        elif p.dim() >= 2:
            p.normal_(0.0, p.shape[-1] ** -0.5)
        else:
            p.normal_(0.0, 0.1)
    # Rotary tables are buffers computed at construction; make sure none is left uninitialised.
    for name, b in model.named_buffers():
        if not torch.isfinite(b.float()).all():
            raise RuntimeError(f"buffer {name} is not finite after construction")
    return model.eval()


@torch.no_grad()
def one_run(model, ids, L, n_dec):
    """(prefill seconds, decode seconds or None) on a fresh cache."""
    sync()
    t0 = time.perf_counter()
    out = model(input_ids=ids[:, :L], use_cache=True, logits_to_keep=1)
    tok = out.logits[:, -1].argmax(-1, keepdim=True)
    sync()
    t1 = time.perf_counter()
    if n_dec <= 0:
        return t1 - t0, None
    cache = cache_of(out)
    del out
    t2 = time.perf_counter()
    for _ in range(n_dec):
        out = model(input_ids=tok, past_key_values=cache, use_cache=True)
        cache = cache_of(out)
        tok = out.logits[:, -1].argmax(-1, keepdim=True)
    tok.item()   # synchronises
    t3 = time.perf_counter()
    return t1 - t0, t3 - t2


def stats(xs):
    return {"tok_s_median": statistics.median(xs), "tok_s_min": min(xs), "tok_s_max": max(xs), "rounds": len(xs)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="the published config.json (text_config is used)")
    ap.add_argument("--out", required=True, help="result JSON path")
    ap.add_argument("--lengths", default="256,512,1024,2048,4096,8192,16384,32768,65536,131072")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--max-seconds", type=float, default=0, help="time budget after the model is built (0 = none)")
    ap.add_argument("--layers", type=int, default=0, help="first N layers only (0 = all 40)")
    ap.add_argument("--attn", default="sdpa", help="attn_implementation (sdpa | eager | flash_attention_2)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--commit", default="")
    ap.add_argument("--device", default="cuda", help="torch device (cpu: a local dry run)")
    args = ap.parse_args()
    global DEV
    DEV = args.device
    cuda = DEV == "cuda"
    lengths = [int(x) for x in args.lengths.split(",") if x]
    t_start = time.time()
    gdn = gdn_kernel_report()
    print(f"hf_bench: transformers {transformers.__version__}, torch {torch.__version__}; GDN: {gdn['summary']}",
          flush=True)
    print("hf_bench: gdn detail:", json.dumps(gdn), flush=True)
    config = make_config(args.config, args.layers)
    model = build_model(config, args.attn, args.seed)
    nparams = sum(p.numel() for p in model.parameters())
    impl = {"attn_implementation": getattr(model.config, "_attn_implementation", None),
            "experts_implementation": getattr(model.config, "_experts_implementation", None)}
    print(f"hf_bench: model built in {time.time() - t_start:.1f} s, {nparams / 1e9:.2f} B params, "
          f"{torch.cuda.memory_allocated() / 2**30 if cuda else 0:.1f} GiB, {impl}", flush=True)
    gen = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(0, config.vocab_size, (1, max(lengths)), generator=gen).to(DEV)

    def write():
        doc = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
               "machine": (torch.cuda.get_device_name(0) if cuda else "cpu") + f" (host: {platform.processor() or platform.machine()})",
               "commit": args.commit, "command": " ".join(["scripts/device/hf_bench.py"] + sys.argv[1:]),
               "model": f"random-weight qwen3.6-35b-a3b bf16 ({config.num_hidden_layers} layers, "
                        f"{nparams / 1e9:.2f} B params), real config",
               "version": f"transformers {transformers.__version__}", "transformers": transformers.__version__,
               "torch": torch.__version__, "gdn_kernel": gdn["summary"], "gdn_detail": gdn, **impl,
               "notes": "prefill tok_s = L / wall time of one forward over L tokens with a fresh cache "
                        "(logits_to_keep=1) to the last token's argmax; decode tok_s = N greedy tokens fed one at a "
                        "time through that cache; one warm-up at the first length discarded; bf16 weights (not "
                        "4-bit: transformers has no MLX 4-bit path)",
               "results": results}
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)

    results = []
    write()   # a valid (empty) file even if the run is killed before the first length
    t_bench = time.time()
    one_run(model, ids, lengths[0], min(args.decode_tokens, 8))   # warm-up, discarded
    prev, failed_at = None, None
    for L in lengths:
        base = {"engine": "transformers", "length": L, "ablate": []}
        elapsed = time.time() - t_bench
        predicted = prev[1] * L / prev[0] * 1.5 if prev else 0.0
        reason = None
        if failed_at is not None:
            reason = f"skipped: failed at {failed_at}"
        elif args.max_seconds > 0 and elapsed + predicted > args.max_seconds and prev is not None:
            reason = f"skipped: predicted {predicted:.0f} s, {elapsed:.0f} of {args.max_seconds:.0f} s used"
        if reason:
            print(f"hf_bench: {L:6d} {reason}", flush=True)
            for ph in ("prefill", "decode"):
                results.append(dict(base, phase=ph, tok_s_median=0.0, rounds=0, error=reason))
            continue
        t0 = time.time()
        pre, dec, err = [], [], None
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        try:
            for _ in range(args.rounds):
                tp, td = one_run(model, ids, L, args.decode_tokens)
                pre.append(L / tp)
                if td is not None:
                    dec.append(args.decode_tokens / td)
                if args.max_seconds > 0 and time.time() - t_bench > args.max_seconds and len(pre) >= 1:
                    break   # budget spent: keep the rounds done so far
        except Exception as e:   # torch.cuda.OutOfMemoryError included
            err = ("OOM: " if isinstance(e, torch.cuda.OutOfMemoryError) else "error: ") + str(e).split("\n")[0][:200]
        if err:   # outside the except block, so the exception's frames (and tensors) are gone
            print(f"hf_bench: {L:6d} {err}", flush=True)
            failed_at = L
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
            if not pre:
                for ph in ("prefill", "decode"):
                    results.append(dict(base, phase=ph, tok_s_median=0.0, rounds=0, error=err))
                write()
                continue
        peak = torch.cuda.max_memory_allocated() if cuda else 0
        prev = (L, time.time() - t0)
        results.append(dict(base, phase="prefill", **stats(pre), peak_device_bytes=peak))
        if dec:
            results.append(dict(base, phase="decode", **stats(dec), tokens=args.decode_tokens,
                                peak_device_bytes=peak))
        print(f"hf_bench: {L:6d} prefill {statistics.median(pre):9.1f} tok/s"
              + (f"  decode {statistics.median(dec):7.1f} tok/s" if dec else "")
              + f"  ({len(pre)} rounds, {prev[1]:.1f} s, peak {peak / 2**30:.1f} GiB)", flush=True)
        if cuda:
            torch.cuda.empty_cache()
        write()   # after every length: a budget kill keeps what was measured

    write()
    print(f"hf_bench: wrote {args.out} in {time.time() - t_start:.0f} s total", flush=True)


if __name__ == "__main__":
    main()
