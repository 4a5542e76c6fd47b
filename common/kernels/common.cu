// flatpeak-common device kernels: the fill, checksum and cast that GPU tests and every crate's
// device paths use. Compiled at run time by NVRTC (see src/cuda.rs) and, in CI, for sm_80 and
// sm_90 with `ptxas -v` (tests/tests/nvrtc_compile.rs).
#include <cuda_bf16.h>

#include "flatpeak/block_reduce.cuh"

// out[i] = value for i < n. Grid-stride loop: any grid covers any n.
extern "C" __global__ void fill_f32(float* __restrict__ out, float value, unsigned long long n) {
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        out[i] = value;
    }
}

// partial[b] = Σ x[i] over the elements block b visits, in a fixed order: each thread sums its
// grid-stride elements in double, then flatpeak_block_sum (no atomics), so the result is bitwise
// reproducible for a given launch shape. Requires blockDim.x to be a multiple of 32, ≤ 1024.
extern "C" __global__ void checksum_f32(const float* __restrict__ x, unsigned long long n,
                                        double* __restrict__ partial) {
    double acc = 0.0;
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        acc += (double)x[i];
    }
    acc = flatpeak_block_sum(acc);
    if (threadIdx.x == 0) partial[blockIdx.x] = acc;
}

// out[i] = bf16(x[i]), round to nearest even (the rounding of half::bf16::from_f32).
extern "C" __global__ void cast_f32_to_bf16(const float* __restrict__ x,
                                            __nv_bfloat16* __restrict__ out,
                                            unsigned long long n) {
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        out[i] = __float2bfloat16_rn(x[i]);
    }
}
