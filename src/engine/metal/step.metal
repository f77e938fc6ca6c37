// The fused Metal decode step's kernels (src/engine/metal/step/ plans and dispatches them), with
// mlx_lm's Qwen3 numerics (mlx_lm/models/qwen3.py) in fp32. Compiled in one library after
// qmatmul.metal (load_param, code_at and qgather, the embedding, come from there).
//
//   qmv4_step / qmvg_step  y = epilogue(rms_norm?(x) @ W^T): 4-bit (64-bit word loads, x as
//                          float4, a scale and bias per 16 codes) and any width; the input norm
//                          inside (its row scale multiplies the finished dot products), LoRA B,
//                          the residual add, and SwiGLU over interleaved (gate, up) rows after.
//   qmm_step               prompts: the same, on 8x8 simdgroup matrices over 32x32 tiles.
//   lora_a_step            t = rms_norm?(x) @ A^T, the LoRA A product of every part at once.
//   qk_norm_rope_cache     prompts: q/k RMSNorm, half-split RoPE, the K/V rows into the cache.
//   attention_step         one query row of one head over the cache, online softmax; at decode
//                          (fused) it does the q/k norms, RoPE and the cache write itself.
//
// Like qmatmul.metal this file is compiled as C++ under tests/metal_shim/shim.h, which runs the
// whole planned step on the tiny fixture models against the CPU forward. Keep to what the shim
// provides: scalar types, float4 and uint2 with component access, `as_type`, `simd_sum`,
// `threadgroup_barrier`, `exp`, `rsqrt`, `fma`, `min`, `max`, `simdgroup_float8x8` with
// load/store from threadgroup memory and multiply-accumulate; no pointers to thread or
// threadgroup memory (index arrays instead), every pointer parameter with its address space.

// What happens to an output after the matmul, in mlx_lm's order (base + LoRA, then residual +
// that). `lora_bt` is B transposed and pre-multiplied by the adapter scale, `r` values an
// output; outputs [0, seg1) use t's first r columns, [seg1, seg2) the next r, the rest the
// third (q|k|v); with `pairs`, even outputs use the first r and odd ones the next (gate|up,
// interleaved). With `swiglu` y gets silu(even) * odd per pair of outputs (N / 2 values a row).
struct StepEpi {
    int residual;
    int lora;
    int r;
    int rtot;
    int seg1;
    int seg2;
    int pairs;
    int swiglu;
};

// Mirrors metal::step::plan::MvParams.
struct MvParams {
    int M;
    int N;
    int K;
    int bits;
    int group_size;
    int sdtype;
    int norm;  // 1: x is RMS-normalized with norm_w first
    float eps;
    StepEpi e;
    // Threadgroups past the matmul's ceil(N / 8) compute the LoRA A product of the same input
    // instead, two of its `a_rtot` values each, into `a_t` (M, a_rtot); 0: none. The B product
    // is then added by the kernel that reads y (attention_step / qk_norm_rope_cache for q|k|v).
    int a_tgs;
    int a_rtot;
};

// Mirrors metal::step::plan::LoraParams.
struct LoraParams {
    int K;
    int rtot;
    int norm;
    float eps;
};

// Mirrors metal::step::plan::AttnParams.
struct AttnParams {
    int nh;
    int nkv;
    int hd;
    int pos;    // the position of row 0
    int fused;  // 1 (one row): q/k norms, RoPE and the cache write happen in attention_step
    float eps;
    float scale;
    // LoRA B of q|k|v, whose A product the q|k|v matmul computed (MvParams::a_tgs): `t` (M, rtot),
    // `bt` one row of r values per q|k|v output; outputs [0, seg1) are q, [seg1, seg2) k.
    int lora;
    int r;
    int rtot;
    int seg1;
    int seg2;
};

// q|k|v output n of row m with its LoRA B term, when there is one.
inline float qkv_value(device const float* row, int m, int n, constant AttnParams& p,
                       device const float* t, device const float* bt) {
    float v = row[n];
    if (p.lora != 0) {
        const int seg = int(n >= p.seg1) + int(n >= p.seg2);
        device const float* tr = t + m * p.rtot + seg * p.r;
        device const float* br = bt + n * p.r;
        for (int j = 0; j < p.r; j++) v = fma(tr[j], br[j], v);
    }
    return v;
}

#ifndef BOT_METAL_SHIM
#include <metal_simdgroup_matrix>
#endif

#define STEP_ROWS 4
#define STEP_SIMDS 2
#define STEP_THREADS (32 * STEP_SIMDS)
// A running maximum's start: finite, so that exp(start - m) is 0 also under fast math.
#define STEP_NEG_BIG (-1.0e30f)

struct StepAcc {
    float v[STEP_ROWS];
};

inline float step_epilogue(float v, int m, int n, constant MvParams& p,
                           device const float* residual, device const float* t,
                           device const float* bt) {
    if (p.e.lora != 0) {
        const int seg = p.e.pairs != 0 ? (n & 1) : int(n >= p.e.seg1) + int(n >= p.e.seg2);
        device const float* tr = t + m * p.e.rtot + seg * p.e.r;
        device const float* br = bt + n * p.e.r;
        float s = 0.f;
        for (int j = 0; j < p.e.r; j++) s = fma(tr[j], br[j], s);
        v += s;
    }
    if (p.e.residual != 0) v = residual[m * p.N + n] + v;
    return v;
}

// A simdgroup's STEP_ROWS partial sums, reduced over the lanes and scaled by the norm's `rn`,
// through the epilogue (and SwiGLU over (gate, up) pairs) into y. Every lane reaches simd_sum.
inline void step_finish(StepAcc acc, float rn, int row0, int m, uint lane, constant MvParams& p,
                        device float* y, device const float* residual, device const float* t,
                        device const float* bt) {
    float out[STEP_ROWS];
    for (int r = 0; r < STEP_ROWS; r++) {
        const float v = simd_sum(acc.v[r]) * rn;
        out[r] = row0 + r < p.N ? step_epilogue(v, m, row0 + r, p, residual, t, bt) : 0.f;
    }
    if (lane != 0) return;
    if (p.e.swiglu != 0) {
        for (int r = 0; r < STEP_ROWS; r += 2) {
            if (row0 + r < p.N) {
                const float g = out[r];
                y[m * (p.N / 2) + (row0 + r) / 2] = g / (1.f + exp(-g)) * out[r + 1];
            }
        }
    } else {
        for (int r = 0; r < STEP_ROWS; r++)
            if (row0 + r < p.N) y[m * p.N + row0 + r] = out[r];
    }
}

// This thread's share of the sum of squares of a row of K values (K % 4 == 0), over a
// threadgroup of `nt` threads, summed over its simdgroup.
inline float step_sumsq(device const float* xr, int K, uint tid, uint nt) {
    device const float4* x4 = (device const float4*)xr;
    float ss = 0.f;
    for (int i = int(tid); i < K / 4; i += int(nt)) {
        const float4 v = x4[i];
        ss = fma(v.x, v.x, fma(v.y, v.y, fma(v.z, v.z, fma(v.w, v.w, ss))));
    }
    return simd_sum(ss);
}

// An extra threadgroup of a matmul (MvParams::a_tgs): simdgroup s computes LoRA A value
// j = 2 * (tgid.y - tiles) + s of row m, t (M, a_rtot) = rms_norm?(x) @ A^T, A^T (a_rtot, K).
inline void step_lora_a(device const float* xr, int j, int m, constant MvParams& p,
                        device const float* norm_w, device const float* at, device float* t,
                        uint lane) {
    if (j >= p.a_rtot) return;  // a whole simdgroup leaves together
    device const float* ar = at + j * p.K;
    float ss = 0.f, dot = 0.f;
    for (int k = int(lane); k < p.K; k += 32) {
        const float xv = xr[k];
        ss = fma(xv, xv, ss);
        dot = fma(p.norm != 0 ? xv * norm_w[k] : xv, ar[k], dot);
    }
    ss = simd_sum(ss);
    dot = simd_sum(dot);
    const float rn = p.norm != 0 ? rsqrt(ss / float(p.K) + p.eps) : 1.f;
    if (lane == 0) t[m * p.a_rtot + j] = dot * rn;
}

// Decode (and prompt rows, one a threadgroup row) at 4 bits: a threadgroup of 2 simdgroups,
// each computing 4 output rows; a lane takes 16 codes (one 64-bit word) of each row a step, so a
// simdgroup covers 512 codes of its rows a step. x is read as float4, times the norm's weight,
// pre-divided by 1, 16, 256, 4096 so that a code is read with a mask and no shift. Needs
// K % 16 == 0 and group_size % 16 == 0. Grid: (M, ceil(N / 8) + a_tgs).
kernel void qmv4_step(device const float* x [[buffer(0)]],
                      device const uchar* w [[buffer(1)]],
                      device const uchar* scales [[buffer(2)]],
                      device const uchar* biases [[buffer(3)]],
                      device float* y [[buffer(4)]],
                      constant MvParams& p [[buffer(5)]],
                      device const float* norm_w [[buffer(6)]],
                      device const float* residual [[buffer(7)]],
                      device const float* lora_t [[buffer(8)]],
                      device const float* lora_bt [[buffer(9)]],
                      device const float* a_at [[buffer(10)]],
                      device float* a_t [[buffer(11)]],
                      uint3 tgid [[threadgroup_position_in_grid]],
                      uint tid [[thread_index_in_threadgroup]],
                      uint simd_gid [[simdgroup_index_in_threadgroup]],
                      uint simd_lid [[thread_index_in_simdgroup]]) {
    threadgroup float part[STEP_SIMDS];
    // rows of x vary fastest over the grid, so the threadgroups of one tile of W run together
    // and a prompt streams W from memory about once
    const int K = p.K, N = p.N, m = int(tgid.x), tile = int(tgid.y);
    const int row0 = tile * (STEP_SIMDS * STEP_ROWS) + int(simd_gid) * STEP_ROWS;
    device const float* xr = x + m * K;
    const int tiles = (N + STEP_SIMDS * STEP_ROWS - 1) / (STEP_SIMDS * STEP_ROWS);
    if (tile >= tiles) {
        const int j = 2 * (tile - tiles) + int(simd_gid);
        step_lora_a(xr, j, m, p, norm_w, a_at, a_t, simd_lid);
        return;
    }
    float rn = 1.f;
    if (p.norm != 0) {
        const float ss = step_sumsq(xr, K, tid, STEP_THREADS);
        if (simd_lid == 0) part[simd_gid] = ss;
        threadgroup_barrier(mem_flags::mem_threadgroup);
        rn = rsqrt((part[0] + part[1]) / float(K) + p.eps);
    }
    const int groups = K / p.group_size;
    StepAcc acc;
    for (int r = 0; r < STEP_ROWS; r++) acc.v[r] = 0.f;
    for (int k = int(simd_lid) * 16; k < K; k += 32 * 16) {
        float xt[16];
        float xsum = 0.f;
        device const float4* x4 = (device const float4*)(xr + k);
        device const float4* g4 = (device const float4*)(norm_w + k);
        for (int i = 0; i < 4; i++) {
            float4 v = x4[i];
            if (p.norm != 0) {
                const float4 g = g4[i];
                v.x *= g.x;
                v.y *= g.y;
                v.z *= g.z;
                v.w *= g.w;
            }
            xsum += (v.x + v.y) + (v.z + v.w);
            xt[4 * i] = v.x;
            xt[4 * i + 1] = v.y * (1.f / 16.f);
            xt[4 * i + 2] = v.z * (1.f / 256.f);
            xt[4 * i + 3] = v.w * (1.f / 4096.f);
        }
        for (int r = 0; r < STEP_ROWS; r++) {
            // rows past N compute a copy of the last row and are never written
            const int n = min(row0 + r, N - 1);
            const uint2 wd = *((device const uint2*)(w + n * (K / 2) + k / 2));
            float qx = 0.f;
            for (int h = 0; h < 4; h++) {
                const uint word = h < 2 ? wd.x : wd.y;
                const uint s16 = (word >> (16 * (h & 1))) & 0xffffu;
                qx += xt[4 * h] * float(s16 & 0x000fu) + xt[4 * h + 1] * float(s16 & 0x00f0u) +
                      xt[4 * h + 2] * float(s16 & 0x0f00u) + xt[4 * h + 3] * float(s16 & 0xf000u);
            }
            const int g = n * groups + k / p.group_size;
            acc.v[r] += load_param(scales, g, p.sdtype) * qx + load_param(biases, g, p.sdtype) * xsum;
        }
    }
    step_finish(acc, rn, row0, m, simd_lid, p, y, residual, lora_t, lora_bt);
}

// Any width and group size (K % 4 == 0): the same grid, epilogues, norm and LoRA A threadgroups
// as qmv4_step, a code at a time.
kernel void qmvg_step(device const float* x [[buffer(0)]],
                      device const uchar* w [[buffer(1)]],
                      device const uchar* scales [[buffer(2)]],
                      device const uchar* biases [[buffer(3)]],
                      device float* y [[buffer(4)]],
                      constant MvParams& p [[buffer(5)]],
                      device const float* norm_w [[buffer(6)]],
                      device const float* residual [[buffer(7)]],
                      device const float* lora_t [[buffer(8)]],
                      device const float* lora_bt [[buffer(9)]],
                      device const float* a_at [[buffer(10)]],
                      device float* a_t [[buffer(11)]],
                      uint3 tgid [[threadgroup_position_in_grid]],
                      uint tid [[thread_index_in_threadgroup]],
                      uint simd_gid [[simdgroup_index_in_threadgroup]],
                      uint simd_lid [[thread_index_in_simdgroup]]) {
    threadgroup float part[STEP_SIMDS];
    // rows of x vary fastest over the grid, so the threadgroups of one tile of W run together
    // and a prompt streams W from memory about once
    const int K = p.K, N = p.N, m = int(tgid.x), tile = int(tgid.y);
    const int row0 = tile * (STEP_SIMDS * STEP_ROWS) + int(simd_gid) * STEP_ROWS;
    device const float* xr = x + m * K;
    const int tiles = (N + STEP_SIMDS * STEP_ROWS - 1) / (STEP_SIMDS * STEP_ROWS);
    if (tile >= tiles) {
        const int j = 2 * (tile - tiles) + int(simd_gid);
        step_lora_a(xr, j, m, p, norm_w, a_at, a_t, simd_lid);
        return;
    }
    float rn = 1.f;
    if (p.norm != 0) {
        const float ss = step_sumsq(xr, K, tid, STEP_THREADS);
        if (simd_lid == 0) part[simd_gid] = ss;
        threadgroup_barrier(mem_flags::mem_threadgroup);
        rn = rsqrt((part[0] + part[1]) / float(K) + p.eps);
    }
    const int row_bytes = K * p.bits / 8, groups = K / p.group_size;
    StepAcc acc;
    for (int r = 0; r < STEP_ROWS; r++) {
        const int n = min(row0 + r, N - 1);
        device const uchar* row = w + n * row_bytes;
        float a = 0.f;
        for (int k = int(simd_lid); k < K; k += 32) {
            const int g = n * groups + k / p.group_size;
            const float wv = load_param(scales, g, p.sdtype) * float(code_at(row, k, p.bits)) +
                             load_param(biases, g, p.sdtype);
            const float xv = p.norm != 0 ? xr[k] * norm_w[k] : xr[k];
            a = fma(wv, xv, a);
        }
        acc.v[r] = a;
    }
    step_finish(acc, rn, row0, m, simd_lid, p, y, residual, lora_t, lora_bt);
}

// t (M, rtot) = rms_norm?(x) @ A^T, A^T stored (rtot, K). Grid (rtot, M), one simdgroup each.
kernel void lora_a_step(device const float* x [[buffer(0)]],
                        device const float* at [[buffer(1)]],
                        device float* t [[buffer(2)]],
                        constant LoraParams& p [[buffer(3)]],
                        device const float* norm_w [[buffer(4)]],
                        uint3 tgid [[threadgroup_position_in_grid]],
                        uint simd_lid [[thread_index_in_simdgroup]]) {
    const int j = int(tgid.x), m = int(tgid.y), K = p.K;
    device const float* xr = x + m * K;
    device const float* ar = at + j * K;
    float ss = 0.f, dot = 0.f;
    for (int k = int(simd_lid); k < K; k += 32) {
        const float xv = xr[k];
        ss = fma(xv, xv, ss);
        dot = fma(p.norm != 0 ? xv * norm_w[k] : xv, ar[k], dot);
    }
    ss = simd_sum(ss);
    dot = simd_sum(dot);
    const float rn = p.norm != 0 ? rsqrt(ss / float(K) + p.eps) : 1.f;
    if (simd_lid == 0) t[m * p.rtot + j] = dot * rn;
}

#define QMM_BM 32
#define QMM_BN 32
#define QMM_BK 32
#define QMM_THREADS 128

// Prompts (more than 8 rows): a threadgroup of 4 simdgroups computes a 32 (rows of x) by 32
// (rows of W) tile of y on 8x8 simdgroup matrices. Each K step stages 32x32 of x (times the
// norm's weight) and a dequantized 32x32 tile of W, transposed, in threadgroup memory; simdgroup
// s owns the 16x16 quadrant (s / 2, s % 2) as four 8x8 accumulators. The tile then goes through
// threadgroup memory to the same finish as the decode kernels: the norm's row scale, LoRA B,
// residual, SwiGLU over (gate, up) column pairs. Extra threadgroups past ceil(N / 32) compute the
// LoRA A product as qmv4_step's do, for every row of their tile. Any width and group size.
// Grid: (ceil(M / 32), ceil(N / 32) + a_tgs).
kernel void qmm_step(device const float* x [[buffer(0)]],
                     device const uchar* w [[buffer(1)]],
                     device const uchar* scales [[buffer(2)]],
                     device const uchar* biases [[buffer(3)]],
                     device float* y [[buffer(4)]],
                     constant MvParams& p [[buffer(5)]],
                     device const float* norm_w [[buffer(6)]],
                     device const float* residual [[buffer(7)]],
                     device const float* lora_t [[buffer(8)]],
                     device const float* lora_bt [[buffer(9)]],
                     device const float* a_at [[buffer(10)]],
                     device float* a_t [[buffer(11)]],
                     uint3 tgid [[threadgroup_position_in_grid]],
                     uint tid [[thread_index_in_threadgroup]],
                     uint simd_gid [[simdgroup_index_in_threadgroup]],
                     uint simd_lid [[thread_index_in_simdgroup]]) {
    threadgroup float Xs[QMM_BM * QMM_BK];  // (m, k)
    threadgroup float Ws[QMM_BK * QMM_BN];  // (k, n)
    threadgroup float Cs[QMM_BM * QMM_BN];  // (m, n)
    threadgroup float rn[QMM_BM];
    const int K = p.K, N = p.N, M = p.M;
    const int m0 = int(tgid.x) * QMM_BM, tile = int(tgid.y);
    const int tiles = (N + QMM_BN - 1) / QMM_BN;
    if (tile >= tiles) {
        if (simd_gid < 2) {
            const int j = 2 * (tile - tiles) + int(simd_gid);
            for (int m = m0; m < min(m0 + QMM_BM, M); m++)
                step_lora_a(x + m * K, j, m, p, norm_w, a_at, a_t, simd_lid);
        }
        return;
    }
    const int n0 = tile * QMM_BN;
    // the norm's row scales: simdgroup s takes rows s, s + 4, ...
    for (int r = int(simd_gid); r < QMM_BM; r += QMM_THREADS / 32) {
        const int m = m0 + r;
        float ss = 0.f;
        if (m < M && p.norm != 0) {
            for (int k = int(simd_lid); k < K; k += 32) ss = fma(x[m * K + k], x[m * K + k], ss);
        }
        ss = simd_sum(ss);
        if (simd_lid == 0) rn[r] = p.norm != 0 ? rsqrt(ss / float(K) + p.eps) : 1.f;
    }
    simdgroup_float8x8 acc[4];
    for (int i = 0; i < 4; i++) acc[i] = make_filled_simdgroup_matrix<float, 8, 8>(0.f);
    const int sr = int(simd_gid) / 2 * 16, sc = int(simd_gid) % 2 * 16;
    const int row_bytes = K * p.bits / 8, groups = K / p.group_size;
    for (int k0 = 0; k0 < K; k0 += QMM_BK) {
        for (int i = int(tid); i < QMM_BM * QMM_BK; i += QMM_THREADS) {
            const int r = i / QMM_BK, kk = i % QMM_BK, m = m0 + r, n = n0 + r, k = k0 + kk;
            float xv = 0.f;
            if (m < M && k < K) xv = p.norm != 0 ? x[m * K + k] * norm_w[k] : x[m * K + k];
            Xs[r * QMM_BK + kk] = xv;
            float wv = 0.f;
            if (n < N && k < K) {
                const int g = n * groups + k / p.group_size;
                wv = load_param(scales, g, p.sdtype) * float(code_at(w + n * row_bytes, k, p.bits)) +
                     load_param(biases, g, p.sdtype);
            }
            Ws[kk * QMM_BN + r] = wv;
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
        for (int kk = 0; kk < QMM_BK; kk += 8) {
            simdgroup_float8x8 a0, a1, b0, b1;
            simdgroup_load(a0, Xs + sr * QMM_BK + kk, QMM_BK);
            simdgroup_load(a1, Xs + (sr + 8) * QMM_BK + kk, QMM_BK);
            simdgroup_load(b0, Ws + kk * QMM_BN + sc, QMM_BN);
            simdgroup_load(b1, Ws + kk * QMM_BN + sc + 8, QMM_BN);
            simdgroup_multiply_accumulate(acc[0], a0, b0, acc[0]);
            simdgroup_multiply_accumulate(acc[1], a0, b1, acc[1]);
            simdgroup_multiply_accumulate(acc[2], a1, b0, acc[2]);
            simdgroup_multiply_accumulate(acc[3], a1, b1, acc[3]);
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
    }
    for (int i = 0; i < 4; i++)
        simdgroup_store(acc[i], Cs + (sr + 8 * (i / 2)) * QMM_BN + sc + 8 * (i % 2), QMM_BN);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (int i = int(tid); i < QMM_BM * QMM_BN; i += QMM_THREADS) {
        const int r = i / QMM_BN, c = i % QMM_BN, m = m0 + r, n = n0 + c;
        if (m >= M || n >= N) continue;
        if (p.e.swiglu != 0) {
            if ((c & 1) != 0) continue;  // the pair's even thread writes it
            const float g = step_epilogue(Cs[i] * rn[r], m, n, p, residual, lora_t, lora_bt);
            const float u = step_epilogue(Cs[i + 1] * rn[r], m, n + 1, p, residual, lora_t, lora_bt);
            y[m * (N / 2) + n / 2] = g / (1.f + exp(-g)) * u;
        } else {
            y[m * N + n] = step_epilogue(Cs[i] * rn[r], m, n, p, residual, lora_t, lora_bt);
        }
    }
}

// The largest head_dim the attention kernels take.
#define STEP_MAX_HD 256
#define ATT_SIMDS 4

// Prompts: grid (nh + nkv, M), threads: head_dim / 2 rounded up to a multiple of 32. Thread t
// owns the RoPE pair (t, t + hd / 2). q heads are normed and rotated in place; k heads are normed,
// rotated and written to the cache at pos + m, with the matching v head. Cache (cap, nkv, hd).
kernel void qk_norm_rope_cache(device float* qkv [[buffer(0)]],
                               device const float* qnw [[buffer(1)]],
                               device const float* knw [[buffer(2)]],
                               device float* kc [[buffer(3)]],
                               device float* vc [[buffer(4)]],
                               device const float* cos_t [[buffer(5)]],
                               device const float* sin_t [[buffer(6)]],
                               constant AttnParams& p [[buffer(7)]],
                               device const float* lora_t [[buffer(8)]],
                               device const float* lora_bt [[buffer(9)]],
                               uint3 tgid [[threadgroup_position_in_grid]],
                               uint tid [[thread_index_in_threadgroup]],
                               uint nt [[threads_per_threadgroup]],
                               uint simd_gid [[simdgroup_index_in_threadgroup]],
                               uint simd_lid [[thread_index_in_simdgroup]]) {
    threadgroup float part[STEP_MAX_HD / 64 + 1];
    const int h = int(tgid.x), m = int(tgid.y), hd = p.hd, half = hd / 2, t = int(tid);
    const int P = p.pos + m;
    device float* row = qkv + m * (p.nh + 2 * p.nkv) * hd;
    device float* src = row + h * hd;  // k heads follow the q heads
    const bool on = t < half;
    const float a = on ? qkv_value(row, m, h * hd + t, p, lora_t, lora_bt) : 0.f;
    const float b = on ? qkv_value(row, m, h * hd + t + half, p, lora_t, lora_bt) : 0.f;
    const float ss = simd_sum(a * a + b * b);
    if (simd_lid == 0) part[simd_gid] = ss;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    float tot = 0.f;
    for (uint i = 0; i < nt / 32; i++) tot += part[i];
    if (!on) return;
    const float rs = rsqrt(tot / float(hd) + p.eps);
    const bool is_q = h < p.nh;
    device const float* nw = is_q ? qnw : knw;
    const float na = a * rs * nw[t], nb = b * rs * nw[t + half];
    const float c = cos_t[P * half + t], s = sin_t[P * half + t];
    const float ra = na * c - nb * s, rb = nb * c + na * s;
    if (is_q) {
        src[t] = ra;
        src[t + half] = rb;
        return;
    }
    const int kvh = h - p.nh;
    device float* kd = kc + (P * p.nkv + kvh) * hd;
    device float* vd = vc + (P * p.nkv + kvh) * hd;
    const int v0 = (p.nh + p.nkv + kvh) * hd;
    kd[t] = ra;
    kd[t + half] = rb;
    vd[t] = qkv_value(row, m, v0 + t, p, lora_t, lora_bt);
    vd[t + half] = qkv_value(row, m, v0 + t + half, p, lora_t, lora_bt);
}

// One query row of one head against the cache's positions 0..=pos+m, online softmax, fp32.
// Grid (nh, M), 32 * ATT_SIMDS threads: simdgroup s takes positions s, s + 4, ...; a lane holds
// head_dim / 32 of the values. With `fused` (decode, M == 1) the threadgroup first normalizes
// and rotates its q head and its kv head's new k row itself (every threadgroup of a kv group
// does, the first writes the cache; q|k|v's LoRA B term added on the way in) and reads the
// newest position from threadgroup memory, so no other threadgroup's write is awaited.
// Output (M, nh * hd).
kernel void attention_step(device const float* qkv [[buffer(0)]],
                           device const float* qnw [[buffer(1)]],
                           device const float* knw [[buffer(2)]],
                           device float* kc [[buffer(3)]],
                           device float* vc [[buffer(4)]],
                           device const float* cos_t [[buffer(5)]],
                           device const float* sin_t [[buffer(6)]],
                           constant AttnParams& p [[buffer(7)]],
                           device float* out [[buffer(8)]],
                           device const float* lora_t [[buffer(9)]],
                           device const float* lora_bt [[buffer(10)]],
                           uint3 tgid [[threadgroup_position_in_grid]],
                           uint tid [[thread_index_in_threadgroup]],
                           uint simd_gid [[simdgroup_index_in_threadgroup]],
                           uint simd_lid [[thread_index_in_simdgroup]]) {
    threadgroup float qs[STEP_MAX_HD];
    threadgroup float ks[STEP_MAX_HD];
    threadgroup float vs[STEP_MAX_HD];
    threadgroup float part[2 * ATT_SIMDS];
    threadgroup float sm[ATT_SIMDS];
    threadgroup float sl[ATT_SIMDS];
    threadgroup float sa[ATT_SIMDS * STEP_MAX_HD];
    const int nt = 32 * ATT_SIMDS;
    const int h = int(tgid.x), m = int(tgid.y), hd = p.hd, half = hd / 2, t = int(tid);
    const int kvh = h / (p.nh / p.nkv), P = p.pos + m;
    device const float* row = qkv + m * (p.nh + 2 * p.nkv) * hd;
    if (p.fused != 0) {
        for (int i = t; i < hd; i += nt) {
            qs[i] = qkv_value(row, m, h * hd + i, p, lora_t, lora_bt);
            ks[i] = qkv_value(row, m, (p.nh + kvh) * hd + i, p, lora_t, lora_bt);
            vs[i] = qkv_value(row, m, (p.nh + p.nkv + kvh) * hd + i, p, lora_t, lora_bt);
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
        const bool on = t < half;
        const float aq = on ? qs[t] : 0.f, bq = on ? qs[t + half] : 0.f;
        const float ak = on ? ks[t] : 0.f, bk = on ? ks[t + half] : 0.f;
        const float sq = simd_sum(aq * aq + bq * bq), sk = simd_sum(ak * ak + bk * bk);
        if (simd_lid == 0) {
            part[simd_gid] = sq;
            part[ATT_SIMDS + simd_gid] = sk;
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
        float tq = 0.f, tk = 0.f;
        for (int i = 0; i < ATT_SIMDS; i++) {
            tq += part[i];
            tk += part[ATT_SIMDS + i];
        }
        if (on) {
            const float rq = rsqrt(tq / float(hd) + p.eps), rk = rsqrt(tk / float(hd) + p.eps);
            const float c = cos_t[P * half + t], s = sin_t[P * half + t];
            const float qa = aq * rq * qnw[t], qb = bq * rq * qnw[t + half];
            const float ka = ak * rk * knw[t], kb = bk * rk * knw[t + half];
            qs[t] = qa * c - qb * s;
            qs[t + half] = qb * c + qa * s;
            ks[t] = ka * c - kb * s;
            ks[t + half] = kb * c + ka * s;
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
        if (h % (p.nh / p.nkv) == 0) {
            for (int i = t; i < hd; i += nt) {
                kc[(P * p.nkv + kvh) * hd + i] = ks[i];
                vc[(P * p.nkv + kvh) * hd + i] = vs[i];
            }
        }
    } else {
        // qk_norm_rope_cache has normed and rotated q (its LoRA term included) in place
        for (int i = t; i < hd; i += nt) qs[i] = row[h * hd + i];
        threadgroup_barrier(mem_flags::mem_threadgroup);
    }
    const int per = hd / 32;
    float acc[STEP_MAX_HD / 32];
    for (int i = 0; i < STEP_MAX_HD / 32; i++) acc[i] = 0.f;
    float mx = STEP_NEG_BIG, l = 0.f;
    for (int j = int(simd_gid); j <= P; j += ATT_SIMDS) {
        const bool newest = p.fused != 0 && j == P;
        device const float* kr = kc + (j * p.nkv + kvh) * hd;
        device const float* vr = vc + (j * p.nkv + kvh) * hd;
        float dot = 0.f;
        for (int i = 0; i < per; i++) {
            const int d = int(simd_lid) + 32 * i;
            dot = fma(qs[d], newest ? ks[d] : kr[d], dot);
        }
        const float s = simd_sum(dot) * p.scale;
        const float mn = max(mx, s);
        const float c = exp(mx - mn), e = exp(s - mn);
        l = l * c + e;
        for (int i = 0; i < per; i++) {
            const int d = int(simd_lid) + 32 * i;
            acc[i] = acc[i] * c + e * (newest ? vs[d] : vr[d]);
        }
        mx = mn;
    }
    if (simd_lid == 0) {
        sm[simd_gid] = mx;
        sl[simd_gid] = l;
    }
    for (int i = 0; i < per; i++) sa[int(simd_gid) * STEP_MAX_HD + int(simd_lid) + 32 * i] = acc[i];
    threadgroup_barrier(mem_flags::mem_threadgroup);
    // simdgroup 0 always has position 0, so the maximum is a real score
    float gm = sm[0];
    for (int s = 1; s < ATT_SIMDS; s++) gm = max(gm, sm[s]);
    float f[ATT_SIMDS];
    float tl = 0.f;
    for (int s = 0; s < ATT_SIMDS; s++) {
        f[s] = exp(sm[s] - gm);
        tl += sl[s] * f[s];
    }
    device float* o = out + (m * p.nh + h) * hd;
    for (int i = t; i < hd; i += nt) {
        float v = 0.f;
        for (int s = 0; s < ATT_SIMDS; s++) v += sa[s * STEP_MAX_HD + i] * f[s];
        o[i] = v / tl;
    }
}
