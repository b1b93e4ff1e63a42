"""The PyTorch ops (python/questkv) against an independent Quest written here
in plain PyTorch: page summaries, scores, GQA aggregation, sink/local/top-K
selection and sparse attention; plus bad inputs and the runtime's sequence
operations. Run: PYTHONPATH=<build>/python python3 -m unittest tests/python/test_ops.py"""
import math
import os
import sys
import tempfile
import unittest

try:
    import torch
    import questkv
except ImportError as e:  # CI must not pass without the ops: fail, saying why
    raise SystemExit(f"test_ops: FAILED: cannot import torch/questkv ({e}); "
                     "build with -DQUESTKV_TORCH=ON and set PYTHONPATH=<build>/python")

S, HQ, HKV, D = 4, 6, 2, 16
G = HQ // HKV


def ref_summaries(k, npages):
    """k: [T, Hkv, D] -> [P, Hkv, 2, D] min/max of each page's keys."""
    out = torch.empty(npages, k.shape[1], 2, k.shape[2])
    for p in range(npages):
        chunk = k[p * S:(p + 1) * S]
        out[p, :, 0] = chunk.amin(0)
        out[p, :, 1] = chunk.amax(0)
    return out


def ref_select(q, summ, budget, sink, local, gqa):
    """q: [Hq, D], summ: [P, Hkv, 2, D] -> per KV head a sorted list of logical pages."""
    P = summ.shape[0]
    k_pages = budget // S
    rows = []
    for h in range(HKV):
        if k_pages >= P:
            rows.append(list(range(P)))
            continue
        fixed = set(range(min(sink, P))) | set(range(max(P - local, 0), P))
        qh = q[h * G:(h + 1) * G]  # [G, D]
        lo, hi = summ[:, h, 0], summ[:, h, 1]  # [P, D]
        scores = torch.maximum(qh[:, None, :] * lo[None], qh[:, None, :] * hi[None]).sum(-1)  # [G, P]
        free = [p for p in range(P) if p not in fixed]
        need = max(k_pages - len(fixed), 0)

        def top(vals):  # best `need` of the free pages, ties toward the lower index
            return sorted(free, key=lambda p: (-float(vals[p]), p))[:need]

        if gqa == "union":
            chosen = set()
            for g in range(G):
                chosen |= set(top(scores[g]))
        else:
            agg = scores.max(0).values if gqa == "max" else scores.mean(0)
            chosen = set(top(agg))
        rows.append(sorted(fixed | chosen))
    return rows


def ref_attend(q, k, v, T, rows):
    """Attention of q [Hq, D] over the tokens of the selected pages."""
    out = torch.empty(HQ, D, dtype=torch.float64)
    for h in range(HKV):
        toks = [t for p in rows[h] for t in range(p * S, min((p + 1) * S, T))]
        kh, vh = k[toks, h].double(), v[toks, h].double()
        for g in range(G):
            qi = q[h * G + g].double()
            w = torch.softmax(kh @ qi / math.sqrt(D), 0)
            out[h * G + g] = w @ vh
    return out.float()


def runtime(**kw):
    base = dict(layers=2, q_heads=HQ, kv_heads=HKV, head_dim=D, page_size=S, token_budget=8 * S,
                sink_pages=1, local_pages=2, dense_layers=[0], max_pages=4096)
    base.update(kw)
    return questkv.Runtime(**base)


class EngineOwnedOps(unittest.TestCase):
    def test_summaries_nhd_and_hnd_with_partial_pages(self):
        g = torch.Generator().manual_seed(1)
        P = 9
        k_nhd = torch.randn(P, S, HKV, D, generator=g)
        k_hnd = k_nhd.permute(0, 2, 1, 3).contiguous()
        pages = torch.tensor([0, 3, 8, 5], dtype=torch.int32)
        lens = torch.tensor([S, 1, 3, S], dtype=torch.int32)
        for layout, kc in (("NHD", k_nhd), ("HND", k_hnd)):
            summ = torch.full((P, HKV, 2, D), 7.0)
            questkv.update_summaries(kc, summ, pages, lens, layout)
            for p, n in zip(pages.tolist(), lens.tolist()):
                self.assertTrue(torch.equal(summ[p, :, 0], k_nhd[p, :n].amin(0)), (layout, p))
                self.assertTrue(torch.equal(summ[p, :, 1], k_nhd[p, :n].amax(0)), (layout, p))
            self.assertTrue(torch.all(summ[1] == 7.0))  # untouched pages stay as they were

    def test_select_pages_equals_the_reference_for_ragged_batches(self):
        g = torch.Generator().manual_seed(2)
        for gqa in ("max", "mean", "union"):
            lens_tokens = [37, 5, 64, 17]
            B = len(lens_tokens)
            npages = [(t + S - 1) // S for t in lens_tokens]
            P = sum(npages) + 3
            perm = torch.randperm(P, generator=g)[:sum(npages)].to(torch.int32)  # scattered physical pages
            summ = torch.randn(P, HKV, 2, D, generator=g).sort(dim=2).values  # min <= max
            indptr = torch.tensor([0] + list(torch.tensor(npages).cumsum(0)), dtype=torch.int32)
            last = torch.tensor([t - (n - 1) * S for t, n in zip(lens_tokens, npages)], dtype=torch.int32)
            q = torch.randn(B, HQ, D, generator=g)
            got = questkv.select_pages(q, summ, indptr, perm, last, S, 6 * S, 1, 2, gqa)
            self.assertEqual(got.dtype, torch.int32)
            for b in range(B):
                phys = perm[indptr[b]:indptr[b + 1]]
                want = ref_select(q[b], summ[phys.long()], 6 * S, 1, 2, gqa)
                for h in range(HKV):
                    row = [x for x in got[b, h].tolist() if x >= 0]
                    self.assertEqual(row, [int(phys[p]) for p in want[h]], (gqa, b, h))
                    self.assertTrue(all(x == -1 for x in got[b, h, len(row):].tolist()))

    def test_bad_inputs_are_errors_with_messages(self):
        summ = torch.zeros(4, HKV, 2, D)
        q = torch.zeros(1, HQ, D)
        ip, ix, last = (torch.tensor(x, dtype=torch.int32) for x in ([0, 2], [0, 1], [3]))
        cases = [
            (lambda: questkv.select_pages(q.double(), summ, ip, ix, last, S, 32), "float32"),
            (lambda: questkv.select_pages(q, summ, ip.long(), ix, last, S, 32), "int32"),
            (lambda: questkv.select_pages(q, summ, ip, torch.tensor([0, 9], dtype=torch.int32), last, S, 32),
             "outside"),
            (lambda: questkv.select_pages(q, summ, ip, ix, last, S, 32, 1, 2, "median"), "GQA"),
            (lambda: questkv.select_pages(q, summ, ip, ix, last, S, S), "fewer than sink"),
            (lambda: questkv.update_summaries(torch.zeros(4, S, HKV, D), summ, torch.tensor([0], dtype=torch.int32),
                                              torch.tensor([S + 1], dtype=torch.int32)), "outside 1.."),
            (lambda: questkv.update_summaries(torch.zeros(4, HKV, D, S).transpose(2, 3), summ,
                                              torch.tensor([0], dtype=torch.int32),
                                              torch.tensor([1], dtype=torch.int32), "HND"), "contiguous"),
        ]
        for call, words in cases:
            with self.assertRaises(RuntimeError) as cm:
                call()
            self.assertIn(words, str(cm.exception))


class OwnedCache(unittest.TestCase):
    def setUp(self):
        self.g = torch.Generator().manual_seed(3)

    def fill(self, rt, T):
        s = rt.create_sequence()
        k = torch.randn(T, HKV, D, generator=self.g)
        v = torch.randn(T, HKV, D, generator=self.g)
        for layer in range(2):
            for start in range(0, T, 11):  # prefill chunks of odd size
                rt.append(s, layer, k[start:start + 11].contiguous(), v[start:start + 11].contiguous())
        return s, k, v

    def test_decode_equals_reference_quest_and_dense_equals_full_attention(self):
        for gqa in ("max", "mean", "union"):
            rt = runtime(gqa=gqa)
            s, k, v = self.fill(rt, 90)
            q = torch.randn(1, HQ, D, generator=self.g)
            got = rt.decode([s], 1, q)
            rows = ref_select(q[0], ref_summaries(k, (90 + S - 1) // S), 8 * S, 1, 2, gqa)
            torch.testing.assert_close(got[0], ref_attend(q[0], k, v, 90, rows), rtol=1e-5, atol=1e-5)
            full = [list(range((90 + S - 1) // S))] * HKV
            torch.testing.assert_close(rt.dense([s], 1, q)[0], ref_attend(q[0], k, v, 90, full), rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(rt.decode([s], 0, q)[0], ref_attend(q[0], k, v, 90, full), rtol=1e-5, atol=1e-5)

    def test_the_engine_owned_selection_is_the_runtimes(self):
        rt = runtime()
        s, k, v = self.fill(rt, 77)
        P = (77 + S - 1) // S
        kc = torch.zeros(P, S, HKV, D)
        kc.view(-1, HKV, D)[:77] = k
        summ = torch.empty(P, HKV, 2, D)
        pages = torch.arange(P, dtype=torch.int32)
        lens = torch.tensor([S] * (P - 1) + [77 - (P - 1) * S], dtype=torch.int32)
        questkv.update_summaries(kc, summ, pages, lens)
        q = torch.randn(1, HQ, D, generator=self.g)
        sel = questkv.select_pages(q, summ, torch.tensor([0, P], dtype=torch.int32), pages,
                                   lens[-1:].contiguous(), S, 8 * S, 1, 2, "max")
        rows = [[p for p in sel[0, h].tolist() if p >= 0] for h in range(HKV)]
        torch.testing.assert_close(rt.decode([s], 1, q)[0], ref_attend(q[0], k, v, 77, rows), rtol=1e-5, atol=1e-5)

    def test_out_form_aliasing_and_batches(self):
        rt = runtime()
        a, _, _ = self.fill(rt, 50)
        b, _, _ = self.fill(rt, 23)
        q = torch.randn(2, HQ, D, generator=self.g)
        want = rt.decode([a, b], 1, q)
        out = torch.empty_like(q)
        self.assertIs(rt.decode([a, b], 1, q, out=out), out)
        self.assertTrue(torch.equal(out, want))
        inout = q.clone()
        rt.decode([a, b], 1, inout, out=inout)  # q and out may be one buffer
        self.assertTrue(torch.equal(inout, want))

    def test_decode_block_equals_single_token_calls(self):
        a, b = runtime(), runtime()
        sa, k, v = self.fill(a, 60)
        sb = b.create_sequence()
        for layer in range(2):
            b.append(sb, layer, k, v)
        blocks, kd, vd = [3], torch.randn(3, HKV, D, generator=self.g), torch.randn(3, HKV, D, generator=self.g)
        q = torch.randn(3, HQ, D, generator=self.g)
        a.append(sa, 1, kd, vd)
        want = []
        for i in range(3):
            b.append(sb, 1, kd[i:i + 1].contiguous(), vd[i:i + 1].contiguous())
            want.append(b.decode([sb], 1, q[i:i + 1].contiguous()))
        self.assertTrue(torch.equal(a.decode_block([sa], blocks, 1, q), torch.cat(want)))
        with self.assertRaises(RuntimeError):
            a.decode_block([sa], [64], 1, torch.zeros(64, HQ, D))

    def test_drafts_are_held_until_accepted(self):
        rt = runtime()
        s, k, v = self.fill(rt, 30)
        d = torch.randn(9, HKV, D, generator=self.g)
        for layer in range(2):
            rt.append(s, layer, d, d, draft=True)
        with self.assertRaises(RuntimeError):
            rt.append(s, 1, d[:1].contiguous(), d[:1].contiguous())
        rt.rollback(s, 4)
        rt.accept(s)
        self.assertEqual(rt.length(s, 1), 35)
        rt.append(s, 1, d[:1].contiguous(), d[:1].contiguous())
        self.assertEqual(rt.length(s, 1), 36)

    def test_rerank_is_a_config_option(self):
        plain, rr = runtime(), runtime(rerank=1e6)
        sp, k, v = self.fill(plain, 300)
        sr = rr.create_sequence()
        for layer in range(2):
            rr.append(sr, layer, k, v)
        q = torch.randn(1, HQ, D, generator=self.g)
        self.assertFalse(torch.equal(plain.decode([sp], 1, q), rr.decode([sr], 1, q)))
        self.assertGreater(rr.stats()["rerank_key_bytes"], 0)
        self.assertEqual(plain.stats()["rerank_key_bytes"], 0)
        with self.assertRaises(RuntimeError):
            runtime(rerank=0.5)

    def test_group_pages_is_a_config_option(self):
        plain, grouped = runtime(), runtime(group_pages=4)
        sp, k, v = self.fill(plain, 300)
        sg = grouped.create_sequence()
        for layer in range(2):
            grouped.append(sg, layer, k, v)
        for _ in range(3):
            q = torch.randn(1, HQ, D, generator=self.g)
            self.assertTrue(torch.equal(plain.decode([sp], 1, q), grouped.decode([sg], 1, q)))
        self.assertGreater(grouped.stats()["summary_bytes_read"], 0)
        with self.assertRaises(RuntimeError):
            runtime(group_pages=1)

    def test_adaptive_budgets_are_a_config_option(self):
        rt = runtime(unread_bound_mass=0.1, adaptive_floor=32)
        s, _, _ = self.fill(rt, 300)
        rt.decode([s], 1, torch.randn(1, HQ, D, generator=self.g))
        st = rt.stats()
        self.assertEqual(st["adaptive_rankings"], HKV)
        self.assertLessEqual(st["adaptive_pages_p95"], st["adaptive_pages_max"])
        self.assertLessEqual(st["adaptive_pages"], HKV * st["adaptive_pages_max"])
        with self.assertRaises(RuntimeError):
            runtime(unread_bound_mass=1.5)

    def test_shared_block_selection_is_a_config_option(self):
        per, shared = runtime(), runtime(block_selection="shared")
        sp, k, v = self.fill(per, 200)
        ss = shared.create_sequence()
        for layer in range(2):
            shared.append(ss, layer, k, v)
        q = torch.randn(6, HQ, D, generator=self.g)
        one = per.decode_block([sp], [1], 1, q[:1].contiguous())
        self.assertTrue(torch.equal(shared.decode_block([ss], [1], 1, q[:1].contiguous()), one))
        self.assertFalse(torch.equal(shared.decode_block([ss], [6], 1, q), per.decode_block([sp], [6], 1, q)))
        with self.assertRaises(RuntimeError):
            runtime(block_selection="all")

    def test_sequences_fork_rollback_free(self):
        rt = runtime()
        s, k, v = self.fill(rt, 45)
        c = rt.fork(s)
        rt.rollback(c, 9)
        self.assertEqual(rt.length(c, 1), 36)
        self.assertEqual(rt.length(s, 1), 45)
        p = rt.from_prefix(s, 5)
        self.assertEqual(rt.length(p, 0), 20)
        q = torch.randn(1, HQ, D, generator=self.g)
        full = [list(range(9))] * HKV
        torch.testing.assert_close(rt.dense([c], 1, q)[0], ref_attend(q[0], k, v, 36, full), rtol=1e-5, atol=1e-5)
        for x in (s, c, p):
            rt.free(x)
        st = rt.stats()
        self.assertEqual(st["live_pages"], 0)
        self.assertEqual(st["live_sequences"], 0)

    def test_bad_inputs_change_nothing(self):
        rt = runtime()
        s, _, _ = self.fill(rt, 20)
        kv = torch.zeros(3, HKV, D)
        q = torch.zeros(1, HQ, D)
        cases = [
            (lambda: rt.append(s, 1, kv.double(), kv.double()), "float32"),
            (lambda: rt.append(s, 1, torch.zeros(3, HKV + 1, D), torch.zeros(3, HKV + 1, D)), "shape"),
            (lambda: rt.append(s, 1, torch.zeros(3, D, HKV).transpose(1, 2), kv), "contiguous"),
            (lambda: rt.append(s, 7, kv, kv), "layer 7"),
            (lambda: rt.append(12345, 1, kv, kv), "does not exist"),
            (lambda: rt.decode([s], 1, torch.zeros(2, HQ, D)), "shape"),
            (lambda: rt.decode([], 1, q), "empty batch"),
            (lambda: rt.rollback(s, 21), "rollback"),
            (lambda: questkv.Runtime(layers=2, q_heads=6, kv_heads=4), "kv_heads"),
            (lambda: questkv.Runtime(layers=2, cold_miss="sometimes"), "cold-miss"),
            (lambda: runtime(hbm_bytes=-1), "hbm_bytes = -1 is out of range"),
            (lambda: runtime(max_pages=1 << 32), "max_pages"),
        ]
        for call, words in cases:
            with self.assertRaises(RuntimeError) as cm:
                call()
            self.assertIn(words, str(cm.exception))
        self.assertEqual(rt.length(s, 1), 20)
        self.assertEqual(rt.stats()["live_sequences"], 1)
        with self.assertRaises(TypeError):
            questkv.Runtime(layer=2)

    def decode_tiered_beside_in_memory(self, seed, **tiers):
        """Ten decode steps of a runtime with tiny hbm and host budgets and a
        disk tier, each compared bit for bit with an all-in-memory runtime's;
        returns the tiered runtime's stats."""
        with tempfile.TemporaryDirectory() as disk:
            page_bytes = 2 * HKV * S * D * 4
            small = runtime(hbm_bytes=12 * page_bytes, host_bytes=8 * 4096, disk_dir=disk, disk_bytes=64 << 20,
                            **tiers)
            big = runtime()
            torch.manual_seed(seed)
            k = torch.randn(300, HKV, D)
            v = torch.randn(300, HKV, D)
            seqs = []
            for rt in (small, big):
                s = rt.create_sequence()
                for layer in range(2):
                    rt.append(s, layer, k, v)
                seqs.append(s)
            for step in range(10):
                q = torch.randn(1, HQ, D)
                self.assertTrue(torch.equal(small.decode([seqs[0]], 1, q), big.decode([seqs[1]], 1, q)), step)
            return small.stats()

    def test_a_tiered_runtime_gives_the_same_bits(self):
        self.assertGreater(self.decode_tiered_beside_in_memory(5)["bytes_disk_to_host"], 0)

    def test_a_deadline_skip_limit_of_zero_waits_like_strict(self):
        st = self.decode_tiered_beside_in_memory(6, cold_miss="deadline", deadline_skip_limit=0.0)
        self.assertGreater(st["deadline_waits"], 0)
        self.assertEqual(st["pages_skipped"], 0)
        self.assertGreater(st["bytes_disk_to_host"], 0)
        with self.assertRaises(RuntimeError):
            runtime(cold_miss="deadline", deadline_skip_limit=1.5)


def cuda_runtime(**kw):
    """A CUDA-backend runtime, or None where questkv was built without CUDA."""
    base = dict(layers=2, q_heads=8, kv_heads=2, head_dim=64, page_size=16, dtype="f16", token_budget=128,
                sink_pages=1, local_pages=2, dense_layers=[0], max_pages=4096, backend="cuda")
    base.update(kw)
    try:
        return questkv.Runtime(**base)
    except RuntimeError as e:
        if "CUDA" in str(e) or "cuda" in str(e):
            return None
        raise


@unittest.skipUnless(torch.cuda.is_available(), "no CUDA device")
class DeviceTensors(unittest.TestCase):
    """CUDA tensors in the model dtype (the device API) against float32 CPU
    tensors (the host API) of a twin runtime: the same pages, outputs within
    f16 rounding; work queued on a side stream of the caller's."""
    HKV, HQ, D, S = 2, 8, 64, 16

    def setUp(self):
        self.host, self.dev = cuda_runtime(), cuda_runtime()
        if self.host is None:
            self.skipTest("questkv built without the CUDA backend")
        self.g = torch.Generator().manual_seed(11)

    def kv(self, n):
        k = torch.randn(n, self.HKV, self.D, generator=self.g).half()
        v = torch.randn(n, self.HKV, self.D, generator=self.g).half()
        return k, v

    def append_both(self, seqs, layer, k, v, draft=False):
        self.host.append(seqs[0], layer, k.float(), v.float(), draft=draft)
        self.dev.append(seqs[1], layer, k.cuda(), v.cuda(), draft=draft)

    def test_decode_and_blocks_match_the_host_api_on_a_side_stream(self):
        side = torch.cuda.Stream()
        seqs = [(self.host.create_sequence(), self.dev.create_sequence()) for _ in range(2)]
        with torch.cuda.stream(side):
            for i, s in enumerate(seqs):
                for layer in range(2):
                    k, v = self.kv(300 + 37 * i)
                    for start in range(0, k.shape[0], 64):
                        self.append_both(s, layer, k[start:start + 64].contiguous(), v[start:start + 64].contiguous())
            for step in range(6):
                for layer in range(2):
                    for s in seqs:
                        self.append_both(s, layer, *self.kv(1))
                    q = torch.randn(2, self.HQ, self.D, generator=self.g).half()
                    want = self.host.decode([s[0] for s in seqs], layer, q.float())
                    # q made on the side stream right before the call: the
                    # runtime's stream must wait for it.
                    qd = q.cuda() * 1.0
                    got = self.dev.decode([s[1] for s in seqs], layer, qd)
                    self.assertEqual(got.dtype, torch.float16)
                    torch.testing.assert_close(got.float().cpu(), want, rtol=2e-3, atol=2e-3)
            # Blocks of drafts: 5 and 3 tokens, verified in one call, 2 and 1 kept.
            blocks = [5, 3]
            for layer in range(2):
                for s, n in zip(seqs, blocks):
                    self.append_both(s, layer, *self.kv(n), draft=True)
            for layer in range(2):
                q = torch.randn(sum(blocks), self.HQ, self.D, generator=self.g).half()
                want = self.host.decode_block([s[0] for s in seqs], blocks, layer, q.float())
                got = self.dev.decode_block([s[1] for s in seqs], blocks, layer, q.cuda())
                torch.testing.assert_close(got.float().cpu(), want, rtol=2e-3, atol=2e-3)
            for rt, col in ((self.host, 0), (self.dev, 1)):
                rt.rollback(seqs[0][col], 3)
                rt.rollback(seqs[1][col], 2)
                rt.accept(seqs[0][col])
                rt.accept(seqs[1][col])
            for layer in range(2):
                for s in seqs:
                    self.append_both(s, layer, *self.kv(1))
                q = torch.randn(2, self.HQ, self.D, generator=self.g).half()
                want = self.host.decode([s[0] for s in seqs], layer, q.float())
                out = torch.empty(2, self.HQ, self.D, dtype=torch.float16, device="cuda")
                self.assertIs(self.dev.decode([s[1] for s in seqs], layer, q.cuda(), out=out), out)
                torch.testing.assert_close(out.float().cpu(), want, rtol=2e-3, atol=2e-3)
        torch.cuda.current_stream().wait_stream(side)
        self.assertEqual([self.dev.length(s[1], 1) for s in seqs], [self.host.length(s[0], 1) for s in seqs])

    def test_tensor_core_scores_are_an_option_within_rounding(self):
        # cuda_mma_scores sums the same bound in another order: on random
        # keys no two pages' scores are that close, so the same pages and
        # the same outputs as the CUDA-core scores.
        mma = cuda_runtime(cuda_mma_scores=True)
        seqs = (self.host.create_sequence(), mma.create_sequence())
        for layer in range(2):
            k, v = self.kv(700)
            self.host.append(seqs[0], layer, k.float(), v.float())
            mma.append(seqs[1], layer, k.cuda(), v.cuda())
        for _ in range(4):
            q = torch.randn(1, self.HQ, self.D, generator=self.g).half()
            want = self.host.decode([seqs[0]], 1, q.float())
            got = mma.decode([seqs[1]], 1, q.cuda())
            torch.testing.assert_close(got.float().cpu(), want, rtol=2e-3, atol=2e-3)

    def test_bad_device_tensors_are_errors_that_change_nothing(self):
        s = self.dev.create_sequence()
        k, v = self.kv(20)
        self.dev.append(s, 1, k.cuda(), v.cuda())
        with self.assertRaisesRegex(RuntimeError, "model dtype"):
            self.dev.append(s, 1, k.float().cuda(), v.float().cuda())
        with self.assertRaisesRegex(RuntimeError, "shape"):
            self.dev.append(s, 1, k[:, :1].contiguous().cuda(), v[:, :1].contiguous().cuda())
        with self.assertRaisesRegex(RuntimeError, "same device|CUDA tensor|CPU tensor"):
            self.dev.append(s, 1, k.cuda(), v)
        q = torch.randn(1, self.HQ, self.D).half().cuda()
        with self.assertRaisesRegex(RuntimeError, "CPU tensors"):
            self.dev.dense([s], 1, q)
        self.assertEqual(self.dev.length(s, 1), 20)
        self.assertEqual(self.dev.decode([s], 1, q).shape, (1, self.HQ, self.D))
        cpu = runtime()
        cs = cpu.create_sequence()
        with self.assertRaisesRegex(RuntimeError, "CUDA backend"):
            cpu.append(cs, 1, torch.randn(2, HKV, D).cuda(), torch.randn(2, HKV, D).cuda())


@unittest.skipUnless(torch.cuda.is_available(), "no CUDA device")
class EngineOwnedOpsOnCuda(unittest.TestCase):
    """update_summaries and select_pages on an engine's CUDA tensors against
    the same ops on float32 CPU copies of the same values: equal summaries and
    equal page ids (the CUDA select scores as the CPU selector does)."""
    HKV, HQ, D, S = 2, 8, 64, 16
    DTYPES = (torch.float32, torch.float16, torch.bfloat16)

    def setUp(self):
        self.g = torch.Generator().manual_seed(21)
        try:  # a one-page call: Unimplemented where questkv was built without CUDA
            questkv.update_summaries(torch.zeros(1, self.S, self.HKV, self.D, device="cuda"),
                                     torch.zeros(1, self.HKV, 2, self.D, device="cuda"),
                                     torch.tensor([0], dtype=torch.int32), torch.tensor([1], dtype=torch.int32))
        except RuntimeError as e:
            if "without CUDA" in str(e):
                self.skipTest("questkv built without CUDA")
            raise

    def test_summaries_equal_the_cpu_ops(self):
        P = 9
        pages = torch.tensor([0, 3, 8, 5], dtype=torch.int32)
        lens = torch.tensor([self.S, 1, 7, self.S], dtype=torch.int32)
        for dt in self.DTYPES:
            k_nhd = torch.randn(P, self.S, self.HKV, self.D, generator=self.g).to(dt)
            for layout, kc in (("NHD", k_nhd), ("HND", k_nhd.permute(0, 2, 1, 3).contiguous())):
                for table_device in ("cpu", "cuda"):
                    want = torch.full((P, self.HKV, 2, self.D), 7.0)
                    questkv.update_summaries(kc.float(), want, pages, lens, layout)
                    got = torch.full((P, self.HKV, 2, self.D), 7.0, dtype=dt, device="cuda")
                    questkv.update_summaries(kc.cuda(), got, pages.to(table_device), lens.to(table_device), layout)
                    self.assertTrue(torch.equal(got.float().cpu(), want), (dt, layout, table_device))

    def test_select_pages_equal_the_cpu_ops_on_a_side_stream(self):
        tokens = [700, 90, 1500, 33]
        npages = [(t + self.S - 1) // self.S for t in tokens]
        P = sum(npages) + 5
        indptr = torch.tensor([0] + list(torch.tensor(npages).cumsum(0)), dtype=torch.int32)
        last = torch.tensor([t - (n - 1) * self.S for t, n in zip(tokens, npages)], dtype=torch.int32)
        side = torch.cuda.Stream()
        for dt in self.DTYPES:
            for gqa in ("max", "mean", "union"):
                perm = torch.randperm(P, generator=self.g)[:sum(npages)].to(torch.int32)
                summ = torch.randn(P, self.HKV, 2, self.D, generator=self.g).to(dt).sort(dim=2).values
                q = torch.randn(len(tokens), self.HQ, self.D, generator=self.g).to(dt)
                want = questkv.select_pages(q.float(), summ.float(), indptr, perm, last, self.S, 8 * self.S, 1, 2, gqa)
                with torch.cuda.stream(side):
                    got = questkv.select_pages(q.cuda(), summ.cuda(), indptr.cuda(), perm.cuda(), last, self.S,
                                               8 * self.S, 1, 2, gqa)
                side.synchronize()
                self.assertEqual((got.dtype, got.device.type), (torch.int32, "cuda"))
                got = got.cpu()
                for b in range(len(tokens)):
                    for h in range(self.HKV):
                        row = [x for x in want[b, h].tolist() if x >= 0]
                        self.assertEqual(got[b, h, :len(row)].tolist(), row, (dt, gqa, b, h))
                        self.assertTrue(all(x == -1 for x in got[b, h, len(row):].tolist()), (dt, gqa, b, h))

    def test_bad_inputs_are_errors_that_change_nothing(self):
        P = 4
        summ = torch.randn(P, self.HKV, 2, self.D, device="cuda").half()
        before = summ.clone()
        q = torch.randn(1, self.HQ, self.D, device="cuda").half()
        ip, ix, last = (torch.tensor(x, dtype=torch.int32) for x in ([0, 2], [0, 1], [3]))
        kc = torch.randn(P, self.S, self.HKV, self.D, device="cuda").half()
        one = torch.tensor([0], dtype=torch.int32)
        cases = [
            (lambda: questkv.select_pages(q, summ.float(), ip, ix, last, self.S, 128), "must be"),
            (lambda: questkv.select_pages(q, summ.cpu(), ip, ix, last, self.S, 128), "summaries must be on"),
            (lambda: questkv.select_pages(q, summ, ip, torch.tensor([0, 9], dtype=torch.int32), last, self.S, 128),
             "outside"),
            (lambda: questkv.select_pages(q.double(), summ, ip, ix, last, self.S, 128), "float32, float16 or"),
            (lambda: questkv.update_summaries(kc, summ, one, torch.tensor([self.S + 1], dtype=torch.int32)),
             "outside 1.."),
            (lambda: questkv.update_summaries(kc, summ.bfloat16(), one, one), "must be"),
            (lambda: questkv.update_summaries(kc, summ, torch.tensor([P], dtype=torch.int32), one), "outside 0.."),
        ]
        for call, words in cases:
            with self.assertRaises(RuntimeError) as cm:
                call()
            self.assertIn(words, str(cm.exception))
        self.assertTrue(torch.equal(summ, before))


if __name__ == "__main__":
    unittest.main()
