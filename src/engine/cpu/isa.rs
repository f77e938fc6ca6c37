//! Which instruction set the CPU kernels use, chosen once per process by feature detection:
//! on x86-64 AMX int8 tiles with AVX-512 VNNI (Sapphire Rapids and later Xeons, where Linux
//! grants the tile state), else AVX-512 with VNNI (Ice Lake and later Xeons, Zen 4 and 5), else
//! AVX-VNNI (Alder Lake and later desktop parts), else AVX2+FMA; the VNNI ones change only the
//! 4-bit decode kernel (`x86.rs`), AVX-512 the prompt's f32 tile, and each its own `fast` prompt
//! GEMM (`amx.rs`; `vnni.rs` in 512-bit registers, or 256-bit ones with AVX-VNNI's or AVX2's
//! multiply-adds); everything else runs its AVX2 code there. On aarch64 NEON with the int8
//! matrix-multiply extension (`smmla`: Apple M2 and later, Graviton 3 and later; the prompt's
//! `fast` GEMM, `i8mm.rs`) and the dot-product one, else NEON with the dot-product extension
//! (`sdot`: every Apple Silicon CPU, Graviton 2 and later), else plain NEON (every aarch64
//! CPU); else the scalar path.
//! `BOT_CPU_ISA=scalar|avx2|avx-vnni|avx512-vnni|amx|neon|neon-dotprod|neon-i8mm` overrides it (tests of the fallbacks, bisecting a wrong
//! result); naming an instruction set this CPU lacks is an error at start-up, not a crash.

use std::sync::OnceLock;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isa {
    Amx,
    Avx512Vnni,
    AvxVnni,
    Avx2,
    NeonI8mm,
    NeonDot,
    Neon,
    Scalar,
}

impl Isa {
    /// Best first.
    pub const ALL: [Isa; 8] = [
        Isa::Amx,
        Isa::Avx512Vnni,
        Isa::AvxVnni,
        Isa::Avx2,
        Isa::NeonI8mm,
        Isa::NeonDot,
        Isa::Neon,
        Isa::Scalar,
    ];

    /// An x86-64 set that includes AVX2 and FMA (the AVX2 kernels run).
    pub fn avx2(self) -> bool {
        matches!(self, Isa::Amx | Isa::Avx512Vnni | Isa::AvxVnni | Isa::Avx2)
    }

    /// An aarch64 set (NEON, which every aarch64 CPU has, and what it adds).
    pub fn neon(self) -> bool {
        matches!(self, Isa::NeonI8mm | Isa::NeonDot | Isa::Neon)
    }

    /// An x86-64 set that includes AVX-512 F/BW/VL and VNNI.
    pub fn avx512(self) -> bool {
        matches!(self, Isa::Amx | Isa::Avx512Vnni)
    }

    pub fn name(self) -> &'static str {
        match self {
            Isa::Amx => "amx",
            Isa::Avx512Vnni => "avx512-vnni",
            Isa::AvxVnni => "avx-vnni",
            Isa::Avx2 => "avx2",
            Isa::NeonI8mm => "neon-i8mm",
            Isa::NeonDot => "neon-dotprod",
            Isa::Neon => "neon",
            Isa::Scalar => "scalar",
        }
    }

    fn parse(s: &str) -> Option<Isa> {
        Isa::ALL
            .into_iter()
            .find(|i| i.name() == s.trim().to_ascii_lowercase())
    }

    /// Whether this CPU can run it.
    pub fn supported(self) -> bool {
        match self {
            Isa::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512Vnni => {
                Isa::Avx2.supported()
                    && std::is_x86_feature_detected!("avx512f")
                    && std::is_x86_feature_detected!("avx512bw")
                    && std::is_x86_feature_detected!("avx512vl")
                    && std::is_x86_feature_detected!("avx512vnni")
            }
            #[cfg(target_arch = "x86_64")]
            Isa::Amx => Isa::Avx512Vnni.supported() && crate::engine::cpu::amx::granted(),
            #[cfg(target_arch = "x86_64")]
            Isa::AvxVnni => Isa::Avx2.supported() && std::is_x86_feature_detected!("avxvnni"),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => {
                std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma")
            }
            #[cfg(target_arch = "aarch64")]
            Isa::Neon => std::arch::is_aarch64_feature_detected!("neon"),
            #[cfg(target_arch = "aarch64")]
            Isa::NeonDot => {
                std::arch::is_aarch64_feature_detected!("neon")
                    && std::arch::is_aarch64_feature_detected!("dotprod")
            }
            // every CPU with i8mm has dotprod too; decode then takes `sdot`
            #[cfg(target_arch = "aarch64")]
            Isa::NeonI8mm => {
                Isa::NeonDot.supported() && std::arch::is_aarch64_feature_detected!("i8mm")
            }
            #[allow(unreachable_patterns)]
            _ => false,
        }
    }
}

/// The best instruction set this CPU supports.
pub fn detect() -> Isa {
    Isa::ALL
        .into_iter()
        .find(|i| i.supported())
        .unwrap_or(Isa::Scalar)
}

/// `BOT_CPU_ISA`, validated: `Ok(None)` when unset.
pub fn from_env(value: Option<&str>) -> Result<Option<Isa>, String> {
    let Some(v) = value.filter(|v| !v.trim().is_empty()) else {
        return Ok(None);
    };
    let isa = Isa::parse(v).ok_or_else(|| {
        format!(
            "BOT_CPU_ISA={v:?}: expected scalar, avx2, avx-vnni, avx512-vnni, amx, neon, neon-dotprod or neon-i8mm"
        )
    })?;
    if !isa.supported() {
        return Err(format!(
            "BOT_CPU_ISA={v}: this CPU cannot run it (best here: {})",
            detect().name()
        ));
    }
    Ok(Some(isa))
}

/// Checks `BOT_CPU_ISA` at start-up, so a bad value is a clear error before any kernel runs.
pub fn check_env() -> Result<Isa, String> {
    Ok(from_env(std::env::var("BOT_CPU_ISA").ok().as_deref())?.unwrap_or_else(detect))
}

/// The instruction set every CPU kernel of this process uses.
pub fn active() -> Isa {
    static ISA: OnceLock<Isa> = OnceLock::new();
    *ISA.get_or_init(|| check_env().unwrap_or_else(|_| detect()))
}

/// Whether a test can run its `isa` part on this CPU; where it cannot, says so on stderr, and
/// fails instead where `REQUIRE_CPU_ISAS` (comma-separated names; `scripts/test.sh` sets it
/// to the sets this machine runs) names the set: CI never passes a part it skipped.
#[cfg(test)]
pub(crate) fn tested_here(isa: Isa, test: &str) -> bool {
    tested_with(isa, test, &required_sets())
}

/// Whether `REQUIRE_CPU_ISAS` names `isa`: a test then also checks what that set's kernels
/// need beyond it (e.g. F16C for the AVX2 attention).
#[cfg(all(test, target_arch = "x86_64"))]
pub(crate) fn required(isa: Isa) -> bool {
    names(&required_sets(), isa)
}

#[cfg(test)]
fn required_sets() -> String {
    std::env::var("REQUIRE_CPU_ISAS").unwrap_or_default()
}

#[cfg(test)]
fn names(required: &str, isa: Isa) -> bool {
    required.split(',').any(|n| n.trim() == isa.name())
}

#[cfg(test)]
fn tested_with(isa: Isa, test: &str, required: &str) -> bool {
    if isa.supported() {
        return true;
    }
    assert!(
        !names(required, isa),
        "{test}: REQUIRE_CPU_ISAS names {} but this process cannot run it",
        isa.name()
    );
    eprintln!("{test}: {} not on this CPU, that part not run", isa.name());
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_required_set_the_cpu_lacks_fails_the_test() {
        let missing = if cfg!(target_arch = "aarch64") {
            Isa::Avx2
        } else {
            Isa::Neon
        };
        let required = format!("scalar, {}", missing.name());
        let failed = std::panic::catch_unwind(|| tested_with(missing, "t", &required));
        assert!(
            failed.is_err(),
            "a named set the CPU lacks must fail the test"
        );
        assert!(tested_with(Isa::Scalar, "t", &required));
        assert!(
            !tested_with(missing, "t", "scalar"),
            "unnamed: skipped, not failed"
        );
    }

    #[test]
    fn overrides_are_validated() {
        assert_eq!(from_env(None), Ok(None));
        assert_eq!(from_env(Some("")), Ok(None));
        assert_eq!(from_env(Some("Scalar")), Ok(Some(Isa::Scalar)));
        assert!(from_env(Some("avx512")).unwrap_err().contains("expected"));
        let missing = if cfg!(target_arch = "aarch64") {
            "avx2"
        } else {
            "neon"
        };
        assert!(from_env(Some(missing)).unwrap_err().contains("cannot run"));
        assert!(detect().supported());
        if cfg!(target_arch = "aarch64") {
            assert!(Isa::Neon.supported(), "every aarch64 CPU has NEON");
            assert_ne!(detect(), Isa::Scalar);
        }
    }
}
