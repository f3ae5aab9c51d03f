"""The Vulkan device layer: pick a device, allocate buffers, build pipelines, record and run.

Everything Vulkan goes through here, via the `vulkan` package (a cffi binding). The pieces:

- `list_devices()` / `DeviceInfo`: what the machine offers (name, type, heaps, limits), for
  `onebit devices` and for choosing. `open_device(selector)` picks one: integrated GPU
  first, then discrete, virtual, CPU (lavapipe); a selector (index or part of the name: the
  CLI's --device, else $ONEBIT_VULKAN_DEVICE) overrides.
- `Buffer`: one allocation. On unified-memory devices (integrated or CPU type) buffers live in
  host-visible device-local memory and stay mapped, so weights are filled from the GGUF memory
  map with one memcpy and results are read back without a staging copy. Other devices get
  device-local memory and a staging copy per upload.
- `Pipeline`: a compute pipeline from SPIR-V, with specialization constants and a 128-byte
  push-constant range (the minimum every device guarantees).
- `Sequence`: dispatches recorded into one command buffer, with a barrier only where a
  dispatch touches a range an earlier one wrote (or writes one it read); `run()` submits and
  waits, and a recorded sequence can be run again (the decode step is recorded once, replayed).
"""

from __future__ import annotations

import logging
import struct
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence as Seq

import numpy as np

from ...errors import BackendUnavailableError, OnebitError

log = logging.getLogger(__name__)

PUSH_CONSTANT_BYTES = 128


class VulkanUnavailableError(BackendUnavailableError):
    """No Vulkan loader, no usable device, or a device that lacks a feature onebit needs."""


class VulkanKernelError(OnebitError):
    """A shader could not be loaded or a pipeline could not be built or run."""


def _vk():
    try:
        import vulkan as vk
    except ImportError as e:
        raise VulkanUnavailableError(
            "the Vulkan backend needs the 'vulkan' Python package (pip install vulkan); "
            "use --backend numpy to run without it"
        ) from e
    except OSError as e:  # the package raises OSError when libvulkan.so.1 is missing
        raise VulkanUnavailableError(
            "no Vulkan loader found (libvulkan.so.1): install your GPU's Vulkan driver "
            "(Debian/Ubuntu: apt-get install libvulkan1 mesa-vulkan-drivers), or use --backend numpy"
        ) from e
    return vk


# -- what a device offers ----------------------------------------------------------------

_TYPE_NAMES = {0: "other", 1: "integrated", 2: "discrete", 3: "virtual", 4: "cpu"}
_TYPE_ORDER = {"integrated": 0, "discrete": 1, "virtual": 2, "cpu": 3, "other": 4}


@dataclass(frozen=True)
class MemoryHeap:
    size: int
    device_local: bool


@dataclass(frozen=True)
class MemoryType:
    heap: int
    device_local: bool
    host_visible: bool
    host_coherent: bool
    host_cached: bool

    def describe(self) -> str:
        flags = [n for n, on in (("device-local", self.device_local), ("host-visible", self.host_visible),
                                 ("coherent", self.host_coherent), ("cached", self.host_cached)) if on]
        return f"heap {self.heap}: {' | '.join(flags) or 'none'}"


@dataclass(frozen=True)
class DeviceInfo:
    index: int
    name: str
    type: str  # integrated | discrete | virtual | cpu | other
    api_version: str
    driver_version: int
    vendor_id: int
    device_id: int
    heaps: tuple[MemoryHeap, ...]
    memory_types: tuple[MemoryType, ...]
    max_storage_buffer_range: int
    max_memory_allocation_size: int
    max_compute_shared_memory_size: int
    max_push_constants_size: int
    max_workgroup_count: tuple[int, int, int]
    max_workgroup_size: tuple[int, int, int]
    max_workgroup_invocations: int
    min_storage_buffer_offset_alignment: int
    subgroup_size: int
    subgroup_arithmetic: bool  # subgroupAdd and friends in compute shaders
    storage_8bit: bool
    storage_16bit: bool
    missing: tuple[str, ...] = field(default=())  # features onebit needs that this device lacks
    max_uniform_buffer_range: int = 16384  # Vulkan's minimum; the device's own below
    min_uniform_buffer_offset_alignment: int = 256  # Vulkan's maximum
    subgroup_shuffle: bool = False  # subgroupShuffle in compute shaders

    @property
    def unified(self) -> bool:
        """CPU and GPU share one memory: integrated GPUs and CPU devices."""
        return self.type in ("integrated", "cpu")

    @property
    def usable(self) -> bool:
        return not self.missing

    def describe(self) -> str:
        gib = 1 << 30
        lines = [
            f"[{self.index}] {self.name} ({self.type}{', unified memory' if self.unified else ''}), "
            f"Vulkan {self.api_version}",
        ]
        for i, h in enumerate(self.heaps):
            lines.append(f"  heap {i}: {h.size / gib:.1f} GiB{' device-local' if h.device_local else ''}")
        for i, t in enumerate(self.memory_types):
            lines.append(f"  memory type {i}: {t.describe()}")
        lines += [
            f"  max storage buffer range: {self.max_storage_buffer_range / (1 << 20):.0f} MiB",
            f"  max allocation: {self.max_memory_allocation_size / (1 << 20):.0f} MiB",
            f"  shared memory: {self.max_compute_shared_memory_size // 1024} KiB, "
            f"push constants: {self.max_push_constants_size} B, subgroup: {self.subgroup_size}"
            f"{' (arithmetic)' if self.subgroup_arithmetic else ''}",
            f"  8/16-bit storage: {'yes' if self.storage_8bit else 'no'}/{'yes' if self.storage_16bit else 'no'}",
        ]
        if self.missing:
            lines.append(f"  not usable by onebit: lacks {', '.join(self.missing)}")
        return "\n".join(lines)


def _version(v: int) -> str:
    return f"{v >> 22}.{(v >> 12) & 0x3FF}.{v & 0xFFF}"


class _Instance:
    """The process-wide Vulkan instance (creating one per device open is slow)."""

    _instance: Optional["_Instance"] = None

    def __init__(self):
        vk = self.vk = _vk()
        app = vk.VkApplicationInfo(
            sType=vk.VK_STRUCTURE_TYPE_APPLICATION_INFO, pApplicationName="onebit", applicationVersion=1,
            pEngineName="onebit", engineVersion=1, apiVersion=vk.VK_MAKE_VERSION(1, 2, 0),
        )
        info = vk.VkInstanceCreateInfo(sType=vk.VK_STRUCTURE_TYPE_INSTANCE_CREATE_INFO, pApplicationInfo=app)
        try:
            self.handle = vk.vkCreateInstance(info, None)
        except vk.VkError as e:
            raise VulkanUnavailableError(
                f"could not create a Vulkan instance ({type(e).__name__}): is a Vulkan driver installed? "
                "(Debian/Ubuntu: apt-get install mesa-vulkan-drivers), or use --backend numpy"
            ) from e
        try:
            self.physical = list(vk.vkEnumeratePhysicalDevices(self.handle))
        except vk.VkError:
            self.physical = []

    @classmethod
    def get(cls) -> "_Instance":
        if cls._instance is None:
            cls._instance = cls()
        return cls._instance


def _struct(vk, ctype: str, stype: str, **fields):
    """A zeroed C struct `ctype` with sType VK_STRUCTURE_TYPE_<stype> (for pNext chains)."""
    return vk.ffi.new(f"{ctype}*", {"sType": getattr(vk, f"VK_STRUCTURE_TYPE_{stype}"), **fields})


def _query(vk, pd, index: int) -> DeviceInfo:
    ffi = vk.ffi
    subgroup = _struct(vk, "VkPhysicalDeviceSubgroupProperties", "PHYSICAL_DEVICE_SUBGROUP_PROPERTIES")
    props2 = _struct(vk, "VkPhysicalDeviceProperties2", "PHYSICAL_DEVICE_PROPERTIES_2", pNext=subgroup)
    vk.lib.vkGetPhysicalDeviceProperties2(pd, props2)
    p = props2.properties
    lim = p.limits
    f11 = _struct(vk, "VkPhysicalDeviceVulkan11Features", "PHYSICAL_DEVICE_VULKAN_1_1_FEATURES")
    f12 = _struct(vk, "VkPhysicalDeviceVulkan12Features", "PHYSICAL_DEVICE_VULKAN_1_2_FEATURES", pNext=f11)
    feats = _struct(vk, "VkPhysicalDeviceFeatures2", "PHYSICAL_DEVICE_FEATURES_2", pNext=f12)
    if p.apiVersion >= vk.VK_MAKE_VERSION(1, 2, 0):
        vk.lib.vkGetPhysicalDeviceFeatures2(pd, feats)
    mem = ffi.new("VkPhysicalDeviceMemoryProperties*")
    vk.lib.vkGetPhysicalDeviceMemoryProperties(pd, mem)
    heaps = tuple(
        MemoryHeap(int(mem.memoryHeaps[i].size), bool(mem.memoryHeaps[i].flags & vk.VK_MEMORY_HEAP_DEVICE_LOCAL_BIT))
        for i in range(mem.memoryHeapCount)
    )
    types = []
    for i in range(mem.memoryTypeCount):
        fl = mem.memoryTypes[i].propertyFlags
        types.append(MemoryType(
            int(mem.memoryTypes[i].heapIndex), bool(fl & vk.VK_MEMORY_PROPERTY_DEVICE_LOCAL_BIT),
            bool(fl & vk.VK_MEMORY_PROPERTY_HOST_VISIBLE_BIT), bool(fl & vk.VK_MEMORY_PROPERTY_HOST_COHERENT_BIT),
            bool(fl & vk.VK_MEMORY_PROPERTY_HOST_CACHED_BIT),
        ))
    arith = bool(subgroup.supportedOperations & vk.VK_SUBGROUP_FEATURE_ARITHMETIC_BIT) and bool(
        subgroup.supportedStages & vk.VK_SHADER_STAGE_COMPUTE_BIT
    )
    shuffle = bool(subgroup.supportedOperations & vk.VK_SUBGROUP_FEATURE_SHUFFLE_BIT) and bool(
        subgroup.supportedStages & vk.VK_SHADER_STAGE_COMPUTE_BIT
    )
    missing = []
    if p.apiVersion < vk.VK_MAKE_VERSION(1, 2, 0):
        missing.append("Vulkan 1.2")
    if not f12.storageBuffer8BitAccess:
        missing.append("8-bit storage buffers")
    if not f11.storageBuffer16BitAccess:
        missing.append("16-bit storage buffers")
    if not any(t.host_visible and t.host_coherent for t in types):
        missing.append("host-visible coherent memory")
    vk_cstr = ffi.string(p.deviceName).decode("utf-8", "replace")
    return DeviceInfo(
        index=index, name=vk_cstr, type=_TYPE_NAMES.get(int(p.deviceType), "other"),
        api_version=_version(int(p.apiVersion)), driver_version=int(p.driverVersion),
        vendor_id=int(p.vendorID), device_id=int(p.deviceID), heaps=heaps, memory_types=tuple(types),
        max_storage_buffer_range=int(lim.maxStorageBufferRange),
        max_memory_allocation_size=int(_max_allocation(vk, pd) or lim.maxStorageBufferRange),
        max_compute_shared_memory_size=int(lim.maxComputeSharedMemorySize),
        max_push_constants_size=int(lim.maxPushConstantsSize),
        max_workgroup_count=tuple(int(lim.maxComputeWorkGroupCount[i]) for i in range(3)),
        max_workgroup_size=tuple(int(lim.maxComputeWorkGroupSize[i]) for i in range(3)),
        max_workgroup_invocations=int(lim.maxComputeWorkGroupInvocations),
        min_storage_buffer_offset_alignment=int(lim.minStorageBufferOffsetAlignment),
        subgroup_size=int(subgroup.subgroupSize), subgroup_arithmetic=arith,
        storage_8bit=bool(f12.storageBuffer8BitAccess), storage_16bit=bool(f11.storageBuffer16BitAccess),
        missing=tuple(missing), max_uniform_buffer_range=int(lim.maxUniformBufferRange),
        min_uniform_buffer_offset_alignment=int(lim.minUniformBufferOffsetAlignment), subgroup_shuffle=shuffle,
    )


def _max_allocation(vk, pd) -> int:
    m3 = _struct(vk, "VkPhysicalDeviceMaintenance3Properties", "PHYSICAL_DEVICE_MAINTENANCE_3_PROPERTIES")
    props2 = _struct(vk, "VkPhysicalDeviceProperties2", "PHYSICAL_DEVICE_PROPERTIES_2", pNext=m3)
    vk.lib.vkGetPhysicalDeviceProperties2(pd, props2)
    return int(m3.maxMemoryAllocationSize)


def list_devices() -> list[DeviceInfo]:
    """Every Vulkan device on this machine, in enumeration order (usable or not)."""
    inst = _Instance.get()
    return [_query(inst.vk, pd, i) for i, pd in enumerate(inst.physical)]


def choose_device(infos: Seq[DeviceInfo], selector: Optional[str | int] = None) -> DeviceInfo:
    """The device to use: `selector` (index or part of the name) if given, else the best usable
    one by type: integrated, discrete, virtual, CPU."""
    if not infos:
        raise VulkanUnavailableError(
            "Vulkan found no devices: install a Vulkan driver (Debian/Ubuntu: apt-get install "
            "mesa-vulkan-drivers for the CPU device lavapipe), or use --backend numpy"
        )
    listing = "; ".join(f"[{d.index}] {d.name} ({d.type})" for d in infos)
    if selector is not None and str(selector).strip() != "":
        s = str(selector).strip()
        if s.isdigit():
            hits = [d for d in infos if d.index == int(s)]
        else:
            hits = [d for d in infos if s.lower() in d.name.lower()]
        if not hits:
            raise VulkanUnavailableError(f"no Vulkan device matches {s!r} (devices: {listing})")
        d = hits[0]
        if not d.usable:
            raise VulkanUnavailableError(f"Vulkan device {d.name!r} lacks {', '.join(d.missing)} (devices: {listing})")
        return d
    usable = [d for d in infos if d.usable]
    if not usable:
        why = "; ".join(f"{d.name}: lacks {', '.join(d.missing)}" for d in infos)
        raise VulkanUnavailableError(f"no usable Vulkan device ({why}); use --backend numpy")
    return min(usable, key=lambda d: (_TYPE_ORDER.get(d.type, 9), d.index))


# -- buffers ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Slice:
    """A byte range of a buffer: what a binding points at."""

    buffer: "Buffer"
    offset: int
    size: int

    def view(self, dtype=np.uint8, shape=None) -> np.ndarray:
        return self.buffer.view(dtype, shape, self.offset, self.size)


class Buffer:
    """One storage buffer with its own memory; mapped for its lifetime when host-visible."""

    def __init__(self, dev: "Device", size: int, host_visible: bool = True):
        vk = dev.vk
        self.dev, self.size = dev, max(int(size), 16)
        usage = (vk.VK_BUFFER_USAGE_STORAGE_BUFFER_BIT | vk.VK_BUFFER_USAGE_UNIFORM_BUFFER_BIT
                 | vk.VK_BUFFER_USAGE_TRANSFER_SRC_BIT | vk.VK_BUFFER_USAGE_TRANSFER_DST_BIT)
        info = vk.VkBufferCreateInfo(sType=vk.VK_STRUCTURE_TYPE_BUFFER_CREATE_INFO, size=self.size, usage=usage,
                                     sharingMode=vk.VK_SHARING_MODE_EXCLUSIVE)
        self.handle = vk.vkCreateBuffer(dev.handle, info, None)
        req = vk.vkGetBufferMemoryRequirements(dev.handle, self.handle)
        type_index = dev.memory_type(req.memoryTypeBits, host_visible)
        self.host_visible = dev.info.memory_types[type_index].host_visible
        alloc = vk.VkMemoryAllocateInfo(sType=vk.VK_STRUCTURE_TYPE_MEMORY_ALLOCATE_INFO,
                                        allocationSize=req.size, memoryTypeIndex=type_index)
        try:
            self.memory = vk.vkAllocateMemory(dev.handle, alloc, None)
        except vk.VkError as e:
            vk.vkDestroyBuffer(dev.handle, self.handle, None)
            raise VulkanUnavailableError(
                f"{dev.info.name}: could not allocate {self.size / (1 << 20):.1f} MiB of device memory "
                f"({type(e).__name__})"
            ) from e
        vk.vkBindBufferMemory(dev.handle, self.handle, self.memory, 0)
        self._map = None
        if self.host_visible:
            self._map = np.frombuffer(vk.vkMapMemory(dev.handle, self.memory, 0, self.size, 0), np.uint8)
        dev._buffers.add(self)

    def slice(self, offset: int = 0, size: Optional[int] = None) -> Slice:
        size = self.size - offset if size is None else size
        if offset < 0 or size < 0 or offset + size > self.size:
            raise ValueError(f"slice [{offset}, {offset + size}) outside a {self.size}-byte buffer")
        return Slice(self, offset, size)

    def view(self, dtype=np.uint8, shape=None, offset: int = 0, size: Optional[int] = None) -> np.ndarray:
        """A numpy view of the mapped memory (host-visible buffers only): writes go to the device."""
        if self._map is None:
            raise ValueError("buffer is not host-visible; use read()/write()")
        dtype = np.dtype(dtype)
        if shape is None:
            n = ((self.size - offset) if size is None else size) // dtype.itemsize
            shape = (n,)
        n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        return self._map[offset : offset + n].view(dtype).reshape(shape)

    def write(self, data: np.ndarray, offset: int = 0) -> None:
        src = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        if offset + src.size > self.size:
            raise ValueError(f"{src.size} bytes at {offset} do not fit a {self.size}-byte buffer")
        if self._map is not None:
            self._map[offset : offset + src.size] = src  # one memcpy, no staging
        else:
            self.dev._staged_write(self, offset, src)

    def read(self, dtype=np.float32, shape=None, offset: int = 0) -> np.ndarray:
        if self._map is not None:
            return self.view(dtype, shape, offset).copy()
        dtype = np.dtype(dtype)
        n = int(np.prod(shape)) * dtype.itemsize if shape is not None else self.size - offset
        raw = self.dev._staged_read(self, offset, n)
        return raw.view(dtype).reshape(shape if shape is not None else (-1,))

    def destroy(self) -> None:
        if self.handle is None:
            return
        vk, dev = self.dev.vk, self.dev.handle
        if self._map is not None:
            self._map = None
            vk.vkUnmapMemory(dev, self.memory)
        vk.vkDestroyBuffer(dev, self.handle, None)
        vk.vkFreeMemory(dev, self.memory, None)
        self.handle = None
        self.dev._buffers.discard(self)


# -- pipelines ----------------------------------------------------------------------------


class Pipeline:
    """A compute pipeline: `n_bindings` buffers in set 0 (storage buffers, but uniform buffers at
    the indices in `uniform`) and 128 bytes of push constants."""

    def __init__(self, dev: "Device", name: str, spirv: bytes, n_bindings: int, spec: Seq[int | float] = (),
                 uniform: Seq[int] = ()):
        vk, ffi = dev.vk, dev.vk.ffi
        self.dev, self.name, self.n_bindings = dev, name, n_bindings
        self.binding_types = [vk.VK_DESCRIPTOR_TYPE_UNIFORM_BUFFER if i in uniform
                              else vk.VK_DESCRIPTOR_TYPE_STORAGE_BUFFER for i in range(n_bindings)]
        bindings = [
            vk.VkDescriptorSetLayoutBinding(binding=i, descriptorType=self.binding_types[i],
                                            descriptorCount=1, stageFlags=vk.VK_SHADER_STAGE_COMPUTE_BIT)
            for i in range(n_bindings)
        ]
        self.set_layout = vk.vkCreateDescriptorSetLayout(dev.handle, vk.VkDescriptorSetLayoutCreateInfo(
            sType=vk.VK_STRUCTURE_TYPE_DESCRIPTOR_SET_LAYOUT_CREATE_INFO, bindingCount=n_bindings, pBindings=bindings,
        ), None)
        push = vk.VkPushConstantRange(stageFlags=vk.VK_SHADER_STAGE_COMPUTE_BIT, offset=0, size=PUSH_CONSTANT_BYTES)
        self.layout = vk.vkCreatePipelineLayout(dev.handle, vk.VkPipelineLayoutCreateInfo(
            sType=vk.VK_STRUCTURE_TYPE_PIPELINE_LAYOUT_CREATE_INFO, setLayoutCount=1, pSetLayouts=[self.set_layout],
            pushConstantRangeCount=1, pPushConstantRanges=[push],
        ), None)
        try:
            self.module = vk.vkCreateShaderModule(dev.handle, vk.VkShaderModuleCreateInfo(
                sType=vk.VK_STRUCTURE_TYPE_SHADER_MODULE_CREATE_INFO, codeSize=len(spirv), pCode=spirv,
            ), None)
        except vk.VkError as e:
            raise VulkanKernelError(f"kernel {name}: the driver rejected its SPIR-V ({type(e).__name__})") from e
        # Specialization constants: ids 0.., each 4 bytes (uint, or float when given a float).
        data = b"".join(struct.pack("<f" if isinstance(v, float) else "<I", v) for v in spec)
        self._spec_data = ffi.new("char[]", data or b"\0")
        entries = ffi.new("VkSpecializationMapEntry[]",
                          [{"constantID": i, "offset": 4 * i, "size": 4} for i in range(len(spec))] or 1)
        spec_info = ffi.new("VkSpecializationInfo*", {
            "mapEntryCount": len(spec), "pMapEntries": entries, "dataSize": len(data), "pData": self._spec_data,
        })
        entry = ffi.new("char[]", b"main")
        stage = ffi.new("VkPipelineShaderStageCreateInfo*", {
            "sType": vk.VK_STRUCTURE_TYPE_PIPELINE_SHADER_STAGE_CREATE_INFO, "stage": vk.VK_SHADER_STAGE_COMPUTE_BIT,
            "module": self.module, "pName": entry, "pSpecializationInfo": spec_info if spec else ffi.NULL,
        })
        info = ffi.new("VkComputePipelineCreateInfo*", {
            "sType": vk.VK_STRUCTURE_TYPE_COMPUTE_PIPELINE_CREATE_INFO, "stage": stage[0], "layout": self.layout,
        })
        out = ffi.new("VkPipeline*")
        res = vk.lib.vkCreateComputePipelines(dev.handle, ffi.NULL, 1, info, ffi.NULL, out)
        if res != vk.VK_SUCCESS:
            raise VulkanKernelError(f"kernel {name}: the driver could not build its pipeline (VkResult {res})")
        self.handle = out[0]

    def destroy(self) -> None:
        vk, dev = self.dev.vk, self.dev.handle
        vk.vkDestroyPipeline(dev, self.handle, None)
        vk.vkDestroyShaderModule(dev, self.module, None)
        vk.vkDestroyPipelineLayout(dev, self.layout, None)
        vk.vkDestroyDescriptorSetLayout(dev, self.set_layout, None)


# -- recording and running ----------------------------------------------------------------


@dataclass
class _Dispatch:
    pipeline: Pipeline
    bindings: tuple[Slice, ...]
    push: bytes
    groups: tuple[int, int, int]
    writes: tuple[int, ...]  # indices of the bindings the kernel writes


@dataclass
class _Copy:
    src: Slice
    dst: Slice


def _overlap(a: Slice, b: Slice) -> bool:
    return a.buffer is b.buffer and a.offset < b.offset + b.size and b.offset < a.offset + a.size


class Fence:
    """A fence besides the device's own, for a sequence queued behind another (Sequence.submit)."""

    def __init__(self, dev: "Device"):
        vk = dev.vk
        self.dev = dev
        self.handle = vk.vkCreateFence(dev.handle, vk.VkFenceCreateInfo(sType=vk.VK_STRUCTURE_TYPE_FENCE_CREATE_INFO),
                                       None)
        self.ptr = vk.ffi.new("VkFence*", self.handle)

    def destroy(self) -> None:
        if self.handle is not None:
            self.dev.vk.vkDestroyFence(self.dev.handle, self.handle, None)
            self.handle = None


class Sequence:
    """Dispatches and copies recorded into one command buffer. `run()` submits it and waits.

    Ops are collected first; the command buffer is recorded at the first `run()` and reused by
    every later one, so push constants and bindings are fixed at recording time and per-run
    inputs travel in buffers."""

    def __init__(self, dev: "Device"):
        self.dev = dev
        self.ops: list[_Dispatch | _Copy] = []
        self._cmd = None
        self._pool = None
        self.n_barriers = 0

    def dispatch(self, pipeline: Pipeline, bindings: Seq[Slice], push: bytes = b"", groups=(1, 1, 1),
                 writes: Seq[int] = ()) -> None:
        if self._cmd is not None:
            raise RuntimeError("sequence already recorded")
        if len(bindings) != pipeline.n_bindings:
            raise VulkanKernelError(f"kernel {pipeline.name} takes {pipeline.n_bindings} bindings, got {len(bindings)}")
        if len(push) > PUSH_CONSTANT_BYTES:
            raise VulkanKernelError(f"kernel {pipeline.name}: {len(push)} bytes of push constants")
        lim = self.dev.info.max_workgroup_count
        g = tuple(int(x) for x in groups) + (1,) * (3 - len(groups))
        if any(x < 1 or x > m for x, m in zip(g, lim)):
            raise VulkanKernelError(f"kernel {pipeline.name}: workgroup count {g} outside 1..{lim}")
        rng = self.dev.info.max_storage_buffer_range
        ubo = self.dev.vk.VK_DESCRIPTOR_TYPE_UNIFORM_BUFFER
        for s, t in zip(bindings, pipeline.binding_types):
            if s.size > rng:
                raise VulkanKernelError(f"kernel {pipeline.name}: a binding of {s.size} bytes exceeds "
                                        f"maxStorageBufferRange ({rng})")
            if t == ubo and (s.size > self.dev.info.max_uniform_buffer_range
                             or s.offset % self.dev.info.min_uniform_buffer_offset_alignment):
                raise VulkanKernelError(f"kernel {pipeline.name}: a uniform binding of {s.size} bytes at {s.offset} is "
                                        "outside the device's uniform buffer limits")
            if s.offset % self.dev.info.min_storage_buffer_offset_alignment:
                raise VulkanKernelError(f"kernel {pipeline.name}: binding offset {s.offset} is not aligned")
        self.ops.append(_Dispatch(pipeline, tuple(bindings), bytes(push), g, tuple(writes)))

    def copy(self, src: Slice, dst: Slice) -> None:
        if self._cmd is not None:
            raise RuntimeError("sequence already recorded")
        if src.size != dst.size:
            raise ValueError("copy between slices of different sizes")
        self.ops.append(_Copy(src, dst))

    def _record(self) -> None:
        dev, vk = self.dev, self.dev.vk
        lib, ffi = vk.lib, vk.ffi
        dispatches = [op for op in self.ops if isinstance(op, _Dispatch)]
        n_ubo = sum(t == vk.VK_DESCRIPTOR_TYPE_UNIFORM_BUFFER for op in dispatches for t in op.pipeline.binding_types)
        n_desc = sum(op.pipeline.n_bindings for op in dispatches) - n_ubo
        if dispatches:
            size = ffi.new("VkDescriptorPoolSize[]", [
                {"type": vk.VK_DESCRIPTOR_TYPE_STORAGE_BUFFER, "descriptorCount": max(n_desc, 1)},
                {"type": vk.VK_DESCRIPTOR_TYPE_UNIFORM_BUFFER, "descriptorCount": max(n_ubo, 1)},
            ])
            pinfo = ffi.new("VkDescriptorPoolCreateInfo*", {
                "sType": vk.VK_STRUCTURE_TYPE_DESCRIPTOR_POOL_CREATE_INFO, "maxSets": len(dispatches),
                "poolSizeCount": 2, "pPoolSizes": size,
            })
            pool = ffi.new("VkDescriptorPool*")
            _check(vk, lib.vkCreateDescriptorPool(dev.handle, pinfo, ffi.NULL, pool), "vkCreateDescriptorPool")
            self._pool = pool[0]
        cmd = ffi.new("VkCommandBuffer*")
        ainfo = ffi.new("VkCommandBufferAllocateInfo*", {
            "sType": vk.VK_STRUCTURE_TYPE_COMMAND_BUFFER_ALLOCATE_INFO, "commandPool": dev.command_pool,
            "level": vk.VK_COMMAND_BUFFER_LEVEL_PRIMARY, "commandBufferCount": 1,
        })
        _check(vk, lib.vkAllocateCommandBuffers(dev.handle, ainfo, cmd), "vkAllocateCommandBuffers")
        self._cmd = cmd[0]
        binfo = ffi.new("VkCommandBufferBeginInfo*", {"sType": vk.VK_STRUCTURE_TYPE_COMMAND_BUFFER_BEGIN_INFO})
        _check(vk, lib.vkBeginCommandBuffer(self._cmd, binfo), "vkBeginCommandBuffer")
        barrier = ffi.new("VkMemoryBarrier*", {
            "sType": vk.VK_STRUCTURE_TYPE_MEMORY_BARRIER,
            "srcAccessMask": vk.VK_ACCESS_SHADER_WRITE_BIT | vk.VK_ACCESS_TRANSFER_WRITE_BIT,
            "dstAccessMask": vk.VK_ACCESS_SHADER_READ_BIT | vk.VK_ACCESS_SHADER_WRITE_BIT
            | vk.VK_ACCESS_TRANSFER_READ_BIT | vk.VK_ACCESS_TRANSFER_WRITE_BIT,
        })
        stages = vk.VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT | vk.VK_PIPELINE_STAGE_TRANSFER_BIT
        # On entry: the host's writes since the last run, and that run's device writes (a
        # replayed sequence reads what it wrote before), are visible to the first dispatch.
        entry = ffi.new("VkMemoryBarrier*", {
            "sType": vk.VK_STRUCTURE_TYPE_MEMORY_BARRIER,
            "srcAccessMask": vk.VK_ACCESS_HOST_WRITE_BIT | vk.VK_ACCESS_SHADER_WRITE_BIT
            | vk.VK_ACCESS_TRANSFER_WRITE_BIT,
            "dstAccessMask": vk.VK_ACCESS_SHADER_READ_BIT | vk.VK_ACCESS_SHADER_WRITE_BIT
            | vk.VK_ACCESS_TRANSFER_READ_BIT | vk.VK_ACCESS_TRANSFER_WRITE_BIT,
        })
        lib.vkCmdPipelineBarrier(self._cmd, stages | vk.VK_PIPELINE_STAGE_HOST_BIT, stages, 0, 1, entry, 0, ffi.NULL,
                                 0, ffi.NULL)
        written: list[Slice] = []  # since the last barrier
        read: list[Slice] = []
        bound = None
        for op in self.ops:
            if isinstance(op, _Copy):
                op_reads, op_writes = [op.src], [op.dst]
            else:
                op_writes = [op.bindings[i] for i in op.writes]
                op_reads = [s for i, s in enumerate(op.bindings) if i not in op.writes]
            hazard = any(_overlap(s, w) for s in op_reads + op_writes for w in written) or any(
                _overlap(w, r) for w in op_writes for r in read
            )
            if hazard:
                lib.vkCmdPipelineBarrier(self._cmd, stages, stages, 0, 1, barrier, 0, ffi.NULL, 0, ffi.NULL)
                self.n_barriers += 1
                written, read = [], []
            written += op_writes
            read += op_reads
            if isinstance(op, _Copy):
                region = ffi.new("VkBufferCopy*",
                                 {"srcOffset": op.src.offset, "dstOffset": op.dst.offset, "size": op.src.size})
                lib.vkCmdCopyBuffer(self._cmd, op.src.buffer.handle, op.dst.buffer.handle, 1, region)
                continue
            p = op.pipeline
            sets = ffi.new("VkDescriptorSet*")
            layouts = ffi.new("VkDescriptorSetLayout*", p.set_layout)
            sinfo = ffi.new("VkDescriptorSetAllocateInfo*", {
                "sType": vk.VK_STRUCTURE_TYPE_DESCRIPTOR_SET_ALLOCATE_INFO, "descriptorPool": self._pool,
                "descriptorSetCount": 1, "pSetLayouts": layouts,
            })
            _check(vk, lib.vkAllocateDescriptorSets(dev.handle, sinfo, sets), "vkAllocateDescriptorSets")
            infos = ffi.new("VkDescriptorBufferInfo[]", [
                {"buffer": s.buffer.handle, "offset": s.offset, "range": s.size} for s in op.bindings
            ])
            writes = ffi.new("VkWriteDescriptorSet[]", [
                {"sType": vk.VK_STRUCTURE_TYPE_WRITE_DESCRIPTOR_SET, "dstSet": sets[0], "dstBinding": i,
                 "descriptorCount": 1, "descriptorType": p.binding_types[i], "pBufferInfo": infos + i}
                for i in range(len(op.bindings))
            ])
            lib.vkUpdateDescriptorSets(dev.handle, len(op.bindings), writes, 0, ffi.NULL)
            if bound is not p:
                lib.vkCmdBindPipeline(self._cmd, vk.VK_PIPELINE_BIND_POINT_COMPUTE, p.handle)
                bound = p
            lib.vkCmdBindDescriptorSets(self._cmd, vk.VK_PIPELINE_BIND_POINT_COMPUTE, p.layout, 0, 1, sets, 0, ffi.NULL)
            if op.push:
                data = ffi.new("char[]", op.push)
                lib.vkCmdPushConstants(self._cmd, p.layout, vk.VK_SHADER_STAGE_COMPUTE_BIT, 0, len(op.push), data)
            lib.vkCmdDispatch(self._cmd, *op.groups)
        # Make the results visible to the host (mapped reads after the fence).
        host = ffi.new("VkMemoryBarrier*", {
            "sType": vk.VK_STRUCTURE_TYPE_MEMORY_BARRIER,
            "srcAccessMask": vk.VK_ACCESS_SHADER_WRITE_BIT | vk.VK_ACCESS_TRANSFER_WRITE_BIT,
            "dstAccessMask": vk.VK_ACCESS_HOST_READ_BIT,
        })
        lib.vkCmdPipelineBarrier(self._cmd, stages, vk.VK_PIPELINE_STAGE_HOST_BIT, 0, 1, host, 0, ffi.NULL, 0, ffi.NULL)
        _check(vk, lib.vkEndCommandBuffer(self._cmd), "vkEndCommandBuffer")
        self._cmd_ptr = ffi.new("VkCommandBuffer*", self._cmd)
        self._submit = ffi.new("VkSubmitInfo*", {  # built once: a replay only submits it
            "sType": vk.VK_STRUCTURE_TYPE_SUBMIT_INFO, "commandBufferCount": 1, "pCommandBuffers": self._cmd_ptr,
        })

    def record(self) -> None:
        """Record the command buffer now (else the first `run()` does); ops are fixed after this."""
        if self._cmd is None:
            self._record()

    def run(self) -> None:
        """Submit (recording first if needed) and wait until the device is done."""
        self.submit()
        self.wait()

    def submit(self, fence: Optional["Fence"] = None) -> None:
        """Start it on the device and return at once; `wait()` before touching what it writes
        (or submitting anything else on the device's fence). With a `fence` of its own it may
        be queued behind other work: `wait(fence)` then waits for it; a command buffer is
        never submitted again before that wait."""
        if self._cmd is None:
            self._record()
        self.dev._submit(self._submit, what=self._what, fence=fence)

    def wait(self, fence: Optional["Fence"] = None) -> None:
        self.dev._wait(what=self._what, fence=fence)

    def _what(self) -> str:
        names = sorted({op.pipeline.name for op in self.ops if isinstance(op, _Dispatch)})
        return ", ".join(names[:4]) + (" ..." if len(names) > 4 else "")

    def close(self) -> None:
        vk, dev = self.dev.vk, self.dev
        if self._cmd is not None:
            vk.lib.vkFreeCommandBuffers(dev.handle, dev.command_pool, 1, self._cmd_ptr)
            self._cmd = None
        if self._pool is not None:
            vk.lib.vkDestroyDescriptorPool(dev.handle, self._pool, vk.ffi.NULL)
            self._pool = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _check(vk, res: int, what: str) -> None:
    if res != vk.VK_SUCCESS:
        raise VulkanKernelError(f"{what} failed (VkResult {res})")


# -- the device ---------------------------------------------------------------------------


class Device:
    """A logical device with one compute queue. Use `open_device()` to get one."""

    def __init__(self, info: DeviceInfo):
        inst = _Instance.get()
        vk = self.vk = inst.vk
        ffi = vk.ffi
        self.info = info
        self.physical = inst.physical[info.index]
        families = vk.vkGetPhysicalDeviceQueueFamilyProperties(self.physical)
        compute = [i for i, f in enumerate(families) if f.queueFlags & vk.VK_QUEUE_COMPUTE_BIT]
        if not compute:
            raise VulkanUnavailableError(f"Vulkan device {info.name!r} has no compute queue")
        self.queue_family = compute[0]
        prio = ffi.new("float[]", [1.0])
        qinfo = ffi.new("VkDeviceQueueCreateInfo*", {
            "sType": vk.VK_STRUCTURE_TYPE_DEVICE_QUEUE_CREATE_INFO, "queueFamilyIndex": self.queue_family,
            "queueCount": 1, "pQueuePriorities": prio,
        })
        f11 = _struct(vk, "VkPhysicalDeviceVulkan11Features", "PHYSICAL_DEVICE_VULKAN_1_1_FEATURES",
                      storageBuffer16BitAccess=1)
        f12 = _struct(vk, "VkPhysicalDeviceVulkan12Features", "PHYSICAL_DEVICE_VULKAN_1_2_FEATURES", pNext=f11,
                      storageBuffer8BitAccess=1)
        dinfo = ffi.new("VkDeviceCreateInfo*", {
            "sType": vk.VK_STRUCTURE_TYPE_DEVICE_CREATE_INFO, "pNext": f12, "queueCreateInfoCount": 1,
            "pQueueCreateInfos": qinfo,
        })
        out = ffi.new("VkDevice*")
        res = vk.lib.vkCreateDevice(self.physical, dinfo, ffi.NULL, out)
        if res != vk.VK_SUCCESS:
            raise VulkanUnavailableError(f"could not open Vulkan device {info.name!r} (VkResult {res})")
        self.handle = out[0]
        self.queue = vk.vkGetDeviceQueue(self.handle, self.queue_family, 0)
        self.command_pool = vk.vkCreateCommandPool(self.handle, vk.VkCommandPoolCreateInfo(
            sType=vk.VK_STRUCTURE_TYPE_COMMAND_POOL_CREATE_INFO, queueFamilyIndex=self.queue_family,
            flags=vk.VK_COMMAND_POOL_CREATE_RESET_COMMAND_BUFFER_BIT,
        ), None)
        fence_info = vk.VkFenceCreateInfo(sType=vk.VK_STRUCTURE_TYPE_FENCE_CREATE_INFO)
        self.fence = vk.vkCreateFence(self.handle, fence_info, None)
        self._fence_ptr = ffi.new("VkFence*", self.fence)
        self._buffers: set[Buffer] = set()
        self.wait_s = 0.0  # time spent waiting on the fence (host time = wall time - this)
        self.n_submits = 0
        self._pipelines: dict[tuple, Pipeline] = {}
        self._closed = False
        log.info("Vulkan device: %s (%s)", info.name, info.type)

    # memory

    def memory_type(self, type_bits: int, host_visible: bool) -> int:
        """Unified devices: device-local and host-visible (coherent), so no staging is ever
        needed. Others: device-local for weights; host-visible when asked."""
        types = self.info.memory_types
        allowed = [i for i in range(len(types)) if type_bits & (1 << i)]

        def first(pred):
            return next((i for i in allowed if pred(types[i])), None)

        if self.info.unified or host_visible:
            i = first(lambda t: t.device_local and t.host_visible and t.host_coherent)
            if i is None:
                i = first(lambda t: t.host_visible and t.host_coherent)
        else:
            i = first(lambda t: t.device_local)
        if i is None:
            i = first(lambda t: True)
        if i is None:
            raise VulkanUnavailableError(f"{self.info.name}: no memory type fits a storage buffer")
        return i

    def buffer(self, size: int, host_visible: bool = True) -> Buffer:
        return Buffer(self, size, host_visible)

    @property
    def live_buffers(self) -> int:
        """Buffers allocated on this device and not yet destroyed."""
        return len(self._buffers)

    @property
    def allocated_bytes(self) -> int:
        """Bytes of the buffers alive on this device."""
        return sum(b.size for b in self._buffers)

    def upload(self, array: np.ndarray) -> Buffer:
        buf = Buffer(self, np.asarray(array).nbytes, host_visible=True)
        buf.write(np.asarray(array))
        return buf

    def _staged(self, buf: Buffer, offset: int, n: int, data: Optional[np.ndarray]):
        stage = Buffer(self, n, host_visible=True)
        try:
            seq = Sequence(self)
            if data is not None:
                stage.write(data)
                seq.copy(stage.slice(0, n), buf.slice(offset, n))
            else:
                seq.copy(buf.slice(offset, n), stage.slice(0, n))
            seq.run()
            seq.close()
            return None if data is not None else stage.view(np.uint8, (n,)).copy()
        finally:
            stage.destroy()

    def _staged_write(self, buf: Buffer, offset: int, data: np.ndarray) -> None:
        self._staged(buf, offset, data.size, data)

    def _staged_read(self, buf: Buffer, offset: int, n: int) -> np.ndarray:
        return self._staged(buf, offset, n, None)

    # pipelines and running

    def pipeline(self, name: str, spirv: bytes, n_bindings: int, spec: Seq[int | float] = (),
                 uniform: Seq[int] = ()) -> Pipeline:
        key = (name, tuple(spec), tuple(uniform))
        p = self._pipelines.get(key)
        if p is None:
            p = self._pipelines[key] = Pipeline(self, name, spirv, n_bindings, spec, uniform)
        return p

    def sequence(self) -> Sequence:
        return Sequence(self)

    def _submit_wait(self, submit, what=str) -> None:
        """Submit a VkSubmitInfo* and wait; `what()` names the work in an error message."""
        self._submit(submit, what)
        self._wait(what)

    def _submit(self, submit, what=str, fence: Optional["Fence"] = None) -> None:
        vk = self.vk
        lib = vk.lib
        handle, ptr = (self.fence, self._fence_ptr) if fence is None else (fence.handle, fence.ptr)
        _check(vk, lib.vkResetFences(self.handle, 1, ptr), "vkResetFences")
        res = lib.vkQueueSubmit(self.queue, 1, submit, handle)
        if res != vk.VK_SUCCESS:
            raise VulkanKernelError(f"submitting {what()} failed (VkResult {res})")

    def _wait(self, what=str, fence: Optional["Fence"] = None) -> None:
        vk = self.vk
        lib = vk.lib
        t0 = time.perf_counter()
        ptr = self._fence_ptr if fence is None else fence.ptr
        res = lib.vkWaitForFences(self.handle, 1, ptr, vk.VK_TRUE, 0xFFFFFFFFFFFFFFFF)
        self.wait_s += time.perf_counter() - t0
        self.n_submits += 1
        if res != vk.VK_SUCCESS:
            raise VulkanKernelError(f"waiting for {what()} failed (VkResult {res}; device lost?)")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        vk = self.vk
        vk.vkDeviceWaitIdle(self.handle)
        for p in self._pipelines.values():
            p.destroy()
        self._pipelines.clear()
        for b in list(self._buffers):
            b.destroy()
        vk.vkDestroyFence(self.handle, self.fence, None)
        vk.vkDestroyCommandPool(self.handle, self.command_pool, None)
        vk.vkDestroyDevice(self.handle, None)


def open_device(selector: Optional[str | int] = None) -> Device:
    """Open the chosen device: `selector` (an index or part of a name), else the best usable one
    (see `choose_device`)."""
    return Device(choose_device(list_devices(), selector))


_opened: dict[Optional[str], Device] = {}


def default_device(selector: Optional[str | int] = None) -> Device:
    """One shared device per process and selector (opening a device and building pipelines is
    slow); `selector` as for `open_device`."""
    key = None if selector is None else str(selector)
    dev = _opened.get(key)
    if dev is None or dev._closed:
        dev = _opened[key] = open_device(selector)
    return dev
