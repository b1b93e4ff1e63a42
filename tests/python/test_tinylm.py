"""questkv under a real model: tinylm (shared/models/tinylm) decodes a C header
it never saw, teacher-forced, with questkv's attention in place of its own.

Runs as ``/usr/bin/python3 -m unittest tests/python/test_tinylm.py``. The
questkv package comes from QUESTKV_PYTHONPATH (default build/python); when it
cannot be imported every test fails saying why.
"""
import importlib.util
import math
import os
import sys
import tempfile
import unittest

import torch

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
PACKAGE_PATH = os.environ.get("QUESTKV_PYTHONPATH", os.path.join(REPO, "build", "python"))
MODEL_DIR = os.path.join(REPO, "..", "shared", "models", "tinylm")
TEXT = "/usr/include/stdio.h"  # C, not the model's Python training data
PREFILL, STEPS = 1024, 32
QUEST_TOLERANCE = 0.02  # nats/byte Quest may land below dense by chance


def load_tinylm():
    """tinylm.py from this source tree, not a build's copy of it."""
    spec = importlib.util.spec_from_file_location(
        "questkv_tinylm", os.path.join(REPO, "python", "questkv", "tinylm.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def import_questkv():
    sys.path.insert(0, PACKAGE_PATH)
    try:
        import questkv
    except Exception as e:  # ImportError, or OSError from loading the library
        raise AssertionError(f"cannot import questkv from {PACKAGE_PATH} ({type(e).__name__}: {e}); "
                             "build it with scripts/build.sh or set QUESTKV_PYTHONPATH") from e
    return questkv


class TorchDenseRuntime:
    """The dense part of questkv.Runtime's API in PyTorch: separates a fault of
    the model's decode loop from one of questkv."""

    def __init__(self, tl):
        self.tl, self.kv = tl, {}

    def create_sequence(self):
        self.kv[0] = self.tl.empty_cache()
        return 0

    def append(self, seq, layer, k, v):
        cache = self.kv[seq][layer]
        cache[0], cache[1] = torch.cat((cache[0], k)), torch.cat((cache[1], v))

    def dense(self, seqs, layer, q):
        k, v = self.kv[seqs[0]][layer]
        return self.tl.causal_attention(q, k, v, k.shape[0] - 1)

    decode = dense

    def stats(self):
        return {}

    def free(self, seq):
        del self.kv[seq]


class TinyLMTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.questkv = import_questkv()
        cls.tl = load_tinylm()
        cls.model = cls.tl.load(MODEL_DIR)
        with open(TEXT, "rb") as f:
            cls.data = f.read()[: PREFILL + STEPS + 1]
        cls.reference = cls.tl.reference_loss(cls.model, cls.data, PREFILL, STEPS)
        cls.cache = cls.tl.prefill_cache(cls.model, cls.data, PREFILL)  # shared by the questkv runs

    def run_questkv(self, rt, dense=False):
        return self.tl.questkv_loss(self.model, rt, self.data, PREFILL, STEPS, dense=dense, cache=self.cache)

    def runtime(self, **overrides):
        config = dict(layers=6, q_heads=6, kv_heads=2, head_dim=64, page_size=16, token_budget=256,
                      sink_pages=1, local_pages=8, dense_layers=[0, 1], gqa="max", backend="cpu")
        config.update(overrides)
        return self.questkv.Runtime(**config)

    def report(self, what, loss):
        print(f"\n  {what}: {loss:.6f} nats/byte (reference {self.reference:.6f})", file=sys.stderr)

    def test_decode_loop_matches_reference_in_pytorch(self):
        r = self.tl.questkv_loss(self.model, TorchDenseRuntime(self.tl), self.data, PREFILL, STEPS)
        self.assertLess(abs(r.loss - self.reference), 1e-4)

    def test_every_layer_dense_reproduces_reference(self):
        r = self.run_questkv(self.runtime(dense_layers=range(6)))
        self.report("decode, dense_layers 0-5", r.loss)
        self.assertLess(abs(r.loss - self.reference), 1e-4)
        self.assertEqual(r.stats["head_pages_selected"], r.stats["head_pages_total"])

    def test_dense_call_reproduces_reference(self):
        r = self.run_questkv(self.runtime(), dense=True)
        self.assertLess(abs(r.loss - self.reference), 1e-4)

    def test_quest_budget_256_loses_little(self):
        r = self.run_questkv(self.runtime(token_budget=256))
        self.report("Quest, budget 256", r.loss)
        self.assertTrue(math.isfinite(r.loss))
        self.assertGreaterEqual(r.loss, self.reference - QUEST_TOLERANCE)
        self.assertLess(r.stats["head_pages_selected"], r.stats["head_pages_total"])

    def test_blocks_per_position_equal_single_tokens_and_shared_differ(self):
        # A verifier's blocks of 4 with per-position pages are the
        # single-token decode (logits within float rounding: the block's
        # layers run on [4, 384] matrices); one page set a block changes them.
        single = self.run_questkv(self.runtime(token_budget=256))
        blocks = self.tl.questkv_block_loss(self.model, self.runtime(token_budget=256), self.data, PREFILL, STEPS, 4,
                                            cache=self.cache)
        torch.testing.assert_close(blocks.logits, single.logits, rtol=1e-4, atol=1e-4)
        shared = self.tl.questkv_block_loss(self.model, self.runtime(token_budget=256, block_selection="shared"),
                                            self.data, PREFILL, STEPS, 4, cache=self.cache)
        self.report("Quest 256, blocks of 4, shared pages", shared.loss)
        self.assertFalse(torch.allclose(shared.logits, single.logits, rtol=1e-4, atol=1e-4))
        self.assertTrue(math.isfinite(shared.loss))
        # The block calls count what they read, as single-token calls do.
        for r in (blocks, shared):
            self.assertGreater(r.stats["head_pages_total"] - r.prefill_stats["head_pages_total"], 0)
        self.assertEqual(blocks.stats["head_pages_total"], single.stats["head_pages_total"])

    def test_tiered_runtime_equals_in_memory_bit_for_bit(self):
        in_memory = self.run_questkv(self.runtime())
        with tempfile.TemporaryDirectory() as disk_dir:
            # The K/V is 6.3 MiB; 2 MiB of hbm and 1 MiB of host push pages to disk.
            rt = self.runtime(hbm_bytes=2 << 20, host_bytes=1 << 20, disk_dir=disk_dir,
                              disk_bytes=256 << 20, cold_miss="strict")
            tiered = self.run_questkv(rt)
            del rt
        self.assertGreater(tiered.stats["bytes_host_to_disk"], 0)
        self.assertGreater(tiered.stats["bytes_disk_to_host"], 0)
        self.assertTrue(torch.equal(tiered.logits, in_memory.logits))


if __name__ == "__main__":
    unittest.main()
