"""tinylm, the byte-level code model of shared/models/tinylm/MODEL.md, in plain
PyTorch: a real attention workload for questkv's page selection.

``load(model_dir, device)`` builds the model (float32 compute from the
bfloat16 weights, on the CPU or a GPU). ``reference_loss`` runs it with PyTorch's own causal attention;
``questkv_loss`` prefills in PyTorch, hands every layer's post-RoPE K/V to a
``questkv.Runtime`` and decodes teacher-forced through ``rt.decode`` (Quest) or
``rt.dense``. Both score the same positions, so their losses compare directly.
A CUDA-backend runtime gets the K/V and queries as GPU tensors in its dtype
(``kv_dtype``), its dense attention float32 CPU tensors.
"""
import math
import os
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

LAYERS, WIDTH, Q_HEADS, KV_HEADS, HEAD_DIM = 6, 384, 6, 2, 64
GROUP = Q_HEADS // KV_HEADS  # query head h reads KV head h // GROUP
ROPE_THETA = 500000.0
RMS_EPS = torch.finfo(torch.float32).eps
PREFILL_CHUNK = 512  # queries per attention chunk: bounds the [Hq, chunk, T] scores


class TinyLM:
    """The merged state dict as float32 tensors, read as ``m["blocks.0.qkv.weight"]``."""

    def __init__(self, state, device="cpu"):
        self.device = torch.device(device)
        self.w = {name: t.float().contiguous().to(self.device) for name, t in state.items()}

    def __getitem__(self, name):
        return self.w[name]


def load(model_dir, device="cpu"):
    """The model from ``tinylm_part0.pt`` and ``tinylm_part1.pt`` in ``model_dir``, on ``device``."""
    state = {}
    for part in ("tinylm_part0.pt", "tinylm_part1.pt"):
        state.update(torch.load(os.path.join(model_dir, part), map_location="cpu"))
    return TinyLM(state, device)


def rms_norm(x, weight):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + RMS_EPS) * weight


def rope(x, pos):
    """Rotates interleaved pairs (x[2i], x[2i+1]) of ``x [T, H, 64]`` by pos·θ^(−2i/64)."""
    inv_freq = ROPE_THETA ** (-torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM)
    angle = pos.to(torch.float64)[:, None] * inv_freq[None, :]  # [T, 32]
    cos = angle.cos().float().to(x.device)[:, None, :]
    sin = angle.sin().float().to(x.device)[:, None, :]
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)


def qkv(m, layer, x, pos):
    """Post-RoPE q [T, 6, 64], k [T, 2, 64] and v [T, 2, 64] of block ``layer`` for ``x [T, 384]``."""
    h = rms_norm(x, m[f"blocks.{layer}.n1.weight"]) @ m[f"blocks.{layer}.qkv.weight"].T
    q, k, v = h.view(-1, Q_HEADS + 2 * KV_HEADS, HEAD_DIM).split([Q_HEADS, KV_HEADS, KV_HEADS], dim=1)
    return rope(q, pos).contiguous(), rope(k, pos).contiguous(), v.contiguous()


def finish_block(m, layer, x, attn):
    """The rest of block ``layer`` once attention gave ``attn [T, 6, 64]``."""
    p = f"blocks.{layer}."
    x = x + attn.reshape(-1, WIDTH) @ m[p + "o.weight"].T
    h = rms_norm(x, m[p + "n2.weight"])
    return x + (F.silu(h @ m[p + "w1.weight"].T) * (h @ m[p + "w3.weight"].T)) @ m[p + "w2.weight"].T


def logits(m, x):
    return rms_norm(x, m["norm.weight"]) @ m["head.weight"].T


def causal_attention(q, k, v, start):
    """Dense causal attention of queries ``q [Tq, 6, 64]`` at positions
    start..start+Tq-1 over keys/values ``k, v [Tk, 2, 64]`` at positions 0..Tk-1."""
    tq, tk = q.shape[0], k.shape[0]
    qg = q.view(tq, KV_HEADS, GROUP, HEAD_DIM).permute(1, 2, 0, 3).reshape(KV_HEADS, GROUP * tq, HEAD_DIM)
    scores = (qg @ k.permute(1, 2, 0)) / math.sqrt(HEAD_DIM)  # [Hkv, G*Tq, Tk]
    q_pos = (torch.arange(tq, device=q.device) + start).repeat(GROUP)
    scores.masked_fill_(torch.arange(tk, device=q.device)[None, :] > q_pos[:, None], float("-inf"))
    out = torch.softmax(scores, dim=-1) @ v.permute(1, 0, 2)  # [Hkv, G*Tq, D]
    return out.view(KV_HEADS, GROUP, tq, HEAD_DIM).permute(2, 0, 1, 3).reshape(tq, Q_HEADS, HEAD_DIM)


def forward(m, tokens, cache):
    """Runs ``tokens`` after the ``cache`` (per layer [k, v], grown in place)
    with dense causal attention, in chunks; returns the last hidden states [T, 384]."""
    outs = []
    for chunk in tokens.split(PREFILL_CHUNK):
        start = cache[0][0].shape[0]
        pos = torch.arange(start, start + chunk.shape[0])
        x = m["emb.weight"][chunk.to(m.device)]
        for layer in range(LAYERS):
            q, k, v = qkv(m, layer, x, pos)
            cache[layer][0] = torch.cat((cache[layer][0], k))
            cache[layer][1] = torch.cat((cache[layer][1], v))
            x = finish_block(m, layer, x, causal_attention(q, cache[layer][0], cache[layer][1], start))
        outs.append(x)
    return torch.cat(outs)


def empty_cache(device="cpu"):
    return [[torch.empty(0, KV_HEADS, HEAD_DIM, device=device), torch.empty(0, KV_HEADS, HEAD_DIM, device=device)]
            for _ in range(LAYERS)]


def window_tokens(data, prefill, steps):
    """The prefill + steps + 1 tokens a run reads (the last is only predicted)."""
    tokens = torch.tensor(list(data[: prefill + steps + 1]), dtype=torch.long)
    assert tokens.shape[0] == prefill + steps + 1, "data shorter than prefill + steps + 1 bytes"
    return tokens


def prefill_cache(m, data, prefill):
    """Per layer [k, v] (post-RoPE) of the first ``prefill`` bytes of ``data``;
    computed once, it serves any number of runs over the same window."""
    cache = empty_cache(m.device)
    with torch.no_grad():
        forward(m, torch.tensor(list(data[:prefill]), dtype=torch.long), cache)
    return cache


def reference_loss(m, data, prefill, steps, cache=None):
    """Teacher-forced loss (nats/byte) of PyTorch's dense causal attention over
    positions prefill..prefill+steps-1, each predicting the next byte of ``data``."""
    tokens = window_tokens(data, prefill, steps)
    cache = [list(kv) for kv in (prefill_cache(m, data, prefill) if cache is None else cache)]
    with torch.no_grad():
        x = forward(m, tokens[prefill:-1], cache)
        return F.cross_entropy(logits(m, x), tokens[prefill + 1:].to(m.device)).item()


@dataclass
class DecodeResult:
    loss: float  # mean nats/byte over the decoded steps
    ms_per_token: float  # whole decode step: six blocks, questkv calls, logits
    questkv_ms_per_token: float  # of which rt.append + rt.decode/dense
    prefill_stats: dict  # rt.stats() once the prefill is appended
    stats: dict  # rt.stats() after the last step
    logits: torch.Tensor = field(repr=False)  # [steps, 256]


def attention_calls(rt, dense, kv_dtype):
    """``rt``'s decode (or dense) attention as a function of float32 queries on
    the model's device: queries in ``kv_dtype`` for decode (GPU tensors for a
    CUDA-backend runtime), float32 CPU tensors for dense; outputs back as
    float32 on the queries' device."""
    if dense:
        return lambda seqs, layer, q: rt.dense(seqs, layer, q.cpu()).to(q.device)
    return lambda seqs, layer, q: rt.decode(seqs, layer, q.to(kv_dtype)).float()


def decode_step(m, rt, seq, token, pos, attend, kv_dtype=torch.float32):
    """One teacher-forced token through the model with questkv attention;
    returns (logits [256], seconds inside questkv)."""
    x = m["emb.weight"][int(token)][None, :]
    pos = torch.tensor([pos])
    in_questkv = 0.0
    for layer in range(LAYERS):
        q, k, v = qkv(m, layer, x, pos)
        sync(m)
        t0 = time.perf_counter()
        rt.append(seq, layer, k.to(kv_dtype), v.to(kv_dtype))
        out = attend([seq], layer, q)
        sync(m)
        in_questkv += time.perf_counter() - t0
        x = finish_block(m, layer, x, out)
    return logits(m, x)[0], in_questkv


def sync(m):
    """Waits for the GPU's queued work when the model runs there (timings)."""
    if m.device.type == "cuda":
        torch.cuda.synchronize(m.device)


def questkv_loss(m, rt, data, prefill, steps, dense=False, cache=None, kv_dtype=torch.float32):
    """Appends the prefill's K/V (``cache`` from prefill_cache, computed when
    None) to a new sequence of ``rt``, then decodes positions
    prefill..prefill+steps-1 teacher-forced with ``rt.decode`` (or ``rt.dense``);
    returns a DecodeResult. The sequence is freed at the end. ``kv_dtype``: the
    dtype ``rt`` takes K/V and queries in (float32 for the CPU backend)."""
    attend = attention_calls(rt, dense, kv_dtype)

    def decode(seq, tokens):
        rows, in_questkv = [], 0.0
        for p in range(prefill, prefill + steps):
            row, seconds = decode_step(m, rt, seq, tokens[p], p, attend, kv_dtype)
            rows.append(row[None, :])
            in_questkv += seconds
        return rows, in_questkv

    return teacher_forced(m, rt, data, prefill, steps, cache, kv_dtype, decode)


def questkv_block_loss(m, rt, data, prefill, steps, block, cache=None, kv_dtype=torch.float32):
    """As questkv_loss, but positions prefill..prefill+steps-1 go through the
    model ``block`` at a time, as a speculative verifier runs them: per layer
    the block's K/V appended as drafts and its queries attended by one
    ``rt.decode_block`` call (causal among themselves), every draft then
    accepted (teacher forcing). With per-position selection this equals
    questkv_loss; with shared selection it measures what one page set a
    block costs. ``steps`` must be a multiple of ``block``."""
    assert steps % block == 0, "steps must be a multiple of block"

    def decode(seq, tokens):
        rows, in_questkv = [], 0.0
        for p in range(prefill, prefill + steps, block):
            x = m["emb.weight"][tokens[p:p + block].to(m.device)]
            pos = torch.arange(p, p + block)
            for layer in range(LAYERS):
                q, k, v = qkv(m, layer, x, pos)
                sync(m)
                t0 = time.perf_counter()
                rt.append(seq, layer, k.to(kv_dtype), v.to(kv_dtype), draft=True)
                out = rt.decode_block([seq], [block], layer, q.to(kv_dtype)).float()
                sync(m)
                in_questkv += time.perf_counter() - t0
                x = finish_block(m, layer, x, out)
            rt.accept(seq)
            rows.append(logits(m, x))
        return rows, in_questkv

    return teacher_forced(m, rt, data, prefill, steps, cache, kv_dtype, decode)


def teacher_forced(m, rt, data, prefill, steps, cache, kv_dtype, decode):
    """A new sequence of ``rt`` holding the prefill's K/V, then ``decode(seq,
    tokens)`` -> (logits rows, seconds inside questkv) over the decoded
    positions; the DecodeResult. The sequence is freed at the end."""
    tokens = window_tokens(data, prefill, steps)
    cache = prefill_cache(m, data, prefill) if cache is None else cache
    seq = rt.create_sequence()
    for layer, (k, v) in enumerate(cache):
        if k.shape[0]:
            rt.append(seq, layer, k.to(kv_dtype), v.to(kv_dtype))
    prefill_stats = rt.stats()
    with torch.no_grad():
        sync(m)
        t0 = time.perf_counter()
        rows, in_questkv = decode(seq, tokens)
        sync(m)
        elapsed = time.perf_counter() - t0
    out = torch.cat(rows)
    stats = rt.stats()
    rt.free(seq)
    return DecodeResult(loss=F.cross_entropy(out, tokens[prefill + 1:].to(out.device)).item(),
                        ms_per_token=1e3 * elapsed / steps, questkv_ms_per_token=1e3 * in_questkv / steps,
                        prefill_stats=prefill_stats, stats=stats, logits=out)
