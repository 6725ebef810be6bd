//! Every CUDA kernel source compiles with NVRTC (the pinned wheel from scripts/setup.sh) for sm_80 and sm_90, on a
//! machine without a GPU. A compile error fails the test with NVRTC's log.

use std::path::PathBuf;
use std::process::Command;

/// The NVRTC wheel's library folder: `$KVGATE_NVRTC_LIB_DIR`, else found through `$KVGATE_PYTHON`'s `nvidia`
/// package, else the repository's `.venv`.
fn nvrtc_lib_dir() -> Option<PathBuf> {
    if let Some(d) = std::env::var_os("KVGATE_NVRTC_LIB_DIR") {
        return Some(PathBuf::from(d));
    }
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let python =
        std::env::var_os("KVGATE_PYTHON").map(PathBuf::from).unwrap_or(root.join(".venv/bin/python"));
    let out = Command::new(python)
        .args(["-c", "import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], 'cu13', 'lib'))"])
        .output()
        .ok()?;
    let dir = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    dir.join("libnvrtc.so.13").exists().then_some(dir)
}

#[test]
fn cuda_kernels_compile() {
    let dir = nvrtc_lib_dir().expect(
        "NVRTC not found: scripts/setup.sh installs nvidia-cuda-nvrtc==13.0.88 into .venv (or set KVGATE_NVRTC_LIB_DIR)",
    );
    // The loader path is read at process start, so the compile runs in a child process.
    let out = Command::new(env!("CARGO_BIN_EXE_kvgate-worker"))
        .args(["compile-kernels", "--arch", "sm_80,sm_90"])
        .env("LD_LIBRARY_PATH", &dir)
        .output()
        .expect("run kvgate-worker compile-kernels");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    println!("{stdout}");
    assert!(out.status.success(), "kernels failed to compile:\n{stderr}");
    let n = kvgate_worker::cuda::compile::KERNEL_FILES.len() * 2;
    assert!(stdout.contains(&format!("compiled {n} kernels with NVRTC 13.0")), "{stdout}");
}

/// On a machine with a CUDA GPU, every kernel matches its CPU reference (`gpu-selftest`); elsewhere the test says
/// why it has nothing to run (the GPU check, scripts/gpu-check.sh, runs it on a GPU machine).
#[test]
fn gpu_selftest_passes_where_a_gpu_is_present() {
    if kvgate_worker::cuda::gpu::driver_gpu_count() == 0 {
        eprintln!("skipped: no CUDA driver or GPU on this machine");
        return;
    }
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvgate-worker"));
    cmd.arg("gpu-selftest");
    if let Some(dir) = nvrtc_lib_dir() {
        let path = std::env::var("LD_LIBRARY_PATH").unwrap_or_default();
        cmd.env("LD_LIBRARY_PATH", format!("{}:{path}", dir.display()));
    }
    let out = cmd.output().expect("run gpu-selftest");
    let stdout = String::from_utf8_lossy(&out.stdout);
    println!("{stdout}");
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
}
