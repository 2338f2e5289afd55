/*
 * The floor of a broadcast-and-reply round trip on this machine, in C, with no payload:
 * one writer and 2 reader processes; the writer bumps a shared word and wakes the readers
 * (FUTEX_WAKE), each reader answers on its own word, the writer waits for both answers.
 * `work_us` of busy work on each side per step stands in for what a real queue does per message
 * (Python's pickling and bookkeeping cost 10-20 us a side). Optional spinning before each sleep.
 *
 *   broadcast_floor <work_us> <spin_iterations>    prints: median and p99 round trip in us
 */
#include <linux/futex.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define STEPS 20000
#define READERS 2

static long futex(volatile uint32_t *addr, int op, uint32_t val) {
    return syscall(SYS_futex, addr, op, val, NULL, NULL, 0);
}

static double now_us(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}

static void busy(int us) {
    const double end = now_us() + us;
    while (now_us() < end) {
    }
}

/* Wait until *word == want: spin `spin` times, then sleep in the kernel. */
static void wait_for(volatile uint32_t *word, uint32_t want, int spin) {
    uint32_t seen;
    for (int s = 0; (seen = *word) != want; s++) {
        if (s < spin) {
            __builtin_ia32_pause();
            continue;
        }
        futex(word, FUTEX_WAIT, seen); /* returns at once if the word moved on since */
    }
}

static int cmp(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

int main(int argc, char **argv) {
    const int work = argc > 1 ? atoi(argv[1]) : 0, spin = argc > 2 ? atoi(argv[2]) : 0;
    volatile uint32_t *shm = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS,
                                  -1, 0);
    volatile uint32_t *bcast = shm, *reply[READERS] = {shm + 16, shm + 32};
    for (int r = 0; r < READERS; r++) {
        if (fork() == 0) {
            for (uint32_t i = 1; i <= STEPS; i++) {
                wait_for(bcast, i, spin);
                busy(work);
                *reply[r] = i;
                futex(reply[r], FUTEX_WAKE, 1);
            }
            _exit(0);
        }
    }
    double *lat = malloc(STEPS * sizeof(double));
    for (uint32_t i = 1; i <= STEPS; i++) {
        const double t0 = now_us();
        busy(work);
        *bcast = i;
        futex(bcast, FUTEX_WAKE, READERS);
        for (int r = 0; r < READERS; r++) wait_for(reply[r], i, spin);
        busy(work);
        lat[i - 1] = now_us() - t0;
    }
    while (wait(NULL) > 0) {
    }
    qsort(lat, STEPS, sizeof(double), cmp);
    printf("%.1f %.1f\n", lat[STEPS / 2], lat[STEPS * 99 / 100]);
    return 0;
}
