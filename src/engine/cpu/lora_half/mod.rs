//! Rank-8 LoRA loops on f16 copies (`lora::Half`) with the CPU's own f16 conversion: F16C's
//! `vcvtph2ps` on x86-64 (`f16c.rs`), `fcvtl` on aarch64 (`neon.rs`). `x @ a` a piece at a
//! time and `@ b` over whole blocks of `b`, the bits of `lora::project_piece_body` and
//! `lora::add_b_body` (their slow references, compared in the tests below). Why: the portable
//! loops widen each f16 in six integer and float operations (`Half::widen`, which any
//! instruction set vectorizes); here a load and one conversion. On the Zen 4 those two loops
//! were 2.6% of a `--synthetic-lora` decode's samples, most of them on the widening (0.6B
//! shape, 2 threads, rank 8 on 7 projections x 16 layers); on aarch64 the conversion takes
//! the place of seven NEON instructions per four values (not measured on ARM hardware).

use crate::engine::lora::Half;

#[cfg(target_arch = "x86_64")]
mod f16c;
#[cfg(target_arch = "aarch64")]
mod neon;

/// Whether the loops here run: x86-64 with AVX2 and FMA in the active instruction set (so
/// `BOT_CPU_ISA=scalar` keeps the portable loops) and F16C on the CPU; aarch64 with NEON in
/// the active set. Elsewhere never.
pub fn usable() -> bool {
    #[cfg(target_arch = "x86_64")]
    let on =
        crate::engine::cpu::isa::active().avx2() && std::arch::is_x86_feature_detected!("f16c");
    #[cfg(target_arch = "aarch64")]
    let on = crate::engine::cpu::isa::active().neon();
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    let on = false;
    on
}

/// `out[j] = Σ_k x[k] a[k][j]` (`a` [x.len(), 8]) where `usable`, in `project_piece_body`'s
/// order and bits; false (`out` untouched) where not.
pub fn project8(a: &[Half], x: &[f32], out: &mut [f32; 8]) -> bool {
    if !usable() {
        return false;
    }
    // SAFETY: `usable` checked the instructions each kernel needs.
    #[cfg(target_arch = "x86_64")]
    unsafe {
        f16c::project8(a, x, out)
    };
    #[cfg(target_arch = "aarch64")]
    unsafe {
        neon::project8(a, x, out)
    };
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    let _ = (a, x, out);
    true
}

/// `y[n] += Σ_j c[j] b[j][n]` over whole blocks of `b` (`lora::block_b`, rank 8: `y.len() /
/// LANES` blocks) where `usable`, in `add_b_body`'s order and bits; false (`y` untouched)
/// where not.
pub fn add_b8(blocks: &[Half], c: &[f32; 8], y: &mut [f32]) -> bool {
    if !usable() {
        return false;
    }
    // SAFETY: as in `project8`.
    #[cfg(target_arch = "x86_64")]
    unsafe {
        f16c::add_b8(blocks, c, y)
    };
    #[cfg(target_arch = "aarch64")]
    unsafe {
        neon::add_b8(blocks, c, y)
    };
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    let _ = (blocks, c, y);
    true
}

#[cfg(all(test, any(target_arch = "x86_64", target_arch = "aarch64")))]
mod tests {
    use super::*;
    use crate::engine::lora::{add_b, block_b, project_piece, Elem, Stored, LANES, PIECE};
    use rand::{Rng, SeedableRng};

    type Project8 = unsafe fn(&[Half], &[f32], &mut [f32; 8]);
    type AddB8 = unsafe fn(&[Half], &[f32; 8], &mut [f32]);

    /// This CPU's kernels, called directly whatever `BOT_CPU_ISA` picks, and whether the
    /// dispatch should take them under the active set: fails rather than skips where an
    /// x86-64 CPU lacks F16C, AVX2 or FMA (every one this project runs on has them).
    #[cfg(target_arch = "x86_64")]
    fn kernels() -> (Project8, AddB8, bool) {
        assert!(
            std::arch::is_x86_feature_detected!("f16c")
                && std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma"),
            "this x86-64 CPU lacks F16C, AVX2 or FMA"
        );
        let on = crate::engine::cpu::isa::active().avx2();
        (f16c::project8, f16c::add_b8, on)
    }

    #[cfg(target_arch = "aarch64")]
    fn kernels() -> (Project8, AddB8, bool) {
        let on = crate::engine::cpu::isa::active().neon();
        (neon::project8, neon::add_b8, on)
    }

    fn halves(rng: &mut rand::rngs::StdRng, n: usize, s: f32) -> Vec<Half> {
        (0..n)
            .map(|_| Half::narrow(rng.random_range(-s..s)).expect("finite"))
            .collect()
    }

    /// Both loops give the portable bodies' bits (the slow references, run through the f32
    /// copies of the same values with `BOT_CPU_ISA`'s choice bypassed), over input lengths
    /// that end mid-chain, several pieces, `y` ranges starting and ending mid-block, and
    /// subnormal halves (which a flush to zero would lose); `project_piece` and `add_b` take
    /// these loops where the active set allows (asserted) and give the same bits.
    #[test]
    fn converted_loops_match_portable_bodies() {
        let (project8_k, add_b8_k, on) = kernels();
        assert_eq!(
            usable(),
            on,
            "the dispatch under the active instruction set"
        );
        let mut rng = rand::rngs::StdRng::seed_from_u64(17);
        for inp in [1, 3, 4, 7, 64, 1023, 1024, 1029, 3072] {
            let mut a = halves(&mut rng, inp * 8, 0.05);
            a[0] = Half::narrow(3.0e-7).expect("subnormal"); // f16 subnormal
            let x: Vec<f32> = (0..inp).map(|_| rng.random_range(-4.0..4.0)).collect();
            let wide: Vec<f32> = a.iter().map(|h| h.widen()).collect();
            for p in 0..inp.div_ceil(PIECE) {
                let k = (p * PIECE).min(inp)..((p + 1) * PIECE).min(inp);
                let mut got = [0f32; 8];
                // SAFETY: `kernels` checked the CPU.
                unsafe { project8_k(&a[k.start * 8..k.end * 8], &x[k.clone()], &mut got) };
                let mut want = [0f32; 8];
                crate::engine::lora::project_piece_portable(&wide, &x, p, &mut want);
                assert_eq!(
                    got.map(f32::to_bits),
                    want.map(f32::to_bits),
                    "inp {inp} piece {p}"
                );
                assert!(got.iter().any(|&v| v != 0.0));
                let mut via = [0f32; 8];
                project_piece(Stored::F16(&a), &x, p, &mut via);
                assert_eq!(via.map(f32::to_bits), want.map(f32::to_bits));
            }
        }
        for out in [8, 70, 256, 1000] {
            let b: Vec<f32> = halves(&mut rng, 8 * out, 0.02)
                .iter()
                .map(|h| h.widen())
                .collect();
            let wide = block_b(&b, 8, out);
            let bb: Vec<Half> = wide
                .iter()
                .map(|&v| Half::narrow(v).expect("exact"))
                .collect();
            let c: [f32; 8] = std::array::from_fn(|_| rng.random_range(-2.0..2.0));
            let y0: Vec<f32> = (0..out).map(|_| rng.random_range(-1.0..1.0)).collect();
            for (first, len) in [
                (0, out),
                (3, out - 3),
                (8, out - 8),
                (5, 2),
                (0, out / 8 * 8),
            ] {
                let mut want = y0[first..first + len].to_vec();
                crate::engine::lora::add_b_portable(&wide, &c, first, &mut want);
                let mut got = y0[first..first + len].to_vec();
                add_b(Stored::F16(&bb), &c, first, &mut got);
                assert_eq!(
                    got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    want.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    "out {out} first {first} len {len}"
                );
                assert!(len < 8 || got != y0[first..first + len]);
            }
            // whole blocks straight through the kernel
            let whole = out / LANES * LANES;
            let mut got = y0[..whole].to_vec();
            // SAFETY: `kernels` checked the CPU.
            unsafe { add_b8_k(&bb[..whole * 8], &c, &mut got) };
            let mut want = y0[..whole].to_vec();
            crate::engine::lora::add_b_portable(&wide, &c, 0, &mut want);
            assert_eq!(
                got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                want.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                "out {out}"
            );
        }
    }
}
