"""The Vulkan backend: compute shaders on the GPU (or on lavapipe, Mesa's CPU device).

`device` is the Vulkan layer, `kernels` runs the compiled shaders in `spv/` (built from
`shaders/` at the repository root), `reference` holds their numpy twins, and `backend` is
`VulkanBackend`, the same interface as `NumpyBackend`; `graph` records a forward of R rows
(decode, verify rows, prompt chunks) into command buffers replayed per forward, cut at the
pause points that need the host; `slots` holds a streaming pool's slots in device memory.
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
