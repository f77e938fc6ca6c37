//! A prompt's attention (`MIN_TOKENS` or more new tokens) as blocked matrix products, for the
//! query heads of one task over their KV head (`Group`): the keys widened to f32 and
//! transposed once (D x T) and the values widened once (T x D); then, `TILES·QR` query rows
//! at a time, their scores against every key a row can see (register tiles of `QR` rows x
//! `NK` vectors of keys: one query value broadcast against a vector of keys a step, no
//! horizontal sums), each row's exps, and its outputs from the values (`PR` rows x `DV`
//! vectors of values a tile), divided by the row's sum. The same terms as the per-query walk
//! (`Group::walk`) in another order (within 4e-6 of it at head dim 256); the walk reads and
//! widens every visible key and value once a query. Zen 5, 0.6B shape, 2 threads, a layer
//! from an empty cache (`cargo run --release --example attention f16 prompt N 2`, three
//! alternated runs): walk / this 4.7-5.0 / 4.0 ms at 512 tokens, 18.0-18.6 / 14.7 ms at 1024;
//! at those lengths attention is 20-30% of the prefill.

use super::{Group, KvElem, Lanes, Out};

/// New tokens from which `attend_with` takes this path. Below, widening and transposing the
/// keys costs about what it saves (as above, walk / this: 1 thread 238 / 257 us at 64 tokens,
/// 720 / 643 at 128; 2 threads 186 / 182 at 64, 319 / 300 at 96).
pub(super) const MIN_TOKENS: usize = 96;

/// `o`'s rows of the group's heads, as `Group::run`, with `K`'s softmax and the
/// tiles `W`, `QR`, `NK`, `PR`, `DV` (`hd` a multiple of `W`). Inlined into a function
/// compiled for `K`'s set, whose FMA `mul_add` then is.
#[inline(always)]
pub(super) unsafe fn run<
    K: Lanes,
    E: KvElem,
    const W: usize,
    const QR: usize,
    const NK: usize,
    const PR: usize,
    const DV: usize,
>(
    g: &Group<E>,
    o: Out,
) -> bool {
    let (hd, l, t_max) = (g.hd, g.l, g.offset + g.l);
    debug_assert!(hd % W == 0 && l > 0);
    // keys padded to whole vectors (scores computed there are never read)
    let tp = t_max.next_multiple_of(W);
    assert!(g.keys.len() >= t_max * hd && g.values.len() >= t_max * hd);
    assert!(g.q.len() >= l * g.nh * hd && g.h0 + g.rep <= g.nh);
    // taken out of the thread's slot and put back: a closure inside `with` would not be
    // compiled for the caller's vector set (`mul_add` became a libm call)
    let mut sc = SCRATCH.take();
    // kept from call to call (zeroing ~0.5 MB a task at 512 tokens cost 6%); a padding key's
    // scores are never read, so what the padding holds does not matter
    sc.kt.resize(hd * tp, 0.0);
    sc.vf.resize(t_max * hd, 0.0);
    sc.s.resize(TILES * QR * tp, 0.0);
    sc.blk.resize(16 * hd, 0.0);
    sc.spare.resize(hd, 0.0);
    let done;
    {
        let Scratch {
            kt,
            vf,
            s,
            blk,
            spare,
        } = &mut sc;
        done = fill_run::<K, E, W, QR, NK, PR, DV>(g, o, tp, kt, vf, s, blk, spare);
    }
    SCRATCH.set(sc);
    done
}

/// Per-thread buffers of `run`.
#[derive(Default)]
struct Scratch {
    kt: Vec<f32>,
    vf: Vec<f32>,
    s: Vec<f32>,
    blk: Vec<f32>,
    spare: Vec<f32>,
}

thread_local! {
    static SCRATCH: std::cell::Cell<Scratch> = std::cell::Cell::new(Scratch::default());
}

/// `run` with its buffers: `kt` (D x `tp`), `vf` (T x D), `s` (`TILES·QR` x `tp`), `blk` (16 x D),
/// `spare` (D).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn fill_run<
    K: Lanes,
    E: KvElem,
    const W: usize,
    const QR: usize,
    const NK: usize,
    const PR: usize,
    const DV: usize,
>(
    g: &Group<E>,
    o: Out,
    tp: usize,
    kt: &mut [f32],
    vf: &mut [f32],
    s: &mut [f32],
    blk: &mut [f32],
    spare: &mut [f32],
) -> bool {
    let Group {
        q,
        keys,
        values,
        h0,
        rep,
        nh,
        hd,
        l,
        offset,
        scale,
    } = *g;
    let t_max = offset + l;
    // the tiles write through pointers into these: their sizes checked once here
    assert!(kt.len() >= hd * tp && vf.len() >= t_max * hd && s.len() >= TILES * QR * tp);
    assert!(blk.len() >= 16 * hd && spare.len() >= hd && tp >= t_max.next_multiple_of(W));
    // 16 keys at a time widened, then written out a row of 16 per dimension (one key at a
    // time, every store went to another cache line: 15% of the call at 512 tokens)
    for t0 in (0..t_max).step_by(16) {
        let n = 16.min(t_max - t0);
        E::load(&keys[t0 * hd..(t0 + n) * hd], &mut blk[..n * hd]);
        for d in 0..hd {
            let dst = &mut kt[d * tp + t0..][..n];
            for (j, x) in dst.iter_mut().enumerate() {
                *x = blk[j * hd + d];
            }
        }
    }
    E::load(&values[..t_max * hd], vf);
    // a row's masked positions are multiplied in with a weight of 0, and 0 x inf or NaN is
    // NaN: a non-finite value would reach earlier tokens' outputs, so such a task is left to
    // the walk (which reads only each query's visible values; nothing written to `o` yet)
    if !vf[..t_max * hd].iter().fold(true, |a, x| a & x.is_finite()) {
        return false;
    }
    // `QR` rows of scores; a row (r, i) is query head h0 + r at new token i
    let rows = rep * l;
    let qrow = |rho: usize| q.as_ptr().add(((rho % l) * nh + h0 + rho / l) * hd);
    let visible = |rho: usize| offset + rho % l + 1;
    // row rho's output: head rho / l, new token rho % l
    let orow = |rho: usize| o.row(rho / l, rho % l);
    // every row's pointer from these one borrow each (a new `as_mut_ptr` would invalidate
    // the pointers made before it under stacked borrows)
    let (sb, spb) = (s.as_mut_ptr(), spare.as_mut_ptr());
    let block = TILES * QR;
    let mut sums = vec![1f32; block];
    for rho0 in (0..rows).step_by(block) {
        let n = block.min(rows - rho0);
        // a tile's rows past the block's last repeat it (the same scores again; outputs to
        // `spare`)
        let last = |k: usize| k.min(n - 1);
        let vmax = (0..n).map(|k| visible(rho0 + k)).max().unwrap_or(0);
        let nv = vmax.div_ceil(W);
        let mut v0 = 0;
        while v0 < nv {
            let nvc = NK.min(nv - v0);
            for k0 in (0..n).step_by(QR) {
                let qp: [*const f32; QR] = std::array::from_fn(|k| qrow(rho0 + last(k0 + k)));
                let sp: [*mut f32; QR] = std::array::from_fn(|k| sb.add(last(k0 + k) * tp));
                if nvc == NK {
                    scores::<W, QR, NK>(qp, kt.as_ptr(), tp, v0 * W, hd, scale, sp);
                } else {
                    for v in v0..v0 + nvc {
                        scores::<W, QR, 1>(qp, kt.as_ptr(), tp, v * W, hd, scale, sp);
                    }
                }
            }
            v0 += nvc;
        }
        // the exps and their sums; each output is divided by its row's sum at the end (a
        // pass over D values, not over the row's keys)
        for (k, sum) in sums.iter_mut().enumerate().take(n) {
            let sr = std::slice::from_raw_parts_mut(sb.add(k * tp), vmax);
            let vis = visible(rho0 + k);
            *sum = K::exp_sum(&mut sr[..vis]);
            sr[vis..].fill(0.0);
        }
        for t0 in (0..vmax).step_by(TC) {
            let nt = TC.min(vmax - t0);
            for k0 in (0..n).step_by(PR) {
                let pp: [*const f32; PR] =
                    std::array::from_fn(|k| sb.add(last(k0 + k) * tp + t0).cast_const());
                let dst: [*mut f32; PR] =
                    std::array::from_fn(|k| if k0 + k < n { orow(rho0 + k0 + k) } else { spb });
                let (vp, first) = (vf.as_ptr().add(t0 * hd), t0 == 0);
                let mut d0 = 0;
                while d0 + DV * W <= hd {
                    outputs::<W, PR, DV>(pp, vp, hd, d0, nt, dst, first);
                    d0 += DV * W;
                }
                while d0 < hd {
                    outputs::<W, PR, 1>(pp, vp, hd, d0, nt, dst, first);
                    d0 += W;
                }
            }
        }
        for (k, &sum) in sums.iter().enumerate().take(n) {
            let row = std::slice::from_raw_parts_mut(orow(rho0 + k), hd);
            row.iter_mut().for_each(|v| *v /= sum);
        }
    }
    true
}

/// Register tiles of rows a block: each chunk of keys (scores) or values (outputs) is read
/// from L1 by every tile of the block, not streamed from L2 or L3 once a tile (at 1024
/// positions a task's keys and values are 1 MB).
const TILES: usize = 4;

/// Keys (and values) a chunk of the blocked loops: 64 x D f32 is 32 KiB at D = 128.
const TC: usize = 64;

/// `s[r][t] = scale · q_r·k_t` for the `NK·W` keys from `t0` (`kt`: D rows of `tp` keys).
// indices name the tile's rows and vectors (the loops are unrolled into registers)
#[allow(clippy::needless_range_loop)]
#[inline(always)]
unsafe fn scores<const W: usize, const QR: usize, const NK: usize>(
    q: [*const f32; QR],
    kt: *const f32,
    tp: usize,
    t0: usize,
    hd: usize,
    scale: f32,
    s: [*mut f32; QR],
) {
    // a lane is one key's dot product: summed `DC` dimensions at a time, then the partial
    // sums added (one chain of 256 products was ~1e-5 off at head dim 256, the walk's
    // lane-split sums ~1e-6)
    const DC: usize = 32;
    let mut sum = [[[0f32; W]; NK]; QR];
    for c0 in (0..hd).step_by(DC) {
        let mut acc = [[[0f32; W]; NK]; QR];
        for d in c0..(c0 + DC).min(hd) {
            let kr = kt.add(d * tp + t0);
            let kv: [[f32; W]; NK] = std::array::from_fn(|k| *(kr.add(k * W) as *const [f32; W]));
            for r in 0..QR {
                let x = *q[r].add(d);
                for k in 0..NK {
                    for j in 0..W {
                        acc[r][k][j] = x.mul_add(kv[k][j], acc[r][k][j]);
                    }
                }
            }
        }
        for r in 0..QR {
            for k in 0..NK {
                sum[r][k] = std::array::from_fn(|j| sum[r][k][j] + acc[r][k][j]);
            }
        }
    }
    // whole vectors stored (a loop of QR·NK·W single values is not unrolled, and the
    // accumulators then went through memory every step)
    for r in 0..QR {
        for k in 0..NK {
            let v: [f32; W] = std::array::from_fn(|j| sum[r][k][j] * scale);
            *(s[r].add(t0 + k * W) as *mut [f32; W]) = v;
        }
    }
}

/// `o_r[d0..d0 + DV·W] (+)= Σ_{t < nt} p_r[t] · v_t[d0..]` (`v`: rows of `hd` values), from
/// zero where `first`, else onto what `o` holds (the sums of the chunks before: the same
/// additions in the same order as one loop over every position).
// indices name the tile's rows and vectors (the loops are unrolled into registers)
#[allow(clippy::needless_range_loop)]
#[inline(always)]
unsafe fn outputs<const W: usize, const PR: usize, const DV: usize>(
    p: [*const f32; PR],
    v: *const f32,
    hd: usize,
    d0: usize,
    nt: usize,
    o: [*mut f32; PR],
    first: bool,
) {
    let mut acc = [[[0f32; W]; DV]; PR];
    if !first {
        for r in 0..PR {
            for k in 0..DV {
                acc[r][k] = *(o[r].add(d0 + k * W) as *const [f32; W]);
            }
        }
    }
    for t in 0..nt {
        let vr = v.add(t * hd + d0);
        let vv: [[f32; W]; DV] = std::array::from_fn(|k| *(vr.add(k * W) as *const [f32; W]));
        for r in 0..PR {
            let x = *p[r].add(t);
            for k in 0..DV {
                for j in 0..W {
                    acc[r][k][j] = x.mul_add(vv[k][j], acc[r][k][j]);
                }
            }
        }
    }
    for r in 0..PR {
        for k in 0..DV {
            *(o[r].add(d0 + k * W) as *mut [f32; W]) = acc[r][k];
        }
    }
}
