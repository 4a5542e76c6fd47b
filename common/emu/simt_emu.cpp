// simt_emu.cpp: the runtime behind simt_emu.hpp. One launch runs its blocks one after another on
// the calling OS thread; inside a block every CUDA thread is a ucontext fiber, and a deterministic
// cooperative scheduler always resumes the runnable fiber with the lowest linear id (schedule 0)
// or the highest (schedule 1), which runs until it blocks at a barrier or warp rendezvous or
// returns. The two schedules are opposite extremes of interleaving, so running a kernel under
// both and comparing outputs exposes missing barriers; the rendezvous bookkeeping exposes
// divergent barriers, bad warp masks and deadlocks. All state is per launch or thread_local, so
// launches on different OS threads (Rust's test harness) do not interact.
//
// Compile: g++ -std=c++17 -O2 -Wall -Wextra -c simt_emu.cpp   (no -fsanitize: this file provides
// the two ubsan handlers that kernels compiled with -fsanitize=bounds call).
#include <stdarg.h>
#include <stdio.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <mutex>
#include <new>
#include <string>
#include <vector>

#include "simt_emu.hpp"

static_assert(offsetof(flatpeak_emu_config, dynamic_shared_bytes) == 24 &&
                  offsetof(flatpeak_emu_config, schedule) == 32 &&
                  offsetof(flatpeak_emu_config, fiber_stack_bytes) == 40 &&
                  sizeof(flatpeak_emu_config) == 48,
              "the Rust #[repr(C)] mirror assumes this LP64 layout");

namespace flatpeak_emu {

__thread ThreadCtx* tls_thread = nullptr;

void not_in_launch(const char* what) {
    // Host code (not a kernel) used a device-only facility: a harness bug, not a kernel bug.
    fprintf(stderr, "flatpeak_emu: %s used outside a kernel launch\n", what);
    abort();
}

namespace {

constexpr size_t kDefaultStack = 256 * 1024;
constexpr size_t kMinStack = 64 * 1024;
constexpr unsigned char kPoison = 0xff;  // uninitialised dynamic shared memory reads as NaN / -1

enum class State : uint8_t { Runnable, Barrier, Warp, Done, Dead };

struct Fiber {
    ucontext_t uc;  // holds a pointer into itself (fpregs): a Fiber never moves after getcontext
    ThreadCtx tc;
    unsigned linear = 0, lane = 0, warp = 0;
    State state = State::Runnable;
    Site site{nullptr, 0};  // where it waits
    int pred = 0, barrier_result = 0;
    WarpOp op = WarpOp::SyncWarp;
    ValueKind kind = ValueKind::None;
    unsigned bytes = 0, mask = 0;
    int param = 0, width = 32;
    uint64_t in = 0, out = 0;
};

struct Region {
    unsigned char* base;
    size_t capacity;
};

struct Launch {
    flatpeak_emu_config cfg{};
    flatpeak_emu_thunk thunk = nullptr;
    void* ctx = nullptr;
    unsigned nthreads = 0;
    std::unique_ptr<Fiber[]> fibers;
    unsigned char* stacks = nullptr;
    size_t slot = 0, map_len = 0, page = 0;
    ucontext_t sched;
    Fiber* cur = nullptr;
    unsigned done = 0, at_barrier = 0;
    Fiber* barrier_first = nullptr;
    unsigned rewind = 0;  // lowest schedule position a rendezvous released since the last switch
    uint3 block{0, 0, 0};
    int code = FLATPEAK_EMU_OK;
    std::string message;
    std::vector<Region> regions;
    std::vector<unsigned char> canary;  // canary[i]: the byte expected at offset i of every region
};

thread_local Launch* tls_launch = nullptr;
thread_local std::vector<Region> tls_regions;  // filled by the generated visitor at each launch

std::string fmt(const char* f, ...) __attribute__((format(printf, 1, 2)));
std::string fmt(const char* f, ...) {
    char buf[512];
    va_list ap;
    va_start(ap, f);
    vsnprintf(buf, sizeof buf, f, ap);
    va_end(ap);
    return buf;
}

// 1-D shapes print as "5"; others as "(x,y,z)".
std::string idx3(uint3 v, bool one_d) { return one_d ? fmt("%u", v.x) : fmt("(%u,%u,%u)", v.x, v.y, v.z); }
bool block_1d(const Launch& L) { return L.cfg.block[1] == 1 && L.cfg.block[2] == 1; }
bool grid_1d(const Launch& L) { return L.cfg.grid[1] == 1 && L.cfg.grid[2] == 1; }
std::string where(const Launch& L) { return "block " + idx3(L.block, grid_1d(L)); }
std::string who(const Launch& L, const Fiber& f) {
    return "thread " + idx3(f.tc.thread_idx, block_1d(L)) + fmt(" (warp %u lane %u)", f.warp, f.lane);
}
std::string site_str(Site s) { return fmt("%s:%d", s.file ? s.file : "?", s.line); }
bool same_site(Site a, Site b) {
    return a.line == b.line && (a.file == b.file || (a.file && b.file && !strcmp(a.file, b.file)));
}

// Lane sets print as ranges: "0-15,20".
std::string lanes_str(unsigned m) {
    std::string s;
    for (unsigned i = 0; i < 32;) {
        if (!(m >> i & 1u)) { ++i; continue; }
        unsigned j = i;
        while (j + 1 < 32 && (m >> (j + 1) & 1u)) ++j;
        if (!s.empty()) s += ",";
        s += i == j ? fmt("%u", i) : fmt("%u-%u", i, j);
        i = j + 1;
    }
    return s.empty() ? "none" : s;
}

const char* op_name(WarpOp op) {
    switch (op) {
        case WarpOp::SyncWarp: return "__syncwarp";
        case WarpOp::Shfl: return "__shfl_sync";
        case WarpOp::ShflUp: return "__shfl_up_sync";
        case WarpOp::ShflDown: return "__shfl_down_sync";
        case WarpOp::ShflXor: return "__shfl_xor_sync";
        case WarpOp::Ballot: return "__ballot_sync";
        case WarpOp::Any: return "__any_sync";
        case WarpOp::All: return "__all_sync";
    }
    return "?";
}
bool is_shuffle(WarpOp op) {
    return op == WarpOp::Shfl || op == WarpOp::ShflUp || op == WarpOp::ShflDown || op == WarpOp::ShflXor;
}

// First error wins; later ones are consequences of it.
void fail(Launch& L, int code, const std::string& msg) {
    if (L.code != FLATPEAK_EMU_OK) return;
    L.code = code;
    L.message = msg;
}

// Suspends the running fiber until the scheduler resumes it.
void yield(Launch& L, Fiber& f) { swapcontext(&f.uc, &L.sched); }

// A fiber released from a rendezvous becomes runnable; the scheduler must look back to it.
void release(Launch& L, Fiber& f) {
    f.state = State::Runnable;
    const unsigned pos = L.cfg.schedule == 1 ? L.nthreads - 1 - f.linear : f.linear;
    if (pos < L.rewind) L.rewind = pos;
}

// Ends the running fiber for good after an error: the launch is abandoned, so nothing it would
// still do (like the out-of-bounds store ubsan just announced) may happen.
[[noreturn]] void kill_current(Launch& L) {
    Fiber& f = *L.cur;
    f.state = State::Dead;
    swapcontext(&f.uc, &L.sched);
    abort();  // a dead fiber is never resumed
}

[[noreturn]] void fault(Launch& L, const std::string& msg) {
    fail(L, FLATPEAK_EMU_KERNEL_FAULT, where(L) + ", " + who(L, *L.cur) + ": " + msg);
    kill_current(L);
}

Launch& running(const char* what) {
    Launch* L = tls_launch;
    if (!L || !L->cur) not_in_launch(what);
    return *L;
}

void fiber_main() {
    Launch& L = *tls_launch;
    Fiber& f = *L.cur;
    L.thunk(L.ctx);
    f.state = State::Done;
    ++L.done;
    swapcontext(&f.uc, &L.sched);
    abort();  // a finished fiber is never resumed
}

unsigned lanes_in_warp(const Launch& L, unsigned warp) {
    const unsigned left = L.nthreads - warp * 32;
    return left < 32 ? left : 32;
}

// Everything a missing lane may be doing, for deadlock reports.
std::string lane_state(const Fiber& f) {
    switch (f.state) {
        case State::Done: return "exited";
        case State::Barrier: return "waiting at __syncthreads " + site_str(f.site);
        case State::Warp:
            return fmt("waiting at %s mask 0x%08x ", op_name(f.op), f.mask) + site_str(f.site);
        default: return "runnable";
    }
}

// Every lane of `mask` has arrived: compute each one's result and let them all run again.
// A lane reading a lane outside the mask gets poison (NaN for floating types) from the relative
// shuffles (the GPU returns garbage there; code that discards it is legal), but __shfl_sync's
// explicit source lane outside the mask is reported.
void complete_warp_op(Launch& L, Fiber* base, unsigned mask) {
    uint64_t vote = 0;
    for (unsigned l = 0; l < 32; ++l)
        if ((mask >> l & 1u) && base[l].in) vote |= 1ull << l;
    for (unsigned l = 0; l < 32; ++l) {
        if (!(mask >> l & 1u)) continue;
        Fiber& f = base[l];
        release(L, f);
        switch (f.op) {
            case WarpOp::SyncWarp: f.out = 0; break;
            case WarpOp::Ballot: f.out = vote; break;
            case WarpOp::Any: f.out = vote != 0; break;
            case WarpOp::All: f.out = vote == mask; break;
            default: {
                // PTX shfl.sync: segmask = 32 - width, clamp 31 (0 for up), b taken mod 32.
                const int seg = 32 - f.width, b = f.param & 31, lane = (int)l;
                const int lo = lane & seg, hi = lo | (31 & ~seg);
                int j = lane;
                bool ok = true;
                switch (f.op) {
                    case WarpOp::Shfl: j = lo | (b & ~seg); break;
                    case WarpOp::ShflUp: j = lane - b; ok = j >= lo; break;
                    case WarpOp::ShflDown: j = lane + b; ok = j <= hi; break;
                    default: j = lane ^ b; ok = j <= hi; break;
                }
                if (!ok) j = lane;  // outside the segment: the caller's own value
                if (mask >> j & 1u) {
                    f.out = base[j].in;
                } else if (f.op == WarpOp::Shfl) {
                    fail(L, FLATPEAK_EMU_KERNEL_FAULT,
                         where(L) + ", " + who(L, f) +
                             fmt(": __shfl_sync reads lane %d not in mask 0x%08x at ", j, mask) +
                             site_str(f.site));
                } else if (f.kind == ValueKind::Float) {
                    f.out = f.bytes == 8 ? 0x7ff8badbadbadbadull : f.bytes == 4 ? 0x7fcbadbaull : 0x7fffull;
                } else {
                    f.out = 0xbadbadbadbadbadbull;
                }
            }
        }
    }
    if (L.code != FLATPEAK_EMU_OK) kill_current(L);
}

// No fiber can run but not all have returned: say who waits for whom.
void diagnose_deadlock(Launch& L) {
    const unsigned nwarps = (L.nthreads + 31) / 32;
    for (unsigned w = 0; w < nwarps; ++w) {
        Fiber* base = &L.fibers[w * 32];
        const unsigned count = lanes_in_warp(L, w);
        for (unsigned l = 0; l < count; ++l) {
            const Fiber& f = base[l];
            if (f.state != State::Warp) continue;
            unsigned arrived = 0;
            for (unsigned p = 0; p < count; ++p)
                if (base[p].state == State::Warp && base[p].mask == f.mask) arrived |= 1u << p;
            const unsigned missing = f.mask & ~arrived;
            std::string why;
            for (unsigned p = 0; p < 32;) {  // group consecutive lanes in the same state
                if (!(missing >> p & 1u)) { ++p; continue; }
                const std::string s = lane_state(base[p]);
                unsigned group = 0, q = p;
                while (q < 32 && (missing >> q & 1u) && lane_state(base[q]) == s) group |= 1u << q++;
                why += (why.empty() ? "" : "; ") + lanes_str(group) + " " + s;
                p = q;
            }
            fail(L, FLATPEAK_EMU_KERNEL_FAULT,
                 where(L) + fmt(", warp %u: deadlock in %s with mask 0x%08x at ", w, op_name(f.op), f.mask) +
                     site_str(f.site) + ": lanes " + lanes_str(arrived) +
                     " arrived, lanes never arriving: " + why);
            return;
        }
    }
    if (L.at_barrier && L.at_barrier + L.done == L.nthreads) {
        fail(L, FLATPEAK_EMU_KERNEL_FAULT,
             where(L) + ": __syncthreads at " + site_str(L.barrier_first->site) +
                 fmt(" reached by %u of %u threads; the others exited", L.at_barrier, L.nthreads));
        return;
    }
    fail(L, FLATPEAK_EMU_KERNEL_FAULT, where(L) + ": deadlock: no thread can make progress");
}

// Each region's bytes past the requested size hold a canary, written once per launch and checked
// after every block. It is position dependent, so a store of any one repeated byte (0.0f, -1) is
// still seen.
void arm_canaries(Launch& L) {
    size_t most = 0;
    for (const Region& r : L.regions) most = r.capacity > most ? r.capacity : most;
    L.canary.resize(most);
    for (size_t i = 0; i < most; ++i) L.canary[i] = (unsigned char)(0xa5u ^ (i * 0x3bu));
    const size_t req = L.cfg.dynamic_shared_bytes;
    for (const Region& r : L.regions) memcpy(r.base + req, L.canary.data() + req, r.capacity - req);
}

void check_canaries(Launch& L) {
    const size_t req = L.cfg.dynamic_shared_bytes;
    for (const Region& r : L.regions) {
        if (!memcmp(r.base + req, L.canary.data() + req, r.capacity - req)) continue;
        size_t i = req;
        while (r.base[i] == L.canary[i]) ++i;
        fail(L, FLATPEAK_EMU_KERNEL_FAULT,
             where(L) + fmt(": dynamic shared memory written out of bounds (requested %zu bytes, "
                            "written at offset %zu)", req, i));
        return;
    }
}

// Kept out of line: getcontext returns twice, which would put run_block's locals at risk
// (-Wclobbered).
__attribute__((noinline)) void make_fiber(Fiber& f, unsigned char* stack, size_t size) {
    getcontext(&f.uc);
    f.uc.uc_stack.ss_sp = stack;
    f.uc.uc_stack.ss_size = size;
    f.uc.uc_link = nullptr;
    makecontext(&f.uc, fiber_main, 0);
}

void run_block(Launch& L) {
    const unsigned bx = L.cfg.block[0], by = L.cfg.block[1];
    for (unsigned i = 0; i < L.nthreads; ++i) {
        Fiber& f = L.fibers[i];
        f.linear = i;
        f.lane = i % 32;
        f.warp = i / 32;
        f.state = State::Runnable;
        f.tc.thread_idx = uint3{i % bx, (i / bx) % by, i / (bx * by)};
        f.tc.block_idx = L.block;
        f.tc.block_dim = dim3(L.cfg.block[0], L.cfg.block[1], L.cfg.block[2]);
        f.tc.grid_dim = dim3(L.cfg.grid[0], L.cfg.grid[1], L.cfg.grid[2]);
        make_fiber(f, L.stacks + i * L.slot + L.page, L.slot - L.page);  // first page: guard
    }
    L.done = L.at_barrier = 0;
    L.barrier_first = nullptr;
    // Shared memory starts undefined on the GPU; make reading it before writing it visible.
    for (const Region& r : L.regions) memset(r.base, kPoison, L.cfg.dynamic_shared_bytes);

    // Priority scheduling: always resume the runnable fiber earliest in schedule order (lowest
    // linear id forward, highest reverse). Invariant: no fiber before `pos` is runnable, since
    // fibers only become runnable through release(), which records how far back to look.
    const bool reverse = L.cfg.schedule == 1;
    auto at = [&](unsigned pos) -> Fiber& { return L.fibers[reverse ? L.nthreads - 1 - pos : pos]; };
    unsigned pos = 0;
    L.rewind = L.nthreads;
    while (L.done < L.nthreads) {
        while (pos < L.nthreads && at(pos).state != State::Runnable) ++pos;
        if (pos == L.nthreads) {
            diagnose_deadlock(L);
            return;
        }
        Fiber& f = at(pos);
        L.cur = &f;
        tls_thread = &f.tc;
        swapcontext(&L.sched, &f.uc);
        L.cur = nullptr;
        tls_thread = nullptr;
        if (L.code != FLATPEAK_EMU_OK) return;  // abandon the block: stacks are freed later
        if (L.rewind < pos) pos = L.rewind;
        L.rewind = L.nthreads;
    }
    check_canaries(L);
}

std::string check_config(const flatpeak_emu_config& c) {
    for (int d = 0; d < 3; ++d)
        if (!c.grid[d] || !c.block[d]) return "grid and block dimensions must be nonzero";
    if (c.grid[0] > 0x7fffffffu || c.grid[1] > 65535 || c.grid[2] > 65535)
        return fmt("grid (%u,%u,%u) exceeds (2^31-1, 65535, 65535)", c.grid[0], c.grid[1], c.grid[2]);
    if (c.block[0] > 1024 || c.block[1] > 1024 || c.block[2] > 64 ||
        (unsigned long long)c.block[0] * c.block[1] * c.block[2] > 1024)
        return fmt("block (%u,%u,%u) exceeds (1024, 1024, 64) or 1024 threads", c.block[0], c.block[1],
                   c.block[2]);
    if (c.dynamic_shared_bytes > FLATPEAK_EMU_MAX_DYNAMIC_SHARED)
        return fmt("%zu bytes of dynamic shared memory requested; at most %d", c.dynamic_shared_bytes,
                   FLATPEAK_EMU_MAX_DYNAMIC_SHARED);
    if (c.schedule > 1) return fmt("schedule %u is neither 0 (forward) nor 1 (reverse)", c.schedule);
    return "";
}

using RegionsFn = void (*)(void (*)(void*, size_t));
std::mutex& visitors_mutex() {
    static std::mutex m;
    return m;
}
std::vector<RegionsFn>& visitors() {
    static std::vector<RegionsFn> v;
    return v;
}
// A snapshot, so a constructor registering on another thread never races a launch's walk.
std::vector<RegionsFn> registered_region_visitors() {
    std::lock_guard<std::mutex> lock(visitors_mutex());
    return visitors();
}

int launch(Launch& L) {
    std::string bad = check_config(L.cfg);
    if (!bad.empty()) {
        fail(L, FLATPEAK_EMU_BAD_CONFIG, "invalid launch: " + bad);
        return L.code;
    }
    tls_regions.clear();
    for (RegionsFn regions : registered_region_visitors()) regions(flatpeak_emu_register_dynamic_shared);
    L.regions = tls_regions;
    for (const Region& r : L.regions)
        if (r.capacity < L.cfg.dynamic_shared_bytes) {
            fail(L, FLATPEAK_EMU_BAD_CONFIG,
                 fmt("invalid launch: %zu bytes of dynamic shared memory requested; a registered "
                     "region holds only %zu", L.cfg.dynamic_shared_bytes, r.capacity));
            return L.code;
        }
    L.nthreads = L.cfg.block[0] * L.cfg.block[1] * L.cfg.block[2];
    L.fibers.reset(new (std::nothrow) Fiber[L.nthreads]);
    L.page = (size_t)sysconf(_SC_PAGESIZE);
    size_t stack = L.cfg.fiber_stack_bytes ? L.cfg.fiber_stack_bytes : kDefaultStack;
    stack = stack < kMinStack ? kMinStack : stack;
    L.slot = (stack + L.page - 1) / L.page * L.page + L.page;
    L.map_len = L.slot * L.nthreads;
    void* m = mmap(nullptr, L.map_len, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_STACK, -1, 0);
    if (!L.fibers || m == MAP_FAILED) {
        fail(L, FLATPEAK_EMU_NO_MEMORY,
             fmt("cannot allocate %u fibers of %zu-byte stacks", L.nthreads, stack));
        if (m != MAP_FAILED) munmap(m, L.map_len);
        return L.code;
    }
    L.stacks = static_cast<unsigned char*>(m);
    for (unsigned i = 0; i < L.nthreads; ++i) mprotect(L.stacks + i * L.slot, L.page, PROT_NONE);
    arm_canaries(L);

    tls_launch = &L;
    for (unsigned z = 0; z < L.cfg.grid[2] && L.code == FLATPEAK_EMU_OK; ++z)
        for (unsigned y = 0; y < L.cfg.grid[1] && L.code == FLATPEAK_EMU_OK; ++y)
            for (unsigned x = 0; x < L.cfg.grid[0] && L.code == FLATPEAK_EMU_OK; ++x) {
                L.block = uint3{x, y, z};
                run_block(L);
            }
    tls_launch = nullptr;
    munmap(L.stacks, L.map_len);  // abandoned fibers' frames go with it (kernels own no heap)
    L.stacks = nullptr;
    return L.code;
}

// ubsan's out-of-bounds report (GCC 12 libsanitizer, ubsan_handlers.h / ubsan_value.h).
struct TypeDescriptor {
    uint16_t kind;  // 0: integer
    uint16_t info;  // integer: log2(bit width) << 1 | signed
    char name[1];   // NUL-terminated, quoted: "'float [32]'"
};
struct OutOfBoundsData {
    const char* file;
    uint32_t line, column;
    const TypeDescriptor* array_type;
    const TypeDescriptor* index_type;
};

void out_of_bounds(void* data, void* index, bool abort_variant) {
    const OutOfBoundsData* d = static_cast<const OutOfBoundsData*>(data);
    const TypeDescriptor* t = d->index_type;
    std::string idx = "?";
    if (t->kind == 0 && (t->info >> 1) <= 6) {  // inline integers up to 64 bits
        const unsigned width = 1u << (t->info >> 1), spare = 64 - width;
        const uint64_t raw = (uint64_t)(uintptr_t)index;
        idx = (t->info & 1) ? fmt("%lld", (long long)(raw << spare) >> spare)
                            : fmt("%llu", (unsigned long long)(raw << spare >> spare));
    }
    const std::string msg = "index " + idx + " out of bounds for type " + d->array_type->name + " at " +
                            fmt("%s:%u:%u", d->file, d->line, d->column);
    Launch* L = tls_launch;
    if (L && L->cur) fault(*L, msg);
    fprintf(stderr, "flatpeak_emu: %s (outside a kernel launch)\n", msg.c_str());
    if (abort_variant) abort();
}

}  // namespace

int block_barrier(Site site, int pred, BarrierMode mode) {
    Launch& L = running("__syncthreads");
    Fiber& f = *L.cur;
    if (L.at_barrier && !same_site(L.barrier_first->site, site))
        fault(L, "divergent __syncthreads: " + who(L, *L.barrier_first) + " at " +
                     site_str(L.barrier_first->site) + ", " + who(L, f) + " at " + site_str(site));
    f.state = State::Barrier;
    f.site = site;
    f.pred = pred != 0;
    if (L.at_barrier++ == 0) L.barrier_first = &f;
    if (L.at_barrier == L.nthreads) {
        unsigned count = 0;
        for (unsigned i = 0; i < L.nthreads; ++i) count += (unsigned)L.fibers[i].pred;
        const int r = mode == BarrierMode::Count ? (int)count
                      : mode == BarrierMode::And ? count == L.nthreads
                      : mode == BarrierMode::Or  ? count != 0
                                                 : 0;
        for (unsigned i = 0; i < L.nthreads; ++i) {
            release(L, L.fibers[i]);
            L.fibers[i].barrier_result = r;
        }
        L.at_barrier = 0;
        L.barrier_first = nullptr;
    }
    yield(L, f);  // even the last arrival: who runs next is the schedule's choice
    return f.barrier_result;
}

uint64_t warp_op(Site site, WarpOp op, unsigned mask, uint64_t bits, unsigned bytes, ValueKind kind,
                 int param, int width) {
    Launch& L = running(op_name(op));
    Fiber& f = *L.cur;
    const unsigned count = lanes_in_warp(L, f.warp);
    const unsigned exist = count == 32 ? ~0u : (1u << count) - 1u;
    const char* name = op_name(op);
    if (!(mask >> f.lane & 1u))
        fault(L, fmt("lane %u called %s with mask 0x%08x that excludes itself at ", f.lane, name, mask) +
                     site_str(site));
    if (mask & ~exist)
        fault(L, fmt("%s with mask 0x%08x at ", name, mask) + site_str(site) + ": lanes " +
                     lanes_str(mask & ~exist) +
                     fmt(" do not exist (the block has %u threads; warp %u has %u)", L.nthreads, f.warp,
                         count));
    if (is_shuffle(op) && (width < 1 || width > 32 || (width & (width - 1))))
        fault(L, fmt("%s width %d is not a power of two in [1, 32] at ", name, width) + site_str(site));

    // Lanes already waiting with the same mask form the group this lane joins. A lane waiting
    // under a different mask that names this lane, while this lane's mask names it, waits for
    // this lane while this lane waits for it: a certain deadlock, reported now. (One-sided
    // overlap is legal: the other group may finish first and its lanes come here next.)
    Fiber* base = &L.fibers[f.warp * 32];
    unsigned arrived = 1u << f.lane;
    for (unsigned p = 0; p < count; ++p) {
        const Fiber& o = base[p];
        if (&o == &f || o.state != State::Warp) continue;
        if (o.mask == mask) {
            if (o.op != op || o.bytes != bytes || (is_shuffle(op) && o.width != width))
                fault(L, fmt("lane %u called %s (%u-byte value, width %d) at ", f.lane, name, bytes, width) +
                             site_str(site) +
                             fmt(" while lane %u waits in %s (%u-byte value, width %d) at ", p,
                                 op_name(o.op), o.bytes, o.width) +
                             site_str(o.site) + fmt(" with the same mask 0x%08x", mask));
            arrived |= 1u << p;
        } else if ((o.mask >> f.lane & 1u) && (mask >> p & 1u)) {
            fault(L, fmt("lane %u called %s with mask 0x%08x at ", f.lane, name, mask) + site_str(site) +
                         fmt(" while lane %u waits in %s with mask 0x%08x at ", p, op_name(o.op), o.mask) +
                         site_str(o.site));
        }
    }
    f.state = State::Warp;
    f.site = site;
    f.op = op;
    f.kind = kind;
    f.bytes = bytes;
    f.mask = mask;
    f.param = param;
    f.width = width;
    f.in = bits;
    if (arrived == mask) complete_warp_op(L, base, mask);
    yield(L, f);  // even the last arrival: who runs next is the schedule's choice
    return f.out;
}

}  // namespace flatpeak_emu

extern "C" {

int flatpeak_emu_launch(const flatpeak_emu_config* cfg, flatpeak_emu_thunk thunk, void* ctx, char* message,
                        size_t message_capacity) {
    using namespace flatpeak_emu;
    Launch L;
    if (!cfg || !thunk) fail(L, FLATPEAK_EMU_BAD_CONFIG, "invalid launch: null config or thunk");
    else if (tls_launch) fail(L, FLATPEAK_EMU_BAD_CONFIG, "invalid launch: nested inside a running kernel");
    else {
        L.cfg = *cfg;
        L.thunk = thunk;
        L.ctx = ctx;
        launch(L);
    }
    if (message && message_capacity) snprintf(message, message_capacity, "%s", L.message.c_str());
    return L.code;
}

void flatpeak_emu_register_dynamic_shared(void* base, size_t capacity_bytes) {
    for (const auto& r : flatpeak_emu::tls_regions)
        if (r.base == base) return;
    flatpeak_emu::tls_regions.push_back({static_cast<unsigned char*>(base), capacity_bytes});
}

// Each crate's generated dynamic-shared file registers its visitor from a static constructor;
// several crates may do so, so the runtime keeps a list (mutex: constructors and launches may
// run on any thread).
void flatpeak_emu_add_dynamic_shared_visitor(void (*regions)(void (*visit)(void*, size_t))) {
    std::lock_guard<std::mutex> lock(flatpeak_emu::visitors_mutex());
    auto& list = flatpeak_emu::visitors();
    for (auto f : list)
        if (f == regions) return;
    list.push_back(regions);
}

// Called by code compiled with -fsanitize=bounds (GCC's ABI). Inside a launch the error is
// recorded and the offending fiber stopped before its access; outside one it is printed.
void __ubsan_handle_out_of_bounds(void* data, void* index) {
    flatpeak_emu::out_of_bounds(data, index, false);
}
void __ubsan_handle_out_of_bounds_abort(void* data, void* index) {
    flatpeak_emu::out_of_bounds(data, index, true);
    abort();
}

}  // extern "C"
