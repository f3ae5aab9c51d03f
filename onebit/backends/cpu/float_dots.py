"""Float32 dot products as numba intrinsics of LLVM vector IR: DOT1 / DOT2 / DOT4 / DOT8[type]
dot one raw weight row with 1, 2, 4 or 8 float32 activation rows, decoding each block in
registers (ir_blocks._groups) into one 32-wide accumulator per activation row. Every type of
IR_TYPES has them; the row loops (rows.py) call them for the types without integer dots."""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from ...formats.quants import QTYPES_BY_NAME
from .base import MORE_TYPES
from .ir_blocks import FAST, FLT, HALF, I16, I32, I64, W, _const, _groups, _hsum, _load, _vec


def _groups1(b, name, p):
    """One weight of a float type at byte pointer p, as float."""
    if name == "F32":
        return _load(b, p, 0, FLT)
    if name == "F16":
        return b.fpext(_load(b, p, 0, HALF), FLT)
    return b.bitcast(b.shl(b.zext(_load(b, p, 0, I16), I32), _const(I32, 16)), FLT)


IR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "MXFP4", "Q4_K", "Q5_K", "Q6_K") + MORE_TYPES


def _intrinsic_of(typer, lead: str, rows: list[str], name: str):
    """intrinsic `name`(typingctx, <lead>, <rows>) -> typer(typingctx, ...): numba's intrinsics
    take a fixed list of arguments, so each row count gets a function of its own arity."""
    args = ", ".join([lead, *rows])
    ns = {"typer": typer}
    exec(f"def {name}(typingctx, {args}):\n    return typer(typingctx, {args})", ns)
    return intrinsic(ns[name])


def _make_dot(name: str, rows: int):
    qt = QTYPES_BY_NAME[name]
    elem = qt.type_size if qt.block_size == 1 else 0  # float types: bytes per weight; 32 per group
    bs, ts = (W, W * elem) if elem else (qt.block_size, qt.type_size)

    def codegen(context, builder, sig, args):
        b = builder
        w = context.make_array(sig.args[0])(context, b, args[0])
        xs = [context.make_array(t)(context, b, a).data for t, a in zip(sig.args[1:], args[1:])]
        nbytes = b.extract_value(w.shape, 0)
        nb = b.udiv(nbytes, _const(I64, ts))
        accs = [cgutils.alloca_once_value(b, ir.Constant(_vec(FLT), [0.0] * W)) for _ in xs]
        with cgutils.for_range(b, nb) as loop:
            i = loop.index
            blk = b.gep(w.data, [b.mul(i, _const(I64, ts))])
            first = b.mul(i, _const(I64, bs))
            for off, wv in _groups(b, name, blk):
                k = b.add(first, _const(I64, off))
                for x, acc in zip(xs, accs):
                    xv = _load(b, x, k, _vec(FLT), align=4)
                    b.store(b.fadd(b.load(acc), b.fmul(wv, xv, flags=FAST), flags=FAST), acc)
        sums = [_hsum(b, b.load(acc)) for acc in accs]
        if elem:  # a float row's last len % 32 weights, one at a time
            tails = [cgutils.alloca_once_value(b, ir.Constant(FLT, 0.0)) for _ in xs]
            first = b.mul(nb, _const(I64, W))
            with cgutils.for_range(b, b.sub(b.udiv(nbytes, _const(I64, elem)), first)) as loop:
                k = b.add(first, loop.index)
                wv = _groups1(b, name, b.gep(w.data, [b.mul(k, _const(I64, elem))]))
                for x, t in zip(xs, tails):
                    xv = b.load(b.gep(x, [k]), align=4)
                    b.store(b.fadd(b.load(t), b.fmul(wv, xv, flags=FAST), flags=FAST), t)
            sums = [b.fadd(s, b.load(t)) for s, t in zip(sums, tails)]
        if rows == 1:
            return sums[0]
        return context.make_tuple(b, sig.return_type, sums)

    def typer(typingctx, w, *xs):
        ok = (isinstance(w, types.Array) and w.ndim == 1 and w.dtype == types.uint8 and w.layout == "C"
              and all(isinstance(x, types.Array) and x.ndim == 1 and x.dtype == types.float32 and x.layout == "C"
                      for x in xs))
        if not ok:
            return None
        ret = types.float32 if rows == 1 else types.UniTuple(types.float32, rows)
        return ret(w, *xs), codegen

    return _intrinsic_of(typer, "w", [f"x{i}" for i in range(rows)], f"dot{rows}_{name.lower()}")


DOT1 = {n: _make_dot(n, 1) for n in IR_TYPES}
DOT2 = {n: _make_dot(n, 2) for n in IR_TYPES}
DOT4 = {n: _make_dot(n, 4) for n in IR_TYPES}
DOT8 = {n: _make_dot(n, 8) for n in IR_TYPES}
