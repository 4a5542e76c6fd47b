#!/usr/bin/env bash
# One prepared call for a machine with a CUDA GPU: build with --features cuda, run the tests
# that need a device (ignored elsewhere), run the GPU benches and the report on cuda:0, and print
# a short table last. Logs go to $OUT (or ./gpu-check-out) so they come back even on a timeout.
#     bash scripts/gpu-check.sh
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
out="${OUT:-$root/gpu-check-out}"
mkdir -p "$out"
export CARGO_TERM_COLOR=never

command -v cargo >/dev/null || { echo "gpu-check: cargo not found on this machine" >&2; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv,noheader \
  | tee "$out/gpu.txt"
# NVRTC and the CUDA headers from pip when the machine has no toolkit (libcuda comes with the driver).
if ! ldconfig -p | grep -q libnvrtc || [[ ! -f /usr/local/cuda/include/cuda_bf16.h ]]; then
  eval "$(bash scripts/setup-nvrtc.sh)"
fi

status=()
run_stage() { # name, command...
  local name=$1; shift
  local t0=$SECONDS
  if "$@" >"$out/$name.log" 2>&1; then status+=("$name|ok|$((SECONDS - t0)) s"); else status+=("$name|FAILED|$((SECONDS - t0)) s"); fi
}

run_stage build cargo build --release --workspace --all-targets --features cuda
run_stage gpu-tests env FLATPEAK_REQUIRE_NVRTC=1 cargo test --release --workspace --features cuda -- --include-ignored
run_stage gpu-benches cargo bench -p flatpeak-bench --features cuda -- cuda
run_stage report cargo run --release -p flatpeak-bench --features cuda -- report --device cuda:0 --markdown --json "$out/report.json"

echo
echo "== test binaries (passed / failed / ignored)"
grep -E "^(     Running|test result)" "$out/gpu-tests.log" | paste - - \
  | sed -E 's/.*Running ([^ ]+).*ok\. ([0-9]+) passed; ([0-9]+) failed; ([0-9]+) ignored.*/\1 \2 \3 \4/; s/.*Running ([^ ]+).*FAILED\. ([0-9]+) passed; ([0-9]+) failed; ([0-9]+) ignored.*/\1 \2 \3 \4 FAILED/' \
  | column -t
echo
echo "== GPU benches"
grep -E "^cuda/|time:|thrpt:" "$out/gpu-benches.log" | paste - - - 2>/dev/null | sed 's/  */ /g'
echo
echo "== report (cuda:0)"
cat "$out/report.log"
echo
echo "== stages"
printf '%s\n' "${status[@]}" | column -t -s '|'
printf '%s\n' "${status[@]}" | grep -q FAILED && exit 1 || exit 0
