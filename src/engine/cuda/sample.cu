// CUDA entry of the on-device sampler (kernels/sample.h): one block of up to 1024 threads reads
// the logits the head just wrote (L2-resident) and leaves only the token, its log-probability
// and a flag for the host (src/engine/cuda/fused.rs in the step's graph; src/engine/cuda/sample.rs
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
