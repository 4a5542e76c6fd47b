#!/usr/bin/env bash
# Builds and runs the SIMT emulator self-test with g++ alone (no cargo, no GPU).
#   bash common/emu/build_selftest.sh [extra g++ flags, e.g. -O0 or -fsanitize=address]
# Kernels get the flags the Rust build should use for every *.cu (-Wno-unknown-pragmas because
# GCC 12 warns on nvcc's `#pragma unroll`); the runtime and the test driver are plain C++.
# Nothing links libubsan: simt_emu.cpp defines the handlers.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# Objects go to $FLATPEAK_EMU_BUILD if set (kept), else to a temporary directory (removed).
if [ -n "${FLATPEAK_EMU_BUILD:-}" ]; then
    out="$FLATPEAK_EMU_BUILD"
    mkdir -p "$out"
else
    out="$(mktemp -d)"
    trap 'rm -rf "$out"' EXIT
fi
cxx="${CXX:-g++}"
common=(-std=c++17 -O2 -g -Wall -Wextra -Werror "$@")
kernel=(-x c++ -include "$here/simt_emu.hpp" -I "$here/include" -fsanitize=bounds -Wno-unknown-pragmas)

"$cxx" "${common[@]}" "${kernel[@]}" -I "$here/../kernels/include" -c "$here/../kernels/common.cu" -o "$out/common.o"
"$cxx" "${common[@]}" "${kernel[@]}" -c "$here/selftest_kernels.cu" -o "$out/selftest_kernels.o"
"$cxx" "${common[@]}" -c "$here/selftest_dynamic_shared.cpp" -o "$out/selftest_dynamic_shared.o"
"$cxx" "${common[@]}" -c "$here/simt_emu.cpp" -o "$out/simt_emu.o"
"$cxx" "${common[@]}" -c "$here/selftest.cpp" -o "$out/selftest.o"
"$cxx" "${common[@]}" -pthread "$out"/selftest.o "$out"/simt_emu.o "$out"/common.o \
    "$out"/selftest_kernels.o "$out"/selftest_dynamic_shared.o -o "$out/selftest"

# The kernels must need no sanitizer runtime beyond the handler the emulator defines.
extra="$(nm -u "$out"/common.o "$out"/selftest_kernels.o | grep -o '__ubsan[A-Za-z_]*' | sort -u |
         grep -v '^__ubsan_handle_out_of_bounds$' || true)"
if [ -n "$extra" ]; then echo "FAIL kernels need unprovided ubsan symbols: $extra"; exit 1; fi

"$out/selftest"
