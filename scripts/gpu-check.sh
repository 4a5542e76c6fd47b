#!/usr/bin/env bash
# One prepared call for a machine with a CUDA GPU: run the tests that need a device (ignored
# elsewhere) and the GPU benches on cuda:0, and print a short table last. Logs go to $OUT (or
# ./gpu-check-out) so they come back even on a timeout.
#     bash scripts/gpu-check.sh
# With cargo on the machine it builds with `--features cuda` first. Without one (a GPU machine
# with no Rust toolchain and no registry), run `scripts/gpu-bundle.sh` where cargo is, carry
# .gpu-bundle/ along, and this script runs those executables (FLATPEAK_GPU_BUNDLE=1 forces it).
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
out="${OUT:-$root/gpu-check-out}"
mkdir -p "$out"
export CARGO_TERM_COLOR=never
stage_limit="${FLATPEAK_GPU_STAGE_LIMIT:-300}" # seconds for one test or bench executable

command -v nvcc >/dev/null && nvcc --version | tail -n 2
nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv,noheader \
  | tee "$out/gpu.txt"

# cudarc loads libnvrtc, libcublas, libcublasLt and libnccl by their unversioned names (or
# CUDA 12's `.so.12`). Where the machine has them only under another name (a CUDA 13 toolkit,
# NVIDIA's pip wheels), link each one found under its plain name in a private folder.
libs="$root/target/gpu-check-libs"
mkdir -p "$libs"
lib_dirs=()
for lib in nvrtc cublas cublasLt nccl; do
  if ldconfig -p | grep -q "lib$lib\.so "; then continue; fi
  found=$(find /usr/local/cuda/lib64 /usr/local/cuda/targets/*/lib /usr/lib/x86_64-linux-gnu /opt \
    /usr/local/lib -name "lib$lib.so*" ! -name '*builtins*' ! -name '*.alt.*' 2>/dev/null \
    | head -1)
  if [[ -n "$found" ]]; then
    ln -sf "$found" "$libs/lib$lib.so"
    lib_dirs+=("$(dirname "$found")")
    echo "lib$lib.so -> $found"
  fi
done
if [[ ${#lib_dirs[@]} -gt 0 ]]; then
  export LD_LIBRARY_PATH="$libs:$(printf '%s:' "${lib_dirs[@]}")${LD_LIBRARY_PATH:-}"
fi
# Headers for NVRTC and ptxas for the compile check: the machine's toolkit, else the pip wheels.
if [[ -f /usr/local/cuda/include/cuda_bf16.h ]] && command -v nvcc >/dev/null; then
  export FLATPEAK_CUDA_INCLUDE=/usr/local/cuda/include
  export FLATPEAK_PTXAS="$(command -v ptxas || echo /usr/local/cuda/bin/ptxas)"
elif [[ ! -f /usr/local/cuda/include/cuda_bf16.h ]] || ! ldconfig -p | grep -q libnvrtc; then
  eval "$(bash scripts/setup-nvrtc.sh)"
fi
export FLATPEAK_REQUIRE_NVRTC=1

# `column` where the machine has it, else the rows as they are.
table() { if command -v column >/dev/null; then column "$@"; else cat; fi; }

status=()
run_stage() { # name, command...
  local name=$1; shift
  local t0=$SECONDS
  if timeout "$stage_limit" "$@" >"$out/$name.log" 2>&1; then
    status+=("$name|ok|$((SECONDS - t0)) s")
  else
    status+=("$name|FAILED ($?)|$((SECONDS - t0)) s")
  fi
}

bench_flags=(--warm-up-time 1 --measurement-time 3)
# Nsight Compute over flatpeak's calls (bench_cuda.py --profile: each once), where the machine
# has `ncu`: a per-kernel summary of its own kernels and the GEMMs beside them, the first 200
# launches with the speed-of-light section only, so it fits a stage. A profiler the machine
# does not allow (no access to the counters) is reported in its log, not as a failed check.
profile_kernels() { # env prefix (env VAR=... or env)
  if command -v ncu >/dev/null; then
    run_stage ncu "$@" bash -c 'ncu --target-processes all --launch-count 200 --section SpeedOfLight \
      --print-summary per-kernel python3 python/bench/bench_cuda.py --profile || echo "ncu exited $?"'
  else
    status+=("ncu|skipped (no ncu here)|0 s")
  fi
}

# FLATPEAK_GPU_STAGES picks what a bundle run does (a rerun of one part saves device time):
# any of `tests py py-bench benches`, all by default.
stages=" ${FLATPEAK_GPU_STAGES:-tests py py-bench benches} "
want() { [[ "$stages" == *" $1 "* ]]; }
if [[ "${FLATPEAK_GPU_BUNDLE:-}" == 1 ]] || ! command -v cargo >/dev/null; then
  [[ -d .gpu-bundle/tests ]] || { echo "gpu-check: no cargo and no .gpu-bundle/ (run scripts/gpu-bundle.sh)" >&2; exit 1; }
  echo "bundle built at commit $(cat .gpu-bundle/commit 2>/dev/null)"
  : >"$out/gpu-tests.log"
  for t in .gpu-bundle/tests/*; do
    want tests || break
    # The NVRTC compile check is not ignored (CI runs it): run it here against this toolkit too.
    which=--ignored
    [[ "$t" == *.nvrtc_compile ]] && which=--include-ignored
    run_stage "test.$(basename "$t")" "$t" "$which" --test-threads 1
    echo "     Running $(basename "$t")" >>"$out/gpu-tests.log"
    cat "$out/test.$(basename "$t").log" >>"$out/gpu-tests.log"
  done
  # The PyTorch package's CUDA path from the wheel gpu-bundle.sh built with `cuda` (abi3): installed
  # beside the machine's own torch, its CUDA tests run (the CPU ones run in CI).
  wheel=$(ls .gpu-bundle/wheel/*.whl 2>/dev/null | head -1)
  if [[ -n "$wheel" ]] && python3 -c "import torch, pytest; assert torch.cuda.is_available()" 2>/dev/null; then
    site="$root/target/gpu-check-site"
    run_stage py-install python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$site" "$wheel"
    if want py; then
      run_stage py-tests env PYTHONPATH="$site" OMP_NUM_THREADS=4 python3 -m pytest -q -p no:cacheprovider -k cuda \
        python/tests/test_linear_cross_entropy.py python/tests/test_moe.py python/tests/test_ring_loss.py \
        python/tests/test_stream_adamw.py python/tests/test_offload.py python/tests/test_bad_input.py
    fi
    # flatpeak.torch against torch on this GPU: docs/gpu.md's section, written to $out/gpu.md.
    if want py-bench; then
      cp docs/gpu.md "$out/gpu.md"
      run_stage py-bench env PYTHONPATH="$site" python3 python/bench/bench_cuda.py --reps 5 --markdown "$out/gpu.md"
      profile_kernels env PYTHONPATH="$site"
      # Reach on one GPU: the longest sequence under 8 GiB, FSDP2 against FSDP2 + flatpeak.
      run_stage py-reach env PYTHONPATH="$site" FLATPEAK_BIN="$root/.gpu-bundle/flatpeak" \
        python3 python/bench/bench_reach.py --device cuda --markdown "$out/gpu.md"
    fi
  else
    status+=("py-tests|skipped (no .gpu-bundle/wheel, or no torch with CUDA here)|0 s")
  fi
  # The benches last: the tests' verdicts come first when the machine's time is short.
  : >"$out/gpu-benches.log"
  for b in .gpu-bundle/benches/*; do
    want benches || break
    run_stage "bench.$(basename "$b")" "$b" --bench cuda "${bench_flags[@]}"
    cat "$out/bench.$(basename "$b").log" >>"$out/gpu-benches.log"
  done
else
  # flatpeak-candle's `cuda` builds candle's own kernels with nvcc and links the CUDA libraries
  # (candle's choice): it is built apart, below, where the machine has a CUDA toolkit.
  run_stage build cargo build --release --workspace --exclude flatpeak-candle --all-targets --features cuda
  run_stage gpu-tests cargo test --release --workspace --exclude flatpeak-candle --features cuda -- --ignored --test-threads 1
  run_stage nvrtc-compile cargo test --release -p flatpeak-tests --features cuda --test nvrtc_compile
  cat "$out/nvrtc-compile.log" >>"$out/gpu-tests.log"
  run_stage gpu-benches cargo bench -p flatpeak-bench --features cuda -- cuda "${bench_flags[@]}"
  if command -v nvcc >/dev/null; then
    run_stage candle-cuda cargo test --release -p flatpeak-candle --features cuda --test loss -- --nocapture
    cat "$out/candle-cuda.log" >>"$out/gpu-tests.log"
  else
    status+=("candle-cuda|skipped (no nvcc: candle's kernels need a CUDA toolkit)|0 s")
  fi
  # The PyTorch package's CUDA path, where the machine has torch and maturin (the device
  # machine reaches no registry): built with `cuda`, the same pytest file on CUDA tensors.
  if python3 -c "import torch, maturin, pytest; assert torch.cuda.is_available()" 2>/dev/null; then
    run_stage py-build env MATURIN_PEP517_ARGS="--features cuda" python3 -m pip install --no-build-isolation ./python
    run_stage py-tests python3 -m pytest -q -p no:cacheprovider python/tests
    cp docs/gpu.md "$out/gpu.md"
    run_stage py-bench python3 python/bench/bench_cuda.py --reps 5 --markdown "$out/gpu.md"
    profile_kernels env
    run_stage py-reach python3 python/bench/bench_reach.py --device cuda --markdown "$out/gpu.md"
  else
    status+=("py-tests|skipped (no torch+maturin+pytest with CUDA here)|0 s")
  fi
fi

echo
echo "== test binaries (passed / failed / ignored)"
grep -E "^(     Running|test result)" "$out/gpu-tests.log" | paste - - \
  | sed -E 's/.*Running ([^ ]+).*ok\. ([0-9]+) passed; ([0-9]+) failed; ([0-9]+) ignored.*/\1 \2 \3 \4/; s/.*Running ([^ ]+).*FAILED\. ([0-9]+) passed; ([0-9]+) failed; ([0-9]+) ignored.*/\1 \2 \3 \4 FAILED/' \
  | table -t
echo
echo "== failures"
grep -E "^test .* FAILED|panicked at|^Error|error:" "$out/gpu-tests.log" | head -40
echo
echo "== GPU benches"
grep -E "^cuda|time:|thrpt:|GEMMs|per .*M bucket" "$out/gpu-benches.log" | sed 's/  */ /g'
echo
echo "== gemm_efficiency: ring-dtp rows against their dtype's GEMM probe (target >= 0.7 for bf16)"
# Criterion prints a bench's name, then `thrpt: [low mid high]`; rates are GEMM FLOPs per second.
awk '
  /^cuda\// { name = $1 }
  /thrpt:/ {
    gsub(/[\[\]]/, ""); v = $4; u = $5
    m = (u ~ /^T/) ? 1e12 : (u ~ /^G/) ? 1e9 : (u ~ /^M/) ? 1e6 : (u ~ /^K/) ? 1e3 : 1
    rate[name] = v * m
  }
  END {
    for (n in rate) {
      probe = ""
      if (n ~ /ring_dtp.*\/f32_/) probe = "cuda/sgemm_probe/sgemm_8192"
      if (n ~ /ring_dtp.*\/bf16_native/) probe = "cuda/gemm_bf16_probe/gemm_bf16_8192"
      if (n ~ /ring_dtp.*\/bf16_f32gemms/) probe = "cuda/sgemm_probe/sgemm_8192"
      if (probe != "" && rate[probe] > 0) printf "%s %.3f of %s\n", n, rate[n] / rate[probe], probe
    }
  }' "$out/gpu-benches.log" | sort
echo
echo "== PyTorch package on CUDA"
tail -n 3 "$out/py-tests.log" 2>/dev/null
echo
echo "== flatpeak.torch against torch on this GPU"
grep -E "^\| " "$out/py-bench.log" 2>/dev/null
echo
echo "== top kernels under ncu (per-kernel summary: name, launches, duration)"
grep -E "^  [A-Za-z_].*\(|Duration|Invocations" "$out/ncu.log" 2>/dev/null | head -60
echo
echo "== reach on this GPU"
grep -E "^\| |^Longest" "$out/py-reach.log" 2>/dev/null
echo
echo "== stages"
printf '%s\n' "${status[@]}" | table -t -s '|'
printf '%s\n' "${status[@]}" | grep -q FAILED && exit 1 || exit 0
