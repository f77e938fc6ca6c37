// CUDA kernels for MLX affine quantization (see src/engine/quant.rs): y = x @ dequant(W)^T with
// W stored as mlx_lm writes it: each row a little-endian bitstream of `bits`-wide codes (low bits
// first), one scale and bias per `group_size` codes, w = scale * q + bias.
//
// qmv (decode, few rows of x): one warp per output row, in the spirit of MLX's qmv. A lane takes
// 16 consecutive codes per step (one 8-byte load at 4 bits, 16 bytes at 8), so a warp reads a
// contiguous 256/512-byte span; 16 codes never straddle a group (group_size >= 32), which lets
// a lane apply its group's scale and bias once: scale * sum(q*x) + bias * sum(x), i.e. two FMAs
// per 16 weights. All rows of x (M <= 8 per pass) reuse the unpacked codes; later passes over
// the same weight row hit L1. fp32 throughout: this is also the exact mode.
//
// qmm_tf32 (prefill, many rows): a 64x64 output tile per block; each K step dequantizes a
// 64x32 tile of W into shared memory and runs TF32 tensor-core MMAs (wmma 16x16x8), so the
// dequantized matrix never exists in global memory and each weight is read once per 64 rows.
//
// qmv4_m1 (decode at 4 bits, one row of x) is the fast path of qmv; see its comment.
// qmv, qmv4_m1 and qmm apply an epilogue (LoRA term, residual) to each output: see common.cuh.
//
// Scales and biases arrive raw, in the file's dtype: 0 = bf16, 1 = f16, 2 = f32.

#include <mma.h>
#include "common.cuh"

using namespace nvcuda;

#define QMV_WARPS 8
#define QMV_MT 8

// x (M, K) row-major, y (M, N) row-major. Grid: ceil(N / QMV_WARPS) blocks of 32*QMV_WARPS.
extern "C" __global__ void qmv_f32(const float* __restrict__ x, const uint8_t* __restrict__ w,
                                   const void* __restrict__ scales, const void* __restrict__ biases,
                                   float* y, int M, int N, int K, int bits,
                                   int group_size, int sdtype, Epi e) {
    const int lane = threadIdx.x & 31;
    const int n = blockIdx.x * QMV_WARPS + (threadIdx.x >> 5);
    if (n >= N) return;
    const size_t row_bytes = (size_t)K * bits / 8;
    const uint8_t* row = w + (size_t)n * row_bytes;
    const int groups = K / group_size;
    for (int m0 = 0; m0 < M; m0 += QMV_MT) {
        const int mt = min(QMV_MT, M - m0);
        float acc[QMV_MT];
#pragma unroll
        for (int m = 0; m < QMV_MT; m++) acc[m] = 0.f;
        for (int k = lane * 16; k < K; k += 32 * 16) {
            float q[16];
            unpack16(row, k, bits, q);
            const int g = n * groups + k / group_size;
            const float s = load_param(scales, g, sdtype);
            const float b = load_param(biases, g, sdtype);
#pragma unroll
            for (int m = 0; m < QMV_MT; m++) {
                if (m < mt) {
                    const float4* xv = (const float4*)(x + (size_t)(m0 + m) * K + k);
                    float qx = 0.f, xs = 0.f;
#pragma unroll
                    for (int j = 0; j < 4; j++) {
                        float4 v = xv[j];
                        qx = fmaf(q[4 * j], v.x, qx);
                        qx = fmaf(q[4 * j + 1], v.y, qx);
                        qx = fmaf(q[4 * j + 2], v.z, qx);
                        qx = fmaf(q[4 * j + 3], v.w, qx);
                        xs += (v.x + v.y) + (v.z + v.w);
                    }
                    acc[m] = fmaf(s, qx, fmaf(b, xs, acc[m]));
                }
            }
        }
#pragma unroll
        for (int m = 0; m < QMV_MT; m++) {
            float v = acc[m];
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
            if (lane == 0 && m < mt) y[(size_t)(m0 + m) * N + n] = epilogue(v, m0 + m, n, N, e);
        }
    }
}

// qmv4_m1_r2/_r4 (decode, one row of x, 4-bit): each warp computes 2 or 4 output rows, a lane
// taking 32 codes (one 16-byte load) of each row per step, so every x value a lane holds serves
// every row of the warp. The block first stages x in shared memory (RMS-normalized with `norm_w` if given, as
// rms_norm_f32 computes it, which saves the norm's own launch), in an order where lane L's 32
// values of a step are float4 slots L, L+32, ..., L+224: reads are then free of bank conflicts.
// Codes become floats without integer conversion (quarter-rate on sm_90): a nibble masked in
// place, OR-ed into the mantissa of 2^23, minus 2^23, is 16^j * q exactly for nibble j of a
// 16-bit half, so x is pre-divided by 16^j once per step (as MLX's qmv_fast does).

__device__ __forceinline__ float nib(unsigned int v, unsigned int mask) {
    return __uint_as_float((v & mask) | 0x4B000000u) - 8388608.f;
}

// Slot of x's float4 number c in the staged layout (blocks of 256 float4 = 1024 codes).
__device__ __forceinline__ int q4_slot(int c) {
    const int w = c & 255;
    return (c & ~255) + (w & 7) * 32 + (w >> 3);
}

// ROWS rows per warp. Grid: ceil(N / (ROWS * warps)) blocks of 32 * warps threads (warps <= 32);
// dynamic shared memory: K rounded up to 1024, times 4 bytes. With e.swiglu the rows come in
// (gate, up) pairs and y receives silu(gate) * up, one value per pair.
template <int ROWS>
__device__ void qmv4(const float* __restrict__ x, const uint8_t* __restrict__ w,
                     const void* __restrict__ scales, const void* __restrict__ biases, float* y,
                     int N, int K, int group_size, int sdtype, const float* __restrict__ norm_w,
                     float eps, const Epi& e) {
    extern __shared__ float4 xsm[];
    __shared__ float part[32];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nw = blockDim.x >> 5;
    const int row0 = (blockIdx.x * nw + warp) * ROWS;
    const size_t rb = (size_t)K / 2;
    // the first step's weights are requested before x is staged, to overlap the two
    uint4 wv[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; r++)
        wv[r] = row0 + r < N && lane * 32 < K ? *(const uint4*)(w + (size_t)(row0 + r) * rb + lane * 16)
                                              : make_uint4(0u, 0u, 0u, 0u);
    const float4* x4 = (const float4*)x;
    float ss = 0.f;
    for (int c = tid; c < K / 4; c += blockDim.x) {
        const float4 v = x4[c];
        ss = fmaf(v.x, v.x, fmaf(v.y, v.y, fmaf(v.z, v.z, fmaf(v.w, v.w, ss))));
        xsm[q4_slot(c)] = v;
    }
    if (norm_w) {
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
        if (lane == 0) part[warp] = ss;
        __syncthreads();
        float t = 0.f;
        for (int i = 0; i < nw; i++) t += part[i];
        const float rn = rsqrtf(t / (float)K + eps);
        const float4* g4 = (const float4*)norm_w;
        for (int c = tid; c < K / 4; c += blockDim.x) {
            // the thread rewrites the slot it wrote above
            const float4 v = xsm[q4_slot(c)], g = g4[c];
            xsm[q4_slot(c)] = make_float4(v.x * rn * g.x, v.y * rn * g.y, v.z * rn * g.z, v.w * rn * g.w);
        }
    }
    __syncthreads();
    if (row0 >= N) return;

    const int groups = K / group_size;
    float acc[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; r++) acc[r] = 0.f;
    for (int k = lane * 32; k < K; k += 32 * 32) {
        // next step's weights in flight while this one is computed
        uint4 nv[ROWS];
        const int kn = k + 32 * 32;
#pragma unroll
        for (int r = 0; r < ROWS; r++)
            nv[r] = row0 + r < N && kn < K ? *(const uint4*)(w + (size_t)(row0 + r) * rb + kn / 2)
                                           : make_uint4(0u, 0u, 0u, 0u);
        float xs[32];
        float xsum = 0.f;
        const float4* xb = xsm + (k & ~1023) / 4 + lane;
#pragma unroll
        for (int j = 0; j < 8; j++) {
            const float4 v = xb[32 * j];
            xsum += (v.x + v.y) + (v.z + v.w);
            xs[4 * j] = v.x;
            xs[4 * j + 1] = v.y * (1.f / 16.f);
            xs[4 * j + 2] = v.z * (1.f / 256.f);
            xs[4 * j + 3] = v.w * (1.f / 4096.f);
        }
#pragma unroll
        for (int r = 0; r < ROWS; r++) {
            const unsigned int wd[4] = {wv[r].x, wv[r].y, wv[r].z, wv[r].w};
            float p0 = 0.f, p1 = 0.f;
#pragma unroll
            for (int u = 0; u < 4; u++) {
                const unsigned int lo = wd[u], hi = wd[u] >> 16;
                const float* xu = xs + 8 * u;
                p0 = fmaf(nib(lo, 0x000Fu), xu[0], p0);
                p0 = fmaf(nib(lo, 0x00F0u), xu[1], p0);
                p0 = fmaf(nib(lo, 0x0F00u), xu[2], p0);
                p0 = fmaf(nib(lo, 0xF000u), xu[3], p0);
                p1 = fmaf(nib(hi, 0x000Fu), xu[4], p1);
                p1 = fmaf(nib(hi, 0x00F0u), xu[5], p1);
                p1 = fmaf(nib(hi, 0x0F00u), xu[6], p1);
                p1 = fmaf(nib(hi, 0xF000u), xu[7], p1);
            }
            const int n = min(row0 + r, N - 1);
            const int g = n * groups + k / group_size;
            const float s = load_param(scales, g, sdtype);
            const float b = load_param(biases, g, sdtype);
            acc[r] = fmaf(s, p0 + p1, fmaf(b, xsum, acc[r]));
            wv[r] = nv[r];
        }
    }
    float out[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; r++) {
        float v = acc[r];
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
        out[r] = row0 + r < N ? epilogue(v, 0, row0 + r, N, e) : 0.f;
    }
    if (e.swiglu) {
#pragma unroll
        for (int r = 0; r < ROWS; r += 2)
            if (lane == r && row0 + r < N) {
                const float g = out[r];
                y[(row0 + r) / 2] = g / (1.f + expf(-g)) * out[r + 1];
            }
    } else {
#pragma unroll
        for (int r = 0; r < ROWS; r++)
            if (lane == r && row0 + r < N) y[row0 + r] = out[r];
    }
}

#define QMV4(R)                                                                                   \
    extern "C" __global__ void qmv4_m1_r##R(const float* x, const uint8_t* w, const void* scales, \
                                            const void* biases, float* y, int N, int K,           \
                                            int group_size, int sdtype, const float* norm_w,      \
                                            float eps, Epi e) {                                   \
        qmv4<R>(x, w, scales, biases, y, N, K, group_size, sdtype, norm_w, eps, e);               \
    }
QMV4(2)
QMV4(4)

#define QMM_BM 64
#define QMM_BN 64
#define QMM_BK 32
#define QMM_PAD 4
#define QMM_THREADS 128

// Grid: (ceil(N / 64), ceil(M / 64)), 128 threads (4 warps, each 16 rows of x by 64 of W).
extern "C" __global__ void qmm_tf32(const float* __restrict__ x, const uint8_t* __restrict__ w,
                                    const void* __restrict__ scales, const void* __restrict__ biases,
                                    float* y, int M, int N, int K, int bits,
                                    int group_size, int sdtype, Epi e) {
    __shared__ __align__(32) float As[QMM_BM][QMM_BK + QMM_PAD];
    __shared__ __align__(32) float Bs[QMM_BN][QMM_BK + QMM_PAD];
    __shared__ __align__(32) float Cs[QMM_BM][QMM_BN + QMM_PAD];
    const int tid = threadIdx.x, warp = tid >> 5;
    const int n0 = blockIdx.x * QMM_BN, m0 = blockIdx.y * QMM_BM;
    const size_t row_bytes = (size_t)K * bits / 8;
    const int groups = K / group_size;

    wmma::fragment<wmma::accumulator, 16, 16, 8, float> acc[4];
#pragma unroll
    for (int j = 0; j < 4; j++) wmma::fill_fragment(acc[j], 0.f);

    for (int k0 = 0; k0 < K; k0 += QMM_BK) {
        // x tile: 64 x 32 floats, 16 per thread; rows past M are zero.
        {
            const int r = tid >> 1, c = (tid & 1) * 16;
            const int m = m0 + r;
#pragma unroll
            for (int j = 0; j < 16; j += 4) {
                float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
                if (m < M) v = *(const float4*)(x + (size_t)m * K + k0 + c + j);
                As[r][c + j] = wmma::__float_to_tf32(v.x);
                As[r][c + j + 1] = wmma::__float_to_tf32(v.y);
                As[r][c + j + 2] = wmma::__float_to_tf32(v.z);
                As[r][c + j + 3] = wmma::__float_to_tf32(v.w);
            }
        }
        // W tile: 64 rows x 32 codes, dequantized, 16 per thread; rows past N are zero.
        {
            const int r = tid >> 1, c = (tid & 1) * 16;
            const int n = n0 + r;
            float q[16];
            if (n < N) {
                unpack16(w + (size_t)n * row_bytes, k0 + c, bits, q);
                const int g = n * groups + (k0 + c) / group_size;
                const float s = load_param(scales, g, sdtype);
                const float b = load_param(biases, g, sdtype);
#pragma unroll
                for (int j = 0; j < 16; j++) Bs[r][c + j] = wmma::__float_to_tf32(fmaf(s, q[j], b));
            } else {
#pragma unroll
                for (int j = 0; j < 16; j++) Bs[r][c + j] = 0.f;
            }
        }
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < QMM_BK; kk += 8) {
            wmma::fragment<wmma::matrix_a, 16, 16, 8, wmma::precision::tf32, wmma::row_major> a;
            wmma::load_matrix_sync(a, &As[warp * 16][kk], QMM_BK + QMM_PAD);
#pragma unroll
            for (int j = 0; j < 4; j++) {
                // W is N x K row-major, i.e. the K x N operand in column-major order.
                wmma::fragment<wmma::matrix_b, 16, 16, 8, wmma::precision::tf32, wmma::col_major> b;
                wmma::load_matrix_sync(b, &Bs[j * 16][kk], QMM_BK + QMM_PAD);
                wmma::mma_sync(acc[j], a, b, acc[j]);
            }
        }
        __syncthreads();
    }
#pragma unroll
    for (int j = 0; j < 4; j++)
        wmma::store_matrix_sync(&Cs[warp * 16][j * 16], acc[j], QMM_BN + QMM_PAD, wmma::mem_row_major);
    __syncthreads();
    for (int i = tid; i < QMM_BM * QMM_BN; i += QMM_THREADS) {
        const int r = i / QMM_BN, c = i % QMM_BN;
        if (m0 + r < M && n0 + c < N)
            y[(size_t)(m0 + r) * N + n0 + c] = epilogue(Cs[r][c], m0 + r, n0 + c, N, e);
    }
}

// Rows `ids` of a quantized table, dequantized: out (L, K).
extern "C" __global__ void qgather_f32(const uint32_t* __restrict__ ids, const uint8_t* __restrict__ w,
                                       const void* __restrict__ scales, const void* __restrict__ biases,
                                       float* __restrict__ out, int K, int bits, int group_size,
                                       int sdtype) {
    const int l = blockIdx.y;
    const int k = (blockIdx.x * blockDim.x + threadIdx.x) * 16;
    if (k >= K) return;
    const uint32_t n = ids[l];
    float q[16];
    unpack16(w + (size_t)n * ((size_t)K * bits / 8), k, bits, q);
    const int g = n * (K / group_size) + k / group_size;
    const float s = load_param(scales, g, sdtype);
    const float b = load_param(biases, g, sdtype);
#pragma unroll
    for (int j = 0; j < 16; j++) out[(size_t)l * K + k + j] = fmaf(s, q[j], b);
}
