"""The README's PyTorch snippet runs as written (its ```python blocks)."""
import os
import re
import unittest

try:
    import torch
    import questkv  # noqa: F401  (the snippet imports it too)
except ImportError as e:
    raise SystemExit(f"test_readme: FAILED: cannot import torch/questkv ({e}); set PYTHONPATH=<build>/python")

README = os.path.join(os.path.dirname(__file__), "..", "..", "README.md")


class ReadmeSnippets(unittest.TestCase):
    def test_python_blocks_run(self):
        blocks = re.findall(r"```python\n(.*?)```", open(README, encoding="utf-8").read(), re.S)
        self.assertTrue(blocks, "the README has no ```python block")
        for code in blocks:
            scope = {}
            exec(compile(code, "README.md", "exec"), scope)
            self.assertEqual(tuple(scope["out"].shape), (1, 8, 64))
            self.assertTrue(torch.isfinite(scope["out"]).all())
            pages = scope["pages"]
            self.assertEqual(pages.shape[:2], (1, 2))
            row = [p for p in pages[0, 0].tolist() if p >= 0]
            self.assertEqual(len(row), 256 // 16)  # the budget's pages: sink + local + top-K
            self.assertEqual(row, sorted(row))


if __name__ == "__main__":
    unittest.main()
