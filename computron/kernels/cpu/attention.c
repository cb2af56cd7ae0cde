/* The paged decode attention of ``attention.py`` (its docstring says what it computes and why). */
#include <math.h>
#include <stdlib.h>
#include <string.h>
/* a vector of the processor's width: 16 floats with AVX-512, else 8 (AVX2; wider ones emulated there took
   3.3x as long) */
#if defined(__AVX512F__)
#define VW 16
#else
#define VW 8
#endif
typedef float vec __attribute__((vector_size(VW * 4)));
static inline vec ld(const float* p) { vec v; memcpy(&v, p, VW * 4); return v; }
static inline void st(float* p, vec v) { memcpy(p, &v, VW * 4); }

/* the sum of a vector's lanes by halves (a tree: a chain of 15 scalar adds was most of a dot's time) */
typedef float v4 __attribute__((vector_size(16)));
typedef float v8h __attribute__((vector_size(32)));
static inline float hsum(vec v) {
  v8h s8;
#if VW == 16
  v8h a, b;
  memcpy(&a, &v, 32); memcpy(&b, (char*)&v + 32, 32);
  s8 = a + b;
#else
  s8 = v;
#endif
  v4 c, d;
  memcpy(&c, &s8, 16); memcpy(&d, (char*)&s8 + 16, 16);
  v4 s4 = c + d;
  return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

static float dot(const float* a, const float* b, long D) {
  vec acc = (vec){0};
  long d = 0;
  for (; d + VW <= D; d += VW) acc += ld(a + d) * ld(b + d);
  float s = hsum(acc);
  for (; d < D; d++) s += a[d] * b[d];
  return s;
}

static void axpy(float* y, float w, const float* x, long D) {
  long d = 0;
  for (; d + VW <= D; d += VW) st(y + d, ld(y + d) + w * ld(x + d));
  for (; d < D; d++) y[d] += w * x[d];
}

/* out[b, h] = softmax_t(scale * q[b, h] . K[g, s_t]) . V[g, s_t], s_t = slots[b, t], t from start to
   lengths[b] - 1 (start = lengths[b] - window for window > 0), g = h / (H / KVH). q and out [B, H, D],
   the pools [KVH, S, D], slots [B, W]. Returns 0, or -1 where its scratch could not be allocated. */
int computron_paged_decode(const float* q, const float* kp, const float* vp, const long* slots,
                           const long* lengths, float* out, long B, long H, long KVH, long D, long S,
                           long W, float scale, long window) {
  long G = H / KVH;
  float* sc = malloc(sizeof(float) * G * (W > 0 ? W : 1));
  if (!sc) return -1;
  float mx[G], inv[G];
  for (long b = 0; b < B; b++) {
    long len = lengths[b], start = window > 0 && len > window ? len - window : 0;
    const long* sl = slots + b * W;
    for (long g = 0; g < KVH; g++) {
      const float* K = kp + g * S * D;
      const float* V = vp + g * S * D;
      const float* qg = q + (b * H + g * G) * D;
      float* og = out + (b * H + g * G) * D;
      for (long i = 0; i < G; i++) mx[i] = -INFINITY;
      for (long t = start; t < len; t++) {
        const float* k = K + sl[t] * D;
        for (long i = 0; i < G; i++) {
          float s = scale * dot(qg + i * D, k, D);
          sc[i * W + t] = s;
          if (s > mx[i]) mx[i] = s;
        }
      }
      for (long i = 0; i < G; i++) {
        float total = 0;
        for (long t = start; t < len; t++) {
          float e = expf(sc[i * W + t] - mx[i]);
          sc[i * W + t] = e;
          total += e;
        }
        inv[i] = total > 0 ? 1.0f / total : 0.0f;
        memset(og + i * D, 0, sizeof(float) * D);
      }
      for (long t = start; t < len; t++) {
        const float* v = V + sl[t] * D;
        for (long i = 0; i < G; i++) axpy(og + i * D, sc[i * W + t] * inv[i], v, D);
      }
    }
  }
  free(sc);
  return 0;
}
