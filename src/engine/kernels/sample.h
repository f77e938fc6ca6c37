// One thread block samples the next token from V logits with the rules of src/engine/sample.rs
// (mlx_lm's sampler, masses in 2^-40 fixed point). One source for three compilers: CUDA
// (cuda/sample.cu), Metal (metal/sample.metal, which Rust splices this file into at run time)
// and C++ under tests/metal_shim (where its logic is tested against the Rust reference). No
// warp or simdgroup intrinsics: only block barriers, block-shared arrays and atomic adds on a
// shared histogram, so the three behave alike.
//
// The including file defines:
//   KDEV        qualifier of device-memory pointers (Metal: device)
//   KSHM        qualifier of block-shared pointers (Metal: threadgroup)
//   KBARRIER()  a barrier over the block that also orders its device-memory accesses
//   k_u64       a 64-bit unsigned integer; KHIST, a histogram slot, with
//   hist_clear(KSHM KHIST* h, uint b), hist_add(KSHM KHIST* h, uint b, k_u64 v),
//   hist_get(KSHM KHIST* h, uint b); KCOUNT, a counter, with count_clear(KSHM KCOUNT* c),
//   count_add(KSHM KCOUNT* c, uint v) (returns the value before) and count_get
//   KFN         the qualifiers of a helper function (CUDA: __device__ __forceinline__)
//   kfma, kmul, kadd  f32 fused multiply-add, multiply and add that the compiler may not
//               contract or reorder (so `sample_exp` gives the same bits everywhere)
//   klog, krint  f32 log (as accurate as the platform has) and round-half-even; f2u / u2f: bit casts
//
// -inf logits are masked tokens: never kept (the most likely token is finite and always is).
//
// Steps (nt threads, a power of two from 32 to 1024): copy (when x_in != x) and the repetition
// penalty; max and first argmax; the exponentials (skipped far below the max), the normalizer,
// the total mass and a histogram of mass by distance from the max; for top-p, the bin where
// the mass crosses the limit, its tokens gathered and sorted (a radix select on the value's
// order key when too many tie there); for top-k a radix select by count, and one on the index
// for ties; the Gumbel-max draw. Atomic adds go to 32-bit words only and, in the common cases,
// to many different bins.

#define SAMPLE_MAX_RECENT 64
#define SAMPLE_HIST_BINS 2048

struct SampleParams {
    uint greedy;
    float inv_temp;
    uint top_p24;
    float ln_min_p;
    uint top_k;
    float penalty;
};

struct SampleState {
    k_u64 seed;
    k_u64 counter;
    uint n_recent;
    uint pad;
    uint recent[SAMPLE_MAX_RECENT];
};

// Larger key <=> larger value, for non-NaN floats; -0 and +0 share a key (they are equal).
KFN uint sample_key(float v) {
    uint b = f2u(v);
    if ((b & 0x7FFFFFFFu) == 0) b = 0;
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

KFN uint sample_key_inverse(uint k) { return (k & 0x80000000u) ? (k & 0x7FFFFFFFu) : ~k; }

// exp(x) for x <= 0, as engine::sample::exp_neg: the same operations, so the same bits.
KFN float sample_exp(float x) {
    if (!(x >= -87.0f)) return 0.0f;
    const float n = krint(kmul(x, 1.442695f));
    float r = kfma(n, -0.6933594f, x);
    r = kfma(n, 2.1219444e-4f, r);
    float p = 1.9875691e-4f;
    p = kfma(p, r, 1.3981999e-3f);
    p = kfma(p, r, 8.333452e-3f);
    p = kfma(p, r, 4.1665796e-2f);
    p = kfma(p, r, 0.16666665f);
    p = kfma(p, r, 0.5f);
    const float y = kadd(kfma(p, kmul(r, r), r), 1.0f);
    return kmul(y, u2f((uint)((int)n + 127) << 23));
}

KFN k_u64 sample_mass(float e) { return (k_u64)krint(e * 1099511627776.0f); }

KFN k_u64 sample_mix(k_u64 z) {
    z = (z ^ (z >> 30)) * (k_u64)0xBF58476D1CE4E5B9;
    z = (z ^ (z >> 27)) * (k_u64)0x94D049BB133111EB;
    return z ^ (z >> 31);
}

// Wellons' lowbias32: a cheap, well-mixed 32-bit hash.
KFN uint sample_hash32(uint x) {
    x ^= x >> 16;
    x *= 0x7feb352du;
    x ^= x >> 15;
    x *= 0x846ca68bu;
    return x ^ (x >> 16);
}

// The Gumbel variate of token i under the per-token key (engine::sample::gumbel).
KFN float sample_gumbel(k_u64 key, uint i) {
    const uint h = sample_hash32(sample_hash32((i * 0x9E3779B9u) ^ (uint)key) ^ (uint)(key >> 32));
    // the top 24 bits' last value would round to 1 (a Gumbel variate of +inf): the f32 below 1
    const float u = (h >> 8) == 0xFFFFFFu ? 0.99999994f : ((float)(h >> 8) + 0.5f) * (1.0f / 16777216.0f);
    return -klog(-klog(u));
}

// (value, index) packed so that the larger value, then the lower index, is the larger u64.
KFN k_u64 sample_pack(float v, uint i) { return ((k_u64)sample_key(v) << 32) | (k_u64)(0xFFFFFFFFu - i); }

KFN k_u64 block_sum_u64(k_u64 v, KSHM k_u64* red, uint tid, uint nt) {
    red[tid] = v;
    KBARRIER();
    for (uint s = nt / 2; s > 0; s >>= 1) {
        if (tid < s) red[tid] += red[tid + s];
        KBARRIER();
    }
    k_u64 r = red[0];
    KBARRIER();
    return r;
}

KFN k_u64 block_max_u64(k_u64 v, KSHM k_u64* red, uint tid, uint nt) {
    red[tid] = v;
    KBARRIER();
    for (uint s = nt / 2; s > 0; s >>= 1) {
        if (tid < s && red[tid + s] > red[tid]) red[tid] = red[tid + s];
        KBARRIER();
    }
    k_u64 r = red[0];
    KBARRIER();
    return r;
}

KFN float block_sum_f32(float v, KSHM k_u64* red, uint tid, uint nt) {
    red[tid] = f2u(v);
    KBARRIER();
    for (uint s = nt / 2; s > 0; s >>= 1) {
        if (tid < s) red[tid] = f2u(u2f((uint)red[tid]) + u2f((uint)red[tid + s]));
        KBARRIER();
    }
    float r = u2f((uint)red[0]);
    KBARRIER();
    return r;
}

KFN k_u64 block_exclusive_scan_u64(k_u64 v, KSHM k_u64* red, uint tid, uint nt) {
    red[tid] = v;
    KBARRIER();
    for (uint off = 1; off < nt; off <<= 1) {
        k_u64 t = tid >= off ? red[tid - off] : 0;
        KBARRIER();
        red[tid] += t;
        KBARRIER();
    }
    k_u64 incl = red[tid];
    KBARRIER();
    return incl - v;
}

struct Crossing {
    uint bin;
    k_u64 before;  // weight walked before `bin`
    k_u64 weight;  // the bin's own weight
};

// Walking `nbins` bins from the top (desc) or the bottom, starting with `base`: the bin where
// the running weight goes from below `limit` to at least `limit` (there is exactly one when
// base < limit <= base + total). nbins % nt == 0.
KFN Crossing find_crossing(KSHM KHIST* h, uint nbins, bool desc, k_u64 limit, k_u64 base,
                              KSHM k_u64* red, KSHM k_u64* misc, uint tid, uint nt) {
    const uint per = nbins / nt;
    k_u64 local = 0;
    for (uint j = 0; j < per; j++) {
        uint pos = tid * per + j;
        local += hist_get(h, desc ? nbins - 1 - pos : pos);
    }
    k_u64 run = base + block_exclusive_scan_u64(local, red, tid, nt);
    for (uint j = 0; j < per; j++) {
        uint pos = tid * per + j;
        uint b = desc ? nbins - 1 - pos : pos;
        k_u64 w = hist_get(h, b);
        if (run < limit && limit <= run + w) {
            misc[0] = b;
            misc[1] = run;
            misc[2] = w;
        }
        run += w;
    }
    KBARRIER();
    Crossing c;
    c.bin = (uint)misc[0];
    c.before = misc[1];
    c.weight = misc[2];
    KBARRIER();
    return c;
}

KFN void clear_hist(KSHM KHIST* h, uint nbins, uint tid, uint nt) {
    for (uint b = tid; b < nbins; b += nt) hist_clear(h, b);
    KBARRIER();
}

// Top-p's first histogram bins a token by how far below the max it is: 32 bins a nat over the
// 32 nats below it (a token of non-zero mass is within 28.5), 1024 for the rest. The bin only
// grows as the value falls, so bins walked upward are values walked downward.
#define SAMPLE_DBINS 1024
KFN uint sample_dbin(float dv) {
    if (!(dv >= -32.0f)) return SAMPLE_DBINS;
    const uint b = (uint)(-dv * 32.0f);
    return b < SAMPLE_DBINS - 1 ? b : SAMPLE_DBINS - 1;
}

// Entries of the boundary bin sorted in block memory (more go to the radix fallback).
#define SAMPLE_LIST 1024

// Sorts a[0..n) (n a power of two) descending.
KFN void bitonic_desc(KSHM uint* a, uint n, uint tid, uint nt) {
    for (uint k = 2; k <= n; k <<= 1) {
        for (uint j = k >> 1; j > 0; j >>= 1) {
            for (uint i = tid; i < n; i += nt) {
                const uint l = i ^ j;
                if (l > i) {
                    const uint ai = a[i], al = a[l];
                    if ((i & k) == 0 ? ai < al : ai > al) {
                        a[i] = al;
                        a[l] = ai;
                    }
                }
            }
            KBARRIER();
        }
    }
}

// Radix select (11 + 11 + 10 bits of the order key, weight: mass, or 1 with `count`) among
// the tokens `in` admits: the key at which the weight walked from the top crosses `limit`,
// starting from `base`. Returns the key and, through misc[1] / misc[2], the weight before it
// and at it.
#define SAMPLE_RADIX_SELECT(IN, COUNT, LIMIT, BASE, RESULT)                                     \
    {                                                                                         \
        k_u64 rs_base = (BASE);                                                               \
        uint rs_prefix = 0;                                                                   \
        for (uint level = 0; level < 3; level++) {                                            \
            const uint shift = level == 0 ? 21u : (level == 1 ? 10u : 0u);                    \
            const uint bins = level == 2 ? 1024u : 2048u;                                     \
            const uint above = level == 0 ? 32u : (level == 1 ? 21u : 10u);                   \
            clear_hist(hist, bins, tid, nt);                                                  \
            for (uint i = tid; i < V; i += nt) {                                              \
                const float v = x[i];                                                         \
                const uint key = sample_key(v);                                               \
                if ((IN) && (level == 0 || (key >> above) == rs_prefix)) {                    \
                    const k_u64 w = (COUNT) ? (k_u64)1 : sample_mass(sample_exp(v - m));          \
                    if (w != 0) hist_add(hist, (key >> shift) & (bins - 1), w);               \
                }                                                                             \
            }                                                                                 \
            KBARRIER();                                                                       \
            Crossing rc = find_crossing(hist, bins, true, (LIMIT), rs_base, red, misc, tid, nt); \
            rs_prefix = level == 0 ? rc.bin : ((rs_prefix << (level == 1 ? 11u : 10u)) | rc.bin); \
            rs_base = rc.before;                                                              \
            if (tid == 0) {                                                                   \
                misc[1] = rc.before;                                                          \
                misc[2] = rc.weight;                                                          \
            }                                                                                 \
        }                                                                                     \
        KBARRIER();                                                                           \
        RESULT = rs_prefix;                                                                   \
    }

// out[0] the token, out[1] its log-probability's bits, out[2] 1 when the logits held NaN or
// +inf or nothing finite. With `want_keep`, keep[i] = whether token i was kept (for tests).
KFN void sample_block(const KDEV float* x_in, KDEV float* x, uint V, SampleParams p,
                      const KDEV SampleState* st, KDEV uint* out, KDEV uchar* keep,
                      bool want_keep, KSHM k_u64* red, KSHM KHIST* hist, KSHM uint* list,
                      KSHM k_u64* misc, KSHM KCOUNT* count, uint tid, uint nt) {
    if (x_in != x) {
        for (uint i = tid; i < V; i += nt) x[i] = x_in[i];
        KBARRIER();
    }
    if (p.penalty != 1.0f) {
        for (uint j = tid; j < st->n_recent; j += nt) {
            uint id = st->recent[j];
            if (id < V) {
                float v = x[id];
                x[id] = v < 0.0f ? v * p.penalty : v / p.penalty;
            }
        }
        KBARRIER();
    }

    // max and its first index; NaN / +inf flagged
    float m = -INFINITY;
    uint arg = 0xFFFFFFFFu, bad = 0;
    for (uint i = tid; i < V; i += nt) {
        float v = x[i];
        bad |= (v < INFINITY) ? 0u : 1u;
        if (v > m) {
            m = v;
            arg = i;
        }
    }
    k_u64 best = block_max_u64(sample_pack(m, arg), red, tid, nt);
    bad = (uint)block_sum_u64(bad, red, tid, nt);
    m = u2f(sample_key_inverse((uint)(best >> 32)));
    arg = 0xFFFFFFFFu - (uint)best;
    if (bad != 0 || m == -INFINITY) {
        if (tid == 0) {
            out[0] = 0;
            out[1] = 0;
            out[2] = 1;
        }
        return;
    }

    // the normalizer, the total mass and top-p's histogram; below e^-29 a token's mass is 0
    // and its share of the normalizer under 1e-12, so its exponential is skipped
    const bool greedy = p.greedy != 0;
    const bool top_p = !greedy && p.top_p24 != 0;
    if (top_p) clear_hist(hist, SAMPLE_DBINS, tid, nt);
    float se = 0.0f;
    k_u64 total = 0;
    for (uint i = tid; i < V; i += nt) {
        const float dv = x[i] - m;
        if (dv >= -29.0f) {
            const float e = sample_exp(dv);
            se += e;
            const k_u64 q = sample_mass(e);
            total += q;
            if (top_p && q != 0) hist_add(hist, sample_dbin(dv), q);
        }
    }
    KBARRIER();
    se = block_sum_f32(se, red, tid, nt);
    const float lse = m + klog(se);
    if (greedy) {
        if (tid == 0) {
            out[0] = arg;
            out[1] = f2u(x[arg] - lse);
            out[2] = 0;
        }
        return;
    }
    const float lnm = p.ln_min_p;

    // top-p: the least likely kept value's key. The bin where the mass crosses the limit;
    // its tokens sorted in block memory (or, when there are too many, a radix select among
    // them); within it a value is kept when the mass of all larger values is below the limit.
    uint tau = 0;
    if (top_p) {
        total = block_sum_u64(total, red, tid, nt);
        const k_u64 limit = (k_u64)p.top_p24 * (total >> 24) + (((k_u64)p.top_p24 * (total & (k_u64)0xFFFFFF)) >> 24);
        const Crossing c = find_crossing(hist, SAMPLE_DBINS, false, limit, 0, red, misc, tid, nt);
        if (tid == 0) count_clear(count);
        KBARRIER();
        for (uint i = tid; i < V; i += nt) {
            const float v = x[i];
            const float dv = v - m;
            if (dv >= -29.0f && sample_dbin(dv) == c.bin) {
                const uint slot = count_add(count, 1u);
                if (slot < SAMPLE_LIST) list[slot] = sample_key(v);
            }
        }
        KBARRIER();
        const uint nl = count_get(count);
        if (nl <= SAMPLE_LIST) {
            uint np = 1;
            while (np < nl) np <<= 1;
            for (uint j = nl + tid; j < np; j += nt) list[j] = 0;
            KBARRIER();
            bitonic_desc(list, np, tid, nt);
            const uint per = (np + nt - 1) / nt;
            k_u64 local = 0;
            for (uint j = tid * per; j < tid * per + per && j < nl; j++)
                local += sample_mass(sample_exp(u2f(sample_key_inverse(list[j])) - m));
            k_u64 run = c.before + block_exclusive_scan_u64(local, red, tid, nt);
            uint least = 0xFFFFFFFFu;
            for (uint j = tid * per; j < tid * per + per && j < nl; j++) {
                // a value's first entry sees exactly the mass of the larger values above it
                if ((j == 0 || list[j - 1] != list[j]) && run < limit && list[j] < least) least = list[j];
                run += sample_mass(sample_exp(u2f(sample_key_inverse(list[j])) - m));
            }
            tau = 0xFFFFFFFFu - (uint)block_max_u64(0xFFFFFFFFu - least, red, tid, nt);
        } else {
            const uint bp = c.bin;
            SAMPLE_RADIX_SELECT(v - m >= -29.0f && sample_dbin(v - m) == bp, false, limit, c.before, tau);
        }
    }

    // top-k among the survivors: the k-th key, and for ties at it the highest kept index
    bool cut = false;
    uint kth = 0, ibound = 0xFFFFFFFFu;
    if (p.top_k != 0) {
        uint ns = 0;
        for (uint i = tid; i < V; i += nt) {
            const float v = x[i];
            ns += (v > -INFINITY && sample_key(v) >= tau && v - m >= lnm) ? 1u : 0u;
        }
        ns = (uint)block_sum_u64(ns, red, tid, nt);
        if (ns > p.top_k) {
            cut = true;
            const k_u64 k = p.top_k;
            SAMPLE_RADIX_SELECT(v > -INFINITY && key >= tau && v - m >= lnm, true, k, 0, kth);
            const k_u64 base = misc[1], weight = misc[2];
            KBARRIER();
            if (weight > k - base) {
                // ties at the k-th value: keep the (k - base) lowest indices among them
                const k_u64 r = k - base;
                k_u64 ib = 0;
                uint hi = 0;
                for (uint il = 0; il < 2; il++) {
                    clear_hist(hist, 1024, tid, nt);
                    for (uint i = tid; i < V; i += nt) {
                        const float v = x[i];
                        const bool in = v > -INFINITY && sample_key(v) == kth && v - m >= lnm && (il == 0 || (i >> 10) == hi);
                        if (in) hist_add(hist, il == 0 ? (i >> 10) : (i & 1023u), 1);
                    }
                    KBARRIER();
                    const Crossing ci = find_crossing(hist, 1024, false, r, ib, red, misc, tid, nt);
                    ib = ci.before;
                    hi = il == 0 ? ci.bin : ((hi << 10) | ci.bin);
                }
                ibound = hi;
            }
        }
    }

    // the Gumbel-max draw over the kept tokens
    const k_u64 gkey = sample_mix(st->seed ^ sample_mix(st->counter + (k_u64)0x9E3779B97F4A7C15));
    float bs = -INFINITY;
    uint bi = 0xFFFFFFFFu;
    for (uint i = tid; i < V; i += nt) {
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
    best = block_max_u64(bi == 0xFFFFFFFFu ? 0 : sample_pack(bs, bi), red, tid, nt);
    if (tid == 0) {
        uint id = best == 0 ? 0 : 0xFFFFFFFFu - (uint)best;
        out[0] = id;
        out[1] = f2u(x[id] - lse);
        out[2] = 0;
    }
}
