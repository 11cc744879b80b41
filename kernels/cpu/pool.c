/* Helper threads for the native CPU kernels: `hs_parallel` runs parts
 * 0 … parts - 1 of a job, the caller taking part 0 and the others claimed one
 * at a time by helper threads or by the caller once its own is done, so a
 * helper that is asleep or off its core holds up nothing it has not started.
 * `hs_set_threads` (kept at torch's intra-op thread count by
 * `cpu_native.sync_threads`) says how many threads a job may use.
 *
 * Helpers are started on first need and kept. After a job they stay awake for
 * SPIN_NS (a forward's jobs follow each other within microseconds, and the
 * next decode step's first job comes after the host's work between steps),
 * then sleep on a condition variable; a job wakes them through it only when
 * one sleeps, so a forward's jobs cost an atomic store each to start and the
 * helpers' claims. Awake and idle, a helper (and a caller waiting for the
 * helpers' parts) looks for work between calls to sched_yield, not pause
 * instructions: where more threads are runnable than there are cores (torch's
 * own OpenMP threads between our jobs, another process), a pausing thread
 * holds its core for its whole time slice and the thread it waits for, or the
 * caller's serial work, runs on what is left; a yielding one hands the core
 * over and still sees a job within a system call's time on an idle core. A
 * job no helper has claimed within CLAIM_NS goes back to its caller whole
 * (`hs_parallel` returns 0). A long job (`hs_parallel_long`: a prefill's
 * product, milliseconds on one core) is not taken back: its caller starts
 * its part at once and then runs the parts no helper has claimed, so a
 * helper that claims late (its core held a while by torch's OpenMP workers
 * spinning after their own work) still shortens the job.
 * A job may have more parts than threads (`hs_parallel_units`' long jobs): the
 * threads claim them in turn, so a helper that claims late, or a part slower
 * than the others, leaves less for the caller to run alone.
 * One job uses the helpers at a time: a job
 * submitted while they serve another (another Python thread: the C calls
 * release the GIL) gets 0 back and runs on its caller. A forked child starts
 * with no helpers and makes its own.
 *
 * Pinning (`hs_set_pinning`, off by default): each helper is bound to one CPU
 * of the process's affinity mask other than the one its first caller ran on,
 * helper k to the k-th of those after it, so the helpers never migrate and
 * never share a core with each other or, while it stays, the caller. The
 * caller itself is not bound: it is the host's Python thread, whose torch
 * work and whatever else the process runs on it keep the scheduler's choice.
 * A helper with no CPU of its own left (more threads than CPUs) keeps the
 * whole mask. Off by default, as llama.cpp's threads are: processes that share
 * a mask would bind their helpers to the same CPUs, with no way out.
 *
 * A part must not depend on which thread runs it or in what order, so the
 * results do not depend on the thread count. Built with the other kernels by
 * `cpu/native.py`; used by `cpu/rows.c` (the products), `cpu/quant.c`, the recurrences
 * (`cpu/mamba2.c`, `cpu/mamba1.c`, `cpu/gdn.c`) and the attention (`cpu/blocks.c`).
 */
#define _GNU_SOURCE /* pthread_attr_setaffinity_np, pthread_setname_np, sched_getcpu, CPU_SET */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <time.h>

#include "kernels.h"

#define MAX_THREADS 64
#define CLAIM_NS 10000 /* how long a caller waits for a helper to claim a part before it takes the job back */
#define SPIN_NS 3000000 /* how long an idle helper stays awake before it sleeps: a few decode steps' host work */
/* hs_parallel_units: the work (floats of state updated) from which a job is long, a prefill's recurrence
 * (milliseconds; a decode step's is below), and the parts per thread it then takes */
#define LONG_WORK (1 << 22)
#define PARTS_PER_THREAD 4

/* pool.ticket: the job's generation (bits 32-63), its parts (16-31) and the next unclaimed part (0-15) */
#define TICKET(generation, parts, next) ((uint64_t)(generation) << 32 | (uint64_t)(parts) << 16 | (uint64_t)(next))
#define TICKET_GENERATION(t) ((uint32_t)((t) >> 32))
#define TICKET_PARTS(t) ((int)((t) >> 16 & 0xffff))
#define TICKET_NEXT(t) ((int)((t) & 0xffff))

static struct {
    pthread_mutex_t lock;     /* guards the helpers' sleep and the wake-up of sleepers */
    pthread_cond_t wake;
    pthread_mutex_t busy;     /* held by the caller of a job */
    _Atomic uint64_t ticket;  /* the job's generation and claims (TICKET) */
    atomic_int done;          /* claimed parts finished */
    atomic_int wanted;        /* threads a job may use */
    atomic_int sleepers;      /* helpers asleep or about to sleep on `wake` (changed under `lock`) */
    int started;              /* helpers running */
    pthread_t helpers[MAX_THREADS];
    int pin;                  /* bind each helper to one CPU (hs_set_pinning) */
    int home;                 /* the CPU the caller ran on when the helpers were first bound, -1 before */
    hs_part_fn fn;            /* the job, written before the ticket that names it */
    void *ctx;
} pool = {.lock = PTHREAD_MUTEX_INITIALIZER, .wake = PTHREAD_COND_INITIALIZER, .busy = PTHREAD_MUTEX_INITIALIZER,
            .wanted = 1, .pin = 0, .home = -1};

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* a part of the current job (its parts in *parts), or -1 when none is left;
 * the job stays the claimed ticket's while the part is unfinished */
static int claim_part(int *parts) {
    uint64_t t = atomic_load(&pool.ticket);
    while (TICKET_NEXT(t) < TICKET_PARTS(t))
        if (atomic_compare_exchange_weak(&pool.ticket, &t, t + 1)) {
            *parts = TICKET_PARTS(t);
            return TICKET_NEXT(t);
        }
    return -1;
}

static void run_claimed(void) {
    for (int part, parts; (part = claim_part(&parts)) >= 0;) {
        pool.fn(pool.ctx, part, parts);
        atomic_fetch_add(&pool.done, 1);
    }
}

/* arg: the generation before the helper's first job */
static void *helper(void *arg) {
    uint32_t seen = (uint32_t)(uintptr_t)arg;
    for (;;) {
        uint32_t now = TICKET_GENERATION(atomic_load(&pool.ticket));
        for (int64_t until = now == seen ? now_ns() + SPIN_NS : 0; now == seen && now_ns() < until;) {
            sched_yield();
            now = TICKET_GENERATION(atomic_load(&pool.ticket));
        }
        if (now == seen) {
            /* counted before the generation is read again: a caller that then reads no sleeper has
             * stored its ticket before (both sequentially consistent), so the read below sees it */
            pthread_mutex_lock(&pool.lock);
            atomic_fetch_add(&pool.sleepers, 1);
            while ((now = TICKET_GENERATION(atomic_load(&pool.ticket))) == seen) pthread_cond_wait(&pool.wake, &pool.lock);
            atomic_fetch_sub(&pool.sleepers, 1);
            pthread_mutex_unlock(&pool.lock);
        }
        seen = now;
        run_claimed();
    }
    return 0;
}

/* helper k's CPUs: the k-th of the process's CPUs after pool.home (wrapping, home itself left out),
 * or the whole mask when pinning is off or there are not k + 1 such CPUs */
static void helper_cpus(int k, cpu_set_t *cpus) {
    cpu_set_t mask;
    CPU_ZERO(cpus);
    if (sched_getaffinity(0, sizeof mask, &mask)) { /* cannot read it: every CPU */
        for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) CPU_SET(cpu, cpus);
        return;
    }
    *cpus = mask;
    if (!pool.pin) return;
    if (pool.home < 0 || !CPU_ISSET(pool.home, &mask)) pool.home = sched_getcpu();
    int others[CPU_SETSIZE], count = 0, after = 0;
    for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) {
        if (!CPU_ISSET(cpu, &mask) || cpu == pool.home) continue;
        if (cpu < pool.home) ++after; /* the ones before home come last */
        others[count++] = cpu;
    }
    if (k >= count) return;
    CPU_ZERO(cpus);
    CPU_SET(others[(after + k) % count], cpus);
}

static void bind_helpers(void) { /* after a change of pinning: every started helper to its CPUs */
    pool.home = -1;
    for (int k = 0; k < pool.started; ++k) {
        cpu_set_t cpus;
        helper_cpus(k, &cpus);
        pthread_setaffinity_np(pool.helpers[k], sizeof cpus, &cpus);
    }
}

static void forget_helpers(void) { /* in a forked child: the helpers stayed in the parent */
    pthread_mutex_init(&pool.lock, 0);
    pthread_cond_init(&pool.wake, 0);
    pthread_mutex_init(&pool.busy, 0);
    pool.started = 0;
    pool.home = -1;
    atomic_store(&pool.sleepers, 0);
}

int hs_set_threads(int threads) {
    static int registered = 0;
    if (!registered) {
        pthread_atfork(0, 0, forget_helpers);
        registered = 1;
    }
    atomic_store(&pool.wanted, threads < 1 ? 1 : threads > MAX_THREADS ? MAX_THREADS : threads);
    return atomic_load(&pool.wanted);
}

int hs_threads(void) { return atomic_load(&pool.wanted); }

int hs_set_pinning(int on) {
    pthread_mutex_lock(&pool.busy); /* no job runs while the helpers move */
    pool.pin = on != 0;
    bind_helpers();
    pthread_mutex_unlock(&pool.busy);
    return pool.pin;
}

static int parallel(hs_part_fn fn, void *ctx, int parts, int take_back) {
    if (parts > MAX_THREADS) parts = MAX_THREADS;
    const int wanted = atomic_load(&pool.wanted), threads = parts < wanted ? parts : wanted;
    if (parts < 2 || pthread_mutex_trylock(&pool.busy)) return 0;
    const uint32_t generation = TICKET_GENERATION(atomic_load(&pool.ticket));
    while (pool.started < threads - 1) { /* more parts than threads: the threads claim them in turn */
        pthread_t thread;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        cpu_set_t cpus;
        helper_cpus(pool.started, &cpus);
        pthread_attr_setaffinity_np(&attr, sizeof cpus, &cpus);
        const int failed = pthread_create(&thread, &attr, helper, (void *)(uintptr_t)generation);
        pthread_attr_destroy(&attr);
        if (failed) break;
        pthread_setname_np(thread, "hs-helper");
        pool.helpers[pool.started++] = thread;
    }
    if (pool.started == 0) { /* no helper could start */
        pthread_mutex_unlock(&pool.busy);
        return 0;
    }
    pool.fn = fn;
    pool.ctx = ctx;
    atomic_store(&pool.done, 0);
    atomic_store(&pool.ticket, TICKET(generation + 1, parts, 1)); /* part 0 is the caller's */
    if (atomic_load(&pool.sleepers)) { /* under the lock: a helper between its count and its wait hears it */
        pthread_mutex_lock(&pool.lock);
        pthread_cond_broadcast(&pool.wake);
        pthread_mutex_unlock(&pool.lock);
    }
    /* No helper claimed a part within CLAIM_NS (its core held by other work, or asleep): take the
     * whole job back and let the caller run it as one part. Alone, the caller would otherwise run
     * the parts one after another, each a narrower pass over a product's weight rows than one
     * pass, or wait for a helper that claims a part late. Where a helper is awake on its own
     * core it claims within a sched_yield call, and its part ends the job either way. */
    for (const int64_t until = now_ns() + CLAIM_NS; take_back && TICKET_NEXT(atomic_load(&pool.ticket)) == 1;) {
        if (now_ns() > until) {
            uint64_t posted = TICKET(generation + 1, parts, 1);
            if (atomic_compare_exchange_strong(&pool.ticket, &posted, TICKET(generation + 1, parts, parts))) {
                pthread_mutex_unlock(&pool.busy);
                return 0;
            }
            break;
        }
    }
    fn(ctx, 0, parts);
    run_claimed();
    while (atomic_load(&pool.done) < parts - 1) sched_yield();
    pthread_mutex_unlock(&pool.busy);
    return 1;
}

int hs_parallel(hs_part_fn fn, void *ctx, int parts) { return parallel(fn, ctx, parts, 1); }

int hs_parallel_long(hs_part_fn fn, void *ctx, int parts) { return parallel(fn, ctx, parts, 0); }

int hs_parallel_units(hs_part_fn fn, void *ctx, int64_t units, int64_t work, int64_t min_work) {
    const int64_t threads = hs_threads();
    if (threads < 2 || units < 2 || work < min_work) return 0;
    if (work < LONG_WORK) return hs_parallel(fn, ctx, (int)(threads < units ? threads : units));
    const int64_t parts = PARTS_PER_THREAD * threads < units ? PARTS_PER_THREAD * threads : units;
    return hs_parallel_long(fn, ctx, (int)(parts < MAX_THREADS ? parts : MAX_THREADS));
}
