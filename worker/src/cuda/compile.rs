//! Kernel sources and their compilation: every `kernels/*.cu` file (with `common.cuh` prepended) is compiled by
//! NVRTC at start for the device's compute capability into CUBIN (machine code: a PTX from a newer NVRTC could not
//! be JIT-compiled by an older driver), and cached on disk keyed by source hash + arch + NVRTC version.
//!
//! NVRTC is loaded at run time (cudarc `dynamic-loading`): the binary links no CUDA library. Callers check
//! [`nvrtc_available`] first; without `libnvrtc.so.13` on the loader path NVRTC's first call would panic.

use std::ffi::{c_char, CStr, CString};
use std::path::{Path, PathBuf};

use cudarc::nvrtc::{result as nvrtc, sys};

use super::gpu::{GpuError, GpuResult};

const COMMON: &str = include_str!("kernels/common.cuh");

/// The kernel families, one source file each (name, source).
pub const KERNEL_FILES: &[(&str, &str)] = &[
    ("elementwise", include_str!("kernels/elementwise.cu")),
    ("norm", include_str!("kernels/norm.cu")),
    ("rope", include_str!("kernels/rope.cu")),
    ("attention", include_str!("kernels/attention.cu")),
    ("sampling", include_str!("kernels/sampling.cu")),
    ("gemv", include_str!("kernels/gemv.cu")),
    ("flash", include_str!("kernels/flash.cu")),
];

/// NVRTC options besides the architecture (no fast math: kernels are checked against f32 references).
const OPTIONS: &[&str] = &["--std=c++17", "-DNDEBUG"];

/// Extra NVRTC options from `KVGATE_NVRTC_EXTRA` (space-separated, e.g. `-DDEC_UNROLL=8`): for kernel experiments
/// on a GPU machine without rebuilding; part of the cache key.
fn extra_options() -> Vec<String> {
    std::env::var("KVGATE_NVRTC_EXTRA").unwrap_or_default().split_whitespace().map(str::to_string).collect()
}

/// Whether `libnvrtc` can be loaded.
pub fn nvrtc_available() -> bool {
    // SAFETY: only tries to open the library.
    unsafe { sys::is_culib_present() }
}

/// NVRTC's version, e.g. `(13, 0)`.
pub fn nvrtc_version() -> GpuResult<(i32, i32)> {
    if !nvrtc_available() {
        return Err(GpuError::NoDevice("libnvrtc is not on the loader path".into()));
    }
    let (mut major, mut minor) = (0, 0);
    // SAFETY: two out-parameters.
    unsafe { sys::nvrtcVersion(&mut major, &mut minor) }
        .result()
        .map_err(|e| GpuError::Call { what: "nvrtcVersion".into(), error: format!("{e:?}") })?;
    Ok((major, minor))
}

/// The full source NVRTC compiles for `file`.
pub fn full_source(src: &str) -> String {
    format!("{COMMON}\n{src}")
}

/// Compiles one kernel file to CUBIN for `arch` (`sm_80`, `sm_90`, ...). Errors carry NVRTC's log.
pub fn compile_cubin(name: &str, src: &str, arch: &str) -> GpuResult<Vec<u8>> {
    if !nvrtc_available() {
        return Err(GpuError::NoDevice("libnvrtc is not on the loader path".into()));
    }
    let source =
        CString::new(full_source(src)).map_err(|_| GpuError::Invalid(format!("{name}: NUL in source")))?;
    let cname = CString::new(format!("{name}.cu")).map_err(|_| GpuError::Invalid("bad name".into()))?;
    let prog = nvrtc::create_program(&source, Some(&cname))
        .map_err(|e| GpuError::Call { what: format!("{name}: create program"), error: format!("{e:?}") })?;
    let mut opts: Vec<String> = OPTIONS.iter().map(|s| s.to_string()).collect();
    opts.extend(extra_options());
    opts.push(format!("--gpu-architecture={arch}"));
    // SAFETY: prog is live until destroy_program below; buffers are sized by NVRTC's own size calls.
    let out = unsafe {
        let compiled = nvrtc::compile_program(prog, &opts);
        let result = match compiled {
            Err(e) => {
                let log = nvrtc::get_program_log(prog)
                    .map(|l| CStr::from_ptr(l.as_ptr()).to_string_lossy().into_owned())
                    .unwrap_or_default();
                Err(GpuError::Compile {
                    kernel: format!("{name}.cu"),
                    arch: arch.to_owned(),
                    error: format!("{e:?}"),
                    log,
                })
            }
            Ok(()) => {
                let mut size = 0usize;
                match sys::nvrtcGetCUBINSize(prog, &mut size).result() {
                    Err(e) => {
                        Err(GpuError::Call { what: format!("{name}: cubin size"), error: format!("{e:?}") })
                    }
                    Ok(()) => {
                        let mut buf = vec![0u8; size];
                        sys::nvrtcGetCUBIN(prog, buf.as_mut_ptr() as *mut c_char)
                            .result()
                            .map(|_| buf)
                            .map_err(|e| GpuError::Call {
                                what: format!("{name}: cubin"),
                                error: format!("{e:?}"),
                            })
                    }
                }
            }
        };
        let _ = nvrtc::destroy_program(prog);
        result
    };
    out
}

/// Where compiled kernels are cached: `$KVGATE_CACHE_DIR/kernels` or `~/.cache/kvgate/kernels`.
pub fn default_cache_dir() -> Option<PathBuf> {
    let base = std::env::var_os("KVGATE_CACHE_DIR")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/kvgate")))?;
    Some(base.join("kernels"))
}

/// The cache file of `name` for `arch` under this NVRTC version.
fn cache_path(dir: &Path, name: &str, src: &str, arch: &str, version: (i32, i32)) -> PathBuf {
    let key = format!("{}\n{arch}\n{version:?}\n{OPTIONS:?}\n{:?}", full_source(src), extra_options());
    let h = xxhash_rust::xxh3::xxh3_64(key.as_bytes());
    dir.join(format!("{name}-{arch}-{h:016x}.cubin"))
}

/// [`compile_cubin`] through the on-disk cache (a cache that cannot be written is only logged).
pub fn compile_cached(name: &str, src: &str, arch: &str, dir: Option<&Path>) -> GpuResult<Vec<u8>> {
    let version = nvrtc_version()?;
    let path = dir.map(|d| cache_path(d, name, src, arch, version));
    if let Some(p) = &path {
        if let Ok(bytes) = std::fs::read(p) {
            if !bytes.is_empty() {
                return Ok(bytes);
            }
        }
    }
    let cubin = compile_cubin(name, src, arch)?;
    if let (Some(p), Some(d)) = (&path, dir) {
        let tmp = p.with_extension(format!("tmp-{}", std::process::id()));
        let written = std::fs::create_dir_all(d)
            .and_then(|_| std::fs::write(&tmp, &cubin))
            .and_then(|_| std::fs::rename(&tmp, p));
        if let Err(e) = written {
            tracing::warn!(path = %p.display(), error = %e, "cannot cache a compiled kernel");
        }
    }
    Ok(cubin)
}

/// Compiles every kernel file for each of `archs`; returns how many (file, arch) pairs compiled.
pub fn compile_all(archs: &[&str]) -> GpuResult<usize> {
    let mut n = 0;
    for arch in archs {
        for (name, src) in KERNEL_FILES {
            compile_cubin(name, src, arch)?;
            n += 1;
        }
    }
    Ok(n)
}
