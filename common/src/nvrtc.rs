//! Compiling embedded CUDA C with NVRTC (feature `cuda`). Needs libnvrtc at run time, never a
//! GPU: the CI compile check and the run-time [`KernelCache`](crate::cuda::KernelCache) share it.
//!
//! Headers such as `cuda_bf16.h` are not bundled with NVRTC 12.9; the include directory is taken
//! from, in order: `FLATPEAK_CUDA_INCLUDE`, `/usr/local/cuda/include`, and the pip wheel that
//! `scripts/setup-nvrtc.sh` installs under `.nvrtc/` in this workspace.

use std::ffi::CString;
use std::fmt;
use std::path::PathBuf;

use cudarc::nvrtc::{result, sys};

use crate::error::{Error, Result};
use crate::kernels::KernelSource;

/// A GPU architecture, `sm_{major}{minor}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Arch {
    /// Compute capability major version.
    pub major: u32,
    /// Compute capability minor version.
    pub minor: u32,
}

impl Arch {
    /// Ampere A100.
    pub const SM80: Arch = Arch { major: 8, minor: 0 };
    /// Hopper H100/H200.
    pub const SM90: Arch = Arch { major: 9, minor: 0 };
}

impl fmt::Display for Arch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "sm_{}{}", self.major, self.minor)
    }
}

/// What NVRTC can emit for one source.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    /// Virtual-architecture PTX (`compute_XY`): portable, JIT-compiled by the driver.
    Ptx,
    /// Real-architecture SASS in an ELF cubin (`sm_XY`): loads without driver JIT.
    Cubin,
}

/// NVRTC output: PTX text or cubin bytes, plus the compiler log (warnings).
#[derive(Debug, Clone)]
pub struct Compiled {
    /// PTX text (for [`Target::Ptx`]) or cubin ELF bytes (for [`Target::Cubin`]).
    pub image: Vec<u8>,
    /// Warnings NVRTC printed, possibly empty.
    pub log: String,
}

/// The directories searched for CUDA headers, in priority order, that exist on this machine.
pub fn include_dirs() -> Vec<PathBuf> {
    let mut candidates: Vec<PathBuf> = Vec::new();
    if let Some(dir) = std::env::var_os("FLATPEAK_CUDA_INCLUDE") {
        candidates.push(dir.into());
    }
    candidates.push("/usr/local/cuda/include".into());
    candidates
        .push(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.nvrtc/site/nvidia/cuda_runtime/include"));
    candidates.into_iter().filter(|d| d.join("cuda_bf16.h").is_file()).collect()
}

fn nvrtc_error(op: &'static str, e: result::NvrtcError) -> Error {
    Error::Cuda { op, message: format!("{:?}", e.0) }
}

fn c_text(bytes: Vec<std::ffi::c_char>) -> String {
    let bytes: Vec<u8> = bytes.into_iter().map(|c| c as u8).take_while(|&b| b != 0).collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// Compiles `kernel` for `arch` to `target`. A source error returns
/// [`Error::KernelCompile`] with NVRTC's log; a missing libnvrtc, [`Error::CudaUnavailable`].
pub fn compile(kernel: &KernelSource, arch: Arch, target: Target) -> Result<Compiled> {
    if !crate::device::nvrtc_available() {
        return Err(Error::CudaUnavailable {
            reason: "libnvrtc is not on the loader path (run scripts/setup-nvrtc.sh and export \
                     what it prints)"
                .into(),
        });
    }
    let arch_flag = match target {
        Target::Ptx => format!("--gpu-architecture=compute_{}{}", arch.major, arch.minor),
        Target::Cubin => format!("--gpu-architecture={arch}"),
    };
    let mut options =
        vec![arch_flag, "--std=c++17".to_string(), "--device-as-default-execution-space".into()];
    options.extend(include_dirs().into_iter().map(|d| format!("--include-path={}", d.display())));

    let source = CString::new(kernel.source).map_err(|_| Error::KernelCompile {
        kernel: kernel.name.into(),
        arch: arch.to_string(),
        log: "source contains a NUL byte".into(),
    })?;
    let name = CString::new(format!("{}.cu", kernel.name)).unwrap_or_default();
    let c_string = |text: &str| {
        CString::new(text).map_err(|_| Error::KernelCompile {
            kernel: kernel.name.into(),
            arch: arch.to_string(),
            log: format!("header text or name {text:.40?} contains a NUL byte"),
        })
    };
    let header_sources = kernel.headers.iter().map(|h| c_string(h.source)).collect::<Result<Vec<_>>>()?;
    let header_names = kernel.headers.iter().map(|h| c_string(h.include_name)).collect::<Result<Vec<_>>>()?;
    let source_ptrs: Vec<*const std::ffi::c_char> = header_sources.iter().map(|c| c.as_ptr()).collect();
    let name_ptrs: Vec<*const std::ffi::c_char> = header_names.iter().map(|c| c.as_ptr()).collect();
    let mut prog = std::mem::MaybeUninit::<sys::nvrtcProgram>::uninit();
    // SAFETY: every pointer is a NUL-terminated string owned by a CString that outlives the
    // program (NVRTC may keep them until nvrtcDestroyProgram below); the two header arrays have
    // `headers.len()` entries each; `prog` is a valid out-pointer, initialised on success.
    let prog = unsafe {
        sys::nvrtcCreateProgram(
            prog.as_mut_ptr(),
            source.as_ptr(),
            name.as_ptr(),
            source_ptrs.len() as std::ffi::c_int,
            source_ptrs.as_ptr(),
            name_ptrs.as_ptr(),
        )
        .result()
        .map_err(|e| nvrtc_error("nvrtcCreateProgram", e))?;
        prog.assume_init()
    };
    let outcome = (|| {
        // SAFETY: `prog` was just created by `nvrtcCreateProgram` and is destroyed only below, after
        // this closure; `source`, `name` and the headers outlive it.
        let compiled = unsafe { result::compile_program(prog, &options) };
        // SAFETY: as above; the log exists after any compile attempt.
        let log = unsafe { result::get_program_log(prog) };
        let log = c_text(log.map_err(|e| nvrtc_error("nvrtcGetProgramLog", e))?);
        if compiled.is_err() {
            return Err(Error::KernelCompile { kernel: kernel.name.into(), arch: arch.to_string(), log });
        }
        let image = match target {
            Target::Ptx => {
                // SAFETY: `prog` is live and compiled for a virtual architecture, so PTX exists.
                let ptx = unsafe { result::get_ptx(prog) };
                c_text(ptx.map_err(|e| nvrtc_error("nvrtcGetPTX", e))?).into_bytes()
            }
            Target::Cubin => {
                let mut size = 0usize;
                // SAFETY: `prog` is live and compiled for a real architecture, so a cubin exists;
                // `size` is a valid out-pointer.
                unsafe { sys::nvrtcGetCUBINSize(prog, &mut size) }
                    .result()
                    .map_err(|e| nvrtc_error("nvrtcGetCUBINSize", e))?;
                let mut cubin = vec![0u8; size];
                // SAFETY: `cubin` holds exactly the `size` bytes NVRTC reported for this program.
                unsafe { sys::nvrtcGetCUBIN(prog, cubin.as_mut_ptr().cast()) }
                    .result()
                    .map_err(|e| nvrtc_error("nvrtcGetCUBIN", e))?;
                cubin
            }
        };
        Ok(Compiled { image, log })
    })();
    // SAFETY: `prog` came from `nvrtcCreateProgram` and is destroyed exactly once, here.
    unsafe { result::destroy_program(prog) }.map_err(|e| nvrtc_error("nvrtcDestroyProgram", e))?;
    outcome
}
