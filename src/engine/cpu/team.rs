//! A CPU pass's workers: for one forward pass (a decode step, or a prompt's host pass), the
//! pool's other threads stop sleeping and spin, waiting for the next parallel region
//! (llama.cpp's threadpool keeps its threads hot across a graph the same way). A decode step
//! of the 0.6B shape has ~140 short regions (q|k|v, attention, o, gate|up, down a layer, and
//! the head), a 64-token prompt ~300; through rayon each costs a worker's wake-up
//! (`examples/handoff.rs`: 7-9 us a region at 2 threads, 21 us at 16, on the Zen 1 EPYC and
//! the Xeon; a chain of them where a region's tasks split in halves), through a team ~2 and
//! ~5 us.
//!
//! A region's tasks are claimed one index at a time with a compare-and-swap on one word that
//! holds the region's number, its task count and the next index: a helper that saw an earlier
//! region can never claim a task of a later one, so it never calls a closure that is gone.
//! Outside a team (prompts through tensors, tests on a pool, nested calls) `for_each_mut` is
//! rayon's.
//!
//! A helper with nothing to claim reads ahead (`read_ahead`): the leader names the bytes the
//! next region starts on (the first rows of its first two tasks), and while the leader runs
//! the serial part between regions (norms, attention set-up, residuals) or finishes a
//! region's last task, the helper prefetches them, so the memory bus is not idle then. At the
//! 8B shape on 2 threads the leader alone spent ~4.5% of a decode step outside regions and
//! ~3% waiting at their ends (Zen 4 EPYC); each was time the weights did not stream.

use std::any::Any;
use std::cell::Cell;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};

use rayon::prelude::*;

/// Task indices live in 16 bits of the state word; larger regions go to rayon.
const MAX_TASKS: usize = u16::MAX as usize;

/// Units (rows, values, blocks) a task of a parallel region over `units` takes: ~4 tasks a
/// thread, so that the region's tail is short, and no fewer than `least`, so that its
/// hand-offs stay small beside the work; all of them where there is one thread.
pub fn per_task(units: usize, least: usize) -> usize {
    let threads = rayon::current_num_threads().max(1);
    if threads == 1 {
        return units.max(1);
    }
    units.div_ceil(4 * threads).max(least).min(units).max(1)
}

/// Bytes read ahead at most per range of a hint. The gaps are 20-100 us, 0.3-1.5 MB of
/// streaming on one core; what does not fit the helper's L2 lands in L3 (a victim cache on
/// AMD), still far closer than DRAM. Measured with per-token alternation in one run (Zen 4
/// EPYC, 2 threads): 0.6B decode 17.6 -> 16.3 ms a step at 1 MiB, 8B 137.5 -> 134.9 ms, on
/// a busier hour no change at any size (256 KiB to 4 MiB).
pub const AHEAD_BYTES: usize = 1 << 20;

/// Ranges a hint holds: a region's first two tasks, and before them up to three LoRA `a`
/// matrices (q|k|v's), which the region's first tasks read (`for_each_mut_after`).
const RANGES: usize = 5;

/// What the next region reads first: up to `RANGES` byte ranges, as addresses (a hint: they
/// are only ever prefetched, never read, so a range that is gone by then costs nothing).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Ahead {
    ranges: [(usize, usize); RANGES],
}

impl Ahead {
    /// The first `AHEAD_BYTES` (at most) of each of up to `RANGES` slices.
    pub fn of(slices: &[&[u8]]) -> Self {
        Ahead::before(slices, Ahead::default())
    }

    /// `rest`'s ranges after the first `AHEAD_BYTES` (at most) of each of `first` (helpers
    /// read every range a step at a time, in this order), as many as `RANGES` allows.
    pub fn before<T>(first: &[&[T]], rest: Ahead) -> Self {
        let firsts = first
            .iter()
            .map(|s| (s.as_ptr() as usize, std::mem::size_of_val(*s)));
        Self::before_ranges(firsts, rest)
    }

    /// `before` with the first ranges as (address, bytes).
    pub fn before_ranges(first: impl IntoIterator<Item = (usize, usize)>, rest: Ahead) -> Self {
        let firsts = first
            .into_iter()
            .map(|(addr, len)| (addr, len.min(AHEAD_BYTES)));
        let rests = rest.ranges.into_iter().filter(|&(_, len)| len > 0);
        let mut a = Ahead::default();
        for (r, v) in a.ranges.iter_mut().zip(firsts.chain(rests)) {
            *r = v;
        }
        a
    }

    /// (address, length) of each range.
    pub fn ranges(&self) -> [(usize, usize); RANGES] {
        self.ranges
    }
}

/// Asks the team this thread leads, if it leads one, to read `ahead` into its helpers'
/// caches while they wait for the next region; replaces the last hint. A no-op elsewhere.
pub fn read_ahead(ahead: Ahead) {
    let team = LEADING.with(Cell::get);
    if team.is_null() {
        return;
    }
    // SAFETY: `LEADING` is set only inside `Team::lead` on this thread, while the team lives.
    let team = unsafe { &*team };
    for (slot, &(addr, len)) in team.ahead.iter().zip(&ahead.ranges) {
        slot[0].store(addr, Ordering::Relaxed);
        slot[1].store(len, Ordering::Relaxed);
    }
    team.ahead_gen.fetch_add(1, Ordering::Release);
}

/// A hint to the cache hierarchy: the line at `addr` into L2. A prefetch never faults and
/// reads nothing the program can see, so any address will do.
#[inline]
fn prefetch_line(addr: usize) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch has no effect on memory and cannot fault (see above).
    unsafe {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T1};
        _mm_prefetch::<_MM_HINT_T1>(addr as *const i8)
    }
    #[cfg(target_arch = "aarch64")]
    // SAFETY: as above (`prfm` is a hint).
    unsafe {
        std::arch::asm!("prfm pldl2keep, [{0}]", in(reg) addr, options(nostack, readonly, preserves_flags))
    }
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    let _ = addr;
}

/// Every cache line of `s` into L2 (`prefetch_line`): for a task to ask early for small data
/// it reads only after its main work (a LoRA branch's `b` for its rows, after the matmul),
/// which would otherwise come from DRAM a miss at a time.
pub fn prefetch<T>(s: &[T]) {
    let (addr, len) = (s.as_ptr() as usize, std::mem::size_of_val(s));
    let mut off = 0;
    while off < len {
        prefetch_line(addr.wrapping_add(off));
        off += 64;
    }
}

/// A helper's progress through the current read-ahead hint.
#[derive(Default)]
struct Reading {
    gen: u64,
    ranges: [(usize, usize); RANGES],
    done: usize,
}

/// `f(item)` for every item, each exactly once, in parallel: on the team this thread leads if it
/// leads one, else on rayon's pool.
pub fn for_each_mut<T: Send>(items: &mut [T], f: impl Fn(&mut T) + Sync) {
    let team = LEADING.with(Cell::get);
    if items.len() < 2 {
        items.iter_mut().for_each(f);
        return;
    }
    if team.is_null() || items.len() > MAX_TASKS {
        items.par_iter_mut().for_each(&f);
        return;
    }
    let base = SendPtr(items.as_mut_ptr());
    let run = |i: usize| {
        let base = &base;
        // SAFETY: `Team::run` hands out each index in 0..len once, so the `&mut` are
        // disjoint, and returns only after every task has finished.
        f(unsafe { &mut *base.0.add(i) })
    };
    // SAFETY: `LEADING` is set only inside `Team::lead` on this thread, while the team lives.
    unsafe { (*team).run(items.len(), &run) };
}

/// What a task of `for_each_mut_after` waits on: every leading task (`pre`) finished.
pub struct Ready<'a> {
    done: &'a AtomicUsize,
    of: usize,
}

impl Ready<'_> {
    /// Returns once every `pre` task has finished (and its writes are visible to this
    /// thread). In a team the wait is short or none: tasks are claimed in index order, so
    /// every `pre` task is already running on some thread by the time an item's task starts.
    pub fn wait(&self) {
        let mut idle = 0u32;
        while self.done.load(Ordering::Acquire) < self.of {
            pause(&mut idle);
        }
    }
}

/// `pre(j)` for each `j` in `0..pre_tasks`, then `f(item, ready)` for every item, in one
/// parallel region where this thread leads a team: the `pre` tasks come first in the claim
/// order and an item's task calls `ready.wait()` before it uses what they wrote. Work that
/// every item needs (a LoRA branch's `x @ a`) then runs on the whole team instead of before
/// the region on the leading thread alone, and an item waits only after its own share of the
/// rest. Elsewhere (rayon, whose jobs run in no fixed order) the `pre` tasks run first, as a
/// region of their own.
pub fn for_each_mut_after<T: Send>(
    pre_tasks: usize,
    pre: impl Fn(usize) + Sync,
    items: &mut [T],
    f: impl Fn(&mut T, &Ready) + Sync,
) {
    let done = AtomicUsize::new(0);
    let ready = Ready {
        done: &done,
        of: pre_tasks,
    };
    let team = LEADING.with(Cell::get);
    let tasks = pre_tasks + items.len();
    if team.is_null() || !(2..=MAX_TASKS).contains(&tasks) {
        (0..pre_tasks).into_par_iter().for_each(&pre);
        done.store(pre_tasks, Ordering::Release);
        for_each_mut(items, |item| f(item, &ready));
        return;
    }
    // counted on every way out of a `pre` task, a panic too (the team resumes it at the
    // region's end), so no item waits forever
    struct Count<'a>(&'a AtomicUsize);
    impl Drop for Count<'_> {
        fn drop(&mut self) {
            self.0.fetch_add(1, Ordering::AcqRel);
        }
    }
    let base = SendPtr(items.as_mut_ptr());
    let run = |i: usize| {
        if i < pre_tasks {
            let _count = Count(&done);
            pre(i);
            return;
        }
        let base = &base;
        // SAFETY: `Team::run` hands out each index in 0..tasks once, so the `&mut` are
        // disjoint, and returns only after every task has finished.
        f(unsafe { &mut *base.0.add(i - pre_tasks) }, &ready)
    };
    // SAFETY: `LEADING` is set only inside `Team::lead` on this thread, while the team lives.
    unsafe { (*team).run(tasks, &run) };
}

struct SendPtr<T>(*mut T);
// SAFETY: only used to hand disjoint elements of a `&mut [T]` (T: Send) to the team's threads.
unsafe impl<T: Send> Sync for SendPtr<T> {}

thread_local! {
    /// The team whose regions this thread opens now (null inside a region's task).
    static LEADING: Cell<*const Team> = const { Cell::new(std::ptr::null()) };
    /// Whether this thread leads a team or helps one now.
    static IN_TEAM: Cell<bool> = const { Cell::new(false) };
}

/// One wait of a spin: a pause instruction, and after ~4k of them in a row (~0.1-0.5 ms)
/// a yield to the OS as well, for a machine with more runnable threads than cores.
fn pause(idle: &mut u32) {
    *idle = idle.saturating_add(1);
    if *idle > 4096 {
        std::thread::yield_now();
    } else {
        std::hint::spin_loop();
    }
}

type Job<'a> = &'a (dyn Fn(usize) + Sync);

pub struct Team {
    /// `region << 32 | tasks << 16 | next`: the current region, its task count, the next
    /// unclaimed index.
    state: AtomicU64,
    /// The current region's closure, written by the leader before it publishes the region.
    job: std::cell::UnsafeCell<Option<Job<'static>>>,
    done: AtomicUsize,
    /// The first panic of a region's tasks, for the leader to resume.
    panic: Mutex<Option<Box<dyn Any + Send>>>,
    stop: AtomicBool,
    /// The read-ahead hint (`read_ahead`): (address, length) of each range, and a count the
    /// leader bumps after writing them.
    ahead: [[AtomicUsize; 2]; RANGES],
    ahead_gen: AtomicU64,
}

// SAFETY: `job` is written only by the leader while no region is open (every task of the last
// one has finished) and read only by a thread that has claimed a task of the open region.
unsafe impl Sync for Team {}

impl Team {
    fn new() -> Self {
        Team {
            state: AtomicU64::new(0),
            job: std::cell::UnsafeCell::new(None),
            done: AtomicUsize::new(0),
            panic: Mutex::new(None),
            stop: AtomicBool::new(false),
            ahead: Default::default(),
            ahead_gen: AtomicU64::new(0),
        }
    }

    /// Runs `f` on this thread (a worker of the current rayon pool) with the pool's other
    /// workers helping in its parallel regions, and returns its result once they are released.
    pub fn lead<R: Send>(f: impl FnOnce() -> R + Send) -> R {
        let helpers = rayon::current_num_threads().saturating_sub(1);
        if helpers == 0 || rayon::current_thread_index().is_none() {
            return f();
        }
        let team = Team::new();
        let team = &team;
        rayon::scope(|s| {
            // released on every way out (of `f`, or of a spawn), or the scope would wait on
            // the helpers forever
            struct Release<'a>(&'a Team, *const Team, bool);
            impl Drop for Release<'_> {
                fn drop(&mut self) {
                    LEADING.with(|l| l.set(self.1));
                    IN_TEAM.with(|l| l.set(self.2));
                    self.0.stop.store(true, Ordering::Release);
                }
            }
            let _release = Release(
                team,
                LEADING.with(|l| l.replace(team)),
                IN_TEAM.with(|l| l.replace(true)),
            );
            for _ in 0..helpers {
                s.spawn(move |_| team.help());
            }
            f()
        })
    }

    /// A helper: runs the tasks it claims until the leader releases it.
    fn help(&self) {
        // Neither a leader nor a helper (inside a task that waits in a rayon join) takes a
        // helper job: rayon runs queued jobs on a thread waiting in a join, and a thread that
        // spun there, under the work it interrupted, could wait on itself.
        if IN_TEAM.with(|t| t.replace(true)) {
            return;
        }
        // no region has this number: a region open already is joined at once
        let mut seen = u64::MAX;
        let mut idle = 0u32;
        let mut reading = Reading::default();
        loop {
            let v = self.state.load(Ordering::Acquire);
            if v >> 32 != seen {
                seen = v >> 32;
                self.work(seen);
                idle = 0;
            } else if self.stop.load(Ordering::Acquire) {
                IN_TEAM.with(|t| t.set(false));
                return;
            } else if self.read_ahead_some(&mut reading) {
                idle = 0;
            } else {
                pause(&mut idle);
            }
        }
    }

    /// Prefetches the next 4 KiB of each range of the current hint; false when there is
    /// nothing left to read ahead. Small steps, so a region that opens is joined soon.
    fn read_ahead_some(&self, r: &mut Reading) -> bool {
        const STEP: usize = 4096;
        let gen = self.ahead_gen.load(Ordering::Acquire);
        if gen != r.gen {
            r.gen = gen;
            r.done = 0;
            for (range, slot) in r.ranges.iter_mut().zip(&self.ahead) {
                *range = (
                    slot[0].load(Ordering::Relaxed),
                    slot[1].load(Ordering::Relaxed),
                );
            }
        }
        let mut any = false;
        for &(addr, len) in &r.ranges {
            let end = len.min(r.done + STEP);
            let mut off = r.done;
            while off < end {
                prefetch_line(addr.wrapping_add(off));
                off += 64;
                any = true;
            }
        }
        if any {
            r.done += STEP;
        }
        any
    }

    /// Claims and runs tasks of region `region` until it has none left.
    fn work(&self, region: u64) {
        loop {
            let v = self.state.load(Ordering::Acquire);
            let (tasks, next) = ((v >> 16) & 0xffff, v & 0xffff);
            if v >> 32 != region || next >= tasks {
                return;
            }
            if self
                .state
                .compare_exchange_weak(v, v + 1, Ordering::AcqRel, Ordering::Acquire)
                .is_err()
            {
                continue;
            }
            // SAFETY: a task of the open region is claimed, so the leader is waiting for it
            // and `job` is that region's closure.
            let Some(job) = (unsafe { *self.job.get() }) else {
                unreachable!("team: a claimed task without its region's closure");
            };
            if let Err(p) = catch_unwind(AssertUnwindSafe(|| job(next as usize))) {
                self.first_panic().get_or_insert(p);
            }
            self.done.fetch_add(1, Ordering::AcqRel);
        }
    }

    /// The slot of a region's first panic (a poisoned lock still holds it).
    fn first_panic(&self) -> MutexGuard<'_, Option<Box<dyn Any + Send>>> {
        self.panic.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// One parallel region of `tasks` (2..=MAX_TASKS) tasks: `f(i)` for each `i`, on this
    /// thread and the helpers; returns when all have finished. Only the leader calls this.
    fn run(&self, tasks: usize, f: Job<'_>) {
        debug_assert!((2..=MAX_TASKS).contains(&tasks));
        // a region opened inside one of this region's tasks goes to rayon
        let leading = LEADING.with(|l| l.replace(std::ptr::null()));
        // SAFETY: no region is open (the last `run` returned after its tasks finished), so no
        // thread reads `job`; the lifetime is erased only until this function returns, and no
        // task of this region can be claimed after that.
        unsafe {
            *self.job.get() = Some(std::mem::transmute::<Job<'_>, Job<'static>>(f));
        }
        self.done.store(0, Ordering::Release);
        let region = (self.state.load(Ordering::Acquire) >> 32) + 1;
        self.state
            .store(region << 32 | (tasks as u64) << 16, Ordering::Release);
        self.work(region);
        let mut idle = 0u32;
        while self.done.load(Ordering::Acquire) < tasks {
            pause(&mut idle);
        }
        // SAFETY: every task has finished; nothing reads `job` until the next region opens.
        unsafe { *self.job.get() = None };
        LEADING.with(|l| l.set(leading));
        let panic = self.first_panic().take();
        if let Some(p) = panic {
            resume_unwind(p);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every item is visited exactly once, region after region, with and without a team,
    /// on a pool of 3 threads; with a team, helpers take part.
    #[test]
    fn each_item_once_per_region() {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(3)
            .build()
            .expect("pool");
        for lead in [false, true] {
            let threads = std::sync::Mutex::new(std::collections::HashSet::new());
            pool.install(|| {
                let body = || {
                    let mut counts = vec![0u32; 37];
                    for round in 0..300usize {
                        let n = 2 + round % 36;
                        for_each_mut(&mut counts[..n], |c| {
                            *c += 1;
                            let t = std::time::Instant::now();
                            while t.elapsed() < std::time::Duration::from_micros(5) {}
                            if let Ok(mut s) = threads.lock() {
                                s.insert(std::thread::current().id());
                            }
                        });
                    }
                    counts
                };
                let counts = if lead { Team::lead(body) } else { body() };
                let want: Vec<u32> = (0..37)
                    .map(|i| (0..300usize).filter(|r| 2 + r % 36 > i).count() as u32)
                    .collect();
                assert_eq!(counts, want, "lead {lead}");
            });
            let n = threads.lock().map(|s| s.len()).unwrap_or(0);
            assert!(n >= 2, "lead {lead}: tasks ran on {n} thread(s)");
        }
    }

    /// `for_each_mut_after`: every `pre` task runs once and has finished (its write visible)
    /// whenever an item's `ready.wait()` returns; every item is visited once; with a team on
    /// a pool of 3 threads and without one, over region sizes and `pre` counts.
    #[test]
    fn items_see_every_pre_task_finished() {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(3)
            .build()
            .expect("pool");
        for lead in [false, true] {
            pool.install(|| {
                let body = || {
                    for round in 0..200usize {
                        let pre_tasks = round % 6;
                        let n = round % 9;
                        let marks: Vec<AtomicUsize> =
                            (0..pre_tasks).map(|_| AtomicUsize::new(0)).collect();
                        let mut items = vec![0usize; n];
                        for_each_mut_after(
                            pre_tasks,
                            |j| {
                                let t = std::time::Instant::now();
                                while t.elapsed() < std::time::Duration::from_micros(3) {}
                                marks[j].fetch_add(1, Ordering::Relaxed);
                            },
                            &mut items,
                            |item, ready| {
                                ready.wait();
                                *item += 1 + marks
                                    .iter()
                                    .map(|m| m.load(Ordering::Relaxed))
                                    .sum::<usize>();
                            },
                        );
                        assert!(
                            items.iter().all(|&v| v == 1 + pre_tasks),
                            "lead {lead} round {round}: {items:?}"
                        );
                        assert!(marks.iter().all(|m| m.load(Ordering::Relaxed) == 1));
                    }
                };
                if lead {
                    Team::lead(body)
                } else {
                    body()
                }
            });
        }
    }

    /// Two teams on one pool at once, their leaders also waiting in rayon joins, and tasks
    /// opening regions of their own (which go to rayon), on pools whose workers take their own
    /// oldest queued job first (`breadth_first`: a leader's own helper jobs come before its
    /// join's) and on default pools: all finish, each item once.
    #[test]
    fn teams_with_joins_and_nested_regions_finish() {
        for breadth_first in [false, true] {
            let mut b = rayon::ThreadPoolBuilder::new().num_threads(3);
            if breadth_first {
                // deprecated for new code; this test covers pools whose users still build it
                #[allow(deprecated)]
                {
                    b = b.breadth_first();
                }
            }
            let pool = b.build().expect("pool");
            let body = || {
                Team::lead(|| {
                    let mut counts = vec![[0u32; 4]; 16];
                    for _ in 0..100 {
                        for_each_mut(&mut counts, |c| {
                            c[0] += 1;
                            for_each_mut(&mut c[1..], |x| *x += 1);
                        });
                        let (a, b) = rayon::join(|| 1, || 2);
                        assert_eq!(a + b, 3);
                    }
                    counts
                })
            };
            let (a, b) = pool.install(|| rayon::join(body, body));
            assert!(
                a.iter().chain(&b).flatten().all(|&c| c == 100),
                "breadth_first {breadth_first}"
            );
        }
    }

    /// A hint is read ahead 4 KiB a range a call until its longest range is covered, then
    /// not again; a new hint starts over; `Ahead::of` keeps at most `AHEAD_BYTES` a range.
    #[test]
    fn a_helper_reads_each_hint_once() {
        let team = Team::new();
        let mut r = Reading::default();
        assert!(!team.read_ahead_some(&mut r), "no hint yet");
        let big = vec![1u8; AHEAD_BYTES + 100];
        let small = vec![2u8; 10_000];
        let a = Ahead::of(&[&big, &small]);
        assert_eq!(a.ranges()[0], (big.as_ptr() as usize, AHEAD_BYTES));
        assert_eq!(a.ranges()[1], (small.as_ptr() as usize, 10_000));
        let publish = |a: Ahead| {
            for (slot, &(addr, len)) in team.ahead.iter().zip(&a.ranges()) {
                slot[0].store(addr, Ordering::Relaxed);
                slot[1].store(len, Ordering::Relaxed);
            }
            team.ahead_gen.fetch_add(1, Ordering::Release);
        };
        publish(a);
        let steps = std::iter::from_fn(|| team.read_ahead_some(&mut r).then_some(())).count();
        assert_eq!(steps, AHEAD_BYTES / 4096);
        assert!(!team.read_ahead_some(&mut r), "read once");
        publish(Ahead::of(&[&small]));
        let steps = std::iter::from_fn(|| team.read_ahead_some(&mut r).then_some(())).count();
        assert_eq!(steps, 10_000usize.div_ceil(4096));
    }

    /// `before` puts its slices first, keeps `rest`'s ranges after them in order, drops what
    /// does not fit, and sizes each range in bytes whatever the element type.
    #[test]
    fn ranges_before_a_hint_come_first() {
        let (t0, t1) = (vec![0u8; 300], vec![0u8; 500]);
        let rest = Ahead::of(&[&t0, &t1]);
        let a = vec![0f32; 100];
        let r = Ahead::before(&[&a[..]], rest).ranges();
        assert_eq!(r[0], (a.as_ptr() as usize, 400));
        assert_eq!(r[1], (t0.as_ptr() as usize, 300));
        assert_eq!(r[2], (t1.as_ptr() as usize, 500));
        assert_eq!(r[3], (0, 0));
        let many: Vec<Vec<f32>> = (0..RANGES).map(|_| vec![0f32; 8]).collect();
        let views: Vec<&[f32]> = many.iter().map(|v| &v[..]).collect();
        let r = Ahead::before(&views, rest).ranges();
        assert!(r
            .iter()
            .zip(&many)
            .all(|(&(p, n), v)| p == v.as_ptr() as usize && n == 32));
    }

    /// Hints, stale ones included (a buffer freed since), change no result and stop no region:
    /// a prefetch reads nothing.
    #[test]
    fn read_ahead_changes_no_result() {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .expect("pool");
        pool.install(|| {
            let counts = Team::lead(|| {
                let mut counts = vec![0u32; 16];
                for round in 0..200 {
                    let gone = vec![0u8; 3 << 20];
                    let stale = Ahead::of(&[&gone]);
                    drop(gone);
                    let live = vec![round as u8; 1 << 20];
                    read_ahead(if round % 2 == 0 {
                        stale
                    } else {
                        Ahead::of(&[&live])
                    });
                    for_each_mut(&mut counts, |c| *c += 1);
                }
                counts
            });
            assert!(counts.iter().all(|&c| c == 200));
        });
        // outside a team: nothing to hint
        read_ahead(Ahead::of(&[&[0u8; 64]]));
    }

    /// A panicking task reaches the leader with its own payload, the other tasks still run,
    /// and the worker leads a working team afterwards.
    #[test]
    fn a_panicking_task_panics_the_leader() {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .expect("pool");
        pool.install(|| {
            let mut v: Vec<(usize, u32)> = (0..64).map(|i| (i, 0)).collect();
            let r = catch_unwind(AssertUnwindSafe(|| {
                Team::lead(|| {
                    for_each_mut(&mut v, |(i, n)| {
                        *n += 1;
                        if *i == 5 {
                            panic!("task 5");
                        }
                    })
                })
            }));
            let msg = r
                .err()
                .and_then(|p| p.downcast_ref::<&str>().map(|s| s.to_string()));
            assert_eq!(msg.as_deref(), Some("task 5"));
            assert!(v.iter().all(|&(_, n)| n == 1));
            assert!(!IN_TEAM.with(Cell::get) && LEADING.with(Cell::get).is_null());
            let threads = Mutex::new(std::collections::HashSet::new());
            Team::lead(|| {
                for _ in 0..100 {
                    for_each_mut(&mut v, |_| {
                        let t = std::time::Instant::now();
                        while t.elapsed() < std::time::Duration::from_micros(5) {}
                        if let Ok(mut s) = threads.lock() {
                            s.insert(std::thread::current().id());
                        }
                    });
                }
            });
            assert!(threads.lock().map(|s| s.len()).unwrap_or(0) >= 2);
        });
    }
}
