/* An outside C program against an installed questkv, through questkv.h and
   pkg-config: the same runtime, sequences and checks as cpp_consumer/main.cc
   (a dense layer and a sparse layer whose budget covers every page, both
   equal to dense attention computed here within 1e-5). Prints the outputs'
   sum and exits 0, or prints what went wrong and exits 1. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "questkv/questkv.h"

#define LAYERS 2
#define Q_HEADS 4
#define KV_HEADS 2
#define HEAD_DIM 64
#define PAGE_SIZE 16
#define PREFILL 16 /* tokens appended in one call; the rest a token a call */
#define ROW (KV_HEADS * HEAD_DIM)
#define Q_ELEMS (Q_HEADS * HEAD_DIM)
#define MAX_TOKENS 53

static const int kTokens[2] = {53, 20};
static float k[LAYERS][2][MAX_TOKENS * ROW], v[LAYERS][2][MAX_TOKENS * ROW];

/* Deterministic values in [-1, 1), the same sequence as the C++ consumer's. */
static void fill(float* x, size_t n, uint32_t state) {
  size_t i;
  for (i = 0; i < n; ++i) {
    state = state * 1664525u + 1013904223u;
    x[i] = (float)(state >> 8) / (float)(1u << 23) - 1.f;
  }
}

/* Largest |out - dense attention| over query heads [Q_HEADS][HEAD_DIM];
   query head h reads KV head h / (Q_HEADS / KV_HEADS). */
static double reference_error(const float* q, const float* kk, const float* vv, int n, const float* out) {
  double logit[MAX_TOKENS], err = 0;
  int h, t, d;
  for (h = 0; h < Q_HEADS; ++h) {
    const int kvh = h / (Q_HEADS / KV_HEADS);
    double max_logit = -INFINITY, denom = 0;
    for (t = 0; t < n; ++t) {
      double dot = 0;
      for (d = 0; d < HEAD_DIM; ++d) dot += (double)q[h * HEAD_DIM + d] * kk[(t * KV_HEADS + kvh) * HEAD_DIM + d];
      logit[t] = dot / sqrt((double)HEAD_DIM);
      if (logit[t] > max_logit) max_logit = logit[t];
    }
    for (t = 0; t < n; ++t) denom += logit[t] = exp(logit[t] - max_logit);
    for (d = 0; d < HEAD_DIM; ++d) {
      double ref = 0;
      for (t = 0; t < n; ++t) ref += logit[t] / denom * vv[(t * KV_HEADS + kvh) * HEAD_DIM + d];
      err = fmax(err, fabs(out[h * HEAD_DIM + d] - ref));
    }
  }
  return err;
}

static int fail(qkv_runtime* rt, const char* what) {
  printf("c_consumer: %s: %s\n", what, rt ? qkv_last_error(rt) : qkv_create_error());
  qkv_destroy(rt);
  return 1;
}

/* Two sequences per layer: a prefill chunk, then a token a call. */
static int append_all(qkv_runtime* rt, uint64_t seqs[2]) {
  int b, layer, t;
  for (b = 0; b < 2; ++b) {
    if (qkv_sequence_create(rt, &seqs[b]) != QKV_OK) return 0;
    for (layer = 0; layer < LAYERS; ++layer) {
      fill(k[layer][b], (size_t)kTokens[b] * ROW, 100u * b + layer + 1);
      fill(v[layer][b], (size_t)kTokens[b] * ROW, 100u * b + layer + 51);
      if (qkv_append(rt, seqs[b], layer, k[layer][b], v[layer][b], PREFILL) != QKV_OK) return 0;
      for (t = PREFILL; t < kTokens[b]; ++t)
        if (qkv_append(rt, seqs[b], layer, k[layer][b] + t * ROW, v[layer][b] + t * ROW, 1) != QKV_OK) return 0;
    }
  }
  return 1;
}

int main(void) {
  static const int dense_layers[1] = {0};
  static float q[2 * Q_ELEMS], out[2 * Q_ELEMS];
  qkv_config cfg;
  qkv_runtime* rt = NULL;
  uint64_t seqs[2];
  double sum = 0, err = 0;
  int layer, b, i;
  qkv_config_default(&cfg);
  cfg.layers = LAYERS, cfg.q_heads = Q_HEADS, cfg.kv_heads = KV_HEADS;
  cfg.head_dim = HEAD_DIM, cfg.page_size = PAGE_SIZE;
  cfg.dense_layers = dense_layers, cfg.num_dense_layers = 1;
  cfg.token_budget = 4 * PAGE_SIZE; /* covers all four pages of the longer sequence */
  cfg.sink_pages = 1, cfg.local_pages = 1;
  if (qkv_create(&cfg, &rt) != QKV_OK) return fail(NULL, "qkv_create");
  if (!append_all(rt, seqs)) return fail(rt, "appending");
  for (layer = 0; layer < LAYERS; ++layer) {
    fill(q, 2 * Q_ELEMS, 7u + layer);
    if (qkv_decode_attention(rt, seqs, 2, layer, q, out) != QKV_OK) return fail(rt, "qkv_decode_attention");
    for (b = 0; b < 2; ++b) {
      err = fmax(err, reference_error(q + b * Q_ELEMS, k[layer][b], v[layer][b], kTokens[b], out + b * Q_ELEMS));
      for (i = 0; i < Q_ELEMS; ++i) sum += out[b * Q_ELEMS + i];
    }
  }
  qkv_destroy(rt);
  if (!(err <= 1e-5)) {
    printf("c_consumer: output differs from dense attention by %.3g (tolerance 1e-05)\n", err);
    return 1;
  }
  printf("%.6f\n", sum);
  return 0;
}
