"""The Vulkan device layer: choosing a device, reporting it, buffers, recording and replaying."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest

from onebit.backends.vulkan.device import (
    VulkanUnavailableError,
    choose_device,
    default_device,
    list_devices,
)
from onebit.backends.vulkan.kernels import Kernels
from onebit.errors import OnebitError


@pytest.fixture(scope="module")
def dev():
    return default_device()


def test_device_reports_name_heaps_and_limits(dev):
    info = dev.info
    assert info.usable and info.heaps and info.memory_types
    assert info.max_storage_buffer_range >= 1 << 20 and info.max_memory_allocation_size >= info.max_storage_buffer_range
    assert info.max_push_constants_size >= 128 and info.subgroup_size >= 1
    text = info.describe()
    for needle in (info.name, "heap 0", "max storage buffer range", "push constants", "subgroup"):
        assert needle in text
    if info.unified:  # lavapipe: a CPU device, so weights live in host-visible device-local memory
        buf = dev.buffer(64)
        assert buf.host_visible
        t = info.memory_types[dev.memory_type(0xFFFFFFFF, host_visible=False)]
        assert t.device_local and t.host_visible


def test_choose_device_order_and_selector():
    base = list_devices()[0]
    cpu = replace(base, index=0, name="llvmpipe", type="cpu")
    dgpu = replace(base, index=1, name="Radeon RX 7900", type="discrete")
    igpu = replace(base, index=2, name="Radeon 8060S", type="integrated")
    broken = replace(base, index=3, name="Old GPU", type="integrated", missing=("8-bit storage buffers",))
    infos = [cpu, dgpu, igpu, broken]
    assert choose_device(infos) is igpu
    assert choose_device([cpu, dgpu]) is dgpu
    assert choose_device(infos, "0") is cpu
    assert choose_device(infos, "rx 79") is dgpu
    with pytest.raises(VulkanUnavailableError, match="no Vulkan device matches 'nvidia'.*llvmpipe"):
        choose_device(infos, "nvidia")
    with pytest.raises(VulkanUnavailableError, match="lacks 8-bit storage"):
        choose_device(infos, "old")
    with pytest.raises(VulkanUnavailableError, match="found no devices"):
        choose_device([])
    assert issubclass(VulkanUnavailableError, OnebitError)


def _run_isolated(code: str, env_extra: dict) -> subprocess.CompletedProcess:
    import os

    env = dict(os.environ, **env_extra)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)


def test_no_driver_is_a_clear_error():
    code = (
        "from onebit.backends.vulkan import open_device, VulkanUnavailableError\n"
        "try:\n    open_device()\nexcept VulkanUnavailableError as e:\n    print('ERR', e)\n"
    )
    res = _run_isolated(code, {"VK_ICD_FILENAMES": "/nonexistent.json", "VK_DRIVER_FILES": "/nonexistent.json"})
    assert "ERR" in res.stdout, res.stdout + res.stderr
    assert "--backend numpy" in res.stdout


def test_no_vulkan_package_or_loader_is_a_clear_error():
    code = (
        "import sys\nsys.modules['vulkan'] = None\n"
        "from onebit.backends.vulkan import open_device, VulkanUnavailableError\n"
        "try:\n    open_device()\nexcept VulkanUnavailableError as e:\n    print('ERR', e)\n"
    )
    res = _run_isolated(code, {})
    assert "ERR" in res.stdout and "pip install vulkan" in res.stdout, res.stdout + res.stderr


def test_buffer_roundtrip_and_views(dev):
    buf = dev.buffer(4096)
    a = np.arange(100, dtype=np.float32)
    buf.write(a, offset=256)
    np.testing.assert_array_equal(buf.read(np.float32, (100,), 256), a)
    buf.view(np.float32, (4,), 256)[:] = -1  # a mapped view writes device memory directly
    assert buf.read(np.float32, (2,), 256).tolist() == [-1, -1]
    buf.destroy()


def test_sequence_replays_and_barriers_only_on_hazards(dev):
    k = Kernels(dev)
    n = 64
    a, b, c, d = (dev.buffer(n * 4) for _ in range(4))
    a.write(np.ones(n, np.float32))
    b.write(np.full(n, 2, np.float32))
    seq = dev.sequence()
    k.elementwise(seq, "add", a.slice(), b.slice(), c.slice(), n)  # c = a + b
    k.elementwise(seq, "mul", a.slice(), b.slice(), d.slice(), n)  # independent of the first
    k.elementwise(seq, "add", c.slice(), d.slice(), a.slice(), n)  # reads both, writes a (read before)
    seq.run()
    assert seq.n_barriers == 1
    np.testing.assert_array_equal(a.read(np.float32, (n,)), np.full(n, 5, np.float32))
    seq.run()  # replay the recorded command buffer: a = (a + b) + a * b with the new a
    np.testing.assert_array_equal(a.read(np.float32, (n,)), np.full(n, 17, np.float32))
    seq.close()


def test_buffer_copy_and_copy_kernel(dev):
    k = Kernels(dev)
    src, mid, dst = (dev.buffer(1024) for _ in range(3))
    data = np.random.default_rng().integers(0, 2**32, 256, dtype=np.uint32)
    src.write(data)
    with dev.sequence() as seq:
        seq.copy(src.slice(), mid.slice())
        k.copy(seq, mid.slice(), dst.slice())
        seq.run()
    np.testing.assert_array_equal(dst.read(np.uint32, (256,)), data)
