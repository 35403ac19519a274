/* This machine's read bandwidth: every thread sums its share of a buffer far larger than the
 * caches, with wide loads and several independent sums, nothing else. The wall a decode step
 * meets (it reads every weight once per token; docs/performance.md). Build and run:
 *   gcc -O2 -march=native -fopenmp tools/bench/read_bandwidth.c -o /tmp/read_bw && OMP_NUM_THREADS=2 /tmp/read_bw [MiB]
 * Default 1024 MiB, touched once first (so no page is faulted inside a timed pass); best of 7
 * passes; prints GB/s (10^9 bytes a second). */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int main(int argc, char **argv) {
    size_t mib = argc > 1 ? strtoul(argv[1], NULL, 10) : 1024;
    size_t bytes = mib << 20;
    size_t n = bytes / 64; /* 64-byte lines */
    uint64_t *buf = aligned_alloc(64, bytes);
    if (!buf) {
        fprintf(stderr, "cannot allocate %zu MiB\n", mib);
        return 1;
    }
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < bytes / 8; i++) buf[i] = i;
    double best = 1e30;
    uint64_t sink = 0;
    for (int pass = 0; pass < 7; pass++) {
        double t0 = omp_get_wtime();
        uint64_t total = 0;
#pragma omp parallel reduction(+ : total)
        {
#ifdef __AVX512F__
            __m512i s0 = _mm512_setzero_si512(), s1 = s0, s2 = s0, s3 = s0;
#pragma omp for schedule(static)
            for (size_t i = 0; i < n / 4; i++) {
                const __m512i *p = (const __m512i *)(buf + i * 32);
                s0 = _mm512_add_epi64(s0, _mm512_load_si512(p));
                s1 = _mm512_add_epi64(s1, _mm512_load_si512(p + 1));
                s2 = _mm512_add_epi64(s2, _mm512_load_si512(p + 2));
                s3 = _mm512_add_epi64(s3, _mm512_load_si512(p + 3));
            }
            total += _mm512_reduce_add_epi64(_mm512_add_epi64(_mm512_add_epi64(s0, s1), _mm512_add_epi64(s2, s3)));
#else
            __m256i s0 = _mm256_setzero_si256(), s1 = s0, s2 = s0, s3 = s0;
#pragma omp for schedule(static)
            for (size_t i = 0; i < n / 2; i++) {
                const __m256i *p = (const __m256i *)(buf + i * 16);
                s0 = _mm256_add_epi64(s0, _mm256_load_si256(p));
                s1 = _mm256_add_epi64(s1, _mm256_load_si256(p + 1));
                s2 = _mm256_add_epi64(s2, _mm256_load_si256(p + 2));
                s3 = _mm256_add_epi64(s3, _mm256_load_si256(p + 3));
            }
            uint64_t lanes[4];
            _mm256_storeu_si256((__m256i *)lanes, _mm256_add_epi64(_mm256_add_epi64(s0, s1), _mm256_add_epi64(s2, s3)));
            total += lanes[0] + lanes[1] + lanes[2] + lanes[3];
#endif
        }
        double t = omp_get_wtime() - t0;
        sink += total;
        if (t < best) best = t;
    }
    printf("read bandwidth: %.1f GB/s (%zu MiB, %d threads, best of 7; checksum %llu)\n", bytes / best / 1e9, mib,
           omp_get_max_threads(), (unsigned long long)(sink % 9973));
    free(buf);
    return 0;
}
