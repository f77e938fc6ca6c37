// Helpers shared by the CUDA kernels: reading MLX's group scales/biases in their stored dtype,
// unpacking 16 codes of a packed row, and the epilogue applied to each output element.
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <stdint.h>

// Programmatic dependent launch (sm_90 and newer): the fused step launches each kernel allowed
// to start while its predecessor still runs (`cuda_fused.rs`), so a kernel's launch and its
// first weight loads overlap the previous kernel's tail. Before `pdl_wait()` a kernel may only
// read what no kernel writes (weights); after it, everything earlier kernels wrote is visible
// and nothing they read is still being read. Every kernel calls `pdl_wait()` in every block
// (a grid's completion then implies its predecessor's). Launched without the attribute, or
// built for an older architecture, both are no-ops.
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
// Asks L2 for the 128-byte line holding p, without waiting for it: what a kernel will read and
// no earlier kernel writes can be fetched before `pdl_wait()`, while the previous kernel runs.
__device__ __forceinline__ void prefetch_line(const void* p) {
    asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}
// The entry of a kernel with nothing to do before its inputs are ready.
#define PDL_ENTRY() \
    do {            \
        pdl_trigger(); \
        pdl_wait();    \
    } while (0)

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

// What happens to an output element after the matmul: an optional LoRA term and an optional
// residual, in mlx_lm's order (base + lora, then residual + that). `lora_bt` is the B matrix
// transposed and pre-multiplied by the adapter scale, one row of `r` values per output; outputs
// [0, seg1) use t's first r columns, [seg1, seg2) the next r, the rest the third (q|k|v is one
// matmul over concatenated weights); with `pairs`, even outputs use the first r and odd ones the
// next (gate|up, whose rows are interleaved). `residual` may alias y. `swiglu` is read by the
// decode kernel only: y gets silu(even) * odd per pair of outputs.
//
// `feed_*`, `fed_*` (the 4-bit decode kernel only): LoRA A products made by the kernel that
// writes a projection's input instead of by a `lora_a_f32` launch between the two. The producer
// reads `feed_at` (N_y, feed_r), the next projection's A transposed (times the weight of its
// input RMSNorm, if any), and each block adds its sums of y · feed_at over its outputs y into
// `feed_acc` (feed_r words, zeroed before), in fixed point: integer sums do not depend on the
// blocks' order, so t is the same bits on every run. The consumer reads `fed_acc` (rtot
// words), times its own norm's row scale, as its `lora_t`.
struct Epi {
    const float* residual;
    const float* lora_t;
    const float* lora_bt;
    int r, rtot, seg1, seg2, pairs, swiglu;
    const float* feed_at;
    unsigned long long* feed_acc;
    const long long* fed_acc;
    int feed_r, pad_;
};

// One in `Epi::feed_acc`'s fixed point: 2^-32 resolution; t, and each block's share of it, must
// stay under 2^31 in size (the words would wrap).
#define FEED_ONE 4294967296.f

// Which part's adapter (0, 1 or 2: t's r-wide slices) output n takes.
__device__ __forceinline__ int lora_seg(int n, const Epi& e) {
    return e.pairs ? (n & 1) : (n >= e.seg1) + (n >= e.seg2);
}

__device__ __forceinline__ float epilogue(float v, int m, int n, int N, const Epi& e) {
    if (e.lora_t) {
        const int seg = lora_seg(n, e);
        const float* t = e.lora_t + (size_t)m * e.rtot + seg * e.r;
        const float* b = e.lora_bt + (size_t)n * e.r;
        float s = 0.f;
        for (int j = 0; j < e.r; j++) s = fmaf(t[j], b[j], s);
        v += s;
    }
    if (e.residual) v = e.residual[(size_t)m * N + n] + v;
    return v;
}
