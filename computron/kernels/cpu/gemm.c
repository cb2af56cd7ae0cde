/* The block matmul of ``gemm.py``: its register tiles per vector width, and the helper threads.

   Kept apart from ``gemm.py`` (which builds, checks, times and calls it) because it is a program of its own.
   The tiles are described in ``gemm.py``'s docstring. The helpers (``computron_gemm_lend``, Linux only) are
   threads of the worker process at idle priority (``SCHED_IDLE``: whatever else wants their core runs first)
   on the cores no worker holds; a product of at least ``MIN_BLOCKS`` blocks is shared with them chunk by chunk,
   each output block computed by the same tile code as alone (the same sums: results equal bit for bit), and a
   chunk a helper has not finished when the caller runs out of work is computed by the caller again, so a
   helper set aside by the scheduler never delays the product; the source's comment says how. */
#define _GNU_SOURCE
#include <string.h>

#if defined(__AVX512F__)
/* 32 vector registers of 16 floats: a tile of up to 8 rows keeps its accumulators in registers */
typedef float v16 __attribute__((vector_size(64)));
static inline v16 ld(const float* p) { v16 v; memcpy(&v, p, 64); return v; }
static inline void st(float* p, v16 v) { memcpy(p, &v, 64); }

/* one block (16 output features): MT rows, K split over two accumulators per row */
#define ONE(MT)                                                                                      \
static void one_##MT(const float* x, const float* p, const float* b, float* y, long ldy, long K) {   \
  v16 a0[MT], a1[MT];                                                                                \
  for (int i = 0; i < MT; i++) a0[i] = a1[i] = (v16){0};                                             \
  long k = 0;                                                                                        \
  for (; k + 2 <= K; k += 2) {                                                                       \
    v16 w0 = ld(p + k * 16), w1 = ld(p + k * 16 + 16);                                               \
    _Pragma("GCC unroll 8") for (int i = 0; i < MT; i++) {                                           \
      a0[i] += x[i * K + k] * w0; a1[i] += x[i * K + k + 1] * w1;                                    \
    }                                                                                                \
  }                                                                                                  \
  for (; k < K; k++) {                                                                               \
    v16 w0 = ld(p + k * 16);                                                                         \
    for (int i = 0; i < MT; i++) a0[i] += x[i * K + k] * w0;                                         \
  }                                                                                                  \
  v16 bias = b ? ld(b) : (v16){0};                                                                   \
  for (int i = 0; i < MT; i++) st(y + i * ldy, a0[i] + a1[i] + bias);                                \
}

/* two blocks side by side (32 output features): MT rows, two products per activation load */
#define TWO(MT)                                                                                      \
static void two_##MT(const float* x, const float* p, const float* b, float* y, long ldy, long K) {   \
  v16 a0[MT], a1[MT];                                                                                \
  for (int i = 0; i < MT; i++) a0[i] = a1[i] = (v16){0};                                             \
  const float* q = p + K * 16;                                                                       \
  for (long k = 0; k < K; k++) {                                                                     \
    v16 w0 = ld(p + k * 16), w1 = ld(q + k * 16);                                                    \
    _Pragma("GCC unroll 8") for (int i = 0; i < MT; i++) {                                           \
      float xi = x[i * K + k]; a0[i] += xi * w0; a1[i] += xi * w1;                                   \
    }                                                                                                \
  }                                                                                                  \
  v16 b0 = b ? ld(b) : (v16){0}, b1 = b ? ld(b + 16) : (v16){0};                                     \
  for (int i = 0; i < MT; i++) { st(y + i * ldy, a0[i] + b0); st(y + i * ldy + 16, a1[i] + b1); }    \
}

ONE(1) ONE(2) ONE(3) ONE(4) ONE(5) ONE(6) ONE(7) ONE(8)
TWO(1) TWO(2) TWO(3) TWO(4) TWO(5) TWO(6) TWO(7) TWO(8)
typedef void (*tile)(const float*, const float*, const float*, float*, long, long);
static const tile ONES[9] = {0, one_1, one_2, one_3, one_4, one_5, one_6, one_7, one_8};
static const tile TWOS[9] = {0, two_1, two_2, two_3, two_4, two_5, two_6, two_7, two_8};

/* y[m, n] = sum_k x[m, k] w[n, k] (+ b[n]) for M rows of x [M, K] (contiguous), w in blocks [NB, K, 16],
   b NULL or NB * 16 floats, y [M, ldy] with ldy >= NB * 16 */
/* blocks [nb0, nb1) of y = x w^T (+ b): y points at block nb0's first column (nb0 even: the same tiles, so the
   same sums, as the whole product takes for them) */
static void range(const float* x, const float* w, const float* b, float* y, long M, long K,
                  long nb0, long nb1, long ldy) {
  long nb = nb0;
  if (M > 1)
    for (; nb + 2 <= nb1; nb += 2)
      for (long m = 0; m < M; m += 8) {
        long mt = M - m < 8 ? M - m : 8;
        TWOS[mt](x + m * K, w + nb * K * 16, b ? b + nb * 16 : 0, y + m * ldy + (nb - nb0) * 16, ldy, K);
      }
  for (; nb < nb1; nb++)
    for (long m = 0; m < M; m += 8) {
      long mt = M - m < 8 ? M - m : 8;
      ONES[mt](x + m * K, w + nb * K * 16, b ? b + nb * 16 : 0, y + m * ldy + (nb - nb0) * 16, ldy, K);
    }
}
#else
/* 16 registers of 8 floats (AVX2; NEON has 32 of 4): a block is two vectors, a tile at most 6 rows
   (12 accumulators, 2 weights, 1 broadcast); the rows past a tile read the block again from L2 */
typedef float v8 __attribute__((vector_size(32)));
static inline v8 ld(const float* p) { v8 v; memcpy(&v, p, 32); return v; }
static inline void st(float* p, v8 v) { memcpy(p, &v, 32); }
#define MAXT 6

#define TILE(MT)                                                                                     \
static void tile_##MT(const float* x, const float* p, const float* b, float* y, long ldy, long K) {  \
  v8 lo[MT], hi[MT];                                                                                 \
  for (int i = 0; i < MT; i++) lo[i] = hi[i] = (v8){0};                                              \
  for (long k = 0; k < K; k++) {                                                                     \
    v8 w0 = ld(p + k * 16), w1 = ld(p + k * 16 + 8);                                                 \
    _Pragma("GCC unroll 8") for (int i = 0; i < MT; i++) {                                           \
      float xi = x[i * K + k]; lo[i] += xi * w0; hi[i] += xi * w1;                                   \
    }                                                                                                \
  }                                                                                                  \
  v8 b0 = b ? ld(b) : (v8){0}, b1 = b ? ld(b + 8) : (v8){0};                                         \
  for (int i = 0; i < MT; i++) { st(y + i * ldy, lo[i] + b0); st(y + i * ldy + 8, hi[i] + b1); }     \
}

/* one row: K split over two pairs of accumulators, so the adds do not wait on each other */
static void row_1(const float* x, const float* p, const float* b, float* y, long K) {
  v8 a0 = {0}, a1 = {0}, c0 = {0}, c1 = {0};
  long k = 0;
  for (; k + 2 <= K; k += 2) {
    a0 += x[k] * ld(p + k * 16); a1 += x[k] * ld(p + k * 16 + 8);
    c0 += x[k + 1] * ld(p + k * 16 + 16); c1 += x[k + 1] * ld(p + k * 16 + 24);
  }
  for (; k < K; k++) { a0 += x[k] * ld(p + k * 16); a1 += x[k] * ld(p + k * 16 + 8); }
  v8 b0 = b ? ld(b) : (v8){0}, b1 = b ? ld(b + 8) : (v8){0};
  st(y, a0 + c0 + b0); st(y + 8, a1 + c1 + b1);
}

TILE(1) TILE(2) TILE(3) TILE(4) TILE(5) TILE(6)
typedef void (*tile)(const float*, const float*, const float*, float*, long, long);
static const tile TILES[MAXT + 1] = {0, tile_1, tile_2, tile_3, tile_4, tile_5, tile_6};

static void range(const float* x, const float* w, const float* b, float* y, long M, long K,
                  long nb0, long nb1, long ldy) {
  for (long nb = nb0; nb < nb1; nb++) {
    const float* p = w + nb * K * 16;
    const float* bb = b ? b + nb * 16 : 0;
    float* yy = y + (nb - nb0) * 16;
    if (M == 1) { row_1(x, p, bb, yy, K); continue; }
    for (long m = 0; m < M; m += MAXT) {
      long mt = M - m < MAXT ? M - m : MAXT;
      TILES[mt](x + m * K, p, bb, yy + m * ldy, ldy, K);
    }
  }
}
#endif

/* ---- helper threads: idle-priority threads on the cores no worker holds take blocks of a product ----
   A product is cut into chunks of CB blocks (CB even). The caller publishes the job (a generation number and
   its description) and takes chunks from the first; helpers take them from the last. A chunk is taken by a
   compare-and-swap on its word ((job << 3) | state): a word of an older job is free. A helper computes its
   chunk into scratch of its own and copies it into y only if it can still mark the chunk COPYING; the
   caller, out of chunks, waits a little for the helpers' and computes any still unfinished itself (STOLEN),
   so a helper the scheduler put aside (SCHED_IDLE: anything else on its core runs first) never holds the
   product up. It returns the job's number where it took one back: that helper may still be reading x, w and
   b, and the caller keeps them alive until computron_gemm_inside(job) is 0. */
#if defined(__linux__)
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <time.h>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <stdlib.h>
#include <unistd.h>

#define MAX_HELPERS 8
#define MAX_CHUNKS 4096
#define MAX_SCRATCH (64 * 16 * 16)        /* 64 rows by 16 blocks */
#define MIN_BLOCKS 8                      /* fewer blocks: the caller alone */
#define SPIN_NS 100000L                   /* a helper spins this long for the next job, then sleeps */
enum { MAIN = 1, HELPER = 2, COPYING = 3, DONE = 4, STOLEN = 5 };

typedef struct { const float *x, *w, *b; float* y; long M, K, NB, ldy, cb, n; int cpu; } job_t;
static job_t jobs[2];                     /* job g's description is jobs[g & 1] */
static _Atomic long job_now;              /* the latest job's number (0: none yet) */
static _Atomic int bell;                  /* futex word: rung with each job */
static _Atomic int sleepers;
static _Atomic unsigned long claim[MAX_CHUNKS];
static _Atomic long inside[MAX_HELPERS];  /* the job a helper is working on, 0 when none */
static _Atomic int caller_busy;           /* one product at a time uses the helpers */
static int helpers;
static long slow_ns;                      /* tests: a helper waits this long in each chunk it takes */
static int normal_priority;               /* tests: helpers of normal priority (a busy machine runs them) */
static float scratch[MAX_HELPERS][MAX_SCRATCH];
static cpu_set_t allowed;                 /* where helpers may run */

/* a helper on its caller's core would only take turns with it (at idle priority it is not moved away by
   the kernel's balancing): it moves itself to its other allowed cores */
static void keep_off(int cpu) {
  if (cpu < 0 || sched_getcpu() != cpu || !CPU_ISSET(cpu, &allowed) || CPU_COUNT(&allowed) < 2) return;
  cpu_set_t elsewhere = allowed;
  CPU_CLR(cpu, &elsewhere);
  sched_setaffinity(0, sizeof elsewhere, &elsewhere);
}

static inline void relax(void) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  __asm__ volatile("yield");
#endif
}

static inline long now_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1000000000L + t.tv_nsec;
}

static inline unsigned long word(long job, int state) { return ((unsigned long)job << 3) | state; }

static inline int take(long c, long job, int state) {
  unsigned long old = atomic_load(&claim[c]);
  if ((long)(old >> 3) >= job) return 0;
  return atomic_compare_exchange_strong(&claim[c], &old, word(job, state));
}

static void help(int h, long job, const job_t* j) {
  atomic_store(&inside[h], job);
  float* mine = scratch[h];
  for (long c = j->n - 1; c >= 0; c--) {
    if (atomic_load(&job_now) != job) break;
    if (!take(c, job, HELPER)) continue;
    if (slow_ns) { struct timespec t = {slow_ns / 1000000000L, slow_ns % 1000000000L}; nanosleep(&t, NULL); }
    long nb0 = c * j->cb, nb1 = nb0 + j->cb < j->NB ? nb0 + j->cb : j->NB, width = (nb1 - nb0) * 16;
    range(j->x, j->w, j->b, mine, j->M, j->K, nb0, nb1, width);
    unsigned long held = word(job, HELPER);
    if (!atomic_compare_exchange_strong(&claim[c], &held, word(job, COPYING))) continue;  /* taken back */
    for (long m = 0; m < j->M; m++) memcpy(j->y + m * j->ldy + nb0 * 16, mine + m * width, width * 4);
    atomic_store(&claim[c], word(job, DONE));
  }
  atomic_store(&inside[h], 0);
}

static void* helper_main(void* arg) {
  int h = (int)(long)arg;
  struct sched_param none = {0};
  if (!normal_priority) pthread_setschedparam(pthread_self(), SCHED_IDLE, &none);
  int heard = atomic_load(&bell);
  long idle_since = now_ns();
  for (;;) {
    int rung = atomic_load(&bell);
    if (rung == heard) {
      if (now_ns() - idle_since < SPIN_NS) { relax(); continue; }
      atomic_fetch_add(&sleepers, 1);
      if (atomic_load(&bell) == heard) syscall(SYS_futex, &bell, FUTEX_WAIT_PRIVATE, heard, NULL, NULL, 0);
      atomic_fetch_sub(&sleepers, 1);
      continue;
    }
    heard = rung;
    long job = atomic_load(&job_now);
    job_t j = jobs[job & 1];
    atomic_thread_fence(memory_order_acquire);  /* the copy is read before job_now is read again */
    if (job && atomic_load(&job_now) == job) {
      keep_off(j.cpu);
      help(h, job, &j);
    }  /* else the copy may mix two jobs: skip */
    idle_since = now_ns();
  }
  return NULL;
}

static void forget_helpers(void) { helpers = 0; }  /* a forked child has none of its parent's threads */

/* start n helper threads (once per process; more calls return the count), allowed on cpus[0..ncpus) (where
   ncpus is 0: on this thread's cores), never on the core their caller runs on (keep_off) */
int computron_gemm_lend(int n, const int* cpus, int ncpus) {
  static int registered;
  if (helpers || n <= 0) return helpers;
  if (!registered) { pthread_atfork(NULL, NULL, forget_helpers); registered = 1; }
  if (n > MAX_HELPERS) n = MAX_HELPERS;
  normal_priority = getenv("COMPUTRON_HELPERS_NORMAL_PRIORITY") != NULL;
  CPU_ZERO(&allowed);
  if (ncpus > 0)
    for (int i = 0; i < ncpus; i++) CPU_SET(cpus[i], &allowed);
  else if (sched_getaffinity(0, sizeof allowed, &allowed))
    return 0;
  for (int h = 0; h < n; h++) {
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setaffinity_np(&attr, sizeof allowed, &allowed);
    pthread_t t;
    int failed = pthread_create(&t, &attr, helper_main, (void*)(long)h);
    pthread_attr_destroy(&attr);
    if (failed) break;
    pthread_detach(t);
    helpers = h + 1;
  }
  return helpers;
}

void computron_gemm_slow_helpers(long ns) { slow_ns = ns; }

int computron_gemm_inside(long job) {
  for (int h = 0; h < MAX_HELPERS; h++) if (atomic_load(&inside[h]) == job) return 1;
  return 0;
}

/* y[m, n] = sum_k x[m, k] w[n, k] (+ b[n]) for M rows of x [M, K] (contiguous), w in blocks [NB, K, 16],
   b NULL or NB * 16 floats, y [M, ldy] with ldy >= NB * 16; returns 0, or the job a helper may still read */
long computron_block_matmul(const float* x, const float* w, const float* b, float* y,
                            long M, long K, long NB, long ldy) {
  long cb = 2;
  while ((NB + cb - 1) / cb > MAX_CHUNKS && cb * 2 * 16 * M <= MAX_SCRATCH) cb *= 2;
  long n = (NB + cb - 1) / cb;
  int expected = 0;
  if (!helpers || NB < MIN_BLOCKS || M > 64 || cb * 16 * M > MAX_SCRATCH || n > MAX_CHUNKS
      || !atomic_compare_exchange_strong(&caller_busy, &expected, 1)) {
    range(x, w, b, y, M, K, 0, NB, ldy);
    return 0;
  }
  long job = atomic_load(&job_now) + 1;
  jobs[job & 1] = (job_t){x, w, b, y, M, K, NB, ldy, cb, n, sched_getcpu()};
  atomic_store(&job_now, job);
  atomic_fetch_add(&bell, 1);
  if (atomic_load(&sleepers)) syscall(SYS_futex, &bell, FUTEX_WAKE_PRIVATE, MAX_HELPERS, NULL, NULL, 0);
  long start = now_ns(), done = 0;
  for (long c = 0; c < n; c++) {
    if (!take(c, job, MAIN)) continue;
    long nb0 = c * cb, nb1 = nb0 + cb < NB ? nb0 + cb : NB;
    range(x, w, b, y + nb0 * 16, M, K, nb0, nb1, ldy);
    done++;
  }
  long t = now_ns(), deadline = t + 2 * (t - start) / (done ? done : 1) + 5000, took_back = 0;
  for (long c = 0; c < n; c++) {
    for (;;) {
      unsigned long v = atomic_load(&claim[c]);
      int state = v & 7;
      if (state != HELPER && state != COPYING) break;
      if (state == HELPER && now_ns() > deadline && atomic_compare_exchange_strong(&claim[c], &v, word(job, STOLEN))) {
        long nb0 = c * cb, nb1 = nb0 + cb < NB ? nb0 + cb : NB;
        range(x, w, b, y + nb0 * 16, M, K, nb0, nb1, ldy);
        took_back = 1;
        break;
      }
      relax();
    }
  }
  atomic_store(&caller_busy, 0);
  return took_back ? job : 0;
}
#else
int computron_gemm_lend(int n, const int* cpus, int ncpus) { return 0; }
int computron_gemm_inside(long job) { return 0; }
void computron_gemm_slow_helpers(long ns) {}
long computron_block_matmul(const float* x, const float* w, const float* b, float* y,
                            long M, long K, long NB, long ldy) {
  range(x, w, b, y, M, K, 0, NB, ldy);
  return 0;
}
#endif
