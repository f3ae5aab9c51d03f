"""Check that the cpu kernels compiled for a file's types give the bits of the all-types kernels.

    python tools/check_kernel_bits.py [--old PATH] [--sets Q8_0,F32 ...]

For every type of each set (default: the shipped model's Q8_0 + F32, the nine plain types, and
MORE_TYPES with F32), fresh random blocks go through get_rows, matmul (1, 2, 3, 4, 5, 8, 13
rows), matmul_serial, matmul3 (two types of the set) and the expert FFNs (plain and gpt-oss),
each called once through `Kernels(set)` and once through the all-types kernels; every output
must be equal bit for bit ('*' as a set: this file's all-types kernels themselves).

With --old PATH (the single-module cpu kernels of a revision before onebit/backends/cpu/, e.g.
`git show a6d698d:onebit/backends/cpu_kernels.py > /tmp/old_kernels.py`), the all-types kernels of
that file are the reference instead (loaded as onebit.backends._old_kernels), and the small ops
are compared with that file's too. Minutes of compile on a cold cache (the all-types kernels
are compiled unless cached): run under nice. Prints one line per set and type, exits 1 on
any difference.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from onebit.backends.cpu import base, kernel_sets  # noqa: E402
from onebit.backends.vulkan.reference import random_blocks  # noqa: E402
from onebit.formats.quants import QTYPES_BY_NAME  # noqa: E402

PLAIN = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "MXFP4", "Q4_K", "Q5_K", "Q6_K")
SETS = (("Q8_0", "F32"), PLAIN, base.MORE_TYPES + ("F32",))


def ro(a):
    a = np.ascontiguousarray(a).view()
    a.flags.writeable = False
    return a


def load_old(path: str):
    """The module at `path` as onebit.backends._old_kernels (its relative imports resolve)."""
    spec = importlib.util.spec_from_file_location("onebit.backends._old_kernels", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def outputs(k, name: str, other: str, rng_seed: int) -> list[np.ndarray]:
    """Every kernel's output for type `name` (matmul3's middle matrix of type `other`)."""
    rng = np.random.default_rng(rng_seed)
    qt, q2 = QTYPES_BY_NAME[name].type_id, QTYPES_BY_NAME[other].type_id
    n = max(QTYPES_BY_NAME[name].block_size, 32) * 3
    w = ro(random_blocks(name, (40, n), rng))
    got = []
    ids = np.array([3, 0, 39, 3], np.int64)
    out = np.full((4, n), np.nan, np.float32)
    k.get_rows(out, w, ids, qt, base.LUT, base.M)
    got.append(out)
    for R in (1, 2, 3, 4, 5, 8, 13):
        x = rng.standard_normal((R, n)).astype(np.float32)
        out = np.full((R, 40), np.nan, np.float32)
        k.matmul(out, x, w, qt)
        got.append(out)
        out = np.full((R, 40), np.nan, np.float32)
        k.matmul_serial(out, x, w, qt)
        got.append(out)
    n2 = max(QTYPES_BY_NAME[other].block_size, 32) * 3
    if n2 == n:
        w2 = ro(random_blocks(other, (24, n), rng))
        x = rng.standard_normal((5, n)).astype(np.float32)
        out = np.full((5, 40 + 24 + 40), np.nan, np.float32)
        k.matmul3(out, x, w, w2, w, qt, q2, qt)
        got.append(out)
    E, hidden, R, kk = 6, n, 17, 3
    gate, up = (ro(random_blocks(name, (E, hidden, n), rng)) for _ in range(2))
    down = ro(random_blocks(name, (E, n, hidden), rng))
    x = rng.standard_normal((R, n)).astype(np.float32)
    ids = np.stack([rng.choice(E, kk, replace=False) for _ in range(R)])
    wts = rng.random((R, kk)).astype(np.float32)
    experts, offs, rows, rw = kernel_sets.EVERY.routed_rows(ids, wts, E)
    with np.errstate(over="ignore"):
        out = np.zeros_like(x)
        every, y = np.arange(len(experts)), np.empty((len(rows), x.shape[1]), np.float32)
        k.expert_ffn(out, y, x, gate, up, down, experts, every, offs, rows, rw, True, qt, qt, qt)
        got.append(out)
        bg, bu = (ro(rng.standard_normal((E, hidden)).astype(np.float32)) for _ in range(2))
        bd = ro(rng.standard_normal((E, n)).astype(np.float32))
        out = np.zeros_like(x)
        k.expert_ffn_oai(out, y, x, gate, up, down, experts, every, experts, offs, rows, rw, True, qt, qt, qt,
                         bg, bu, bd, 1.702, 7.0)
        got.append(out)
    return got


def small_outputs(mod, seed: int = 7) -> list[np.ndarray]:
    """The small ops' outputs (rms_norm, rope both ways, attention, routing) of module `mod`."""
    rng = np.random.default_rng(seed)
    x = ro(rng.standard_normal((3, 64)).astype(np.float32))
    out = np.empty_like(x)
    mod.rms_norm(out, x, ro(rng.standard_normal(64).astype(np.float32)), 1e-6)
    got = [out]
    q = ro(rng.standard_normal((3, 4, 32)).astype(np.float32))
    pos = ro(np.array([5, 6, 7], np.int64))
    inv = ro(10000.0 ** (-np.arange(0, 24, 2, dtype=np.float64) / 24))
    for neox in (True, False):
        out = np.empty_like(q)
        mod.rope(out, q, pos, inv, 1.0, neox)
        got.append(out)
    k, v = (ro(rng.standard_normal((9, 2, 32)).astype(np.float32)) for _ in range(2))
    out = np.empty_like(q)
    mod.attention(out, q, k, v, pos, 0)
    got.append(out)
    ids, wts = mod.route(ro(rng.standard_normal((3, 16)).astype(np.float32)), 4, True)
    return got + [ids, wts, *mod.routed_rows(ids, wts, 16)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", help="a cpu_kernels.py of a revision before onebit/backends/cpu/: its all-types kernels "
                    "are the reference")
    ap.add_argument("--sets", nargs="*", help="comma-separated type sets, '*' for the all-types kernels "
                    "(default: Q8_0,F32; the plain types; MORE_TYPES + F32)")
    args = ap.parse_args()
    ref = load_old(args.old) if args.old else kernel_sets.EVERY
    sets = [tuple(s.split(",")) for s in args.sets] if args.sets else SETS
    bad = 0
    if args.old:
        same = all(a.tobytes() == b.tobytes() for a, b in zip(small_outputs(kernel_sets.EVERY), small_outputs(ref)))
        bad += not same
        print(f"{'small ops (rms_norm, rope, attention, route, routed_rows)':69s} {'same bits' if same else 'DIFFER'}")
    for names in sets:
        k = kernel_sets.Kernels(None if names == ("*",) else names)
        for i, name in enumerate(k.names):
            other = k.names[(i + 1) % len(k.names)]
            mine, want = outputs(k, name, other, i), outputs(ref, name, other, i)
            same = all(a.shape == b.shape and a.tobytes() == b.tobytes() for a, b in zip(mine, want))
            bad += not same
            print(f"{','.join(k.names):60s} {name:8s} {len(mine)} outputs {'same bits' if same else 'DIFFER'}",
                  flush=True)
    print("all equal bit for bit" if not bad else f"{bad} types differ")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
