//! The decode step's workers: for one CPU forward pass of one token, the pool's other threads
//! stop sleeping and spin, waiting for the next parallel region (llama.cpp's threadpool keeps
//! its threads hot across a graph the same way). A decode step of the 0.6B shape has ~140
//! short regions (q|k|v, attention, o, gate|up, down a layer, and the head); through rayon each
//! costs a worker's wake-up (`examples/handoff.rs`: 7-9 us a region at 2 threads, 21 us at 16,
//! on the Zen 1 EPYC and the Xeon), through a team ~2 and ~5 us.
//!
//! A region's tasks are claimed one index at a time with a compare-and-swap on one word that
//! holds the region's number, its task count and the next index: a helper that saw an earlier
//! region can never claim a task of a later one, so it never calls a closure that is gone.
//! Outside a team (prefill, tests on a pool, nested calls) `for_each_mut` is rayon's.

use std::cell::Cell;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

use rayon::prelude::*;

/// Task indices live in 16 bits of the state word; larger regions go to rayon.
const MAX_TASKS: usize = u16::MAX as usize;

/// `f(item)` for every item, each exactly once, in parallel: on the team this thread leads if it
/// leads one, else on rayon's pool.
pub fn for_each_mut<T: Send>(items: &mut [T], f: impl Fn(&mut T) + Sync) {
    let team = LEADING.with(Cell::get);
    if items.len() < 2 || team.is_null() || items.len() > MAX_TASKS {
        if items.len() < 2 {
            items.iter_mut().for_each(f);
        } else {
            items.par_iter_mut().for_each(&f);
        }
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

struct SendPtr<T>(*mut T);
// SAFETY: only used to hand disjoint elements of a `&mut [T]` (T: Send) to the team's threads.
unsafe impl<T: Send> Sync for SendPtr<T> {}

thread_local! {
    /// The team whose regions this thread opens now (null inside a region's task).
    static LEADING: Cell<*const Team> = const { Cell::new(std::ptr::null()) };
    /// Whether this thread is inside `Team::lead`.
    static LEADS: Cell<bool> = const { Cell::new(false) };
}

type Job<'a> = &'a (dyn Fn(usize) + Sync);

pub struct Team {
    /// `region << 32 | tasks << 16 | next`: the current region, its task count, the next
    /// unclaimed index.
    state: AtomicU64,
    /// The current region's closure, written by the leader before it publishes the region.
    job: std::cell::UnsafeCell<Option<Job<'static>>>,
    done: AtomicUsize,
    panicked: AtomicBool,
    stop: AtomicBool,
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
            panicked: AtomicBool::new(false),
            stop: AtomicBool::new(false),
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
            for _ in 0..helpers {
                s.spawn(move |_| team.help());
            }
            // released on every way out of `f`, or the scope would wait on the helpers forever
            struct Release<'a>(&'a Team, *const Team, bool);
            impl Drop for Release<'_> {
                fn drop(&mut self) {
                    LEADING.with(|l| l.set(self.1));
                    LEADS.with(|l| l.set(self.2));
                    self.0.stop.store(true, Ordering::Release);
                }
            }
            let _release = Release(
                team,
                LEADING.with(|l| l.replace(team)),
                LEADS.with(|l| l.replace(true)),
            );
            f()
        })
    }

    /// A helper: runs the tasks it claims until the leader releases it.
    fn help(&self) {
        // A leader never helps: rayon runs queued jobs on a thread waiting in a join, and a
        // leader spinning under another team's (or its own) helper job could wait on itself.
        if LEADS.with(Cell::get) {
            return;
        }
        let mut seen = self.state.load(Ordering::Acquire) >> 32;
        loop {
            let v = self.state.load(Ordering::Acquire);
            if v >> 32 != seen {
                seen = v >> 32;
                self.work(seen);
            } else if self.stop.load(Ordering::Acquire) {
                return;
            } else {
                std::hint::spin_loop();
            }
        }
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
            let job = unsafe { *self.job.get() };
            if let Some(job) = job {
                if catch_unwind(AssertUnwindSafe(|| job(next as usize))).is_err() {
                    self.panicked.store(true, Ordering::Release);
                }
            }
            self.done.fetch_add(1, Ordering::AcqRel);
        }
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
        let own = catch_unwind(AssertUnwindSafe(|| self.work(region)));
        while self.done.load(Ordering::Acquire) < tasks {
            std::hint::spin_loop();
        }
        // SAFETY: every task has finished; nothing reads `job` until the next region opens.
        unsafe { *self.job.get() = None };
        LEADING.with(|l| l.set(leading));
        if let Err(p) = own {
            resume_unwind(p);
        }
        if self.panicked.swap(false, Ordering::AcqRel) {
            panic!("a decode worker panicked in a parallel region");
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

    /// Two teams on one pool at once, their leaders also waiting in rayon joins (where rayon
    /// runs queued jobs, such as the other team's helpers): both finish, each item once.
    #[test]
    fn two_leaders_on_one_pool_finish() {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .expect("pool");
        let body = || {
            Team::lead(|| {
                let mut counts = vec![0u32; 16];
                for _ in 0..200 {
                    for_each_mut(&mut counts, |c| *c += 1);
                    let (a, b) = rayon::join(|| 1, || 2);
                    assert_eq!(a + b, 3);
                }
                counts
            })
        };
        let (a, b) = pool.install(|| rayon::join(body, body));
        assert!(a.iter().chain(&b).all(|&c| c == 200));
    }

    /// A panicking task reaches the leader as a panic, and the team is released (no hang).
    #[test]
    fn a_panicking_task_panics_the_leader() {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .expect("pool");
        let r = pool.install(|| {
            catch_unwind(|| {
                Team::lead(|| {
                    let mut v = vec![0u32; 64];
                    for_each_mut(&mut v, |x| {
                        if *x == 0 {
                            panic!("task");
                        }
                    });
                })
            })
        });
        assert!(r.is_err());
    }
}
