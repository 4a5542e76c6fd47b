// Block-wide reductions shared by the workspace's kernels (embedded as an NVRTC header and found
// on the include path of the emulated build). Fixed order, no atomics: bitwise reproducible for a
// given launch shape.
#pragma once

// Σ acc over the block in f64: warp shuffles, then warp 0 adds the warp sums in warp order.
// Returns the block's sum in thread 0 (the value elsewhere is unspecified). Every thread of the
// block must call it (it contains barriers); blockDim.x must be a multiple of 32, at most 1024.
// Safe to call repeatedly: the trailing barrier keeps the next call from overwriting the warp
// sums before warp 0 has read them.
__device__ __forceinline__ double flatpeak_block_sum(double acc) {
    __shared__ double warp_sums[32];
    for (int offset = 16; offset > 0; offset >>= 1) {
        acc += __shfl_down_sync(0xffffffffu, acc, offset);
    }
    const unsigned lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    if (lane == 0) warp_sums[warp] = acc;
    __syncthreads();
    acc = 0.0;
    if (warp == 0) {
        const unsigned n_warps = blockDim.x >> 5;
        acc = lane < n_warps ? warp_sums[lane] : 0.0;
        for (int offset = 16; offset > 0; offset >>= 1) {
            acc += __shfl_down_sync(0xffffffffu, acc, offset);
        }
    }
    __syncthreads();
    return acc;
}
