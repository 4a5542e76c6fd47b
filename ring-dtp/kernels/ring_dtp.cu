// ring-dtp device kernels: everything between the cuBLAS GEMMs of one (token block, vocabulary
// block) step. The logits block is token-major, C rows of Vb columns (row k = token t0 + k,
// column j = vocabulary row v0 + j), exactly as the GEMM wrote it: u = x·wᵀ, not yet biased or
// capped. One thread block per token row; blockDim.x a multiple of 32, at most 1024. Reductions
// are in a fixed order (thread-strided partials, then warp shuffles, then warps in order), so
// results are bitwise reproducible for a launch shape.
#include <cuda_bf16.h>

#include "flatpeak/block_reduce.cuh"

#define LCE_NO_TARGET 0xffffffffu
#define LCE_NEG_INF __int_as_float((int)0xff800000u)

// z = softcap(u + bias_j); softcap <= 0 means off.
__device__ __forceinline__ float lce_logit(float u, const float* __restrict__ bias, unsigned j, float softcap) {
    float z = bias ? u + bias[j] : u;
    return softcap > 0.0f ? softcap * tanhf(z / softcap) : z;
}

// dz/du of the softcap at the capped logit z: 1 − (z/cap)².
__device__ __forceinline__ float lce_softcap_derivative(float z, float softcap) {
    if (softcap <= 0.0f) return 1.0f;
    const float t = z / softcap;
    return 1.0f - t * t;
}

// Max over the block; the result is returned to every thread.
__device__ __forceinline__ float lce_block_max(float x) {
    __shared__ float warp_max[32];
    __shared__ float result;
    for (int offset = 16; offset > 0; offset >>= 1) {
        x = fmaxf(x, __shfl_down_sync(0xffffffffu, x, offset));
    }
    const unsigned lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    if (lane == 0) warp_max[warp] = x;
    __syncthreads();
    if (warp == 0) {
        const unsigned n_warps = blockDim.x >> 5;
        x = lane < n_warps ? warp_max[lane] : LCE_NEG_INF;
        for (int offset = 16; offset > 0; offset >>= 1) {
            x = fmaxf(x, __shfl_down_sync(0xffffffffu, x, offset));
        }
        if (lane == 0) result = x;
    }
    __syncthreads();
    const float out = result;
    __syncthreads();
    return out;
}

// The target of row i: targets[i + shift] when i + shift < n_targets and it is not
// ignore_index, else none. Every target in 0..n_targets is checked: one outside 0..V that is not
// ignore_index lowers *first_bad to its index (atomicMin: the smallest bad index, whatever the
// schedule). resolved[i] for i < n rows. Grid-stride over max(n, n_targets).
extern "C" __global__ void lce_resolve_targets(const long long* __restrict__ targets,
                                               unsigned long long n_targets, unsigned long long n,
                                               unsigned long long shift, long long ignore_index,
                                               unsigned long long vocab, unsigned* __restrict__ resolved,
                                               unsigned long long* __restrict__ first_bad) {
    const unsigned long long total = n > n_targets ? n : n_targets;
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < total;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        if (i < n_targets) {
            const long long t = targets[i];
            if (t != ignore_index && (t < 0 || (unsigned long long)t >= vocab)) atomicMin(first_bad, i);
        }
        if (i < n) {
            unsigned r = LCE_NO_TARGET;
            // Compared without forming i + shift, which would wrap for a shift near 2^64.
            if (shift < n_targets && i < n_targets - shift) {
                const long long t = targets[i + shift];
                if (t != ignore_index && t >= 0 && (unsigned long long)t < vocab) r = (unsigned)t;
            }
            resolved[i] = r;
        }
    }
}

// Whether row pointer `row` of a block vb wide takes 16-byte loads: vb a multiple of 4 and the
// row 16-byte aligned (the block buffer is carved at 256 bytes, so every row is when vb is).
__device__ __forceinline__ bool lce_vectorized(const float* row, unsigned vb) {
    return (vb & 3u) == 0 && ((unsigned long long)row & 15ull) == 0;
}

// One logit into a thread's online statistics: m its running max, s = Σ e^(z − m) (f64) over
// the logits it saw. A larger z rescales s once; −∞ adds nothing; NaN propagates into s.
__device__ __forceinline__ void lce_online(float z, float& m, double& s) {
    if (z > m) {
        s = s * (double)expf(m - z) + 1.0;
        m = z;
    } else if (z != LCE_NEG_INF) {
        s += (double)expf(z - m);
    }
}

// Folds a raw logits block into the rows' running statistics (block b = row k, grid = C) in one
// read of the row (16-byte loads where `lce_vectorized`): each thread keeps an online (max, sum)
// over its logits, z = softcap(u + bias); then M' = max(M, max_j z) and
// S' = S·e^(M − M') + Σ_threads s_t·e^(m_t − M') (f64, threads in a fixed order); the target
// logit when the row's target lies in v0..v0+vb; Σ_j z_j (f64) when `smoothing`.
extern "C" __global__ void lce_fold(const float* __restrict__ logits, unsigned vb, unsigned v0,
                                    const float* __restrict__ bias, float softcap,
                                    const unsigned* __restrict__ targets, float* __restrict__ row_max,
                                    double* __restrict__ row_sum, float* __restrict__ target_logit,
                                    double* __restrict__ logit_sum, int smoothing) {
    const unsigned k = blockIdx.x;
    const float* row = logits + (unsigned long long)k * vb;
    float m = LCE_NEG_INF;
    double s = 0.0, zs = 0.0;
    if (lce_vectorized(row, vb)) {
        const float4* row4 = reinterpret_cast<const float4*>(row);
        for (unsigned q = threadIdx.x; q < vb / 4; q += blockDim.x) {
            const float4 u = row4[q];
            const float z[4] = {lce_logit(u.x, bias, 4 * q, softcap), lce_logit(u.y, bias, 4 * q + 1, softcap),
                                lce_logit(u.z, bias, 4 * q + 2, softcap), lce_logit(u.w, bias, 4 * q + 3, softcap)};
            for (int e = 0; e < 4; ++e) {
                lce_online(z[e], m, s);
                zs += (double)z[e];
            }
        }
    } else {
        for (unsigned j = threadIdx.x; j < vb; j += blockDim.x) {
            const float z = lce_logit(row[j], bias, j, softcap);
            lce_online(z, m, s);
            zs += (double)z;
        }
    }
    const float m_old = row_max[k];
    const float m_new = fmaxf(m_old, lce_block_max(m));
    // A thread that saw only −∞ (or nothing) holds s = 0; NaN stays NaN.
    s = flatpeak_block_sum(s > 0.0 ? s * exp((double)m - (double)m_new) : s);
    if (smoothing) zs = flatpeak_block_sum(zs);
    if (threadIdx.x == 0) {
        const unsigned y = targets[k];
        if (y != LCE_NO_TARGET && y >= v0 && y - v0 < vb) target_logit[k] = lce_logit(row[y - v0], bias, y - v0, softcap);
        double run = row_sum[k];
        if (run > 0.0) run *= exp((double)(m_old - m_new));
        row_sum[k] = run + s;
        row_max[k] = m_new;
        if (smoothing) logit_sum[k] += zs;
    }
}

// lse[k] = float(M_k + ln S_k) in f64 from a token block's finished statistics (grid-stride over
// the block's rows): the fused forward + backward pass needs it before the gradient kernel.
extern "C" __global__ void lce_row_lse(const float* __restrict__ row_max, const double* __restrict__ row_sum,
                                       float* __restrict__ lse, unsigned rows) {
    for (unsigned k = blockIdx.x * blockDim.x + threadIdx.x; k < rows; k += gridDim.x * blockDim.x) {
        lse[k] = (float)((double)row_max[k] + log(row_sum[k]));
    }
}

// The logit gradient of one logit: row constants of `lce_gradient`.
struct LceGradRow {
    const float* bias;
    float softcap, c, l, zm, b, t;
    unsigned at;
};

__device__ __forceinline__ float lce_grad(const LceGradRow& r, float u, unsigned j) {
    const float z = lce_logit(u, r.bias, j, r.softcap);
    const float p = expf(z - r.l);
    const float g = j == r.at ? (r.c * p - r.t) + r.zm * p : r.c * p - r.b + r.zm * p;
    return g * lce_softcap_derivative(z, r.softcap);
}

__device__ __forceinline__ unsigned lce_pack_bf16x2(float lo, float hi) {
    return (unsigned)__bfloat16_as_ushort(__float2bfloat16_rn(lo)) |
           ((unsigned)__bfloat16_as_ushort(__float2bfloat16_rn(hi)) << 16);
}

// Turns a raw logits block into the logit gradient in place (block b = row k, grid = C), one
// read of the row (16-byte loads where `lce_vectorized`): with p = e^(z − lse), c the row's
// scale, zm = 2λ·lse·c + dlse, b = c·α/V, t = c·((1−α) + α/V):
// G = (c·p − b + zm·p)·f(z) off the target and ((c·p − t) + zm·p)·f(z) at it, f the softcap
// derivative. `dlse` may be null. `store_bf16` 0: G stored as f32 over the logits. 1: each row
// rounded to bf16 (nearest even) into the first half of its bytes (bf16 j of row k at bf16
// element 2·vb·k + j: the operand of the bf16 dX/dW GEMMs) in the same pass — per chunk of
// blockDim.x elements (or float4s) every thread reads before any writes (barrier), and a
// chunk's bf16 slots lie in f32 elements already read by this chunk or an earlier one.
extern "C" __global__ void lce_gradient(float* __restrict__ logits, unsigned vb, unsigned v0,
                                        const float* __restrict__ bias, float softcap,
                                        const unsigned* __restrict__ targets, const float* __restrict__ coef,
                                        const float* __restrict__ lse, const float* __restrict__ dlse,
                                        float alpha, float lambda, unsigned long long vocab, int store_bf16) {
    const unsigned k = blockIdx.x;
    float* row = logits + (unsigned long long)k * vb;
    LceGradRow r;
    r.bias = bias;
    r.softcap = softcap;
    r.c = coef[k];
    r.l = lse[k];
    r.zm = 2.0f * lambda * r.l * r.c + (dlse ? dlse[k] : 0.0f);
    r.b = r.c * alpha / (float)vocab;
    r.t = r.c * (float)((1.0 - (double)alpha) + (double)alpha / (double)vocab);
    const unsigned y = targets[k];
    r.at = (y != LCE_NO_TARGET && y >= v0 && y - v0 < vb) ? y - v0 : LCE_NO_TARGET;
    if (lce_vectorized(row, vb)) {
        float4* row4 = reinterpret_cast<float4*>(row);
        const unsigned n4 = vb / 4;
        if (!store_bf16) {
            for (unsigned q = threadIdx.x; q < n4; q += blockDim.x) {
                const float4 u = row4[q];
                row4[q] = make_float4(lce_grad(r, u.x, 4 * q), lce_grad(r, u.y, 4 * q + 1), lce_grad(r, u.z, 4 * q + 2),
                                      lce_grad(r, u.w, 4 * q + 3));
            }
            return;
        }
        // bf16 slots 4q..4q+4 of the row are its bytes 8q..8q+8: one uint2 per float4.
        uint2* out = reinterpret_cast<uint2*>(row);
        for (unsigned base = 0; base < n4; base += blockDim.x) {
            const unsigned q = base + threadIdx.x;
            uint2 packed = make_uint2(0u, 0u);
            if (q < n4) {
                const float4 u = row4[q];
                packed = make_uint2(lce_pack_bf16x2(lce_grad(r, u.x, 4 * q), lce_grad(r, u.y, 4 * q + 1)),
                                    lce_pack_bf16x2(lce_grad(r, u.z, 4 * q + 2), lce_grad(r, u.w, 4 * q + 3)));
            }
            __syncthreads();
            if (q < n4) out[q] = packed;
            __syncthreads();
        }
        return;
    }
    if (!store_bf16) {
        for (unsigned j = threadIdx.x; j < vb; j += blockDim.x) row[j] = lce_grad(r, row[j], j);
        return;
    }
    __nv_bfloat16* out = reinterpret_cast<__nv_bfloat16*>(row);
    for (unsigned base = 0; base < vb; base += blockDim.x) {
        const unsigned j = base + threadIdx.x;
        const float g = j < vb ? lce_grad(r, row[j], j) : 0.0f;
        __syncthreads();
        if (j < vb) out[j] = __float2bfloat16_rn(g);
        __syncthreads();
    }
}

// dbias[j] += Σ_k G[k][j] over the block's C rows, in row order (one thread per column).
extern "C" __global__ void lce_bias_grad(const float* __restrict__ g, unsigned rows, unsigned vb,
                                         float* __restrict__ dbias) {
    for (unsigned j = blockIdx.x * blockDim.x + threadIdx.x; j < vb; j += gridDim.x * blockDim.x) {
        float acc = dbias[j];
        for (unsigned k = 0; k < rows; ++k) acc += g[(unsigned long long)k * vb + j];
        dbias[j] = acc;
    }
}

// out[i] = float(x[i]) (exact).
extern "C" __global__ void lce_widen_bf16(const __nv_bfloat16* __restrict__ x, float* __restrict__ out,
                                          unsigned long long n) {
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        out[i] = __bfloat162float(x[i]);
    }
}

// g[i] = f32(bf16_rn(g[i])) in place: the logit gradient rounded to bf16 before the dX/dW GEMMs
// of bf16 inputs (Precision::Native), as autograd of a bf16 matmul rounds its incoming gradient.
extern "C" __global__ void lce_round_bf16(float* __restrict__ g, unsigned long long n) {
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        g[i] = __bfloat162float(__float2bfloat16_rn(g[i]));
    }
}

// Each row of a rows×vb gradient block G rounded to bf16 in place (round to nearest even):
// bf16 j of a row lands in the row's j-th 16-bit slot, so the first half of the row's bytes
// holds it as bf16 (row stride 2·vb bf16), the operand of the bf16 dX/dW GEMMs. One block per
// row. Per chunk of blockDim.x elements every thread reads its element before any writes
// (barrier); a chunk's slots [b, b + T) are f32 elements [b/2, (b + T)/2), all read by then,
// and no later chunk's element is written.
extern "C" __global__ void lce_narrow_rows_bf16(float* __restrict__ g, unsigned vb) {
    float* row = g + (unsigned long long)blockIdx.x * vb;
    __nv_bfloat16* out = reinterpret_cast<__nv_bfloat16*>(row);
    for (unsigned base = 0; base < vb; base += blockDim.x) {
        unsigned j = base + threadIdx.x;
        float v = j < vb ? row[j] : 0.0f;
        __syncthreads();
        if (j < vb) out[j] = __float2bfloat16_rn(v);
        __syncthreads();
    }
}
