/* Work split for the weight-streaming loops: each thread owns a contiguous range of blocks (as
   OpenMP's schedule(static) gives it, so each thread's weights stream in order), takes its own
   blocks from the front, and when its range is done takes blocks from the tails of the others'.

   Why: a decode step on 2 cores runs ~150 parallel regions (5 per layer), each ending in a
   barrier, and with a static split every barrier waits for the slower thread. `perf` of a batch-1
   int8 step (Zen 4 EPYC, 2 threads) showed the loop thread waiting 9% of the step at those
   barriers for its worker; a thread preempted by another process (the HTTP thread of
   `engine serve`, a noisy neighbour) stalls the other for the whole slice. Interleaved dynamic
   scheduling (schedule(dynamic)) fixed the balance but broke each thread's stream: 6.4 -> 10 ms
   for the 30 layers. Stealing from the tail keeps the streams and moves only the last blocks.
   Against schedule(static), both builds in one engine taking alternate decode steps
   (profiling/bench_native_ab.py --base 9178918; Zen 4 EPYC, 2 threads, the default model at
   batch 1, 900 steps, median of the 30 layers): bf16 9.37 -> 8.72 ms, int8 8.00 -> 7.43 ms;
   under ENGINE_CPU_ISA=avx2 float32 with bf16 weights 16.34 -> 15.96 ms, int8 6.93 -> 6.67.

   Which thread computes a block never changes its bits: every block's rows are computed whole by
   one thread with the same code, so results stay batch- and thread-invariant.

   The state lives on the caller's stack, one cache line per range (the owner's line moves only
   when it is stolen from). Usage (STEAL_FOR, below, at most once per scope):

       STEAL_FOR(blk, num_threads, blocks) { ... block blk (an int64_t) ... }

   A team smaller than `threads` (OpenMP may give fewer) is fine: the missing threads' ranges are
   stolen whole. */
#ifndef ENGINE_STEAL_H
#define ENGINE_STEAL_H

#include <stdint.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define STEAL_MAX_PARTS 64

typedef struct {
    _Alignas(64) uint64_t v; /* next block to take from the front (low 32 bits), end (high 32) */
} StealRange;

typedef struct {
    int self, parts, victim; /* victim: the range being taken from (self first) */
} StealCursor;

/* Splits `blocks` (< 2^32) into min(threads, STEAL_MAX_PARTS) contiguous ranges, as
   schedule(static) would; returns that count (>= 1). */
static inline int steal_init(StealRange *r, int threads, int64_t blocks) {
    const int parts = threads < 1 ? 1 : (threads > STEAL_MAX_PARTS ? STEAL_MAX_PARTS : threads);
    for (int t = 0; t < parts; t++) {
        const uint64_t lo = (uint64_t)(blocks * t / parts);
        const uint64_t hi = (uint64_t)(blocks * (t + 1) / parts);
        __atomic_store_n(&r[t].v, lo | (hi << 32), __ATOMIC_RELAXED);
    }
    return parts;
}

static inline StealCursor steal_cursor(int parts) {
#ifdef _OPENMP
    const int self = omp_get_thread_num();
#else
    const int self = 0;
#endif
    StealCursor c = {self < parts ? self : 0, parts, self < parts ? self : 0};
    return c;
}

/* The next block for this thread: from the front of its own range, then from the back of the
   others' in turn; -1 when every range is empty. */
static inline int64_t steal_next(StealRange *r, StealCursor *c) {
    for (int tried = 0; tried < c->parts;) {
        uint64_t v = __atomic_load_n(&r[c->victim].v, __ATOMIC_RELAXED);
        for (;;) {
            const uint64_t lo = v & 0xffffffffu, hi = v >> 32;
            if (lo >= hi) break;
            const int own = c->victim == c->self;
            const uint64_t next = own ? (lo + 1) | (hi << 32) : lo | ((hi - 1) << 32);
            if (__atomic_compare_exchange_n(&r[c->victim].v, &v, next, 1, __ATOMIC_RELAXED,
                                            __ATOMIC_RELAXED))
                return (int64_t)(own ? lo : hi - 1);
        }
        c->victim = (c->victim + 1) % c->parts;
        tried++;
    }
    return -1;
}

/* Runs the statement after it for every block 0 <= blk < blocks, on an OpenMP team of up to
   `threads`, each thread taking its own range and then the others' tails (above). */
#define STEAL_FOR(blk, threads, blocks)                                                           \
    StealRange steal_ranges_[STEAL_MAX_PARTS];                                                    \
    const int steal_parts_ = steal_init(steal_ranges_, (threads), (blocks));                      \
    _Pragma("omp parallel num_threads(steal_parts_)")                                             \
    for (StealCursor steal_cur_ = steal_cursor(steal_parts_), *steal_once_ = &steal_cur_;         \
         steal_once_; steal_once_ = NULL)                                                         \
        for (int64_t blk; (blk = steal_next(steal_ranges_, &steal_cur_)) >= 0;)

#endif
