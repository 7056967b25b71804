#!/usr/bin/env python3
"""Error metrics between two logit sets [rows, vocab] (engine vs reference) and the pass/fail bounds.

Used by tests/golden/* and by hand:
  compare_logits.py TEST.f32 REF_DIR_or_logits.npy [--bound f32|hf32]
TEST is a raw little-endian float32 file as written by `lily run --dump-logits` (its .json sidecar
gives rows and vocab) or a .npy file.
"""
import argparse
import json
import pathlib
import sys

import numpy as np

# Bounds on errors relative to the reference's largest |logit| (max_rel) and on the whole-array
# RMS relative error (rms_rel). Chosen from the measured figures in docs/VALIDATION.md: well above
# the honest differences (accumulation order, bf16 rounding points) and well below the smallest
# error a known bug produces.
# Measured for lily: max_rel <= 4.0e-6, rms_rel <= 2.7e-6 (mlx f32) and 1.0e-6 / 6.6e-7 (HF f32);
# the smallest bug tried (recurrent state kept in bf16) gives max_rel 2.4e-3, rms_rel 1.4e-3.
BOUNDS = {
    "f32": {"max_rel": 5e-5, "rms_rel": 2e-5},     # mlx-lm computing in f32 vs lily
    "hf32": {"max_rel": 5e-5, "rms_rel": 2e-5},    # HF transformers computing in f32 vs lily
}


def load_dump(path):
    """Reads `lily run --dump-logits` output (raw f32 + FILE.json) or an .npy array."""
    path = pathlib.Path(path)
    if path.suffix == ".npy":
        return np.load(path), None
    meta = json.loads(pathlib.Path(str(path) + ".json").read_text())
    data = np.fromfile(path, dtype="<f4")
    rows, vocab = int(meta["rows"]), int(meta["vocab"])
    if data.size != rows * vocab:
        raise ValueError(f"{path}: {data.size} floats, sidecar says {rows} x {vocab}")
    return data.reshape(rows, vocab), meta


def metrics(test, ref, tie_tol=0.0):
    """Errors of `test` against `ref`, both [rows, vocab].

    A row whose reference top-2 margin is <= tie_tol has no well-defined top-1 (e.g. exact bf16
    ties); there top-1 counts as agreeing when the test's pick is one of the tied reference maxima.
    """
    test = np.asarray(test, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    if test.shape != ref.shape:
        raise ValueError(f"shape mismatch: test {test.shape} vs reference {ref.shape}")
    if not np.isfinite(test).all():
        bad = np.argwhere(~np.isfinite(test))[0]
        raise ValueError(f"non-finite test logit at row {bad[0]}, id {bad[1]}")
    diff = np.abs(test - ref)
    scale = np.abs(ref).max()
    rows = np.arange(ref.shape[0])
    ref_top = ref.argmax(axis=1)
    test_top = test.argmax(axis=1)
    sorted_ref = np.sort(ref, axis=1)
    margin = sorted_ref[:, -1] - sorted_ref[:, -2]
    tied = margin <= tie_tol
    exact = test_top == ref_top
    within_tie = ref[rows, test_top] >= ref[rows, ref_top] - tie_tol
    agree = np.where(tied, within_tie, exact)
    worst = int(diff.max(axis=1).argmax())
    return {
        "rows": int(ref.shape[0]),
        "max_abs": float(diff.max()),
        "max_rel": float(diff.max() / scale),
        "rms_rel": float(np.sqrt((diff ** 2).mean()) / np.sqrt((ref ** 2).mean())),
        "worst_row": worst,
        "top1_agree": float(agree.mean()),
        "top1_exact": float(exact.mean()),
        "tied_rows": int(tied.sum()),
        "first_disagree_row": int(np.argmin(agree)) if not agree.all() else -1,
        "ref_min_margin_untied": float(margin[~tied].min()) if (~tied).any() else 0.0,
    }


def check(m, bound):
    """Failure messages of metrics `m` against BOUNDS[bound] plus 100% top-1 (empty = pass)."""
    b = BOUNDS[bound]
    errors = []
    for key in ("max_rel", "rms_rel"):
        if not m[key] <= b[key]:
            errors.append(f"{key} {m[key]:.3e} > bound {b[key]:.1e}")
    if m["top1_agree"] < 1.0:
        errors.append(f"top-1 agreement {100 * m['top1_agree']:.2f}% (first miss at row "
                      f"{m['first_disagree_row']})")
    return errors


def format_metrics(m):
    return (f"max_abs {m['max_abs']:.3e}  max_rel {m['max_rel']:.3e}  rms_rel {m['rms_rel']:.3e}  "
            f"top1 {100 * m['top1_agree']:.2f}% (exact {100 * m['top1_exact']:.2f}%, "
            f"{m['tied_rows']} tied rows)  worst row {m['worst_row']}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("test")
    ap.add_argument("ref", help="reference dir holding logits.npy, or a .npy file")
    ap.add_argument("--bound", choices=sorted(BOUNDS), default="f32")
    ap.add_argument("--tie-tol", type=float, default=0.0)
    args = ap.parse_args()
    test, _ = load_dump(args.test)
    ref_path = pathlib.Path(args.ref)
    ref = np.load(ref_path / "logits.npy" if ref_path.is_dir() else ref_path)
    m = metrics(test, ref, args.tie_tol)
    print(format_metrics(m))
    errors = check(m, args.bound)
    for e in errors:
        print("FAIL:", e)
    sys.exit(1 if errors else 0)


if __name__ == "__main__":
    main()
