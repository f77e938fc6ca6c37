//! The step itself: every kernel of a forward in order (`issue`), the projections with their
//! fused norms and epilogues, and the sampler at the end.

use super::*;

/// How a decode projection's LoRA A products travel (`FeedBufs`): made by the kernel before
/// it, and/or made here for the projection after it.
#[derive(Clone, Copy, Default)]
pub(super) struct Link {
    /// This projection's A products are in this link's words (`FeedBufs::link`).
    pub(super) fed: Option<usize>,
    /// This kernel makes the next projection's A products (its `feed_at` and ranks) there.
    pub(super) feeds: Option<(usize, u64, usize)>,
}

/// Whether a projection's decode kernel carries the feed code: the two-row instances (every
/// layer projection's; the head's four-row one is kept free of it).
fn feedable(p: &Proj) -> bool {
    p.bits == 4 && p.decode.f.contains("_r2")
}

impl FusedQwen3 {
    /// `to`'s `feed_at` and rank total, where a 4-bit decode kernel can make its A products:
    /// `to` takes a feedable decode kernel too, has LoRA of at most 32 ranks in all (a lane
    /// each), and feeds are on.
    fn feed_of(&self, to: &Proj) -> Option<(u64, usize)> {
        let l = to.lora.as_ref()?;
        (self.feed.is_some() && feedable(to) && l.rtot <= 32)
            .then(|| (ptr(&l.feed_at, &self.stream), l.rtot))
    }

    /// The link between `from` and the projection `to` that reads its output, at decode (a
    /// 4-bit producer too), through link `i`'s words: what each of the two is told.
    fn link(&self, on: bool, from: &Proj, to: &Proj, i: usize) -> (Link, Link) {
        match self.feed_of(to) {
            Some((at, r)) if on && feedable(from) => (
                Link {
                    feeds: Some((i, at, r)),
                    ..Link::default()
                },
                Link {
                    fed: Some(i),
                    ..Link::default()
                },
            ),
            _ => (Link::default(), Link::default()),
        }
    }

    /// `y (rows, p.n) = x (rows, p.k) @ W^T`, plus LoRA and `residual` (which may be `y`).
    /// With `norm`, x is RMS-normalized with that weight first: where `fuse` allows, inside the
    /// decode matmul or the prompt's `x_to_f16p` (and the LoRA A product), else by its own kernel.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn proj(
        &self,
        tag: &'static str,
        p: &Proj,
        x: u64,
        rows: usize,
        y: u64,
        residual: u64,
        norm: Option<&CudaSlice<f32>>,
        fuse: bool,
        link: Link,
    ) -> Result<()> {
        let st = &self.stream;
        let decode = rows == 1 && p.bits == 4;
        let feed = self.feed.as_ref().filter(|_| decode);
        // gate|up: the decode kernel, or the prompt kernel's cluster reduction, writes SwiGLU's
        // output to `act` directly
        let swiglu = self.writes_act(p, rows);
        let y = if swiglu { ptr(&self.bufs.act, st) } else { y };
        let (n, k) = (p.n as i32, p.k as i32);
        let (bits, gs, sd) = (p.bits as i32, p.group_size as i32, p.sdtype);
        let plan = self.plan_of(p, rows);
        // the norm rides in the kernel that reads x: the decode matmul, or x_to_f16p (which
        // writes what it would from rms_norm_f32's output; with LoRA the A product would
        // then take the norm in another order, so a prompt with LoRA keeps the norm kernel,
        // and a forward that keeps hidden states gets the same logits)
        let prompt_folds = matches!(plan, Matmul::PromptF16 { .. }) && p.lora.is_none();
        let folds = fuse && (decode || prompt_folds);
        let (x, nw) = match norm {
            Some(w) if folds => (x, ptr(w, st)),
            Some(w) => {
                let xn = ptr(&self.bufs.xn, st);
                self.rms_norm(x, w, xn, rows)?;
                (xn, 0)
            }
            None => (x, 0),
        };
        let mut epi = Epi {
            residual,
            swiglu: swiglu as i32,
            ..Epi::default()
        };
        if let (Some(f), Some((to, at, r))) = (feed, link.feeds) {
            epi.feed_at = at;
            epi.feed_acc = f.link(to, st);
            epi.feed_r = r as i32;
        }
        if let Some(l) = &p.lora {
            let t = match (feed, link.fed) {
                (Some(f), Some(from)) => {
                    epi.fed_acc = f.link(from, st);
                    0
                }
                _ => {
                    let t = ptr(&self.bufs.t, st);
                    self.lora_a(x, ptr(&l.at, st), t, (rows, p.k, l.rtot), nw)?;
                    t
                }
            };
            epi.lora_t = t;
            epi.lora_bt = ptr(&l.bt, st);
            epi.r = l.r as i32;
            epi.rtot = l.rtot as i32;
            epi.seg1 = l.seg1 as i32;
            epi.seg2 = l.seg2 as i32;
            epi.pairs = p.interleaved as i32;
        }
        let (w, s, b) = (
            ptr(&p.w.packed, st),
            ptr(&p.w.scales, st),
            ptr(&p.w.biases, st),
        );
        if decode {
            let a = [
                Arg::P(x),
                Arg::P(w),
                Arg::P(s),
                Arg::P(b),
                Arg::P(y),
                Arg::I(n),
                Arg::I(k),
                Arg::I(gs),
                Arg::I(sd),
                Arg::P(nw),
                Arg::F(self.d.eps),
                Arg::E(epi),
            ];
            let s = p.decode;
            let smem = feed_smem(s.smem, s.threads, &epi);
            return self.launch_as(tag, s.f, (s.grid, 1), s.threads, smem, &a);
        }
        let a = [
            Arg::P(x),
            Arg::P(w),
            Arg::P(s),
            Arg::P(b),
            Arg::P(y),
            Arg::I(rows as i32),
            Arg::I(n),
            Arg::I(k),
            Arg::I(bits),
            Arg::I(gs),
            Arg::I(sd),
            Arg::E(epi),
        ];
        match plan {
            Matmul::PromptF16 { splits } => {
                let (xh, rs, ws) = (
                    ptr(&self.bufs.xh, st),
                    ptr(&self.bufs.rs, st),
                    ptr(&self.bufs.ws, st),
                );
                self.launch_as(
                    tag,
                    "x_to_f16p",
                    (rows, 1),
                    256,
                    0,
                    &[
                        Arg::P(x),
                        Arg::P(xh),
                        Arg::P(rs),
                        Arg::I(k),
                        Arg::P(nw),
                        Arg::F(self.d.eps),
                    ],
                )?;
                let cluster = self.cluster_splits(p, splits);
                let a = [
                    Arg::P(xh),
                    Arg::P(rs),
                    Arg::P(w),
                    Arg::P(s),
                    Arg::P(b),
                    Arg::P(y),
                    Arg::P(ws),
                    Arg::I(rows as i32),
                    Arg::I(n),
                    Arg::I(k),
                    Arg::I(gs),
                    Arg::I(sd),
                    Arg::I(splits as i32),
                    Arg::I(cluster as i32),
                    Arg::E(epi),
                ];
                let grid = (p.n.div_ceil(128), rows.div_ceil(64), splits);
                let mode = if cluster {
                    Mode::ClusterZ(splits as u32)
                } else {
                    Mode::Plain
                };
                self.launch3(tag, plan::qmm4_kernel(), grid, 128, &a, mode)?;
                if splits == 1 || cluster {
                    return Ok(());
                }
                self.reduce_splits(tag, rows, p.n, splits, y, epi)
            }
            Matmul::PromptTf32 { splits } if splits > 1 => {
                let ws = ptr(&self.bufs.ws, st);
                let grid = (p.n.div_ceil(64), rows.div_ceil(64) * splits);
                let sk = [
                    Arg::P(x),
                    Arg::P(w),
                    Arg::P(s),
                    Arg::P(b),
                    Arg::P(ws),
                    Arg::I(rows as i32),
                    Arg::I(n),
                    Arg::I(k),
                    Arg::I(bits),
                    Arg::I(gs),
                    Arg::I(sd),
                    Arg::I(splits as i32),
                ];
                self.launch_as(tag, "qmm_tf32_sk", grid, 128, 0, &sk)?;
                self.reduce_splits(tag, rows, p.n, splits, y, epi)
            }
            Matmul::PromptTf32 { .. } => self.launch_as(
                tag,
                "qmm_tf32",
                (p.n.div_ceil(64), rows.div_ceil(64)),
                128,
                0,
                &a,
            ),
            // one row at 4 bits took the decode kernel above
            Matmul::Rows | Matmul::Decode4 { .. } => {
                self.launch_as(tag, "qmv_f32", (p.n.div_ceil(8), 1), 256, 0, &a)
            }
        }
    }

    /// Whether `p`'s kernel over `rows` rows writes SwiGLU's output (`act`) itself: gate|up's
    /// (interleaved rows) 4-bit decode kernel, and its prompt kernel where the K splits add
    /// their partials in a cluster.
    pub(super) fn writes_act(&self, p: &Proj, rows: usize) -> bool {
        if !p.interleaved || p.bits != 4 {
            return false;
        }
        if rows == 1 {
            return true;
        }
        match self.plan_of(p, rows) {
            Matmul::PromptF16 { splits } => self.cluster_splits(p, splits),
            _ => false,
        }
    }

    /// Whether `p`'s prompt kernel adds its `splits` K splits in a thread-block cluster.
    fn cluster_splits(&self, p: &Proj, splits: usize) -> bool {
        let on = match self.clusters {
            Clusters::Off => false,
            Clusters::GateUp => p.interleaved,
            Clusters::All => true,
        };
        on && splits > 1 && splits <= plan::QMM4_CLUSTER_SPLITS
    }

    /// The kernel plan of `p` over `rows` rows (`plan::matmul`, with this step's workspace).
    fn plan_of(&self, p: &Proj, rows: usize) -> Matmul {
        let q = QParams {
            m: rows as i32,
            n: p.n as i32,
            k: p.k as i32,
            bits: p.bits as i32,
            group_size: p.group_size as i32,
            sdtype: p.sdtype,
        };
        let numerics = if self.exact {
            Numerics::Exact
        } else {
            Numerics::Fast
        };
        plan::matmul(&q, numerics, self.bufs.ws.len())
    }

    /// `y (rows, n) = epilogue(sum of the split-K partials in ws)`: `qmm_reduce`.
    pub(super) fn reduce_splits(
        &self,
        tag: &'static str,
        rows: usize,
        n: usize,
        splits: usize,
        y: u64,
        epi: Epi,
    ) -> Result<()> {
        let red = [
            Arg::P(ptr(&self.bufs.ws, &self.stream)),
            Arg::P(y),
            Arg::I(rows as i32),
            Arg::I(n as i32),
            Arg::I(splits as i32),
            Arg::E(epi),
        ];
        let grid = ((rows * n).div_ceil(256), 1);
        self.launch_as(tag, "qmm_reduce", grid, 256, 0, &red)
    }

    /// Every kernel of a forward over `m` rows, in order, on the stream; with `sample`, the
    /// sampler after the head (on the last row's logits, which it penalizes in place).
    pub(super) fn issue(
        &self,
        m: usize,
        all_logits: bool,
        mut hidden: Option<&mut Vec<Vec<f32>>>,
        sample: Option<KernelParams>,
    ) -> Result<()> {
        let (d, st) = (self.d, &self.stream);
        self.pdl_now
            .set(self.pdl == Pdl::All || (self.pdl == Pdl::Decode && m == 1));
        let b = &self.bufs;
        let (x, xn, qkv, ao, gu, act) = (
            ptr(&b.x, st),
            ptr(&b.xn, st),
            ptr(&b.qkv, st),
            ptr(&b.ao, st),
            ptr(&b.gu, st),
            ptr(&b.act, st),
        );
        let pos = ptr(&self.pos, st);
        if let Some(f) = self.feed.as_ref().filter(|_| m == 1 && hidden.is_none()) {
            // the decode step's producers add into their links' words
            f.zero(st)?;
        }
        self.embed(ptr(&b.ids, st), x, m)?;
        let keep =
            |h: &mut Option<&mut Vec<Vec<f32>>>, src: &CudaSlice<f32>, n: usize| -> Result<()> {
                if let Some(h) = h {
                    let mut v = vec![0f32; n];
                    st.memcpy_dtoh(&src.slice(0..n), &mut v).w()?;
                    st.synchronize().w()?;
                    h.push(v);
                }
                Ok(())
            };
        keep(&mut hidden, &b.x, m * d.h)?;
        // the final norm's output is a hidden state, so it is materialized when kept
        let fuse = hidden.is_none();
        // at decode, each LoRA A product the kernel before can make is made there: o's for
        // gate|up, gate|up's for down, down's for the next layer's q|k|v
        let on = m == 1 && fuse;
        let mut qkv_link = Link::default();
        for (i, l) in self.layers.iter().enumerate() {
            self.proj(
                "qkv_proj",
                &l.qkv,
                x,
                m,
                qkv,
                0,
                Some(&l.in_norm),
                fuse,
                qkv_link,
            )?;
            let io = AttentionIo {
                qkv,
                q_norm: ptr(&l.q_norm, st),
                k_norm: ptr(&l.k_norm, st),
                kc: ptr(&self.cache.k[i], st),
                vc: ptr(&self.cache.v[i], st),
                cos: ptr(&self.cache.cos, st),
                sin: ptr(&self.cache.sin, st),
                out: ao,
            };
            if m == 1 {
                // q/k norms, RoPE and the cache write happen inside the decode attention
                self.attention_decode(&io, pos)?;
            } else {
                self.qk_norm_rope_cache(&io, pos, m)?;
                self.attention(&io, pos, m)?;
            }
            let (o_link, gu_fed) = self.link(on, &l.o, &l.gu, 3 * i);
            self.proj("o_proj", &l.o, ao, m, x, x, None, fuse, o_link)?;
            let (gu_feeds, down_fed) = self.link(on, &l.gu, &l.down, 3 * i + 1);
            let gu_link = Link {
                fed: gu_fed.fed,
                feeds: gu_feeds.feeds,
            };
            let post = Some(&l.post_norm);
            self.proj("gate_up_proj", &l.gu, x, m, gu, 0, post, fuse, gu_link)?;
            if !self.writes_act(&l.gu, m) {
                self.swiglu(gu, act, m)?;
            }
            let (down_feeds, next_fed) = match self.layers.get(i + 1) {
                Some(n) => self.link(on, &l.down, &n.qkv, 3 * i + 2),
                None => (Link::default(), Link::default()),
            };
            qkv_link = next_fed;
            let down_link = Link {
                fed: down_fed.fed,
                feeds: down_feeds.feeds,
            };
            self.proj("down_proj", &l.down, act, m, x, x, None, fuse, down_link)?;
            keep(&mut hidden, &b.x, m * d.h)?;
        }
        let rows = if all_logits { m } else { 1 };
        let last = x + ((m - rows) * d.h * 4) as u64;
        if !fuse {
            self.rms_norm(last, &self.norm, xn, rows)?;
            keep(&mut hidden, &b.xn, rows * d.h)?;
            self.proj(
                "lm_head",
                &self.head,
                xn,
                rows,
                ptr(&b.logits, st),
                0,
                None,
                fuse,
                Link::default(),
            )?;
            return match sample {
                Some(p) => self.sample(p),
                None => Ok(()),
            };
        }
        self.proj(
            "lm_head",
            &self.head,
            last,
            rows,
            ptr(&b.logits, st),
            0,
            Some(&self.norm),
            fuse,
            Link::default(),
        )?;
        match sample {
            Some(p) => self.sample(p),
            None => Ok(()),
        }
    }

    /// The sampler on the last row of logits: `sample_grid_f32` over `sample_grid` blocks, or
    /// `sample_f32` in one block (`kernels/sample.h`).
    pub(super) fn sample(&self, p: KernelParams) -> Result<()> {
        let st = &self.stream;
        let logits = ptr(&self.bufs.logits, st);
        let out = ptr(&self.sample_out, st);
        let mut args = vec![
            Arg::P(logits),
            Arg::P(logits),
            Arg::I(self.d.vocab as i32),
            Arg::S(p),
            Arg::P(ptr(&self.sample_state, st)),
            Arg::P(out),
            Arg::P(out),
            Arg::I(0),
        ];
        match self.sample_grid {
            Some(blocks) => {
                args.push(Arg::P(ptr(&self.sample_scratch, st)));
                let f = sample::GRID_KERNEL;
                let (g, t) = ((blocks, 1, 1), sample::GRID_THREADS);
                self.launch_with("sample", f, g, t, 0, &args, Mode::Cooperative)
            }
            None => self.launch_as("sample", sample::KERNEL, (1, 1), sample::THREADS, 0, &args),
        }
    }
}
