//! Driver / NVRTC runtime: lazy per-device initialisation, primary-context binding,
//! NVRTC compilation of the `cuda/*.cu` modules to a CUBIN for the device's exact arch,
//! an on-disk CUBIN cache, and kernel lookup.

use crate::error::{CudaError, DrvExt, Result};
use crate::kernels::{self, Module};
use cudarc::driver::{result as dr, sys};
use cudarc::nvrtc::{result as nr, sys as nsys};
use std::collections::HashMap;
use std::ffi::{c_void, CString};
use std::path::PathBuf;
use std::sync::{Mutex, OnceLock};

/// What [`status`] reports about CUDA on this machine.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CudaStatus {
    /// True when device 0 can run the kernels (driver, device and NVRTC all present).
    pub available: bool,
    /// Why it is not available (None when it is).
    pub reason: Option<String>,
    /// Device 0's name.
    pub device_name: Option<String>,
    /// Device 0's compute capability (major, minor).
    pub compute_capability: Option<(i32, i32)>,
    /// NVRTC version (major, minor).
    pub nvrtc_version: Option<(i32, i32)>,
    /// Number of devices the driver reports.
    pub device_count: usize,
}

/// Reports whether the CUDA path can run, without ever panicking (no driver, no device,
/// no NVRTC all give `available: false` with a reason).
pub fn status() -> CudaStatus {
    let mut st = CudaStatus::default();
    let drv = match driver() {
        Ok(d) => d,
        Err(e) => {
            st.reason = Some(e.to_string());
            return st;
        }
    };
    st.device_count = drv.count;
    st.nvrtc_version = nvrtc_version().ok();
    match device(0) {
        Ok(d) => {
            st.device_name = Some(d.name.clone());
            st.compute_capability = Some(d.cc);
        }
        Err(e) => {
            st.reason = Some(e.to_string());
            return st;
        }
    }
    match nvrtc_version() {
        Ok(_) => st.available = true,
        Err(e) => st.reason = Some(e.to_string()),
    }
    st
}

struct Driver {
    count: usize,
    devices: Vec<OnceLock<Result<Device>>>,
}

/// One initialised device: its primary context (retained, never released) and the
/// kernels loaded so far.
pub(crate) struct Device {
    pub(crate) ordinal: usize,
    ctx: sys::CUcontext,
    pub(crate) name: String,
    pub(crate) cc: (i32, i32),
    pub(crate) sm_count: i32,
    modules: Mutex<HashMap<Module, Result<sys::CUmodule>>>,
    funcs: Mutex<HashMap<&'static str, Func>>,
}

// SAFETY: CUcontext / CUmodule / CUfunction are driver handles usable from any thread once
// the context is current there (we bind it before every use); the maps are behind Mutexes.
unsafe impl Send for Device {}
unsafe impl Sync for Device {}

/// A kernel handle.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Func(pub(crate) sys::CUfunction);
// SAFETY: see Device.
unsafe impl Send for Func {}
unsafe impl Sync for Func {}

static DRIVER: OnceLock<Result<Driver>> = OnceLock::new();

fn driver() -> Result<&'static Driver> {
    DRIVER
        .get_or_init(|| {
            // SAFETY: only tries to dlopen libcuda.
            if !unsafe { sys::is_culib_present() } {
                return Err(CudaError::NoDriver("libcuda could not be loaded".into()));
            }
            dr::init()
                .drv("cuInit")
                .map_err(|e| CudaError::NoDriver(e.to_string()))?;
            let count = dr::device::get_count().drv("cuDeviceGetCount")? as usize;
            let devices = (0..count).map(|_| OnceLock::new()).collect();
            Ok(Driver { count, devices })
        })
        .as_ref()
        .map_err(Clone::clone)
}

pub(crate) fn device(ordinal: usize) -> Result<&'static Device> {
    let drv = driver()?;
    let slot = drv.devices.get(ordinal).ok_or(CudaError::NoDevice {
        ordinal,
        count: drv.count,
    })?;
    slot.get_or_init(|| init_device(ordinal))
        .as_ref()
        .map_err(Clone::clone)
}

fn init_device(ordinal: usize) -> Result<Device> {
    let dev = dr::device::get(ordinal as i32).drv("cuDeviceGet")?;
    // SAFETY: dev is a valid device handle.
    let ctx = unsafe { dr::primary_ctx::retain(dev) }.drv("cuDevicePrimaryCtxRetain")?;
    let attr = |a| unsafe { dr::device::get_attribute(dev, a) }.drv("cuDeviceGetAttribute");
    use sys::CUdevice_attribute::*;
    let cc = (
        attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
        attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
    );
    let sm_count = attr(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?;
    let name = dr::device::get_name(dev).drv("cuDeviceGetName")?;
    Ok(Device {
        ordinal,
        ctx,
        name,
        cc,
        sm_count,
        modules: Mutex::new(HashMap::new()),
        funcs: Mutex::new(HashMap::new()),
    })
}

impl Device {
    /// Makes this device's primary context current on the calling thread.
    pub(crate) fn bind(&self) -> Result<()> {
        // SAFETY: ctx is a retained primary context, never released.
        unsafe { dr::ctx::set_current(self.ctx) }.drv("cuCtxSetCurrent")
    }

    /// The NVRTC target: `sm_90a` on Hopper (wgmma etc.), `sm_XY` elsewhere.
    pub(crate) fn arch(&self) -> String {
        let (ma, mi) = self.cc;
        if ma >= 9 {
            format!("sm_{ma}{mi}a")
        } else {
            format!("sm_{ma}{mi}")
        }
    }

    fn module(&self, m: Module) -> Result<sys::CUmodule> {
        let mut mods = self.modules.lock().map_err(|_| CudaError::Driver {
            op: "module cache",
            code: "poisoned lock".into(),
        })?;
        if let Some(r) = mods.get(&m) {
            return r.clone();
        }
        let r = self.load_module(m);
        mods.insert(m, r.clone());
        r
    }

    fn load_module(&self, m: Module) -> Result<sys::CUmodule> {
        let cubin = compile_cached(m, &self.arch())?;
        self.bind()?;
        // SAFETY: cubin is a complete CUBIN image produced by NVRTC for this arch.
        unsafe { dr::module::load_data(cubin.as_ptr() as *const c_void) }.drv("cuModuleLoadData")
    }

    /// Looks up (compiling and loading its module on first use) a kernel entry point.
    pub(crate) fn function(&self, name: &'static str) -> Result<Func> {
        if let Ok(f) = self.funcs.lock() {
            if let Some(f) = f.get(name) {
                return Ok(*f);
            }
        }
        let m = kernels::module_of(name).ok_or_else(|| CudaError::MissingKernel(name.into()))?;
        let module = self.module(m)?;
        let cname = CString::new(name).map_err(|_| CudaError::MissingKernel(name.into()))?;
        // SAFETY: module is loaded and never unloaded.
        let f = unsafe { dr::module::get_function(module, cname) }
            .map_err(|_| CudaError::MissingKernel(name.into()))?;
        let f = Func(f);
        if let Some(bytes) = kernels::dynamic_smem_limit(name) {
            self.bind()?;
            // SAFETY: f is a loaded kernel; raising its dynamic shared-memory limit.
            unsafe {
                dr::function::set_function_attribute(
                    f.0,
                    sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    bytes as i32,
                )
            }
            .drv("cuFuncSetAttribute")?;
        }
        if let Ok(mut map) = self.funcs.lock() {
            map.insert(name, f);
        }
        Ok(f)
    }

    /// Resident blocks per SM of `f` for a block size and dynamic shared memory (1 when the
    /// driver cannot say).
    pub(crate) fn occupancy(&self, f: Func, block: u32, smem: usize) -> usize {
        if self.bind().is_err() {
            return 1;
        }
        // SAFETY: f is a loaded kernel of this context.
        unsafe { dr::occupancy::max_active_block_per_multiprocessor(f.0, block as i32, smem) }
            .map(|n| n.max(1) as usize)
            .unwrap_or(1)
    }

    /// How many clusters of `cluster_z` blocks of `f` (grid `dims`) the device holds at once;
    /// 0 when it cannot launch such a cluster at all (or the query fails).
    pub(crate) fn max_active_clusters(&self, f: Func, dims: LaunchDims, cluster_z: u32) -> usize {
        if self.cc < (9, 0) || self.bind().is_err() {
            return 0;
        }
        let (mut attrs, n) = launch_attributes(false, cluster_z);
        let config = launch_config(dims, 0, &mut attrs[..n]);
        let mut n: std::ffi::c_int = 0;
        // SAFETY: f is a loaded kernel of this context; config and attrs outlive the call.
        let r = unsafe { sys::cuOccupancyMaxActiveClusters(&mut n, f.0, &config) };
        if r == sys::CUresult::CUDA_SUCCESS {
            n.max(0) as usize
        } else {
            0
        }
    }

    /// Compiles and loads every module (a self-test of the kernel sources).
    pub(crate) fn load_all(&self) -> Result<()> {
        for m in Module::ALL {
            self.module(m)?;
        }
        for name in kernels::all_kernels() {
            self.function(name)?;
        }
        Ok(())
    }
}

/// Launches `f` on the caller's stream (`stream` = raw `CUstream`, 0 = legacy default stream).
///
/// # Safety
/// `params` must match the kernel's parameter list exactly and every pointer in it must be
/// valid for what the kernel does with it.
pub(crate) unsafe fn launch(
    dev: &Device,
    f: Func,
    grid: (u32, u32, u32),
    block: (u32, u32, u32),
    smem: u32,
    stream: u64,
    params: &mut [*mut c_void],
) -> Result<()> {
    if !launchable(dev, grid)? {
        return Ok(());
    }
    // SAFETY: upheld by the caller.
    unsafe { dr::launch_kernel(f.0, grid, block, smem, stream as sys::CUstream, params) }
        .drv("cuLaunchKernel")
}

/// Binds `dev`'s context; false when the grid is empty (nothing to launch).
fn launchable(dev: &Device, grid: (u32, u32, u32)) -> Result<bool> {
    dev.bind()?;
    Ok(![grid.0, grid.1, grid.2].contains(&0))
}

/// Grid, block and dynamic shared memory (bytes) of a launch.
pub(crate) type LaunchDims = ((u32, u32, u32), (u32, u32, u32), u32);

/// [`launch`] with programmatic stream serialization (sm_90+): the kernel may be scheduled
/// before the previous kernel on `stream` has finished, once every block of that kernel has
/// executed `griddepcontrol.launch_dependents` (common.cuh `pdl_launch_dependents`), and it
/// must itself wait for that kernel with `griddepcontrol.wait` (`pdl_wait`) before reading its
/// results. Its launch latency then overlaps the previous kernel's tail. Before sm_90 (no
/// programmatic serialization; `pdl_wait` compiles to nothing) it is a plain [`launch`].
///
/// # Safety
/// As [`launch`]; and `f` calls `pdl_wait` before it touches memory the previous kernel writes.
pub(crate) unsafe fn launch_programmatic(
    dev: &Device,
    f: Func,
    dims: LaunchDims,
    stream: u64,
    params: &mut [*mut c_void],
) -> Result<()> {
    // SAFETY: as the caller's.
    unsafe { launch_clustered(dev, f, dims, 1, stream, params) }
}

/// [`launch_programmatic`] with the blocks grouped along z in thread block clusters of
/// `cluster_z` (sm_90+; 1: no clusters), which may read each other's shared memory. The grid's
/// z must be a multiple of `cluster_z`, and the device must be able to hold such a cluster
/// ([`Device::max_active_clusters`]).
///
/// # Safety
/// As [`launch_programmatic`]; and a block whose shared memory others of its cluster read does
/// not exit before they have (a cluster barrier).
pub(crate) unsafe fn launch_clustered(
    dev: &Device,
    f: Func,
    (grid, block, smem): LaunchDims,
    cluster_z: u32,
    stream: u64,
    params: &mut [*mut c_void],
) -> Result<()> {
    // FORGE_PDL=0: plain launches (for a profiler or an A/B run that wants them serialized).
    static PDL: OnceLock<bool> = OnceLock::new();
    let pdl = *PDL.get_or_init(|| std::env::var("FORGE_PDL").map_or(true, |v| v != "0"));
    let pdl = pdl && dev.cc >= (9, 0);
    if !pdl && cluster_z <= 1 {
        // SAFETY: as the caller's.
        return unsafe { launch(dev, f, grid, block, smem, stream, params) };
    }
    if !launchable(dev, grid)? {
        return Ok(());
    }
    let (mut attrs, n) = launch_attributes(pdl, cluster_z);
    let config = launch_config((grid, block, smem), stream, &mut attrs[..n]);
    // SAFETY: config and its attributes outlive the call; the parameters are upheld by the
    // caller.
    unsafe {
        sys::cuLaunchKernelEx(&config, f.0, params.as_mut_ptr(), std::ptr::null_mut()).result()
    }
    .drv("cuLaunchKernelEx")
}

/// The `cuLaunchKernelEx` attributes of a launch: programmatic stream serialization when `pdl`,
/// a cluster dimension (1, 1, `cluster_z`) when `cluster_z > 1`; the first `.1` of the array
/// are set (on the stack: launches are a hot path).
fn launch_attributes(pdl: bool, cluster_z: u32) -> ([sys::CUlaunchAttribute; 2], usize) {
    let attribute = || sys::CUlaunchAttribute {
        id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_IGNORE,
        pad: [0; 4],
        // SAFETY: a plain-data union, all zeros is a valid value of every member.
        value: unsafe { std::mem::zeroed() },
    };
    let mut attrs = [attribute(), attribute()];
    let mut n = 0;
    if pdl {
        attrs[n].id =
            sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        attrs[n].value.programmaticStreamSerializationAllowed = 1;
        n += 1;
    }
    if cluster_z > 1 {
        attrs[n].id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
        attrs[n].value.clusterDim = sys::CUlaunchAttributeValue_union__bindgen_ty_1 {
            x: 1,
            y: 1,
            z: cluster_z,
        };
        n += 1;
    }
    (attrs, n)
}

/// A `cuLaunchKernelEx` configuration over `attrs` (which must outlive its use).
fn launch_config(
    (grid, block, smem): LaunchDims,
    stream: u64,
    attrs: &mut [sys::CUlaunchAttribute],
) -> sys::CUlaunchConfig {
    sys::CUlaunchConfig {
        gridDimX: grid.0,
        gridDimY: grid.1,
        gridDimZ: grid.2,
        blockDimX: block.0,
        blockDimY: block.1,
        blockDimZ: block.2,
        sharedMemBytes: smem,
        hStream: stream as sys::CUstream,
        attrs: attrs.as_mut_ptr(),
        numAttrs: attrs.len() as u32,
    }
}

// ---------------------------------------------------------------------------------------
// NVRTC

static NVRTC: OnceLock<Result<(i32, i32)>> = OnceLock::new();

/// NVRTC's version, loading the library on first use (looking also in `CUDA_HOME`,
/// `/usr/local/cuda` and a pip `nvidia/cu13` wheel when it is not on the loader path).
pub fn nvrtc_version() -> Result<(i32, i32)> {
    NVRTC
        .get_or_init(|| {
            // SAFETY: only dlopen attempts.
            if !unsafe { nsys::is_culib_present() } {
                preload_nvrtc();
            }
            if !unsafe { nsys::is_culib_present() } {
                return Err(CudaError::NoNvrtc(
                    "libnvrtc could not be loaded (set LD_LIBRARY_PATH or CUDA_HOME)".into(),
                ));
            }
            let (mut ma, mut mi) = (0i32, 0i32);
            // SAFETY: the library is present; out-pointers are valid.
            unsafe { nsys::nvrtcVersion(&mut ma, &mut mi) }
                .result()
                .map_err(|e| CudaError::NoNvrtc(format!("nvrtcVersion: {e:?}")))?;
            Ok((ma, mi))
        })
        .clone()
}

fn preload_nvrtc() {
    let mut dirs: Vec<PathBuf> = Vec::new();
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Some(h) = std::env::var_os(var) {
            dirs.push(PathBuf::from(&h).join("lib64"));
            dirs.push(PathBuf::from(&h).join("lib"));
        }
    }
    // NVIDIA's pip wheels (torch depends on them): site-packages/nvidia/cu13/lib (CUDA 13) or
    // nvidia/cuda_nvrtc/lib (CUDA 12) of the active virtual environment or conda prefix, and of
    // the environment whose bin/ holds this executable (forge-rs installed by pip).
    let mut prefixes: Vec<PathBuf> = ["VIRTUAL_ENV", "CONDA_PREFIX"]
        .iter()
        .filter_map(|v| std::env::var_os(v).map(PathBuf::from))
        .collect();
    if let Some(root) = std::env::current_exe()
        .ok()
        .and_then(|e| e.parent()?.parent().map(PathBuf::from))
    {
        prefixes.push(root);
    }
    for prefix in prefixes {
        let Ok(rd) = std::fs::read_dir(prefix.join("lib")) else {
            continue;
        };
        for e in rd.flatten() {
            if e.file_name().to_string_lossy().starts_with("python") {
                let nv = e.path().join("site-packages").join("nvidia");
                dirs.push(nv.join("cu13").join("lib"));
                dirs.push(nv.join("cuda_nvrtc").join("lib"));
            }
        }
    }
    dirs.push("/usr/local/cuda/lib64".into());
    if let Ok(rd) = std::fs::read_dir("/usr/local") {
        for e in rd.flatten() {
            if e.file_name().to_string_lossy().starts_with("cuda-") {
                dirs.push(e.path().join("lib64"));
            }
        }
    }
    for d in dirs {
        for name in ["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"] {
            let p = d.join(name);
            if p.exists() {
                // SAFETY: loading NVRTC runs its initialisers only; the handle is leaked so
                // the library stays loaded and a later dlopen by soname finds it.
                if let Ok(lib) = unsafe {
                    libloading::os::unix::Library::open(
                        Some(&p),
                        libloading::os::unix::RTLD_NOW | libloading::os::unix::RTLD_GLOBAL,
                    )
                } {
                    std::mem::forget(lib);
                    return;
                }
            }
        }
    }
}

/// NVRTC options for an arch (part of the cache key).
pub fn nvrtc_options(arch: &str) -> Vec<String> {
    vec![
        format!("--gpu-architecture={arch}"),
        "--fmad=false".into(),
        "-std=c++17".into(),
        "-default-device".into(),
        if std::env::var_os("FORGE_NVRTC_VERBOSE").is_some() {
            "--ptxas-options=-v".into()
        } else {
            "--ptxas-options=--warn-on-spills".into()
        },
    ]
}

fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for p in parts {
        for &b in *p {
            h ^= b as u64;
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
        h ^= 0xff;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

fn cache_dir() -> Option<PathBuf> {
    if let Some(d) = std::env::var_os("FORGE_KERNEL_CACHE") {
        return Some(PathBuf::from(d));
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
    Some(base.join("4bit-forge").join("kernels"))
}

/// Compiles one module for `arch` (e.g. `"sm_90a"`) without any driver or GPU (NVRTC only),
/// through the on-disk cache; returns the CUBIN. Lets a GPU-less machine check that the
/// kernel sources compile.
pub fn compile_for_arch(m: Module, arch: &str) -> Result<Vec<u8>> {
    compile_cached(m, arch)
}

fn compile_cached(m: Module, arch: &str) -> Result<Vec<u8>> {
    let ver = nvrtc_version()?;
    let src = kernels::full_source(m);
    let opts = nvrtc_options(arch);
    let key = fnv1a(&[
        src.as_bytes(),
        opts.join(" ").as_bytes(),
        format!("nvrtc {}.{}", ver.0, ver.1).as_bytes(),
        arch.as_bytes(),
    ]);
    let path = cache_dir().map(|d| d.join(format!("{}-{key:016x}.cubin", m.name())));
    if let Some(p) = &path {
        if let Ok(b) = std::fs::read(p) {
            if !b.is_empty() {
                return Ok(b);
            }
        }
    }
    let cubin = compile(m.name(), &src, &opts)?;
    if let Some(p) = &path {
        // Best effort: a read-only cache directory only costs a recompile next time.
        if let Some(dir) = p.parent() {
            let _ = std::fs::create_dir_all(dir);
        }
        let tmp = p.with_extension(format!("tmp{}", std::process::id()));
        if std::fs::write(&tmp, &cubin).is_ok() && std::fs::rename(&tmp, p).is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
    }
    Ok(cubin)
}

fn compile(name: &str, src: &str, opts: &[String]) -> Result<Vec<u8>> {
    let csrc = CString::new(src).map_err(|_| CudaError::Compile {
        module: name.into(),
        log: "source contains a NUL byte".into(),
    })?;
    let cname = CString::new(format!("{name}.cu")).unwrap_or_default();
    let nerr = |what: &str, e: nr::NvrtcError| CudaError::Compile {
        module: name.into(),
        log: format!("{what}: {e:?}"),
    };
    let prog =
        nr::create_program(&csrc, Some(&cname)).map_err(|e| nerr("nvrtcCreateProgram", e))?;
    // SAFETY: prog was just created and is destroyed below on every path.
    let out = unsafe {
        let res = nr::compile_program(prog, opts);
        let log = nr::get_program_log(prog)
            .map(|l| {
                let bytes: Vec<u8> = l.iter().map(|&c| c as u8).take_while(|&c| c != 0).collect();
                String::from_utf8_lossy(&bytes).into_owned()
            })
            .unwrap_or_default();
        match res {
            Err(e) => Err(CudaError::Compile {
                module: name.into(),
                log: format!("{e:?}\n{log}"),
            }),
            Ok(()) => {
                if !log.trim().is_empty() && std::env::var_os("FORGE_NVRTC_LOG").is_some() {
                    eprintln!("[forge-cuda] NVRTC log for {name}:\n{log}");
                }
                let mut size = 0usize;
                let r = nsys::nvrtcGetCUBINSize(prog, &mut size);
                if r != nsys::nvrtcResult::NVRTC_SUCCESS || size == 0 {
                    Err(CudaError::Compile {
                        module: name.into(),
                        log: format!("nvrtcGetCUBINSize: {r:?}"),
                    })
                } else {
                    let mut buf = vec![0u8; size];
                    let r = nsys::nvrtcGetCUBIN(prog, buf.as_mut_ptr() as *mut std::ffi::c_char);
                    if r != nsys::nvrtcResult::NVRTC_SUCCESS {
                        Err(CudaError::Compile {
                            module: name.into(),
                            log: format!("nvrtcGetCUBIN: {r:?}"),
                        })
                    } else {
                        Ok(buf)
                    }
                }
            }
        }
    };
    // SAFETY: prog is valid and not used afterwards.
    let _ = unsafe { nr::destroy_program(prog) };
    out
}
