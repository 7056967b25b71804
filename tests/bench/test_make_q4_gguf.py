"""scripts/device/make_q4_gguf.py (the llama.cpp baseline's input) read back with ggml-org's own `gguf` reader.

A tiny config of the same architecture (4 layers: 3 Gated DeltaNet + 1 attention) and a small byte-level vocabulary;
the reference is the `gguf` package's GGUFReader and its Q4_0 dequantiser, not this repository's code.
"""
import json
import pathlib
import subprocess
import sys

import pytest

gguf = pytest.importorskip("gguf")

ROOT = pathlib.Path(__file__).resolve().parent.parent.parent
SCRIPT = ROOT / "scripts" / "device" / "make_q4_gguf.py"
sys.path.insert(0, str(ROOT / "tests" / "tokenizer"))
from tok_files import _bytes_to_unicode  # noqa: E402

CFG = {
    "text_config": {
        "hidden_size": 64, "num_hidden_layers": 4, "full_attention_interval": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 32,
        "linear_value_head_dim": 32, "linear_conv_kernel_dim": 4,
        "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 64, "vocab_size": 320, "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096,
        "rope_parameters": {"rope_theta": 10000000, "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10]},
    }
}


def byte_vocab():
    # The 256 single-byte tokens of a byte-level BPE vocabulary, in byte order (GPT-2's byte-to-unicode table).
    table = _bytes_to_unicode()
    return [table[b] for b in range(256)]


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    d = tmp_path_factory.mktemp("gguf")
    (d / "config.json").write_text(json.dumps(CFG))
    toks = byte_vocab() + ["Ġt", "he"]
    tok = {"model": {"type": "BPE", "vocab": {t: i for i, t in enumerate(toks)}, "merges": ["Ġ t", "h e"]},
           "added_tokens": [{"id": 258, "content": "<|endoftext|>", "special": True},
                            {"id": 259, "content": "<|im_end|>", "special": True}]}
    (d / "tokenizer.json").write_text(json.dumps(tok))
    out = d / "tiny.gguf"
    r = subprocess.run([sys.executable, str(SCRIPT), "--config", str(d / "config.json"), "--tokenizer",
                        str(d / "tokenizer.json"), "--out", str(out), "--threads", "2"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return gguf.GGUFReader(str(out))


def field(r, key):
    return r.fields[key].contents()


def test_metadata(gguf_file):
    r = gguf_file
    t = CFG["text_config"]
    assert field(r, "general.architecture") == "qwen35moe"
    assert field(r, "qwen35moe.block_count") == 4
    assert field(r, "qwen35moe.embedding_length") == t["hidden_size"]
    assert field(r, "qwen35moe.expert_count") == t["num_experts"]
    assert field(r, "qwen35moe.expert_used_count") == t["num_experts_per_tok"]
    assert field(r, "qwen35moe.ssm.inner_size") == t["linear_num_value_heads"] * t["linear_value_head_dim"]
    assert field(r, "qwen35moe.ssm.group_count") == t["linear_num_key_heads"]
    assert field(r, "qwen35moe.rope.dimension_count") == 16
    assert list(field(r, "qwen35moe.rope.dimension_sections")) == [11, 11, 10, 0]
    tokens = field(r, "tokenizer.ggml.tokens")
    types = field(r, "tokenizer.ggml.token_type")
    assert len(tokens) == len(types) == t["vocab_size"]
    assert tokens[256] == "Ġt" and tokens[259] == "<|im_end|>" and tokens[300] == "<|unused_300|>"
    assert types[0] == 1 and types[259] == 3 and types[300] == 5
    assert field(r, "tokenizer.ggml.eos_token_id") == 259
    assert list(field(r, "tokenizer.ggml.merges")) == ["Ġ t", "h e"]


def test_tensors(gguf_file):
    r = gguf_file
    t = CFG["text_config"]
    H, E, F = t["hidden_size"], t["num_experts"], t["moe_intermediate_size"]
    by = {x.name: x for x in r.tensors}
    # 3 globals + 3 GDN layers x 19 + 1 attention layer x 16, as llama.cpp's qwen35moe loader expects.
    assert len(by) == 3 + 3 * 19 + 16
    Q4, F32 = gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.F32
    conv_dim = 2 * 2 * 32 + 4 * 32
    expect = {
        "token_embd.weight": (Q4, [H, t["vocab_size"]]),
        "blk.0.attn_qkv.weight": (Q4, [H, conv_dim]),
        "blk.0.ssm_conv1d.weight": (F32, [4, conv_dim]),
        "blk.0.ssm_a": (F32, [4]),
        "blk.2.ffn_down_exps.weight": (Q4, [F, H, E]),
        "blk.2.ffn_gate_inp.weight": (F32, [H, E]),
        "blk.3.attn_q.weight": (Q4, [H, 4 * 64 * 2]),
        "blk.3.attn_output.weight": (Q4, [4 * 64, H]),
        "blk.3.ffn_down_shexp.weight": (Q4, [64, H]),
    }
    for name, (ty, shape) in expect.items():
        x = by[name]
        assert x.tensor_type == ty, name
        assert [int(v) for v in x.shape] == shape, name
    assert "blk.3.attn_qkv.weight" not in by and "blk.0.attn_q.weight" not in by
    for x in r.tensors:
        n = 1
        for v in x.shape:
            n *= int(v)
        assert int(x.n_bytes) == (n // 32 * 18 if x.tensor_type == Q4 else 4 * n), x.name


def test_q4_values(gguf_file):
    import numpy as np
    by = {x.name: x for x in gguf_file.tensors}
    for name in ("blk.1.ffn_up_exps.weight", "output.weight", "blk.3.attn_v.weight"):
        x = by[name]
        w = gguf.quants.dequantize(np.asarray(x.data), x.tensor_type)
        assert np.isfinite(w).all()
        # scales in [0.004, 0.008), codes 0..15 around 8: |w| <= 8 * 0.008
        assert np.abs(w).max() <= 0.064 + 1e-6
        assert np.abs(w).max() > 0.02 and w.std() > 0.005   # random codes, not a constant
    norm = np.asarray(by["blk.0.attn_norm.weight"].data)
    assert (norm == 1.0).all()
