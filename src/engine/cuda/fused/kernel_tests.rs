//! Each kernel of `step.cu` on its own against a plain CPU reference, on the GPU (a `cuda`
//! build's tests need one), at every head size the step compiles (32, 64, 128, 256): RMSNorm,
//! x_to_f16p with the norm folded in (against RMSNorm then x_to_f16p), the q/k norms with
//! RoPE and the cache write, prompt attention, decode attention (norms,
//! RoPE and cache write inside, keys split over blocks), SwiGLU and the LoRA A product (with
//! and without the fused norm). The matmul epilogues are covered end to end by the fused-vs-ops
//! test (`tests/integration/engine_vs_mlx.rs`). References accumulate in f64; kernels must
//! agree within 2e-5 of the output's largest magnitude (fp32 rounding, `expf`, `rsqrtf`).

use candle_core::cuda_backend::cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};
use candle_core::{CudaDevice, Device};
use rand::{Rng, SeedableRng};

use super::{ATT_SPLITS, STEP_MODULE, STEP_PTX};

const TOL: f32 = 2e-5;

fn gpu() -> CudaDevice {
    match Device::new_cuda(0).expect("a `cuda` build's tests need a GPU") {
        Device::Cuda(d) => d,
        _ => unreachable!("new_cuda returns a CUDA device"),
    }
}

fn random(rng: &mut rand::rngs::StdRng, n: usize, amp: f32) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-amp..amp)).collect()
}

fn up(dev: &CudaDevice, v: &[f32]) -> CudaSlice<f32> {
    dev.clone_htod(v).expect("upload")
}

fn down(dev: &CudaDevice, s: &CudaSlice<f32>) -> Vec<f32> {
    dev.clone_dtoh(s).expect("download")
}

fn cfg(grid: (usize, usize), block: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (grid.0 as u32, grid.1 as u32, 1),
        block_dim: (block as u32, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// max |got - want| over the largest |want|.
fn assert_close(label: &str, got: &[f32], want: &[f64]) {
    assert_eq!(got.len(), want.len(), "{label}");
    let scale = want.iter().fold(1e-6f64, |m, v| m.max(v.abs()));
    let err = got
        .iter()
        .zip(want)
        .fold(0f64, |m, (g, w)| m.max((*g as f64 - w).abs()))
        / scale;
    assert!(
        err <= TOL as f64,
        "{label}: relative error {err:.2e} > {TOL:.0e}"
    );
}

fn rms_ref(x: &[f32], w: &[f32], eps: f32) -> Vec<f64> {
    let ss = x.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / x.len() as f64;
    let r = 1.0 / (ss + eps as f64).sqrt();
    x.iter()
        .zip(w)
        .map(|(v, g)| *v as f64 * r * *g as f64)
        .collect()
}

/// RoPE tables as the step builds them (`qwen3::rope_angles`).
fn tables(hd: usize, cap: usize) -> (Vec<f32>, Vec<f32>) {
    crate::engine::layers::rope_angles(1e6, hd, 0..cap)
}

/// `x` (one head) normed with `w`, then rotated to position `p` (half-split RoPE).
fn norm_rope_ref(x: &[f32], w: &[f32], eps: f32, cos: &[f32], sin: &[f32], p: usize) -> Vec<f64> {
    let n = rms_ref(x, w, eps);
    let half = x.len() / 2;
    let mut out = vec![0f64; x.len()];
    for t in 0..half {
        let (c, s) = (cos[p * half + t] as f64, sin[p * half + t] as f64);
        out[t] = n[t] * c - n[t + half] * s;
        out[t + half] = n[t] * s + n[t + half] * c;
    }
    out
}

/// Causal GQA attention of one query head over cache positions `0..=p`.
fn attend_ref(q: &[f64], kc: &[f64], vc: &[f64], nkv: usize, kvh: usize, p: usize) -> Vec<f64> {
    let hd = q.len();
    let scale = (hd as f64).powf(-0.5);
    let row = |c: &[f64], t: usize| c[(t * nkv + kvh) * hd..(t * nkv + kvh + 1) * hd].to_vec();
    let scores: Vec<f64> = (0..=p)
        .map(|t| scale * q.iter().zip(row(kc, t)).map(|(a, b)| a * b).sum::<f64>())
        .collect();
    let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let e: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
    let sum: f64 = e.iter().sum();
    let mut out = vec![0f64; hd];
    for (t, w) in e.iter().enumerate() {
        for (o, v) in out.iter_mut().zip(row(vc, t)) {
            *o += w / sum * v;
        }
    }
    out
}

#[test]
fn rms_norm_swiglu_and_lora_a_match_their_references() {
    let dev = gpu();
    let mut rng = rand::rngs::StdRng::seed_from_u64(1);
    let (m, h, eps) = (3usize, 4096usize, 1e-6f32);
    let (x, w) = (random(&mut rng, m * h, 4.0), random(&mut rng, h, 1.5));
    let (xs, ws) = (up(&dev, &x), up(&dev, &w));
    let out = dev.alloc_zeros::<f32>(m * h).unwrap();
    let func = dev
        .get_or_load_custom_func("rms_norm_f32", STEP_MODULE, STEP_PTX)
        .unwrap();
    let mut b = func.builder();
    let hi = h as i32;
    b.arg(&xs).arg(&ws).arg(&out).arg(&hi).arg(&eps);
    // SAFETY: the arguments match rms_norm_f32's signature; x and out hold m * h floats.
    unsafe { b.launch(cfg((m, 1), 256)) }.unwrap();
    let want: Vec<f64> = x.chunks(h).flat_map(|r| rms_ref(r, &w, eps)).collect();
    assert_close("rms_norm_f32", &down(&dev, &out), &want);

    // x_to_f16p with the norm folded in writes the halves (and row scales) it writes from
    // rms_norm_f32's output: the same arithmetic in the same order
    let half = |src: &CudaSlice<f32>, nw: Option<&CudaSlice<f32>>| -> (Vec<u16>, Vec<f32>) {
        let (xh, rs) = (
            dev.alloc_zeros::<u16>(m * h).unwrap(),
            dev.alloc_zeros::<f32>(m).unwrap(),
        );
        let func = dev
            .get_or_load_custom_func("x_to_f16p", super::QMODULE, super::QPTX)
            .unwrap();
        let null = 0u64;
        let mut b = func.builder();
        b.arg(src).arg(&xh).arg(&rs).arg(&hi);
        match nw {
            Some(nw) => b.arg(nw),
            None => b.arg(&null),
        };
        b.arg(&eps);
        // SAFETY: the arguments match x_to_f16p's signature; src holds m * h floats.
        unsafe { b.launch(cfg((m, 1), 256)) }.unwrap();
        (dev.clone_dtoh(&xh).unwrap(), down(&dev, &rs))
    };
    let (folded, separate) = (half(&xs, Some(&ws)), half(&out, None));
    assert_eq!(folded, separate, "x_to_f16p with the norm folded in");
    assert_ne!(
        half(&xs, None),
        separate,
        "the fold changes what x_to_f16p writes"
    );

    let inter = 3072usize;
    let gu = random(&mut rng, m * 2 * inter, 8.0);
    let (gus, act) = (up(&dev, &gu), dev.alloc_zeros::<f32>(m * inter).unwrap());
    let func = dev
        .get_or_load_custom_func("swiglu_f32", STEP_MODULE, STEP_PTX)
        .unwrap();
    let mut b = func.builder();
    let (ii, total) = (inter as i32, (m * inter) as i32);
    b.arg(&gus).arg(&act).arg(&ii).arg(&total);
    // SAFETY: the arguments match swiglu_f32's signature; gu holds 2 * total floats.
    unsafe { b.launch(cfg(((m * inter).div_ceil(256), 1), 256)) }.unwrap();
    let want: Vec<f64> = gu
        .chunks(2)
        .map(|p| {
            let (g, u) = (p[0] as f64, p[1] as f64);
            g / (1.0 + (-g).exp()) * u
        })
        .collect();
    assert_close("swiglu_f32", &down(&dev, &act), &want);

    // LoRA A of three projections sharing x, ranks concatenated: R = 24
    let r = 24usize;
    let at = random(&mut rng, r * h, 0.05);
    let ats = up(&dev, &at);
    for norm in [false, true] {
        let t = dev.alloc_zeros::<f32>(m * r).unwrap();
        let func = dev
            .get_or_load_custom_func("lora_a_f32", STEP_MODULE, STEP_PTX)
            .unwrap();
        let mut b = func.builder();
        let (ki, ri, null) = (h as i32, r as i32, 0u64);
        b.arg(&xs).arg(&ats).arg(&t).arg(&ki).arg(&ri);
        if norm {
            b.arg(&ws);
        } else {
            b.arg(&null);
        }
        b.arg(&eps);
        // SAFETY: the arguments match lora_a_f32's signature; at holds r * h floats, t m * r.
        unsafe { b.launch(cfg((r, m), 256)) }.unwrap();
        let mut want = Vec::new();
        for row in x.chunks(h) {
            let xn: Vec<f64> = if norm {
                rms_ref(row, &w, eps)
            } else {
                row.iter().map(|v| *v as f64).collect()
            };
            for a in at.chunks(h) {
                want.push(xn.iter().zip(a).map(|(p, q)| p * *q as f64).sum());
            }
        }
        assert_close(&format!("lora_a_f32 norm={norm}"), &down(&dev, &t), &want);
    }
}

/// A prompt of `m` rows at positions `pos..pos+m` after `pos` cached ones: the q/k norms with
/// RoPE and the cache write, then prompt attention; then one decode step at `pos + m`.
#[test]
fn norm_rope_cache_and_attention_match_their_references_at_every_head_size() {
    let dev = gpu();
    let mut rng = rand::rngs::StdRng::seed_from_u64(2);
    let (nh, nkv, eps) = (4usize, 2usize, 1e-6f32);
    // 70 cached positions: keys span three 32-key chunks and all four decode splits; 600: five
    // chunks a split
    for (hd, pos, cap) in [32usize, 64, 128, 256]
        .into_iter()
        .flat_map(|hd| [(hd, 70usize, 128usize), (hd, 600, 1024)])
    {
        // 13 rows: two blocks of attention_prompt's 8, the second part full
        let m = 13usize;
        let width = (nh + 2 * nkv) * hd;
        let (cos, sin) = tables(hd, cap);
        let (qnw, knw) = (random(&mut rng, hd, 1.5), random(&mut rng, hd, 1.5));
        // cache rows before `pos`, as earlier steps would have left them
        let mut kc = random(&mut rng, cap * nkv * hd, 1.0);
        let mut vc = random(&mut rng, cap * nkv * hd, 1.0);
        kc[(pos + m + 1) * nkv * hd..]
            .iter_mut()
            .for_each(|v| *v = 0.0);
        vc[(pos + m + 1) * nkv * hd..]
            .iter_mut()
            .for_each(|v| *v = 0.0);
        let qkv = random(&mut rng, m * width, 3.0);
        let (qkvs, kcs, vcs) = (up(&dev, &qkv), up(&dev, &kc), up(&dev, &vc));
        let (coss, sins, qns, kns) = (
            up(&dev, &cos),
            up(&dev, &sin),
            up(&dev, &qnw),
            up(&dev, &knw),
        );
        let poss = dev.clone_htod(&[pos as i32]).unwrap();
        let (nhi, nkvi, hdi, scale) = (nh as i32, nkv as i32, hd as i32, (hd as f32).powf(-0.5));
        let func = dev
            .get_or_load_custom_func("qk_norm_rope_cache", STEP_MODULE, STEP_PTX)
            .unwrap();
        let mut b = func.builder();
        b.arg(&qkvs)
            .arg(&qns)
            .arg(&kns)
            .arg(&kcs)
            .arg(&vcs)
            .arg(&coss)
            .arg(&sins)
            .arg(&poss);
        b.arg(&nhi).arg(&nkvi).arg(&hdi).arg(&eps);
        // SAFETY: the arguments match qk_norm_rope_cache's signature; buffers sized above.
        unsafe { b.launch(cfg((nh + nkv, m), (hd / 2).next_multiple_of(32))) }.unwrap();

        // reference: q rotated in place, k rotated and v copied into the cache
        let mut want_q = vec![0f64; m * nh * hd];
        let mut kr: Vec<f64> = kc.iter().map(|v| *v as f64).collect();
        let mut vr: Vec<f64> = vc.iter().map(|v| *v as f64).collect();
        for r in 0..m {
            let row = &qkv[r * width..(r + 1) * width];
            for h in 0..nh {
                let q = norm_rope_ref(&row[h * hd..(h + 1) * hd], &qnw, eps, &cos, &sin, pos + r);
                want_q[(r * nh + h) * hd..(r * nh + h + 1) * hd].copy_from_slice(&q);
            }
            for g in 0..nkv {
                let k0 = (nh + g) * hd;
                let k = norm_rope_ref(&row[k0..k0 + hd], &knw, eps, &cos, &sin, pos + r);
                let at = ((pos + r) * nkv + g) * hd;
                kr[at..at + hd].copy_from_slice(&k);
                let v0 = (nh + nkv + g) * hd;
                for (o, v) in vr[at..at + hd].iter_mut().zip(&row[v0..v0 + hd]) {
                    *o = *v as f64;
                }
            }
        }
        let got_qkv = down(&dev, &qkvs);
        let got_q: Vec<f32> = got_qkv
            .chunks(width)
            .flat_map(|r| r[..nh * hd].to_vec())
            .collect();
        assert_close(
            &format!("hd {hd} pos {pos}: q after norm and RoPE"),
            &got_q,
            &want_q,
        );
        let live = (pos + m) * nkv * hd;
        assert_close(
            &format!("hd {hd} pos {pos}: k cache"),
            &down(&dev, &kcs)[..live],
            &kr[..live],
        );
        assert_close(
            &format!("hd {hd} pos {pos}: v cache"),
            &down(&dev, &vcs)[..live],
            &vr[..live],
        );

        let name = format!("attention_f32_hd{hd}");
        let out = dev.alloc_zeros::<f32>(m * nh * hd).unwrap();
        let func = dev
            .get_or_load_custom_func(&name, STEP_MODULE, STEP_PTX)
            .unwrap();
        let mut b = func.builder();
        b.arg(&qkvs)
            .arg(&kcs)
            .arg(&vcs)
            .arg(&out)
            .arg(&poss)
            .arg(&nhi)
            .arg(&nkvi)
            .arg(&scale);
        // SAFETY: the arguments match attention_f32_hd*'s signature; buffers sized above.
        unsafe { b.launch(cfg((nh, m), 256)) }.unwrap();
        let mut want = Vec::new();
        for r in 0..m {
            for h in 0..nh {
                let q = &want_q[(r * nh + h) * hd..(r * nh + h + 1) * hd];
                want.extend(attend_ref(q, &kr, &vr, nkv, h / (nh / nkv), pos + r));
            }
        }
        assert_close(
            &format!("hd {hd} pos {pos}: {name}"),
            &down(&dev, &out),
            &want,
        );
        if hd <= 128 {
            let name = format!("attention_prompt_hd{hd}");
            let out = dev.alloc_zeros::<f32>(m * nh * hd).unwrap();
            let func = dev
                .get_or_load_custom_func(&name, STEP_MODULE, STEP_PTX)
                .unwrap();
            let mi = m as i32;
            let mut b = func.builder();
            b.arg(&qkvs)
                .arg(&kcs)
                .arg(&vcs)
                .arg(&out)
                .arg(&poss)
                .arg(&mi)
                .arg(&nhi)
                .arg(&nkvi)
                .arg(&scale);
            // SAFETY: the arguments match attention_prompt_hd*'s signature; buffers sized above.
            unsafe { b.launch(cfg((nh, m.div_ceil(8)), 256)) }.unwrap();
            assert_close(
                &format!("hd {hd} pos {pos}: {name}"),
                &down(&dev, &out),
                &want,
            );
        }

        // one decode step at position pos + m, raw q|k|v in: norms, RoPE, cache write inside
        let p = pos + m;
        let row = random(&mut rng, width, 3.0);
        let rows = up(&dev, &row);
        let pp = dev.clone_htod(&[p as i32]).unwrap();
        let att_ws = dev.alloc_zeros::<f32>(nh * ATT_SPLITS * (hd + 2)).unwrap();
        let att_cnt = dev.alloc_zeros::<u32>(nh).unwrap();
        let out = dev.alloc_zeros::<f32>(nh * hd).unwrap();
        let name = format!("attention_decode_hd{hd}");
        for replay in 0..2 {
            let func = dev
                .get_or_load_custom_func(&name, STEP_MODULE, STEP_PTX)
                .unwrap();
            let mut b = func.builder();
            b.arg(&rows)
                .arg(&qns)
                .arg(&kns)
                .arg(&kcs)
                .arg(&vcs)
                .arg(&coss)
                .arg(&sins);
            b.arg(&out)
                .arg(&pp)
                .arg(&nhi)
                .arg(&nkvi)
                .arg(&scale)
                .arg(&eps);
            b.arg(&att_ws).arg(&att_cnt);
            // SAFETY: the arguments match attention_decode_hd*'s signature; buffers sized above.
            unsafe { b.launch(cfg((nh, ATT_SPLITS), 256)) }.unwrap();
            for g in 0..nkv {
                let k0 = (nh + g) * hd;
                let k = norm_rope_ref(&row[k0..k0 + hd], &knw, eps, &cos, &sin, p);
                let at = (p * nkv + g) * hd;
                kr[at..at + hd].copy_from_slice(&k);
                let v0 = (nh + nkv + g) * hd;
                for (o, v) in vr[at..at + hd].iter_mut().zip(&row[v0..v0 + hd]) {
                    *o = *v as f64;
                }
            }
            let mut want = Vec::new();
            for h in 0..nh {
                let q = norm_rope_ref(&row[h * hd..(h + 1) * hd], &qnw, eps, &cos, &sin, p);
                want.extend(attend_ref(&q, &kr, &vr, nkv, h / (nh / nkv), p));
            }
            // a replay (as a captured graph does) finds the split counters reset
            let label = format!("hd {hd} pos {pos}: {name}, launch {replay}");
            assert_close(&label, &down(&dev, &out), &want);
            let live = (p + 1) * nkv * hd;
            assert_close(
                &format!("{label}: k cache"),
                &down(&dev, &kcs)[..live],
                &kr[..live],
            );
            assert_close(
                &format!("{label}: v cache"),
                &down(&dev, &vcs)[..live],
                &vr[..live],
            );
            assert_eq!(
                dev.clone_dtoh(&att_cnt).unwrap(),
                vec![0u32; nh],
                "{label}: counters"
            );
        }
    }
}

/// `qmm4_f16` with its K splits in a thread-block cluster (the prompt path on sm_90) against
/// the same kernel writing the splits to a workspace and `qmm_reduce` adding them: the same
/// sums in the same order, so the same bits, with a residual epilogue; and with SwiGLU over
/// gate|up's interleaved columns, against `swiglu_f32` on the reduced output. Row counts with a
/// partial tile and with splits that get no rows (9 rows over 8 splits); 3 weight tiles.
#[test]
fn prompt_matmul_clusters_add_the_splits_as_the_reduce_does() {
    use super::launch::{launch_ex, ptr, Arg, Mode};
    use super::{QMODULE, QPTX};
    use crate::engine::cuda::quant::{resident, Epi};
    use crate::engine::quant::testutil::random_qmatrix;
    use crate::engine::weights::Dtype;

    let dev = gpu();
    let st = dev.cuda_stream();
    let mut rng = rand::rngs::StdRng::seed_from_u64(21);
    let (n, k) = (384usize, 3072usize);
    let w = random_qmatrix(n, k, 4, 64, Dtype::BF16, 5);
    let g = resident(&w, &dev).unwrap();
    let (sd, gs) = (0i32, 64i32);
    let load = |name: &str| dev.get_or_load_custom_func(name, QMODULE, QPTX).unwrap();
    for m in [9usize, 64, 100] {
        let x = up(&dev, &random(&mut rng, m * k, 2.0));
        let res = up(&dev, &random(&mut rng, m * n, 1.0));
        let xh = dev.alloc_zeros::<u16>(m * k).unwrap();
        let rs = dev.alloc_zeros::<f32>(m).unwrap();
        let a = [
            Arg::P(ptr(&x, &st)),
            Arg::P(ptr(&xh, &st)),
            Arg::P(ptr(&rs, &st)),
            Arg::I(k as i32),
            Arg::P(0),
            Arg::F(0.0),
        ];
        launch_ex(
            &st,
            &load("x_to_f16p"),
            (m, 1, 1),
            256,
            0,
            &a,
            false,
            Mode::Plain,
        )
        .unwrap();
        for splits in [2usize, 3, 4, 6, 8] {
            let run = |cluster: bool, epi: Epi| -> Vec<f32> {
                let cols = if epi.swiglu != 0 { n / 2 } else { n };
                let y = dev.alloc_zeros::<f32>(m * cols).unwrap();
                let ws = dev.alloc_zeros::<f32>(splits * m * n).unwrap();
                let a = [
                    Arg::P(ptr(&xh, &st)),
                    Arg::P(ptr(&rs, &st)),
                    Arg::P(ptr(&g.packed, &st)),
                    Arg::P(ptr(&g.scales, &st)),
                    Arg::P(ptr(&g.biases, &st)),
                    Arg::P(ptr(&y, &st)),
                    Arg::P(ptr(&ws, &st)),
                    Arg::I(m as i32),
                    Arg::I(n as i32),
                    Arg::I(k as i32),
                    Arg::I(gs),
                    Arg::I(sd),
                    Arg::I(splits as i32),
                    Arg::I(cluster as i32),
                    Arg::E(epi),
                ];
                let grid = (n.div_ceil(128), m.div_ceil(64), splits);
                let mode = if cluster {
                    Mode::ClusterZ(splits as u32)
                } else {
                    Mode::Plain
                };
                launch_ex(&st, &load("qmm4_f16"), grid, 128, 0, &a, false, mode).unwrap();
                if !cluster {
                    let r = [
                        Arg::P(ptr(&ws, &st)),
                        Arg::P(ptr(&y, &st)),
                        Arg::I(m as i32),
                        Arg::I(n as i32),
                        Arg::I(splits as i32),
                        Arg::E(epi),
                    ];
                    let f = load("qmm_reduce");
                    let grid = ((m * n).div_ceil(256), 1, 1);
                    launch_ex(&st, &f, grid, 256, 0, &r, false, Mode::Plain).unwrap();
                }
                down(&dev, &y)
            };
            let label = format!("m {m}, {splits} splits");
            let with_res = Epi {
                residual: ptr(&res, &st),
                ..Epi::default()
            };
            let (plain, clustered) = (run(false, with_res), run(true, with_res));
            assert!(plain.iter().all(|v| v.is_finite()), "{label}: non-finite");
            let same = plain
                .iter()
                .zip(&clustered)
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "{label}: the cluster's sums differ from qmm_reduce's");

            // SwiGLU: the reduced gate|up (no residual) through swiglu_f32
            let reduced = up(&dev, &run(false, Epi::default()));
            let act = dev.alloc_zeros::<f32>(m * n / 2).unwrap();
            let total = (m * n / 2) as i32;
            let f = dev
                .get_or_load_custom_func("swiglu_f32", STEP_MODULE, STEP_PTX)
                .unwrap();
            let a = [
                Arg::P(ptr(&reduced, &st)),
                Arg::P(ptr(&act, &st)),
                Arg::I((n / 2) as i32),
                Arg::I(total),
            ];
            launch_ex(
                &st,
                &f,
                ((m * n / 2).div_ceil(256), 1, 1),
                256,
                0,
                &a,
                false,
                Mode::Plain,
            )
            .unwrap();
            let want = down(&dev, &act);
            let swiglu = Epi {
                swiglu: 1,
                ..Epi::default()
            };
            let got = run(true, swiglu);
            let same = want
                .iter()
                .zip(&got)
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(
                same,
                "{label}: the cluster's SwiGLU differs from swiglu_f32's"
            );
        }
    }
}
