//! With feature `cuda-emu`, compiles `kernels/*.cu` as host C++ for the SIMT emulator (see
//! `common/emu/build_support.rs`); otherwise does nothing.

include!("../common/emu/build_support.rs");

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    if std::env::var_os("CARGO_FEATURE_CUDA_EMU").is_none() {
        return;
    }
    let dir = std::path::PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets it"));
    build_emulated_kernels(&dir, &dir.join("../common/emu"), "flatpeak_emu_llep", false);
}
