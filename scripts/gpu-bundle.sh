#!/usr/bin/env bash
# Builds every test and bench executable with `--features cuda` here and copies them, stripped,
# into .gpu-bundle/ (git ignored), for a GPU machine that has a driver and CUDA libraries but no
# Rust toolchain and no registry. `scripts/gpu-check.sh` runs the bundle when it finds no cargo
# (or when FLATPEAK_GPU_BUNDLE=1). The executables need glibc ≥ the build machine's symbols only.
#     bash scripts/gpu-bundle.sh && du -sh .gpu-bundle
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bundle="$root/.gpu-bundle"
rm -rf "$bundle"
mkdir -p "$bundle/tests" "$bundle/benches"

# The executables cargo reports for one build, as "kind name path" lines.
executables() {
  python3 -c '
import json, os, sys
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("executable"):
        t = m["target"]
        crate = os.path.basename(os.path.dirname(m["manifest_path"]))
        print(t["kind"][0], crate + "." + t["kind"][0] + "." + t["name"], m["executable"])
'
}

cargo test --release --workspace --exclude flatpeak-candle --features cuda --no-run --message-format=json \
  | executables | while read -r kind name path; do
    # Plain-`main` test binaries (harness = false) measure host peaks and take no libtest flags.
    # Examples are programs, not test harnesses.
    [[ "$kind" == example ]] && continue
    case "$name" in *.peak_meter | *.stream_adamw_peak | *.ring_dtp_peak) continue ;; esac
    cp "$path" "$bundle/tests/$name"
  done
cargo bench -p flatpeak-bench --features cuda --no-run --message-format=json \
  | executables | while read -r kind name path; do
    if [[ "$kind" == bench ]]; then cp "$path" "$bundle/benches/$name"; fi
  done
# Only the executables with device tests (ignored elsewhere) travel, and the NVRTC compile check.
for t in "$bundle"/tests/*; do
  if [[ "$t" != *.nvrtc_compile ]] && ! "$t" --list --ignored 2>/dev/null | grep -q ': test$'; then
    rm "$t"
  fi
done
# The CLI, for `flatpeak plan` beside the reach measured on the device (bench_reach.py).
cargo build --release -p flatpeak-bench --bin flatpeak
cp target/release/flatpeak "$bundle/flatpeak"
strip "$bundle"/tests/* "$bundle"/benches/* "$bundle/flatpeak"
# The PyTorch package built with `cuda`, an abi3 wheel that gpu-check.sh installs beside the
# GPU machine's own torch (FLATPEAK_BUNDLE_PYTHON: a python with pip, which fetches maturin).
py="${FLATPEAK_BUNDLE_PYTHON:-python3}"
if "$py" -m pip --version >/dev/null 2>&1; then
  MATURIN_PEP517_ARGS="--features cuda" "$py" -m pip wheel --quiet --disable-pip-version-check \
    --no-deps -w "$bundle/wheel" ./python
else
  echo "gpu-bundle: no pip for $py: the PyTorch package's CUDA tests will be skipped" >&2
fi
git rev-parse --short HEAD >"$bundle/commit"
ls "$bundle/tests" "$bundle/benches" >&2
du -sh "$bundle" >&2
