# Shared start of the device-call scripts (sourced, not run): SRC (the repository, also the working
# directory), B (build directory, default /root/work/build), OUT (logs, default /tmp/out), el (a log line
# with the seconds since the start), a build into $B (its log in $OUT/${BUILD_LOG:-build.txt}; the script
# exits when it fails) and L (the binary).
set -o pipefail
SRC=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)   # this file is scripts/device/lib.sh
B=${B:-/root/work/build}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
cd "$SRC"
t0=$(date +%s)
el() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
bash scripts/device/build.sh "$B" >"$OUT/${BUILD_LOG:-build.txt}" 2>&1 || { tail -30 "$OUT/${BUILD_LOG:-build.txt}"; exit 1; }
el "built"
L="$B/lily"
