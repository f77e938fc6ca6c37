//! `bot doctor`: what this install can use, for the user and for bug reports. Prints one
//! `key: value` line per check on stdout (no secrets) and never fails on a missing piece: the
//! point is to show it. Checks the backends compiled in, the devices found (and, on Metal,
//! whether our kernels compile), the config, the model and adapter locations, and whether the
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
    for (name, kind) in [("metal", DeviceKind::Metal), ("cuda", DeviceKind::Cuda)] {
        match device::select(kind) {
            Ok(_d) => {
                #[cfg(bot_metal)]
                if let candle_core::Device::Metal(m) = &_d {
                    match crate::engine::metal::quant::native_kernels_available(m) {
                        Ok(()) => line("metal kernels", "compiled (native route)"),
                        Err(e) => line("metal kernels", format!("FAILED, repack route used: {e}")),
                    }
                }
                line(name, "available");
            }
            Err(e) => line(name, format!("not available: {e}")),
        }
    }
    let auto = device::select(DeviceKind::Auto)?;
    line(
        "device auto",
        match auto {
            candle_core::Device::Cpu => "cpu",
            candle_core::Device::Cuda(_) => "cuda",
            candle_core::Device::Metal(_) => "metal",
        },
    );
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
