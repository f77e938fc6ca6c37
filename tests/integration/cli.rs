//! The `bot` binary from the outside.

use assert_cmd::Command;

use crate::common::*;

/// `bot debug forward` prints mlx_lm's last-position logits and greedy ids.
#[test]
fn debug_forward_prints_logits_and_greedy_ids() {
    let v = "q4g64";
    let r = Reference::open(v);
    let ids = r.prompt_ids();
    let ids_arg = ids
        .iter()
        .map(|i| i.to_string())
        .collect::<Vec<_>>()
        .join(",");
    let out = Command::cargo_bin("bot")
        .unwrap()
        .args(["debug", "forward", "--model"])
        .arg(fixtures().join(v))
        .arg("--adapter")
        .arg(fixtures().join("adapter"))
        .args(["--ids", &ids_arg, "--steps", "32"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    assert_eq!(text.lines().count(), 1, "one JSON object on one line");
    let j: serde_json::Value = serde_json::from_str(&text).unwrap();
    let got: Vec<f32> = j["last_logits"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect();
    let (want, shape) = r.f32("logits_lora_f32");
    assert!(max_abs_diff(&got, &want[want.len() - shape[1]..]) <= 1e-3);
    let greedy: Vec<u64> = j["greedy_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect();
    let reference = greedy_ref(v, "lora", false);
    let want_ids: Vec<u64> = reference["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect();
    assert_eq!(greedy, want_ids);
}

#[test]
fn doctor_reports_backends_devices_and_config() {
    let home = tempfile::tempdir().unwrap();
    let out = Command::cargo_bin("bot")
        .unwrap()
        .env("BOT_HOME", home.path())
        .env("HF_HUB_OFFLINE", "1")
        .env("BOT_BSKY_SERVICE", "http://127.0.0.1:9")
        .env("BOT_BSKY_APP_PASSWORD", "never-printed-pass")
        .arg("doctor")
        .output()
        .unwrap();
    assert!(out.status.success());
    let s = String::from_utf8(out.stdout).unwrap();
    for key in [
        "backends",
        "device auto",
        "config",
        "model",
        "service check",
    ] {
        assert!(s.lines().any(|l| l.starts_with(key)), "{key} missing:\n{s}");
    }
    assert!(s.contains("NOT cached, and HF_HUB_OFFLINE is set"), "{s}");
    assert!(s.contains("NOT reachable"), "{s}");
    assert!(!s.contains("never-printed-pass"));
}

/// `bot bench` on the CPU says how the model's weights are held: mapped in place at a 2 MiB
/// boundary by default (huge pages where the page cache has them), copied into 2 MiB pages
/// with `BOT_HUGEPAGES=copy` where transparent huge pages are on, mapped as they are with
/// `BOT_HUGEPAGES=off`; the speed figures are there each way.
/// `bot bench --json` of the q4g64 fixture: 2 threads, a 4-token prompt, one repeat.
fn bench_q4g64(gen_tokens: &str) -> Command {
    let mut cmd = Command::cargo_bin("bot").unwrap();
    cmd.args(["bench", "--model"])
        .arg(fixtures().join("q4g64"))
        .args(["--threads", "2", "--prompt-tokens", "4"])
        .args(["--gen-tokens", gen_tokens, "--repeats", "1", "--json"]);
    cmd
}

/// Runs `cmd`, which must succeed, and parses its stdout as JSON.
fn json_of(cmd: &mut Command) -> serde_json::Value {
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// With an adapter, `bot bench` also reports its decode cost from a pass that turns the
/// branches on and off by turns; without one, no such figure.
#[test]
fn bench_reports_the_adapter_cost() {
    for lora in [true, false] {
        let mut cmd = bench_q4g64("6");
        if lora {
            cmd.arg("--synthetic-lora");
        }
        let j = json_of(&mut cmd);
        assert_eq!(j["lora"], lora);
        let cost = &j["lora_decode_cost"];
        if lora {
            let c = cost.as_f64().unwrap_or(f64::NAN);
            assert!(c.is_finite() && c > -1.0, "lora_decode_cost {cost}");
        } else {
            assert!(cost.is_null(), "lora_decode_cost {cost} without an adapter");
        }
    }
}

/// Where the CPU decode reads a copy of the weights (`tile16`: AVX-512 CPUs, Intel's by
/// default), `bot bench` says how that copy is held as well; elsewhere nothing.
#[test]
fn bench_reports_how_the_decode_copy_is_held() {
    for layout in ["tile16", "rows"] {
        let mut cmd = bench_q4g64("4");
        cmd.env("BOT_CPU_LAYOUT", layout);
        let j = json_of(&mut cmd);
        let avx512 = matches!(j["cpu_isa"].as_str(), Some("avx512-vnni" | "amx"));
        let copy = &j["decode_copy_memory"];
        if layout == "tile16" && avx512 {
            let c = copy.as_str().expect("the copy's line");
            assert!(
                c.starts_with("tile16, ") && c.ends_with(" MiB in 2 MiB pages"),
                "{c}"
            );
        } else {
            assert!(copy.is_null(), "{layout} on {}: {copy}", j["cpu_isa"]);
        }
    }
}

#[test]
fn bench_reports_how_the_weights_are_held() {
    let thp =
        std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled").unwrap_or_default();
    let on = thp.contains("[always]") || thp.contains("[madvise]");
    if !on {
        // CI sets REQUIRE_HUGEPAGES (scripts/test.sh): there, a kernel without them fails
        assert!(
            std::env::var_os("REQUIRE_HUGEPAGES").is_none(),
            "transparent huge pages are off here ({thp:?})"
        );
    }
    for mode in [None, Some("copy"), Some("off")] {
        let mut cmd = bench_q4g64("4");
        match mode {
            Some(m) => cmd.env("BOT_HUGEPAGES", m),
            None => cmd.env_remove("BOT_HUGEPAGES"),
        };
        let j = json_of(&mut cmd);
        let held = j["weights_memory"].as_str().unwrap().to_string();
        match mode {
            _ if !on => assert!(held.ends_with("MiB mapped in place"), "{held}"),
            Some("off") => assert!(held.ends_with("MiB mapped in place"), "{held}"),
            // the fixture is smaller than a huge page: never in 2 MiB entries, so copied
            Some(_) => {
                assert!(held.starts_with("read into memory: "), "{held}");
                // "read into memory: X of Y MiB in 2 MiB pages": some of it, at least
                let x: f64 = held["read into memory: ".len()..]
                    .split(' ')
                    .next()
                    .and_then(|v| v.parse().ok())
                    .unwrap();
                assert!(x > 0.0, "{held}");
            }
            None => assert!(
                held.starts_with("mapped in place: ") && held.contains("in 2 MiB pages"),
                "{held}"
            ),
        }
        assert!(j["decode_tok_s"].as_f64().unwrap() > 0.0);
    }
}
