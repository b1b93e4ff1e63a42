/* questkv C API: the Runtime for engines not written in C++.
 *
 * Opaque handles and integer status codes (the same numbering as
 * questkv::Code). Every call returns QKV_OK or an error code; after an error,
 * qkv_last_error() gives the message for that runtime. A runtime is
 * thread-compatible: serialise calls on one handle.
 *
 * Errors: a call that fails changes nothing — no sequence is created, no id
 * is used up, no token is appended or dropped, no page or slot leaks.
 * Arguments, output pointers included, are checked before anything is done.
 * No C++ exception reaches the caller: running out of memory is
 * QKV_RESOURCE_EXHAUSTED. A disk tier whose writes or reads keep failing
 * (full, EIO) gives QKV_IO_ERROR naming the page and the OS's reason after a
 * bounded number of attempts; a page is never lost for it (it keeps its host
 * home). Outputs of a failed decode call are unspecified.
 *
 * Shapes (floats, row-major):
 *   K, V of n tokens   [n][kv_heads][head_dim]   (post-RoPE keys)
 *   queries, outputs   [batch][q_heads][head_dim]
 * Aliasing: q and out may be the same buffer (or overlap) on the host calls;
 * on the *_device calls they must not overlap (QKV_INVALID_ARGUMENT).
 * Finite inputs whose logits q·k/sqrt(head_dim) pass float32's range make a
 * host decode call fail with QKV_INVALID_ARGUMENT instead of returning NaN.
 */
#ifndef QUESTKV_H_
#define QUESTKV_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
  QKV_OK = 0,
  QKV_INVALID_ARGUMENT = 1,
  QKV_NOT_FOUND = 2,
  QKV_OUT_OF_RANGE = 3,
  QKV_RESOURCE_EXHAUSTED = 4,
  QKV_FAILED_PRECONDITION = 5,
  QKV_IO_ERROR = 6,
  QKV_CORRUPTION = 7,
  QKV_UNIMPLEMENTED = 8,
  QKV_INTERNAL = 9
} qkv_status;

typedef enum { QKV_GQA_MAX = 0, QKV_GQA_MEAN = 1, QKV_GQA_UNION = 2 } qkv_gqa_mode;
typedef enum { QKV_COLD_MISS_STRICT = 0, QKV_COLD_MISS_DEADLINE = 1 } qkv_cold_miss;
/* Pages for a block of new tokens (qkv_decode_block): each position its own,
   or one set for the block (questkv::BlockSelection). */
typedef enum { QKV_BLOCK_PER_POSITION = 0, QKV_BLOCK_SHARED = 1 } qkv_block_selection;
typedef enum { QKV_BACKEND_CPU = 0, QKV_BACKEND_CUDA = 1 } qkv_backend;
/* The model dtype of K/V (and of the device pointers of the *_device calls). */
typedef enum { QKV_DTYPE_F32 = 0, QKV_DTYPE_F16 = 1, QKV_DTYPE_BF16 = 2 } qkv_dtype;
/* How page summaries are stored: in the K/V dtype, or as 8-bit E4M3 codes
   rounded outward (half of f16's bytes for the select to scan). */
typedef enum { QKV_SUMMARY_KV = 0, QKV_SUMMARY_E4M3 = 1 } qkv_summary_dtype;

typedef struct {
  /* geometry */
  int layers, q_heads, kv_heads, head_dim, page_size;
  /* selection policy */
  int64_t token_budget;
  int sink_pages, local_pages;
  qkv_gqa_mode gqa;
  const int* dense_layers; /* may be NULL when num_dense_layers is 0 */
  int num_dense_layers;
  /* capacities and tiers (0 = room for every page; disk_dir NULL or "" = no disk tier) */
  uint32_t max_pages;
  uint64_t hbm_bytes, host_bytes;
  const char* disk_dir;
  uint64_t disk_bytes;
  qkv_cold_miss cold_miss;
  /* where the data plane runs; the CPU backend needs QKV_DTYPE_F32 */
  qkv_backend backend;
  qkv_dtype dtype;
  qkv_summary_dtype summary_dtype;
  /* tuning: pages per (sequence, layer, KV head) promoted from disk ahead of
     need each step; CUDA backend: 1 replays a repeating decode step from a
     captured CUDA graph, 0 launches every step directly */
  int prefetch_pages;
  int cuda_graphs;
  qkv_block_selection block_selection;
  /* two-stage re-rank: 0 off (plain Quest), else >= 1: the top ceil(rerank * K)
     pages by the bound ranked again by their exact max logit */
  double rerank;
  /* exact hierarchical scan: 0 off (flat scan), else >= 2 pages per group box
     (CPU backend; the same selections, fewer summary bytes where groups fall
     below the K-th score) */
  int group_pages;
  /* adaptive budgets: 0 off (a fixed K), else in (0, 1): the fewest pages whose
     bound mass leaves at most this share unread, from adaptive_floor tokens up
     to the token budget (CPU backend) */
  double unread_bound_mass;
  int64_t adaptive_floor;
  /* QKV_COLD_MISS_DEADLINE: a sequence's call whose cold misses pass this
     share of its selected head-pages at the layer waits for them; in [0, 1],
     1 never waits */
  double deadline_skip_limit;
} qkv_config;

typedef struct qkv_runtime qkv_runtime;

/* Fills *config with the defaults of questkv::Config (nothing for NULL). */
void qkv_config_default(qkv_config* config);

/* Creates a runtime; on error *out is NULL and qkv_create_error() says why.
 * Every other call returns QKV_INVALID_ARGUMENT for a NULL handle. */
qkv_status qkv_create(const qkv_config* config, qkv_runtime** out);
/* Message of the last failed qkv_create on this thread ("" if none). */
const char* qkv_create_error(void);
void qkv_destroy(qkv_runtime* rt);
/* Message of the last failed call on rt ("" if none); valid until the next call. */
const char* qkv_last_error(const qkv_runtime* rt);

qkv_status qkv_sequence_create(qkv_runtime* rt, uint64_t* seq);
qkv_status qkv_sequence_fork(qkv_runtime* rt, uint64_t parent, uint64_t* child);
qkv_status qkv_sequence_from_prefix(qkv_runtime* rt, uint64_t parent, int64_t pages, uint64_t* child);
qkv_status qkv_sequence_rollback(qkv_runtime* rt, uint64_t seq, int64_t tokens);
qkv_status qkv_sequence_free(qkv_runtime* rt, uint64_t seq);
qkv_status qkv_sequence_length(qkv_runtime* rt, uint64_t seq, int layer, int64_t* tokens);

qkv_status qkv_append(qkv_runtime* rt, uint64_t seq, int layer, const float* k, const float* v, int64_t n);
/* Draft tokens: appended like qkv_append, but the pages they fill stay off
   the host and disk until qkv_sequence_accept keeps the drafts that
   qkv_sequence_rollback left (Runtime::AppendDraft). */
qkv_status qkv_append_draft(qkv_runtime* rt, uint64_t seq, int layer, const float* k, const float* v, int64_t n);
qkv_status qkv_sequence_accept(qkv_runtime* rt, uint64_t seq);
/* Sparse (Quest) decode attention for a batch of sequences at one layer. */
qkv_status qkv_decode_attention(qkv_runtime* rt, const uint64_t* seqs, int batch, int layer, const float* q,
                                float* out);
/* The same for a block of block[b] >= 1 new tokens per sequence (already
   appended; speculative decoding's verify step): q and out hold one row per
   block token, sequence by sequence ([sum(block)][q_heads][head_dim]); each
   position attends causally and, with QKV_BLOCK_PER_POSITION, selects its
   own pages, exactly as single-token calls made after each append would
   (Runtime::DecodeBlock); QKV_BLOCK_SHARED selects once for the block (CPU
   backend).
   Roll back the rejected tokens with qkv_sequence_rollback. */
qkv_status qkv_decode_block(qkv_runtime* rt, const uint64_t* seqs, const int* block, int batch, int layer,
                            const float* q, float* out);
/* CUDA backend only: the same on device pointers in the config's dtype
   (k, v [n][Hkv][D]; q, out [batch][Hq][D]), ordered on qkv_cuda_stream():
   inputs are read and out written when that stream reaches them, and a
   decode call may return before its work is done (unless it waits for cold
   misses under strict: Runtime::DecodeAttentionDevice). Read out after qkv_synchronize() or on the stream. */
qkv_status qkv_append_device(qkv_runtime* rt, uint64_t seq, int layer, const void* k, const void* v, int64_t n);
qkv_status qkv_decode_attention_device(qkv_runtime* rt, const uint64_t* seqs, int batch, int layer, const void* q,
                                       void* out);
/* qkv_append_draft and qkv_decode_block, the same way (q, out [sum(block)][Hq][D]). */
qkv_status qkv_append_draft_device(qkv_runtime* rt, uint64_t seq, int layer, const void* k, const void* v,
                                   int64_t n);
qkv_status qkv_decode_block_device(qkv_runtime* rt, const uint64_t* seqs, const int* block, int batch, int layer,
                                   const void* q, void* out);
/* Waits for every call's device work; the first fault an enqueued call reported. */
qkv_status qkv_synchronize(qkv_runtime* rt);
/* The cudaStream_t the CUDA backend orders its work on; NULL on the CPU backend or a null handle. */
void* qkv_cuda_stream(qkv_runtime* rt);
/* Dense attention over every token (reference). */
qkv_status qkv_dense_attention(qkv_runtime* rt, const uint64_t* seqs, int batch, int layer, const float* q,
                               float* out);

#ifdef __cplusplus
}
#endif

#endif /* QUESTKV_H_ */
