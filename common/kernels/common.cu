// flatpeak-common device kernels: the fill, checksum and cast that GPU tests and every crate's
// device paths use. Compiled at run time by NVRTC (see src/cuda.rs) and, in CI, for sm_80 and
// sm_90 with `ptxas -v` (tests/tests/nvrtc_compile.rs).
#include <cuda_bf16.h>

// out[i] = value for i < n. Grid-stride loop: any grid covers any n.
extern "C" __global__ void fill_f32(float* __restrict__ out, float value, unsigned long long n) {
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        out[i] = value;
    }
}

// partial[b] = Σ x[i] over the elements block b visits, in a fixed order: each thread sums its
// grid-stride elements in double, the block reduces by warp shuffles then across warps.
// No atomics, so the result is bitwise reproducible for a given launch shape.
// Requires blockDim.x to be a multiple of 32 and at most 1024.
extern "C" __global__ void checksum_f32(const float* __restrict__ x, unsigned long long n,
                                        double* __restrict__ partial) {
    __shared__ double warp_sums[32];
    double acc = 0.0;
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        acc += (double)x[i];
    }
    for (int offset = 16; offset > 0; offset >>= 1) {
        acc += __shfl_down_sync(0xffffffffu, acc, offset);
    }
    const unsigned lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    if (lane == 0) warp_sums[warp] = acc;
    __syncthreads();
    if (warp == 0) {
        const unsigned n_warps = blockDim.x >> 5;
        acc = lane < n_warps ? warp_sums[lane] : 0.0;
        for (int offset = 16; offset > 0; offset >>= 1) {
            acc += __shfl_down_sync(0xffffffffu, acc, offset);
        }
        if (lane == 0) partial[blockIdx.x] = acc;
    }
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
