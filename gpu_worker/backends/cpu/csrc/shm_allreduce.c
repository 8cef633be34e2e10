/* The all-reduce of tensor-parallel ranks on one machine, through a shared memory region instead of
 * gloo's loopback TCP (gpu_worker/backends/cpu/shm_allreduce.py maps the region and calls this).
 *
 * Region layout, for ``world`` ranks and pieces of ``piece`` bytes:
 *   flags   world cache lines, rank r's step counter in line r (only rank r writes it)
 *   out     one piece: the summed values, each rank writing its own slice
 *   inputs  world pieces: rank r's values in piece r
 *
 * One piece of the tensor (at most ``piece`` bytes) per round:
 *   1. copy my values into my input piece; counter := 2g + 1; wait until every counter >= 2g + 1
 *   2. sum my slice of the piece over the input pieces, in rank order, into ``out``;
 *      counter := 2g + 2; wait until every counter >= 2g + 2
 *   3. copy ``out`` back into my tensor.
 * Every element is summed by one rank in one order, so every rank gets the same bits. The next
 * round's step 1 writes my input piece only after every rank has passed this round's step 2 (it read
 * the pieces before raising its counter), and step 2 writes ``out`` only after every rank has passed
 * the next step 1, that is finished this round's step 3. Counters are stored with release and read
 * with acquire ordering, so the values written before a counter are seen after it. */
#define _POSIX_C_SOURCE 200809L
#include <sched.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#include "rivulet_kernels.h"

#define LINE 64
#define SPINS_BEFORE_YIELD 4096 /* then each wait gives the core away: ranks may share cores */
#define WAIT_LIMIT_S 300.0      /* a rank that never arrives (it died): fail instead of hanging */

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static int64_t *counter(void *region, int r) { return (int64_t *)((char *)region + (int64_t)r * LINE); }

/* Wait until every rank's counter reached ``target``; 0, or -1 past WAIT_LIMIT_S. */
static int wait_all(void *region, int world, int64_t target) {
    double started = 0.0;
    for (int64_t spins = 0;; spins++) {
        int behind = 0;
        for (int r = 0; r < world; r++) behind |= __atomic_load_n(counter(region, r), __ATOMIC_ACQUIRE) < target;
        if (!behind) return 0;
        if (spins < SPINS_BEFORE_YIELD) {
            cpu_relax();
            continue;
        }
        if (spins == SPINS_BEFORE_YIELD) started = now_s();
        if ((spins & 1023) == 0 && now_s() - started > WAIT_LIMIT_S) return -1;
        sched_yield();
    }
}

/* Bytes of the region for ``world`` ranks and ``piece``-byte pieces. */
int64_t shm_region_bytes(int world, int64_t piece) { return (int64_t)world * LINE + piece * (1 + world); }

/* Sum ``n`` elements of ``data`` (float32: dtype 0, float64: dtype 2) over the ranks, in place.
 * Returns RV_OK, or RV_ERR_TIMEOUT when a rank did not arrive within WAIT_LIMIT_S. */
int shm_all_reduce(void *region, int rank, int world, int64_t piece, void *data, int64_t n, int dtype) {
    const int64_t elem = dtype == 2 ? 8 : 4, per_piece = piece / elem;
    char *out = (char *)region + (int64_t)world * LINE;
    char *inputs = out + piece;
    int64_t *mine = counter(region, rank);
    for (int64_t at = 0; at < n; at += per_piece) {
        const int64_t len = n - at < per_piece ? n - at : per_piece;
        const int64_t g = __atomic_load_n(mine, __ATOMIC_RELAXED) / 2;
        memcpy(inputs + rank * piece, (char *)data + at * elem, (size_t)(len * elem));
        __atomic_store_n(mine, 2 * g + 1, __ATOMIC_RELEASE);
        if (wait_all(region, world, 2 * g + 1)) return RV_ERR_TIMEOUT;
        const int64_t lo = len * rank / world, hi = len * (rank + 1) / world;
        if (dtype == 2) {
            double *sum = (double *)out;
            for (int64_t i = lo; i < hi; i++) {
                double s = 0.0;
                for (int r = 0; r < world; r++) s += ((const double *)(inputs + r * piece))[i];
                sum[i] = s;
            }
        } else {
            float *sum = (float *)out;
            for (int64_t i = lo; i < hi; i++) {
                float s = 0.0f;
                for (int r = 0; r < world; r++) s += ((const float *)(inputs + r * piece))[i];
                sum[i] = s;
            }
        }
        __atomic_store_n(mine, 2 * g + 2, __ATOMIC_RELEASE);
        if (wait_all(region, world, 2 * g + 2)) return RV_ERR_TIMEOUT;
        memcpy((char *)data + at * elem, out, (size_t)(len * elem));
    }
    return 0;
}
