//! Launching the step's kernels: typed arguments, programmatic dependent launch on sm_90,
//! profiling events around each launch.

use super::*;

pub(super) enum Arg {
    P(u64),
    I(i32),
    F(f32),
    E(Epi),
    S(KernelParams),
}

/// Programmatic dependent launch needs sm_90 on both sides: a GPU of compute capability 9.0 or
/// newer, and PTX built for it (`build.rs`; older PTX has no `griddepcontrol`, so its kernels
/// would not wait). `BOT_CUDA_PDL=0` turns it off, for comparisons.
pub(super) fn pdl_available(dev: &CudaDevice) -> Result<bool> {
    let built: u32 = env!("BOT_CUDA_ARCH").parse().unwrap_or(0);
    let (major, _) = dev.cuda_stream().context().compute_capability().w()?;
    let off = std::env::var("BOT_CUDA_PDL").is_ok_and(|v| v == "0");
    Ok(built >= 90 && major >= 9 && !off)
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
        self.launch_grid(tag, f, (grid.0, grid.1, 1), block, smem, args)
    }

    /// `launch_as` with a 3-D grid and no dynamic shared memory.
    pub(super) fn launch3(
        &self,
        tag: &'static str,
        f: &str,
        grid: (usize, usize, usize),
        block: usize,
        args: &[Arg],
    ) -> Result<()> {
        self.launch_grid(tag, f, grid, block, 0, args)
    }

    pub(super) fn launch_grid(
        &self,
        tag: &'static str,
        f: &str,
        grid: (usize, usize, usize),
        block: usize,
        smem: usize,
        args: &[Arg],
    ) -> Result<()> {
        let func = self
            .funcs
            .get(f)
            .ok_or_else(|| EngineError::Internal(format!("kernel {f} not loaded")))?;
        if self.pdl && self.profile.is_none() {
            return self.launch_pdl(func, grid, block, smem, args);
        }
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
        let start = match &self.profile {
            Some(_) => Some(
                self.stream
                    .record_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
                    .w()?,
            ),
            None => None,
        };
        // SAFETY: each call site passes the arguments of the kernel's C signature, in order,
        // and sizes its buffers for the grid it launches (`ensure`).
        unsafe { b.launch(cfg) }.w()?;
        if let (Some(rec), Some(start)) = (&self.profile, start) {
            let end = self
                .stream
                .record_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
                .w()?;
            rec.borrow_mut().push((tag, start, end));
        }
        Ok(())
    }

    /// `launch_grid` through `cuLaunchKernelEx` with programmatic stream serialization: the
    /// kernel may start while the previous one still runs and waits for it in `pdl_wait()`
    /// (`cuda/common.cuh`). Stream capture records this as a programmatic graph edge.
    pub(super) fn launch_pdl(
        &self,
        func: &CudaFunction,
        grid: (usize, usize, usize),
        block: usize,
        smem: usize,
        args: &[Arg],
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
        // SAFETY: a zeroed attribute value is valid (all fields are plain integers)
        let mut value: sys::CUlaunchAttributeValue = unsafe { std::mem::zeroed() };
        value.programmaticStreamSerializationAllowed = 1;
        let mut attr = sys::CUlaunchAttribute {
            id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
            pad: [0; 4],
            value,
        };
        let cfg = sys::CUlaunchConfig {
            gridDimX: grid.0 as u32,
            gridDimY: grid.1 as u32,
            gridDimZ: grid.2 as u32,
            blockDimX: block as u32,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: smem as u32,
            hStream: self.stream.cu_stream(),
            attrs: &mut attr,
            numAttrs: 1,
        };
        self.stream.context().bind_to_thread().w()?;
        // SAFETY: `params` points at one value per parameter of the kernel's C signature, in
        // order (each call site's contract, as for `launch_grid`), alive for the call.
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
}
