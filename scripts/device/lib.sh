# Shared start of the device-call scripts (sourced, not run): SRC (the repository, also the working
# directory), B (build directory, default /root/work/build), OUT (logs, default /tmp/out), el (a log line
# with the seconds since the start), a build into $B (its log in $OUT/${BUILD_LOG:-build.txt}; the script
# exits when it fails) or a carried prebuilt binary (LILY_PREBUILT, below), and L (the binary).
set -o pipefail
SRC=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)   # this file is scripts/device/lib.sh
B=${B:-/root/work/build}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
cd "$SRC"
t0=$(date +%s)
el() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
# LILY_PREBUILT=dir (relative to the repository): a binary that scripts/device/prebuild.sh built on the host and the call
# carried (`carry: ["build-prebuilt"]`), used instead of building here (saves ~100-140 s of device time per fresh machine).
if [ -n "${LILY_PREBUILT:-}" ] && [ -x "$SRC/$LILY_PREBUILT/lily" ] && "$SRC/$LILY_PREBUILT/lily" --help >/dev/null 2>&1; then
  L="$SRC/$LILY_PREBUILT/lily"
  el "prebuilt binary: $(cat "$SRC/$LILY_PREBUILT/BUILT_FROM" 2>/dev/null)"
else
  [ -n "${LILY_PREBUILT:-}" ] && el "prebuilt binary $LILY_PREBUILT/lily missing or not runnable here: building"
  bash scripts/device/build.sh "$B" >"$OUT/${BUILD_LOG:-build.txt}" 2>&1 || { tail -30 "$OUT/${BUILD_LOG:-build.txt}"; exit 1; }
  el "built"
  L="$B/lily"
fi
