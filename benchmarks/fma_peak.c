// This core's float32 multiply-add peak: 24 independent accumulators (registers only,
// no memory), each thread multiply-adding into them in turn; prints GFLOP/s, the best
// of five runs. What a tile loop could reach at most, beside the GEMM ceiling that
// libraries reach (tokenmill.bench.ceilings).
//
//     gcc -O2 -march=native -fopenmp benchmarks/fma_peak.c -o /tmp/fma_peak
//     OMP_NUM_THREADS=2 /tmp/fma_peak
#include <omp.h>
#include <stdio.h>
#include <time.h>

#if defined(__AVX512F__)
#define LANES 16
#else
#define LANES 8
#endif
typedef float vf __attribute__((vector_size(LANES * sizeof(float))));

#define ACC(i) vf a##i = x + (float)(i);
#define FMA(i) a##i = a##i * x + w;
#define SUM(i) + a##i[0]
#define EACH(F) F(0) F(1) F(2) F(3) F(4) F(5) F(6) F(7) F(8) F(9) F(10) F(11) \
    F(12) F(13) F(14) F(15) F(16) F(17) F(18) F(19) F(20) F(21) F(22) F(23)

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(void) {
  const long iterations = 100000000;  // per thread
  double best = 0, check = 0;
  const int threads = omp_get_max_threads();
  for (int run = 0; run < 5; ++run) {
    const double started = now();
#pragma omp parallel reduction(+ : check)
    {
      vf x = {0}, w = {0};
      x += 0.9999f;
      w += 1e-7f;
      EACH(ACC)
      for (long i = 0; i < iterations; ++i) {
        EACH(FMA)
        __asm__("" : "+x"(x));  // x unknown to the compiler each pass
      }
      check += 0 EACH(SUM);
    }
    const double rate = threads * iterations * 24.0 * LANES * 2 / (now() - started) / 1e9;
    if (rate > best) best = rate;
  }
  printf("%d threads, %d lanes: %.1f GFLOP/s multiply-add peak (check %g)\n", threads, LANES,
         best, check);
  return 0;
}
