//! With feature `cuda-emu`, compiles `kernels/*.cu` and the SIMT emulation runtime as host C++
//! (see `emu/build_support.rs`); otherwise does nothing.

include!("emu/build_support.rs");

fn main() {
    emulated_kernels_build_script("emu", "flatpeak_emu_common", EmuRuntime::Include);
}
