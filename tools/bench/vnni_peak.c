/* This machine's int8 peak with AVX512-VNNI: independent `vpdpbusd` on every thread, nothing
 * else (12 accumulators, in inline assembly so no compiler keeps them in memory). The ceiling for
 * the Q4_K / Q6_K products of a few rows (`vl_nn::stored`, docs/performance.md). Also times the
 * other 512-bit operations those kernels issue per block and row, one kind at a time:
 *   gcc -O2 -fopenmp tools/bench/vnni_peak.c -o /tmp/vnni_peak && OMP_NUM_THREADS=2 /tmp/vnni_peak
 * Prints instructions per ns per core for each, and the `vpdpbusd` rate as int8 ops (2 a
 * multiply-add, 64 multiply-adds an instruction) summed over the threads. */
#include <omp.h>
#include <stdio.h>

#define R12(I) I(0) I(1) I(2) I(3) I(4) I(5) I(6) I(7) I(8) I(9) I(10) I(11)
#define LOOP(BODY)                                                              \
    for (long i = 0; i < iters; i++) __asm__ volatile(R12(BODY) ::: "memory");

static const long iters = 50000000;

static double per_core(int kind) {
    double t0 = omp_get_wtime();
#pragma omp parallel
    {
        switch (kind) {
#define I(n) "vpdpbusd %%zmm30, %%zmm31, %%zmm" #n "\n"
        case 0: LOOP(I) break;
#undef I
#define I(n) "vpdpbusd %%ymm30, %%ymm31, %%ymm" #n "\n"
        case 1: LOOP(I) break;
#undef I
#define I(n) "vpmaddwd %%zmm30, %%zmm31, %%zmm" #n "\n"
        case 2: LOOP(I) break;
#undef I
#define I(n) "vfmadd231ps %%zmm30, %%zmm31, %%zmm" #n "\n"
        case 3: LOOP(I) break;
#undef I
#define I(n) "vcvtdq2ps %%zmm30, %%zmm" #n "\n"
        case 4: LOOP(I) break;
#undef I
#define I(n) "vpunpckldq %%zmm30, %%zmm31, %%zmm" #n "\n"
        case 5: LOOP(I) break;
#undef I
        }
    }
    return 12.0 * iters / (omp_get_wtime() - t0) / 1e9;
}

int main(void) {
    const char *names[] = {"vpdpbusd zmm", "vpdpbusd ymm", "vpmaddwd zmm", "vfmadd231ps zmm", "vcvtdq2ps zmm",
                           "vpunpckldq zmm"};
    int threads = omp_get_max_threads();
    for (int k = 0; k < 6; k++) {
        double rate = per_core(k);
        printf("%-16s %.2f per ns per core", names[k], rate);
        if (k == 0) printf("  -> %.0f Gop/s int8 on %d threads", rate * threads * 64 * 2, threads);
        printf("\n");
    }
    return 0;
}
