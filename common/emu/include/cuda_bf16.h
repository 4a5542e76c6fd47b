// Emulation stub: NVRTC kernels `#include` this CUDA header; under the SIMT emulator (compiled
// with `-I common/emu/include`) everything it would declare comes from simt_emu.hpp.
#pragma once
#include "../simt_emu.hpp"
