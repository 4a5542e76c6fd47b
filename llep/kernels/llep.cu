// llep device kernels: the data movement and elementwise work between the expert GEMMs of a
// dispatch round. Rows are H (or I) elements, row-major. The kernel that accumulates into rows
// that several inputs may share (duplicate token indices, one token's several routes to one
// expert) gives each thread one (destination row, column) and walks that destination's inputs
// in order, so results are bitwise reproducible and race-free without atomics.
//
// Each kernel is written once over its element types and instantiated for an f32 layer (no
// suffix) and a bf16 layer (`_bf16`; `llep_scatter_add_rows_bf16_bf16` accumulates into bf16
// rows). Every kernel loads its inputs widened to f32, computes in f32 and rounds once when it
// stores to bf16 (round to nearest even); routing weights, their gradients and the dot products
// are f32 in both. An f32 instantiation runs exactly the arithmetic of an f32-only kernel.
#include <cuda_bf16.h>

#include "flatpeak/block_reduce.cuh"

__device__ __forceinline__ float llep_load(float v) { return v; }
__device__ __forceinline__ float llep_load(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T> __device__ __forceinline__ T llep_store(float v);
template <> __device__ __forceinline__ float llep_store<float>(float v) { return v; }
template <> __device__ __forceinline__ __nv_bfloat16 llep_store<__nv_bfloat16>(float v) {
    return __float2bfloat16_rn(v);
}

// dst[r][:] = scale_r · src[index[r]][:] for r < rows (scale null: 1, a plain copy).
// Grid-stride over rows×width.
template <typename T>
__device__ __forceinline__ void llep_gather_rows_impl(const T* __restrict__ src, const unsigned* __restrict__ index,
                                                      const float* __restrict__ scale, unsigned rows,
                                                      unsigned width, T* __restrict__ dst) {
    const unsigned long long total = (unsigned long long)rows * width;
    for (unsigned long long e = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; e < total;
         e += (unsigned long long)gridDim.x * blockDim.x) {
        const unsigned r = (unsigned)(e / width), c = (unsigned)(e % width);
        const T v = src[(unsigned long long)index[r] * width + c];
        dst[e] = scale ? llep_store<T>(scale[r] * llep_load(v)) : v;
    }
}

// acc[index[r]][c] += scale_r · src[r][c] for r = 0, 1, …, rows − 1 in order (scale null: 1),
// read from the rows grouped by destination (llep's `ScatterGroups`, built on the host):
// `groups` = offsets[0..=n_groups], dests[0..n_groups], sources[0..rows]. One thread per
// (destination, column), grid-stride over n_groups × width: it walks its destination's rows in
// input order, rounding to A after each addition as a read-modify-write of acc would, so the
// result is the serial order's bit for bit; no two threads share an element (dests distinct).
template <typename S, typename A>
__device__ __forceinline__ void llep_scatter_add_rows_impl(const S* __restrict__ src,
                                                           const unsigned* __restrict__ groups,
                                                           const float* __restrict__ scale, unsigned n_groups,
                                                           unsigned width, A* __restrict__ acc) {
    const unsigned* offsets = groups;
    const unsigned* dests = groups + n_groups + 1;
    const unsigned* sources = dests + n_groups;
    const unsigned long long total = (unsigned long long)n_groups * width;
    for (unsigned long long e = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; e < total;
         e += (unsigned long long)gridDim.x * blockDim.x) {
        const unsigned g = (unsigned)(e / width), c = (unsigned)(e % width);
        A* out = &acc[(unsigned long long)dests[g] * width + c];
        float a = llep_load(*out);
        for (unsigned j = offsets[g]; j < offsets[g + 1]; ++j) {
            const unsigned r = sources[j];
            const float v = llep_load(src[(unsigned long long)r * width + c]);
            a = llep_load(llep_store<A>(a + (scale ? scale[r] * v : v)));
        }
        *out = llep_store<A>(a);
    }
}

// acc[index[r]][c] += scale_r · src[r][c] for r < rows (scale null: 1) where no two rows share a
// destination (llep's `ScatterLayout::Direct`, checked on the host): one thread per (row,
// column), grid-stride over rows × width, one addition rounded once to A per element, as the
// serial order adds it; the index is read as it is, nothing grouped or uploaded.
template <typename S, typename A>
__device__ __forceinline__ void llep_scatter_add_rows_direct_impl(const S* __restrict__ src,
                                                                  const unsigned* __restrict__ index,
                                                                  const float* __restrict__ scale, unsigned rows,
                                                                  unsigned width, A* __restrict__ acc) {
    const unsigned long long total = (unsigned long long)rows * width;
    for (unsigned long long e = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; e < total;
         e += (unsigned long long)gridDim.x * blockDim.x) {
        const unsigned r = (unsigned)(e / width), c = (unsigned)(e % width);
        A* out = &acc[(unsigned long long)index[r] * width + c];
        const float v = llep_load(src[e]);
        *out = llep_store<A>(llep_load(*out) + (scale ? scale[r] * v : v));
    }
}

__device__ __forceinline__ float llep_sigmoid(float g) { return 1.0f / (1.0f + expf(-g)); }

// The pre-activations' layout: element e = (r, c) of n (rows of `width`) reads gate at
// gu[gate_at + r·pitch + c] and up at gu[up_at + r·pitch + c]. llep's split projections: width =
// pitch = n (two contiguous blocks); torch's `gate_up_proj` in one GEMM: rows of [gate | up],
// gate_at = 0, up_at = width, pitch = 2·width. The two element sets are disjoint (checked on
// the host).
__device__ __forceinline__ unsigned long long llep_pre_at(unsigned long long e, unsigned width,
                                                          unsigned long long pitch) {
    return (e / width) * pitch + e % width;
}

// h = silu(g) ⊙ u, silu(g) = g·σ(g), over n elements (h contiguous, rows of `width`).
template <typename T>
__device__ __forceinline__ void llep_swiglu_impl(const T* __restrict__ gu, unsigned long long gate_at,
                                                 unsigned long long up_at, unsigned long long n, unsigned width,
                                                 unsigned long long pitch, T* __restrict__ h) {
    for (unsigned long long e = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; e < n;
         e += (unsigned long long)gridDim.x * blockDim.x) {
        const unsigned long long at = llep_pre_at(e, width, pitch);
        const float g = llep_load(gu[gate_at + at]);
        h[e] = llep_store<T>(g * llep_sigmoid(g) * llep_load(gu[up_at + at]));
    }
}

// From dh (contiguous, rows of `width`): dg = dh ⊙ u ⊙ silu'(g), silu'(g) = σ(g)·(1 + g·(1 − σ(g)));
// du = dh ⊙ silu(g). Written in place: gate ← dg, up ← du.
template <typename T>
__device__ __forceinline__ void llep_swiglu_backward_impl(T* __restrict__ gu, unsigned long long gate_at,
                                                          unsigned long long up_at, const T* __restrict__ dh,
                                                          unsigned long long n, unsigned width,
                                                          unsigned long long pitch) {
    for (unsigned long long e = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; e < n;
         e += (unsigned long long)gridDim.x * blockDim.x) {
        const unsigned long long at = llep_pre_at(e, width, pitch);
        const float g = llep_load(gu[gate_at + at]), u = llep_load(gu[up_at + at]), d = llep_load(dh[e]);
        const float s = llep_sigmoid(g);
        gu[gate_at + at] = llep_store<T>(d * u * (s * (1.0f + g * (1.0f - s))));
        gu[up_at + at] = llep_store<T>(d * (g * s));
    }
}

// out[r] = Σ_c a[r][c]·b[r][c] (one block per row; f64 partials in a fixed order; out f32).
// blockDim.x a multiple of 32, at most 1024.
template <typename T>
__device__ __forceinline__ void llep_row_dot_impl(const T* __restrict__ a, const T* __restrict__ b, unsigned width,
                                                  float* __restrict__ out) {
    const unsigned r = blockIdx.x;
    double acc = 0.0;
    for (unsigned c = threadIdx.x; c < width; c += blockDim.x) {
        acc += (double)llep_load(a[(unsigned long long)r * width + c]) *
               (double)llep_load(b[(unsigned long long)r * width + c]);
    }
    acc = flatpeak_block_sum(acc);
    if (threadIdx.x == 0) out[r] = (float)acc;
}

// The entry points, one per instantiation (C linkage: NVRTC and the emulator look them up by
// name), generated for each element type T by LLEP_ENTRY_POINTS(SUFFIX, T): an f32 layer has no
// suffix, a bf16 layer `_bf16`. Scatter-add accumulates T rows into f32 (`llep_scatter_add_rows`,
// `llep_scatter_add_rows_bf16`) or, for bf16, into bf16 rows (`llep_scatter_add_rows_bf16_bf16`);
// its `_direct` forms take the index of a scatter whose destinations are distinct.
#define LLEP_ENTRY_POINTS(SUFFIX, T)                                                                 \
    extern "C" __global__ void llep_gather_rows##SUFFIX(const T* __restrict__ src,                 \
                                                        const unsigned* __restrict__ index,         \
                                                        const float* __restrict__ scale, unsigned rows, \
                                                        unsigned width, T* __restrict__ dst) {      \
        llep_gather_rows_impl(src, index, scale, rows, width, dst);                                 \
    }                                                                                                \
    extern "C" __global__ void llep_swiglu##SUFFIX(const T* __restrict__ gu, unsigned long long gate_at, \
                                                   unsigned long long up_at, unsigned long long n,  \
                                                   unsigned width, unsigned long long pitch,        \
                                                   T* __restrict__ h) {                             \
        llep_swiglu_impl(gu, gate_at, up_at, n, width, pitch, h);                                    \
    }                                                                                                \
    extern "C" __global__ void llep_swiglu_backward##SUFFIX(T* __restrict__ gu, unsigned long long gate_at, \
                                                            unsigned long long up_at,               \
                                                            const T* __restrict__ dh,               \
                                                            unsigned long long n, unsigned width,   \
                                                            unsigned long long pitch) {             \
        llep_swiglu_backward_impl(gu, gate_at, up_at, dh, n, width, pitch);                          \
    }                                                                                                \
    extern "C" __global__ void llep_row_dot##SUFFIX(const T* __restrict__ a, const T* __restrict__ b, \
                                                    unsigned width, float* __restrict__ out) {      \
        llep_row_dot_impl(a, b, width, out);                                                         \
    }                                                                                                \
    extern "C" __global__ void llep_scatter_add_rows##SUFFIX(const T* __restrict__ src,            \
                                                             const unsigned* __restrict__ groups,   \
                                                             const float* __restrict__ scale,       \
                                                             unsigned n_groups, unsigned width,     \
                                                             float* __restrict__ acc) {             \
        llep_scatter_add_rows_impl(src, groups, scale, n_groups, width, acc);                        \
    }                                                                                                \
    extern "C" __global__ void llep_scatter_add_rows_direct##SUFFIX(const T* __restrict__ src,     \
                                                                    const unsigned* __restrict__ index, \
                                                                    const float* __restrict__ scale, \
                                                                    unsigned rows, unsigned width,  \
                                                                    float* __restrict__ acc) {      \
        llep_scatter_add_rows_direct_impl(src, index, scale, rows, width, acc);                      \
    }

LLEP_ENTRY_POINTS(, float)
LLEP_ENTRY_POINTS(_bf16, __nv_bfloat16)

extern "C" __global__ void llep_scatter_add_rows_bf16_bf16(const __nv_bfloat16* __restrict__ src,
                                                           const unsigned* __restrict__ groups,
                                                           const float* __restrict__ scale, unsigned n_groups,
                                                           unsigned width, __nv_bfloat16* __restrict__ acc) {
    llep_scatter_add_rows_impl(src, groups, scale, n_groups, width, acc);
}

extern "C" __global__ void llep_scatter_add_rows_direct_bf16_bf16(const __nv_bfloat16* __restrict__ src,
                                                                  const unsigned* __restrict__ index,
                                                                  const float* __restrict__ scale, unsigned rows,
                                                                  unsigned width, __nv_bfloat16* __restrict__ acc) {
    llep_scatter_add_rows_direct_impl(src, index, scale, rows, width, acc);
}
