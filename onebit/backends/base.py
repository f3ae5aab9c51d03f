"""What every backend answers for itself, asked of its class before one is opened.

The planner (memory/plan.py), the loader and the facade (model.py) name no backend: they ask
its class (`Backend`) for the device it computes on and the limits that device sets, how a
pool's slots are allocated, and for one file its `MemoryPolicy`: the bytes it holds for a
tensor, the layout it holds routed experts in, its scratch for R rows. ggml's allocator asks a
buffer type for a tensor's size the same way. The defaults are a host backend whose kernels
read every tensor where the file has it.
"""

from __future__ import annotations

from typing import Optional

from ..cache import F32_KV, KVTypes
from .experts import ExpertLayout

# A prompt's attention scores hold at most this many elements at once (query rows in tiles):
# 16 MiB of float32 per array, whatever the context, so the plan's scratch does not grow with it.
SCORE_TILE = 1 << 22
DELTA_CHUNK = 64  # rows per block of the chunked delta rule (as transformers and llama.cpp)


def activation_bytes(cfg, rows: int, n_ctx: int, all_logits: bool = False) -> int:
    """Peak transient bytes of one forward's activations over `rows` rows (the schedule's, the
    same on every backend): hidden states, attention scores over n_ctx keys, and logits."""
    H, Hkv, D, Dv = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.head_dim_v
    ffn = max(cfg.hidden_dim, cfg.expert_hidden_dim * max(cfg.n_experts_used, 1), cfg.shared_expert_hidden_dim)
    act = rows * (4 * cfg.dim + H * D + 2 * Hkv * (D + Dv) + H * Dv + 3 * ffn + cfg.n_experts)
    scores = 3 * max(min(H * rows * n_ctx, SCORE_TILE), H * n_ctx)  # scores, mask select, probabilities
    logits = (rows if all_logits else 1) * cfg.vocab_size
    if cfg.recurrent_layers:  # a DeltaNet layer: conv in/out, q/k/v per value head, z, and the
        Hv, Ds = cfg.ssm_time_step_rank, cfg.ssm_state_size  # state twice (old, new), the
        n = min(rows, DELTA_CHUNK)  # chunked form's [Hv, n, n] matrices
        act += rows * (3 * cfg.ssm_conv_channels + 5 * Hv * Ds) + 2 * Hv * Ds * Ds + 4 * Hv * n * n
    return 4 * (act + scores + logits)


class MemoryPolicy:
    """How backend class `backend` holds one file's tensors, decided before it is opened: the
    planner counts what this says, the loader and the backend do it. The default: every tensor
    as the file has it, read in place by the kernels."""

    experts: Optional[ExpertLayout] = None  # every expert source's layout of routed experts (None: the file's)

    def __init__(self, backend: type["Backend"], gguf):
        self.backend, self.gguf = backend, gguf

    def packs(self, t) -> bool:
        """Whether non-expert tensor t is held in a layout of the backend's own, made at load from
        the file's map (so the loader neither copies nor maps it: that would be a second copy)."""
        return False

    def held_bytes(self, t) -> int:
        """The bytes tensor t takes as held (routed experts: as `experts` holds them)."""
        if self.experts is not None and self.experts.packs(t):
            rows, row_bytes = self.experts.shape(t)
            return t.shape[0] * rows * row_bytes
        return t.n_bytes

    def scratch_bytes(self, cfg, rows: int, n_ctx: int, all_logits: bool = False) -> int:
        """Peak transient bytes of one forward over `rows` rows."""
        return activation_bytes(cfg, rows, n_ctx, all_logits)

    def decoded_bytes(self) -> int:
        """Scratch for a weight decoded for its use, once for all forwards (0: the kernels read
        the quantized blocks in place)."""
        return 0


class Backend:
    """What a backend class declares, with the defaults of a host backend. The loader asks, in
    order: `find_device` (a named device that cannot be found is an error), `open_device`,
    `device_limits` (for the budget), `memory_policy` (for the plan), `slot_allocator` (where
    experts stream), then `open`, then `repack`."""

    name = ""
    runs_on_host = True  # computes on the host's cores (False: a device; a predictor beside it runs on the host)
    # a forward reads the model file's memory map at any time: the host holds the non-expert
    # tensors (a copy where experts stream, the map's pages where all are resident)
    reads_map = True
    threads: Optional[int] = None  # compute threads where the backend sets them (cpu)
    cpu_target: Optional[dict] = None  # where kernels are compiled for a CPU: its model and instruction sets (cpu)
    reference = False  # the plain twin every other backend is checked against (numpy)
    # for a routing predictor beside a device backend (model.Model.set_predict): whether the
    # host's work overlaps this backend's compute, and whether the host may read a pool's slots
    overlaps_host = False
    host_reads_slots = True
    # one forward may run the rows of several sequences, each over its own cache (`forward_batch`:
    # serve's parallel slots)
    batches_sequences = False
    # its attention takes a quantized KV cache's blocks as stored (cache.KVRows) rather than
    # float32 rows decoded from them (cache.KVCache.write's `blocks`)
    reads_kv_blocks = False
    kv_types: KVTypes = F32_KV  # what its KV caches store keys and values as (set by the loader after `open`)

    @classmethod
    def memory_policy(cls, gguf, repack_from: Optional[int] = None) -> MemoryPolicy:
        """How this backend would hold file `gguf` (`repack_from`: files of at least this many
        bytes take the backend's own layouts, where it has any; None: its default)."""
        return MemoryPolicy(cls, gguf)

    @classmethod
    def find_device(cls, selector) -> None:
        """Check that the device `selector` names exists here (BackendUnavailableError if not):
        nothing to find for a host backend."""

    @classmethod
    def open_device(cls, selector):
        """The device it computes on (None: the host)."""
        return None

    @classmethod
    def device_limits(cls, selector) -> dict:
        """memory.budget.detect_budget's device arguments (heap, largest allocation and binding)."""
        return {}

    @classmethod
    def slot_allocator(cls, device):
        """`allocate(shape)` for an expert pool's slots (memory/pool.py), or None: host memory."""
        return None

    @classmethod
    def open(cls, gguf, experts=None, device=None, slot_arrays=None, policy: Optional[MemoryPolicy] = None,
             threads: Optional[int] = None) -> "Backend":
        """The backend over `gguf` with its expert source (`experts`: a pool, or None for the
        file); `policy` as `memory_policy` gave it, `threads` where the backend sets them."""
        return cls(gguf, experts)

    def repack(self, experts: bool = True) -> None:
        """Make the tensors it holds in layouts of its own now, at load (the file's routed experts
        too when `experts`): none here."""

    def close(self) -> None:
        """Free what it allocated (not the expert source: its owner closes that)."""
