// stream-adamw device kernels: the gradient statistics pass that runs before the offloaded step.
// partial[b] = Σ g[i]² (in f64) over the elements block b visits, reduced in a fixed order (each
// thread's grid-stride elements in sequence, then flatpeak_block_sum), so the
// result is bitwise reproducible for a launch shape. A NaN or infinity anywhere makes the total
// non-finite: that is the non-finite check, at no extra cost. Requires blockDim.x to be a
// multiple of 32, at most 1024.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "flatpeak/block_reduce.cuh"

__device__ __forceinline__ float widen(float x) { return x; }
__device__ __forceinline__ float widen(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float widen(__half x) { return __half2float(x); }

template <typename G>
__device__ void grad_sq_partial(const G* __restrict__ g, unsigned long long n, double* __restrict__ partial) {
    double acc = 0.0;
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        const double x = (double)widen(g[i]);
        acc += x * x;
    }
    acc = flatpeak_block_sum(acc);
    if (threadIdx.x == 0) partial[blockIdx.x] = acc;
}

extern "C" __global__ void grad_sq_partial_f32(const float* __restrict__ g, unsigned long long n,
                                               double* __restrict__ partial) {
    grad_sq_partial(g, n, partial);
}

extern "C" __global__ void grad_sq_partial_bf16(const __nv_bfloat16* __restrict__ g, unsigned long long n,
                                                double* __restrict__ partial) {
    grad_sq_partial(g, n, partial);
}

extern "C" __global__ void grad_sq_partial_f16(const __half* __restrict__ g, unsigned long long n,
                                               double* __restrict__ partial) {
    grad_sq_partial(g, n, partial);
}
