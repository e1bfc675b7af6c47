/* server._cpu_kernels' thread pool: pool_run runs a call's parts on a small pool of pthreads (started on
first use, spinning briefly after a call, then sleeping; a fork()ed child starts its own). It only
schedules: how a kernel cuts its work into parts, and that no part's cut changes a bit, is the
kernel's business (part_range and parts_for, in _cpu_kernels.h, are the usual cuts). The module's
contract is the comment at the top of _cpu_kernels.c. */
#include "_cpu_kernels.h"

#define SPIN_NS 200000    /* how long an idle worker (or a waiting caller) spins before sleeping */

/* ---------------------------------------------------------------------------------------------
   Thread pool. Workers 1..size run parts of one call at a time (the caller runs part 0 and any
   part beyond the workers it has); the call mutex serialises callers. Every worker checks in for
   every call (pending counts all of them), so no worker can see one call's generation with the
   next call's fields. */

static struct {
    pthread_mutex_t call, mu;
    pthread_cond_t wake, done;
    int size;
    unsigned long gen;  /* bumped under mu to start a call; read atomically by spinning workers */
    part_fn fn;
    void *ctx;
    int nparts;
    int pending;        /* workers yet to check in for the current call */
    unsigned long start_gen[MAX_THREADS];
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER,
          PTHREAD_COND_INITIALIZER, 0, 0, NULL, NULL, 0, 0, {0}};

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static inline void cpu_relax(void) {
#if HAVE_X86
    _mm_pause();
#endif
}

static void *worker_main(void *arg) {
    int id = (int)(intptr_t)arg;
    unsigned long seen = pool.start_gen[id];  /* written before this thread was created */
    for (;;) {
        unsigned long g;
        uint64_t t0 = now_ns();
        unsigned spins = 0;
        while ((g = __atomic_load_n(&pool.gen, __ATOMIC_ACQUIRE)) == seen) {
            cpu_relax();
            if ((++spins & 63) == 0 && now_ns() - t0 > SPIN_NS) {
                pthread_mutex_lock(&pool.mu);
                while ((g = __atomic_load_n(&pool.gen, __ATOMIC_ACQUIRE)) == seen)
                    pthread_cond_wait(&pool.wake, &pool.mu);
                pthread_mutex_unlock(&pool.mu);
                break;
            }
        }
        seen = g;
        if (id < pool.nparts) pool.fn(pool.ctx, id, pool.nparts);
        if (__atomic_sub_fetch(&pool.pending, 1, __ATOMIC_ACQ_REL) == 0) {
            pthread_mutex_lock(&pool.mu);
            pthread_cond_signal(&pool.done);
            pthread_mutex_unlock(&pool.mu);
        }
    }
    return NULL;
}

/* Start workers until there are `want` (fewer if the system refuses); called holding pool.call. */
static void ensure_workers(int want) {
    while (pool.size < want) {
        int id = pool.size + 1;
        pthread_t tid;
        pthread_attr_t attr;
        pool.start_gen[id] = pool.gen;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int rc = pthread_create(&tid, &attr, worker_main, (void *)(intptr_t)id);
        pthread_attr_destroy(&attr);
        if (rc != 0) return;  /* the caller runs the parts no worker takes */
        pool.size = id;
    }
}

/* Run fn(ctx, part, nparts) for every part in 0..nparts-1, on up to nparts threads; returns when
   all are done. Called without the GIL. */
void pool_run(part_fn fn, void *ctx, int nparts) {
    if (nparts <= 1) {
        fn(ctx, 0, 1);
        return;
    }
    pthread_mutex_lock(&pool.call);
    ensure_workers(nparts - 1 < MAX_THREADS - 1 ? nparts - 1 : MAX_THREADS - 1);
    pthread_mutex_lock(&pool.mu);
    pool.fn = fn;
    pool.ctx = ctx;
    pool.nparts = nparts;
    pool.pending = pool.size;
    __atomic_add_fetch(&pool.gen, 1, __ATOMIC_RELEASE);
    pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.mu);
    fn(ctx, 0, nparts);
    for (int p = pool.size + 1; p < nparts; p++) fn(ctx, p, nparts);
    uint64_t t0 = now_ns();
    unsigned spins = 0;
    while (__atomic_load_n(&pool.pending, __ATOMIC_ACQUIRE) > 0) {
        cpu_relax();
        if ((++spins & 63) == 0 && now_ns() - t0 > SPIN_NS) {
            pthread_mutex_lock(&pool.mu);
            while (__atomic_load_n(&pool.pending, __ATOMIC_ACQUIRE) > 0) pthread_cond_wait(&pool.done, &pool.mu);
            pthread_mutex_unlock(&pool.mu);
            break;
        }
    }
    pthread_mutex_unlock(&pool.call);
}

/* A fork()ed child has none of the parent's workers: forget them (and any lock a parent thread held). */
void pool_after_fork_child(void) {
    pthread_mutex_init(&pool.call, NULL);
    pthread_mutex_init(&pool.mu, NULL);
    pthread_cond_init(&pool.wake, NULL);
    pthread_cond_init(&pool.done, NULL);
    pool.size = 0;
    pool.pending = 0;
}
