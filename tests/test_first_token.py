"""The first use of the cpu backend on a fresh machine compiles only what the file needs.

The products (matmul, matmul3, get_rows, the expert FFNs) are compiled for the file's quant
types (`kernel_sets.Kernels`): the all-types kernels' source with the type dispatch cut, which
must give the all-types kernels' bits. Compile cost is judged by what numba compiled and
cached (dispatcher signatures, cache files), never by time.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np

from conftest import fixture_path
from onebit.backends.cpu import CpuBackend, base, int_dots, kernel_sets, products
from onebit.backends.vulkan.reference import random_blocks
from onebit.formats.gguf_file import GGUFFile
from onebit.formats.quants import QTYPES_BY_NAME

ROOT = Path(__file__).resolve().parent.parent


def test_a_fresh_machine_compiles_only_the_files_types(tmp_path):
    """An empty numba cache (a fresh machine) and a small Q8_0 file (under the cpu backend's
    X16_FROM: no X16 layout): the backend compiles the Q8_0 + F32 products and the small ops, and nothing of any
    other type or layout: the all-types kernels
    (which hold every type's code, Q4_K's among them) are never compiled or loaded, and the
    disk cache holds only kernels of that set. A forward then compiles nothing more (prompt,
    decode, and the streamed experts of a pool)."""
    code = f"""
import os, numpy as np, onebit
from onebit.backends.cpu import kernel_sets, products
m = onebit.load({str(fixture_path("q3moe256-Q8_0.gguf"))!r}, backend="cpu")
assert m.be.K.names == ("Q8_0", "F32"), m.be.K.names
assert m.be.K.parts == ("dense", "fused", "experts", "small"), m.be.K.parts
kernels = m.be.K.kernels()
before = [len(k.signatures) for k in kernels]
assert all(before), [k.__name__ for k, n in zip(kernels, before) if not n]
cache = m.new_cache()
m.net.forward(np.arange(1, 12), cache)
for t in range(3):
    m.net.forward(np.array([t + 1]), cache)
s = onebit.load({str(fixture_path("q3moe256-Q8_0.gguf"))!r}, backend="cpu", slots=4)
s.logits([1, 2, 3])
assert before == [len(k.signatures) for k in kernels], "a forward compiled"
every = [getattr(products, n) for n in kernel_sets.PRODUCTS + ("matmul_rows", "gate_up", "one_expert", "one_expert_oai")]
assert not any(k.signatures or k.stats.cache_misses or k.stats.cache_hits for k in every)
names = sorted(f for _, _, fs in os.walk(os.environ["NUMBA_CACHE_DIR"]) for f in fs if f.endswith(".nbi"))
small = {{k.__name__ for k in kernel_sets.SMALL_OPS}} | {{"_attend", "quantize_acts"}}  # shared by every type set
assert all("__q8_0_f32-" in f or f.split(".")[1].split("-")[0] in small for f in names), names
assert any("expert_ffn__q8_0_f32" in f for f in names) and not any("oai__" in f for f in names), names
print("ok")
"""
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]
    assert "compiling the cpu kernels for Q8_0, F32" in r.stderr  # said before it happens
    seen = [tuple(map(int, m)) for m in re.findall(r"compiling kernels (\d+)/(\d+)", r.stderr)]  # (the progress)
    # the kernels of its parts: dense 2, fused 2, experts 1, small 5 (no attention with sinks: not gpt-oss)
    assert seen and seen[-1] == (10, 10) and seen == sorted(seen), r.stderr[-3000:]


def ro(a):
    a = np.ascontiguousarray(a).view()
    a.flags.writeable = False
    return a


def test_kernels_of_some_types_give_the_all_types_bits(cpu_kernels):
    """Kernels(("Q8_0", "IQ4_NL")): a plain type (its dot inlined) and a codebook type (an
    outlined dot, an IR decoder): get_rows, matmul (1, 3 and 9 rows), matmul3 mixing the two,
    and the expert FFN give exactly the all-types kernels' bits."""
    k = kernel_sets.Kernels(("Q8_0", "IQ4_NL"))
    assert k.names == ("Q8_0", "IQ4_NL") and k.SUPPORTED == {QTYPES_BY_NAME[n].type_id for n in k.names}
    assert kernel_sets.Kernels({"IQ4_NL", "Q8_0"}).matmul is k.matmul  # one set of dispatchers per process
    rng = np.random.default_rng(34)
    for name in k.names:
        qt = QTYPES_BY_NAME[name].type_id
        n = 96
        w = ro(random_blocks(name, (40, n), rng))
        ids = np.array([3, 0, 39, 3], np.int64)
        pairs = []
        for kern in (k, products):
            out = np.full((4, n), np.nan, np.float32)
            kern.get_rows(out, w, ids, qt, base.LUT, base.M)
            pairs.append([out])
        for R in (1, 3, 9):
            x = rng.standard_normal((R, n)).astype(np.float32)
            for got, kern in zip(pairs, (k, products)):
                out = np.full((R, 40), np.nan, np.float32)
                kern.matmul(out, x, w, qt)
                got.append(out)
        other = [o for o in k.names if o != name][0]
        w2 = ro(random_blocks(other, (24, n), rng))
        x = rng.standard_normal((5, n)).astype(np.float32)
        for got, kern in zip(pairs, (k, products)):
            out = np.full((5, 104), np.nan, np.float32)
            kern.matmul3(out, x, w, w2, w, qt, QTYPES_BY_NAME[other].type_id, qt)
            got.append(out)
        E, R, top = 6, 11, 3
        gate, up, down = (ro(random_blocks(name, (E, n, n), rng)) for _ in range(3))
        x = rng.standard_normal((R, n)).astype(np.float32)
        chosen = np.stack([rng.choice(E, top, replace=False) for _ in range(R)])
        experts, offs, rows, rw = CpuBackend.routed_rows(chosen, rng.random((R, top)).astype(np.float32), E)
        for got, kern in zip(pairs, (k, products)):
            out = np.zeros_like(x)
            with np.errstate(over="ignore"):
                kern.expert_ffn(out, np.empty_like(x, shape=(len(rows), n)), x, gate, up, down, experts,
                                np.arange(len(experts)), offs, rows, rw, True, qt, qt, qt)
            got.append(out)
        mine, want = pairs
        assert not np.isnan(np.concatenate([a.ravel() for a in want])).all()
        for i, (a, b) in enumerate(zip(mine, want)):
            assert a.tobytes() == b.tobytes(), (name, i)


def test_a_file_takes_its_own_kernels_or_the_cached_all_types_ones(tmp_path, monkeypatch):
    """The choice, from what the disk cache holds: the file's own set when cached or when the
    all-types kernels are not (a fresh machine); the all-types kernels when only they are
    cached (here a cache that holds the all-types kernels and no set of the file's own: whether
    this machine's holds one depends on which tests ran first). A tensor of a type outside the
    set is not SUPPORTED by it (it would take the numpy path, never another type's code)."""
    m = GGUFFile(fixture_path("q3moe256-Q4_K_M.gguf"))
    every = {id(k) for k in kernel_sets.EVERY.kernels()}
    repacks = CpuBackend.memory_policy(m, repack_from=0).repacks  # (its layouts asked for)
    with monkeypatch.context() as mp:
        mp.setattr(kernel_sets, "_cached", lambda kernel: id(kernel) in every)
        k = kernel_sets.kernels_for(m, repacks)
    assert k.everything and k.SUPPORTED == base.SUPPORTED
    own = kernel_sets.Kernels({t.type_name for t in m.tensors.values() if len(t.shape) > 1}, k.parts)
    assert own.names == ("Q4_K", "Q6_K", "F32") and QTYPES_BY_NAME["Q8_0"].type_id not in own.SUPPORTED
    code = f"""
from onebit.formats.gguf_file import GGUFFile
from onebit.backends.cpu import CpuBackend, kernel_sets
g = GGUFFile({str(fixture_path("q3moe256-Q4_K_M.gguf"))!r})
k = kernel_sets.kernels_for(g, CpuBackend.memory_policy(g, repack_from=0).repacks)
print(k.everything, k.names, k.cold_parts())
"""
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    repack = ", 'repack'" if int_dots.VNNI else ""  # (its Q4_K and Q6_K repacked on AVX-512 VNNI: their repack kernels)
    assert r.stdout.split("\n")[0] == f"False ('Q4_K', 'Q6_K', 'F32') ('dense', 'fused', 'experts', 'small'{repack})", r


def test_a_files_set_holds_only_the_kernels_its_forward_calls():
    """A file's set compiles the small ops it calls (routing only with routed experts, attention
    with sinks only with gpt-oss's) and the serial repack of each of its types' layouts (the
    backend runs them on its threads); the all-types set holds every kernel."""
    dense = kernel_sets.Kernels(("Q8_0", "Q4_K", "Q6_K", "Q5_0"), ("dense", "fused", "small", "repack"))
    assert dense.names_of() == ("matmul", "matmul_serial", "get_rows", "matmul3", "rms_norm", "rope", "attention",
                                "repack_k_x16_serial", "repack_q6_k_x16_serial", "repack_plain_x16_serial")
    moe = kernel_sets.Kernels(("Q4_K", "F32"), ("dense", "fused", "small", "experts"))
    assert moe.names_of(("small",)) == ("rms_norm", "rope", "attention", "route", "routed_rows")
    oai = kernel_sets.Kernels(("MXFP4", "F32"), ("dense", "fused", "small", "experts_oai", "repack"))
    assert oai.names_of(("small", "repack")) == ("rms_norm", "rope", "attention", "attention_sinks", "route",
                                                 "routed_rows", "repack_plain_x16_serial")
    every = kernel_sets.EVERY.names_of()
    assert len(every) == len(set(every)) == sum(len(v) for v in kernel_sets.WARM_PARTS.values()) == 22


def test_the_compile_plan_compiles_matmul_rows_once(monkeypatch):
    """A cold set's kernels, each once, in the order the compile's processes take them: matmul
    first (this process's: it compiles matmul_rows, the row loops of every type of the set), the
    other products that call matmul_rows last (a worker waits for it in the disk cache); one
    process a core, at most one a kernel. matmul_rows already cached: no such order."""
    k = kernel_sets.Kernels(("Q4_K", "Q6_K", "F32"), ("dense", "fused", "experts", "small", "repack"))
    monkeypatch.setattr(kernel_sets, "_cached", lambda kernel: False)
    for cores in (1, 2, 16):
        order, processes, rows_cold = k.plan(cores)
        assert rows_cold and processes == min(cores, len(k.names_of())) and sorted(order) == sorted(k.names_of())
        uses = [n in kernel_sets.ROWS_USERS for n in order]
        assert order[0] == "matmul" and uses[1:] == sorted(uses[1:]) and sum(uses) == 4, order
    monkeypatch.setattr(kernel_sets, "_cached", lambda kernel: kernel is k.matmul_rows)
    order, _, rows_cold = k.plan(2)
    assert not rows_cold and sorted(order) == sorted(k.names_of())


def test_each_kernel_is_compiled_by_the_process_that_claims_it_first(tmp_path, monkeypatch):
    """`_compile` with a folder of claims calls only the kernels no other process has claimed,
    in order, and claims them."""
    k = kernel_sets.Kernels(("Q8_0", "F32"), ("dense", "small"))
    called = []
    monkeypatch.setattr(k, "_warm_one", called.append)
    assert kernel_sets._claim(str(tmp_path), "rope") and not kernel_sets._claim(str(tmp_path), "rope")
    k._compile(["rms_norm", "rope", "attention"], 0, str(tmp_path))
    assert called == ["rms_norm", "attention"]
    k._compile(["rms_norm", "rope", "attention"], 0, str(tmp_path))
    assert called == ["rms_norm", "attention"] and sorted(os.listdir(tmp_path)) == ["attention", "rms_norm", "rope"]


def test_a_worker_links_matmul_rows_from_the_disk_cache(tmp_path):
    """An empty disk cache: a worker given matmul_serial (wait: its parent's pid) while its parent
    compiles matmul loads matmul_rows from the disk cache once the parent has put it there, and
    never compiles it; what it compiles is its own matmul_serial."""
    script = tmp_path / "fill.py"
    script.write_text("""
import os, subprocess, sys
from onebit.backends.cpu.kernel_sets import Kernels
k = Kernels(("Q8_0", "F32"), (), False)
if sys.argv[1:] == ["worker"]:
    k._compile(["matmul_serial"], os.getppid())
    rows = k.matmul_rows.stats
    print(len(k.matmul_serial.stats.cache_misses), sum(rows.cache_hits.values()), sum(rows.cache_misses.values()))
else:
    w = subprocess.Popen([sys.executable, sys.argv[0], "worker"], stdout=subprocess.PIPE, text=True)
    k._compile(["matmul"])
    print("worker", w.communicate()[0].strip())
""")
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=900, cwd=ROOT, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().splitlines()[-1] == "worker 1 1 0", r.stdout + r.stderr[-3000:]


def test_a_repack_on_the_backends_threads_is_the_whole_repack(cpu_kernels):
    """repack_on_threads (the serial repack on each thread's run of whole groups, the last run
    with the N % 16 rows after them) gives repack_x16's bytes: 83 rows on 2 threads (48 + 35),
    and 7 rows (no whole group)."""
    import numba

    from onebit.backends.cpu import repack
    from onebit.backends.cpu.backend import repack_on_threads

    rng = np.random.default_rng(55)
    numba.set_num_threads(min(2, numba.config.NUMBA_NUM_THREADS))
    for name in ("Q4_K", "Q6_K", "Q5_0", "Q8_0", "IQ4_XS", "Q3_K"):
        qt = QTYPES_BY_NAME[name]
        for rows in (83, 7):
            raw = ro(random_blocks(name, (rows, 2 * 256), rng))
            want = repack.repack_x16(raw, qt.type_id)
            got = np.full(want.shape, 0xAB, np.uint8)
            repack_on_threads(raw, got, qt.type_id)
            assert got.tobytes() == want.tobytes(), (name, rows)
