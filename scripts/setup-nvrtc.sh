#!/usr/bin/env bash
# Installs NVRTC, the CUDA runtime headers and ptxas from NVIDIA's pip wheels into .nvrtc/ (git
# ignored), idempotently, so kernels compile and assemble on a machine without a GPU or a CUDA
# toolkit. Prints the environment to export; use it as:
#     eval "$(bash scripts/setup-nvrtc.sh)"
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
site="$root/.nvrtc/site"
stamp="$root/.nvrtc/installed-12.9"
packages=(
  nvidia-cuda-nvrtc-cu12==12.9.86
  nvidia-cuda-runtime-cu12==12.9.79
  nvidia-cuda-nvcc-cu12==12.9.86
)
if [[ ! -f "$stamp" ]]; then
  python3 -m pip install --quiet --disable-pip-version-check --no-deps --target "$site" --upgrade \
    "${packages[@]}" >&2
  touch "$stamp"
fi
nvrtc_lib="$site/nvidia/cuda_nvrtc/lib"
include="$site/nvidia/cuda_runtime/include"
ptxas="$site/nvidia/cuda_nvcc/bin/ptxas"
for need in "$nvrtc_lib/libnvrtc.so.12" "$include/cuda_bf16.h" "$ptxas"; do
  [[ -e "$need" ]] || { echo "setup-nvrtc: missing $need after install" >&2; exit 1; }
done
# cudarc's loader tries libnvrtc.so first; the wheel ships only the versioned name.
ln -sf libnvrtc.so.12 "$nvrtc_lib/libnvrtc.so"
chmod +x "$ptxas"
echo "export LD_LIBRARY_PATH=\"$nvrtc_lib\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}\""
echo "export FLATPEAK_CUDA_INCLUDE=\"$include\""
echo "export FLATPEAK_PTXAS=\"$ptxas\""
