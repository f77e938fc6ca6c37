//! Whether this Mac can run the Metal backend, decided from plain facts before candle touches
//! Metal. candle 0.11's `MetalDevice::new` creates an `MTLResidencySet` (macOS 15 and newer:
//! objc2 panics "class could not be found" on older systems) and indexes the device list
//! without checking it (a panic where no GPU exists); our kernels assume 32-wide simdgroups,
//! which only Apple GPUs guarantee. So the facts are gathered first (`probe`, on a Mac), judged
//! here (pure, tested on every platform), and only a Mac that passes reaches candle, inside a
//! `catch_unwind` for whatever else it may panic on.

use std::fmt;

/// The oldest macOS candle's Metal backend runs on (`MTLResidencySet` arrived in macOS 15).
pub const MIN_MACOS: (u32, u32) = (15, 0);

/// What the guard knows about the machine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MetalHost {
    /// `kern.osproductversion` (e.g. "15.1.1"), `None` where it could not be read.
    pub macos: Option<String>,
    /// The system's default Metal device, if any.
    pub gpu: Option<GpuFacts>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuFacts {
    pub name: String,
    /// Supports `MTLGPUFamilyApple7` (M1 and newer): 32-wide simdgroups, unified memory.
    pub apple_silicon: bool,
}

/// Why Metal is not used on this machine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MetalUnavailable {
    /// The macOS version could not be read (or this is not macOS).
    UnknownMacOs,
    MacOsTooOld {
        found: String,
    },
    NoDevice,
    NotAppleSilicon {
        gpu: String,
    },
    /// candle's device constructor panicked; the panic's message.
    Panicked(String),
    /// candle's device constructor returned an error.
    Failed(String),
}

impl fmt::Display for MetalUnavailable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (maj, min) = MIN_MACOS;
        match self {
            MetalUnavailable::UnknownMacOs => {
                write!(f, "the macOS version could not be read (Metal needs macOS {maj}.{min} or newer)")
            }
            MetalUnavailable::MacOsTooOld { found } => write!(
                f,
                "macOS {found} is too old: the Metal backend needs macOS {maj}.{min} (Sequoia) or newer"
            ),
            MetalUnavailable::NoDevice => write!(f, "no Metal device found"),
            MetalUnavailable::NotAppleSilicon { gpu } => write!(
                f,
                "the GPU {gpu:?} is not Apple Silicon (M1 or newer); bot's Metal kernels need an Apple GPU"
            ),
            MetalUnavailable::Panicked(m) => write!(f, "Metal device creation panicked: {m}"),
            MetalUnavailable::Failed(m) => write!(f, "Metal device creation failed: {m}"),
        }
    }
}

impl std::error::Error for MetalUnavailable {}

/// `"15.1.1"` -> `(15, 1)`; a missing minor is 0.
pub fn parse_macos_version(s: &str) -> Option<(u32, u32)> {
    let mut parts = s.trim().split('.');
    let major = parts.next()?.parse().ok()?;
    let minor = match parts.next() {
        Some(p) => p.parse().ok()?,
        None => 0,
    };
    Some((major, minor))
}

/// Whether candle may be asked for a Metal device on this host.
pub fn judge(host: &MetalHost) -> Result<(), MetalUnavailable> {
    let found = host
        .macos
        .as_deref()
        .ok_or(MetalUnavailable::UnknownMacOs)?;
    let version = parse_macos_version(found).ok_or(MetalUnavailable::UnknownMacOs)?;
    if version < MIN_MACOS {
        return Err(MetalUnavailable::MacOsTooOld {
            found: found.trim().to_string(),
        });
    }
    let gpu = host.gpu.as_ref().ok_or(MetalUnavailable::NoDevice)?;
    if !gpu.apple_silicon {
        return Err(MetalUnavailable::NotAppleSilicon {
            gpu: gpu.name.clone(),
        });
    }
    Ok(())
}

/// Runs `f` (candle's constructor), turning a panic into `MetalUnavailable::Panicked` without
/// printing it: the caller explains and falls back. The panic hook is process-global, so this
/// runs before the engine starts threads of its own (device selection is the first step).
pub fn without_panics<T, E: fmt::Display>(
    f: impl FnOnce() -> Result<T, E> + std::panic::UnwindSafe,
) -> Result<T, MetalUnavailable> {
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let r = std::panic::catch_unwind(f);
    std::panic::set_hook(hook);
    match r {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(MetalUnavailable::Failed(e.to_string())),
        Err(p) => Err(MetalUnavailable::Panicked(
            p.downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| p.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "(no message)".into()),
        )),
    }
}

/// The facts of this machine (a Mac with the Metal backend compiled in).
#[cfg(bot_metal)]
pub fn probe() -> MetalHost {
    use objc2_metal::{MTLCreateSystemDefaultDevice, MTLDevice, MTLGPUFamily};
    // Creating the default device cannot panic (it returns nil where there is none).
    let gpu = MTLCreateSystemDefaultDevice().map(|d| GpuFacts {
        name: d.name().to_string(),
        apple_silicon: d.supportsFamily(MTLGPUFamily::Apple7),
    });
    MetalHost {
        macos: macos_version(),
        gpu,
    }
}

#[cfg(all(bot_metal, target_os = "macos"))]
fn macos_version() -> Option<String> {
    let mut buf = [0u8; 64];
    let mut len = buf.len();
    // SAFETY: the name is NUL-terminated; buf and len describe a writable buffer of len bytes.
    let rc = unsafe {
        libc::sysctlbyname(
            c"kern.osproductversion".as_ptr(),
            buf.as_mut_ptr().cast(),
            &mut len,
            std::ptr::null_mut(),
            0,
        )
    };
    if rc != 0 || len == 0 || len > buf.len() {
        return None;
    }
    let s = std::str::from_utf8(&buf[..len]).ok()?;
    Some(s.trim_end_matches('\0').to_string())
}

/// Only the Linux type-check compiles this (`--features metal` off a Mac); nothing runs it.
#[cfg(all(bot_metal, not(target_os = "macos")))]
fn macos_version() -> Option<String> {
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn host(macos: Option<&str>, gpu: Option<(&str, bool)>) -> MetalHost {
        MetalHost {
            macos: macos.map(str::to_string),
            gpu: gpu.map(|(n, a)| GpuFacts {
                name: n.into(),
                apple_silicon: a,
            }),
        }
    }

    #[test]
    fn a_current_apple_silicon_mac_is_accepted() {
        for v in ["15.0", "15.1.1", "26.1", "16"] {
            assert_eq!(
                judge(&host(Some(v), Some(("Apple M2 Pro", true)))),
                Ok(()),
                "{v}"
            );
        }
    }

    #[test]
    fn an_old_macos_is_refused_before_candle_can_panic() {
        for v in ["14.7.1", "13.0", "11.2.3"] {
            let e = judge(&host(Some(v), Some(("Apple M1", true)))).unwrap_err();
            assert_eq!(e, MetalUnavailable::MacOsTooOld { found: v.into() });
            assert!(e.to_string().contains("15.0"), "{e}");
        }
    }

    #[test]
    fn unreadable_version_missing_gpu_and_non_apple_gpus_are_refused() {
        assert_eq!(
            judge(&host(None, Some(("Apple M1", true)))),
            Err(MetalUnavailable::UnknownMacOs)
        );
        assert_eq!(
            judge(&host(Some("fifteen"), Some(("Apple M1", true)))),
            Err(MetalUnavailable::UnknownMacOs)
        );
        assert_eq!(
            judge(&host(Some("15.2"), None)),
            Err(MetalUnavailable::NoDevice)
        );
        let e = judge(&host(Some("15.2"), Some(("AMD Radeon Pro 5500M", false)))).unwrap_err();
        assert!(e.to_string().contains("AMD Radeon Pro 5500M"), "{e}");
    }

    #[test]
    fn a_panicking_constructor_becomes_an_error_and_the_hook_is_restored() {
        let r: Result<(), _> =
            without_panics(|| -> Result<(), String> { panic!("class could not be found") });
        assert_eq!(
            r,
            Err(MetalUnavailable::Panicked(
                "class could not be found".into()
            ))
        );
        let r: Result<(), _> = without_panics(|| Err::<(), _>("no queue"));
        assert_eq!(r, Err(MetalUnavailable::Failed("no queue".into())));
        assert_eq!(without_panics(|| Ok::<_, String>(7)), Ok(7));
    }
}
