#!/usr/bin/env python3
"""Per-fixture figures of one backend against numpy and llama.cpp, for every q3moe256 quant file.

    python bench/quant_figures.py                 # the cpu backend
    python bench/quant_figures.py --backend vulkan

For each tests/fixtures/q3moe256-<TYPE>.gguf: the tensor types it holds; over the 48 tokens of
its .ref.npz, the largest |logit - numpy's| as a fraction of numpy's largest |logit|; the
cosine against llama.cpp's logits per position (smallest, median, positions >= 0.999); and
whether 6 greedy tokens after a 6-token prompt are numpy's. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import onebit  # noqa: E402
from conftest import cosine_rows, greedy_tokens  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="cpu")
    args = ap.parse_args()
    print(f"| file | types | max abs diff vs numpy / max abs logit | cos vs llama.cpp: min | median | "
          f"positions >= 0.999 | greedy == numpy |")
    print("|---|---|---:|---:|---:|---:|---|")
    for path in sorted((ROOT / "tests" / "fixtures").glob("q3moe256-*.gguf")):
        ref = np.load(path.with_suffix(".ref.npz"))
        ids = ref["tokens"].astype(np.int64)
        want_m, got_m = onebit.load(path, backend="numpy"), onebit.load(path, backend=args.backend)
        kinds = collections.Counter(t.type_name for t in got_m.gguf.tensors.values() if len(t.shape) > 1)
        want, got = want_m.logits(ids), got_m.logits(ids)
        rel = float(np.abs(got - want).max() / np.abs(want).max())
        cos = cosine_rows(got, ref["logits_llama"])
        same = greedy_tokens(got_m, ids[:6], 6) == greedy_tokens(want_m, ids[:6], 6)
        print(f"| {path.stem} | {', '.join(sorted(kinds))} | {rel:.2e} | {cos.min():.5f} | {np.median(cos):.6f} | "
              f"{int((cos >= 0.999).sum())}/{len(cos)} | {'yes' if same else 'NO'} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
