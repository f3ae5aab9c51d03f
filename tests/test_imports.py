"""The engine's import graph: no module imports another that (directly or not) imports it back,
and no layer imports a layer above it. Read from the source (every import statement, those
inside functions too), so a lazy import cannot hide a circle."""

from __future__ import annotations

import ast
from pathlib import Path



ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"onebit": "onebit", "cli": "onebit.cli", "memory": "onebit.memory"}  # folder -> installed name

# Layers, lowest first: a module may import its own layer and the layers below it. An entry names
# a module and the modules under it; the package root, `onebit` (the API: load, LoadSpec), names
# itself only. Every module must be placed.
LAYERS = [
    ("file formats", ["onebit.errors", "onebit.formats"]),  # GGUF, quant types, tokenizer, model stores
    ("chat formats", ["onebit.chat_formats"]),  # templates, reasoning channels, tool calls, structured output
    ("core", ["onebit.config", "onebit.cache", "onebit.pause", "onebit.gate", "onebit.sample", "onebit.moe",
              "onebit.moe.trace", "onebit.moe.cachesim", "onebit.moe.routing"]),  # config, caches, pause protocol
    ("backends", ["onebit.backends", "onebit.nonfinite"]),
    ("memory", ["onebit.memory"]),  # budget, plan, expert pool
    ("models", ["onebit.models", "onebit.moe.predict"]),
    ("engine", ["onebit.runner", "onebit.generate", "onebit.lookup", "onebit.model", "onebit"]),
    ("applications", ["onebit.apps"]),  # chat, batch, cluster, serve, bench, info
    ("cli", ["onebit.cli"]),
]
ROOT_PACKAGE = "onebit"


def modules() -> dict[str, Path]:
    out = {}
    for folder, name in PACKAGES.items():
        for p in (ROOT / folder).rglob("*.py"):
            parts = [x for x in p.relative_to(ROOT / folder).with_suffix("").parts if x != "__init__"]
            out[".".join([name, *parts])] = p
    return out


def imports(mods: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the modules of this project it imports (a `from pkg import name` counts as
    pkg.name where that is a module, else as pkg)."""
    graph = {}
    for mod, path in mods.items():
        is_pkg = path.name == "__init__.py"
        found = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = mod.split(".")[: len(mod.split(".")) - node.level + (1 if is_pkg else 0)]
                    prefix = ".".join(base + ([node.module] if node.module else []))
                else:
                    prefix = node.module or ""
                targets = [f"{prefix}.{a.name}" if f"{prefix}.{a.name}" in mods else prefix for a in node.names]
            else:
                continue
            for t in targets:
                while t and t not in mods:
                    t = t.rpartition(".")[0]
                if t and t != mod and not mod.startswith(t + "."):  # (a package's own __init__ is not an edge)
                    found.add(t)
        graph[mod] = found
    return graph


def layer_of(mod: str) -> int:
    best, rank = -1, None
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            under = mod.startswith(p + ".") and p != ROOT_PACKAGE
            if (mod == p or under) and len(p) > best:
                best, rank = len(p), i
    return rank


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, n = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = n[0]
        n[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_circle():
    assert cycles(imports(modules())) == []


def test_no_layer_imports_a_layer_above_it():
    graph = imports(modules())
    unplaced = sorted(m for m in graph if layer_of(m) is None)
    assert unplaced == [], "modules without a layer in LAYERS"
    upward = sorted(f"{m} ({LAYERS[layer_of(m)][0]}) -> {t} ({LAYERS[layer_of(t)][0]})"
                    for m, ts in graph.items() for t in ts if layer_of(t) > layer_of(m))
    assert upward == []


def test_the_check_sees_a_circle_and_an_upward_import():
    """The checks above can fail: a made-up graph with both faults is caught; the package root
    places only itself (a new top-level module is unplaced, not taken into the engine)."""
    graph = {"onebit.cache": {"onebit.model"}, "onebit.model": {"onebit.cache"}}
    assert cycles(graph) == [["onebit.cache", "onebit.model"]]
    assert layer_of("onebit.model") > layer_of("onebit.cache")
    layer = {name: i for i, (name, _) in enumerate(LAYERS)}
    assert layer_of("onebit.backends.vulkan.recording") == layer["backends"]
    assert layer_of("onebit.moe.predict") == layer["models"] and layer_of("onebit.moe.trace") == layer["core"]
    assert layer_of("onebit") == layer["engine"] and layer_of("onebit.something_new") is None
    assert layer_of("onebit.formats.gguf_file") < layer_of("onebit") < layer_of("onebit.apps.serve")
