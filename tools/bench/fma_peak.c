/* This machine's f32 FMA peak: independent fused multiply-adds on every thread, nothing else.
 * The ceiling for the vision tower's GEMMs (docs/performance.md). Build and run both widths:
 *   gcc -O3 -funroll-loops -mavx512f -fopenmp tools/bench/fma_peak.c -o /tmp/fma512 && OMP_NUM_THREADS=2 /tmp/fma512
 *   gcc -O3 -funroll-loops -mavx2 -mfma -fopenmp tools/bench/fma_peak.c -o /tmp/fma256 && OMP_NUM_THREADS=2 /tmp/fma256
 * AVX-512: 24 accumulators of 16 lanes; AVX2: 12 of 8 (what gemm's micro-kernels keep live). */
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>

#ifdef __AVX512F__
#define ACC 24
#define LANES 16
typedef __m512 vec;
#define SET1 _mm512_set1_ps
#define FMA _mm512_fmadd_ps
#define STORE _mm512_storeu_ps
#else
#define ACC 12
#define LANES 8
typedef __m256 vec;
#define SET1 _mm256_set1_ps
#define FMA _mm256_fmadd_ps
#define STORE _mm256_storeu_ps
#endif

int main(void) {
    const long iters = 200000000;
    double t0 = omp_get_wtime();
    float sink = 0;
#pragma omp parallel reduction(+ : sink)
    {
        vec a[ACC];
        for (int i = 0; i < ACC; i++) a[i] = SET1(i * 0.001f);
        vec b = SET1(0.9999f), c = SET1(0.0001f);
        for (long n = 0; n < iters; n++)
            /* Unrolled whole, so the accumulators stay in registers: without it gcc 12 at -O3
             * kept them in memory (a load and a store per FMA) and reported half the AVX-512 peak
             * (175 GFLOP/s on a 2-core Xeon whose gemm ran at 335). */
#pragma GCC unroll 32
            for (int i = 0; i < ACC; i++) a[i] = FMA(a[i], b, c);
        for (int i = 0; i < ACC; i++) {
            float t[LANES];
            STORE(t, a[i]);
            sink += t[0];
        }
    }
    double dt = omp_get_wtime() - t0;
    int threads = omp_get_max_threads();
    printf("%d-lane FMA, %d threads: %.1f GFLOP/s (checksum %g)\n", LANES, threads,
           threads * (double)iters * ACC * LANES * 2 / dt / 1e9, sink);
    return 0;
}
