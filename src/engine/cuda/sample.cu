// CUDA entries of the on-device sampler (kernels/sample.h): one block of up to 1024 threads
// (`sample_f32`), or the same rules over a grid of one block an SM (`sample_grid_f32`, below, the
// default), read the logits the head just wrote (L2-resident) and leave only the token, its
// log-probability and a flag for the host (src/engine/cuda/fused.rs in the step's graph; src/engine/cuda/sample.rs
// for the candle-op path and the tests).

#include <stdint.h>
#include "common.cuh"

typedef unsigned int uint;
typedef unsigned char uchar;
typedef unsigned long long k_u64;
// A histogram slot as two 32-bit words: 64-bit shared atomics are compare-and-swap loops,
// 32-bit ones are native; an add that wraps the low word carries into the high one.
struct KHIST {
    unsigned int lo, hi;
};
typedef unsigned int KCOUNT;
#define KDEV
#define KSHM
#define KBARRIER() __syncthreads()

__device__ __forceinline__ void hist_clear(KHIST* h, uint b) {
    h[b].lo = 0;
    h[b].hi = 0;
}
__device__ __forceinline__ void hist_add(KHIST* h, uint b, k_u64 v) {
    const uint lo = (uint)v;
    const uint old = atomicAdd(&h[b].lo, lo);
    const uint hi = (uint)(v >> 32) + (old + lo < old ? 1u : 0u);
    if (hi != 0) atomicAdd(&h[b].hi, hi);
}
__device__ __forceinline__ k_u64 hist_get(KHIST* h, uint b) {
    return ((k_u64)h[b].hi << 32) | h[b].lo;
}
__device__ __forceinline__ void count_clear(KCOUNT* c) { *c = 0; }
__device__ __forceinline__ uint count_add(KCOUNT* c, uint v) { return atomicAdd(c, v); }
__device__ __forceinline__ uint count_get(KCOUNT* c) { return *c; }
__device__ __forceinline__ float kfma(float a, float b, float c) { return fmaf(a, b, c); }
__device__ __forceinline__ float kmul(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ float kadd(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ float klog(float x) { return logf(x); }
__device__ __forceinline__ float krint(float x) { return rintf(x); }
__device__ __forceinline__ uint f2u(float v) { return __float_as_uint(v); }
__device__ __forceinline__ float u2f(uint v) { return __uint_as_float(v); }

#define KFN __device__ __forceinline__
#include "../kernels/sample.h"

extern "C" __global__ void __launch_bounds__(1024)
    sample_f32(const float* x_in, float* x, uint V, SampleParams p, const SampleState* st,
               uint* out, uchar* keep, uint want_keep) {
    PDL_ENTRY();
    __shared__ k_u64 red[1024];
    __shared__ KHIST hist[SAMPLE_HIST_BINS];
    __shared__ uint list[SAMPLE_LIST];
    __shared__ k_u64 misc[4];
    __shared__ KCOUNT count;
    sample_block(x_in, x, V, p, st, out, keep, want_keep != 0, red, hist, list, misc, &count,
                 threadIdx.x, blockDim.x);
}

// ---------------------------------------------------------------------------------------------
// The same sampler over a grid (`sample_grid_f32`): block b owns the logits [b*C, (b+1)*C) and
// every pass over the vocabulary is split so, with grid-wide barriers between the passes. On
// 152k logits one block spent ~220 us a token (a flat distribution: the exponentials and the
// Gumbel draws of ~100k kept tokens on one SM); the grid spreads them over every SM.
//
// The rules are sample_block's, and where that one sorts the boundary bin of top-p in block
// memory this one always takes the radix select it falls back to (the same key: the least
// value whose larger values hold less than the limit). Sums whose order could change a result
// are integers (masses, counts) or order-free (max), so the kept set and the draw do not depend
// on how the grid is cut; the normalizer (f32, only in the log-probability) is summed per block
// in a fixed tree and over blocks in block order, so it is the same run to run.
//
// Co-residency: the barriers spin, so every block must be resident at once: the host launches
// at most one block per SM (`GRID_THREADS` threads, ~19 KB of shared memory each) as a
// cooperative launch, which the driver refuses when the blocks cannot all be resident (an MPS
// share or a green context with fewer SMs); a barrier that still waits about a second traps,
// so the launch fails with an error rather than hanging the process. The scratch
// (`GridScratch`, zeroed once by the host) is left by every run as the next reads it: the
// count, flags, sums and histograms zero, the generation counting up, the per-block sums
// written before they are read; so graph replays need no memset.

#define GRID_THREADS 256
#define GRID_MAX_BLOCKS 1024
// Global histograms, one region per use so none is cleared between uses within a run:
// top-p's distance bins, top-p's radix select (3 levels), top-k's (3 levels), the index ties (2).
#define GH_D 0
#define GH_P (GH_D + SAMPLE_DBINS)
#define GH_K (GH_P + 5120)
#define GH_I (GH_K + 5120)
#define GH_TOTAL (GH_I + 2048)

struct GridScratch {
    uint bar_count, bar_gen;
    uint bad, ns;
    k_u64 best;   // (value, index) of the max, packed
    k_u64 total;  // the total mass
    k_u64 drawn;  // (score, index) of the Gumbel-max draw, packed
    float se[GRID_MAX_BLOCKS];
    k_u64 hist[GH_TOTAL];
};
// The size the host allocates (cuda/sample.rs GRID_SCRATCH_BYTES).
static_assert(sizeof(GridScratch) <= 131072, "GRID_SCRATCH_BYTES");

// Every block arrives, the last one resets the count and opens the next generation. The fences
// make each block's writes (and atomics) before the barrier visible to every block after it.
__device__ __forceinline__ void grid_sync(GridScratch* g) {
    __syncthreads();
    if (threadIdx.x == 0) {
        volatile uint* gen = &g->bar_gen;
        const uint seen = *gen;
        __threadfence();
        if (atomicAdd(&g->bar_count, 1u) == gridDim.x - 1) {
            atomicExch(&g->bar_count, 0u);
            __threadfence();
            atomicAdd(&g->bar_gen, 1u);
        } else {
            // ~32 ns a round at least: 2^25 rounds is over a second, far past any barrier
            uint spins = 0;
            while (*gen == seen) {
                __nanosleep(32);
                if (++spins == (1u << 25)) __trap();
            }
        }
        __threadfence();
    }
    __syncthreads();
}

__device__ __forceinline__ k_u64 gload(const k_u64* p) { return __ldcg(p); }

// Adds a block's histogram to a global one (bins with nothing skipped).
__device__ __forceinline__ void flush_hist(KHIST* sh, k_u64* gh, uint bins, uint tid, uint nt) {
    __syncthreads();
    for (uint b = tid; b < bins; b += nt) {
        const k_u64 w = hist_get(sh, b);
        if (w != 0) atomicAdd(&gh[b], w);
    }
}

// find_crossing (kernels/sample.h) on a global histogram that every block reads whole.
__device__ Crossing grid_crossing(const k_u64* h, uint nbins, bool desc, k_u64 limit, k_u64 base,
                                  k_u64* red, k_u64* misc, uint tid, uint nt) {
    const uint per = nbins / nt;
    if (tid == 0) {
        misc[0] = 0;
        misc[1] = 0;
        misc[2] = 0;
    }
    k_u64 local = 0;
    for (uint j = 0; j < per; j++) {
        const uint pos = tid * per + j;
        local += gload(&h[desc ? nbins - 1 - pos : pos]);
    }
    k_u64 run = base + block_exclusive_scan_u64(local, red, tid, nt);
    for (uint j = 0; j < per; j++) {
        const uint pos = tid * per + j;
        const uint b = desc ? nbins - 1 - pos : pos;
        const k_u64 w = gload(&h[b]);
        if (run < limit && limit <= run + w) {
            misc[0] = b;
            misc[1] = run;
            misc[2] = w;
        }
        run += w;
    }
    __syncthreads();
    Crossing c;
    c.bin = (uint)misc[0];
    c.before = misc[1];
    c.weight = misc[2];
    __syncthreads();
    return c;
}

// SAMPLE_RADIX_SELECT over the grid: each level's histogram is built per block over its own
// logits, added into the level's global region, and read whole by every block after a barrier.
template <class In>
__device__ uint grid_radix_select(const float* x, uint lo, uint hi, float m, In in, bool count,
                                  k_u64 limit, k_u64 base, k_u64* gh, KHIST* sh, k_u64* red,
                                  k_u64* misc, GridScratch* g, uint tid, uint nt, Crossing* last) {
    uint prefix = 0;
    for (uint level = 0; level < 3; level++) {
        const uint shift = level == 0 ? 21u : (level == 1 ? 10u : 0u);
        const uint bins = level == 2 ? 1024u : 2048u;
        const uint above = level == 0 ? 32u : (level == 1 ? 21u : 10u);
        clear_hist(sh, bins, tid, nt);
        for (uint i = lo + tid; i < hi; i += nt) {
            const float v = x[i];
            const uint key = sample_key(v);
            if (in(v, key, i) && (level == 0 || (key >> above) == prefix)) {
                const k_u64 w = count ? (k_u64)1 : sample_mass(sample_exp(v - m));
                if (w != 0) hist_add(sh, (key >> shift) & (bins - 1), w);
            }
        }
        flush_hist(sh, gh, bins, tid, nt);
        grid_sync(g);
        const Crossing rc = grid_crossing(gh, bins, true, limit, base, red, misc, tid, nt);
        prefix = level == 0 ? rc.bin : ((prefix << (level == 1 ? 11u : 10u)) | rc.bin);
        base = rc.before;
        *last = rc;
        gh += bins;
    }
    return prefix;
}

// The tokens top-p's boundary bin holds, and the survivors of top-p and min-p (top-k's set).
struct InBin {
    float m;
    uint bin;
    __device__ bool operator()(float v, uint, uint) const {
        return v - m >= -29.0f && sample_dbin(v - m) == bin;
    }
};
struct Survives {
    float m;
    uint tau;
    float lnm;
    __device__ bool operator()(float v, uint key, uint) const {
        return v > -INFINITY && key >= tau && v - m >= lnm;
    }
};

// The end of every run: after a last barrier no block reads the scratch again, so it is zeroed
// for the next run (the histograms by every block, a share each; the scalars by block 0 after
// it has read them).
__device__ __forceinline__ void grid_clean(GridScratch* g, uint tid, uint nt) {
    for (uint i = blockIdx.x * nt + tid; i < GH_TOTAL; i += gridDim.x * nt) g->hist[i] = 0;
}

extern "C" __global__ void __launch_bounds__(GRID_THREADS)
    sample_grid_f32(const float* x_in, float* x, uint V, SampleParams p, const SampleState* st,
                    uint* out, uchar* keep, uint want_keep, GridScratch* g) {
    PDL_ENTRY();
    __shared__ k_u64 red[GRID_THREADS];
    __shared__ KHIST sh[2048];
    __shared__ k_u64 misc[4];
    const uint tid = threadIdx.x, nt = blockDim.x, b = blockIdx.x, nb = gridDim.x;
    const uint chunk = (V + nb - 1) / nb;
    const uint lo = min(V, b * chunk), hi = min(V, lo + chunk);

    // the copy and the repetition penalty (the recent ids are distinct), each block on its own
    if (x_in != x) {
        for (uint i = lo + tid; i < hi; i += nt) x[i] = x_in[i];
        __syncthreads();
    }
    if (p.penalty != 1.0f) {
        for (uint j = tid; j < st->n_recent; j += nt) {
            const uint id = st->recent[j];
            if (id >= lo && id < hi) {
                const float v = x[id];
                x[id] = v < 0.0f ? v * p.penalty : v / p.penalty;
            }
        }
        __syncthreads();
    }

    // max and its first index; NaN / +inf flagged
    float m = -INFINITY;
    uint arg = 0xFFFFFFFFu, bad = 0;
    for (uint i = lo + tid; i < hi; i += nt) {
        const float v = x[i];
        bad |= (v < INFINITY) ? 0u : 1u;
        if (v > m) {
            m = v;
            arg = i;
        }
    }
    k_u64 best = block_max_u64(arg == 0xFFFFFFFFu ? 0 : sample_pack(m, arg), red, tid, nt);
    bad = (uint)block_sum_u64(bad, red, tid, nt);
    if (tid == 0) {
        if (best != 0) atomicMax(&g->best, best);
        if (bad != 0) atomicOr(&g->bad, 1u);
    }
    grid_sync(g);
    best = gload(&g->best);
    bad = *(volatile uint*)&g->bad;
    m = u2f(sample_key_inverse((uint)(best >> 32)));
    arg = 0xFFFFFFFFu - (uint)best;
    if (bad != 0 || best == 0 || m == -INFINITY) {
        grid_sync(g);  // every block has read best and bad
        if (b == 0 && tid == 0) {
            out[0] = 0;
            out[1] = 0;
            out[2] = 1;
            g->best = 0;
            g->bad = 0;
        }
        return;
    }

    // the normalizer (per block, summed in block order at the end), the total mass and top-p's
    // histogram of mass by distance from the max
    const bool greedy = p.greedy != 0;
    const bool top_p = !greedy && p.top_p24 != 0;
    if (top_p) clear_hist(sh, SAMPLE_DBINS, tid, nt);
    float se = 0.0f;
    k_u64 total = 0;
    for (uint i = lo + tid; i < hi; i += nt) {
        const float dv = x[i] - m;
        if (dv >= -29.0f) {
            const float e = sample_exp(dv);
            se += e;
            const k_u64 q = sample_mass(e);
            total += q;
            if (top_p && q != 0) hist_add(sh, sample_dbin(dv), q);
        }
    }
    __syncthreads();
    se = block_sum_f32(se, red, tid, nt);
    total = block_sum_u64(total, red, tid, nt);
    if (tid == 0) {
        g->se[b] = se;
        if (total != 0) atomicAdd(&g->total, total);
    }
    if (top_p) flush_hist(sh, g->hist + GH_D, SAMPLE_DBINS, tid, nt);
    grid_sync(g);
    const float lnm = p.ln_min_p;

    // top-p: the least likely kept value's key, by a radix select within the boundary bin
    uint tau = 0;
    if (top_p) {
        total = gload(&g->total);
        const k_u64 limit = (k_u64)p.top_p24 * (total >> 24) + (((k_u64)p.top_p24 * (total & (k_u64)0xFFFFFF)) >> 24);
        const Crossing c = grid_crossing(g->hist + GH_D, SAMPLE_DBINS, false, limit, 0, red, misc, tid, nt);
        const uint bp = c.bin;
        Crossing last;
        tau = grid_radix_select(
            x, lo, hi, m,
            InBin{m, bp},
            false, limit, c.before, g->hist + GH_P, sh, red, misc, g, tid, nt, &last);
    }

    // top-k among the survivors: the k-th key, and for ties at it the highest kept index
    bool cut = false;
    uint kth = 0, ibound = 0xFFFFFFFFu;
    if (!greedy && p.top_k != 0) {
        uint ns = 0;
        for (uint i = lo + tid; i < hi; i += nt) {
            const float v = x[i];
            ns += (v > -INFINITY && sample_key(v) >= tau && v - m >= lnm) ? 1u : 0u;
        }
        ns = (uint)block_sum_u64(ns, red, tid, nt);
        if (tid == 0 && ns != 0) atomicAdd(&g->ns, ns);
        grid_sync(g);
        ns = *(volatile uint*)&g->ns;
        if (ns > p.top_k) {
            cut = true;
            const k_u64 k = p.top_k;
            Crossing last;
            kth = grid_radix_select(
                x, lo, hi, m,
                Survives{m, tau, lnm},
                true, k, 0, g->hist + GH_K, sh, red, misc, g, tid, nt, &last);
            const k_u64 base = last.before, weight = last.weight;
            if (weight > k - base) {
                // ties at the k-th value: keep the (k - base) lowest indices among them
                const k_u64 r = k - base;
                k_u64 ib = 0;
                uint hib = 0;
                for (uint il = 0; il < 2; il++) {
                    clear_hist(sh, 1024, tid, nt);
                    for (uint i = lo + tid; i < hi; i += nt) {
                        const float v = x[i];
                        const bool in = v > -INFINITY && sample_key(v) == kth && v - m >= lnm && (il == 0 || (i >> 10) == hib);
                        if (in) hist_add(sh, il == 0 ? (i >> 10) : (i & 1023u), 1);
                    }
                    k_u64* gh = g->hist + GH_I + il * 1024;
                    flush_hist(sh, gh, 1024, tid, nt);
                    grid_sync(g);
                    const Crossing ci = grid_crossing(gh, 1024, false, r, ib, red, misc, tid, nt);
                    ib = ci.before;
                    hib = il == 0 ? ci.bin : ((hib << 10) | ci.bin);
                }
                ibound = hib;
            }
        }
    }

    // the Gumbel-max draw over the kept tokens (greedy: the max itself)
    if (!greedy) {
        const k_u64 gkey = sample_mix(st->seed ^ sample_mix(st->counter + (k_u64)0x9E3779B97F4A7C15));
        float bs = -INFINITY;
        uint bi = 0xFFFFFFFFu;
        for (uint i = lo + tid; i < hi; i += nt) {
            const float v = x[i];
            const uint key = sample_key(v);
            const bool kept = v > -INFINITY && key >= tau && v - m >= lnm && (!cut || key > kth || (key == kth && i <= ibound));
            if (want_keep) keep[i] = kept ? 1 : 0;
            if (kept) {
                const float s = (v - m) * p.inv_temp + sample_gumbel(gkey, i);
                if (s > bs || (s == bs && i < bi)) {
                    bs = s;
                    bi = i;
                }
            }
        }
        // -inf scores still rank by index: their key is the smallest but the index decides ties
        const k_u64 drawn = block_max_u64(bi == 0xFFFFFFFFu ? 0 : sample_pack(bs, bi), red, tid, nt);
        if (tid == 0 && drawn != 0) atomicMax(&g->drawn, drawn);
    }
    grid_sync(g);

    if (b == 0) {
        float s = 0.0f;
        for (uint j = tid; j < nb; j += nt) s += __ldcg(&g->se[j]);
        s = block_sum_f32(s, red, tid, nt);
        if (tid == 0) {
            const float lse = m + klog(s);
            uint id = arg;
            if (!greedy) {
                const k_u64 drawn = gload(&g->drawn);
                id = drawn == 0 ? 0 : 0xFFFFFFFFu - (uint)drawn;
            }
            out[0] = id;
            out[1] = f2u(__ldcg(&x[id]) - lse);
            out[2] = 0;
            g->best = 0;
            g->total = 0;
            g->drawn = 0;
            g->ns = 0;
        }
    }
    grid_clean(g, tid, nt);
}
