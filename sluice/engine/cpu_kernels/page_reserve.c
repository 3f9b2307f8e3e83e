/*
 * Reserving the pages of memory ranges in the background, on a native thread of idle priority.
 *
 * A Python thread would do the same madvise calls but must take the GIL between them, and at
 * idle priority on busy cores it is starved while holding it, and the engine's thread waits for
 * it at each hand-over of the GIL. This thread never touches Python or torch; at exit the
 * process ends it wherever it is (a Python daemon thread ending as the interpreter did made the
 * process abort now and then: "terminate called without an active exception").
 *
 * The handle is shared by the thread and its owner and freed by whichever lets go last
 * (`sluice_reserve_release`), so an owner may drop it while the thread still runs.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23 /* Linux 5.14+ */
#endif

enum { RESERVE_RUNNING = 0, RESERVE_DONE = 1, RESERVE_STOPPED = 2 };

typedef struct {
    int64_t n;
    uint64_t *starts; /* page-aligned */
    uint64_t *lengths;
    int64_t chunk_bytes;   /* one madvise call: short, so the mm lock is held briefly */
    _Atomic int32_t state; /* RESERVE_*, or -errno where madvise failed */
    _Atomic int32_t stop;
    _Atomic int32_t refs;
    double seconds;
} sluice_reservation;

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static void unref(sluice_reservation *r) {
    if (atomic_fetch_sub(&r->refs, 1) == 1) {
        free(r->starts);
        free(r->lengths);
        free(r);
    }
}

static void *reserve_main(void *arg) {
    sluice_reservation *r = arg;
    struct sched_param idle = {0};
    sched_setscheduler(0, SCHED_IDLE, &idle); /* this thread only; best effort */
    double started = now_s();
    int32_t state = RESERVE_DONE;
    for (int64_t i = 0; i < r->n && state == RESERVE_DONE; i++) {
        for (uint64_t off = 0; off < r->lengths[i]; off += (uint64_t)r->chunk_bytes) {
            if (atomic_load(&r->stop)) {
                state = RESERVE_STOPPED;
                break;
            }
            uint64_t len = r->lengths[i] - off;
            if (len > (uint64_t)r->chunk_bytes) len = (uint64_t)r->chunk_bytes;
            if (madvise((void *)(uintptr_t)(r->starts[i] + off), len, MADV_POPULATE_WRITE) != 0) {
                state = -errno;
                break;
            }
        }
    }
    r->seconds = now_s() - started;
    atomic_store(&r->state, state);
    unref(r);
    return NULL;
}

/* Start reserving n ranges (page-aligned starts); NULL where the thread cannot start. */
sluice_reservation *sluice_reserve_start(const uint64_t *starts, const uint64_t *lengths, int64_t n,
                                         int64_t chunk_bytes) {
    sluice_reservation *r = calloc(1, sizeof *r);
    if (r == NULL) return NULL;
    r->starts = malloc(sizeof(uint64_t) * (size_t)(n > 0 ? n : 1));
    r->lengths = malloc(sizeof(uint64_t) * (size_t)(n > 0 ? n : 1));
    if (r->starts == NULL || r->lengths == NULL || chunk_bytes <= 0) goto fail;
    memcpy(r->starts, starts, sizeof(uint64_t) * (size_t)n);
    memcpy(r->lengths, lengths, sizeof(uint64_t) * (size_t)n);
    r->n = n;
    r->chunk_bytes = chunk_bytes;
    atomic_init(&r->state, RESERVE_RUNNING);
    atomic_init(&r->stop, 0);
    atomic_init(&r->refs, 2);
    pthread_attr_t attr;
    pthread_t thread;
    if (pthread_attr_init(&attr) != 0) goto fail;
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    int started = pthread_create(&thread, &attr, reserve_main, r);
    pthread_attr_destroy(&attr);
    if (started != 0) goto fail;
    return r;
fail:
    free(r->starts);
    free(r->lengths);
    free(r);
    return NULL;
}

/* RESERVE_RUNNING, RESERVE_DONE, RESERVE_STOPPED, or -errno of the madvise that failed. */
int32_t sluice_reserve_state(sluice_reservation *r) { return atomic_load(&r->state); }

/* Seconds the thread took, once it is no longer running. */
double sluice_reserve_seconds(sluice_reservation *r) { return r->seconds; }

/* The owner lets go: the thread stops at its next chunk; the handle is invalid after this. */
void sluice_reserve_release(sluice_reservation *r) {
    atomic_store(&r->stop, 1);
    unref(r);
}
