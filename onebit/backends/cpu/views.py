"""Array views that hold no reference, for use inside the kernels (`row_of`, `rows_after`, `borrowed`, `lent`)
and `keep_alive`, which keeps an array a kernel made alive past the loop that views it."""

from __future__ import annotations

from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic
from numba.np.arrayobj import populate_array



def _view(context, builder, aty, arr, rty, at, ndrop):
    """A view of array `arr` (type aty) as type rty starting `at` bytes in, without its first
    `ndrop` dimensions, that holds no reference (meminfo null)."""
    src = context.make_array(aty)(context, builder, arr)
    out = context.make_array(rty)(context, builder)
    shape, strides = cgutils.unpack_tuple(builder, src.shape), cgutils.unpack_tuple(builder, src.strides)
    data = builder.gep(builder.bitcast(src.data, cgutils.voidptr_t), [at])
    populate_array(out, data=builder.bitcast(data, src.data.type), shape=shape[ndrop:], strides=strides[ndrop:],
                   itemsize=src.itemsize, meminfo=None)
    return out._getvalue()


# Views that hold no reference. numba counts references to an array with atomic increments
# wherever a kernel slices it or hands it to an inlined helper; in a parallel region both
# threads doing so on one array fight over its count's cache line (a decode token's expert FFN
# on the 0.86B file: 430 us a call with counted views, 260 us without). Only for views that
# live inside a kernel while its caller holds the array.

@intrinsic
def row_of(typingctx, a, i):
    """a[i] for a C-ordered array of 2 or more dimensions, as a view that holds no reference."""
    if not (isinstance(a, types.Array) and a.ndim >= 2 and a.layout == "C" and isinstance(i, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        src = context.make_array(sig.args[0])(context, builder, args[0])
        at = builder.mul(context.cast(builder, args[1], sig.args[1], types.intp),
                         builder.extract_value(src.strides, 0))
        return _view(context, builder, sig.args[0], args[0], sig.return_type, at, 1)

    return types.Array(a.dtype, a.ndim - 1, "C", readonly=not a.mutable)(a, i), codegen


@intrinsic
def rows_after(typingctx, a, n, rb):
    """The bytes of a 2-dimensional uint8 C array a from row n's start on, as rows of rb bytes
    (a.shape[0] - n of them: an X16 layout's last rows, which it holds as rows, rows.py), a C
    array that holds no reference."""
    if not (isinstance(a, types.Array) and a.ndim == 2 and a.layout == "C" and a.dtype == types.uint8
            and isinstance(n, types.Integer) and isinstance(rb, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        src = context.make_array(sig.args[0])(context, builder, args[0])
        out = context.make_array(sig.return_type)(context, builder)
        n, rb = (context.cast(builder, v, t, types.intp) for v, t in zip(args[1:], sig.args[1:]))
        at = builder.mul(n, builder.extract_value(src.strides, 0))
        data = builder.gep(builder.bitcast(src.data, cgutils.voidptr_t), [at])
        populate_array(out, data=builder.bitcast(data, src.data.type),
                       shape=[builder.sub(builder.extract_value(src.shape, 0), n), rb],
                       strides=[rb, ir.Constant(rb.type, 1)], itemsize=src.itemsize, meminfo=None)
        return out._getvalue()

    return types.Array(types.uint8, 2, "C", readonly=not a.mutable)(a, n, rb), codegen


@intrinsic
def borrowed(typingctx, a):
    """The C-ordered array a as a view that holds no reference."""
    if not (isinstance(a, types.Array) and a.layout == "C"):
        return None

    def codegen(context, builder, sig, args):
        return _view(context, builder, sig.args[0], args[0], sig.return_type, ir.Constant(ir.IntType(64), 0), 0)

    return a(a), codegen


@intrinsic
def keep_alive(typingctx, a):
    """Nothing, at run time: a use of `a` after a kernel's loop, so that numba frees `a` (an
    array the kernel made) only after the loop's reference-free views of it are done with."""
    return types.none(a), lambda context, builder, sig, args: context.get_dummy_value()


@njit(inline="always")
def lent(a):
    """The three arrays of acts(..) as views that hold no reference (see `keep_alive`)."""
    return borrowed(a[0]), borrowed(a[1]), borrowed(a[2])
