//! The machine's plain read rate at this minute: `threads` threads each sum their part of a 1
//! GiB buffer (in 2 MiB pages where the kernel gives them), front to back, in two loops taken
//! in turn: one with a T1 prefetch 4 KiB ahead on x86-64 (the hint the decode kernels use),
//! one with no hint. On this project's Zen 4 EPYC the loop without the hint read 10-30% more
//! (2 threads 28-34 GB/s against 23-31, one thread 27-30 against 21-23), while the decode
//! kernel without its hint streamed ~12% less (docs/performance.md, twenty-sixth session); on
//! the Xeon (Emerald Rapids) the unhinted loop read 16-55% less (twenty-seventh): so the
//! faster loop's median is the figure. A decode step of a model that does not fit the
//! caches cannot stream its weights much faster than this, so `scripts/bench-peers.sh` prints
//! it beside each round: on a shared machine it moves 25-49 GB/s from minute to minute (this
//! project's 2-core EPYCs), and a decode rate means little without it.
//!
//!   cargo run --release --example read_rate [threads] [rounds]
//!
//! Prints the faster loop's median, min and max over the rounds in GB/s (10^9 bytes a
//! second), and each loop's median.
use std::time::Instant;

const BYTES: usize = 1 << 30;
const PAGE: usize = 2 << 20;

fn main() {
    let mut args = std::env::args().skip(1);
    let threads: usize = args.next().and_then(|s| s.parse().ok()).unwrap_or(2).max(1);
    let rounds: usize = args.next().and_then(|s| s.parse().ok()).unwrap_or(5).max(1);
    let layout = std::alloc::Layout::from_size_align(BYTES, PAGE).expect("a valid layout");
    // SAFETY: the layout has a non-zero size; the pointer is checked, written whole before it
    // is read, and freed with the same layout
    let buf: &mut [u64] = unsafe {
        let p = std::alloc::alloc(layout);
        assert!(!p.is_null(), "cannot allocate 1 GiB");
        #[cfg(target_os = "linux")]
        libc::madvise(p as *mut libc::c_void, BYTES, libc::MADV_HUGEPAGE);
        std::slice::from_raw_parts_mut(p as *mut u64, BYTES / 8)
    };
    for (i, v) in buf.iter_mut().enumerate() {
        *v = i as u64;
    }
    let per = buf.len() / threads;
    // rates of the loop with the hint ([0]) and without ([1]), rounds taken in turn
    let mut rates = [Vec::new(), Vec::new()];
    let mut check = 0u64;
    for _ in 0..rounds {
        for (hint, rates) in [true, false].into_iter().zip(rates.iter_mut()) {
            let t = Instant::now();
            let sums: Vec<u64> = std::thread::scope(|s| {
                let parts: Vec<_> = buf
                    .chunks(per)
                    .take(threads)
                    .map(|part| s.spawn(move || sum(part, hint)))
                    .collect();
                parts
                    .into_iter()
                    // ok: a reader only sums a slice it owns; it cannot panic
                    .map(|h| h.join().expect("a reader thread"))
                    .collect()
            });
            rates.push((per * threads * 8) as f64 / t.elapsed().as_secs_f64() / 1e9);
            check = check.wrapping_add(sums.iter().fold(0, |a, &b| a.wrapping_add(b)));
        }
    }
    for r in rates.iter_mut() {
        r.sort_by(|a, b| a.total_cmp(b));
    }
    let median = |r: &[f64]| r[r.len() / 2];
    let (hinted, plain) = (median(&rates[0]), median(&rates[1]));
    let best = if plain >= hinted {
        &rates[1]
    } else {
        &rates[0]
    };
    println!(
        "plain read, {threads} threads: median {:.1} GB/s (min {:.1}, max {:.1}; no hint {plain:.1}, T1 4 KiB ahead {hinted:.1}; check {})",
        median(best),
        best[0],
        best[best.len() - 1],
        check % 1000
    );
    // SAFETY: allocated above with this layout; `buf` is not used after
    unsafe { std::alloc::dealloc(buf.as_mut_ptr() as *mut u8, layout) };
}

/// The wrapping sum of `part`, eight independent lanes a 64-byte line; `hint`: a T1 prefetch
/// 4 KiB ahead of each line (x86-64 only).
fn sum(part: &[u64], hint: bool) -> u64 {
    #[cfg(not(target_arch = "x86_64"))]
    let _ = hint;
    let mut acc = [0u64; 8];
    for line in part.chunks_exact(8) {
        #[cfg(target_arch = "x86_64")]
        if hint {
            // SAFETY: a prefetch hint; an address past the buffer does not fault
            unsafe {
                std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T1 }>(
                    line.as_ptr().wrapping_add(512) as *const i8,
                )
            }
        }
        for (a, v) in acc.iter_mut().zip(line) {
            *a = a.wrapping_add(*v);
        }
    }
    acc.iter().fold(0, |a, &b| a.wrapping_add(b))
}
