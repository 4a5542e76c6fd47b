#!/usr/bin/env bash
# Type-checks flatpeak-candle's CUDA path (`--features cuda`) on a machine without a CUDA
# toolkit. candle's `cuda` feature builds its kernels (candle-kernels) with nvcc at build time;
# this script puts a stand-in `nvcc` on the PATH for that build script only: it answers the
# version queries and writes empty PTX, objects and archives. So `cargo clippy` checks every
# line of this crate's CUDA code against candle's and cudarc's real CUDA APIs, but nothing is
# linked or run, and candle's kernels are not compiled. On a machine with a CUDA toolkit, build
# with the real nvcc instead (`cargo test -p flatpeak-candle --features cuda`).
#
# The check shares the workspace's target directory (everything but candle's CUDA side is
# already checked there), so the stand-in's outputs must not outlive it: candle-kernels'
# artifacts (its build script's PTX among them) are removed before and after, on failure too,
# and a later real build runs that build script again with the real nvcc.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
target_dir="${CARGO_TARGET_DIR:-$root/target}"
shim="$target_dir/candle-cuda-check/nvcc-shim"
mkdir -p "$shim/bin"
cat >"$shim/bin/nvcc" <<'SHIM'
#!/usr/bin/env bash
# Stand-in nvcc for type-checking only (scripts/check-candle-cuda.sh): writes empty outputs.
set -euo pipefail
out="" outdir="" lib=0 ptx=0 sources=()
while (($#)); do
  case "$1" in
    --version) printf 'nvcc: NVIDIA (R) Cuda compiler driver\nCopyright (c) NVIDIA Corporation\nBuilt on stand-in\nCuda compilation tools, release 12.9, V12.9.86\n'; exit 0 ;;
    --list-gpu-code) echo sm_90; exit 0 ;;
    -o) out="$2"; shift ;;
    --output-directory) outdir="$2"; shift ;;
    --lib) lib=1 ;;
    --ptx) ptx=1 ;;
    *.cu) sources+=("$1") ;;
  esac
  shift
done
if ((ptx)); then
  for s in "${sources[@]}"; do b="$(basename "$s" .cu)"; printf '// stand-in PTX: type-check build\n' >"$outdir/$b.ptx"; done
elif ((lib)); then
  ar rcs "$out"
else
  : >"$out"
fi
SHIM
chmod +x "$shim/bin/nvcc"
cd "$root"
forget_stand_in() { cargo clean --quiet -p candle-kernels; }
forget_stand_in
trap forget_stand_in EXIT
NVCC="$shim/bin/nvcc" CUDA_COMPUTE_CAP=90 \
  cargo clippy -p flatpeak-candle --all-targets --locked --features cuda -- -D warnings
