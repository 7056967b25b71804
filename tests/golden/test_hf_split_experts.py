"""HF checkpoints saved with one tensor per expert (transformers 5.x save_pretrained's default,
mlp.experts.E.{gate,up,down}_proj.weight) load to the same model as the fused layout of the
published checkpoint: the committed HF fixture is rewritten per expert and lily's logits must be
bit-identical on both, and still match the transformers goldens."""
import json
import pathlib
import shutil
import struct
import subprocess

import numpy as np

FIXTURE = pathlib.Path(__file__).resolve().parent.parent / "fixtures" / "hf_tiny"


def read_safetensors(path):
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    header.pop("__metadata__", None)
    base = 8 + n
    return {k: (v["dtype"], v["shape"], raw[base + v["data_offsets"][0]:base + v["data_offsets"][1]])
            for k, v in header.items()}


def write_safetensors(path, tensors):
    header, blobs, off = {}, [], 0
    for k, (dtype, shape, data) in tensors.items():
        header[k] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + len(data)]}
        blobs.append(data)
        off += len(data)
    h = json.dumps(header).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    path.write_bytes(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def split_experts(tensors):
    out = {}
    for name, (dtype, shape, data) in tensors.items():
        width = 2 if dtype == "BF16" else 4
        if name.endswith("mlp.experts.gate_up_proj"):
            E, two_i, H = shape
            per = two_i * H * width
            for e in range(E):
                slab = data[e * per:(e + 1) * per]
                out[name[:-len("gate_up_proj")] + f"{e}.gate_proj.weight"] = (dtype, [two_i // 2, H], slab[:per // 2])
                out[name[:-len("gate_up_proj")] + f"{e}.up_proj.weight"] = (dtype, [two_i // 2, H], slab[per // 2:])
        elif name.endswith("mlp.experts.down_proj"):
            E, H, I = shape
            per = H * I * width
            for e in range(E):
                out[name[:-len("down_proj")] + f"{e}.down_proj.weight"] = (dtype, [H, I], data[e * per:(e + 1) * per])
        else:
            out[name] = (dtype, shape, data)
    return out


def run_logits(lily_bin, model_dir, prompt, n, out):
    subprocess.run([lily_bin, "run", "--model", str(model_dir), "--prompt-ids", ",".join(map(str, prompt)),
                    "-n", str(n), "--chunk", "64", "--dump-logits", str(out), "--quiet"], check=True,
                   capture_output=True, text=True)
    meta = json.loads(pathlib.Path(str(out) + ".json").read_text())
    return np.fromfile(out, dtype=np.float32).reshape(meta["rows"], meta["vocab"]), meta


def test_split_expert_layout_matches_fused(lily_bin, tmp_path):
    tensors = read_safetensors(FIXTURE / "model.safetensors")
    split = split_experts(tensors)
    assert len(split) > len(tensors), "fixture has no fused experts to split"
    d = tmp_path / "split"
    d.mkdir()
    shutil.copy(FIXTURE / "config.json", d / "config.json")
    write_safetensors(d / "model.safetensors", split)

    golden = np.load(FIXTURE / "golden.npz")
    prompt = golden["prompt_ids"].tolist()
    n = len(golden["generated_f32"])
    fused, _ = run_logits(lily_bin, FIXTURE, prompt, n, tmp_path / "fused.bin")
    per_expert, meta = run_logits(lily_bin, d, prompt, n, tmp_path / "split.bin")
    assert np.array_equal(fused, per_expert)
    assert meta["generated"] == golden["generated_f32"].tolist()
