"""The instruction sets the cpu kernels are compiled for: the one place that says what the
target is. numba compiles for its config's CPU_NAME and CPU_FEATURES (which numba itself takes
from $NUMBA_CPU_NAME and $NUMBA_CPU_FEATURES), else for the host; `use` sets them for a named
target before the first kernel module is imported (the command line's --cpu-target), and every
choice of code path (int_dots.VNNI: the AVX-512 VNNI products and the X16 layouts) asks
`features`, never the host. So a machine with AVX-512 builds, tests and measures the AVX2
kernels a laptop runs. numba's disk cache keys each kernel by the target's name and features:
the targets' compiled kernels sit side by side."""

from __future__ import annotations

import sys

from ...errors import UsageError

# An AVX2 and FMA CPU without AVX-512 (Intel client CPUs from Haswell, AMD before Zen 4): LLVM's
# haswell model, with the features named (numba would otherwise take the host's, AVX-512 included).
AVX2_FEATURES = ("+64bit,+avx,+avx2,+bmi,+bmi2,+cmov,+cx16,+f16c,+fma,+fxsr,+lzcnt,+mmx,+movbe,+popcnt,+sahf,"
                 "+sse,+sse2,+sse3,+sse4.1,+sse4.2,+ssse3,+xsave")
TARGETS = {"native": (None, None), "avx2": ("haswell", AVX2_FEATURES)}
# The features `describe` names (the vector instruction sets that change the kernels' code).
SHOWN = ("sse4.2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512vnni", "avxvnni")
KERNEL_MODULES = "onebit.backends.cpu.base"  # imported first by every kernel module


def use(name: str) -> None:
    """Compile the kernels for target `name` (of TARGETS) from now on: numba's CPU_NAME and
    CPU_FEATURES, before the first kernel is made (numba fixes its code generator then). A
    UsageError for an unknown name, or where kernels were already made for another target."""
    if name not in TARGETS:
        raise UsageError(f"--cpu-target {name!r}: the targets are {', '.join(TARGETS)}")
    from numba.core import config

    cpu, feats = TARGETS[name]
    if KERNEL_MODULES in sys.modules and (config.CPU_NAME, config.CPU_FEATURES) != (cpu, feats):
        raise UsageError(f"--cpu-target {name}: the cpu kernels of this process were already made for "
                         f"{describe()['cpu']}")
    config.CPU_NAME, config.CPU_FEATURES = cpu, feats


def features() -> frozenset[str]:
    """The CPU features the kernels are compiled for: numba's CPU_FEATURES, else the host's."""
    from numba.core import config

    feats = config.CPU_FEATURES
    if feats is None:
        import llvmlite.binding as llvm

        feats = llvm.get_host_cpu_features().flatten()
    return frozenset(f[1:] for f in feats.split(",") if f.startswith("+"))


def has_vnni() -> bool:
    """Whether the kernels may use AVX-512 VNNI's vpdpbusd on 512-bit vectors (and AVX-512BW's
    byte shuffles): the X16 layouts and the byte-plane products."""
    return {"avx512vnni", "avx512bw"} <= features()


def describe() -> dict:
    """What `onebit info` and `onebit bench --json` report as cpu_target: the CPU model the
    kernels are compiled for ("host" where none is named, with the host's model), and the vector
    instruction sets of SHOWN among its features."""
    from numba.core import config
    import llvmlite.binding as llvm

    on = features()
    cpu = config.CPU_NAME or f"host ({llvm.get_host_cpu_name()})"
    return {"cpu": cpu, "isa": [f for f in SHOWN if f in on]}
