// What the Rust build script (common/emu/build_support.rs) generates for the self-test kernels:
// one weak definition per distinct `extern __shared__ T name[];` in the kernel sources, each
// FLATPEAK_EMU_MAX_DYNAMIC_SHARED bytes and per OS thread, plus a visitor registered from a static
// constructor, which the runtime calls at each launch to find (and canary) them. `alignas` must
// come after any GNU attribute and before `thread_local`.
#include "simt_emu.hpp"

__attribute__((weak)) alignas(16) thread_local float dyn[FLATPEAK_EMU_MAX_DYNAMIC_SHARED / sizeof(float)];

static void regions(void (*visit)(void*, size_t)) { visit(dyn, sizeof dyn); }
__attribute__((constructor)) static void register_regions() { flatpeak_emu_add_dynamic_shared_visitor(regions); }
