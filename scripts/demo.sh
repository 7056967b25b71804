#!/usr/bin/env bash
# Main job demo: build lily if needed, write the tiny demo model, serve it on a free local port,
# stream one chat completion through it with curl (text as it arrives, then tokens/s), stop.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD="${LILY_BUILD_DIR:-$ROOT/build}"
LILY="$BUILD/lily"
DEMO="$ROOT/demo"

if [[ ! -x "$LILY" ]] || ! "$LILY" serve --help >/dev/null 2>&1; then
  echo "== building lily in $BUILD"
  if [[ ! -f "$BUILD/CMakeCache.txt" ]]; then
    GEN=(); command -v ninja >/dev/null && GEN=(-G Ninja)
    cmake -S "$ROOT" -B "$BUILD" "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release >/dev/null
  fi
  cmake --build "$BUILD" --target lily -j"$(nproc)"
fi

echo "== writing the demo model to $DEMO"
"$LILY" make-demo --out "$DEMO"

PORT="$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')"
LOG="$(mktemp)"
"$LILY" serve --model "$DEMO" --port "$PORT" --quiet >"$LOG" 2>&1 &
SERVER=$!
trap 'kill "$SERVER" 2>/dev/null || true; wait "$SERVER" 2>/dev/null || true; rm -f "$LOG"' EXIT

echo "== waiting for http://127.0.0.1:$PORT/health"
for _ in $(seq 1 300); do
  if curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; then break; fi
  if ! kill -0 "$SERVER" 2>/dev/null; then cat "$LOG"; echo "server exited" >&2; exit 1; fi
  sleep 0.1
done

echo "== streaming a chat completion (reasoning in brackets)"
REQUEST='{"model": "demo", "stream": true, "stream_options": {"include_usage": true}, "max_tokens": 64,
          "messages": [{"role": "user", "content": "Write a short story about a robot."}]}'
START="$(date +%s.%N)"
curl -sN "http://127.0.0.1:$PORT/v1/chat/completions" -H 'Content-Type: application/json' -d "$REQUEST" |
  python3 -u -c '
import json, sys, time
start, tokens, reasoning = float(sys.argv[1]), 0, False
for line in sys.stdin:
    line = line.strip()
    if not line.startswith("data: ") or line == "data: [DONE]":
        continue
    chunk = json.loads(line[6:])
    if "error" in chunk:
        sys.exit("server error: " + chunk["error"]["message"])
    if chunk.get("usage"):
        tokens = chunk["usage"]["completion_tokens"]
    for choice in chunk["choices"]:
        delta = choice["delta"]
        if delta.get("reasoning_content"):
            print(("" if reasoning else "[") + delta["reasoning_content"], end="", flush=True)
            reasoning = True
        if delta.get("content"):
            print(("] " if reasoning else "") + delta["content"], end="", flush=True)
            reasoning = False
secs = time.time() - start
print("]" if reasoning else "")
print(f"== {tokens} tokens in {secs:.2f} s: {tokens / secs:.1f} tokens/s (including prompt processing)")
' "$START"
echo "== stopping the server"
