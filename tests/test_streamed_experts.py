"""What a backend asks of streamed experts is declared (backends/experts.py StreamedExperts): the
pool implements every member with the declared signature, and the Vulkan backend touches the
pool through nothing else (read from the source, so a duck-typed use cannot hide)."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import numpy as np

from conftest import fixture_path
from onebit.backends.experts import ExpertSource, StreamCounts, StreamedExperts
from onebit.formats.gguf_file import GGUFFile
from onebit.memory.plan import size_classes
from onebit.memory.pool import ExpertPool

VULKAN = Path(__file__).resolve().parent.parent / "onebit" / "backends" / "vulkan"
# The names the Vulkan package gives the expert source, and what each may be.
HOLDERS = {"pool": StreamedExperts, "source": ExpertSource}


def members(proto) -> dict[str, object]:
    """A protocol's declared members, its bases' too: name -> the function, property or annotation."""
    out = {}
    for cls in reversed(proto.__mro__):
        if not getattr(cls, "_is_protocol", False) or cls.__module__ == "typing":
            continue
        out.update({name: ann for name, ann in getattr(cls, "__annotations__", {}).items()})
        out.update({name: v for name, v in vars(cls).items()
                    if not name.startswith("_") and (callable(v) or isinstance(v, property))})
    return out


def mismatches(cls, proto, instance=None) -> list[str]:
    """Where `cls` (and `instance`, for declared attributes) differs from `proto`: a member that
    is missing or inherited from the protocol itself, or a method whose parameters differ (names,
    kinds, defaults; annotations are the protocol's documentation)."""
    def params(f):
        return [(p.name, p.kind, p.default) for p in inspect.signature(f).parameters.values()]

    out = []
    for name, want in members(proto).items():
        if callable(want):
            got = inspect.getattr_static(cls, name, None)
            if got is None or got is want or not callable(got):
                out.append(f"{name}: not implemented")
            elif params(got) != params(want):
                out.append(f"{name}: {inspect.signature(got)} is not {inspect.signature(want)}")
        elif not hasattr(cls, name) and (instance is None or not hasattr(instance, name)):
            out.append(f"{name}: no such attribute")
    return out


def pool_uses(source: str) -> list[tuple[str, str, int, bool]]:
    """(holder name, member, line, written) for every attribute read or written on a name in
    HOLDERS, or on an attribute so named (`pool.x`, `self.pool.x`, `self.be.pool.x`)."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Attribute):
            continue
        v = node.value
        holder = v.id if isinstance(v, ast.Name) else v.attr if isinstance(v, ast.Attribute) else None
        if holder in HOLDERS:
            out.append((holder, node.attr, node.lineno, isinstance(node.ctx, (ast.Store, ast.Del))))
    return sorted(out, key=lambda use: use[2])


def outside_protocol(source: str) -> list[str]:
    return [f"line {line}: {holder}.{attr}" + (" written" if written else "")
            for holder, attr, line, written in pool_uses(source)
            if written or attr not in members(HOLDERS[holder])]


def test_the_pool_declares_and_implements_the_protocol():
    assert StreamedExperts in ExpertPool.__mro__  # (declared: issubclass needs a runtime_checkable protocol)
    g = GGUFFile(fixture_path("qwen3moe-f32.gguf"))
    pool = ExpertPool(g, size_classes(g), [3])
    try:
        assert mismatches(ExpertPool, StreamedExperts, pool) == []
        assert mismatches(type(pool.stats), StreamCounts, pool.stats) == []
        # the declared attributes hold what they say
        assert pool.class_of_layer.keys() == pool.streamed_layers
        for layer, ci in pool.class_of_layer.items():
            bufs = pool.buffers[ci]
            assert all(isinstance(a, np.ndarray) and a.flags.writeable for a in bufs.values())
            (slot,) = pool.acquire(layer, [1])
            try:
                assert np.shares_memory(pool.slot_view(layer, slot, "ffn_up_exps"), bufs["ffn_up_exps"])
                assert np.array_equal(pool.slot_view(layer, slot, "ffn_up_exps"),
                                      g.tensor(f"blk.{layer}.ffn_up_exps.weight").raw[1])
            finally:
                pool.release(layer, [1])
        table = np.zeros((max(pool.streamed_layers) + 1, g.tensor("blk.0.ffn_up_exps.weight").shape[0]), np.int32)
        pool.track(table)
        (slot,) = pool.acquire(0, [2])
        pool.release(0, [2])
        assert table[0, 2] == slot
        pool.untrack()  # no later claim writes the table
        for e in range(3, 3 + pool.capacity(0)):
            pool.acquire(0, [e])
            pool.release(0, [e])
        assert table[0, 2] == slot
    finally:
        pool.close()


def test_the_signature_check_can_fail():
    class Pool:
        buffers: list = []
        class_of_layer: dict = {}

        def capacity(self, layer):
            return 1

        def acquire(self, layer, experts, wait=True):
            return []

    found = mismatches(Pool, StreamedExperts)
    assert "stats: no such attribute" in found
    assert any(f.startswith("acquire: ") for f in found)  # an extra parameter
    assert "release: not implemented" in found and "capacity" not in " ".join(found)

    class Declared(StreamedExperts):  # declared but not implemented: the protocol's own bodies
        pass

    assert "touch: not implemented" in mismatches(Declared, StreamedExperts)


def test_the_vulkan_backend_uses_only_what_the_protocol_declares():
    used, found = set(), []
    for path in sorted(VULKAN.glob("*.py")):
        source = path.read_text(encoding="utf-8")
        used |= {attr for holder, attr, _, _ in pool_uses(source) if holder == "pool"}
        found += [f"{path.name} {f}" for f in outside_protocol(source)]
    assert found == []
    assert {"acquire", "release", "capacity", "touch", "track", "untrack"} <= used  # (the scan sees the uses)


def test_the_use_scan_can_fail():
    snippet = """
def close(self):
    self.pool.table = None
    n = len(self.be.pool.sources)
    pool.acquire(0, [1])
    self.source.buffers
"""
    assert outside_protocol(snippet) == ["line 3: pool.table written", "line 4: pool.sources",
                                         "line 6: source.buffers"]
