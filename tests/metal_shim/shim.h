// Runs Metal Shading Language kernels (the subset src/engine/metal/*.metal use) as C++ on
// the CPU, so their arithmetic and indexing are tested where no Mac exists. Every lane of a
// threadgroup is a std::thread; `simd_sum` and `threadgroup_barrier` are barriers over the
// simdgroup's / threadgroup's threads; `threadgroup` arrays become function statics, which is
// threadgroup memory exactly because threadgroups run one at a time. What this cannot show:
// the Metal compiler accepting the source, GPU scheduling, and speed.
//
// With BOT_SHIM_STRICT (a compile-only build, src/engine/metal/shim.rs) the address spaces are
// distinct types: `device` memory is `volatile` and `constant` is `const volatile`, and the
// runners pass every buffer as such, so a pointer or reference parameter that lacks its address
// space, or a device pointer handed to a function that takes thread memory, fails to compile, as
// it would under the Metal compiler.
#pragma once
#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <thread>
#include <vector>

typedef uint32_t uint;
typedef uint64_t ulong;
typedef uint16_t ushort;
typedef uint8_t uchar;
typedef _Float16 half;
struct uint3 {
    uint x, y, z;
};

#define kernel
#ifdef BOT_SHIM_STRICT
#define device volatile
#define constant const volatile
#else
#define device
#define constant const
#endif
#define threadgroup static

// The vector types the kernels use, by component; a copy may be read from device memory.
struct float4 {
    float x, y, z, w;
    float4() = default;
    float4(float a, float b, float c, float d) : x(a), y(b), z(c), w(d) {}
    float4(const float4&) = default;
    float4& operator=(const float4&) = default;
    float4(const volatile float4& o) : x(o.x), y(o.y), z(o.z), w(o.w) {}
};
struct uint2 {
    uint x, y;
    uint2() = default;
    uint2(const uint2&) = default;
    uint2& operator=(const uint2&) = default;
    uint2(const volatile uint2& o) : x(o.x), y(o.y) {}
};

// Metal's math on floats (the library is compiled with fast math; the host's libm here).
inline float rsqrt(float x) { return 1.0f / std::sqrt(x); }
inline float exp(float x) { return std::exp(x); }
inline float max(float a, float b) { return std::fmax(a, b); }
inline int min(int a, int b) { return a < b ? a : b; }

template <typename T, typename U>
inline T as_type(U u) {
    static_assert(sizeof(T) == sizeof(U), "as_type needs equal sizes");
    T t;
    std::memcpy(&t, &u, sizeof(T));
    return t;
}

struct SimdGroup {
    std::barrier<> bar{32};
    float vals[32];
};
thread_local SimdGroup* t_simd = nullptr;
thread_local uint t_lane = 0;
thread_local std::barrier<>* t_tg = nullptr;

inline float simd_sum(float v) {
    t_simd->vals[t_lane] = v;
    t_simd->bar.arrive_and_wait();
    float s = 0.f;
    for (int i = 0; i < 32; i++) s += t_simd->vals[i];
    t_simd->bar.arrive_and_wait();
    return s;
}

// Metal's 8x8 simdgroup matrices, emulated: every lane holds the whole matrix (the operations
// are collective, so every lane computes the same thing); a store is written by lane 0 only.
struct simdgroup_float8x8 {
    float v[64];
};
template <typename T, int C, int R>
inline simdgroup_float8x8 make_filled_simdgroup_matrix(T value) {
    static_assert(C == 8 && R == 8, "8x8 only");
    simdgroup_float8x8 m;
    for (float& x : m.v) x = value;
    return m;
}
inline void simdgroup_load(simdgroup_float8x8& d, const float* src, ulong elements_per_row) {
    for (int r = 0; r < 8; r++)
        for (int c = 0; c < 8; c++) d.v[r * 8 + c] = src[r * elements_per_row + c];
}
inline void simdgroup_store(const simdgroup_float8x8& s, float* dst, ulong elements_per_row);
// d = a * b + c, fp32 (d may be c)
inline void simdgroup_multiply_accumulate(simdgroup_float8x8& d, const simdgroup_float8x8& a,
                                          const simdgroup_float8x8& b, const simdgroup_float8x8& c) {
    simdgroup_float8x8 out;
    for (int r = 0; r < 8; r++)
        for (int col = 0; col < 8; col++) {
            float acc = c.v[r * 8 + col];
            for (int k = 0; k < 8; k++) acc = std::fma(a.v[r * 8 + k], b.v[k * 8 + col], acc);
            out.v[r * 8 + col] = acc;
        }
    d = out;
}

enum class mem_flags { mem_none = 0, mem_device = 1, mem_threadgroup = 2 };
inline mem_flags operator|(mem_flags a, mem_flags b) { return mem_flags(int(a) | int(b)); }
inline void threadgroup_barrier(mem_flags) { t_tg->arrive_and_wait(); }

// Metal's 32-bit atomics (relaxed order is all the kernels ask for).
struct atomic_uint {
    std::atomic<uint> v;
};
enum metal_memory_order { memory_order_relaxed };
inline void atomic_store_explicit(atomic_uint* a, uint v, metal_memory_order) {
    a->v.store(v, std::memory_order_relaxed);
}
inline uint atomic_load_explicit(atomic_uint* a, metal_memory_order) {
    return a->v.load(std::memory_order_relaxed);
}
inline uint atomic_fetch_add_explicit(atomic_uint* a, uint v, metal_memory_order) {
    return a->v.fetch_add(v, std::memory_order_relaxed);
}

// metal::precise: the host's libm, the same functions Rust's f32 calls; fma is exact anywhere.
namespace precise {
inline float exp(float x) { return std::exp(x); }
inline float log(float x) { return std::log(x); }
}  // namespace precise
inline float fma(float a, float b, float c) { return std::fma(a, b, c); }

inline void simdgroup_store(const simdgroup_float8x8& s, float* dst, ulong elements_per_row) {
    if (t_lane != 0) return;
    for (int r = 0; r < 8; r++)
        for (int c = 0; c < 8; c++) dst[r * elements_per_row + c] = s.v[r * 8 + c];
}

// What one lane is told about where it is (`index`: its thread_index_in_threadgroup).
struct Lane {
    uint3 tgid, tid;
    uint simd_gid, simd_lid, index, threads;
};

// Runs `body` for every lane of every threadgroup of the grid, one threadgroup at a time: one
// thread a lane for the whole dispatch, walking the threadgroups in order, all lanes finishing
// one threadgroup (a barrier) before any starts the next, so `threadgroup` statics are never
// shared by two threadgroups.
inline void dispatch(uint3 grid, uint3 tg, const std::function<void(const Lane&)>& body) {
    const uint n = tg.x * tg.y * tg.z;
    std::barrier<> tg_bar(n), done(n);
    std::vector<SimdGroup> simds((n + 31) / 32);
    std::vector<std::thread> threads;
    for (uint i = 0; i < n; i++) {
        threads.emplace_back([&, i] {
            t_simd = &simds[i / 32];
            t_lane = i % 32;
            t_tg = &tg_bar;
            for (uint gz = 0; gz < grid.z; gz++)
                for (uint gy = 0; gy < grid.y; gy++)
                    for (uint gx = 0; gx < grid.x; gx++) {
                        Lane l{{gx, gy, gz}, {i % tg.x, (i / tg.x) % tg.y, i / (tg.x * tg.y)}, i / 32, i % 32, i, n};
                        body(l);
                        done.arrive_and_wait();
                    }
        });
    }
    for (auto& t : threads) t.join();
}
