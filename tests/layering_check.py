#!/usr/bin/env python3
"""Fails when a file includes a header of a layer above its own.

The layers, bottom up (DESIGN.md §2): include/questkv and core; kernels;
selector and tiers (tiers over topology, a leaf); prefetch; runtime; parallel
beside runtime over the selector; tools and python on top. tests/ and bench/
may include anything. Usage: layering_check.py SOURCE_ROOT"""
import os
import re
import sys

BASE = {"include", "core"}
ALLOWED = {
    "include": {"include"},
    "core": BASE,
    "topology": BASE | {"topology"},
    "kernels": BASE | {"kernels"},
    "selector": BASE | {"kernels", "selector"},
    "tiers": BASE | {"kernels", "topology", "tiers"},
    "prefetch": BASE | {"kernels", "topology", "tiers", "prefetch"},
    "parallel": BASE | {"kernels", "selector", "topology", "parallel"},
    "runtime": BASE | {"kernels", "selector", "topology", "tiers", "prefetch", "runtime"},
    "tools": BASE | {"kernels", "selector", "topology", "tiers", "prefetch", "runtime", "parallel", "tools"},
    "python": BASE | {"kernels", "selector", "topology", "tiers", "prefetch", "runtime", "python"},
}
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)
SOURCES = (".h", ".cc", ".cu", ".cuh", ".c", ".cpp")


def layer_of_include(path):
    top = path.split("/", 1)[0]
    return "include" if top == "questkv" else top


def main():
    root = sys.argv[1]
    problems, checked = [], 0
    for layer, allowed in ALLOWED.items():
        for dirpath, _, names in os.walk(os.path.join(root, layer)):
            for name in names:
                if not name.endswith(SOURCES):
                    continue
                path = os.path.join(dirpath, name)
                rel = os.path.relpath(path, root)
                with open(path, encoding="utf-8", errors="replace") as f:
                    text = f.read()
                for inc in INCLUDE.findall(text):
                    checked += 1
                    target = layer_of_include(inc)
                    if "/" not in inc and target not in ALLOWED:
                        continue  # a sibling file named without its folder
                    if target in ALLOWED and target not in allowed:
                        problems.append(f"{rel}: includes \"{inc}\" ({target} is above {layer})")
    for p in problems:
        print("layering_check: " + p, file=sys.stderr)
    print(f"layering_check: {checked} includes checked, {len(problems)} upward")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
