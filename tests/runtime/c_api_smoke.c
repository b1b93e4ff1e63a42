/* Compiled as C: proves questkv.h is a C header and drives a small workload.
 * Writes the sparse output of one decode step to `out` ([4][16] floats). */
#include <string.h>

#include "questkv/questkv.h"

int qkv_c_smoke(float* out, char* error, size_t error_size) {
  qkv_config cfg;
  qkv_runtime* rt = NULL;
  uint64_t seq = 0, child = 0;
  float kv[40 * 2 * 16];
  float q[4 * 16];
  int64_t len = 0;
  int i;
  qkv_config_default(&cfg);
  cfg.layers = 1;
  cfg.q_heads = 4;
  cfg.kv_heads = 2;
  cfg.head_dim = 16;
  cfg.page_size = 4;
  cfg.token_budget = 16;
  cfg.sink_pages = 1;
  cfg.local_pages = 1;
  cfg.num_dense_layers = 0;
  cfg.max_pages = 64;
  for (i = 0; i < 40 * 2 * 16; ++i) kv[i] = (float)((i * 7919) % 101) / 50.0f - 1.0f;
  for (i = 0; i < 4 * 16; ++i) q[i] = (float)((i * 104729) % 37) / 18.0f - 1.0f;
  if (qkv_create(&cfg, &rt) != QKV_OK) {
    strncpy(error, qkv_create_error(), error_size - 1);
    return 1;
  }
  if (qkv_sequence_create(rt, &seq) != QKV_OK || qkv_append(rt, seq, 0, kv, kv, 40) != QKV_OK ||
      qkv_sequence_length(rt, seq, 0, &len) != QKV_OK || len != 40 ||
      qkv_decode_attention(rt, &seq, 1, 0, q, out) != QKV_OK || qkv_sequence_fork(rt, seq, &child) != QKV_OK ||
      qkv_sequence_rollback(rt, child, 3) != QKV_OK || qkv_sequence_free(rt, child) != QKV_OK) {
    strncpy(error, qkv_last_error(rt), error_size - 1);
    qkv_destroy(rt);
    return 2;
  }
  /* Errors come back as codes with a message. */
  if (qkv_append(rt, 999, 0, kv, kv, 1) != QKV_NOT_FOUND || qkv_last_error(rt)[0] == '\0' ||
      qkv_decode_attention(rt, &seq, 1, 5, q, out + 4 * 16) != QKV_OUT_OF_RANGE ||
      qkv_append(NULL, seq, 0, kv, kv, 1) != QKV_INVALID_ARGUMENT) {
    strncpy(error, "error codes not as documented", error_size - 1);
    qkv_destroy(rt);
    return 3;
  }
  qkv_destroy(rt);
  return 0;
}
