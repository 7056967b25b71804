"""Broken checkpoints through the `lily` binary: each must fail with exit status 1 (no crash, no
abort) and a message naming the file / tensor / field. The checkpoints are the built-in demo model
(`lily make-demo`) with one defect each, edited with a small safetensors reader written here from
the format description (8-byte LE header length, JSON header, raw data)."""
import json
import pathlib
import shutil
import struct
import subprocess

import pytest

NORM = "language_model.model.layers.0.input_layernorm.weight"
QPROJ = "language_model.model.layers.3.self_attn.q_proj.weight"


@pytest.fixture(scope="module")
def demo(lily_bin, tmp_path_factory):
    d = tmp_path_factory.mktemp("demo") / "model"
    subprocess.run([lily_bin, "make-demo", "--out", str(d), "--seed", "3"], check=True, capture_output=True, timeout=60)
    return d


def read_st(path):
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def write_st(path, header, data):
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    path.write_bytes(struct.pack("<Q", len(h)) + h + data)


def broken(demo, tmp_path, edit_header=None, edit_config=None, edit_bytes=None):
    d = tmp_path / "broken"
    shutil.copytree(demo, d)
    st = d / "model.safetensors"
    if edit_header:
        header, data = read_st(st)
        edit_header(header)
        write_st(st, header, data)
    if edit_config:
        cfg = json.loads((d / "config.json").read_text())
        edit_config(cfg)
        (d / "config.json").write_text(json.dumps(cfg))
    if edit_bytes:
        st.write_bytes(edit_bytes(st.read_bytes()))
    return d


def run_fails(lily_bin, model_dir, *needles):
    p = subprocess.run([lily_bin, "run", "--model", str(model_dir), "--prompt-ids", "1,2", "-n", "1", "--quiet"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 1, f"rc={p.returncode} (negative = killed by a signal)\n{p.stderr}"
    assert "internal check failed" not in p.stderr and "unexpected error" not in p.stderr, p.stderr
    for n in needles:
        assert str(n) in p.stderr, f"{n!r} not in: {p.stderr}"
    return p.stderr


def test_demo_loads(lily_bin, demo):
    p = subprocess.run([lily_bin, "run", "--model", str(demo), "--prompt-ids", "1,2", "-n", "2", "--quiet"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr


def test_truncated_file(lily_bin, demo, tmp_path):
    d = broken(demo, tmp_path, edit_bytes=lambda b: b[:-1000])
    run_fails(lily_bin, d, d / "model.safetensors", "truncated", "tensor language_model.")


def test_corrupt_header_json(lily_bin, demo, tmp_path):
    d = broken(demo, tmp_path, edit_bytes=lambda b: b[:8] + b"{]" + b[10:])
    run_fails(lily_bin, d, d / "model.safetensors", "corrupt safetensors header")


def test_unsupported_dtype(lily_bin, demo, tmp_path):
    def edit(h):
        h[NORM]["dtype"] = "I16"  # same element size as BF16, so only the dtype is wrong
    d = broken(demo, tmp_path, edit_header=edit)
    run_fails(lily_bin, d, NORM, "I16", d / "model.safetensors")


def test_shape_mismatch(lily_bin, demo, tmp_path):
    def edit(h):
        rows, cols = h[QPROJ]["shape"]
        begin, end = h[QPROJ]["data_offsets"]
        h[QPROJ]["shape"] = [rows // 2, cols]
        h[QPROJ]["data_offsets"] = [begin, begin + (end - begin) // 2]
    d = broken(demo, tmp_path, edit_header=edit)
    run_fails(lily_bin, d, QPROJ, "shape", "expected", d / "model.safetensors")


def test_missing_tensor(lily_bin, demo, tmp_path):
    d = broken(demo, tmp_path, edit_header=lambda h: h.pop(NORM))
    run_fails(lily_bin, d, "missing tensor " + NORM, d / "model.safetensors")


def test_extra_tensor(lily_bin, demo, tmp_path):
    extra = "language_model.model.layers.1.mlp.mystery.weight"
    d = broken(demo, tmp_path, edit_header=lambda h: h.__setitem__(extra, dict(h[NORM])))
    run_fails(lily_bin, d, extra, "unexpected tensor", d / "model.safetensors")


def test_missing_config_field(lily_bin, demo, tmp_path):
    d = broken(demo, tmp_path, edit_config=lambda c: c["text_config"].pop("num_experts"))
    run_fails(lily_bin, d, d / "config.json", "text_config.num_experts", "missing")


def test_unknown_model_type(lily_bin, demo, tmp_path):
    d = broken(demo, tmp_path, edit_config=lambda c: c.update(model_type="llama"))
    run_fails(lily_bin, d, d / "config.json", "model_type", "llama")


def test_unsupported_quantization(lily_bin, demo, tmp_path):
    d = broken(demo, tmp_path, edit_config=lambda c: c["quantization"].update(group_size=32))
    run_fails(lily_bin, d, d / "config.json", "quantization.group_size", "32")


def test_not_a_checkpoint(lily_bin, tmp_path):
    run_fails(lily_bin, tmp_path, tmp_path / "config.json")
    run_fails(lily_bin, tmp_path / "nowhere", tmp_path / "nowhere")
