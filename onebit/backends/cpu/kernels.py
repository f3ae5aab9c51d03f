"""What the cpu backend calls of its kernels, in one namespace (backend.py imports it when a
backend opens, so that importing onebit does not load numba)."""

from .base import SUPPORTED
from .int_dots import VNNI
from .kernel_sets import kernels_for
from .repack import repack_x16, repack_x16_into, repack_x16_serial, x16_type
from .small_ops import routed_rows
from .target import describe as describe_target

__all__ = ["SUPPORTED", "VNNI", "describe_target", "kernels_for", "repack_x16", "repack_x16_into", "repack_x16_serial",
           "routed_rows", "x16_type"]
