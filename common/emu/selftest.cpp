// Self-test of the SIMT emulator: the project's common.cu kernels against CPU references, the
// warp and barrier semantics, and deliberately broken kernels that must be reported. One line per
// check; exit status 1 if any check fails. Built and run by build_selftest.sh.
#include <math.h>
#include <stdio.h>

#include <random>
#include <string>
#include <thread>
#include <vector>

#include "simt_emu.hpp"

extern "C" {
void fill_f32(float* out, float value, unsigned long long n);
void checksum_f32(const float* x, unsigned long long n, double* partial);
void cast_f32_to_bf16(const float* x, __nv_bfloat16* out, unsigned long long n);
void block_reduce_sum(const float* x, unsigned n, float* out);
void broken_reduce_nosync(const float* x, unsigned n, float* out);
void broken_oob_shared(float* out);
void broken_shfl_mask(float* out);
void broken_sync_in_branch(float* out);
void broken_sync_divergent(float* out);
void dyn_shared_reverse(const float* x, float* out, unsigned past);
void warp_semantics(int* out);
void broken_exit_before_shfl(float* out);
void broken_shfl_src_outside(float* out);
void indices_atomics(unsigned* ids, unsigned* counter, int* votes);
void partial_warp(float* out, int full_mask);
void shfl_outside_mask_poison(float* out);
}

namespace {

int failures = 0;

void check(const std::string& name, bool ok, const std::string& detail = "") {
    printf("%s %s%s%s\n", ok ? "PASS" : "FAIL", name.c_str(), detail.empty() ? "" : ": ", detail.c_str());
    if (!ok) ++failures;
}

struct Outcome {
    int rc;
    std::string message;
};

// Launches `body` (a lambda calling one kernel) over grid x block.
template <class F>
Outcome launch(dim3 grid, dim3 block, unsigned schedule, F body, size_t dyn_shared = 0) {
    flatpeak_emu_config cfg{{grid.x, grid.y, grid.z}, {block.x, block.y, block.z}, dyn_shared, schedule, 0};
    char msg[1024];
    const flatpeak_emu_thunk thunk = [](void* c) { (*static_cast<F*>(c))(); };
    const int rc = flatpeak_emu_launch(&cfg, thunk, &body, msg, sizeof msg);
    return {rc, rc ? msg : ""};
}

// A broken kernel passes when the launch fails and the message names the problem.
void expect_error(const std::string& name, const Outcome& o, const std::string& needle) {
    const bool ok = o.rc == FLATPEAK_EMU_KERNEL_FAULT && o.message.find(needle) != std::string::npos;
    check(name, ok, o.rc ? "reported: " + o.message : "not reported");
}

uint32_t bits(float f) { uint32_t b; memcpy(&b, &f, 4); return b; }
float from(uint32_t b) { float f; memcpy(&f, &b, 4); return f; }

// Reference rounding, written independently of the emulator's bit tricks: pick the nearer of the
// two neighbouring representable values (exact in double), ties to the even pattern; an
// overflow candidate counts as 2^(emax+1), as IEEE rounding prescribes.
template <class Decode>
uint16_t nearest(float x, uint16_t lo, uint16_t hi_limit, Decode value) {
    const double a = fabs((double)x);
    const uint16_t sign = signbit(x) ? 0x8000 : 0;
    if (lo >= hi_limit) return sign | hi_limit;
    const double dl = a - value(lo), dh = value(lo + 1) - a;
    const uint16_t r = dl < dh ? lo : dh < dl ? lo + 1 : (lo & 1) ? lo + 1 : lo;
    return sign | r;
}
double bf16_value(uint16_t h) { return h == 0x7f80 ? ldexp(1.0, 128) : (double)from((uint32_t)h << 16); }
uint16_t ref_bf16(float x) { return nearest(x, (bits(x) & 0x7fffffffu) >> 16, 0x7f80, bf16_value); }
double f16_value(uint16_t h) {
    const int e = h >> 10, m = h & 0x3ff;
    return e == 0 ? ldexp(m, -24) : e == 31 ? 65536.0 : ldexp(1024 + m, e - 25);
}
uint16_t ref_f16(float x) {
    const double a = fabs((double)x);
    uint16_t lo = 0, hi = 0x7c00;  // largest pattern whose value is <= |x|
    while (lo < hi) {
        const uint16_t mid = (uint16_t)((lo + hi + 1) / 2);
        if (f16_value(mid) <= a) lo = mid; else hi = mid - 1;
    }
    return nearest(x, lo, 0x7c00, f16_value);
}

bool conversion_ok(float x, uint16_t got, uint16_t want, uint16_t exp_mask, uint16_t quiet) {
    if (isnan(x))  // NaN: a quiet NaN with the input's sign
        return (got & exp_mask) == exp_mask && (got & quiet) && (got >> 15) == (bits(x) >> 31);
    return got == want;
}

std::vector<float> conversion_inputs() {
    std::vector<uint32_t> b = {
        0x7fc00000, 0xffc00000, 0x7f800001, 0xff812345,  // NaNs: quiet, negative, signalling
        0x7f800000, 0xff800000, 0x00000000, 0x80000000,  // ±inf, ±0
        0x00000001, 0x807fffff, 0x00800000, 0x7f7fffff, 0xff7fffff,  // subnormals, min normal, max
        0x3f808000, 0x3f818000, 0x3f808001, 0x3f807fff, 0xbf808000,  // bf16 halfway and neighbours
        0x7f7f8000, 0x7f7e8000, 0x00008000, 0x00018000,              // bf16 ties to inf / subnormal
        0x477fe000, 0x477fefff, 0x477ff000, 0x477fffff, 0x47800000,  // f16: 65504, ..., 65520, 2^16
        0x33000000, 0x33000001, 0x33800000, 0x33c00000, 0x387fc000,  // f16: 2^-25, ..., subnormal top
        0x38800000, 0x3f801000, 0x3f803000, 0x3f801001, 0xc0000000,  // f16: min normal, ties at 1
    };
    std::vector<float> v;
    for (uint32_t u : b) v.push_back(from(u));
    std::mt19937 rng(12345);
    for (int i = 0; i < 1 << 20; ++i) v.push_back(from(rng()));
    return v;
}

void test_common_kernels() {
    // fill_f32 with a grid smaller than n (grid-stride loop).
    std::vector<float> buf(10007, -1.0f);
    Outcome o = launch(dim3(3), dim3(128), 0, [&] { fill_f32(buf.data(), 2.5f, 10000); });
    bool ok = o.rc == 0;
    for (size_t i = 0; i < buf.size(); ++i) ok = ok && buf[i] == (i < 10000 ? 2.5f : -1.0f);
    check("common.cu fill_f32 (grid 3 x 128, n 10000)", ok, o.message);

    // checksum_f32: dyadic inputs make every double sum exact, so the kernel must match a plain
    // CPU sum bitwise; random inputs must match a CPU replay of the kernel's summation order.
    const unsigned grid = 5, block = 256;
    const unsigned long long n = 100003, stride = (unsigned long long)grid * block;
    for (int random = 0; random < 2; ++random) {
        std::vector<float> x(n);
        std::mt19937 rng(7);
        std::uniform_real_distribution<float> dist(-1e3f, 1e3f);
        for (unsigned long long i = 0; i < n; ++i) x[i] = random ? dist(rng) : (float)(i % 1000) / 1024.0f;
        std::vector<double> p0(grid, NAN), p1(grid, NAN), replay(grid);
        Outcome a = launch(dim3(grid), dim3(block), 0, [&] { checksum_f32(x.data(), n, p0.data()); });
        Outcome b = launch(dim3(grid), dim3(block), 1, [&] { checksum_f32(x.data(), n, p1.data()); });
        auto warp_tree = [](double* v) {  // __shfl_down_sync: lanes past the warp read their own
            for (int off = 16; off > 0; off >>= 1) {
                double next[32];
                for (int l = 0; l < 32; ++l) next[l] = v[l] + (l + off < 32 ? v[l + off] : v[l]);
                memcpy(v, next, sizeof next);
            }
        };
        for (unsigned bl = 0; bl < grid; ++bl) {
            std::vector<double> acc(block, 0.0), ws(32, 0.0);
            for (unsigned t = 0; t < block; ++t)
                for (unsigned long long i = bl * block + t; i < n; i += stride) acc[t] += x[i];
            for (unsigned w = 0; w < block / 32; ++w) {
                warp_tree(&acc[w * 32]);
                ws[w] = acc[w * 32];
            }
            warp_tree(ws.data());
            replay[bl] = ws[0];
        }
        double total = 0.0, plain = 0.0;
        for (unsigned bl = 0; bl < grid; ++bl) total += p0[bl];
        for (float v : x) plain += v;
        const bool same = !memcmp(p0.data(), p1.data(), grid * sizeof(double));
        const bool exact = random ? !memcmp(p0.data(), replay.data(), grid * sizeof(double)) : total == plain;
        char d[256];
        snprintf(d, sizeof d, "sum %.17g, CPU %.17g%s", total, plain, (a.message + b.message).c_str());
        check(std::string("common.cu checksum_f32 (grid 5 x 256) ") +
                  (random ? "random input: == CPU replay of its order, schedule 0 == 1"
                          : "dyadic input: == CPU double sum, schedule 0 == 1"),
              a.rc == 0 && b.rc == 0 && same && exact, d);
    }

    // cast_f32_to_bf16 on edge values and 2^20 random patterns.
    std::vector<float> in = conversion_inputs();
    std::vector<__nv_bfloat16> out(in.size());
    o = launch(dim3(7), dim3(256), 1, [&] { cast_f32_to_bf16(in.data(), out.data(), in.size()); });
    size_t bad = 0;
    char first[96] = "";
    for (size_t i = 0; i < in.size(); ++i) {
        const uint16_t want = ref_bf16(in[i]);
        if (!conversion_ok(in[i], out[i].__x, want, 0x7f80, 0x0040) && !bad++)
            snprintf(first, sizeof first, "0x%08x -> 0x%04x, want 0x%04x", bits(in[i]), out[i].__x, want);
    }
    check("common.cu cast_f32_to_bf16 RNE: NaN, inf, 0, subnormal, max, halfway + 2^20 random",
          o.rc == 0 && !bad, o.message + first);
}

void test_conversions_host() {
    size_t bad = 0;
    char first[96] = "";
    for (float x : conversion_inputs()) {
        const uint16_t got = __float2half_rn(x).__x, want = ref_f16(x);
        if (!conversion_ok(x, got, want, 0x7c00, 0x0200) && !bad++)
            snprintf(first, sizeof first, "0x%08x -> 0x%04x, want 0x%04x", bits(x), got, want);
    }
    for (uint32_t h = 0; h < 0x10000; ++h) {  // every binary16 back to float, exactly
        const float f = __half2float(__ushort_as_half((unsigned short)h));
        const bool neg = h & 0x8000, nan = (h & 0x7c00) == 0x7c00 && (h & 0x3ff);
        const bool inf = (h & 0x7fff) == 0x7c00;
        const double want = (neg ? -1 : 1) * f16_value(h & 0x7fff);
        const bool ok = signbit(f) == neg && (nan ? isnan(f) : inf ? isinf(f) : (double)f == want);
        if (!ok && !bad++) snprintf(first, sizeof first, "half 0x%04x -> %a", h, f);
    }
    check("__float2half_rn RNE (edges + 2^20 random) and __half2float (all 65536)", !bad, first);
    check("__bfloat162float(__float2bfloat16(1.5f)) == 1.5f",
          __bfloat162float(__float2bfloat16(1.5f)) == 1.5f);
}

void test_semantics() {
    std::vector<float> x(1000);
    for (size_t i = 0; i < x.size(); ++i) x[i] = (float)(i % 97) * 0.25f;
    std::vector<float> r0(4), r1(4), want(4, 0.0f);
    for (size_t i = 0; i < x.size(); ++i) want[i / 256] += x[i];  // exact: quarter-integers
    Outcome a = launch(dim3(4), dim3(256), 0, [&] { block_reduce_sum(x.data(), 1000, r0.data()); });
    Outcome b = launch(dim3(4), dim3(256), 1, [&] { block_reduce_sum(x.data(), 1000, r1.data()); });
    check("shared-memory block reduction == CPU, schedule 0 and 1",
          a.rc == 0 && b.rc == 0 && r0 == want && r1 == want, a.message + b.message);

    std::vector<int> w(9 * 32);
    Outcome o = launch(dim3(1), dim3(32), 0, [&] { warp_semantics(w.data()); });
    bool ok = o.rc == 0;
    for (int l = 0; l < 32; ++l) {
        const int expect[9] = {
            ((l & ~7) + ((l + 3) & 7)) * 10,  // idx wraps within the 8-lane segment
            ((l & 15) < 3 ? l : l - 3) * 10,  // up: before the segment start -> own value
            (l + 5 < 32 ? l + 5 : l) * 10,    // down: past the warp -> own value
            ((l & 4) ? (l ^ 6) : l) * 10,     // xor: into a later segment -> own value
            (int)0x49249249u,                 // ballot of lane % 3 == 0
            1, 0, l ^ 1, (int)(2.5 * (31 - l))};
        for (int k = 0; k < 9; ++k)
            if (w[k * 32 + l] != expect[k]) {
                if (ok) printf("  lane %d result %d: got %d want %d\n", l, k, w[k * 32 + l], expect[k]);
                ok = false;
            }
    }
    check("warp intrinsics: shfl idx/up/down/xor + widths, ballot/any/all, syncwarp, disjoint masks",
          ok, o.message);

    std::vector<float> po(16, 0.0f);
    o = launch(dim3(1), dim3(32), 1, [&] { shfl_outside_mask_poison(po.data()); });
    ok = o.rc == 0;
    for (int l = 0; l < 16; ++l) ok = ok && (l < 8 ? po[l] == 1.0f : isnan(po[l]));
    check("__shfl_down_sync reading a lane outside its mask yields NaN (GPU: garbage)", ok, o.message);

    std::vector<unsigned> ids(4 * 24), counter(2, 0);
    std::vector<int> votes(12);
    o = launch(dim3(2, 2, 1), dim3(4, 3, 2), 1,
               [&] { indices_atomics(ids.data(), counter.data(), votes.data()); });
    ok = o.rc == 0 && counter[0] == 96 && counter[1] == 23;
    for (unsigned bl = 0; bl < 4; ++bl) {
        ok = ok && votes[3 * bl] == 12 && votes[3 * bl + 1] == 1 && votes[3 * bl + 2] == 1;
        for (unsigned t = 0; t < 24; ++t)
            ok = ok && ids[bl * 24 + t] == t % 4 + 100 * (t / 4 % 3) + 10000 * (t / 12) + 1000000 * bl;
    }
    check("3-D indices, atomics, __syncthreads_count/and/or", ok, o.message);

    std::vector<float> pw(3, -1.0f);
    o = launch(dim3(1), dim3(48), 0, [&] { partial_warp(pw.data(), 0); });
    check("partial warp (48 threads) with masks naming existing lanes",
          o.rc == 0 && pw[0] == 120.0f && pw[1] == 376.0f && pw[2] == 632.0f, o.message);

    // Reentrancy: launches on several OS threads at once must not interfere.
    std::vector<std::thread> pool;
    std::vector<int> good(4, 0);
    for (int t = 0; t < 4; ++t)
        pool.emplace_back([&, t] {
            std::vector<float> sum(4);
            for (int rep = 0; rep < 5; ++rep) {
                Outcome r = launch(dim3(4), dim3(256), (unsigned)(rep + t) % 2,
                                   [&] { block_reduce_sum(x.data(), 1000, sum.data()); });
                good[t] += r.rc == 0 && sum == want;
            }
        });
    for (auto& th : pool) th.join();
    check("4 OS threads launching concurrently", good == std::vector<int>(4, 5));

    Outcome inner{0, ""};
    o = launch(dim3(1), dim3(1), 0, [&] { inner = launch(dim3(1), dim3(1), 0, [] {}); });
    check("a launch from inside a kernel is rejected", o.rc == 0 && inner.rc == FLATPEAK_EMU_BAD_CONFIG,
          inner.message);
    o = launch(dim3(1), dim3(1), 0, [] {}, FLATPEAK_EMU_MAX_DYNAMIC_SHARED + 1);
    check("oversized dynamic shared request is rejected", o.rc == FLATPEAK_EMU_BAD_CONFIG, o.message);
}

// A broken kernel of one block writing `out`: the block size and schedule that break it, and
// what the emulator must report.
struct BrokenLaunch {
    std::string name;
    unsigned threads;
    unsigned schedule;
    void (*kernel)(float* out);
    const char* report;
};

void test_broken() {
    std::vector<float> out(1024), x(1024, 1.0f);
    const BrokenLaunch one_block[] = {
        {"(a) static shared array indexed out of bounds", 64, 0, broken_oob_shared,
         "index 32 out of bounds for type 'float [32]' at "},
        {"(c) __shfl_down_sync, mask 0x0000ffff, all 32 lanes, schedule 0", 32, 0, broken_shfl_mask,
         "with mask 0x0000ffff that excludes itself"},
        {"(c) __shfl_down_sync, mask 0x0000ffff, all 32 lanes, schedule 1", 32, 1, broken_shfl_mask,
         "with mask 0x0000ffff that excludes itself"},
        {"(d) __syncthreads inside if (threadIdx.x < 16)", 32, 0, broken_sync_in_branch,
         "reached by 16 of 32 threads; the others exited"},
        {"(d') __syncthreads at different call sites", 32, 1, broken_sync_divergent, "divergent __syncthreads"},
        {"lanes exiting before a full-mask shuffle: a deadlock naming op, mask, lanes", 64, 0,
         broken_exit_before_shfl, "deadlock in __shfl_down_sync with mask 0xffffffff"},
        {"__shfl_sync source lane outside the mask", 32, 0, broken_shfl_src_outside, "reads lane 16 not in mask"},
        {"full mask in a partial warp (48 threads)", 48, 0, [](float* o) { partial_warp(o, 1); },
         "lanes 16-31 do not exist"},
    };
    for (const BrokenLaunch& c : one_block)
        expect_error(c.name, launch(dim3(1), dim3(c.threads), c.schedule, [&] { c.kernel(out.data()); }),
                     c.report);

    std::vector<float> xs(512), s0(2), s1(2);
    for (size_t i = 0; i < xs.size(); ++i) xs[i] = (float)(i + 1);
    Outcome a = launch(dim3(2), dim3(256), 0, [&] { broken_reduce_nosync(xs.data(), 512, s0.data()); });
    Outcome b = launch(dim3(2), dim3(256), 1, [&] { broken_reduce_nosync(xs.data(), 512, s1.data()); });
    char d[160];
    snprintf(d, sizeof d, "block 0: schedule 0 gives %g, schedule 1 gives %g (the sum is 32896)", s0[0],
             s1[0]);
    check("(b) missing __syncthreads: outputs differ between schedule 0 and 1",
          a.rc == 0 && b.rc == 0 && s0 != s1, d);

    std::vector<float> rev(64);
    const size_t bytes = 64 * sizeof(float);
    Outcome ok = launch(dim3(2), dim3(64), 0, [&] { dyn_shared_reverse(x.data(), rev.data(), 0); }, bytes);
    check("dynamic shared memory within the requested bytes",
          ok.rc == 0 && rev == std::vector<float>(64, 1.0f), ok.message);
    expect_error("(e) dynamic shared write past the requested bytes",
                 launch(dim3(2), dim3(64), 0, [&] { dyn_shared_reverse(x.data(), rev.data(), 1); }, bytes),
                 "dynamic shared memory written out of bounds (requested 256 bytes, written at offset 256)");
}

}  // namespace

int main() {
    test_common_kernels();
    test_conversions_host();
    test_semantics();
    test_broken();
    printf("%s: %d failure(s)\n", failures ? "FAILED" : "ALL PASSED", failures);
    return failures ? 1 : 0;
}
