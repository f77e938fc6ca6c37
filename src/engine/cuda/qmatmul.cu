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
// Scales and biases arrive raw, in the file's dtype: 0 = bf16, 1 = f16, 2 = f32.

#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <mma.h>
#include <stdint.h>

using namespace nvcuda;

__device__ __forceinline__ float load_param(const void* p, int i, int dtype) {
    if (dtype == 0) {
        // bf16 is the top half of an f32
        unsigned int v = ((const unsigned short*)p)[i];
        return __uint_as_float(v << 16);
    } else if (dtype == 1) {
        return __half2float(((const __half*)p)[i]);
    }
    return ((const float*)p)[i];
}

// 16 codes starting at code index k (k % 16 == 0) of a packed row, for any width 2..8.
__device__ __forceinline__ void unpack16(const uint8_t* row, int k, int bits, float* q) {
    if (bits == 4) {
        uint2 v = *(const uint2*)(row + k / 2);
#pragma unroll
        for (int i = 0; i < 8; i++) {
            q[i] = (float)((v.x >> (4 * i)) & 15u);
            q[8 + i] = (float)((v.y >> (4 * i)) & 15u);
        }
    } else if (bits == 8) {
        uint4 v = *(const uint4*)(row + k);
        unsigned int w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int i = 0; i < 16; i++) q[i] = (float)((w[i / 4] >> (8 * (i % 4))) & 255u);
    } else {
        // 16 codes span exactly 2*bits bytes starting at byte k*bits/8.
        const uint8_t* b = row + (k / 16) * 2 * bits;
        unsigned long long lo = 0, hi = 0;
        for (int i = 0; i < 2 * bits; i++) {
            unsigned long long byte = b[i];
            if (i < 8) lo |= byte << (8 * i); else hi |= byte << (8 * (i - 8));
        }
        unsigned int mask = (1u << bits) - 1u;
        for (int i = 0; i < 16; i++) {
            int bit = i * bits;
            unsigned long long v;
            if (bit >= 64) v = hi >> (bit - 64);
            else if (bit + bits <= 64) v = lo >> bit;
            else v = (lo >> bit) | (hi << (64 - bit));
            q[i] = (float)((unsigned int)v & mask);
        }
    }
}

#define QMV_WARPS 8
#define QMV_MT 8

// x (M, K) row-major, y (M, N) row-major. Grid: ceil(N / QMV_WARPS) blocks of 32*QMV_WARPS.
extern "C" __global__ void qmv_f32(const float* __restrict__ x, const uint8_t* __restrict__ w,
                                   const void* __restrict__ scales, const void* __restrict__ biases,
                                   float* __restrict__ y, int M, int N, int K, int bits,
                                   int group_size, int sdtype) {
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
            if (lane == 0 && m < mt) y[(size_t)(m0 + m) * N + n] = v;
        }
    }
}

#define QMM_BM 64
#define QMM_BN 64
#define QMM_BK 32
#define QMM_PAD 4
#define QMM_THREADS 128

// Grid: (ceil(N / 64), ceil(M / 64)), 128 threads (4 warps, each 16 rows of x by 64 of W).
extern "C" __global__ void qmm_tf32(const float* __restrict__ x, const uint8_t* __restrict__ w,
                                    const void* __restrict__ scales, const void* __restrict__ biases,
                                    float* __restrict__ y, int M, int N, int K, int bits,
                                    int group_size, int sdtype) {
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
        if (m0 + r < M && n0 + c < N) y[(size_t)(m0 + r) * N + n0 + c] = Cs[r][c];
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
