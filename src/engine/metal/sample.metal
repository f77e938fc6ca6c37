// Metal entry of the on-device sampler: the definitions kernels/sample.h asks for, then one
// threadgroup per token (src/engine/metal_sample.rs dispatches it). At run time the Rust side
// splices kernels/sample.h in place of the #include (the Metal compiler gets one source string);
// under tests/metal_shim the #include works as it is and the shim stands in for Metal.

#ifndef BOT_METAL_SHIM
#include <metal_stdlib>
using namespace metal;
#define KSHM threadgroup
#else
#define KSHM
#endif
#define KDEV device
#define KFN inline
#define KBARRIER() threadgroup_barrier(mem_flags::mem_device | mem_flags::mem_threadgroup)

typedef ulong k_u64;

// Threadgroup memory has no 64-bit atomics on every Apple GPU: a slot is two 32-bit words, and
// an add that wraps the low word carries into the high one (each wrap is seen by exactly one
// adder, so the sum is exact).
struct KHIST {
    atomic_uint lo;
    atomic_uint hi;
};

inline void hist_clear(KSHM KHIST* h, uint b) {
    atomic_store_explicit(&h[b].lo, 0u, memory_order_relaxed);
    atomic_store_explicit(&h[b].hi, 0u, memory_order_relaxed);
}

inline void hist_add(KSHM KHIST* h, uint b, k_u64 v) {
    uint lo = uint(v);
    uint old = atomic_fetch_add_explicit(&h[b].lo, lo, memory_order_relaxed);
    uint hi = uint(v >> 32) + (old + lo < old ? 1u : 0u);
    if (hi != 0) atomic_fetch_add_explicit(&h[b].hi, hi, memory_order_relaxed);
}

inline k_u64 hist_get(KSHM KHIST* h, uint b) {
    return (k_u64(atomic_load_explicit(&h[b].hi, memory_order_relaxed)) << 32) |
           k_u64(atomic_load_explicit(&h[b].lo, memory_order_relaxed));
}

// The library is compiled with fast math off (metal::quant::pipeline), so these are not
// contracted or reordered.
typedef atomic_uint KCOUNT;
inline void count_clear(KSHM KCOUNT* c) { atomic_store_explicit(c, 0u, memory_order_relaxed); }
inline uint count_add(KSHM KCOUNT* c, uint v) {
    return atomic_fetch_add_explicit(c, v, memory_order_relaxed);
}
inline uint count_get(KSHM KCOUNT* c) { return atomic_load_explicit(c, memory_order_relaxed); }

inline float kfma(float a, float b, float c) { return fma(a, b, c); }
inline float kmul(float a, float b) { return a * b; }
inline float kadd(float a, float b) { return a + b; }
inline float klog(float x) { return precise::log(x); }
inline float krint(float x) { return rint(x); }
inline uint f2u(float v) { return as_type<uint>(v); }
inline float u2f(uint v) { return as_type<float>(v); }

#include "../kernels/sample.h"

// Mirrors engine::sample::SampleShape.
struct SampleShape {
    uint vocab;
    uint want_keep;
};

kernel void sample_f32(device const float* x_in [[buffer(0)]],
                       device float* x [[buffer(1)]],
                       constant SampleShape& shape [[buffer(2)]],
                       constant SampleParams& p [[buffer(3)]],
                       device const SampleState* st [[buffer(4)]],
                       device uint* out [[buffer(5)]],
                       device uchar* keep [[buffer(6)]],
                       uint tid [[thread_index_in_threadgroup]],
                       uint nt [[threads_per_threadgroup]]) {
    threadgroup k_u64 red[1024];
    threadgroup KHIST hist[SAMPLE_HIST_BINS];
    threadgroup uint list[SAMPLE_LIST];
    threadgroup k_u64 misc[4];
    threadgroup KCOUNT count;
    sample_block(x_in, x, shape.vocab, p, st, out, keep, shape.want_keep != 0, red, hist, list,
                 misc, &count, tid, nt);
}
