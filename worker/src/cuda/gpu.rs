//! The device runtime: a CUDA context on one GPU, its stream, a cuBLAS handle, the compiled kernel modules, device
//! buffers (freed on `Drop`), kernel launches and the GEMM shapes the model needs. Everything goes through one
//! stream, so ordering is the stream's and host reads synchronise it.

use std::collections::HashMap;
use std::ffi::{c_void, CString};
use std::sync::Arc;

use cudarc::cublas::{result as blas, sys as blas_sys, CudaBlas};
use cudarc::driver::{result as drv, sys as drv_sys, CudaContext, CudaStream};

use super::compile;
use super::DType;
use crate::engine::BackendError;

/// Decode-sized products (at most this many rows) run on the GEMV kernel instead of cuBLAS. Measured on an H200
/// (docs/benchmarks/gpu.md): at 8 rows the kernel was slower than cuBLAS, at 1 row faster.
pub const GEMV_MAX_ROWS: usize = 2;

/// A failure on the GPU (never retried: the step fails, the engine carries on; at start the worker exits with it).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum GpuError {
    /// No usable device: no driver library, fewer GPUs than the ordinal, an architecture without kernels.
    #[error("{0}")]
    NoDevice(String),
    /// A CUDA driver, cuBLAS or NVRTC call failed: what was being done and the library's error.
    #[error("{what}: {error}")]
    Call { what: String, error: String },
    /// The host refused an argument before any call (a copy out of a buffer's bounds, a shape the kernels lack).
    #[error("{0}")]
    Invalid(String),
    /// NVRTC refused a kernel source: its log says why.
    #[error("{kernel} for {arch}: {error}\n{log}")]
    Compile { kernel: String, arch: String, error: String, log: String },
}

impl From<String> for GpuError {
    fn from(s: String) -> Self {
        GpuError::Invalid(s)
    }
}

impl From<&str> for GpuError {
    fn from(s: &str) -> Self {
        GpuError::Invalid(s.to_owned())
    }
}

/// A GPU failure as text, for callers that only print it (start-up, the `gpu-*` subcommands).
impl From<GpuError> for String {
    fn from(e: GpuError) -> Self {
        e.to_string()
    }
}

/// What the engine's backend boundary says of a GPU failure (the same text): the driver's or cuBLAS's
/// out-of-memory is [`BackendError::OutOfDeviceMemory`]; NVRTC, loading a module, finding or launching a kernel
/// (cuBLAS GEMMs included) is [`BackendError::Kernel`]; any other driver call and a missing device is
/// [`BackendError::Device`]; an argument the host refused is [`BackendError::InvalidInput`].
impl From<GpuError> for BackendError {
    fn from(e: GpuError) -> Self {
        let message = e.to_string();
        match &e {
            GpuError::Call { error, .. }
                if error.contains("OUT_OF_MEMORY") || error.contains("ALLOC_FAILED") =>
            {
                BackendError::OutOfDeviceMemory(message)
            }
            GpuError::Call { what, .. } if is_kernel_call(what) => BackendError::Kernel(message),
            GpuError::Compile { .. } => BackendError::Kernel(message),
            GpuError::Call { .. } | GpuError::NoDevice(_) => BackendError::Device(message),
            GpuError::Invalid(_) => BackendError::InvalidInput(message),
        }
    }
}

/// Whether a failed call (named as [`derr`]'s callers name it) was about a kernel rather than the device.
fn is_kernel_call(what: &str) -> bool {
    ["launch ", "kernel ", "load ", "smem attribute", "cublas gemm"].iter().any(|p| what.starts_with(p))
        || what.contains(": create program")
        || what.contains(": cubin")
}

/// A result on the GPU.
pub type GpuResult<T> = Result<T, GpuError>;

fn derr(what: &str, e: impl std::fmt::Debug) -> GpuError {
    GpuError::Call { what: what.to_owned(), error: format!("{e:?}") }
}

/// Whether a CUDA driver library can be loaded and sees at least one GPU.
pub fn driver_gpu_count() -> usize {
    // SAFETY: only tries to open the library.
    if !unsafe { drv_sys::is_culib_present() } {
        return 0;
    }
    if drv::init().is_err() {
        return 0;
    }
    drv::device::get_count().map_or(0, |n| n.max(0) as usize)
}

/// One GPU, ready to launch kernels.
pub struct Gpu {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    funcs: HashMap<String, drv_sys::CUfunction>,
    _modules: Vec<drv_sys::CUmodule>,
    pub ordinal: usize,
    pub name: String,
    pub arch: String,
    pub total_mem: usize,
}

// SAFETY: the raw function and module handles are plain driver handles valid in the context, which is bound to
// whichever thread uses the Gpu (`bind`); the Gpu is used by one thread at a time (&mut in the engine).
unsafe impl Send for Gpu {}

impl std::fmt::Debug for Gpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Gpu(cuda:{} {} {})", self.ordinal, self.name, self.arch)
    }
}

impl Gpu {
    /// Opens GPU `ordinal`, compiles (or loads from the cache) every kernel for its architecture.
    pub fn open(ordinal: usize) -> GpuResult<Self> {
        if driver_gpu_count() <= ordinal {
            return Err(GpuError::NoDevice(format!(
                "no CUDA GPU {ordinal} (driver library missing or fewer GPUs)"
            )));
        }
        if !compile::nvrtc_available() {
            return Err(GpuError::NoDevice(
                "libnvrtc.so.13 is not on the loader path (CUDA 13 runtime or the nvidia-cuda-nvrtc wheel)"
                    .into(),
            ));
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| derr("cuda context", e))?;
        // One stream only: cudarc's per-buffer event tracking is not needed.
        // SAFETY: no cudarc-managed buffers exist yet.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.default_stream();
        let blas = CudaBlas::new(stream.clone())
            .map_err(|e| derr("cublas (libcublas.so.13 on the loader path?)", e))?;
        let (major, minor) = ctx.compute_capability().map_err(|e| derr("compute capability", e))?;
        let arch = format!("sm_{major}{minor}");
        let name = ctx.name().unwrap_or_else(|_| "unknown GPU".into());
        let total_mem = ctx.total_mem().unwrap_or(0);
        let cache = compile::default_cache_dir();
        let mut funcs = HashMap::new();
        let mut modules = Vec::new();
        for (file, src) in compile::KERNEL_FILES {
            let cubin = compile::compile_cached(file, src, &arch, cache.as_deref())?;
            // SAFETY: the image is a complete CUBIN for this device; the module lives as long as the Gpu.
            let module = unsafe { drv::module::load_data(cubin.as_ptr() as *const c_void) }
                .map_err(|e| derr(&format!("load {file} cubin"), e))?;
            modules.push(module);
            for name in kernel_names(&compile::full_source(src)) {
                let cname = CString::new(name.clone()).map_err(|_| "kernel name".to_string())?;
                // SAFETY: module is loaded; name is a kernel of it.
                let f = unsafe { drv::module::get_function(module, cname) }
                    .map_err(|e| derr(&format!("kernel {name}"), e))?;
                funcs.insert(name, f);
            }
        }
        let gpu = Self { ctx, stream, blas, funcs, _modules: modules, ordinal, name, arch, total_mem };
        // Kernels with large tiles (flash prefill) or long splits (decode) opt in to more shared memory.
        let names: Vec<String> = gpu
            .funcs
            .keys()
            .filter(|n| n.starts_with("flash_") || n.starts_with("paged_decode"))
            .cloned()
            .collect();
        for n in names {
            gpu.allow_smem(&n, super::attention::MAX_DYNAMIC_SMEM)?;
        }
        Ok(gpu)
    }

    /// Makes the context current on this thread (the engine runs on its own thread).
    pub fn bind(&self) -> GpuResult<()> {
        self.ctx.bind_to_thread().map_err(|e| derr("bind context", e))
    }

    /// (free, total) device memory in bytes.
    pub fn mem_info(&self) -> GpuResult<(usize, usize)> {
        self.bind()?;
        drv::mem_get_info().map_err(|e| derr("mem info", e))
    }

    pub fn sync(&self) -> GpuResult<()> {
        self.stream.synchronize().map_err(|e| derr("synchronize", e))
    }

    fn cu_stream(&self) -> drv_sys::CUstream {
        self.stream.cu_stream()
    }

    /// An uninitialised buffer of `bytes`.
    pub fn alloc(&self, bytes: usize) -> GpuResult<DevBuf> {
        self.bind()?;
        // SAFETY: plain device allocation, freed by DevBuf's Drop.
        let ptr = unsafe { drv::malloc_sync(bytes.max(1)) }
            .map_err(|e| derr(&format!("allocate {} MiB", bytes >> 20), e))?;
        Ok(DevBuf { ptr, bytes, ctx: self.ctx.clone() })
    }

    /// A zeroed buffer of `bytes`.
    pub fn zeros(&self, bytes: usize) -> GpuResult<DevBuf> {
        let b = self.alloc(bytes)?;
        // SAFETY: b is bytes long.
        unsafe { drv::memset_d8_async(b.ptr, 0, bytes, self.cu_stream()) }.map_err(|e| derr("memset", e))?;
        Ok(b)
    }

    /// Copies `src` into `dst` (at its start); `dst` must be large enough.
    pub fn upload<T: Copy>(&self, dst: &DevBuf, src: &[T]) -> GpuResult<()> {
        let bytes = std::mem::size_of_val(src);
        if bytes > dst.bytes {
            return Err(format!("upload of {bytes} bytes into a {} byte buffer", dst.bytes).into());
        }
        if bytes == 0 {
            return Ok(());
        }
        // SAFETY: sizes checked; synchronous with respect to the host buffer.
        unsafe { drv::memcpy_htod_sync(dst.ptr, src) }.map_err(|e| derr("upload", e))
    }

    /// A new buffer holding `src`.
    pub fn upload_new<T: Copy>(&self, src: &[T]) -> GpuResult<DevBuf> {
        let b = self.alloc(std::mem::size_of_val(src))?;
        self.upload(&b, src)?;
        Ok(b)
    }

    /// Reads `out.len()` elements from `src + byte_offset` (waits for the stream).
    pub fn download<T: Copy>(&self, out: &mut [T], src: &DevBuf, byte_offset: usize) -> GpuResult<()> {
        let bytes = std::mem::size_of_val(out);
        if byte_offset + bytes > src.bytes {
            return Err("download past the end of a buffer".into());
        }
        self.sync()?;
        // SAFETY: bounds checked above.
        unsafe { drv::memcpy_dtoh_sync(out, src.ptr + byte_offset as u64) }.map_err(|e| derr("download", e))
    }

    /// Reads `len` bytes at each `(buffer, byte offset)` in turn into one host vector, after one wait for the
    /// stream (KV blocks copied down to a lower tier).
    pub fn read_ranges(&self, ranges: &[(&DevBuf, usize)], len: usize) -> GpuResult<Vec<u8>> {
        if ranges.iter().any(|(b, off)| off + len > b.bytes) {
            return Err("read past the end of a buffer".into());
        }
        let mut out = vec![0u8; ranges.len() * len];
        self.sync()?;
        for ((b, off), dst) in ranges.iter().zip(out.chunks_exact_mut(len.max(1))) {
            // SAFETY: bounds checked above; the stream is idle.
            unsafe { drv::memcpy_dtoh_sync(dst, b.ptr + *off as u64) }.map_err(|e| derr("read ranges", e))?;
        }
        Ok(out)
    }

    /// Writes consecutive `len`-byte parts of `src` to each `(buffer, byte offset)` in turn (KV blocks loaded from
    /// a lower tier; ordered before later launches like [`Gpu::upload`]).
    pub fn write_ranges(&self, ranges: &[(&DevBuf, usize)], len: usize, src: &[u8]) -> GpuResult<()> {
        if src.len() != ranges.len() * len || ranges.iter().any(|(b, off)| off + len > b.bytes) {
            return Err(format!("write of {} bytes to {} ranges of {len}", src.len(), ranges.len()).into());
        }
        if len == 0 {
            return Ok(());
        }
        for ((b, off), part) in ranges.iter().zip(src.chunks_exact(len)) {
            // SAFETY: bounds checked above; synchronous with respect to the host buffer.
            unsafe { drv::memcpy_htod_sync(b.ptr + *off as u64, part) }
                .map_err(|e| derr("write ranges", e))?;
        }
        Ok(())
    }

    /// Device-to-device copy of `bytes`.
    pub fn copy(&self, dst: u64, src: u64, bytes: usize) -> GpuResult<()> {
        // SAFETY: callers pass pointers into live buffers of at least `bytes`.
        unsafe { drv::memcpy_dtod_async(dst, src, bytes, self.cu_stream()) }.map_err(|e| derr("copy", e))
    }

    /// Launches kernel `name` with `args` (each a pointer to the argument's value).
    pub fn launch(
        &self,
        name: &str,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        smem: u32,
        args: &mut [*mut c_void],
    ) -> GpuResult<()> {
        let f = *self.funcs.get(name).ok_or_else(|| format!("no kernel named {name}"))?;
        if grid.0 == 0 || grid.1 == 0 || grid.2 == 0 {
            return Ok(());
        }
        // SAFETY: args point at values of the kernel's parameter types (checked by the callers' signatures).
        unsafe { drv::launch_kernel(f, grid, block, smem, self.cu_stream(), args) }
            .map_err(|e| derr(&format!("launch {name}"), e))
    }

    /// Allows kernel `name` up to `bytes` of dynamic shared memory.
    pub fn allow_smem(&self, name: &str, bytes: usize) -> GpuResult<()> {
        let f = *self.funcs.get(name).ok_or_else(|| format!("no kernel named {name}"))?;
        // SAFETY: f is a live function handle.
        unsafe {
            drv::function::set_function_attribute(
                f,
                drv_sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                bytes as i32,
            )
        }
        .map_err(|e| derr("smem attribute", e))
    }

    /// Row-major `y[m, n] = x[m, k] . w[n, k]^T` (a `Linear` with Hugging Face's `[out, in]` weights). `x`, `w` in
    /// `dt`; `y` in `y_dt` (the storage type, or f32 for logits); f32 accumulation. `ldx`/`ldy` are row strides.
    #[allow(clippy::too_many_arguments)]
    pub fn linear(
        &self,
        dt: DType,
        y_dt: DType,
        y: u64,
        ldy: usize,
        x: u64,
        ldx: usize,
        w: u64,
        m: usize,
        n: usize,
        k: usize,
    ) -> GpuResult<()> {
        if m == 0 {
            return Ok(());
        }
        if m <= GEMV_MAX_ROWS && k.is_multiple_of(8) && ldx.is_multiple_of(8) {
            let name = match y_dt == dt {
                true => format!("gemv_{}_m{m}", dt.suffix()),
                false if y_dt == DType::F32 => format!("gemv_{}_f32out_m{m}", dt.suffix()),
                false => return Err(format!("no GEMV from {dt:?} to {y_dt:?}").into()),
            };
            let (mut a, mut b, mut c, mut d, mut e, mut f, mut g) =
                (y, ldy as i32, x, ldx as i32, w, n as i32, k as i32);
            let args: &mut [*mut c_void] = &mut [
                &mut a as *mut u64 as *mut c_void,
                &mut b as *mut i32 as *mut c_void,
                &mut c as *mut u64 as *mut c_void,
                &mut d as *mut i32 as *mut c_void,
                &mut e as *mut u64 as *mut c_void,
                &mut f as *mut i32 as *mut c_void,
                &mut g as *mut i32 as *mut c_void,
            ];
            return self.launch(&name, (n.div_ceil(8) as u32, 1, 1), (256, 1, 1), 0, args);
        }
        // Column-major view: Y^T[n, m] = W^T... i.e. C = op(A) B with A = w (k x n column-major, transposed).
        self.gemm_batched(dt, y_dt, true, n, m, k, 1.0, (w, k, 0), (x, ldx, 0), 0.0, (y, ldy, 0), 1)
    }

    /// cuBLAS column-major `C[m, n] = alpha op(A)[m, k] B[k, n] + beta C` (B never transposed), strided-batched:
    /// each operand is (pointer, leading dimension, element stride between batches).
    #[allow(clippy::too_many_arguments)]
    pub fn gemm_batched(
        &self,
        dt: DType,
        c_dt: DType,
        trans_a: bool,
        m: usize,
        n: usize,
        k: usize,
        alpha: f32,
        a: (u64, usize, usize),
        b: (u64, usize, usize),
        beta: f32,
        c: (u64, usize, usize),
        batch: usize,
    ) -> GpuResult<()> {
        if m == 0 || n == 0 || batch == 0 {
            return Ok(());
        }
        let op_a = if trans_a {
            blas_sys::cublasOperation_t::CUBLAS_OP_T
        } else {
            blas_sys::cublasOperation_t::CUBLAS_OP_N
        };
        let (alpha, beta) = (alpha, beta);
        // SAFETY: pointers are live device buffers sized by the callers for these shapes; alpha/beta are host f32
        // (the handle's default pointer mode) matching the f32 compute type.
        unsafe {
            blas::gemm_strided_batched_ex(
                *self.blas.handle(),
                op_a,
                blas_sys::cublasOperation_t::CUBLAS_OP_N,
                m as i32,
                n as i32,
                k as i32,
                &alpha as *const f32 as *const c_void,
                a.0 as *const c_void,
                dt.cuda(),
                a.1 as i32,
                a.2 as i64,
                b.0 as *const c_void,
                dt.cuda(),
                b.1 as i32,
                b.2 as i64,
                &beta as *const f32 as *const c_void,
                c.0 as *mut c_void,
                c_dt.cuda(),
                c.1 as i32,
                c.2 as i64,
                batch as i32,
                blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|e| derr("cublas gemm", e))
    }

    /// A timing event on the stream.
    pub fn event(&self) -> GpuResult<Event> {
        let e = drv::event::create(drv_sys::CUevent_flags::CU_EVENT_DEFAULT).map_err(|e| derr("event", e))?;
        // SAFETY: e was just created; recorded on our stream.
        unsafe { drv::event::record(e, self.cu_stream()) }.map_err(|e| derr("record", e))?;
        Ok(Event(e))
    }
}

/// A recorded event; [`Event::ms_since`] gives device time between two.
pub struct Event(drv_sys::CUevent);

impl Event {
    pub fn ms_since(&self, start: &Event) -> GpuResult<f32> {
        // SAFETY: both events are live and recorded.
        unsafe {
            drv::event::synchronize(self.0).map_err(|e| derr("event sync", e))?;
            drv::event::elapsed(start.0, self.0).map_err(|e| derr("elapsed", e))
        }
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: owned handle.
        let _ = unsafe { drv::event::destroy(self.0) };
    }
}

/// Device memory, freed on drop.
pub struct DevBuf {
    ptr: u64,
    bytes: usize,
    ctx: Arc<CudaContext>,
}

// SAFETY: a device address; freeing binds the context first.
unsafe impl Send for DevBuf {}

impl std::fmt::Debug for DevBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DevBuf({} bytes)", self.bytes)
    }
}

impl DevBuf {
    pub fn ptr(&self) -> u64 {
        self.ptr
    }
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

impl Drop for DevBuf {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: ptr came from malloc_sync and is freed once.
        let _ = unsafe { drv::free_sync(self.ptr) };
    }
}

/// A grow-only scratch buffer.
#[derive(Debug, Default)]
pub struct Scratch(Option<DevBuf>);

impl Scratch {
    /// At least `bytes`, reallocated (contents lost) when too small.
    pub fn get(&mut self, gpu: &Gpu, bytes: usize) -> GpuResult<u64> {
        if self.0.as_ref().is_none_or(|b| b.bytes < bytes) {
            gpu.sync()?; // queued kernels may still use the old buffer
            self.0 = None;
            self.0 = Some(gpu.alloc(bytes.next_multiple_of(1 << 20))?);
        }
        Ok(self.0.as_ref().map_or(0, |b| b.ptr))
    }
}

/// The names of the `extern "C" __global__` kernels a source defines: macro-generated names are expanded over the
/// dtype suffixes (`##S`), the decode kernel's group sizes (`_g##G`) and the GEMV row counts (`_m##M`), 1..=8.
fn kernel_names(src: &str) -> Vec<String> {
    let suffixes = ["f32", "bf16", "f16"];
    let mut names = Vec::new();
    let mut pending = false;
    for raw in src.lines() {
        let line = if pending {
            pending = false;
            format!("__global__ void {}", raw.trim_start())
        } else {
            raw.to_string()
        };
        let Some(i) = line.find("__global__ void") else { continue };
        let mut rest = line[i + "__global__ void".len()..].trim_start();
        if let Some(after) = rest.strip_prefix("__launch_bounds__(") {
            rest = after.split_once(')').map_or("", |(_, r)| r).trim_start();
        }
        if rest.is_empty() {
            // The name is on the next line.
            pending = true;
            continue;
        }
        let name: String =
            rest.chars().take_while(|c| c.is_alphanumeric() || *c == '_' || *c == '#').collect();
        if name.is_empty() || name == "##" {
            continue;
        }
        let mut expanded = vec![name];
        for (pat, values) in [
            ("##S##", suffixes.iter().map(|s| s.to_string()).collect::<Vec<_>>()),
            ("##S", suffixes.iter().map(|s| s.to_string()).collect()),
            ("##G", (1..=8).map(|g| g.to_string()).collect()),
            ("##M", (1..=8).map(|m| m.to_string()).collect()),
        ] {
            expanded = expanded
                .into_iter()
                .flat_map(|n| match n.contains(pat) {
                    true => values.iter().map(|v| n.replacen(pat, v, 1)).collect::<Vec<_>>(),
                    false => vec![n],
                })
                .collect();
        }
        names.extend(expanded);
    }
    names
}

#[cfg(test)]
mod tests {
    #[test]
    fn kernel_names_expand_dtypes() {
        let all: Vec<String> = super::compile::KERNEL_FILES
            .iter()
            .flat_map(|(_, s)| super::kernel_names(&super::compile::full_source(s)))
            .collect();
        for n in [
            "embed_bf16",
            "rmsnorm_f32",
            "paged_decode_f16_g7",
            "causal_softmax_bf16",
            "argmax_rows",
            "gemv_bf16_m1",
            "gemv_f32_f32out_m8",
            "q_stack_bf16",
            "flash_prefill_bf16_hd128",
            "flash_prefill_f16_hd64",
            "flash_decode_bf16_hd128",
        ] {
            assert!(all.iter().any(|x| x == n), "{n} missing from {all:?}");
        }
    }
}

#[cfg(test)]
mod gpu_error_tests {
    use super::*;

    #[test]
    fn errors_say_what_failed_and_reach_the_backend_boundary_as_text() {
        let e = derr("launch rmsnorm", "CUDA_ERROR_LAUNCH_FAILED");
        assert_eq!(
            e,
            GpuError::Call { what: "launch rmsnorm".into(), error: "\"CUDA_ERROR_LAUNCH_FAILED\"".into() }
        );
        assert_eq!(String::from(e), "launch rmsnorm: \"CUDA_ERROR_LAUNCH_FAILED\"");
        let none = Gpu::open(usize::MAX).map(|_| ()).expect_err("no such GPU");
        assert!(matches!(none, GpuError::NoDevice(ref m) if m.contains("no CUDA GPU")), "{none:?}");
    }

    #[test]
    fn gpu_errors_reach_the_backend_boundary_by_what_failed_with_the_same_text() {
        use crate::engine::Fault;
        let call = |what: &str, error: &str| GpuError::Call { what: what.into(), error: error.into() };
        let cases = [
            (call("allocate 512 MiB", "DriverError(CUDA_ERROR_OUT_OF_MEMORY, \"out of memory\")"), "oom"),
            (call("cublas gemm", "CublasError(CUBLAS_STATUS_ALLOC_FAILED)"), "oom"),
            (call("launch rmsnorm", "\"CUDA_ERROR_LAUNCH_FAILED\""), "kernel"),
            (call("cublas gemm", "CublasError(CUBLAS_STATUS_EXECUTION_FAILED)"), "kernel"),
            (call("kernel rope_bf16", "DriverError(CUDA_ERROR_NOT_FOUND, \"\")"), "kernel"),
            (call("rope: create program", "NvrtcError"), "kernel"),
            (
                GpuError::Compile {
                    kernel: "rope".into(),
                    arch: "sm_90".into(),
                    error: "e".into(),
                    log: "l".into(),
                },
                "kernel",
            ),
            (call("synchronize", "DriverError(CUDA_ERROR_ILLEGAL_ADDRESS, \"\")"), "device"),
            (call("download", "DriverError(CUDA_ERROR_LAUNCH_FAILED, \"\")"), "device"),
            (GpuError::NoDevice("no CUDA GPU 3".into()), "device"),
            (GpuError::Invalid("slots 0..16 past 8".into()), "input"),
        ];
        for (gpu, want) in cases {
            let text = gpu.to_string();
            let e = BackendError::from(gpu);
            let got = match e {
                BackendError::OutOfDeviceMemory(_) => "oom",
                BackendError::Kernel(_) => "kernel",
                BackendError::Device(_) => "device",
                BackendError::InvalidInput(_) => "input",
                _ => "other",
            };
            assert_eq!(got, want, "{e:?}");
            assert_eq!(e.to_string(), text, "the same text as before the type");
            assert_eq!(e.fault() == Fault::Request, want == "input", "{e:?}");
        }
    }
}
