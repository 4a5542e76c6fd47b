// llep device kernels: the data movement and elementwise work between the expert GEMMs of a
// dispatch round. Rows are H (or I) floats, row-major. Every kernel that accumulates into rows
// that several inputs may share (duplicate token indices, one token's several routes to one
// expert) gives each thread whole columns and walks the inputs in order, so results are
// bitwise reproducible and race-free without atomics.
#include "flatpeak/block_reduce.cuh"

// dst[r][:] = scale_r · src[index[r]][:] for r < rows (scale null: 1). Grid-stride over rows×width.
extern "C" __global__ void llep_gather_rows(const float* __restrict__ src, const unsigned* __restrict__ index,
                                            const float* __restrict__ scale, unsigned rows, unsigned width,
                                            float* __restrict__ dst) {
    const unsigned long long total = (unsigned long long)rows * width;
    for (unsigned long long e = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; e < total;
         e += (unsigned long long)gridDim.x * blockDim.x) {
        const unsigned r = (unsigned)(e / width), c = (unsigned)(e % width);
        const float v = src[(unsigned long long)index[r] * width + c];
        dst[e] = scale ? scale[r] * v : v;
    }
}

// acc[index[r]][c] += scale_r · rows[r][c] for r = 0, 1, …, rows − 1 in order (scale null: 1).
// One thread per column c: duplicate indices accumulate in input order.
extern "C" __global__ void llep_scatter_add_rows(const float* __restrict__ src, const unsigned* __restrict__ index,
                                                 const float* __restrict__ scale, unsigned rows, unsigned width,
                                                 float* __restrict__ acc) {
    for (unsigned c = blockIdx.x * blockDim.x + threadIdx.x; c < width; c += gridDim.x * blockDim.x) {
        for (unsigned r = 0; r < rows; ++r) {
            const float v = src[(unsigned long long)r * width + c];
            acc[(unsigned long long)index[r] * width + c] += scale ? scale[r] * v : v;
        }
    }
}

__device__ __forceinline__ float llep_sigmoid(float g) { return 1.0f / (1.0f + expf(-g)); }

// h = silu(g) ⊙ u, silu(g) = g·σ(g), over n elements.
extern "C" __global__ void llep_swiglu(const float* __restrict__ gate, const float* __restrict__ up,
                                       unsigned long long n, float* __restrict__ h) {
    for (unsigned long long e = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; e < n;
         e += (unsigned long long)gridDim.x * blockDim.x) {
        const float g = gate[e];
        h[e] = g * llep_sigmoid(g) * up[e];
    }
}

// From dh: dg = dh ⊙ u ⊙ silu'(g), silu'(g) = σ(g)·(1 + g·(1 − σ(g))); du = dh ⊙ silu(g).
// Written in place: gate ← dg, up ← du.
extern "C" __global__ void llep_swiglu_backward(float* __restrict__ gate, float* __restrict__ up,
                                                const float* __restrict__ dh, unsigned long long n) {
    for (unsigned long long e = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; e < n;
         e += (unsigned long long)gridDim.x * blockDim.x) {
        const float g = gate[e], u = up[e], d = dh[e];
        const float s = llep_sigmoid(g);
        gate[e] = d * u * (s * (1.0f + g * (1.0f - s)));
        up[e] = d * (g * s);
    }
}

// out[r] = Σ_c a[r][c]·b[r][c] (one block per row; f64 partials in a fixed order).
// blockDim.x a multiple of 32, at most 1024.
extern "C" __global__ void llep_row_dot(const float* __restrict__ a, const float* __restrict__ b, unsigned width,
                                        float* __restrict__ out) {
    const unsigned r = blockIdx.x;
    double acc = 0.0;
    for (unsigned c = threadIdx.x; c < width; c += blockDim.x) {
        acc += (double)a[(unsigned long long)r * width + c] * (double)b[(unsigned long long)r * width + c];
    }
    acc = flatpeak_block_sum(acc);
    if (threadIdx.x == 0) out[r] = (float)acc;
}
