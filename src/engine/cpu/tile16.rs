//! A decode copy of a 4-bit matrix with its rows 16 at a time interleaved a 32-bit word at a
//! time, and the matvec that reads it (AVX-512 VNNI; by default on Intel's CPUs, `wanted`).
//!
//! MLX stores each row's codes, scales and biases apart: the row kernels of `x86.rs` sum one
//! row per vector and reduce it across lanes at the end, and read six streams a pair of rows.
//! Here one 64-byte load holds the same word (8 codes) of 16 rows, so a `vpdpbusd`'s 16 lanes
//! are 16 rows against one broadcast dword of activations: no reduction, no scale shuffle, and
//! each (tile, group) is one contiguous piece with its scales and biases after its codes. The
//! idea is llama.cpp's repacked CPU layouts (`ggml-cpu/repack.cpp`); the arithmetic is
//! `x86.rs`'s (15-bit activations as 8-bit halves, exact i32 sums per 32-value block, then
//! `s_g · d_b` in f32), so only the f32 additions' order differs from the row kernels.
//!
//! The copy is made at load in anonymous memory (2 MiB pages) and kept in a cache file
//! (`tilecache.rs`) that later starts map. The `fast` prompt GEMMs read it too (`amx.rs`, and
//! `vnni.rs`'s AVX-512 panels; from 2 tokens where a matrix has its copy), each block
//! transposed back to rows in registers (`transpose_block`), so the model's file is read for
//! the norms and the embedding's rows alone: the copy costs the model's size on disk, not in
//! memory (`exact` and `int8` prompts and groups of 32 still read the rows). Rows past the
//! last whole tile run the row kernels.

use std::path::{Path, PathBuf};

use crate::engine::cpu::isa::Isa;
use crate::engine::cpu::quant::IntActs;
use crate::engine::cpu::tilecache;
use crate::engine::quant::QMatrix;
use crate::engine::resident::HugeBuf;
use crate::engine::weights::{Bytes, Dtype, FileStamp};

/// Rows a tile interleaves: one per i32 lane of a 512-bit vector.
pub const ROWS: usize = 16;

/// The environment variable that chooses: `rows` (or `off`) reads MLX's layout alone;
/// `tile16` makes the copies where the CPU has AVX-512 VNNI; unset, Intel's CPUs make them
/// (`wanted`).
pub const ENV: &str = "BOT_CPU_LAYOUT";

/// Where the copies are kept between starts (a directory), or `off` to make them at every
/// start; unset: the user's cache directory (`~/.cache/bot/tiles` on Linux).
pub const CACHE_ENV: &str = "BOT_TILE_CACHE";

/// Copies smaller than this are made at every start and not kept: they take a few tens of
/// milliseconds, and tests' tiny models leave nothing in the user's cache.
const CACHE_MIN: usize = 64 << 20;

/// Whether the CPU engine gives its matrices decode copies for `isa`: only the AVX-512
/// kernels read them. `BOT_CPU_LAYOUT=tile16` or `rows` decides; unset, Intel CPUs take them
/// and AMD's do not: on the Xeon (Emerald Rapids, 2 threads) the copy's decode was 7-14%
/// faster at the 0.6B shape and ~5% at the 8B, and its AMX prompts 30-60% faster at the 8B
/// (twentieth and twenty-second sessions, docs/performance.md); on the Zen 5 EPYC decode was
/// within its noise (±5%) and the 8B prompt even, which does not pay for a second copy of the
/// model on disk and a first start that makes it (~10 s at the 8B).
pub fn wanted(isa: Isa) -> bool {
    let asked = std::env::var(ENV).unwrap_or_default().to_ascii_lowercase();
    isa.avx512()
        && match asked.as_str() {
            "tile16" => true,
            "rows" | "off" | "0" | "no" | "false" => false,
            _ => intel(),
        }
}

/// Whether the CPU says it is Intel's (`cpuid` leaf 0).
fn intel() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        // leaf 0: the vendor string in EBX, EDX, ECX
        let r = std::arch::x86_64::__cpuid(0);
        let v = [r.ebx, r.edx, r.ecx];
        v.iter().flat_map(|x| x.to_le_bytes()).eq(*b"GenuineIntel")
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// What the CPU decode reads here, in words (`bot doctor`).
pub fn describe(isa: Isa) -> String {
    if !wanted(isa) {
        let asked = std::env::var(ENV).is_ok_and(|v| !v.is_empty());
        let why = if !isa.avx512() {
            "no AVX-512 VNNI"
        } else if asked {
            "asked"
        } else {
            "not an Intel CPU"
        };
        return format!("MLX's rows ({why}; {ENV}=tile16 or rows chooses on AVX-512)");
    }
    let cache = match cache_dir() {
        Some(d) => {
            let (n, bytes) = tilecache::usage(&d);
            format!(
                "kept in {} ({n} files, {:.1} GB)",
                d.display(),
                bytes as f64 / 1e9
            )
        }
        None => "made at every start".into(),
    };
    format!(
        "a copy 16 rows interleaved (tile16; {cache} from {} MB; {ENV}=rows turns it off)",
        CACHE_MIN >> 20
    )
}

fn cache_dir() -> Option<PathBuf> {
    match std::env::var_os(CACHE_ENV) {
        Some(v) if v == "off" => None,
        Some(v) if !v.is_empty() => Some(PathBuf::from(v)),
        _ => directories::ProjectDirs::from("", "", "bot").map(|d| d.cache_dir().join("tiles")),
    }
}

/// Gives each of `ws` that the kernel takes its decode copy: mapped from the cache file of
/// `model_dir` (made from `files`; `None` for a model built in memory, which has none) where
/// it holds them, else made now (where half the available memory holds them) and kept there
/// for the next start. Returns notes for the user: what was made and kept, or why not.
pub fn prepare(ws: &[&QMatrix], files: Option<&[&FileStamp]>, model_dir: &Path) -> Vec<String> {
    // a model built in memory has no files to key a cache by: made every time
    let cache = files.and(cache_dir());
    prepare_in(
        ws,
        files.unwrap_or(&[]),
        model_dir,
        cache.as_deref(),
        CACHE_MIN,
    )
}

/// `prepare` with the cache in `cache` (none: made every time) for copies of `min` bytes on.
fn prepare_in(
    ws: &[&QMatrix],
    files: &[&FileStamp],
    model_dir: &Path,
    cache: Option<&Path>,
    min: usize,
) -> Vec<String> {
    let ws: Vec<&QMatrix> = ws
        .iter()
        .copied()
        .filter(|w| Tiles::layout_of(w).is_some())
        .collect();
    let total: usize = ws
        .iter()
        .filter_map(|w| Tiles::layout_of(w))
        .map(Tiles::len_of)
        .sum();
    if ws.is_empty() {
        return Vec::new();
    }
    let cache = cache.filter(|_| total >= min).map(|d| {
        (
            tilecache::file_for(d, model_dir),
            tilecache::key(files, &ws),
        )
    });
    if let Some((path, key)) = &cache {
        if let Some(copies) = tilecache::load(path, key, &ws) {
            for (w, t) in ws.iter().zip(copies) {
                w.cpu_copy.put(t);
            }
            return Vec::new();
        }
    }
    let mb = total as f64 / 1e6;
    if !crate::engine::resident::room_for_copy(total) {
        return vec![format!(
            "no room for the CPU decode copy ({mb:.0} MB, half the available memory at most): \
             decode reads MLX's rows, ~5-25% slower on this CPU"
        )];
    }
    let t = std::time::Instant::now();
    let copies: Option<Vec<Tiles>> = ws.iter().map(|w| Tiles::of(w)).collect();
    let Some(copies) = copies else {
        return vec!["the CPU decode copy could not be made (memory refused)".into()];
    };
    let secs = t.elapsed().as_secs_f64();
    let mut notes = Vec::new();
    if let Some((path, key)) = &cache {
        let refs: Vec<&Tiles> = copies.iter().collect();
        let room = tilecache::free_bytes(path.parent().unwrap_or(path));
        notes.push(if room.is_some_and(|r| r < total as u64 + (1 << 30)) {
            format!(
                "made the CPU decode copy ({mb:.0} MB, {secs:.1} s); not kept: under {:.1} GB \
                 free beside {} ({CACHE_ENV}=DIR puts it elsewhere, {ENV}=rows turns it off)",
                (total as f64 + 1e9) / 1e9,
                path.display()
            )
        } else {
            match tilecache::store(path, key, model_dir, &ws, &refs) {
                Ok(()) => format!(
                    "made the CPU decode copy ({mb:.0} MB, {secs:.1} s) and kept it in {} for \
                     later starts ({ENV}=rows turns it off)",
                    path.display()
                ),
                Err(e) => format!(
                    "made the CPU decode copy ({mb:.0} MB, {secs:.1} s); could not keep it in \
                     {}: {e}",
                    path.display()
                ),
            }
        });
    }
    for (w, t) in ws.iter().zip(copies) {
        w.cpu_copy.put(t);
    }
    notes
}

/// How the decode copies of `ws` are held, in words (`bot bench`'s "decode copy": on
/// Intel's CPUs they, not the model's files, are what decode streams): their size and how
/// much of them the kernel maps in 2 MiB pages now; `None` where none has a copy.
pub fn describe_memory(ws: &[&QMatrix]) -> Option<String> {
    let (total, huge) = held(ws)?;
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    Some(match huge {
        Some(huge) => format!(
            "tile16, {:.1} of {:.1} MiB in 2 MiB pages",
            mib(huge),
            mib(total)
        ),
        None => format!("tile16, {:.1} MiB", mib(total)),
    })
}

/// The bytes of `ws`' copies and how many of them are in 2 MiB pages, where the kernel says.
fn held(ws: &[&QMatrix]) -> Option<(u64, Option<u64>)> {
    let copies: Vec<&Tiles> = ws
        .iter()
        .filter_map(|w| w.cpu_copy.peek::<Tiles>())
        .collect();
    if copies.is_empty() {
        return None;
    }
    let total = copies.iter().map(|t| t.nbytes() as u64).sum::<u64>();
    // a cache file is one mapping for all of them, copies made at load one each
    let addrs: Vec<usize> = copies.iter().map(|t| t.bytes().as_ptr() as usize).collect();
    // a cache file's mapping also holds its index, and the kernel may merge a copy's
    // anonymous mapping with a neighbour's: at most the copies' bytes
    let huge = crate::engine::resident::huge_bytes_at(&addrs).map(|h| h.min(total));
    Some((total, huge))
}

/// A matrix's whole tiles (rows `0..tiles * 16`) in the interleaved layout. Tile `t`, group
/// `g` starts at `(t * gpr + g) * group_bytes`: word `w` of the group's codes for rows
/// `16t..16t + 16` (64 bytes: row `16t + r`'s word at `4r`), for each of the group's `gs / 8`
/// words, then the 16 rows' bf16 scales (32 bytes) and bf16 biases (32 bytes).
pub struct Tiles {
    /// The copy's bytes: a buffer made at load, or a piece of a cache file mapped
    /// (`tilecache.rs`).
    bytes: Bytes,
    pub tiles: usize,
    pub gpr: usize,
    /// log2(group size / 32): 0, 1 or 2.
    pub gshift: usize,
}

impl Tiles {
    /// The layout `w`'s copy has (no bytes checked): whole tiles, groups a row, log2(group
    /// size / 32); `None` where the kernel does not take `w` (see `of`).
    pub fn layout_of(w: &QMatrix) -> Option<(usize, usize, usize)> {
        let gs = w.params.group_size;
        let ok = w.params.bits == 4
            && matches!(gs, 32 | 64 | 128)
            && w.scales.dtype == Dtype::BF16
            && w.biases.dtype == Dtype::BF16
            && w.rows >= ROWS;
        ok.then(|| {
            (
                w.rows / ROWS,
                w.cols / gs,
                (gs / 32).trailing_zeros() as usize,
            )
        })
    }

    /// The copy's size in bytes for that layout.
    pub fn len_of((tiles, gpr, gshift): (usize, usize, usize)) -> usize {
        tiles * gpr * group_bytes(gshift)
    }

    /// A copy over bytes already in the layout (a cache file's), checked for size.
    pub(crate) fn from_bytes(w: &QMatrix, bytes: Bytes) -> Option<Tiles> {
        let layout = Self::layout_of(w)?;
        let (tiles, gpr, gshift) = layout;
        (bytes.len() == Self::len_of(layout)).then_some(Tiles {
            bytes,
            tiles,
            gpr,
            gshift,
        })
    }

    /// The copy's bytes.
    pub fn bytes(&self) -> &[u8] {
        &self.bytes[..]
    }

    /// Bytes of one (tile, group): its codes, then 64 bytes of scales and biases.
    pub fn group_bytes(&self) -> usize {
        group_bytes(self.gshift)
    }

    /// The copy's size in bytes.
    pub fn nbytes(&self) -> usize {
        self.bytes.len()
    }

    /// Tile `t`'s bytes (all its groups).
    pub fn tile(&self, t: usize) -> &[u8] {
        let n = self.gpr * self.group_bytes();
        &self.bytes[t * n..(t + 1) * n]
    }

    /// The copy of `w`, or `None` where the kernel does not take it (not 4-bit, groups other
    /// than 32/64/128, scales or biases not bf16, fewer than 16 rows) or memory for it is
    /// refused.
    pub fn of(w: &QMatrix) -> Option<Tiles> {
        use rayon::prelude::*;
        let layout = Self::layout_of(w)?;
        let (tiles, gpr, gshift) = layout;
        let gb = group_bytes(gshift);
        let gs = w.params.group_size;
        let mut buf = HugeBuf::zeroed(Self::len_of(layout)).ok()?;
        let (packed, scales, biases) = (&w.packed[..], &w.scales.bytes[..], &w.biases.bytes[..]);
        let (row_bytes, words) = (w.cols / 2, gs / 8);
        buf.par_chunks_mut(gpr * gb)
            .enumerate()
            .for_each(|(t, tile)| {
                for (g, piece) in tile.chunks_exact_mut(gb).enumerate() {
                    let (codes, sb) = piece.split_at_mut(words * 64);
                    for r in 0..ROWS {
                        let n = t * ROWS + r;
                        let src = &packed[n * row_bytes + g * words * 4..][..words * 4];
                        for (wd, word) in src.chunks_exact(4).enumerate() {
                            codes[wd * 64 + 4 * r..][..4].copy_from_slice(word);
                        }
                        let at = 2 * (n * gpr + g);
                        sb[2 * r..2 * r + 2].copy_from_slice(&scales[at..at + 2]);
                        sb[32 + 2 * r..32 + 2 * r + 2].copy_from_slice(&biases[at..at + 2]);
                    }
                }
            });
        let buf = buf.freeze().ok()?;
        let len = buf.as_ref().len();
        Some(Tiles {
            bytes: Bytes::slice_of(std::sync::Arc::new(buf), 0, len),
            tiles,
            gpr,
            gshift,
        })
    }
}

/// Makes `w`'s copy and keeps it with the matrix, where the kernel takes it: its size in
/// bytes, or `None`.
pub fn attach(w: &QMatrix) -> Option<usize> {
    let t = Tiles::of(w)?;
    let n = t.nbytes();
    w.cpu_copy.put(t);
    Some(n)
}

fn group_bytes(gshift: usize) -> usize {
    // (32 << gshift) / 8 words of 16 rows, 4 bytes each; 64 bytes of scales and biases
    ((4 << gshift) + 1) * 64
}

/// Tile `t`'s 16 outputs against activation row 0 of `a`, without SIMD: the definition the
/// AVX-512 kernel reproduces bit for bit (the same integer sums, the same f32 operations in
/// the same order).
pub fn tile_scalar(w: &Tiles, a: &IntActs, t: usize, out: &mut [f32]) {
    let tile = w.tile(t);
    let (gb, bpg) = (w.group_bytes(), 1 << w.gshift);
    let bf16 = |b: &[u8], i: usize| crate::engine::cpu::quant::bf16_at(b, i);
    for (r, o) in out.iter_mut().enumerate().take(ROWS) {
        let (mut acc, mut accb) = (0f32, 0f32);
        for g in 0..w.gpr {
            let piece = &tile[g * gb..(g + 1) * gb];
            let sb = &piece[gb - 64..];
            let (s, bias) = (bf16(sb, r), bf16(&sb[32..], r));
            accb = bias.mul_add(a.gsum[g], accb);
            for blk in 0..bpg {
                let b = g * bpg + blk;
                let mut isum = 0i32;
                for wd in 0..4 {
                    let word = &piece[(blk * 4 + wd) * 64 + 4 * r..][..4];
                    for (j, &byte) in word.iter().enumerate() {
                        let pos = 8 * wd + 2 * j;
                        isum += (byte & 15) as i32 * a.code(0, b, pos);
                        isum += (byte >> 4) as i32 * a.code(0, b, pos + 1);
                    }
                }
                acc = (isum as f32).mul_add(s * a.d[b], acc);
            }
        }
        *o = acc + accb;
    }
}

/// One 64-value block of a tile (its 8 words of 16 rows, 512 bytes at `codes`) transposed
/// to rows, for the prompt kernels (`amx.rs`, `vnni.rs`): two rounds of in-lane unpacks give
/// `q[k]` (k < 4), whose 128-bit lane `L` holds words 0-3 of row `4L + k`, and `q[k + 4]`,
/// its words 4-7: a row's 32 bytes in MLX's layout, in two 16-byte pieces.
///
/// # Safety
/// The CPU has AVX-512 F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
pub(crate) unsafe fn transpose_block(codes: &[u8]) -> [std::arch::x86_64::__m512i; 8] {
    use std::arch::x86_64::*;
    assert!(codes.len() >= 8 * 64);
    let p = codes.as_ptr() as *const __m512i;
    let v: [__m512i; 8] = std::array::from_fn(|w| _mm512_loadu_si512(p.add(w)));
    // rows (4L, 4L+1) and (4L+2, 4L+3) of word pairs (0,1), (2,3), (4,5), (6,7)
    let lo: [__m512i; 4] = std::array::from_fn(|i| _mm512_unpacklo_epi32(v[2 * i], v[2 * i + 1]));
    let hi: [__m512i; 4] = std::array::from_fn(|i| _mm512_unpackhi_epi32(v[2 * i], v[2 * i + 1]));
    [
        _mm512_unpacklo_epi64(lo[0], lo[1]),
        _mm512_unpackhi_epi64(lo[0], lo[1]),
        _mm512_unpacklo_epi64(hi[0], hi[1]),
        _mm512_unpackhi_epi64(hi[0], hi[1]),
        _mm512_unpacklo_epi64(lo[2], lo[3]),
        _mm512_unpackhi_epi64(lo[2], lo[3]),
        _mm512_unpacklo_epi64(hi[2], hi[3]),
        _mm512_unpackhi_epi64(hi[2], hi[3]),
    ]
}

/// Tiles `tiles` of `w` against activation row 0 of `a` (halves layout, 15-bit with `split`),
/// 16 outputs a tile into `outs`.
///
/// # Safety
/// The CPU has AVX-512 F/BW/VL and VNNI; `a` holds one row of `w`'s inputs in the halves
/// layout; `outs` holds `16 * tiles.len()` values.
#[cfg(target_arch = "x86_64")]
pub unsafe fn tiles_avx512(
    w: &Tiles,
    a: &IntActs,
    tiles: std::ops::Range<usize>,
    split: bool,
    outs: &mut [f32],
) {
    assert_eq!(outs.len(), ROWS * tiles.len(), "16 outputs a tile");
    match (split, w.gshift) {
        (true, 0) => simd::run::<true, 0>(w, a, tiles, outs),
        (true, 1) => simd::run::<true, 1>(w, a, tiles, outs),
        (true, _) => simd::run::<true, 2>(w, a, tiles, outs),
        (false, 0) => simd::run::<false, 0>(w, a, tiles, outs),
        (false, 1) => simd::run::<false, 1>(w, a, tiles, outs),
        (false, _) => simd::run::<false, 2>(w, a, tiles, outs),
    }
}

#[cfg(target_arch = "x86_64")]
mod simd {
    use std::arch::x86_64::*;

    use super::{IntActs, Tiles, ROWS};

    /// How far ahead of the codes being read a task prefetches, into L1 (T0): on the Xeon
    /// (where this copy is read by default) the 8B decode ran a median 5% faster so than
    /// with the row kernels' T1 hint (`x86.rs`, tuned on AMD's CPUs), the 0.6B unchanged
    /// within the noise; 8, 16 and 32 KiB ahead were no better.
    const PFD: usize = 4096;

    /// A task's tiles, two at a time: tile `i` of its first half with tile `i` of its
    /// second, so the task reads two sequential streams (as the row kernels' pairs do,
    /// `x86.rs`): one stream alone is held to what the hardware prefetchers keep in flight
    /// for it.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
    pub(super) unsafe fn run<const SPLIT: bool, const G: usize>(
        w: &Tiles,
        a: &IntActs,
        tiles: std::ops::Range<usize>,
        outs: &mut [f32],
    ) {
        // one row's activations: `nb` block scales and `gpr` group sums, `nb` blocks of codes
        let nb = w.gpr << G;
        assert!(a.d.len() >= nb && a.gsum.len() >= w.gpr && a.el.len() >= nb * 16);
        assert!(a.ol.len() >= nb * 16 && (!SPLIT || a.eh.len().min(a.oh.len()) >= nb * 16));
        let (t0, n) = (tiles.start, tiles.len());
        let h = n / 2;
        let (first, second) = outs.split_at_mut(h * ROWS);
        for (i, (o0, o1)) in first
            .chunks_exact_mut(ROWS)
            .zip(second.chunks_exact_mut(ROWS))
            .enumerate()
        {
            let [y0, y1] = tiles_at::<SPLIT, G, 2>(w, a, [t0 + i, t0 + h + i]);
            _mm512_storeu_ps(o0.as_mut_ptr(), y0);
            _mm512_storeu_ps(o1.as_mut_ptr(), y1);
        }
        if n % 2 == 1 {
            let [y] = tiles_at::<SPLIT, G, 1>(w, a, [t0 + n - 1]);
            _mm512_storeu_ps(outs[(n - 1) * ROWS..].as_mut_ptr(), y);
        }
    }

    /// The 16 outputs of each of `P` tiles, their loads interleaved word by word. Per tile
    /// the same operations in the same order as `tile_scalar`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
    #[inline]
    unsafe fn tiles_at<const SPLIT: bool, const G: usize, const P: usize>(
        w: &Tiles,
        a: &IntActs,
        ts: [usize; P],
    ) -> [__m512; P] {
        let mask = _mm512_set1_epi8(0x0f);
        let gb = w.group_bytes();
        let codes = (4 << G) * 64;
        // one dword of activation codes (4 values) at byte `off` of a halves vector, in every
        // lane: a float broadcast from memory is a load alone (an integer one from a
        // register was a load and a shuffle, the way the compiler wrote `set1`)
        let dw = |v: *const i8, off: usize| {
            _mm512_castps_si512(_mm512_set1_ps((v.add(off) as *const f32).read_unaligned()))
        };
        let (el, ol, eh, oh) = (a.el.as_ptr(), a.ol.as_ptr(), a.eh.as_ptr(), a.oh.as_ptr());
        let (dp, gp) = (a.d.as_ptr(), a.gsum.as_ptr());
        let bf = |q: *const u8| {
            _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_loadu_si256(q as *const __m256i)),
                16,
            ))
        };
        let base = ts.map(|t| w.tile(t).as_ptr());
        let mut acc = [_mm512_setzero_ps(); P];
        let mut accb = [_mm512_setzero_ps(); P];
        for g in 0..w.gpr {
            let p = base.map(|b| b.add(g * gb));
            let gsum = _mm512_set1_ps(*gp.add(g));
            let mut s = [_mm512_setzero_ps(); P];
            for j in 0..P {
                s[j] = bf(p[j].add(codes));
                accb[j] = _mm512_fmadd_ps(bf(p[j].add(codes + 32)), gsum, accb[j]);
            }
            for blk in 0..1 << G {
                let b = (g << G) + blk;
                // four sums a tile (even and odd codes, low and high activation parts), so
                // no `vpdpbusd` waits on the one before it in the block
                let mut c = [[_mm512_setzero_si512(); 4]; P];
                for wd in 0..4 {
                    let off = b * 16 + 4 * wd;
                    let x = if SPLIT {
                        [dw(el, off), dw(ol, off), dw(eh, off), dw(oh, off)]
                    } else {
                        // (`eh`, `oh` are empty with 8-bit activations)
                        [
                            dw(el, off),
                            dw(ol, off),
                            _mm512_setzero_si512(),
                            _mm512_setzero_si512(),
                        ]
                    };
                    for j in 0..P {
                        let q = p[j].add((blk * 4 + wd) * 64);
                        // a hint: an address past the copy does not fault
                        _mm_prefetch::<_MM_HINT_T0>(q.wrapping_add(PFD) as *const i8);
                        let v = _mm512_loadu_si512(q as *const _);
                        let cl = _mm512_and_si512(v, mask);
                        let ch = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
                        c[j][0] = _mm512_dpbusd_epi32(c[j][0], cl, x[0]);
                        c[j][1] = _mm512_dpbusd_epi32(c[j][1], ch, x[1]);
                        if SPLIT {
                            c[j][2] = _mm512_dpbusd_epi32(c[j][2], cl, x[2]);
                            c[j][3] = _mm512_dpbusd_epi32(c[j][3], ch, x[3]);
                        }
                    }
                }
                let d = _mm512_set1_ps(*dp.add(b));
                for j in 0..P {
                    let lo = _mm512_add_epi32(c[j][0], c[j][1]);
                    let isum = if SPLIT {
                        let hi = _mm512_add_epi32(c[j][2], c[j][3]);
                        _mm512_add_epi32(lo, _mm512_slli_epi32(hi, 7))
                    } else {
                        lo
                    };
                    let sd = _mm512_mul_ps(s[j], d);
                    acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), sd, acc[j]);
                }
            }
        }
        let mut y = acc;
        for j in 0..P {
            y[j] = _mm512_add_ps(acc[j], accb[j]);
        }
        y
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::cpu::isa;
    use crate::engine::cpu::quant::{int_q4_scalar, ActLayout};
    use crate::engine::quant::testutil::{named_qmatrices, random_qmatrix};

    fn rand_x(k: usize, seed: u64) -> Vec<f32> {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        (0..k).map(|_| rng.random_range(-2.0f32..2.0)).collect()
    }

    /// The copy holds every code, scale and bias where the layout says: the scalar tile
    /// kernel over it equals the row kernels' scalar definition up to f32 rounding (1e-5 of
    /// the largest output), for each group size and activation width; and the AVX-512 kernel
    /// equals the scalar tile kernel bit for bit where the CPU has it.
    #[test]
    fn tiles_match_the_row_definition_and_avx512_matches_scalar() {
        // the scalar tile kernel everywhere, the AVX-512 one where it runs
        #[cfg(target_arch = "x86_64")]
        let avx512 = isa::tested_here(
            isa::Isa::Avx512Vnni,
            "tiles_match_the_row_definition_and_avx512_matches_scalar",
        );
        for (gs, k, rows) in [(32, 96, 16), (64, 1024, 48), (128, 640, 40), (64, 448, 35)] {
            let w = random_qmatrix(rows, k, 4, gs, Dtype::BF16, k as u64 + rows as u64);
            let tiles = Tiles::of(&w).expect("a 4-bit bf16 matrix of 16 rows or more");
            assert_eq!(tiles.tiles, rows / ROWS);
            let x = rand_x(k, 3);
            for split in [true, false] {
                let a = IntActs::new(&x, 1, k, gs, split, ActLayout::Halves);
                let want = int_q4_scalar(&w, &x, 1, split);
                let big = want.iter().fold(0f32, |m, v| m.max(v.abs()));
                let mut got = vec![0f32; tiles.tiles * ROWS];
                for (t, out) in got.chunks_exact_mut(ROWS).enumerate() {
                    tile_scalar(&tiles, &a, t, out);
                }
                for (n, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert!(
                        (g - w).abs() <= 1e-5 * big,
                        "gs {gs} k {k} split {split} row {n}: {g} vs {w}"
                    );
                }
                #[cfg(target_arch = "x86_64")]
                if avx512 {
                    let mut simd = vec![f32::NAN; got.len()];
                    // SAFETY: the CPU has AVX-512 VNNI (checked above); `a` is one row of
                    // `k` inputs in the halves layout; `simd` holds every tile's outputs.
                    unsafe { tiles_avx512(&tiles, &a, 0..tiles.tiles, split, &mut simd) };
                    for (n, (s, g)) in simd.iter().zip(&got).enumerate() {
                        assert_eq!(s.to_bits(), g.to_bits(), "gs {gs} split {split} row {n}");
                    }
                }
            }
        }
    }

    /// Through the decode matvec (`qmatvec_shared`, two threads, so tasks split the
    /// matrices): with the copies, each whole tile's rows are `tile_scalar`'s bits where the
    /// active instruction set is AVX-512 (and the row kernel's elsewhere), and the rows past
    /// the last tile (24 rows: 8) the row kernel's bits either way. (The tasks start at whole
    /// tiles when every matrix before has whole tiles, as Qwen3's all do; elsewhere rows
    /// around a task's tiles run the row kernel.)
    #[test]
    fn the_decode_matvec_reads_the_copy_for_whole_tiles() {
        use crate::engine::cpu::quant::qmatvec_shared;
        use crate::engine::quant::Numerics;
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .expect("pool");
        let k = 1024;
        let ws: Vec<QMatrix> = [48, 1024, 24]
            .iter()
            .map(|&r| random_qmatrix(r, k, 4, 64, Dtype::BF16, r as u64))
            .collect();
        let refs: Vec<&QMatrix> = ws.iter().collect();
        let x = rand_x(k, 9);
        let rows = pool
            .install(|| qmatvec_shared(&refs, &x, Numerics::Fast))
            .expect("the integer kernel takes these");
        for w in &ws {
            w.cpu_copy.put(Tiles::of(w).expect("a copy"));
        }
        let tiled = pool
            .install(|| qmatvec_shared(&refs, &x, Numerics::Fast))
            .expect("the integer kernel takes these");
        let on = isa::active().avx512();
        eprintln!("tile16 through qmatvec_shared: active {:?}", isa::active());
        let a = IntActs::new(&x, 1, k, 64, true, ActLayout::Halves);
        for (w, (r, t)) in ws.iter().zip(rows.iter().zip(&tiled)) {
            let copy = w.cpu_copy.peek::<Tiles>().expect("put above");
            let mut want = r.clone();
            if on {
                for (tile, out) in want.chunks_exact_mut(ROWS).enumerate() {
                    tile_scalar(copy, &a, tile, out);
                }
            }
            for (n, (g, e)) in t.iter().zip(&want).enumerate() {
                assert_eq!(g.to_bits(), e.to_bits(), "{} rows, row {n}", w.rows);
            }
        }
    }

    /// The first start makes the copies and keeps them (one note); the next maps the same
    /// bytes from the file (no note); a changed model file makes them again; no cache
    /// directory, nothing kept; a matrix the kernel does not take gets none.
    #[test]
    fn prepare_keeps_the_copies_and_maps_them_back() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (model, cache) = (dir.path().join("model"), dir.path().join("cache"));
        std::fs::create_dir_all(&model).expect("mkdir");
        let file = model.join("model.safetensors");
        std::fs::write(&file, b"weights").expect("write");
        let make = || named_qmatrices(&[(32, 256, 64), (48, 128, 32), (8, 64, 64)]);
        let run = |ws: &[QMatrix], cache: Option<&Path>| {
            let refs: Vec<&QMatrix> = ws.iter().collect();
            prepare_in(&refs, &[&FileStamp::of_path(&file)], &model, cache, 0)
        };
        let first = make();
        let notes = run(&first, Some(&cache));
        assert!(
            notes.len() == 1 && notes[0].contains("kept it in"),
            "{notes:?}"
        );
        assert!(
            first[2].cpu_copy.peek::<Tiles>().is_none(),
            "8 rows: no tile"
        );
        let second = make();
        assert!(
            run(&second, Some(&cache)).is_empty(),
            "mapped, nothing to say"
        );
        for (a, b) in first.iter().zip(&second).take(2) {
            let (a, b) = (a.cpu_copy.peek::<Tiles>(), b.cpu_copy.peek::<Tiles>());
            let (a, b) = (a.expect("made"), b.expect("mapped"));
            assert_eq!(a.bytes(), b.bytes());
        }
        // another size: another key, whatever the clock's resolution
        std::fs::write(&file, b"new weights").expect("write");
        let notes = run(&make(), Some(&cache));
        assert!(
            notes.len() == 1 && notes[0].contains("kept it in"),
            "{notes:?}"
        );
        // what `bot bench` says of them: the two copies' bytes, and on Linux the huge part
        let refs: Vec<&QMatrix> = second.iter().collect();
        let (total, huge) = held(&refs).expect("copies held");
        let want: usize = second[..2]
            .iter()
            .map(|w| Tiles::len_of(Tiles::layout_of(w).expect("tiled")))
            .sum();
        assert_eq!(total, want as u64);
        assert_eq!(huge.is_some(), cfg!(target_os = "linux"));
        assert!(describe_memory(&refs).is_some_and(|d| d.starts_with("tile16, ")));
        assert!(held(&refs[2..]).is_none(), "no copy, nothing to say");
        let none = make();
        assert!(run(&none, None).is_empty());
        assert!(none[0].cpu_copy.peek::<Tiles>().is_some(), "made, not kept");
        let kept = std::fs::read_dir(&cache).expect("ls").count();
        assert_eq!(kept, 1, "one file a model directory");
    }

    /// Matrices the kernel does not take get no copy.
    #[test]
    fn no_copy_where_the_kernel_does_not_apply() {
        assert!(Tiles::of(&random_qmatrix(15, 64, 4, 64, Dtype::BF16, 1)).is_none());
        assert!(Tiles::of(&random_qmatrix(32, 64, 4, 64, Dtype::F16, 1)).is_none());
        assert!(Tiles::of(&random_qmatrix(32, 64, 8, 64, Dtype::BF16, 1)).is_none());
        assert!(Tiles::of(&random_qmatrix(32, 512, 4, 256, Dtype::BF16, 1)).is_none());
    }
}
