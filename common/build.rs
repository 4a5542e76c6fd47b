//! With feature `cuda-emu`, compiles `kernels/*.cu` and the SIMT emulation runtime as host C++
//! (see `emu/build_support.rs`); otherwise does nothing.

include!("emu/build_support.rs");

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    if std::env::var_os("CARGO_FEATURE_CUDA_EMU").is_none() {
        return;
    }
    let dir = std::path::PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets it"));
    build_emulated_kernels(&dir, &dir.join("emu"), "flatpeak_emu_common", true);
}
