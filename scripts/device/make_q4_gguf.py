#!/usr/bin/env python3
"""Writes a random-weight Q4_0 GGUF of Qwen3.6-35B-A3B's exact shapes: the llama.cpp baseline's input.

BENCHMARK.md compares lily with llama.cpp's CUDA build "on a Q4_0 GGUF of the same shapes (4.5 bits/weight,
same size class)". No such file can be downloaded here, so this script writes one from the model's
config.json (the `text_config` of shared/reference/qwen3.6-35b-a3b/config.json): architecture `qwen35moe`,
40 layers (30 Gated DeltaNet + 10 gated attention, every 4th), 256 experts top-8 + a shared expert.

Every projection matrix is Q4_0 (blocks of 32 weights: an fp16 scale + 16 bytes of 4-bit codes; random codes,
scales in [0.004, 0.008) so activations stay finite); norms, the router, the GDN gates' small matrices, the
conv kernel, A and dt bias are f32, as llama.cpp's converter keeps them. Speed does not depend on the values;
the file is 19.7 GB. The vocabulary is a real byte-level BPE vocabulary (`--tokenizer`, a Hugging Face
tokenizer.json: its tokens and merges) padded with unused tokens to the model's 248,320 rows, so llama.cpp's
tokenizer loads; llama-bench feeds random token ids and never tokenizes text.

Standard library only (the GGUF v3 container is written directly: header, key/values, tensor infos, data
aligned to 32 bytes). Random data is drawn once per kind and reused across tensors, so writing runs at disk
speed with a few threads.

Usage: make_q4_gguf.py --config config.json --tokenizer tokenizer.json --out model.gguf [--layers N]
"""
import argparse
import json
import os
import random
import struct
import sys
import threading
import time

GGUF_MAGIC = b"GGUF"
ALIGN = 32
# gguf value types
T_UINT32, T_INT32, T_FLOAT32, T_BOOL, T_STRING, T_ARRAY = 4, 5, 6, 7, 8, 9
# ggml tensor types
GGML_F32, GGML_Q4_0 = 0, 2
Q4_0_BLOCK, Q4_0_BYTES = 32, 18


def s_str(s):
    b = s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


def kv_value(vtype, v):
    if vtype == T_UINT32:
        return struct.pack("<I", v)
    if vtype == T_INT32:
        return struct.pack("<i", v)
    if vtype == T_FLOAT32:
        return struct.pack("<f", v)
    if vtype == T_BOOL:
        return struct.pack("<B", 1 if v else 0)
    if vtype == T_STRING:
        return s_str(v)
    raise ValueError(vtype)


def kv(key, vtype, v):
    return s_str(key) + struct.pack("<I", vtype) + kv_value(vtype, v)


def kv_arr(key, etype, items):
    out = [s_str(key), struct.pack("<IIQ", T_ARRAY, etype, len(items))]
    if etype == T_STRING:
        out.extend(s_str(x) for x in items)
    elif etype == T_INT32:
        out.append(struct.pack("<%di" % len(items), *items))
    elif etype == T_FLOAT32:
        out.append(struct.pack("<%df" % len(items), *items))
    else:
        raise ValueError(etype)
    return b"".join(out)


def nbytes(ggml_type, ne):
    n = 1
    for d in ne:
        n *= d
    if ggml_type == GGML_F32:
        return 4 * n
    assert ne[0] % Q4_0_BLOCK == 0, ne
    return n // Q4_0_BLOCK * Q4_0_BYTES


def half_bits(x):
    return struct.unpack("<H", struct.pack("<e", x))[0]


def q4_pool(size, seed):
    """`size` bytes of valid Q4_0 blocks (random codes, small positive scales)."""
    rng = random.Random(seed)
    nblk = size // Q4_0_BYTES
    scales = [struct.pack("<H", half_bits(0.004 + 0.004 * rng.random())) for _ in range(1024)]
    codes = rng.randbytes(16 * 4096)
    out = bytearray(nblk * Q4_0_BYTES)
    for i in range(nblk):
        o = i * Q4_0_BYTES
        out[o:o + 2] = scales[i % 1024]
        c = (i * 16) % len(codes)
        out[o + 2:o + 18] = codes[c:c + 16]
    return bytes(out)


def tensors_for(cfg, layers):
    """(name, ggml_type, ne, fill) in llama.cpp's qwen35moe naming; ne is GGUF order (fastest first)."""
    H = cfg["hidden_size"]
    V = cfg["vocab_size"]
    E = cfg["num_experts"]
    F = cfg["moe_intermediate_size"]
    FS = cfg["shared_expert_intermediate_size"]
    nq, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    K = cfg["linear_conv_kernel_dim"]
    interval = cfg.get("full_attention_interval", 4)
    key_dim, value_dim = nk * dk, nv * dv
    conv_dim = 2 * key_dim + value_dim
    t = [("token_embd.weight", GGML_Q4_0, [H, V], "q"),
         ("output_norm.weight", GGML_F32, [H], "one"),
         ("output.weight", GGML_Q4_0, [H, V], "q")]
    for il in range(layers):
        b = "blk.%d." % il
        t.append((b + "attn_norm.weight", GGML_F32, [H], "one"))
        t.append((b + "post_attention_norm.weight", GGML_F32, [H], "one"))
        if (il + 1) % interval == 0:  # gated full attention
            t.append((b + "attn_q.weight", GGML_Q4_0, [H, nq * hd * 2], "q"))
            t.append((b + "attn_k.weight", GGML_Q4_0, [H, nkv * hd], "q"))
            t.append((b + "attn_v.weight", GGML_Q4_0, [H, nkv * hd], "q"))
            t.append((b + "attn_output.weight", GGML_Q4_0, [nq * hd, H], "q"))
            t.append((b + "attn_q_norm.weight", GGML_F32, [hd], "one"))
            t.append((b + "attn_k_norm.weight", GGML_F32, [hd], "one"))
        else:  # Gated DeltaNet
            t.append((b + "attn_qkv.weight", GGML_Q4_0, [H, conv_dim], "q"))
            t.append((b + "attn_gate.weight", GGML_Q4_0, [H, value_dim], "q"))
            t.append((b + "ssm_conv1d.weight", GGML_F32, [K, conv_dim], "small"))
            t.append((b + "ssm_dt.bias", GGML_F32, [nv], "zero"))
            t.append((b + "ssm_a", GGML_F32, [nv], "neg"))
            t.append((b + "ssm_beta.weight", GGML_F32, [H, nv], "small"))
            t.append((b + "ssm_alpha.weight", GGML_F32, [H, nv], "small"))
            t.append((b + "ssm_norm.weight", GGML_F32, [dv], "one"))
            t.append((b + "ssm_out.weight", GGML_Q4_0, [value_dim, H], "q"))
        t.append((b + "ffn_gate_inp.weight", GGML_F32, [H, E], "small"))
        t.append((b + "ffn_gate_exps.weight", GGML_Q4_0, [H, F, E], "q"))
        t.append((b + "ffn_up_exps.weight", GGML_Q4_0, [H, F, E], "q"))
        t.append((b + "ffn_down_exps.weight", GGML_Q4_0, [F, H, E], "q"))
        t.append((b + "ffn_gate_inp_shexp.weight", GGML_F32, [H], "small"))
        t.append((b + "ffn_gate_shexp.weight", GGML_Q4_0, [H, FS], "q"))
        t.append((b + "ffn_up_shexp.weight", GGML_Q4_0, [H, FS], "q"))
        t.append((b + "ffn_down_shexp.weight", GGML_Q4_0, [FS, H], "q"))
    return t


def f32_pool(kind, n, rng):
    if kind == "one":
        return struct.pack("<%df" % n, *([1.0] * n))
    if kind == "zero":
        return bytes(4 * n)
    if kind == "neg":
        return struct.pack("<%df" % n, *[-(0.5 + rng.random()) for _ in range(n)])
    return struct.pack("<%df" % n, *[(rng.random() - 0.5) * 0.04 for _ in range(n)])


def metadata(cfg, layers, vocab_tokens, token_types, merges, eos_id):
    arch = "qwen35moe"
    rp = cfg.get("rope_parameters", {})
    hd = cfg["head_dim"]
    prf = rp.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25))
    sections = list(rp.get("mrope_section", [11, 11, 10])) + [0]
    sections = (sections + [0, 0, 0, 0])[:4]
    items = [
        kv("general.architecture", T_STRING, arch),
        kv("general.name", T_STRING, "qwen3.6-35b-a3b random Q4_0 (lily benchmark input)"),
        kv("general.file_type", T_UINT32, 2),  # MOSTLY_Q4_0
        kv(arch + ".block_count", T_UINT32, layers),
        kv(arch + ".context_length", T_UINT32, cfg.get("max_position_embeddings", 262144)),
        kv(arch + ".embedding_length", T_UINT32, cfg["hidden_size"]),
        kv(arch + ".attention.head_count", T_UINT32, cfg["num_attention_heads"]),
        kv(arch + ".attention.head_count_kv", T_UINT32, cfg["num_key_value_heads"]),
        kv(arch + ".attention.key_length", T_UINT32, hd),
        kv(arch + ".attention.value_length", T_UINT32, hd),
        kv(arch + ".attention.layer_norm_rms_epsilon", T_FLOAT32, cfg["rms_norm_eps"]),
        kv(arch + ".rope.freq_base", T_FLOAT32, float(rp.get("rope_theta", 1e7))),
        kv(arch + ".rope.dimension_count", T_UINT32, int(hd * prf)),
        kv_arr(arch + ".rope.dimension_sections", T_INT32, sections),
        kv(arch + ".expert_count", T_UINT32, cfg["num_experts"]),
        kv(arch + ".expert_used_count", T_UINT32, cfg["num_experts_per_tok"]),
        kv(arch + ".expert_feed_forward_length", T_UINT32, cfg["moe_intermediate_size"]),
        kv(arch + ".expert_shared_feed_forward_length", T_UINT32, cfg["shared_expert_intermediate_size"]),
        kv(arch + ".ssm.conv_kernel", T_UINT32, cfg["linear_conv_kernel_dim"]),
        kv(arch + ".ssm.inner_size", T_UINT32, cfg["linear_num_value_heads"] * cfg["linear_value_head_dim"]),
        kv(arch + ".ssm.state_size", T_UINT32, cfg["linear_key_head_dim"]),
        kv(arch + ".ssm.time_step_rank", T_UINT32, cfg["linear_num_value_heads"]),
        kv(arch + ".ssm.group_count", T_UINT32, cfg["linear_num_key_heads"]),
        kv(arch + ".full_attention_interval", T_UINT32, cfg.get("full_attention_interval", 4)),
        kv("tokenizer.ggml.model", T_STRING, "gpt2"),
        kv("tokenizer.ggml.pre", T_STRING, "qwen2"),
        kv_arr("tokenizer.ggml.tokens", T_STRING, vocab_tokens),
        kv_arr("tokenizer.ggml.token_type", T_INT32, token_types),
        kv_arr("tokenizer.ggml.merges", T_STRING, merges),
        kv("tokenizer.ggml.eos_token_id", T_UINT32, eos_id),
        kv("tokenizer.ggml.padding_token_id", T_UINT32, eos_id),
        kv("tokenizer.ggml.add_bos_token", T_BOOL, False),
        kv("general.alignment", T_UINT32, ALIGN),
    ]
    return items


def load_vocab(path, V):
    tj = json.load(open(path, encoding="utf-8"))
    model = tj["model"]
    by_id = {i: tok for tok, i in model["vocab"].items()}
    for a in tj.get("added_tokens", []):
        by_id[a["id"]] = a["content"]
    n_real = max(by_id) + 1
    if n_real > V:
        sys.exit("tokenizer has %d tokens, more than the model's %d rows" % (n_real, V))
    tokens = [by_id.get(i, "<|unused_%d|>" % i) for i in range(n_real)]
    tokens += ["<|unused_%d|>" % i for i in range(n_real, V)]
    special = {a["id"] for a in tj.get("added_tokens", []) if a.get("special")}
    # llama.cpp token types: 1 normal, 3 control, 5 unused
    types = [3 if i in special else (1 if i in by_id else 5) for i in range(V)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    eos = next((a["id"] for a in tj.get("added_tokens", []) if a["content"] == "<|im_end|>"), n_real - 1)
    return tokens, types, merges, eos, n_real


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True)
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=0, help="default: the config's num_hidden_layers")
    ap.add_argument("--threads", type=int, default=8)
    a = ap.parse_args()
    t0 = time.time()
    cfg = json.load(open(a.config))
    cfg = cfg.get("text_config", cfg)
    layers = a.layers or cfg["num_hidden_layers"]
    tokens, types, merges, eos, n_real = load_vocab(a.tokenizer, cfg["vocab_size"])
    tensors = tensors_for(cfg, layers)
    kvs = metadata(cfg, layers, tokens, types, merges, eos)

    infos, offsets, off = [], [], 0
    for name, ty, ne, _ in tensors:
        off = (off + ALIGN - 1) // ALIGN * ALIGN
        offsets.append(off)
        infos.append(s_str(name) + struct.pack("<I", len(ne)) + struct.pack("<%dQ" % len(ne), *ne) +
                     struct.pack("<IQ", ty, off))
        off += nbytes(ty, ne)
    total = off
    head = GGUF_MAGIC + struct.pack("<IQQ", 3, len(tensors), len(kvs)) + b"".join(kvs) + b"".join(infos)
    data_start = (len(head) + ALIGN - 1) // ALIGN * ALIGN
    with open(a.out, "wb") as f:
        f.write(head + bytes(data_start - len(head)))
        f.truncate(data_start + total)
    print("[make_q4_gguf] %s: %d tensors, %.2f GB, %d layers, vocab %d (%d from the tokenizer), %d merges" %
          (a.out, len(tensors), (data_start + total) / 1e9, layers, len(tokens), n_real, len(merges)), flush=True)

    pool = q4_pool(18 * 1024 * 1024, 1)  # 18 MiB of blocks, reused with a per-tensor rotation
    rng = random.Random(2)
    jobs = []
    for (name, ty, ne, fill), o in zip(tensors, offsets):
        n = nbytes(ty, ne)
        if ty == GGML_F32:
            jobs.append((data_start + o, f32_pool(fill, n // 4, rng)))
        else:
            jobs.append((data_start + o, n))

    def writer(part):
        fd = os.open(a.out, os.O_WRONLY)
        try:
            for pos, what in part:
                if isinstance(what, bytes):
                    os.pwrite(fd, what, pos)
                    continue
                left, p, rot = what, pos, (pos // Q4_0_BYTES) % 1024 * Q4_0_BYTES
                while left > 0:
                    chunk = min(left, len(pool) - rot)  # both multiples of 18: blocks stay whole
                    os.pwrite(fd, memoryview(pool)[rot:rot + chunk], p)
                    p += chunk
                    left -= chunk
                    rot = 0
        finally:
            os.close(fd)

    jobs.sort(key=lambda j: -(j[1] if isinstance(j[1], int) else len(j[1])))
    parts = [[] for _ in range(max(1, a.threads))]
    loads = [0] * len(parts)
    for j in jobs:
        k = loads.index(min(loads))
        parts[k].append(j)
        loads[k] += j[1] if isinstance(j[1], int) else len(j[1])
    th = [threading.Thread(target=writer, args=(p,)) for p in parts]
    for x in th:
        x.start()
    for x in th:
        x.join()
    dt = time.time() - t0
    print("[make_q4_gguf] wrote %.2f GB in %.1f s (%.2f GB/s)" % ((data_start + total) / 1e9, dt,
                                                                 (data_start + total) / 1e9 / dt), flush=True)


if __name__ == "__main__":
    main()
