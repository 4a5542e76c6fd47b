// Kernels for the emulator's self-test (selftest.cpp): correct ones whose results are checked,
// and deliberately broken ones that the emulator must report. Written as ordinary CUDA, compiled
// like every project kernel: g++ -x c++ -include simt_emu.hpp -I include -fsanitize=bounds.
#include <cuda_bf16.h>

// Whether the shared-memory tree below waits for every thread after each level.
enum class LevelBarrier { On, Off };

// out[blockIdx.x] = Σ x over the block's slice, by the classic shared-memory tree (blockDim.x a
// power of two, at most 256), with or without the barrier inside the loop.
template <LevelBarrier barrier>
__device__ void tree_sum(const float* __restrict__ x, unsigned n, float* __restrict__ out) {
    __shared__ float s[256];
    const unsigned t = threadIdx.x, i = blockIdx.x * blockDim.x + t;
    s[t] = i < n ? x[i] : 0.0f;
    __syncthreads();
    for (unsigned stride = blockDim.x / 2; stride > 0; stride >>= 1) {
        if (t < stride) s[t] += s[t + stride];
        if (barrier == LevelBarrier::On) __syncthreads();
    }
    if (t == 0) out[blockIdx.x] = s[0];
}

// The correct tree.
extern "C" __global__ void block_reduce_sum(const float* __restrict__ x, unsigned n,
                                            float* __restrict__ out) {
    tree_sum<LevelBarrier::On>(x, n, out);
}

// BROKEN (b): the same tree without the barrier inside the loop. A thread may read s[t + stride]
// before its owner updated it, so the result depends on the interleaving.
extern "C" __global__ void broken_reduce_nosync(const float* __restrict__ x, unsigned n,
                                                float* __restrict__ out) {
    tree_sum<LevelBarrier::Off>(x, n, out);
}

// BROKEN (a): a 32-entry tile indexed by a 64-thread block.
extern "C" __global__ void broken_oob_shared(float* out) {
    __shared__ float tile[32];
    tile[threadIdx.x] = (float)threadIdx.x;
    __syncthreads();
    out[threadIdx.x] = tile[threadIdx.x % 32];
}

// BROKEN (c): every lane of the warp shuffles under a mask naming only lanes 0-15.
extern "C" __global__ void broken_shfl_mask(float* out) {
    float v = (float)threadIdx.x;
    v += __shfl_down_sync(0x0000ffffu, v, 1);
    out[threadIdx.x] = v;
}

// BROKEN (d): a barrier only half the block reaches.
extern "C" __global__ void broken_sync_in_branch(float* out) {
    if (threadIdx.x < 16) __syncthreads();
    out[threadIdx.x] = 1.0f;
}

// BROKEN (d'): both halves reach *a* barrier, but not the same one.
extern "C" __global__ void broken_sync_divergent(float* out) {
    if (threadIdx.x < 16) {
        __syncthreads();
    } else {
        __syncthreads();
    }
    out[threadIdx.x] = 1.0f;
}

// Dynamic shared memory: reverse a block's slice through `dyn`. With `past` = 0 it stays inside
// blockDim.x floats; BROKEN (e) with `past` = 1 each thread also writes one slot further on.
extern "C" __global__ void dyn_shared_reverse(const float* __restrict__ x, float* __restrict__ out,
                                              unsigned past) {
    extern __shared__ float dyn[];
    const unsigned t = threadIdx.x;
    dyn[t + past * blockDim.x] = x[t];
    if (past) dyn[t] = x[t];
    __syncthreads();
    out[t] = dyn[blockDim.x - 1 - t];
}

// Warp intrinsic semantics: per lane, one result per intrinsic (out has 9 * blockDim.x entries).
extern "C" __global__ void warp_semantics(int* out) {
    const int lane = threadIdx.x & 31, n = blockDim.x;
    int* o = out + threadIdx.x;
    o[0 * n] = __shfl_sync(0xffffffffu, lane * 10, lane + 3, 8);    // idx, width 8, wraps in segment
    o[1 * n] = __shfl_up_sync(0xffffffffu, lane * 10, 3, 16);       // up, width 16
    o[2 * n] = __shfl_down_sync(0xffffffffu, lane * 10, 5);         // down, width 32
    o[3 * n] = __shfl_xor_sync(0xffffffffu, lane * 10, 6, 4);       // xor, width 4: 6 leaves the segment
    o[4 * n] = (int)__ballot_sync(0xffffffffu, lane % 3 == 0);
    o[5 * n] = __any_sync(0xffffffffu, lane == 7);
    o[6 * n] = __all_sync(0xffffffffu, lane < 31);
    __syncwarp();
    // Disjoint half-warp groups at the same time, each with its own mask.
    const unsigned half = lane < 16 ? 0x0000ffffu : 0xffff0000u;
    o[7 * n] = __shfl_xor_sync(half, lane, 1);
    o[8 * n] = (int)__shfl_sync(0xffffffffu, 2.5 * lane, 31 - lane);
}

// BROKEN: lanes 20-31 leave before a full-warp shuffle: a deadlock the scheduler must name.
extern "C" __global__ void broken_exit_before_shfl(float* out) {
    if ((threadIdx.x & 31) >= 20) return;
    out[threadIdx.x] = __shfl_down_sync(0xffffffffu, 1.0f, 1);
}

// BROKEN: an explicit source lane outside the mask.
extern "C" __global__ void broken_shfl_src_outside(float* out) {
    const unsigned lane = threadIdx.x & 31;
    if (lane < 16) out[lane] = __shfl_sync(0x0000ffffu, (float)lane, (int)lane + 16);
}

// 3-D indices, atomics and the barrier reductions.
extern "C" __global__ void indices_atomics(unsigned* ids, unsigned* counter, int* votes) {
    const unsigned linear = threadIdx.x + threadIdx.y * blockDim.x + threadIdx.z * blockDim.x * blockDim.y;
    const unsigned block = blockIdx.x + blockIdx.y * gridDim.x + blockIdx.z * gridDim.x * gridDim.y;
    const unsigned per_block = blockDim.x * blockDim.y * blockDim.z;
    ids[block * per_block + linear] = threadIdx.x + 100u * threadIdx.y + 10000u * threadIdx.z +
                                      1000000u * block;
    atomicAdd(counter, 1u);
    atomicMax(counter + 1, linear);
    const int even = __syncthreads_count(linear % 2 == 0);
    const int all = __syncthreads_and(linear < per_block);
    const int any = __syncthreads_or(linear == 5);
    if (linear == 0) {
        votes[3 * block] = even;
        votes[3 * block + 1] = all;
        votes[3 * block + 2] = any;
    }
}

// Partial last warp (48 threads): masks that name only existing lanes work; 0xffffffff does not.
extern "C" __global__ void partial_warp(float* out, int full_mask) {
    const unsigned lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const unsigned mask = (full_mask || warp == 0) ? 0xffffffffu : 0x0000ffffu;
    float v = (float)threadIdx.x;
    for (int off = 8; off > 0; off >>= 1) v += __shfl_down_sync(mask, v, off, 16);
    if (lane % 16 == 0) out[threadIdx.x / 16] = v;
}

// Lanes 0-15 shuffle down by 8 under mask 0x0000ffff: lanes 8-15 read lanes 16-23, outside the
// mask. The GPU gives them garbage; the emulator gives NaN so any use of it shows.
extern "C" __global__ void shfl_outside_mask_poison(float* out) {
    const unsigned lane = threadIdx.x & 31;
    if (lane < 16) out[lane] = __shfl_down_sync(0x0000ffffu, 1.0f, 8);
}
