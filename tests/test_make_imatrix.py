"""tools/make_imatrix.py: the importance matrix llama-quantize needs for its lowest-bit presets,
made by onebit's numpy engine (tools/sweep_quants.py and tools/make_fixtures.py call it)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import onebit
from conftest import FIXTURES

ROOT = FIXTURES.parent.parent


# qwen3moe: plain SwiGLU experts; gpt-oss: expert biases and the clamped SwiGLU (the two
# extra arguments the numpy backend's expert_ffn takes)
@pytest.mark.parametrize("stem", ["qwen3moe-f32", "gptoss-f32"])
def test_imatrix_covers_every_matmul(stem, tmp_path):
    from gguf import GGUFReader

    out = tmp_path / "m.imatrix.gguf"
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "make_imatrix.py"), str(FIXTURES / f"{stem}.gguf"),
                        str(out)], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    t = {x.name: np.array(x.data, np.float64) for x in GGUFReader(out).tensors}
    model = onebit.load(FIXTURES / f"{stem}.gguf", backend="numpy")
    cfg = model.cfg
    n_tokens = int(t["output.weight.counts"].sum())
    for i in range(cfg.n_layers):
        for part in ("q", "k", "v", "output"):
            assert t[f"blk.{i}.attn_{part}.weight.counts"].sum() == n_tokens
        names = [f"blk.{i}.ffn_{p}_exps.weight" for p in ("gate", "up", "down")]
        counts = [t[n + ".counts"].ravel() for n in names]
        assert all(len(c) == cfg.n_experts for c in counts)
        # every token reaches n_experts_used experts, and each expert's three parts saw its tokens
        assert counts[0].sum() == n_tokens * cfg.n_experts_used
        assert np.array_equal(counts[0], counts[1]) and np.array_equal(counts[0], counts[2])
        gate, up, down = (t[n + ".in_sum2"].reshape(cfg.n_experts, -1) for n in names)
        np.testing.assert_array_equal(gate, up)  # the same input rows
        assert np.isfinite(down).all() and (down[counts[2] > 0] > 0).any(axis=1).all()
    model.close()
