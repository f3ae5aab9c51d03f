#!/usr/bin/env python3
"""Greedy tokens and logits of every fixture, this checkout against another one (e.g. the
commit before a refactor), on the numpy and Vulkan backends.

Each tree runs in its own process: teacher-forced logits of the first 12 reference tokens, and
8 greedy tokens after a 6-token prompt (one forward per token). The table says whether the
tokens are the same and whether the logits are bit-identical (else the largest difference
relative to the largest logit). The other tree needs `onebit/memory` and `onebit/cli` links
to its top-level `memory/` and `cli/` (see bench/bench_modes.py).

    python tools/compare_trees.py --other /tmp/before [--backends numpy,vulkan]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"


def worker(tree: str, out: str, backends: list[str]) -> None:
    sys.path.insert(0, tree)
    import numpy as np

    import onebit

    tokens = {}
    for f in sorted(FIXTURES.glob("*.gguf")):
        ids = np.load(f.with_suffix(".ref.npz"))["tokens"][:12].astype(np.int64)
        for be in backends:
            m = onebit.load(f, backend=be)
            assert m.be.name == be, f"{f.name}: {be} backend not in use"
            np.save(Path(out) / f"{f.stem}-{be}.npy", m.logits(ids))
            cache = m.new_cache()
            logits = m.net.forward(ids[:6], cache, last_only=True)
            toks = []
            for _ in range(8):
                toks.append(int(np.argmax(logits[-1])))
                logits = m.net.forward(np.array([toks[-1]]), cache)
            tokens[f"{f.stem}/{be}"] = toks
    (Path(out) / "tokens.json").write_text(json.dumps(tokens))


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3], sys.argv[4].split(","))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--other", type=Path, required=True)
    ap.add_argument("--backends", default="numpy,vulkan")
    a = ap.parse_args()
    import numpy as np

    dirs = {}
    for key, tree in (("this", ROOT), ("other", a.other.resolve())):
        dirs[key] = tempfile.mkdtemp(prefix=f"compare-{key}-")
        env = dict(os.environ, PYTHONPATH=str(tree))
        subprocess.run([sys.executable, __file__, "--worker", str(tree), dirs[key], a.backends], env=env, check=True)
    toks = {k: json.loads((Path(d) / "tokens.json").read_text()) for k, d in dirs.items()}
    differ = 0
    print(f"{'fixture':<24} {'backend':<7} {'greedy tokens':<14} logits")
    for key in toks["this"]:
        stem, be = key.split("/")
        x, y = (np.load(Path(d) / f"{stem}-{be}.npy") for d in (dirs["this"], dirs["other"]))
        same = toks["this"][key] == toks["other"][key]
        differ += not same
        rel = float(np.abs(x - y).max() / np.abs(y).max())
        print(f"{stem:<24} {be:<7} {'same' if same else 'DIFFERENT':<14} "
              f"{'bit-identical' if np.array_equal(x, y) else f'max diff {rel:.1e} of the largest'}")
    print(f"{len(toks['this'])} runs, {differ} with different greedy tokens")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
