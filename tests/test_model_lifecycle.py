"""A Model owns its file, expert pool and slots, backend and predictor, and `close` frees them:
on Vulkan the device memory comes back, so `serve --models-dir` switching models holds one
model at a time. A model a request switches to loads with the whole LoadSpec the first one had
(its device, its context, its threads...). Lavapipe is the Vulkan device (tests never need a GPU)."""

from __future__ import annotations

import dataclasses

import pytest

import onebit
from conftest import fixture_path
from onebit.model import LoadSpec, shipped_model_path

A, B = "qwen3moe-f32.gguf", "q3moe256-Q4_K_M.gguf"


@pytest.fixture
def device_name():
    from onebit.backends.vulkan.device import VulkanUnavailableError, list_devices

    try:
        devices = [d for d in list_devices() if d.usable]
    except VulkanUnavailableError as e:
        pytest.skip(f"no Vulkan device: {e}")
    if not devices:
        pytest.skip("no usable Vulkan device")
    return devices[0].name.split(" ")[0]


def test_closing_a_model_gives_its_device_memory_back(device_name):
    a = onebit.load(fixture_path(A), backend="vulkan", device=device_name, slots=4, budget="1GiB", predict="off")
    dev = a.be.dev
    held = dev.allocated_bytes
    assert a.be.name == "vulkan" and a.pool is not None and held > 0 and dev.live_buffers > 0
    with a:  # (a context manager: closed on leaving)
        pass
    assert a.closed and (dev.allocated_bytes, dev.live_buffers) == (0, 0)
    a.close()  # (again: nothing left to free)


def test_a_model_switched_in_serve_keeps_the_spec_and_frees_the_old_one(device_name):
    from onebit.apps.serve import Engine, Sampling

    spec = LoadSpec(path=str(fixture_path(A)), backend="vulkan", device=device_name, n_ctx=256, slots=4,
                    budget="1GiB", predict="off", template_kwargs={"enable_thinking": False})
    first = onebit.load(spec)
    dev = first.be.dev
    engine = Engine(first, Sampling(), catalog=lambda: {"b": str(fixture_path(B))})
    try:
        engine._switch("b")  # (what the worker thread does for a request naming model "b")
        m = engine.model
        assert first.closed and m is not first and engine.model_id == "b"
        assert m.spec == dataclasses.replace(spec, path=str(fixture_path(B)))
        assert m.be.name == "vulkan" and m.be.dev is dev and m.context_length == 256
        assert m.template_kwargs == {"enable_thinking": False}
        b_bytes = dev.allocated_bytes
        engine._switch(None)  # (the model loaded now: nothing to do)
        assert engine.model is m and dev.allocated_bytes == b_bytes
    finally:
        engine.close()
    assert engine.model.closed and (dev.allocated_bytes, dev.live_buffers) == (0, 0)


def test_load_takes_a_spec_or_a_path_and_fields():
    path = str(fixture_path(A))
    m = onebit.load(path, backend="numpy", n_ctx=64, budget="1GiB")
    assert m.spec == LoadSpec(path=path, backend="numpy", n_ctx=64, budget="1GiB") and m.context_length == 64
    m.close()
    spec = LoadSpec(path=path, backend="numpy", n_ctx=128, budget="1GiB")
    with onebit.load(spec, n_ctx=32) as m:
        assert m.spec.n_ctx == 32 and m.context_length == 32 and m.spec.path == path
    with onebit.load(backend="numpy") as m:  # (no path: the model shipped with onebit)
        assert m.path == shipped_model_path()


def test_a_device_asked_for_by_name_must_exist(device_name):
    from onebit.backends.vulkan.device import VulkanUnavailableError

    with pytest.raises(VulkanUnavailableError, match="no-such-device"):
        onebit.load(fixture_path(A), backend="auto", device="no-such-device")  # (no fall back to cpu)


def test_a_model_is_built_on_a_thread_that_ends(monkeypatch):
    """onebit.load builds the Model on a thread that is gone when the load returns (so no OpenMP
    team of the load's kernels outlives it beside the thread that runs the forwards), with the
    Model or the load's error."""
    import threading

    from onebit import model as model_module
    from onebit.errors import UsageError

    seen = []
    m = onebit.load(fixture_path("qwen3moe-f32.gguf"), backend="numpy")
    monkeypatch.setattr(model_module, "Model", lambda spec: seen.append(threading.current_thread()) or m)
    assert onebit.load(fixture_path("qwen3moe-f32.gguf"), backend="numpy") is m
    assert seen[0] is not threading.current_thread() and not seen[0].is_alive()

    def bad(spec):
        raise UsageError("no such file")

    monkeypatch.setattr(model_module, "Model", bad)
    with pytest.raises(UsageError, match="no such file"):
        onebit.load("x.gguf")
    m.close()
