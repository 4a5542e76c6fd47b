// simt_emu.hpp: lets the project's CUDA kernels (*.cu) compile unmodified as host C++17 and run
// on the CPU with real barrier and warp-rendezvous semantics, so CI without a GPU executes kernel
// logic. Force-included first into every kernel translation unit:
//
//   g++ -std=c++17 -x c++ -include simt_emu.hpp -I include -fsanitize=bounds -c kernel.cu
//
// A kernel `extern "C" __global__ void k(args)` becomes a plain host function with C linkage. The
// runtime (simt_emu.cpp) runs every CUDA thread of a block as a fiber on the launching OS thread;
// the macros below read the current fiber's indices and turn barriers and warp intrinsics into
// calls that suspend the fiber until its partners arrive. Nothing here is meant to be fast.
#pragma once
#ifndef FLATPEAK_SIMT_EMU_HPP
#define FLATPEAK_SIMT_EMU_HPP

// Every standard header this file or a kernel might want is included *before* the CUDA keyword
// macros exist: libstdc++'s <memory> spells `__attribute__((__noinline__))`, which the
// `__noinline__` macro below would break if <memory> were parsed after it.
#include <float.h>
#include <limits.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <memory>
#include <type_traits>

#define FLATPEAK_EMU 1
// nvcc's `#pragma unroll` means nothing to GCC; keep -Wall kernel builds quiet about it. (GCC
// before 13 ignores this for pragmas, PR53431: pass -Wno-unknown-pragmas there.)
#pragma GCC diagnostic ignored "-Wunknown-pragmas"
// Capacity of every generated dynamic-shared array (the most an sm_90 block may opt into).
#define FLATPEAK_EMU_MAX_DYNAMIC_SHARED 232448

// ---------------------------------------------------------------------------------------------
// C ABI used by the Rust launcher (mirror these with #[repr(C)]).
extern "C" {
// Calls the kernel once, for "the current emulated thread" (whatever fiber the runtime resumed).
typedef void (*flatpeak_emu_thunk)(void* ctx);

typedef struct flatpeak_emu_config {
    unsigned grid[3];
    unsigned block[3];
    size_t dynamic_shared_bytes;
    unsigned schedule;         // 0: lowest runnable linear id runs first; 1: highest
    size_t fiber_stack_bytes;  // 0: 256 KiB
} flatpeak_emu_config;

// Return codes of flatpeak_emu_launch.
enum {
    FLATPEAK_EMU_OK = 0,
    FLATPEAK_EMU_KERNEL_FAULT = 1,  // the kernel did something a GPU would not allow
    FLATPEAK_EMU_BAD_CONFIG = 2,    // the launch itself is invalid (shape, shared size, nesting)
    FLATPEAK_EMU_NO_MEMORY = 3,     // fiber stacks could not be mapped
};

// Runs the whole grid on the calling OS thread; blocks in linear order. On a nonzero return a
// NUL-terminated message is written to `message` (truncated to `message_capacity`).
int flatpeak_emu_launch(const flatpeak_emu_config* cfg, flatpeak_emu_thunk thunk, void* ctx,
                        char* message, size_t message_capacity);

// Dynamic shared memory: the build script generates, per `extern __shared__ T name[];`,
//   __attribute__((weak)) alignas(16) thread_local T name[FLATPEAK_EMU_MAX_DYNAMIC_SHARED / sizeof(T)];
// (weak: two crates' kernels may both name their array `smem`; one definition serves both) and
// a visitor registered from a static constructor:
//   static void regions(void (*visit)(void*, size_t)) { visit(name, sizeof name); ... }
//   __attribute__((constructor)) static void add() { flatpeak_emu_add_dynamic_shared_visitor(regions); }
// At each launch the runtime calls every registered visitor, on the launching OS thread (the
// arrays are per OS thread), with flatpeak_emu_register_dynamic_shared as `visit`.
void flatpeak_emu_register_dynamic_shared(void* base, size_t capacity_bytes);
void flatpeak_emu_add_dynamic_shared_visitor(void (*regions)(void (*visit)(void* base, size_t capacity_bytes)));
}

// ---------------------------------------------------------------------------------------------
// CUDA keywords. `__shared__` is `thread_local`: at block scope that implies static storage, and
// `extern thread_local T x[];` is a valid block-scope declaration, so both static and dynamic
// shared arrays compile. All fibers of a block run on one OS thread and so share the storage,
// which is exactly block-shared semantics; concurrent launches on other OS threads get their own.
#define __global__
#define __device__
#define __host__
#define __constant__
#define __managed__
#define __grid_constant__
#define __shared__ thread_local
#define __forceinline__ inline
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __restrict__ __restrict
// A GNU attribute may sit among decl-specifiers (`extern __shared__ __align__(16) char s[];`),
// where a standard alignas may not.
#define __align__(n) __attribute__((aligned(n)))

// ---------------------------------------------------------------------------------------------
// Vector and index types.
struct uint3 { unsigned x, y, z; };
struct dim3 {
    unsigned x, y, z;
    constexpr dim3(unsigned vx = 1, unsigned vy = 1, unsigned vz = 1) : x(vx), y(vy), z(vz) {}
    constexpr dim3(uint3 v) : x(v.x), y(v.y), z(v.z) {}
    constexpr operator uint3() const { return uint3{x, y, z}; }
};
struct alignas(8) float2 { float x, y; };
struct float3 { float x, y, z; };
struct alignas(16) float4 { float x, y, z, w; };
struct alignas(16) double2 { double x, y; };
struct alignas(8) int2 { int x, y; };
struct alignas(16) int4 { int x, y, z, w; };
struct alignas(8) uint2 { unsigned x, y; };
struct alignas(16) uint4 { unsigned x, y, z, w; };
inline float2 make_float2(float x, float y) { return {x, y}; }
inline float3 make_float3(float x, float y, float z) { return {x, y, z}; }
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
inline double2 make_double2(double x, double y) { return {x, y}; }
inline int2 make_int2(int x, int y) { return {x, y}; }
inline int4 make_int4(int x, int y, int z, int w) { return {x, y, z, w}; }
inline uint2 make_uint2(unsigned x, unsigned y) { return {x, y}; }
inline uint3 make_uint3(unsigned x, unsigned y, unsigned z) { return {x, y, z}; }
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }

static constexpr int warpSize = 32;

namespace flatpeak_emu {

// The indices of the fiber that is running now; the runtime repoints it at every switch.
struct ThreadCtx {
    uint3 thread_idx, block_idx;
    dim3 block_dim, grid_dim;
};
extern __thread ThreadCtx* tls_thread;
[[noreturn]] void not_in_launch(const char* what);

inline ThreadCtx& current_thread() {
    ThreadCtx* t = tls_thread;
    if (!t) not_in_launch("threadIdx/blockIdx/blockDim/gridDim");
    return *t;
}

// Where a barrier or warp intrinsic was called, so divergence can be reported with a location.
struct Site {
    const char* file;
    int line;
};

enum class WarpOp : uint8_t { SyncWarp, Shfl, ShflUp, ShflDown, ShflXor, Ballot, Any, All };
enum class ValueKind : uint8_t { None, Int, Float };  // Float: a poisoned read yields a NaN
enum class BarrierMode : uint8_t { Plain, Count, And, Or };

// One lane's arrival at a warp rendezvous; returns this lane's result (raw bits, low bytes).
uint64_t warp_op(Site site, WarpOp op, unsigned mask, uint64_t bits, unsigned bytes,
                 ValueKind kind, int param, int width);
int block_barrier(Site site, int pred, BarrierMode mode);

template <class T> struct value_kind {
    static constexpr ValueKind value = std::is_floating_point<T>::value ? ValueKind::Float
                                                                        : ValueKind::Int;
};

template <class T> inline uint64_t to_bits(const T& v) {
    static_assert(std::is_trivially_copyable<T>::value && sizeof(T) <= 8,
                  "warp shuffles move at most 8 trivially copyable bytes");
    uint64_t b = 0;
    memcpy(&b, &v, sizeof(T));  // little-endian hosts only (x86-64, aarch64)
    return b;
}
template <class T> inline T from_bits(uint64_t b) {
    T v;
    memcpy(&v, &b, sizeof(T));
    return v;
}

// The intrinsics are function objects built by object-like macros, so `__LINE__` is the line of
// the call and optional CUDA arguments (`__syncwarp()` vs `__syncwarp(m)`) keep their defaults.
template <WarpOp Op> struct Shuffle {
    Site site;
    template <class T> T operator()(unsigned mask, T var, int lane_arg, int width = warpSize) const {
        return from_bits<T>(warp_op(site, Op, mask, to_bits(var), sizeof(T), value_kind<T>::value,
                                    lane_arg, width));
    }
};
template <WarpOp Op> struct Vote {
    Site site;
    auto operator()(unsigned mask, int pred) const {
        const uint64_t r = warp_op(site, Op, mask, pred != 0, 0, ValueKind::None, 0, warpSize);
        if constexpr (Op == WarpOp::Ballot) return (unsigned)r;
        else return (int)r;
    }
};
struct SyncWarp {
    Site site;
    void operator()(unsigned mask = 0xffffffffu) const {
        warp_op(site, WarpOp::SyncWarp, mask, 0, 0, ValueKind::None, 0, warpSize);
    }
};
template <BarrierMode Mode> struct SyncThreads {
    Site site;
    void operator()() const { block_barrier(site, 0, Mode); }
    int operator()(int pred) const { return block_barrier(site, pred, Mode); }
};

}  // namespace flatpeak_emu

#define threadIdx (::flatpeak_emu::current_thread().thread_idx)
#define blockIdx (::flatpeak_emu::current_thread().block_idx)
#define blockDim (::flatpeak_emu::current_thread().block_dim)
#define gridDim (::flatpeak_emu::current_thread().grid_dim)

#define FLATPEAK_EMU_SITE ::flatpeak_emu::Site{__FILE__, __LINE__}
#define __syncthreads ::flatpeak_emu::SyncThreads<::flatpeak_emu::BarrierMode::Plain>{FLATPEAK_EMU_SITE}
#define __syncthreads_count ::flatpeak_emu::SyncThreads<::flatpeak_emu::BarrierMode::Count>{FLATPEAK_EMU_SITE}
#define __syncthreads_and ::flatpeak_emu::SyncThreads<::flatpeak_emu::BarrierMode::And>{FLATPEAK_EMU_SITE}
#define __syncthreads_or ::flatpeak_emu::SyncThreads<::flatpeak_emu::BarrierMode::Or>{FLATPEAK_EMU_SITE}
#define __syncwarp ::flatpeak_emu::SyncWarp{FLATPEAK_EMU_SITE}
#define __shfl_sync ::flatpeak_emu::Shuffle<::flatpeak_emu::WarpOp::Shfl>{FLATPEAK_EMU_SITE}
#define __shfl_up_sync ::flatpeak_emu::Shuffle<::flatpeak_emu::WarpOp::ShflUp>{FLATPEAK_EMU_SITE}
#define __shfl_down_sync ::flatpeak_emu::Shuffle<::flatpeak_emu::WarpOp::ShflDown>{FLATPEAK_EMU_SITE}
#define __shfl_xor_sync ::flatpeak_emu::Shuffle<::flatpeak_emu::WarpOp::ShflXor>{FLATPEAK_EMU_SITE}
#define __ballot_sync ::flatpeak_emu::Vote<::flatpeak_emu::WarpOp::Ballot>{FLATPEAK_EMU_SITE}
#define __any_sync ::flatpeak_emu::Vote<::flatpeak_emu::WarpOp::Any>{FLATPEAK_EMU_SITE}
#define __all_sync ::flatpeak_emu::Vote<::flatpeak_emu::WarpOp::All>{FLATPEAK_EMU_SITE}

// Fences order memory for other threads; with one OS thread per launch every store is already
// visible to every later-resumed fiber.
inline void __threadfence() {}
inline void __threadfence_block() {}
inline void __threadfence_system() {}

// ---------------------------------------------------------------------------------------------
// Atomics. Fibers are cooperative on one OS thread and blocks run one after another, so a plain
// read-modify-write returning the old value is atomic. Integer arithmetic wraps as on the GPU.
#define FLATPEAK_EMU_RMW(name, T, expr)            \
    inline T name(T* address, T val) {             \
        const T old = *address;                    \
        *address = (expr);                         \
        return old;                                \
    }
FLATPEAK_EMU_RMW(atomicAdd, int, (int)((unsigned)old + (unsigned)val))
FLATPEAK_EMU_RMW(atomicAdd, unsigned, old + val)
FLATPEAK_EMU_RMW(atomicAdd, unsigned long long, old + val)
FLATPEAK_EMU_RMW(atomicAdd, float, old + val)
FLATPEAK_EMU_RMW(atomicAdd, double, old + val)
FLATPEAK_EMU_RMW(atomicSub, int, (int)((unsigned)old - (unsigned)val))
FLATPEAK_EMU_RMW(atomicSub, unsigned, old - val)
FLATPEAK_EMU_RMW(atomicMax, int, old > val ? old : val)
FLATPEAK_EMU_RMW(atomicMax, unsigned, old > val ? old : val)
FLATPEAK_EMU_RMW(atomicMax, long long, old > val ? old : val)
FLATPEAK_EMU_RMW(atomicMax, unsigned long long, old > val ? old : val)
FLATPEAK_EMU_RMW(atomicMin, int, old < val ? old : val)
FLATPEAK_EMU_RMW(atomicMin, unsigned, old < val ? old : val)
FLATPEAK_EMU_RMW(atomicMin, long long, old < val ? old : val)
FLATPEAK_EMU_RMW(atomicMin, unsigned long long, old < val ? old : val)
FLATPEAK_EMU_RMW(atomicExch, int, val)
FLATPEAK_EMU_RMW(atomicExch, unsigned, val)
FLATPEAK_EMU_RMW(atomicExch, unsigned long long, val)
FLATPEAK_EMU_RMW(atomicExch, float, val)
FLATPEAK_EMU_RMW(atomicAnd, int, old & val)
FLATPEAK_EMU_RMW(atomicAnd, unsigned, old & val)
FLATPEAK_EMU_RMW(atomicAnd, unsigned long long, old & val)
FLATPEAK_EMU_RMW(atomicOr, int, old | val)
FLATPEAK_EMU_RMW(atomicOr, unsigned, old | val)
FLATPEAK_EMU_RMW(atomicOr, unsigned long long, old | val)
FLATPEAK_EMU_RMW(atomicXor, int, old ^ val)
FLATPEAK_EMU_RMW(atomicXor, unsigned, old ^ val)
FLATPEAK_EMU_RMW(atomicXor, unsigned long long, old ^ val)
FLATPEAK_EMU_RMW(atomicInc, unsigned, old >= val ? 0u : old + 1u)
FLATPEAK_EMU_RMW(atomicDec, unsigned, (old == 0u || old > val) ? val : old - 1u)
#undef FLATPEAK_EMU_RMW
#define FLATPEAK_EMU_CAS(T)                                 \
    inline T atomicCAS(T* address, T compare, T val) {      \
        const T old = *address;                             \
        if (old == compare) *address = val;                 \
        return old;                                         \
    }
FLATPEAK_EMU_CAS(int)
FLATPEAK_EMU_CAS(unsigned)
FLATPEAK_EMU_CAS(unsigned long long)
#undef FLATPEAK_EMU_CAS

// ---------------------------------------------------------------------------------------------
// Loads, bit casts, integer intrinsics.
template <class T> inline T __ldg(const T* p) { return *p; }
template <class T> inline T __ldcg(const T* p) { return *p; }
template <class T> inline T __ldcs(const T* p) { return *p; }
template <class T> inline void __stcg(T* p, T v) { *p = v; }
template <class T> inline void __stcs(T* p, T v) { *p = v; }

inline float __int_as_float(int v) { return flatpeak_emu::from_bits<float>((uint32_t)v); }
inline float __uint_as_float(unsigned v) { return flatpeak_emu::from_bits<float>(v); }
inline int __float_as_int(float v) { return (int)(uint32_t)flatpeak_emu::to_bits(v); }
inline unsigned __float_as_uint(float v) { return (uint32_t)flatpeak_emu::to_bits(v); }
inline double __longlong_as_double(long long v) {
    return flatpeak_emu::from_bits<double>((uint64_t)v);
}
inline long long __double_as_longlong(double v) { return (long long)flatpeak_emu::to_bits(v); }
inline int __popc(unsigned v) { return __builtin_popcount(v); }
inline int __popcll(unsigned long long v) { return __builtin_popcountll(v); }
inline int __clz(int v) { return v == 0 ? 32 : __builtin_clz((unsigned)v); }
inline int __clzll(long long v) { return v == 0 ? 64 : __builtin_clzll((unsigned long long)v); }
inline int __ffs(int v) { return __builtin_ffs(v); }
inline int __ffsll(long long v) { return __builtin_ffsll(v); }
inline unsigned __brev(unsigned v) {
    unsigned r = 0;
    for (int i = 0; i < 32; ++i) r |= ((v >> i) & 1u) << (31 - i);
    return r;
}

// ---------------------------------------------------------------------------------------------
// Math. The `__` fast-math forms are exact-ish here but approximate on the GPU: compare results
// with a tolerance, never bitwise, when a kernel uses them.
inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
inline double rsqrt(double x) { return 1.0 / sqrt(x); }
inline float __expf(float x) { return expf(x); }
inline float __logf(float x) { return logf(x); }
inline float __powf(float x, float y) { return powf(x, y); }
inline float __sinf(float x) { return sinf(x); }
inline float __cosf(float x) { return cosf(x); }
inline float __tanf(float x) { return tanf(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float __frcp_rn(float x) { return 1.0f / x; }
inline float __fsqrt_rn(float x) { return sqrtf(x); }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
inline double __fma_rn(double a, double b, double c) { return fma(a, b, c); }
inline float __saturatef(float x) { return x > 0.0f ? (x < 1.0f ? x : 1.0f) : 0.0f; }  // NaN -> 0
inline int __float2int_rn(float x) { return (int)nearbyintf(x); }
inline int __float2int_rz(float x) { return (int)x; }
inline unsigned __float2uint_rn(float x) { return (unsigned)nearbyintf(x); }
inline long long __float2ll_rn(float x) { return (long long)nearbyintf(x); }

// CUDA's integer and mixed-type min/max live in the global namespace.
#define FLATPEAK_EMU_MINMAX(R, A, B)                              \
    inline R max(A a, B b) { return (R)a > (R)b ? (R)a : (R)b; }  \
    inline R min(A a, B b) { return (R)a < (R)b ? (R)a : (R)b; }
FLATPEAK_EMU_MINMAX(int, int, int)
FLATPEAK_EMU_MINMAX(unsigned, unsigned, unsigned)
FLATPEAK_EMU_MINMAX(unsigned, int, unsigned)
FLATPEAK_EMU_MINMAX(unsigned, unsigned, int)
FLATPEAK_EMU_MINMAX(long, long, long)
FLATPEAK_EMU_MINMAX(unsigned long, unsigned long, unsigned long)
FLATPEAK_EMU_MINMAX(long long, long long, long long)
FLATPEAK_EMU_MINMAX(unsigned long long, unsigned long long, unsigned long long)
FLATPEAK_EMU_MINMAX(unsigned long long, long long, unsigned long long)
FLATPEAK_EMU_MINMAX(unsigned long long, unsigned long long, long long)
#undef FLATPEAK_EMU_MINMAX
inline float max(float a, float b) { return fmaxf(a, b); }
inline float min(float a, float b) { return fminf(a, b); }
inline double max(double a, double b) { return fmax(a, b); }
inline double min(double a, double b) { return fmin(a, b); }
inline double max(float a, double b) { return fmax(a, b); }
inline double min(float a, double b) { return fmin(a, b); }
inline double max(double a, float b) { return fmax(a, b); }
inline double min(double a, float b) { return fmin(a, b); }

// ---------------------------------------------------------------------------------------------
// bfloat16 and binary16: 16-bit storage with the device's conversions (round to nearest even).
namespace flatpeak_emu {

// NaN stays a quiet NaN with its sign and top payload bits (as half::bf16::from_f32 does; the
// GPU instruction returns the canonical 0x7fff instead, so never compare NaN bit patterns).
inline uint16_t f32_to_bf16_rn(float f) {
    uint32_t x = (uint32_t)to_bits(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x0040u);
    x += 0x7fffu + ((x >> 16) & 1u);  // cannot wrap: the largest input is -inf
    return (uint16_t)(x >> 16);
}
inline uint16_t f32_to_bf16_rz(float f) {
    const uint32_t x = (uint32_t)to_bits(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x0040u);
    return (uint16_t)(x >> 16);
}
inline float bf16_to_f32(uint16_t h) { return from_bits<float>((uint32_t)h << 16); }

// IEEE binary16, round to nearest even, with subnormals; overflow rounds to infinity.
inline uint16_t f32_to_f16_rn(float f) {
    const uint32_t x = (uint32_t)to_bits(f);
    const uint32_t sign = (x >> 16) & 0x8000u, exp = (x >> 23) & 0xffu, man = x & 0x7fffffu;
    if (exp == 0xffu) return (uint16_t)(sign | 0x7c00u | (man ? 0x0200u | (man >> 13) : 0u));
    const int half_exp = (int)exp - 127 + 15;
    if (half_exp >= 31) return (uint16_t)(sign | 0x7c00u);
    if (half_exp <= 0) {
        const int shift = 14 - half_exp;  // 24 significant bits down to a subnormal's 10
        if (shift > 24) return (uint16_t)sign;  // below half the smallest subnormal
        const uint32_t full = man | 0x800000u;
        uint32_t r = full >> shift;
        const uint32_t round = (full >> (shift - 1)) & 1u, sticky = full & ((1u << (shift - 1)) - 1u);
        if (round && (sticky || (r & 1u))) ++r;  // a carry into 0x400 is the smallest normal
        return (uint16_t)(sign | r);
    }
    uint32_t r = ((uint32_t)half_exp << 10) | (man >> 13);
    const uint32_t round = (man >> 12) & 1u, sticky = man & 0xfffu;
    if (round && (sticky || (r & 1u))) ++r;  // a carry may reach 0x7c00: infinity, as it should
    return (uint16_t)(sign | r);
}
inline float f16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    if (exp == 0) {
        const float v = (float)man * 0x1p-24f;  // exact
        return sign ? -v : v;
    }
    if (exp == 0x1fu) return from_bits<float>(sign | 0x7f800000u | (man ? 0x400000u | (man << 13) : 0u));
    return from_bits<float>(sign | ((exp + 112u) << 23) | (man << 13));
}

}  // namespace flatpeak_emu

struct __nv_bfloat16 {
    unsigned short __x;
    __nv_bfloat16() = default;
    __nv_bfloat16(float f) : __x(flatpeak_emu::f32_to_bf16_rn(f)) {}
    operator float() const { return flatpeak_emu::bf16_to_f32(__x); }
};
struct __half {
    unsigned short __x;
    __half() = default;
    __half(float f) : __x(flatpeak_emu::f32_to_f16_rn(f)) {}
    operator float() const { return flatpeak_emu::f16_to_f32(__x); }
};
static_assert(sizeof(__nv_bfloat16) == 2 && std::is_trivially_copyable<__nv_bfloat16>::value, "");
static_assert(sizeof(__half) == 2 && std::is_trivially_copyable<__half>::value, "");
typedef __nv_bfloat16 nv_bfloat16;
typedef __half half;
namespace flatpeak_emu {
template <> struct value_kind<__nv_bfloat16> { static constexpr ValueKind value = ValueKind::Float; };
template <> struct value_kind<__half> { static constexpr ValueKind value = ValueKind::Float; };
}  // namespace flatpeak_emu

inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short u) { __nv_bfloat16 h; h.__x = u; return h; }
inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 h) { return h.__x; }
inline __half __ushort_as_half(unsigned short u) { __half h; h.__x = u; return h; }
inline unsigned short __half_as_ushort(__half h) { return h.__x; }
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
    return __ushort_as_bfloat16(flatpeak_emu::f32_to_bf16_rn(f));
}
inline __nv_bfloat16 __float2bfloat16(float f) { return __float2bfloat16_rn(f); }
inline __nv_bfloat16 __float2bfloat16_rz(float f) {
    return __ushort_as_bfloat16(flatpeak_emu::f32_to_bf16_rz(f));
}
inline float __bfloat162float(__nv_bfloat16 h) { return flatpeak_emu::bf16_to_f32(h.__x); }
inline __half __float2half_rn(float f) { return __ushort_as_half(flatpeak_emu::f32_to_f16_rn(f)); }
inline __half __float2half(float f) { return __float2half_rn(f); }
inline float __half2float(__half h) { return flatpeak_emu::f16_to_f32(h.__x); }

#endif  // FLATPEAK_SIMT_EMU_HPP
