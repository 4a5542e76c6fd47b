//! With feature `cuda-emu`, compiles `kernels/*.cu` as host C++ for the SIMT emulator (see
//! `common/emu/build_support.rs`); otherwise does nothing.

include!("../common/emu/build_support.rs");

fn main() {
    emulated_kernels_build_script("../common/emu", "flatpeak_emu_llep", EmuRuntime::Exclude);
}
