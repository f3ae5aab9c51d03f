"""The row loops: for each weight type (and X16 layout) a loop that dots weight rows with up to
8 activation rows at a time through that type's dots (float_dots, int_dots, x16), and the
generated `if qt == ...` dispatch over types (`_dispatch`, `_rows_of`, `_is_int`) that the
products call; kernel_sets.py cuts the same dispatch to one file's types."""

from __future__ import annotations

from numba import njit

from ...formats.quants import QTYPES_BY_NAME, X16_BLOCK, X16_Q5_BLOCK
from .base import MORE_TYPES
from .views import row_of, rows_after
from .float_dots import DOT1, DOT2, DOT4, DOT8, IR_TYPES
from .int_dots import IDOT1, IDOT2, IDOT4, IDOT8, INT_TYPES, VNNI
from .x16 import (X16, X16_TYPES, dot16_iq4_nl_x16, dot16_iq4_xs_x16, dot16_mxfp4_x16, dot16_q2_k_x16, dot16_q3_k_x16,
                  dot16_q4_0_x16, dot16_q4_1_x16, dot16_q4_k_x16, dot16_q5_0_x16, dot16_q5_1_x16, dot16_q5_k_x16,
                  dot16_q6_k_x16, dot16_q8_0_x16)
from .repack import x16_type


def _tid(name: str) -> int:
    """The type id of a quant type's name, or of onebit's own repacked layout (Q4_K_X16)."""
    if name.endswith("_X16"):
        return x16_type(QTYPES_BY_NAME[name[:-4]].type_id)
    return QTYPES_BY_NAME[name].type_id


def _dispatch(table, args: str, doc: str, names=IR_TYPES, last="F32", extra=""):
    """An inlined njit function `f(qt, w, <args>)` that calls table[name] for qt's type: one `if`
    per type (qt is a run-time value, so every type's branch is in each caller: the intrinsic's
    code itself, or a call of an outlined function, see `_outlined`)."""
    lines = [f"def f(qt, w, {args}):", f'    """{doc}"""']
    for n in names:
        if n != last:
            lines += [f"    if qt == {_tid(n)}:  # {n}", f"        return T_{n}(w, {args})"]
    lines.append(f"    return T_{last}(w, {args})")
    ns = {f"T_{n}": table[n] for n in names}
    exec("\n".join(lines), ns)
    return njit(inline="always")(ns["f"])


def _outlined(table, args: str):
    """MORE_TYPES' dots as functions of their own (not inlined): each is compiled once per
    argument type and linked into its callers, rather than copied into every call site. With
    26 types inlined at each of the kernels' dot calls, the first compile took 408 s (wall, on
    the shared 2 cores; 71 s before the new types); outlined, 124 s of CPU time against 70 s.
    A call per weight row costs nothing measurable."""
    out = dict(table)
    for n in MORE_TYPES:
        ns = {"dot": table[n]}
        exec(f"def {n.lower()}(w, {args}):\n    return dot(w, {args})", ns)
        out[n] = njit(ns[n.lower()])
    return out


# The order of the tests: the common types first.
_ORDER = ("Q8_0", "Q4_K", "Q6_K", "Q5_K", "Q4_0", "MXFP4", "F16", "BF16") + MORE_TYPES + ("F32",)
_A1, _A2, _A4, _A8 = "x", "x0, x1", "x0, x1, x2, x3", "x0, x1, x2, x3, x4, x5, x6, x7"
_DOTS = {1: _outlined(DOT1, _A1), 2: _outlined(DOT2, _A2), 4: _outlined(DOT4, _A4), 8: _outlined(DOT8, _A8)}
_IDOTS = {1: IDOT1, 2: IDOT2, 4: IDOT4, 8: IDOT8}
_INT_ORDER = tuple(n for n in _ORDER if n in INT_TYPES)


def _with_x16(names, x16: bool = True) -> tuple:
    """names, and (if x16) the X16 layouts first of those among them that have one, where the
    machine has VNNI."""
    names = tuple(names)
    return tuple(f"{n}_X16" for n in X16_TYPES if x16 and VNNI and n in names) + names


def _is_int(names, x16: bool = True) -> dict:
    """{"is_int": is_int(qt)}: whether qt is one of the INT_TYPES among `names` or (if x16) an X16
    layout of one of them, whose products take x's int16 blocks (`acts`)."""
    test = " or ".join(f"qt == {_tid(n)}" for n in _with_x16(names, x16) if n in _INT_ORDER or n.endswith("_X16"))
    test = test or "False"
    ns: dict = {}
    exec(f"def is_int(qt):\n    return {test}", ns)
    return {"is_int": njit(inline="always")(ns["is_int"])}


TILE = 32  # weight rows a prompt's row groups meet before the next (about 20-70 KiB of weights)


def _row_loop(name: str):
    """rows(w, out, x, aq, ad, am, n0, n1, col) for weights of type `name`: out[:, col + n] = x @
    row n of w for n in [n0, n1), a weight row against up to 8 activation rows at once (the
    int16 products on (aq, ad, am) = acts(x) for INT_TYPES, else the float32 ones on x). One
    loop per type, the type's test outside it: with every type's code inside one loop, values
    LLVM hoists out of it for all the types at once spilled to the stack (the shipped types'
    decode products ran 10-40% slower, bench/results/issue34-kernels.md)."""
    def call(k, rs):  # weight row n . activation rows rs
        if name in INT_TYPES:
            return f"I{k}(row_of(w, n), aq, ad, am, {', '.join(rs)})"
        return f"F{k}(row_of(w, n), {', '.join(f'row_of(x, {r})' for r in rs)})"

    r8 = [f"r + {i}" if i else "r" for i in range(8)]
    src = f"""def rows(w, out, x, aq, ad, am, n0, n1, col):
    R = x.shape[0]
    if R == 1:  # decode
        for n in range(n0, n1):
            out[0, col + n] = {call(1, ["0"])}
        return
    for t0 in range(n0, n1, TILE):  # (a tile of weight rows stays in cache while each group of
        # x's rows meets it, rather than every row of x streaming through the cache for each weight row)
        t1 = min(n1, t0 + TILE)
        r = 0
        while r + 8 <= R:
            for n in range(t0, t1):
                t = {call(8, r8)}
                for i in range(8):
                    out[r + i, col + n] = t[i]
            r += 8
        while r + 4 <= R:
            for n in range(t0, t1):
                s0, s1, s2, s3 = {call(4, r8[:4])}
                out[r, col + n], out[r + 1, col + n], out[r + 2, col + n], out[r + 3, col + n] = s0, s1, s2, s3
            r += 4
        if r + 2 <= R:
            for n in range(t0, t1):
                s0, s1 = {call(2, r8[:2])}
                out[r, col + n], out[r + 1, col + n] = s0, s1
            r += 2
        while r < R:
            for n in range(t0, t1):
                out[r, col + n] = {call(1, ["r"])}
            r += 1
"""
    ns = {"row_of": row_of, "TILE": TILE}
    ns.update({f"F{k}": t[name] for k, t in _DOTS.items()})
    if name in INT_TYPES:
        ns.update({f"I{k}": t[name] for k, t in _IDOTS.items()})
    exec(src, ns)
    return njit(inline="always")(ns["rows"])


# The bytes of an X16 layout's row to those of the type's row, where they differ (decoded scales).
X16_GROWTH = {"Q4_K": (X16_BLOCK // X16, 144), "Q5_K": (X16_Q5_BLOCK // X16, 176)}


def _x16_rows(dot, name: str):
    """rows(w, out, x, aq, ad, am, n0, n1, col), the row loop of an X16 layout whose dot is `dot`
    (n0 a multiple of 16): 16 weight rows a call, each activation row in turn against them while
    they are in cache. A matrix of N rows holds its last N % 16 as the type's rows, one after
    another from row N - N % 16's start (repack.py), dotted one at a time by the type's row dot.
    Called, not inlined: inlined beside the other types' loops it slowed them (Gemma 3 270M's
    Q5_0 gate and up products 88 -> 93 us)."""
    base = name.removesuffix("_X16")
    wide, narrow = X16_GROWTH.get(base, (1, 1))
    if base in INT_TYPES:
        one = "I1(row_of(t, n), aq, ad, am, r)"
    else:
        one = "F1(row_of(t, n), row_of(x, r))"
    ns = {"dot": dot, "X16": X16, "row_of": row_of, "rows_after": rows_after, "I1": IDOT1.get(base),
          "F1": _DOTS[1][base]}
    exec("def rows(w, out, x, aq, ad, am, n0, n1, col):\n"
         "    full = n0 + (n1 - n0) // X16 * X16\n"
         "    for n in range(n0, full, X16):\n"
         "        for r in range(x.shape[0]):\n"
         "            dot(w, n, aq, ad, am, r, out, col + n)\n"
         "    if full < n1:  # the last rows, as rows\n"
         f"        t = rows_after(w, full, w.shape[1] // {wide} * {narrow})\n"
         "        for n in range(n1 - full):\n"
         "            for r in range(x.shape[0]):\n"
         f"                out[r, col + full + n] = {one}\n", ns)
    ns["rows"].__qualname__ = ns["rows"].__name__ = f"rows_{name.lower()}"
    return njit(nogil=True)(ns["rows"])


ROWS = {n: _row_loop(n) for n in IR_TYPES}
ROWS.update({f"{n}_X16": _x16_rows(dot, f"{n}_X16") for n, dot in (
    ("Q4_K", dot16_q4_k_x16), ("Q5_K", dot16_q5_k_x16), ("Q6_K", dot16_q6_k_x16), ("MXFP4", dot16_mxfp4_x16), ("Q4_0", dot16_q4_0_x16),
    ("IQ4_XS", dot16_iq4_xs_x16), ("Q8_0", dot16_q8_0_x16), ("Q5_0", dot16_q5_0_x16), ("Q4_1", dot16_q4_1_x16),
    ("Q5_1", dot16_q5_1_x16), ("IQ4_NL", dot16_iq4_nl_x16), ("Q2_K", dot16_q2_k_x16), ("Q3_K", dot16_q3_k_x16))})
_RA = "out, x, aq, ad, am, n0, n1, col"


def _rows_of(names, x16: bool = True) -> dict:
    """{"rows_of": rows_of(qt, w, out, x, aq, ad, am, n0, n1, col)}: ROWS[qt's type] for the
    types `names` (and their X16 layouts if x16)."""
    return {"rows_of": _dispatch(ROWS, _RA, "The row loop of qt's type (ROWS).", _with_x16(names, x16), names[-1])}
