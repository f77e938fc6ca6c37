//! `bot doctor`: what this install can use, for the user and for bug reports. Prints one
//! `key: value` line per check on stdout (no secrets) and never fails on a missing piece: the
//! point is to show it. Checks the backends compiled in, the devices found (and, on a Mac, the
//! macOS version, the GPU and our kernels' self-test), the config, the model and adapter locations, and whether the
//! Bluesky service answers.

use std::path::Path;
use std::time::Duration;

use crate::app::hub::{looks_like_repo, HubEnv};
use crate::cmd::load_settings;
use crate::engine::device::{self, DeviceKind};

fn line(k: &str, v: impl std::fmt::Display) {
    println!("{k:<16} {v}");
}

/// Where `spec` is on disk, or why it is not there yet.
fn locate(spec: &str, env: &HubEnv) -> String {
    if Path::new(spec).is_dir() {
        return format!("{spec} (local directory)");
    }
    if looks_like_repo(spec) {
        let dir = env
            .cache
            .join(format!("models--{}", spec.replace('/', "--")))
            .join("snapshots");
        let snapshots = std::fs::read_dir(&dir).map(|d| d.count()).unwrap_or(0);
        return if snapshots > 0 {
            format!("{spec} (cached in {})", dir.display())
        } else if env.offline {
            format!("{spec}: NOT cached, and HF_HUB_OFFLINE is set")
        } else {
            format!("{spec}: not cached yet; the first run downloads it")
        };
    }
    format!("{spec}: NOT FOUND (neither a directory nor a Hub repo id)")
}

pub fn run(config: Option<&Path>, profile: Option<&str>) -> anyhow::Result<()> {
    line("version", env!("CARGO_PKG_VERSION"));
    let mut features = vec!["cpu"];
    if cfg!(feature = "cuda") {
        features.push("cuda");
    }
    if cfg!(bot_metal) {
        features.push("metal");
    }
    line("backends", features.join(", "));
    #[cfg(bot_metal)]
    {
        let host = crate::engine::metal::guard::probe();
        line("macos", host.macos.as_deref().unwrap_or("unknown"));
        line(
            "gpu",
            match &host.gpu {
                Some(g) if g.apple_silicon => format!("{} (Apple Silicon)", g.name),
                Some(g) => format!("{} (not Apple Silicon)", g.name),
                None => "none found".into(),
            },
        );
    }
    for (name, kind) in [("metal", DeviceKind::Metal), ("cuda", DeviceKind::Cuda)] {
        match device::select(kind) {
            Ok(_s) => {
                line(name, "available");
                #[cfg(bot_metal)]
                if let candle_core::Device::Metal(m) = &_s.device {
                    line("metal self-test", metal_self_test(m));
                }
            }
            Err(e) => line(name, format!("not available: {e}")),
        }
    }
    let auto = device::select(DeviceKind::Auto)?;
    line(
        "device auto",
        match auto.device {
            candle_core::Device::Cpu => "cpu",
            candle_core::Device::Cuda(_) => "cuda",
            candle_core::Device::Metal(_) => "metal",
        },
    );
    if let Some(n) = auto.note {
        line("device note", n);
    }
    line(
        "cpu kernels",
        match crate::engine::cpu::isa::check_env() {
            Ok(isa) if isa == crate::engine::cpu::isa::detect() => isa.name().to_string(),
            Ok(isa) => format!(
                "{} (BOT_CPU_ISA; detected {})",
                isa.name(),
                crate::engine::cpu::isa::detect().name()
            ),
            Err(e) => format!("ERROR: {e}"),
        },
    );
    line("cpu weights", crate::engine::resident::describe_cpu());
    if let Ok(isa) = crate::engine::cpu::isa::check_env() {
        line("cpu decode", crate::engine::cpu::tile16::describe(isa));
    }
    line(
        "threads",
        std::thread::available_parallelism().map_or(1, |n| n.get()),
    );
    let settings = match load_settings(config, profile, &Default::default()) {
        Ok(s) => s,
        Err(e) => {
            line("config", format!("ERROR: {e:#}"));
            return Ok(());
        }
    };
    line(
        "config",
        format!(
            "{} ({})",
            settings.paths.config_file.display(),
            if settings.config_found {
                "found"
            } else {
                "not found: defaults in use"
            }
        ),
    );
    line("profile", settings.profile.as_deref().unwrap_or("default"));
    line("data dir", settings.paths.data_dir.display());
    let env = HubEnv::from_env();
    line("model", locate(&settings.model.value, &env));
    match &settings.adapter.value {
        Some(a) => line("adapter", locate(a, &env)),
        None => line("adapter", "none (the base model writes the posts)"),
    }
    line("service", &settings.service.value);
    line(
        "handle",
        settings
            .handle
            .value
            .as_deref()
            .unwrap_or("not set (bluesky.handle)"),
    );
    let health = reqwest::blocking::Client::builder()
        .timeout(Duration::from_secs(5))
        .build()
        .ok()
        .and_then(|c| {
            c.get(format!("{}/xrpc/_health", settings.service.value))
                .send()
                .ok()
        })
        .map(|r| format!("{} {}", r.status(), r.text().unwrap_or_default().trim()));
    line(
        "service check",
        match health {
            Some(v) => format!("reachable: {v}"),
            None => "NOT reachable (offline, or the service is down)".into(),
        },
    );
    Ok(())
}

/// Our Metal kernels, as mlx_lm's 4- and 8-bit models use them, against the slow reference.
#[cfg(bot_metal)]
fn metal_self_test(dev: &candle_core::MetalDevice) -> String {
    use crate::engine::metal::{quant::GpuRunner, selftest};
    let results = selftest::run_all(&GpuRunner(dev), &selftest::common_variants());
    match selftest::verdict(&results) {
        Ok(()) => format!(
            "{} kernel variants match the reference (native route)",
            results.len()
        ),
        Err(why) => format!("FAILED, models will use the verified route: {why}"),
    }
}
