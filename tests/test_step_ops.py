"""The schedule's op set (models/blocks.py `StepOps`) is the one the architectures use, and
every step a backend runs a schedule on gives all of it."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

from onebit.backends.numpy_backend import EagerStep
from onebit.backends.vulkan.recorder import Recorder
from onebit.models.blocks import StepOps

MODELS = Path(__file__).resolve().parent.parent / "onebit" / "models"


def declared() -> set[str]:
    return {n for n in vars(StepOps) if not n.startswith("_")} | set(StepOps.__annotations__)


def used_by_the_architectures() -> set[str]:
    """Every attribute the schedules read from their step (`g.op`)."""
    out = set()
    for p in MODELS.glob("*.py"):
        for node in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "g":
                out.add(node.attr)
    return out


def given_by(cls) -> set[str]:
    """The ops a step class defines (methods), and the attributes its __init__ sets."""
    names = {n for n, v in inspect.getmembers(cls) if callable(v) and not n.startswith("_")}
    init = ast.parse(inspect.getsource(cls.__init__).strip().replace("\n    ", "\n"))
    for node in ast.walk(init):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self" \
                and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
    return names


def test_the_protocol_declares_what_the_architectures_use():
    assert used_by_the_architectures() - declared() == set()


def test_every_step_gives_every_op():
    for cls in (EagerStep, Recorder):
        assert declared() - given_by(cls) == set(), cls.__name__


def test_the_checks_see_a_missing_op():
    class Partial:
        def __init__(self):
            self.tensor_names = {}

        def embed(self, name):
            return name

    assert "norm" in declared() - given_by(Partial)
