"""The kernels one backend calls, and their compile. `kernels_for(file, repack)` gives a `Kernels` set:
the products cloned with the type dispatch cut to the file's quant types (`_clone`, `_typed`),
or the all-types kernels when only they are in numba's disk cache; the small ops and repacks,
which every file shares. `Kernels.fill_cache` compiles a cold set into the disk cache, its kernels
side by side in worker processes (`Kernels.plan`; a set by one process of a machine at a time: a
lock file in the cache directory), and `warm_up` loads every kernel before the first forward."""

from __future__ import annotations

import contextlib
import os
import types as pytypes
from functools import cache
from pathlib import Path

import numpy as np

from ...formats.quants import QTYPES_BY_NAME
from .base import LUT, M, SUPPORTED, cached
from .ir_blocks import W
from .decode import _row_decoders
from .int_dots import VNNI
from .x16 import NIBBLE_X16, X16, X16_BLOCK
from .repack import (repack_iq4_xs_x16, repack_iq4_xs_x16_serial, repack_k_x16, repack_k_x16_serial, repack_plain_x16,
                     repack_plain_x16_serial, repack_q23_k_x16, repack_q23_k_x16_serial, repack_q6_k_x16,
                     repack_q6_k_x16_serial)
from .rows import _ORDER, _dispatch, _is_int, _rows_of
from .products import (SERIAL_WORK, acts, expert_ffn, expert_ffn_oai, gate_up, get_rows, matmul, matmul3, matmul_rows,
                       matmul_serial, one_expert, one_expert_oai)
from .small_ops import attention, attention_sinks, rms_norm, rope, route, routed_rows


SMALL_OPS = (rms_norm, rope, attention, attention_sinks, route, routed_rows)
REPACKS = (repack_k_x16, repack_k_x16_serial, repack_q6_k_x16, repack_q6_k_x16_serial, repack_plain_x16,
           repack_plain_x16_serial, repack_iq4_xs_x16, repack_iq4_xs_x16_serial, repack_q23_k_x16,
           repack_q23_k_x16_serial)


KERNELS = (matmul, matmul_serial, matmul3, get_rows, expert_ffn, matmul_rows, gate_up, one_expert, expert_ffn_oai,
           one_expert_oai)  # + SMALL_OPS, REPACKS


# -- the kernels of a file's types -----------------------------------------------------------
# A cold compile of the products for every type took 84-127 s on the 2-core VM (each product
# holds every type's dot code); for one file's two types (the shipped model: Q8_0, F32), with
# the small ops, about 13 s of CPU. So a backend takes the products compiled for its file's
# types: the same source, with the dot products' and decode_row's `if qt == ...` chains cut to
# those types, each type's code the all-types kernel's bit for bit (tests/test_first_token.py;
# every type: tools/check_kernel_bits.py).

PRODUCTS = ("matmul", "matmul_serial", "matmul3", "get_rows", "expert_ffn", "expert_ffn_oai")


def _clone(kernel, env: dict, tag: str):
    """`kernel`'s code compiled against its module's globals with `env` over them, cached on disk
    under its own name (`<name>__<tag>`: numba's index is by module, name and line)."""
    py = kernel.py_func
    f = pytypes.FunctionType(py.__code__, dict(py.__globals__, **env), py.__name__, py.__defaults__, py.__closure__)
    f.__qualname__ = f"{py.__qualname__}__{tag}"
    f.__doc__ = py.__doc__
    return cached(**{k: v for k, v in kernel.targetoptions.items() if k != "nopython"})(f)


@cache
def _typed(names: tuple[str, ...], x16: bool) -> dict:
    """The products (and the helpers they call) of PRODUCTS with the dispatch cut to `names`, and
    their X16 layouts if x16 (one set of dispatchers per process: a second load of a file reuses
    the compiled code)."""
    tag = "_".join(n.lower() for n in names) + ("_x16" if x16 and VNNI else "")
    last = names[-1]
    env = {"decode_row": _dispatch(_row_decoders(), "out, lut, m", f"decode_row of {tag}.", names, last)}
    env.update(_is_int(names, x16))
    env.update(_rows_of(names, x16))
    for helper in (acts, matmul_rows, gate_up, one_expert, one_expert_oai):  # (each after what it calls)
        env[helper.py_func.__name__] = _clone(helper, env, tag)
    return {name: _clone(globals()[name], env, tag) for name in PRODUCTS}


# The parts of a kernel set: what a file's forward calls (parts_for), each part's kernels.
WARM_PARTS = {"dense": ("matmul", "matmul_serial"), "fused": ("get_rows", "matmul3"), "experts": ("expert_ffn",),
              "experts_oai": ("expert_ffn_oai",), "small": ("rms_norm", "rope", "attention", "attention_sinks",
                                                            "route", "routed_rows"),
              "repack": ("repack_k_x16", "repack_k_x16_serial", "repack_q6_k_x16", "repack_q6_k_x16_serial",
                         "repack_plain_x16", "repack_plain_x16_serial", "repack_iq4_xs_x16",
                         "repack_iq4_xs_x16_serial", "repack_q23_k_x16", "repack_q23_k_x16_serial")}
# The serial repack kernel of each type's X16 layout: a file's "repack" part compiles its types'
# only (the backend runs them on its threads, backend.repack_on_threads); the parallel ones are
# the all-types set's (tests and benches call repack_x16).
REPACKS_OF = {"Q4_K": "repack_k_x16_serial", "Q5_K": "repack_k_x16_serial", "Q6_K": "repack_q6_k_x16_serial",
              "IQ4_XS": "repack_iq4_xs_x16_serial", "Q2_K": "repack_q23_k_x16_serial",
              "Q3_K": "repack_q23_k_x16_serial"}
REPACKS_OF.update({n: "repack_plain_x16_serial" for n in NIBBLE_X16 + ("Q8_0",)})
# The small ops a file without routed experts never calls (routing), and those only gpt-oss calls
# (attention with sinks; its experts are the only ones with biases: the "experts_oai" part).
ROUTING, SINKS = ("route", "routed_rows"), ("attention_sinks",)
# The products that call matmul_rows (the row loops of every type of the set): the first of them
# compiled compiles it, the others link it from numba's disk cache (`_fill` orders them so).
ROWS_USERS = frozenset({"matmul", "matmul_serial", "matmul3", "expert_ffn", "expert_ffn_oai"})
# What each kernel's cold compile costs, to start the longest first (`plan`): (CPU seconds, and
# more per quant type of the set), measured on the shared 2-core VM (bench/bench_compile.py,
# Gemma 3 270M's Q8_0, Q4_K, Q6_K, Q5_0 with their X16 layouts: 39 s of CPU in all); "rows" is
# matmul_rows, paid by the first of ROWS_USERS.
COSTS = {"rows": (0.5, 1.3), "matmul": (1.0, 1.3), "matmul_serial": (0.3, 0.4), "matmul3": (1.0, 1.2),
         "get_rows": (0.3, 0.4), "expert_ffn": (1.5, 1.5), "expert_ffn_oai": (1.5, 1.5), "rms_norm": (0.15, 0),
         "rope": (0.25, 0), "attention": (1.8, 0), "attention_sinks": (0.3, 0), "route": (0.45, 0),
         "routed_rows": (0.45, 0)}
REPACK_COST, SERIAL_REPACK_COST = 4.0, 1.0
PROGRESS_AFTER, PROGRESS_EVERY = 1.0, 0.5  # seconds: fill_cache's progress, first and between looks
ROWS_WAIT = 600.0  # seconds a worker waits at most for matmul_rows in the disk cache


class Kernels:
    """The kernels one backend calls: the products compiled for `names` (quant type names; None:
    every type, the all-types kernels of products.py) and the small ops, which every file shares. `parts`
    (of WARM_PARTS) are what `warm_up` loads and `fill_cache` compiles: a file without experts
    needs no expert kernel, nor routing (`names_of`)."""

    LUT, M, SERIAL_WORK = LUT, M, SERIAL_WORK

    def __init__(self, names=None, parts: tuple[str, ...] = tuple(WARM_PARTS), x16: bool | None = None):
        self.names = tuple(n for n in _ORDER if names is None or n in names) or ("F32",)
        self.everything = names is None
        self.parts = tuple(p for p in WARM_PARTS if p in parts)
        # the products take the X16 layouts' branches: by default where the file repacks (parts_for);
        # `fill_cache`'s workers, each given some of the kernels, are told
        self.x16 = "repack" in self.parts if x16 is None else x16
        self.SUPPORTED = frozenset(SUPPORTED) if self.everything else frozenset(
            QTYPES_BY_NAME[n].type_id for n in self.names) & SUPPORTED
        own = globals() if self.everything else _typed(self.names, self.x16)
        for name in PRODUCTS + WARM_PARTS["small"] + WARM_PARTS["repack"]:
            setattr(self, name, own[name] if name in own else globals()[name])
        self.matmul_rows = self.matmul.py_func.__globals__["matmul_rows"]  # (what ROWS_USERS call)
        self._warm = False

    def names_of(self, parts=None) -> tuple[str, ...]:
        """The names of the kernels of `parts` (default: this set's), each once: of the small ops
        the routing only with experts, attention with sinks only with gpt-oss's experts; of the
        repacks the serial one of each of this set's types' layouts (all of them for the
        all-types set)."""
        parts = self.parts if parts is None else parts
        out = []
        for p in parts:
            for n in WARM_PARTS[p]:
                if p == "small" and not self.everything and (
                        n in ROUTING and not {"experts", "experts_oai"} & set(self.parts)
                        or n in SINKS and "experts_oai" not in self.parts):
                    continue
                if p == "repack" and not self.everything and n not in (REPACKS_OF.get(t) for t in self.names):
                    continue
                out.append(n)
        return tuple(dict.fromkeys(out))

    def kernels(self, parts=None) -> list:
        """The dispatchers of `parts` (default: this set's), each once (`names_of`)."""
        return [getattr(self, n) for n in self.names_of(parts)]

    def cold_parts(self) -> tuple[str, ...]:
        """The parts some kernel of which numba's disk cache lacks (none once this set is loaded)."""
        if self._warm:
            return ()
        return tuple(p for p in self.parts if not all(_cached(k) for k in self.kernels((p,))))

    def cache_is_cold(self) -> bool:
        return bool(self.cold_parts())

    def fill_cache(self, progress=None) -> float:
        """Compile the cold parts into numba's disk cache (`_fill`), one process of a machine at a
        time (`_compile_lock`): a second that finds the set cold meanwhile (another `onebit` on a
        file of the same types, a worker of `pytest -n`) waits, then compiles what is still cold.
        `progress(done, total)`: called with the count of the cold parts' kernels in the cache
        as it grows, from a thread of its own, once the compile has taken PROGRESS_AFTER seconds.
        Returns the seconds spent compiling."""
        if not self.cold_parts():
            return 0.0
        with self._compile_lock(), self._watch(progress):
            return self._fill()

    @contextlib.contextmanager
    def _watch(self, progress):
        """While the block runs: progress(done, total) whenever the count of this set's cold
        kernels in numba's disk cache changes (looked at every PROGRESS_EVERY seconds), the first
        time after PROGRESS_AFTER seconds; once more at the end if it was called at all."""
        if progress is None:
            yield
            return
        import threading

        todo = self.kernels(self.cold_parts())
        stop, said = threading.Event(), [None]

        def watch():
            if stop.wait(PROGRESS_AFTER):
                return
            while True:
                done = sum(_cached(k) for k in todo)
                if done != said[0]:
                    said[0] = done
                    progress(done, len(todo))
                if stop.wait(PROGRESS_EVERY):
                    return

        t = threading.Thread(target=watch, name="onebit-compile-progress", daemon=True)
        t.start()
        try:
            yield
        finally:
            stop.set()
            t.join()
            if said[0] is not None and said[0] != len(todo):
                progress(sum(_cached(k) for k in todo), len(todo))

    def plan(self, cores: int) -> tuple[list[str], int, bool]:
        """The cold kernels in the order the processes of `_fill` take them (each the next that
        no other has taken: the slowest process sets the compile's time, and the costs are only
        estimates), how many processes, and whether matmul_rows is cold. Then matmul (else
        another of ROWS_USERS) is first: this process takes it and compiles matmul_rows with it;
        the other ROWS_USERS come last, and a worker starts one no sooner than matmul_rows is in
        the disk cache (a worker that compiled it too would spend 5-6 s of CPU on it again for
        Gemma 3 270M's types). Otherwise the longest first (`_cost`)."""
        todo = [n for n in self.names_of(self.cold_parts()) if not _cached(getattr(self, n))]
        rows_cold = any(n in ROWS_USERS for n in todo) and not _cached(self.matmul_rows)
        first = [min((n for n in todo if n in ROWS_USERS), key=lambda n: n != "matmul")] if rows_cold else []
        rest = sorted((n for n in todo if n not in first), key=self._cost, reverse=True)
        order = first + [n for n in rest if n not in ROWS_USERS] + [n for n in rest if n in ROWS_USERS]
        return order, min(cores, len(order)), rows_cold

    def _fill(self) -> float:
        """Compile the cold kernels side by side (`plan`): this process and worker processes,
        each taking the next kernel of the plan that no other has taken (a file of its name in a
        folder of claims)."""
        import shutil
        import subprocess
        import sys
        import tempfile
        import time

        t0 = time.perf_counter()
        order, processes, rows_cold = self.plan(os.cpu_count() or 1)
        if not order:
            return 0.0
        root = str(Path(os.path.abspath(__file__)).parents[3])  # (this tree's onebit, first on the worker's path)
        code = (f"import sys; sys.path.insert(0, {root!r}); from onebit.backends.cpu.kernel_sets import Kernels; "
                "names = sys.argv[1]; "
                "Kernels(None if names == '*' else names.split(','), (), sys.argv[2] == 'x16')"
                "._compile(sys.argv[5:], int(sys.argv[3]), sys.argv[4])")
        names = "*" if self.everything else ",".join(self.names)
        wait = str(os.getpid() if rows_cold else 0)
        claims = tempfile.mkdtemp(prefix="onebit-compile-")
        procs = []
        try:
            _claim(claims, order[0])  # (this process's: with matmul_rows cold, the one that compiles it)
            for _ in range(processes - 1):
                try:
                    procs.append(subprocess.Popen([sys.executable, "-c", code, names, "x16" if self.x16 else "rows",
                                                   wait, claims, *order[1:]],
                                                  stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                                  stderr=subprocess.DEVNULL))
                except OSError:  # no interpreter to start: this process compiles the rest
                    break
            self._warm_one(order[0])
            self._compile(order[1:], 0, claims)
            for p in procs:
                p.wait()  # a kernel that failed is compiled again by warm_up, which reports it
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            shutil.rmtree(claims, ignore_errors=True)
        return time.perf_counter() - t0

    def _compile(self, names, wait: int = 0, claims: str | None = None) -> None:
        """Call (compile, or load) the kernels `names` in order: with `claims` (a folder), only
        those this process claims first (`_claim`); with `wait` (the pid of the process that
        compiles matmul_rows), those of ROWS_USERS only once matmul_rows is in the disk cache, or
        that process has gone, or after ROWS_WAIT seconds."""
        import time

        t0 = time.monotonic()
        for n in names:
            if claims is not None and not _claim(claims, n):
                continue
            if wait and n in ROWS_USERS:
                while (not _cached(self.matmul_rows) and os.getppid() == wait
                       and time.monotonic() - t0 < ROWS_WAIT):
                    time.sleep(0.05)
                wait = 0
            self._warm_one(n)

    @contextlib.contextmanager
    def _compile_lock(self):
        """Held while this process fills the disk cache with this set: an exclusive lock (flock)
        on a file of the set's own in numba's cache directory, so that two processes never compile
        the same set side by side (each fill already takes every core). Another set's compile does
        not wait for it (a `onebit` process beside a long all-types fill). Released when the file
        closes, also if the process dies. No lock where there is no flock or no writable directory."""
        tag = "all" if self.everything else "_".join(n.lower() for n in self.names) + ("_x16" if self.x16 else "")
        try:
            import fcntl

            where = self.kernels()[0]._cache.cache_path
            os.makedirs(where, exist_ok=True)
            f = open(os.path.join(where, f"onebit-compile-{tag}.lock"), "a")
        except (ImportError, AttributeError, OSError):
            yield
            return
        with f:
            fcntl.flock(f, fcntl.LOCK_EX)
            yield

    def _cost(self, name: str) -> float:
        """COSTS' estimate of kernel `name`'s cold compile (CPU seconds)."""
        if name.startswith("repack_"):
            return SERIAL_REPACK_COST if name.endswith("_serial") else REPACK_COST
        fixed, per_type = COSTS[name]
        return fixed + per_type * len(self.names)

    def warm_up(self) -> tuple[float, int]:
        """Load every kernel of this set now (compiling it the first time on this machine), so
        that no compile lands in a forward pass. Returns (seconds, kernels compiled rather than
        loaded)."""
        import time

        if self._warm:
            return 0.0, 0
        t0 = time.perf_counter()
        kernels = self.kernels()
        before = sum(len(k.stats.cache_misses) for k in kernels)
        self._compile(self.names_of())
        self._warm = True
        return time.perf_counter() - t0, sum(len(k.stats.cache_misses) for k in kernels) - before

    def _warm_one(self, name: str) -> None:
        """Call kernel `name` once, on tiny arguments of a forward's signatures."""
        if name in WARM_PARTS["small"]:
            _warm_small(name)
            return
        if name.startswith("repack_"):
            _warm_repack(name)
            return
        qt = QTYPES_BY_NAME[self.names[0]]
        n = max(W, qt.block_size)  # one block (32 weights of a float type)
        x = np.zeros((1, n), np.float32)
        w = _ro(np.zeros((2, n // qt.block_size * qt.type_size), np.uint8))  # [2 rows, row bytes]
        h = _ro(np.zeros((1, n, w.shape[1]), np.uint8))  # one expert, hidden = dim = n
        ids, offs, one = np.zeros(1, np.int64), np.array([0, 1], np.int64), np.ones(1, np.float32)
        t = qt.type_id
        if name in ("matmul", "matmul_serial"):
            getattr(self, name)(np.empty((1, 2), np.float32), x, w, t)
        elif name == "matmul3":
            self.matmul3(np.empty((1, 6), np.float32), x, w, w, w, t, t, t)
        elif name == "get_rows":
            self.get_rows(np.empty((1, n), np.float32), w, ids, t, LUT, M)
        elif name == "expert_ffn":
            self.expert_ffn(np.zeros((1, n), np.float32), np.empty((1, n), np.float32), x, h, h, h, ids, ids, offs,
                            ids, one, True, t, t, t)
        elif name == "expert_ffn_oai":
            b = _ro(np.zeros((1, n), np.float32))
            self.expert_ffn_oai(np.zeros((1, n), np.float32), np.empty((1, n), np.float32), x, h, h, h, ids, ids,
                                ids, offs, ids, one, True, t, t, t, b, b, b, 1.702, 7.0)
        else:
            raise ValueError(f"no kernel {name!r} in a kernel set")


def parts_for(gguf, repack: bool) -> tuple[str, ...]:
    """The WARM_PARTS a forward of this file calls (gpt-oss's experts, with their biases, only
    the clamped-SwiGLU kernel); `repack`: whether the backend holds some of its tensors in X16
    layouts (its memory policy says, backend.X16Policy)."""
    names = gguf.tensors.keys()
    experts = any("_exps.weight" in n for n in names)
    oai = any(n.endswith("ffn_gate_exps.bias") for n in names)
    return (("dense", "fused", "small") + (("experts_oai",) if oai else ("experts",) if experts else ())
            + (("repack",) if repack else ()))


def kernels_for(gguf, repack: bool) -> Kernels:
    """The kernels for this file: those of its own quant types when numba's disk cache holds
    them or when it holds no all-types set either (a fresh machine compiles only what the file
    needs); else the all-types kernels (a machine that compiled them, such as the test suite's)."""
    names = {t.type_name for t in gguf.tensors.values() if len(t.shape) > 1 and t.qtype in SUPPORTED}
    parts = parts_for(gguf, repack)
    own = Kernels(names, parts)
    if own.cache_is_cold():
        every = Kernels(None, parts)
        if not every.cache_is_cold():
            return every
    return own


def _ro(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


def _warm_small(name: str) -> None:
    """Call small op `name` once on tiny arguments of a forward's signatures."""
    xr = _ro(np.zeros((1, 32), np.float32))  # the small ops take read-only inputs (cpu._ro32)
    q = _ro(np.zeros((1, 2, 4), np.float32))
    pos, inv = _ro(np.zeros(1, np.int64)), _ro(np.ones(2))
    if name == "rms_norm":
        rms_norm(np.empty_like(xr), xr, xr[0], 1e-6)
    elif name == "rope":
        rope(np.empty_like(q), q, pos, inv, 1.0, True)
    elif name == "attention":
        attention(np.empty_like(q), q, q, q, pos, 0, 0.5)
    elif name == "attention_sinks":
        attention_sinks(np.empty_like(q), q, q, q, pos, 0, 0.5, xr[0, :2])
    elif name == "route":
        route(xr, 2, True)
    else:
        routed_rows(*route(xr, 2, True), 32)  # (route's outputs: the types the backend passes)


def _warm_repack(name: str) -> None:
    """Call repack kernel `name` on one group of 16 rows."""
    args = {"repack_k_x16": (144, X16_BLOCK // X16, 144, X16_BLOCK), "repack_q6_k_x16": (210, 210),
            "repack_plain_x16": (17, 17, 17, 16),
            "repack_iq4_xs_x16": (136, 136), "repack_q23_k_x16": (84, 84, 84)}
    row, out, *more = args[name.removesuffix("_serial")]
    globals()[name](_ro(np.zeros((X16, row), np.uint8)), np.empty((X16, out), np.uint8), *more)


def _claim(folder: str, name: str) -> bool:
    """Whether this process is the first to claim `name` in `folder` (creates a file of that name)."""
    try:
        os.close(os.open(os.path.join(folder, name), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def _cached(kernel) -> bool:
    """Whether numba's disk cache holds compiled code of `kernel` for this source (an index made
    before this file last changed, e.g. by an upgrade, counts as empty: numba compiles again)."""
    try:
        return bool(kernel._cache._cache_file._load_index())
    except Exception:  # a numba without this layout: say yes, and compile in process if need be
        return True


EVERY = Kernels()  # the all-types kernels (tests, benches and the test suite's cache fill)


def cache_is_cold() -> bool:
    """Whether some all-types kernel has never been compiled on this machine."""
    return EVERY.cache_is_cold()


def fill_cache() -> float:
    """Compile every all-types kernel into numba's disk cache (Kernels.fill_cache)."""
    return EVERY.fill_cache()


def warm_up() -> tuple[float, int]:
    """Load every all-types kernel now (Kernels.warm_up)."""
    return EVERY.warm_up()
