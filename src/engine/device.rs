//! The one place that picks the compute device. A backend that was not compiled in fails with
//! a message naming the cargo feature to enable.

use candle_core::Device;

use crate::engine::error::{EngineError, Result};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum DeviceKind {
    /// Metal on a Mac when built with it, else CUDA when built with it and a GPU is present, else CPU
    #[default]
    Auto,
    Cpu,
    Cuda,
    Metal,
}

/// Process-wide CPU threading, called first thing in `main` (before any thread exists, since
/// it sets an environment variable): candle's element-wise CPU ops run on the calling thread
/// unless the user set `CANDLE_NUM_THREADS`. Their parallel pool spins ~25k iterations after
/// each op, which on a 2-core machine takes a core from our rayon matmuls; measured with
/// `bot bench --synthetic qwen3-0.6b --threads 2`: prefill 96 -> 110 tok/s, decode unchanged.
/// The hot loops (matmuls, attention, sampling) use rayon and are unaffected.
pub fn init_process() {
    if std::env::var_os("CANDLE_NUM_THREADS").is_none() {
        std::env::set_var("CANDLE_NUM_THREADS", "1");
    }
}

/// The device picked, and why `auto` passed over a GPU backend that was compiled in (for the
/// command to say on stderr).
pub struct Selection {
    pub device: Device,
    pub note: Option<String>,
}

/// The device for `kind`. An explicit GPU that cannot be used is an error naming the reason;
/// `auto` falls back to the CPU and says why when a compiled-in backend was refused.
pub fn select(kind: DeviceKind) -> Result<Selection> {
    let plain = |device| Selection { device, note: None };
    match kind {
        DeviceKind::Cpu => Ok(plain(Device::Cpu)),
        DeviceKind::Cuda => cuda().map(plain),
        DeviceKind::Metal => metal().map(plain),
        DeviceKind::Auto => {
            let mut refused = Vec::new();
            for (name, make) in [("Metal", metal as fn() -> Result<Device>), ("CUDA", cuda)] {
                match make() {
                    Ok(device) => return Ok(plain(device)),
                    Err(EngineError::FeatureDisabled { .. }) => {}
                    // built with CUDA but no GPU here is the normal CPU run, not news
                    Err(_) if name == "CUDA" => {}
                    Err(e) => refused.push(format!("{name} not used: {e}")),
                }
            }
            Ok(Selection {
                device: Device::Cpu,
                note: (!refused.is_empty())
                    .then(|| format!("{}; running on the CPU", refused.join("; "))),
            })
        }
    }
}

#[cfg(feature = "cuda")]
fn cuda() -> Result<Device> {
    let d = Device::new_cuda(0)?;
    if let Device::Cuda(c) = &d {
        // SAFETY: the engine issues all its work on the device's one stream, so the per-tensor
        // cross-stream events candle records by default only cost time (an event per op).
        unsafe { c.disable_event_tracking() };
    }
    Ok(d)
}

#[cfg(not(feature = "cuda"))]
fn cuda() -> Result<Device> {
    Err(EngineError::FeatureDisabled {
        backend: "CUDA",
        feature: "cuda",
    })
}

/// Metal, after the guard (`metal::guard`) has judged this Mac: never a panic.
#[cfg(bot_metal)]
fn metal() -> Result<Device> {
    use crate::engine::metal::guard;
    guard::judge(&guard::probe()).map_err(EngineError::MetalUnavailable)?;
    guard::without_panics(|| Device::new_metal(0)).map_err(EngineError::MetalUnavailable)
}

#[cfg(not(bot_metal))]
fn metal() -> Result<Device> {
    Err(EngineError::FeatureDisabled {
        backend: "Metal",
        feature: "metal",
    })
}
