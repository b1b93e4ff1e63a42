"""questkv for PyTorch: Quest page selection and a tiered KV cache.

Two surfaces (see the project README):

* questkv owns the cache: ``Runtime`` (sequences, append, decode, dense, stats);
* the engine owns its paged KV: ``update_summaries`` and ``select_pages``, pure
  functions of an engine's paged K cache and FlashInfer-style CSR page tables.

Errors raise RuntimeError with questkv's message.
"""
import os

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
torch.ops.load_library(os.path.join(_HERE, "libquestkv_ops.so"))

_OPTION_TYPES = {
    "layers": int, "q_heads": int, "kv_heads": int, "head_dim": int, "page_size": int,
    "dtype": str, "summary_dtype": str, "token_budget": int, "sink_pages": int, "local_pages": int,
    "gqa": str, "dense_layers": list, "layer_token_budgets": list, "max_pages": int,
    "hbm_bytes": int, "host_bytes": int, "disk_dir": str, "disk_bytes": int, "cold_miss": str,
    "deadline_skip_limit": float, "io_backend": str, "prefetch_pages": int, "backend": str,
    "cuda_graphs": bool, "cuda_mma_scores": bool,
    "block_selection": str,
    "rerank": float, "group_pages": int, "unread_bound_mass": float, "adaptive_floor": int,
}


def _options(kwargs):
    out = {}
    for key, value in kwargs.items():
        kind = _OPTION_TYPES.get(key)
        if kind is None:
            raise TypeError(f"questkv.Runtime: unknown option '{key}'")
        if kind is list:
            out[key] = ",".join(str(int(x)) for x in value)
        elif kind is bool:
            out[key] = "1" if value else "0"
        elif kind is int:
            if isinstance(value, bool) or int(value) != value:
                raise TypeError(f"questkv.Runtime: {key} must be an integer, not {value!r}")
            out[key] = str(int(value))
        elif kind is float:
            out[key] = repr(float(value))
        else:
            out[key] = str(value)
    return out


class Runtime:
    """A questkv runtime owning the KV cache of a model: ``Runtime(**config)``
    with the fields of questkv::Config (layers, q_heads, kv_heads, head_dim,
    page_size, token_budget, sink_pages, local_pages, gqa, dense_layers,
    max_pages, hbm_bytes, host_bytes, disk_dir, disk_bytes, cold_miss, ...).

    K/V enter per layer as ``[n, kv_heads, head_dim]`` (post-RoPE keys);
    ``decode`` takes ``q [B, q_heads, head_dim]`` for a batch of sequences at
    one layer and returns ``out`` of the same shape (or writes ``out=``).
    Tensors are float32 on the CPU, or, with ``backend="cuda"``, the model
    ``dtype`` on the GPU: then the runtime's stream runs after the work
    queued so far on the caller's current stream, which in turn waits for
    the call's work, so nothing is copied and nothing waits on the host.
    """

    def __init__(self, **config):
        self._rt = torch.classes.questkv.Runtime(_options(config))
        self._stream_ptr = self._rt.cuda_stream()  # 0 on the CPU backend
        self._stream = None  # that stream as torch sees it (first CUDA call)

    def _ordered(self, tensor, call):
        """call(), ordered after the caller's current stream and before its
        later work when ``tensor`` is on the GPU."""
        if not tensor.is_cuda or self._stream_ptr == 0:
            return call()  # CPU tensors, or the op's own error for CUDA ones
        if self._stream is None:
            self._stream = torch.cuda.ExternalStream(self._stream_ptr, device=tensor.device)
        caller = torch.cuda.current_stream(tensor.device)
        self._stream.wait_stream(caller)
        result = call()
        caller.wait_stream(self._stream)
        return result

    def create_sequence(self):
        return self._rt.create_sequence()

    def fork(self, parent):
        return self._rt.fork(parent)

    def from_prefix(self, parent, pages):
        return self._rt.from_prefix(parent, pages)

    def rollback(self, seq, tokens):
        self._rt.rollback(seq, tokens)

    def free(self, seq):
        self._rt.free(seq)

    def length(self, seq, layer):
        return self._rt.length(seq, layer)

    def append(self, seq, layer, k, v, draft=False):
        """Appends ``k, v [n, kv_heads, head_dim]``; ``draft=True``: draft
        tokens, whose full pages stay off the host and disk until ``accept``."""
        self._ordered(k, lambda: self._rt.append(seq, layer, k, v, draft))

    def accept(self, seq):
        """The drafts left after ``rollback`` become ordinary tokens."""
        self._rt.accept(seq)

    def decode(self, seqs, layer, q, out=None):
        return self._ordered(q, lambda: self._rt.decode(list(seqs), layer, q, out))

    def dense(self, seqs, layer, q, out=None):
        return self._rt.dense(list(seqs), layer, q, out)

    def decode_block(self, seqs, block, layer, q):
        """Verifies a block of ``block[b]`` draft tokens per sequence (already
        appended): ``q [sum(block), q_heads, head_dim]``, one row per token,
        each attending causally with its own page selection."""
        return self._ordered(q, lambda: self._rt.decode_block(list(seqs), list(block), layer, q))

    def stats(self):
        return dict(self._rt.stats())

    def synchronize(self):
        self._rt.synchronize()


def _stream_of(t):
    """The caller's current CUDA stream for a CUDA tensor (0 on the CPU)."""
    return torch.cuda.current_stream(t.device).cuda_stream if t.is_cuda else 0


def update_summaries(k_cache, summaries, pages, lens, layout="NHD"):
    """Rewrites ``summaries [P, kv_heads, 2, head_dim]`` (min, max) of each page
    in ``pages`` from its first ``lens`` keys of ``k_cache`` (``[P, page_size,
    kv_heads, head_dim]`` for NHD, ``[P, kv_heads, page_size, head_dim]`` for
    HND). float32 CPU tensors, or CUDA tensors of one dtype (float32, float16,
    bfloat16) written on the current CUDA stream; ``pages`` and ``lens`` are
    int32 on the CPU or the GPU."""
    torch.ops.questkv.update_summaries(k_cache, summaries, pages, lens, layout, _stream_of(k_cache))


def select_pages(q, summaries, indptr, indices, last_page_len, page_size, token_budget,
                 sink_pages=1, local_pages=8, gqa="max"):
    """The pages Quest attends for each (sequence, KV head): ``[B, kv_heads, K]``
    int32 page ids from ``indices``, ascending in logical order, padded with -1.
    ``indptr [B+1]``, ``indices``, ``last_page_len [B]`` are FlashInfer's CSR
    page table (int32, on the CPU or with CUDA tensors on the GPU). float32 CPU
    tensors select on the CPU; CUDA ``q`` and ``summaries`` of one dtype select
    on the GPU on the current stream (GQA groups of 1, 2, 4 or 8), with K the
    most pages a row can hold. The page table is read on the host to check it."""
    return torch.ops.questkv.select_pages(q, summaries, indptr, indices, last_page_len, page_size,
                                          token_budget, sink_pages, local_pages, gqa, _stream_of(q))
