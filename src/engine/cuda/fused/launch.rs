//! Launching the step's kernels: typed arguments, programmatic dependent launch on sm_90,
//! profiling events around each launch.

use super::*;

/// How a launch is made beyond its grid: plainly, cooperatively (the driver refuses a grid
/// whose blocks cannot all be resident at once, which the grid sampler's barriers need), or
/// with thread-block clusters of (1, 1, z) blocks (`qmm4_f16`'s K splits add their partials
/// in the cluster's shared memory).
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Mode {
    Plain,
    Cooperative,
    ClusterZ(u32),
}

pub(super) enum Arg {
    P(u64),
    I(i32),
    F(f32),
    E(Epi),
    S(KernelParams),
}

/// Where kernels are launched with programmatic dependent launch.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Pdl {
    Off,
    /// In decode steps (one row) only, the default: there the next kernel's early start hides
    /// launch latency; in a prompt's forward its waiting blocks hold SM slots that the running
    /// matmul's later blocks need (a 64-token prompt on an H100: 7.8 ms without, 9.5 with).
    Decode,
    /// In prompts too (`BOT_CUDA_PDL=all`), for comparisons.
    All,
}

/// Programmatic dependent launch needs sm_90 on both sides: a GPU of compute capability 9.0 or
/// newer, and PTX built for it (`build.rs`; older PTX has no `griddepcontrol`, so its kernels
/// would not wait). `BOT_CUDA_PDL=0` turns it off, for comparisons.
pub(super) fn pdl_available(dev: &CudaDevice) -> Result<Pdl> {
    if !sm90(dev)? {
        return Ok(Pdl::Off);
    }
    Ok(match std::env::var("BOT_CUDA_PDL").as_deref() {
        Ok("0") => Pdl::Off,
        Ok("all") => Pdl::All,
        _ => Pdl::Decode,
    })
}

/// Which prompt matmuls add their K splits in a thread-block cluster, which needs sm_90 on
/// both sides (`qmm4_f16` compiles its cluster reduction only there).
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Clusters {
    /// None: the splits go through the workspace and `qmm_reduce` (`BOT_CUDA_PROMPT_CLUSTER=0`).
    Off,
    /// gate|up's, whose cluster also applies SwiGLU (the default).
    GateUp,
    /// Every projection's with at most `QMM4_CLUSTER_SPLITS` splits (`BOT_CUDA_PROMPT_CLUSTER=all`).
    All,
}

pub(super) fn clusters_available(dev: &CudaDevice) -> Result<Clusters> {
    if !sm90(dev)? {
        return Ok(Clusters::Off);
    }
    Ok(match std::env::var("BOT_CUDA_PROMPT_CLUSTER").as_deref() {
        Ok("0") => Clusters::Off,
        Ok("all") => Clusters::All,
        _ => Clusters::GateUp,
    })
}

fn sm90(dev: &CudaDevice) -> Result<bool> {
    let built: u32 = env!("BOT_CUDA_ARCH").parse().unwrap_or(0);
    let (major, _) = dev.cuda_stream().context().compute_capability().w()?;
    Ok(built >= 90 && major >= 9)
}

pub(super) fn ptr<T>(s: &CudaSlice<T>, stream: &CudaStream) -> u64 {
    s.device_ptr(stream).0
}

impl FusedQwen3 {
    pub(super) fn launch(
        &self,
        f: &'static str,
        grid: (usize, usize),
        block: usize,
        args: &[Arg],
    ) -> Result<()> {
        self.launch_as(f, f, grid, block, 0, args)
    }

    /// `launch`, profiled under `tag`.
    pub(super) fn launch_as(
        &self,
        tag: &'static str,
        f: &str,
        grid: (usize, usize),
        block: usize,
        smem: usize,
        args: &[Arg],
    ) -> Result<()> {
        self.launch_with(tag, f, (grid.0, grid.1, 1), block, smem, args, Mode::Plain)
    }

    /// `launch_as` with a 3-D grid and no dynamic shared memory.
    pub(super) fn launch3(
        &self,
        tag: &'static str,
        f: &str,
        grid: (usize, usize, usize),
        block: usize,
        args: &[Arg],
        mode: Mode,
    ) -> Result<()> {
        self.launch_with(tag, f, grid, block, 0, args, mode)
    }

    /// A launch with a 3-D grid, in `mode`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn launch_with(
        &self,
        tag: &'static str,
        f: &str,
        grid: (usize, usize, usize),
        block: usize,
        smem: usize,
        args: &[Arg],
        mode: Mode,
    ) -> Result<()> {
        let func = self
            .funcs
            .get(f)
            .ok_or_else(|| EngineError::Internal(format!("kernel {f} not loaded")))?;
        let pdl = self.pdl_now.get() && self.profile.is_none();
        let start = match &self.profile {
            Some(_) => Some(
                self.stream
                    .record_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
                    .w()?,
            ),
            None => None,
        };
        if pdl || mode != Mode::Plain {
            self.launch_ex(func, grid, block, smem, args, pdl, mode)?;
        } else {
            let mut b = self.stream.launch_builder(func);
            for a in args {
                match a {
                    Arg::P(v) => b.arg(v),
                    Arg::I(v) => b.arg(v),
                    Arg::F(v) => b.arg(v),
                    Arg::E(v) => b.arg(v),
                    Arg::S(v) => b.arg(v),
                };
            }
            let cfg = LaunchConfig {
                grid_dim: (grid.0 as u32, grid.1 as u32, grid.2 as u32),
                block_dim: (block as u32, 1, 1),
                shared_mem_bytes: smem as u32,
            };
            // SAFETY: each call site passes the arguments of the kernel's C signature, in
            // order, and sizes its buffers for the grid it launches (`ensure`).
            unsafe { b.launch(cfg) }.w()?;
        }
        if let (Some(rec), Some(start)) = (&self.profile, start) {
            let end = self
                .stream
                .record_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
                .w()?;
            rec.borrow_mut().push((tag, start, end));
        }
        Ok(())
    }

    /// `launch_with` through `cuLaunchKernelEx` (`launch_ex`, on this step's stream).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn launch_ex(
        &self,
        func: &CudaFunction,
        grid: (usize, usize, usize),
        block: usize,
        smem: usize,
        args: &[Arg],
        pdl: bool,
        mode: Mode,
    ) -> Result<()> {
        launch_ex(&self.stream, func, grid, block, smem, args, pdl, mode)
    }
}

/// A launch through `cuLaunchKernelEx`: with `pdl`, programmatic stream serialization
/// (the kernel may start while the previous one still runs and waits for it in
/// `pdl_wait()`, `cuda/common.cuh`; stream capture records this as a programmatic graph
/// edge); and `mode`'s attribute.
#[allow(clippy::too_many_arguments)]
pub(super) fn launch_ex(
    stream: &CudaStream,
    func: &CudaFunction,
    grid: (usize, usize, usize),
    block: usize,
    smem: usize,
    args: &[Arg],
    pdl: bool,
    mode: Mode,
) -> Result<()> {
    let mut params: Vec<*mut std::ffi::c_void> = args
        .iter()
        .map(|a| match a {
            Arg::P(v) => v as *const u64 as *mut std::ffi::c_void,
            Arg::I(v) => v as *const i32 as *mut std::ffi::c_void,
            Arg::F(v) => v as *const f32 as *mut std::ffi::c_void,
            Arg::E(v) => v as *const Epi as *mut std::ffi::c_void,
            Arg::S(v) => v as *const KernelParams as *mut std::ffi::c_void,
        })
        .collect();
    let attr = |id, set: fn(&mut sys::CUlaunchAttributeValue)| {
        // SAFETY: a zeroed attribute value is valid (all fields are plain integers)
        let mut value: sys::CUlaunchAttributeValue = unsafe { std::mem::zeroed() };
        set(&mut value);
        sys::CUlaunchAttribute {
            id,
            pad: [0; 4],
            value,
        }
    };
    let mut attrs = Vec::with_capacity(2);
    if pdl {
        attrs.push(attr(
            sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
            |v| v.programmaticStreamSerializationAllowed = 1,
        ));
    }
    match mode {
        Mode::Plain => {}
        Mode::Cooperative => attrs.push(attr(
            sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_COOPERATIVE,
            |v| v.cooperative = 1,
        )),
        Mode::ClusterZ(z) => {
            let mut a = attr(
                sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION,
                |_| {},
            );
            a.value.clusterDim = sys::CUlaunchAttributeValue_union__bindgen_ty_1 { x: 1, y: 1, z };
            attrs.push(a);
        }
    }
    let cfg = sys::CUlaunchConfig {
        gridDimX: grid.0 as u32,
        gridDimY: grid.1 as u32,
        gridDimZ: grid.2 as u32,
        blockDimX: block as u32,
        blockDimY: 1,
        blockDimZ: 1,
        sharedMemBytes: smem as u32,
        hStream: stream.cu_stream(),
        attrs: attrs.as_mut_ptr(),
        numAttrs: attrs.len() as u32,
    };
    stream.context().bind_to_thread().w()?;
    // SAFETY: `params` points at one value per parameter of the kernel's C signature, in
    // order (each call site's contract, as for `launch_with`), alive for the call, and
    // `attrs` holds `numAttrs` attributes.
    unsafe {
        sys::cuLaunchKernelEx(
            &cfg,
            func.cu_function(),
            params.as_mut_ptr(),
            std::ptr::null_mut(),
        )
    }
    .result()
    .w()?;
    Ok(())
}
