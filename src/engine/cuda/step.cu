// The non-matmul kernels of a Qwen3 forward on CUDA (src/engine/cuda/fused.rs drives them), each
// replacing a run of candle ops, with mlx_lm's numerics (mlx_lm/models/qwen3.py) in fp32:
// RMSNorm with a plain weight; per-head q/k RMSNorm, then half-split RoPE, then the KV cache
// write, in one kernel; single-pass attention with an online softmax over the cache; SwiGLU; the
// LoRA A product. Positions come from device memory (`pos`), so a captured CUDA graph of a
// decode step stays valid from one token to the next.
//
// Layouts: activations (M, width) row-major; qkv rows are [q heads | k heads | v heads]; the KV
// cache of a layer is (capacity, n_kv, head_dim); cos/sin tables are (capacity, head_dim / 2).

#include <stdint.h>
#include "common.cuh"

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over a block whose size is a multiple of 32 (at most 1024); every thread gets the total.
__device__ float block_sum(float v) {
    __shared__ float part[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_sum(v);
    __syncthreads();  // `part` may still be read by a previous call
    if (lane == 0) part[warp] = v;
    __syncthreads();
    float t = 0.f;
    for (int i = 0; i < (int)(blockDim.x >> 5); i++) t += part[i];
    return t;
}

// out[m] = x[m] * rsqrt(mean(x[m]^2) + eps) * w. Grid: M blocks; H % 4 == 0. The loops are
// unrolled so that a thread's few loads of a row are in flight together.
extern "C" __global__ void rms_norm_f32(const float* __restrict__ x, const float* __restrict__ w,
                                        float* __restrict__ out, int H, float eps) {
    PDL_ENTRY();
    const float4* xr = (const float4*)(x + (size_t)blockIdx.x * H);
    const float4* w4 = (const float4*)w;
    float4* o = (float4*)(out + (size_t)blockIdx.x * H);
    float ss = 0.f;
#pragma unroll 4
    for (int i = threadIdx.x; i < H / 4; i += blockDim.x) {
        const float4 v = xr[i];
        ss = fmaf(v.x, v.x, fmaf(v.y, v.y, fmaf(v.z, v.z, fmaf(v.w, v.w, ss))));
    }
    const float r = rsqrtf(block_sum(ss) / (float)H + eps);
#pragma unroll 4
    for (int i = threadIdx.x; i < H / 4; i += blockDim.x) {
        const float4 v = xr[i], g = w4[i];
        o[i] = make_float4(v.x * r * g.x, v.y * r * g.y, v.z * r * g.z, v.w * r * g.w);
    }
}

// Grid (n_heads + n_kv, M); block: half = head_dim / 2 threads rounded up to a multiple of 32.
// Thread t owns the RoPE pair (t, t + half). q heads are normed and rotated in place; k heads are
// normed, rotated and written to the cache at position pos + m, with the matching v head.
extern "C" __global__ void qk_norm_rope_cache(float* __restrict__ qkv, const float* __restrict__ qnw,
                                              const float* __restrict__ knw, float* __restrict__ kc,
                                              float* __restrict__ vc, const float* __restrict__ cos_t,
                                              const float* __restrict__ sin_t, const int* __restrict__ pos,
                                              int nh, int nkv, int hd, float eps) {
    PDL_ENTRY();
    const int h = blockIdx.x, m = blockIdx.y, t = threadIdx.x, half = hd / 2;
    const int p = pos[0] + m;
    float* row = qkv + (size_t)m * (nh + 2 * nkv) * hd;
    const bool is_q = h < nh;
    float* src = row + (size_t)h * hd;  // k heads follow the q heads
    const float* nw = is_q ? qnw : knw;
    const bool on = t < half;
    float a = on ? src[t] : 0.f, b = on ? src[t + half] : 0.f;
    const float r = rsqrtf(block_sum(a * a + b * b) / (float)hd + eps);
    if (!on) return;
    a = a * r * nw[t];
    b = b * r * nw[t + half];
    const float c = cos_t[(size_t)p * half + t], s = sin_t[(size_t)p * half + t];
    const float o1 = a * c - b * s, o2 = a * s + b * c;
    if (is_q) {
        src[t] = o1;
        src[t + half] = o2;
        return;
    }
    const int kvh = h - nh;
    const size_t at = ((size_t)p * nkv + kvh) * hd;
    kc[at + t] = o1;
    kc[at + t + half] = o2;
    const float* v = row + (size_t)(nh + nkv + kvh) * hd;
    vc[at + t] = v[t];
    vc[at + t + half] = v[t + half];
}

#define ATT_WARPS 8

// Grid (n_heads, M), 32 * ATT_WARPS threads; one instance per head_dim (32, 64, 128, 256), so
// the loops over a head unroll and every load of a key or value row is in flight at once. Query
// row m (absolute position pos + m) attends to cache positions 0..=pos+m. Each warp takes chunks
// of 32 keys: a lane scores one key, the chunk updates the warp's running max and sum, then the
// lanes (one per 32nd of head_dim) accumulate the values; the warps are merged at the end.
//
// DECODE (one row): the block also does qk_norm_rope_cache's work for its head, saving a launch:
// it norms and rotates its q and the new k of its KV head (threads 0..127 and 128..255), takes
// the new k and v from shared memory for the last position, and the first query head of each KV
// group writes them to the cache for later steps (nobody reads them from there in this one).
// The keys are split over gridDim.y blocks a head (32 heads alone would leave most of the SMs
// idle): each writes its running max, sum and unnormalized values to `ws`, and the last block
// of the head to finish (a counter it resets, so a replayed graph finds it at zero) merges
// them in split order, which keeps the result deterministic.
template <int HD, bool DECODE>
__device__ __forceinline__ void attention(const float* __restrict__ qkv, const float* __restrict__ kc,
                          const float* __restrict__ vc, float* __restrict__ out,
                          const int* __restrict__ pos, int nh, int nkv, float scale,
                          const float* __restrict__ qnw, const float* __restrict__ knw,
                          float* __restrict__ kw, float* __restrict__ vw,
                          const float* __restrict__ cos_t, const float* __restrict__ sin_t, float eps,
                          float* __restrict__ ws, unsigned int* __restrict__ cnt) {
    constexpr int DPL = HD / 32;
    __shared__ __align__(16) float qs[HD];
    __shared__ __align__(16) float kn[DECODE ? HD : 1];
    __shared__ float vn[DECODE ? HD : 1];
    __shared__ float red[ATT_WARPS];
    __shared__ float wm[ATT_WARPS], wl[ATT_WARPS];
    __shared__ float wacc[ATT_WARPS][HD];
    const int h = blockIdx.x, m = DECODE ? 0 : blockIdx.y;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int keys = pos[0] + m + 1;
    // this block's keys: [kb, ke), whole 32-key chunks except at the end
    const int S = DECODE ? gridDim.y : 1, z = DECODE ? blockIdx.y : 0;
    const int per = (keys + 32 * S - 1) / (32 * S) * 32;
    const int kb = z * per, ke = min(keys, kb + per);
    const int kvh = h / (nh / nkv);
    const float* row = qkv + (size_t)m * (nh + 2 * nkv) * HD;
    if (DECODE) {
        // the cache rows this block reads (earlier steps wrote them) and the RoPE row do not
        // depend on the kernels before this one (`pos` is the host's): L2 fetches them while
        // the q|k|v matmul still runs
        constexpr int LPR = HD / 32;  // 128-byte lines a row
        for (int i = threadIdx.x; i < (ke - kb) * LPR; i += blockDim.x) {
            const size_t off = ((size_t)(kb + i / LPR) * nkv + kvh) * HD + (i % LPR) * 32;
            prefetch_line(kc + off);
            prefetch_line(vc + off);
        }
        if (threadIdx.x < (LPR + 1) / 2) {
            const size_t off = (size_t)(keys - 1) * (HD / 2) + threadIdx.x * 32;
            prefetch_line(cos_t + off);
            prefetch_line(sin_t + off);
        }
        pdl_wait();
        constexpr int half = HD / 2;
        const int p = keys - 1, t = threadIdx.x & 127;
        const bool is_k = threadIdx.x >= 128, on = t < half;
        const float* src = row + (size_t)(is_k ? nh + kvh : h) * HD;
        float a = on ? src[t] : 0.f, b = on ? src[t + half] : 0.f;
        const float sq = warp_sum(a * a + b * b);
        if (lane == 0) red[warp] = sq;
        __syncthreads();
        const int w0 = is_k ? 4 : 0;
        const float r = rsqrtf((red[w0] + red[w0 + 1] + red[w0 + 2] + red[w0 + 3]) / (float)HD + eps);
        if (on) {
            const float* nw = is_k ? knw : qnw;
            a = a * r * nw[t];
            b = b * r * nw[t + half];
            const float c = cos_t[(size_t)p * half + t], s = sin_t[(size_t)p * half + t];
            const float o1 = a * c - b * s, o2 = a * s + b * c;
            if (is_k) {
                kn[t] = o1;
                kn[t + half] = o2;
            } else {
                qs[t] = o1 * scale;
                qs[t + half] = o2 * scale;
            }
        }
        for (int i = threadIdx.x; i < HD; i += blockDim.x) vn[i] = row[(size_t)(nh + nkv + kvh) * HD + i];
        __syncthreads();
        if (h % (nh / nkv) == 0 && z == 0)
            for (int i = threadIdx.x; i < HD; i += blockDim.x) {
                kw[((size_t)p * nkv + kvh) * HD + i] = kn[i];
                vw[((size_t)p * nkv + kvh) * HD + i] = vn[i];
            }
    } else {
        const float* q = row + (size_t)h * HD;
        for (int i = threadIdx.x; i < HD; i += blockDim.x) qs[i] = q[i] * scale;
        __syncthreads();
    }

    float acc[DPL];
#pragma unroll
    for (int d = 0; d < DPL; d++) acc[d] = 0.f;
    float mx = -INFINITY, l = 0.f;
    for (int j0 = kb + warp * 32; j0 < ke; j0 += ATT_WARPS * 32) {
        const int j = j0 + lane;
        float s = -INFINITY;
        if (j < ke) {
            // a lane reads its key row in batches of 16 float4, all in flight before any FMA:
            // the chunk costs a few memory round trips rather than one per load
            const float4* kr = DECODE && j == keys - 1 ? (const float4*)kn
                                                       : (const float4*)(kc + ((size_t)j * nkv + kvh) * HD);
            const float4* q4 = (const float4*)qs;
            float d0 = 0.f, d1 = 0.f;
#pragma unroll
            for (int c = 0; c < HD / 4; c += 16) {
                float4 kk[16];
#pragma unroll
                for (int i = 0; i < 16 && c + i < HD / 4; i++) kk[i] = kr[c + i];
#pragma unroll
                for (int i = 0; i < 16 && c + i < HD / 4; i += 2) {
                    const float4 a = q4[c + i], b = q4[c + i + 1];
                    d0 = fmaf(a.x, kk[i].x, fmaf(a.y, kk[i].y, fmaf(a.z, kk[i].z, fmaf(a.w, kk[i].w, d0))));
                    d1 = fmaf(b.x, kk[i + 1].x, fmaf(b.y, kk[i + 1].y, fmaf(b.z, kk[i + 1].z, fmaf(b.w, kk[i + 1].w, d1))));
                }
            }
            s = d0 + d1;
        }
        // lane 0's key exists (j0 < ke), so the new max is finite
        const float nm = fmaxf(mx, warp_max(s));
        const float e = j < ke ? expf(s - nm) : 0.f;
        const float corr = expf(mx - nm);
        l = l * corr + warp_sum(e);
#pragma unroll
        for (int d = 0; d < DPL; d++) acc[d] *= corr;
        const float* vbase = vc + ((size_t)j0 * nkv + kvh) * HD + lane;
        const size_t vstride = (size_t)nkv * HD;
        if (j0 + 32 <= ke) {
            // values in batches of 16 keys (DPL floats each), loaded before they are used
            constexpr int VB = DPL <= 4 ? 16 : 8;
#pragma unroll
            for (int b0 = 0; b0 < 32; b0 += VB) {
                float vv[VB][DPL];
#pragma unroll
                for (int jj = 0; jj < VB; jj++)
#pragma unroll
                    for (int d = 0; d < DPL; d++)
                        vv[jj][d] = DECODE && j0 + b0 + jj == keys - 1 ? vn[lane + 32 * d]
                                                                      : vbase[(b0 + jj) * vstride + 32 * d];
#pragma unroll
                for (int jj = 0; jj < VB; jj++) {
                    const float pj = __shfl_sync(0xffffffffu, e, b0 + jj);
#pragma unroll
                    for (int d = 0; d < DPL; d++) acc[d] = fmaf(pj, vv[jj][d], acc[d]);
                }
            }
        } else {
            const int nk = ke - j0;
            for (int jj = 0; jj < nk; jj++) {
                const float pj = __shfl_sync(0xffffffffu, e, jj);
#pragma unroll
                for (int d = 0; d < DPL; d++)
                    acc[d] = fmaf(pj, DECODE && j0 + jj == keys - 1 ? vn[lane + 32 * d] : vbase[jj * vstride + 32 * d], acc[d]);
            }
        }
        mx = nm;
    }
    if (lane == 0) {
        wm[warp] = mx;
        wl[warp] = l;
    }
#pragma unroll
    for (int d = 0; d < DPL; d++) wacc[warp][lane + 32 * d] = acc[d];
    __syncthreads();
    float gm = -INFINITY;
#pragma unroll
    for (int w = 0; w < ATT_WARPS; w++) gm = fmaxf(gm, wm[w]);
    // idle warps (and a split with no keys at all) weigh 0
    float f[ATT_WARPS], tl = 0.f;
#pragma unroll
    for (int w = 0; w < ATT_WARPS; w++) {
        f[w] = wm[w] == -INFINITY ? 0.f : expf(wm[w] - gm);
        tl += wl[w] * f[w];
    }
    float* o = out + (size_t)m * nh * HD + (size_t)h * HD;
    if (S == 1) {
        for (int i = threadIdx.x; i < HD; i += blockDim.x) {
            float v = 0.f;
#pragma unroll
            for (int w = 0; w < ATT_WARPS; w++) v += wacc[w][i] * f[w];
            o[i] = v / tl;
        }
        return;
    }
    float* pw = ws + ((size_t)h * S + z) * (HD + 2);
    for (int i = threadIdx.x; i < HD; i += blockDim.x) {
        float v = 0.f;
#pragma unroll
        for (int w = 0; w < ATT_WARPS; w++) v += wacc[w][i] * f[w];
        pw[2 + i] = v;
    }
    if (threadIdx.x == 0) {
        pw[0] = gm;
        pw[1] = tl;
    }
    __threadfence();
    __syncthreads();
    __shared__ bool last;
    if (threadIdx.x == 0) last = atomicAdd(&cnt[h], 1u) == (unsigned int)(S - 1);
    __syncthreads();
    if (!last) return;
    __threadfence();
    // split 0 always has keys, so M is finite; the partials bypass L1 (other SMs wrote them)
    const float* ph = ws + (size_t)h * S * (HD + 2);
    float M = -INFINITY, L = 0.f;
    for (int zz = 0; zz < S; zz++) M = fmaxf(M, __ldcg(ph + zz * (HD + 2)));
    for (int zz = 0; zz < S; zz++) {
        const float mz = __ldcg(ph + zz * (HD + 2));
        L += __ldcg(ph + zz * (HD + 2) + 1) * (mz == -INFINITY ? 0.f : expf(mz - M));
    }
    for (int i = threadIdx.x; i < HD; i += blockDim.x) {
        float v = 0.f;
        for (int zz = 0; zz < S; zz++) {
            const float mz = __ldcg(ph + zz * (HD + 2));
            v += __ldcg(ph + zz * (HD + 2) + 2 + i) * (mz == -INFINITY ? 0.f : expf(mz - M));
        }
        o[i] = v / L;
    }
    if (threadIdx.x == 0) cnt[h] = 0u;
}

#define ATTENTION(HD)                                                                              \
    extern "C" __global__ void __launch_bounds__(32 * ATT_WARPS, 1) attention_f32_hd##HD(          \
        const float* qkv, const float* kc, const float* vc, float* out, const int* pos, int nh,    \
        int nkv, float scale) {                                                                    \
        PDL_ENTRY();                                                                               \
        attention<HD, false>(qkv, kc, vc, out, pos, nh, nkv, scale, nullptr, nullptr, nullptr,     \
                             nullptr, nullptr, nullptr, 0.f, nullptr, nullptr);                    \
    }                                                                                              \
    extern "C" __global__ void __launch_bounds__(32 * ATT_WARPS, 1) attention_decode_hd##HD(       \
        const float* qkv, const float* qnw, const float* knw, float* kc, float* vc,                \
        const float* cos_t, const float* sin_t, float* out, const int* pos, int nh, int nkv,       \
        float scale, float eps, float* ws, unsigned int* cnt) {                                    \
        pdl_trigger();                                                                             \
        attention<HD, true>(qkv, kc, vc, out, pos, nh, nkv, scale, qnw, knw, kc, vc, cos_t, sin_t, \
                            eps, ws, cnt);                                                         \
    }
ATTENTION(32)
ATTENTION(64)
ATTENTION(128)
ATTENTION(256)

// Prompt attention, a block per head and ATT_WARPS query rows (a warp each): the keys and
// values the rows need are staged in shared memory 32 at a time, once for all the block's rows
// (attention_f32 has every row read them from L2 on its own: 64 prompt rows read a head's cache
// 64 times). Query row m (position pos + m) attends to positions 0..=pos+m; a lane scores one key
// of a chunk (keys padded to HD + 1 floats: a lane a bank), the warp updates its running max and
// sum, then lane d accumulates dims d, d + 32, ... of the values. Grid (n_heads, ceil(M / 8)).
// Not for head_dim 256 (two chunks would not fit the static shared memory).
template <int HD>
__device__ __forceinline__ void attention_prompt(const float* __restrict__ qkv, const float* __restrict__ kc,
                                                 const float* __restrict__ vc, float* __restrict__ out,
                                                 const int* __restrict__ pos, int M, int nh, int nkv, float scale) {
    constexpr int DPL = HD / 32;
    __shared__ float ks[32][HD + 1];
    __shared__ __align__(16) float vs[32][HD];
    __shared__ float qs[ATT_WARPS][HD];
    const int h = blockIdx.x, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int m0 = blockIdx.y * ATT_WARPS, m = m0 + warp;
    const bool active = m < M;
    const int p0 = pos[0];
    const int kend = p0 + min(M, m0 + ATT_WARPS);  // keys any row of the block attends to
    const int keys = p0 + m + 1;                     // this warp's row's
    const int kvh = h / (nh / nkv);
    if (active) {
        const float* q = qkv + ((size_t)m * (nh + 2 * nkv) + h) * HD;
        for (int d = lane; d < HD; d += 32) qs[warp][d] = q[d] * scale;
    }
    float acc[DPL];
#pragma unroll
    for (int d = 0; d < DPL; d++) acc[d] = 0.f;
    float mx = -INFINITY, l = 0.f;
    for (int j0 = 0; j0 < kend; j0 += 32) {
        const int nk = min(32, kend - j0);
        __syncthreads();  // the previous chunk is consumed (and, the first time, qs written)
        for (int e = threadIdx.x; e < nk * (HD / 4); e += blockDim.x) {
            const int jj = e / (HD / 4), d = (e % (HD / 4)) * 4;
            const size_t off = ((size_t)(j0 + jj) * nkv + kvh) * HD + d;
            const float4 k = *(const float4*)(kc + off);
            *(float4*)&vs[jj][d] = *(const float4*)(vc + off);
            ks[jj][d] = k.x;
            ks[jj][d + 1] = k.y;
            ks[jj][d + 2] = k.z;
            ks[jj][d + 3] = k.w;
        }
        __syncthreads();
        if (!active || j0 >= keys) continue;
        const int j = j0 + lane;
        float s = -INFINITY;
        if (j < keys) {
            float d0 = 0.f, d1 = 0.f;
#pragma unroll
            for (int d = 0; d < HD; d += 2) {
                d0 = fmaf(qs[warp][d], ks[lane][d], d0);
                d1 = fmaf(qs[warp][d + 1], ks[lane][d + 1], d1);
            }
            s = d0 + d1;
        }
        // lane 0's key exists (j0 < keys), so the new max is finite
        const float nm = fmaxf(mx, warp_max(s));
        const float e = j < keys ? expf(s - nm) : 0.f;
        const float corr = expf(mx - nm);
        l = l * corr + warp_sum(e);
#pragma unroll
        for (int d = 0; d < DPL; d++) acc[d] *= corr;
        const int nj = min(32, keys - j0);
        for (int jj = 0; jj < nj; jj++) {
            const float pj = __shfl_sync(0xffffffffu, e, jj);
#pragma unroll
            for (int d = 0; d < DPL; d++) acc[d] = fmaf(pj, vs[jj][lane + 32 * d], acc[d]);
        }
        mx = nm;
    }
    if (active) {
        float* o = out + ((size_t)m * nh + h) * HD;
#pragma unroll
        for (int d = 0; d < DPL; d++) o[lane + 32 * d] = acc[d] / l;
    }
}

#define ATTENTION_PROMPT(HD)                                                                          \
    extern "C" __global__ void __launch_bounds__(32 * ATT_WARPS) attention_prompt_hd##HD(             \
        const float* qkv, const float* kc, const float* vc, float* out, const int* pos, int M, int nh, \
        int nkv, float scale) {                                                                       \
        PDL_ENTRY();                                                                                  \
        attention_prompt<HD>(qkv, kc, vc, out, pos, M, nh, nkv, scale);                               \
    }
ATTENTION_PROMPT(32)
ATTENTION_PROMPT(64)
ATTENTION_PROMPT(128)

// act (M, I) = silu(gate) * up, from gu rows of interleaved (gate, up) pairs.
extern "C" __global__ void swiglu_f32(const float* __restrict__ gu, float* __restrict__ act, int I,
                                      int total) {
    PDL_ENTRY();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= total) return;
    const int m = i / I, c = i % I;
    const float g = gu[(size_t)m * 2 * I + 2 * c], u = gu[(size_t)m * 2 * I + 2 * c + 1];
    act[i] = g / (1.f + expf(-g)) * u;
}

// t (M, R) = x (M, K) @ at^T with at (R, K): the LoRA A products of the projections that share
// x, concatenated. With `norm_w`, x is RMS-normalized first (as rms_norm_f32; the row's scale is
// factored out of the dot product). Grid (R, M), 256 threads splitting K: a block per output,
// so the few outputs (3 x rank at most) still spread over many SMs.
extern "C" __global__ void lora_a_f32(const float* __restrict__ x, const float* __restrict__ at,
                                      float* __restrict__ t, int K, int R,
                                      const float* __restrict__ norm_w, float eps) {
    pdl_trigger();
    __shared__ float ps[8], pss[8];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int j = blockIdx.x, m = blockIdx.y;
    // A is no earlier kernel's output: L2 fetches its row while x is still being computed
    for (int i = threadIdx.x * 32; i < K; i += blockDim.x * 32) prefetch_line(at + (size_t)j * K + i);
    pdl_wait();
    const float4* xr = (const float4*)(x + (size_t)m * K);
    const float4* ar = (const float4*)(at + (size_t)j * K);
    const float4* nr = (const float4*)norm_w;
    float s = 0.f, ss = 0.f;
    // four float4 of each operand in flight per thread before any FMA (K = 4096 is one pass)
    const int K4 = K / 4, bd = blockDim.x;
    for (int k0 = threadIdx.x; k0 < K4; k0 += 4 * bd) {
        float4 a[4], v[4], g[4];
#pragma unroll
        for (int u = 0; u < 4; u++) {
            const int k = k0 + u * bd;
            const float4 z = make_float4(0.f, 0.f, 0.f, 0.f);
            a[u] = k < K4 ? ar[k] : z;
            v[u] = k < K4 ? xr[k] : z;
            g[u] = norm_w && k < K4 ? nr[k] : make_float4(1.f, 1.f, 1.f, 1.f);
        }
#pragma unroll
        for (int u = 0; u < 4; u++) {
            const float4 aa = make_float4(a[u].x * g[u].x, a[u].y * g[u].y, a[u].z * g[u].z, a[u].w * g[u].w);
            ss = fmaf(v[u].x, v[u].x, fmaf(v[u].y, v[u].y, fmaf(v[u].z, v[u].z, fmaf(v[u].w, v[u].w, ss))));
            s = fmaf(aa.x, v[u].x, fmaf(aa.y, v[u].y, fmaf(aa.z, v[u].z, fmaf(aa.w, v[u].w, s))));
        }
    }
    s = warp_sum(s);
    ss = warp_sum(ss);
    if (lane == 0) {
        ps[warp] = s;
        pss[warp] = ss;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        float st = 0.f, sst = 0.f;
        for (int i = 0; i < (int)(blockDim.x >> 5); i++) {
            st += ps[i];
            sst += pss[i];
        }
        if (norm_w) st *= rsqrtf(sst / (float)K + eps);
        t[(size_t)m * R + j] = st;
    }
}
