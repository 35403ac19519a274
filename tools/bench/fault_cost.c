/* The cost of first touching fresh anonymous memory (page faults, the kernel zeroing each page)
 * against rewriting the same memory once it is mapped: what an allocation of a large buffer
 * costs before any work is done in it.
 *
 *   gcc -O2 tools/bench/fault_cost.c -o /tmp/fault_cost && /tmp/fault_cost [MIB]
 *
 * Maps MIB (default 1600) of anonymous memory three times, writes one byte a 4 KiB page (the
 * faults), then memsets the whole buffer (the rewrite); one thread. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char **argv) {
    size_t n = (size_t)(argc > 1 ? atol(argv[1]) : 1600) << 20;
    for (int r = 0; r < 3; r++) {
        char *p = mmap(0, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (p == MAP_FAILED) {
            perror("mmap");
            return 1;
        }
        double t0 = now();
        for (size_t i = 0; i < n; i += 4096) p[i] = 1;
        double t1 = now();
        memset(p, 2, n);
        double t2 = now();
        printf("%zu MiB: first touch %.3f s (%.2f us a 4 KiB page), rewrite %.3f s\n", n >> 20, t1 - t0,
               (t1 - t0) / (n / 4096) * 1e6, t2 - t1);
        munmap(p, n);
    }
    return 0;
}
