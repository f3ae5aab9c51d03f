"""The Vulkan backend: compute shaders on the GPU (or on lavapipe, Mesa's CPU device).

`device` is the Vulkan layer, `kernels` runs the compiled shaders in `spv/` (built from
`shaders/` at the repository root), `reference` holds their numpy twins, and `backend` is
`VulkanBackend`, the same interface as `NumpyBackend`. A forward of R rows (decode, verify
rows, prompt chunks) is recorded into command buffers replayed per forward, cut at the pause
points that need the host: `recorder` records the schedule's ops over `arena` values,
`recording` holds and replays the result, `chain` replays a greedy decode a step ahead,
`runner` picks the recording a forward replays, and `kv` holds the KV cache in device memory;
`slots` holds a streaming pool's slots in device memory.
"""

from .device import (
    DeviceInfo,
    VulkanKernelError,
    VulkanUnavailableError,
    choose_device,
    default_device,
    list_devices,
    open_device,
)

__all__ = [
    "DeviceInfo", "VulkanKernelError", "VulkanUnavailableError", "choose_device", "default_device",
    "list_devices", "open_device",
]
