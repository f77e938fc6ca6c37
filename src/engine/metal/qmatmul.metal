// Metal kernels for MLX affine quantization (see src/engine/quant.rs): y = x @ dequant(W)^T,
// W as mlx_lm stores it (little-endian `bits`-wide codes, low bits first; one scale and bias per
// `group_size` codes; w = scale * q + bias). Compiled from source at run time through candle's
// Metal device (src/engine/metal/quant.rs).
//
// This file is also compiled as C++ on Linux under tests/metal_shim/shim.h, which runs every
// lane of a threadgroup as a thread and implements simd_sum and threadgroup_barrier with
// barriers, so the arithmetic and indexing below are tested against the slow reference without
// a Mac (src/engine/metal/shim.rs). Keep to the subset the shim provides: scalar types,
// `as_type`, `simd_sum`, `threadgroup_barrier`, the attributes used here.
//
// qmv_fast_4 / qmv_fast_8 (decode) follow MLX's qmv_fast: a threadgroup of 2 simdgroups, each
// simdgroup computing 4 output rows; a lane takes 16 codes per step, so a simdgroup covers 512
// codes of a row per step. At 4 bits x is pre-divided by 1, 16, 256, 4096 so that a code is
// read with a mask and no shift: (w & 0x00f0) * (x / 16) == q * x. Each lane applies its
// group's scale and bias once per 16 codes: scale * sum(q*x) + bias * sum(x). fp32 throughout.
// The fast kernels need K % 512 == 0 and N % 8 == 0; qmv_generic covers every width, group size
// and tail. qmm (prefill) dequantizes a 32x32 tile of W into threadgroup memory and reuses it
// across 32 rows of x. qgather dequantizes embedding rows.

#ifndef BOT_METAL_SHIM
#include <metal_stdlib>
using namespace metal;
#endif

struct QParams {
    int M;          // rows of x
    int N;          // rows of W (outputs)
    int K;          // columns of W (inputs)
    int bits;
    int group_size;
    int sdtype;     // scales/biases: 0 bf16, 1 f16, 2 f32
};

inline float load_param(device const uchar* p, int i, int sdtype) {
    if (sdtype == 0) {
        // bf16 is the top half of an f32
        uint v = uint(p[2 * i]) | (uint(p[2 * i + 1]) << 8);
        return as_type<float>(v << 16);
    } else if (sdtype == 1) {
        ushort h = ushort(uint(p[2 * i]) | (uint(p[2 * i + 1]) << 8));
        return float(as_type<half>(h));
    }
    uint v = uint(p[4 * i]) | (uint(p[4 * i + 1]) << 8) | (uint(p[4 * i + 2]) << 16) |
             (uint(p[4 * i + 3]) << 24);
    return as_type<float>(v);
}

// Code j (0-based) of a packed row, for any width 1..8.
inline uint code_at(device const uchar* row, int j, int bits) {
    int bit = j * bits;
    int byte = bit >> 3;
    int sh = bit & 7;
    uint v = uint(row[byte]);
    if (sh + bits > 8) v |= uint(row[byte + 1]) << 8;
    return (v >> sh) & ((1u << bits) - 1u);
}

#define SIMD 32
#define ROWS_PER_SIMD 4
#define SIMDS_PER_TG 2

kernel void qmv_fast_4(device const float* x [[buffer(0)]],
                       device const uchar* w [[buffer(1)]],
                       device const uchar* scales [[buffer(2)]],
                       device const uchar* biases [[buffer(3)]],
                       device float* y [[buffer(4)]],
                       constant QParams& p [[buffer(5)]],
                       uint3 tgid [[threadgroup_position_in_grid]],
                       uint simd_gid [[simdgroup_index_in_threadgroup]],
                       uint simd_lid [[thread_index_in_simdgroup]]) {
    const int K = p.K, N = p.N;
    const int row0 = int(tgid.x) * (SIMDS_PER_TG * ROWS_PER_SIMD) + int(simd_gid) * ROWS_PER_SIMD;
    const int m = int(tgid.y);
    const int row_bytes = K / 2;
    const int groups = K / p.group_size;
    device const float* xr = x + m * K;
    float acc[ROWS_PER_SIMD] = {0.f, 0.f, 0.f, 0.f};
    for (int k = int(simd_lid) * 16; k < K; k += SIMD * 16) {
        // x for 16 codes, pre-divided so masked nibbles need no shift
        float xt[16];
        float xsum = 0.f;
        for (int i = 0; i < 16; i += 4) {
            float a = xr[k + i], b = xr[k + i + 1], c = xr[k + i + 2], d = xr[k + i + 3];
            xsum += (a + b) + (c + d);
            xt[i] = a;
            xt[i + 1] = b / 16.0f;
            xt[i + 2] = c / 256.0f;
            xt[i + 3] = d / 4096.0f;
        }
        for (int r = 0; r < ROWS_PER_SIMD; r++) {
            const int n = row0 + r;
            device const uchar* wb = w + n * row_bytes + k / 2;
            float qx = 0.f;
            for (int i = 0; i < 16; i += 4) {
                ushort ws = ushort(uint(wb[i / 2]) | (uint(wb[i / 2 + 1]) << 8));
                qx += xt[i] * float(ws & 0x000f) + xt[i + 1] * float(ws & 0x00f0) +
                      xt[i + 2] * float(ws & 0x0f00) + xt[i + 3] * float(ws & 0xf000);
            }
            const int g = n * groups + k / p.group_size;
            acc[r] += load_param(scales, g, p.sdtype) * qx + load_param(biases, g, p.sdtype) * xsum;
        }
    }
    for (int r = 0; r < ROWS_PER_SIMD; r++) {
        const float v = simd_sum(acc[r]);
        if (simd_lid == 0) y[m * N + row0 + r] = v;
    }
}

kernel void qmv_fast_8(device const float* x [[buffer(0)]],
                       device const uchar* w [[buffer(1)]],
                       device const uchar* scales [[buffer(2)]],
                       device const uchar* biases [[buffer(3)]],
                       device float* y [[buffer(4)]],
                       constant QParams& p [[buffer(5)]],
                       uint3 tgid [[threadgroup_position_in_grid]],
                       uint simd_gid [[simdgroup_index_in_threadgroup]],
                       uint simd_lid [[thread_index_in_simdgroup]]) {
    const int K = p.K, N = p.N;
    const int row0 = int(tgid.x) * (SIMDS_PER_TG * ROWS_PER_SIMD) + int(simd_gid) * ROWS_PER_SIMD;
    const int m = int(tgid.y);
    const int groups = K / p.group_size;
    device const float* xr = x + m * K;
    float acc[ROWS_PER_SIMD] = {0.f, 0.f, 0.f, 0.f};
    for (int k = int(simd_lid) * 16; k < K; k += SIMD * 16) {
        float xt[16];
        float xsum = 0.f;
        for (int i = 0; i < 16; i++) {
            xt[i] = xr[k + i];
            xsum += xt[i];
        }
        for (int r = 0; r < ROWS_PER_SIMD; r++) {
            const int n = row0 + r;
            device const uchar* wb = w + n * K + k;
            float qx = 0.f;
            for (int i = 0; i < 16; i++) qx += xt[i] * float(wb[i]);
            const int g = n * groups + k / p.group_size;
            acc[r] += load_param(scales, g, p.sdtype) * qx + load_param(biases, g, p.sdtype) * xsum;
        }
    }
    for (int r = 0; r < ROWS_PER_SIMD; r++) {
        const float v = simd_sum(acc[r]);
        if (simd_lid == 0) y[m * N + row0 + r] = v;
    }
}

// Any width, group size and shape: the same grid as the fast kernels, rows past N skipped.
kernel void qmv_generic(device const float* x [[buffer(0)]],
                        device const uchar* w [[buffer(1)]],
                        device const uchar* scales [[buffer(2)]],
                        device const uchar* biases [[buffer(3)]],
                        device float* y [[buffer(4)]],
                        constant QParams& p [[buffer(5)]],
                        uint3 tgid [[threadgroup_position_in_grid]],
                        uint simd_gid [[simdgroup_index_in_threadgroup]],
                        uint simd_lid [[thread_index_in_simdgroup]]) {
    const int K = p.K, N = p.N;
    const int row0 = int(tgid.x) * (SIMDS_PER_TG * ROWS_PER_SIMD) + int(simd_gid) * ROWS_PER_SIMD;
    const int m = int(tgid.y);
    const int row_bytes = K * p.bits / 8;
    const int groups = K / p.group_size;
    device const float* xr = x + m * K;
    for (int r = 0; r < ROWS_PER_SIMD; r++) {
        const int n = row0 + r;
        float acc = 0.f;
        if (n < N) {
            device const uchar* row = w + n * row_bytes;
            for (int k = int(simd_lid); k < K; k += SIMD) {
                const int g = n * groups + k / p.group_size;
                const float wv = load_param(scales, g, p.sdtype) * float(code_at(row, k, p.bits)) +
                                 load_param(biases, g, p.sdtype);
                acc += wv * xr[k];
            }
        }
        // every lane takes part in the reduction, also for rows past N
        const float v = simd_sum(acc);
        if (simd_lid == 0 && n < N) y[m * N + n] = v;
    }
}

#define QMM_T 32

// Prefill: a threadgroup of 32x8 threads computes a 32 (x rows) by 32 (W rows) tile; each K step
// dequantizes a 32x32 tile of W into threadgroup memory once for all 32 rows of x.
// Grid: (ceil(N / 32), ceil(M / 32)) threadgroups.
kernel void qmm(device const float* x [[buffer(0)]],
                device const uchar* w [[buffer(1)]],
                device const uchar* scales [[buffer(2)]],
                device const uchar* biases [[buffer(3)]],
                device float* y [[buffer(4)]],
                constant QParams& p [[buffer(5)]],
                uint3 tgid [[threadgroup_position_in_grid]],
                uint3 tid [[thread_position_in_threadgroup]]) {
    threadgroup float Ws[QMM_T][QMM_T + 1];
    threadgroup float Xs[QMM_T][QMM_T + 1];
    const int K = p.K, N = p.N, M = p.M;
    const int n0 = int(tgid.x) * QMM_T, m0 = int(tgid.y) * QMM_T;
    const int tx = int(tid.x), ty = int(tid.y);  // tx 0..31 (W row / k), ty 0..7
    const int row_bytes = K * p.bits / 8;
    const int groups = K / p.group_size;
    float acc[4] = {0.f, 0.f, 0.f, 0.f};  // x rows ty, ty+8, ty+16, ty+24; W row n0+tx
    for (int k0 = 0; k0 < K; k0 += QMM_T) {
        for (int i = ty; i < QMM_T; i += 8) {
            const int n = n0 + i, k = k0 + tx, m = m0 + i;
            float wv = 0.f;
            if (n < N && k < K) {
                const int g = n * groups + k / p.group_size;
                wv = load_param(scales, g, p.sdtype) * float(code_at(w + n * row_bytes, k, p.bits)) +
                     load_param(biases, g, p.sdtype);
            }
            Ws[i][tx] = wv;
            Xs[i][tx] = (m < M && k < K) ? x[m * K + k] : 0.f;
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
        for (int kk = 0; kk < QMM_T; kk++) {
            const float wv = Ws[tx][kk];
            for (int j = 0; j < 4; j++) acc[j] += Xs[ty + 8 * j][kk] * wv;
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
    }
    for (int j = 0; j < 4; j++) {
        const int m = m0 + ty + 8 * j, n = n0 + tx;
        if (m < M && n < N) y[m * N + n] = acc[j];
    }
}

// out (L, K): rows ids[l] of the table, dequantized. Grid: (ceil(K / 256), L), 256 threads.
kernel void qgather(device const uint* ids [[buffer(0)]],
                    device const uchar* w [[buffer(1)]],
                    device const uchar* scales [[buffer(2)]],
                    device const uchar* biases [[buffer(3)]],
                    device float* out [[buffer(4)]],
                    constant QParams& p [[buffer(5)]],
                    uint3 tgid [[threadgroup_position_in_grid]],
                    uint3 tid [[thread_position_in_threadgroup]]) {
    const int K = p.K;
    const int l = int(tgid.y);
    const int k = int(tgid.x) * 256 + int(tid.x);
    if (k >= K) return;
    const int n = int(ids[l]);
    const int g = n * (K / p.group_size) + k / p.group_size;
    out[l * K + k] = load_param(scales, g, p.sdtype) * float(code_at(w + n * (K * p.bits / 8), k, p.bits)) +
                     load_param(biases, g, p.sdtype);
}
