"""Sizing the KV and GDN pools from the deployment flags and the memory left after loading the weights.

KV pool bytes = ``--kv-cache-mb`` MiB when given, else ``--kv-fraction`` x the memory left. The GDN pool has
one slot per ``--max-num-seqs`` and is sized on top of it. The prefix cache (GDN snapshots and hidden rows,
outside the KV pool) gets ``--prefix-cache-mb``, at most half of what the pools leave free.

"The memory left" (:class:`MemoryBudget`, measured by :func:`measure_memory` once the weights are loaded):

- GPU: free device memory after the weights, less the activation peak of a warm-up forward of a full
  ``--prefill-chunk-size`` step (which also compiles the Triton kernels before the pools take the memory),
  less one layer's gathered K/V of a ``--max-length`` record, less the hidden rows the running decision
  sequences keep (``--max-num-seqs`` x ``--max-length`` x hidden);
- CPU: MemAvailable capped by the process's memory cgroup headroom (:mod:`clefserve.model.host_memory`),
  less the weights that are still the safetensors files' memory (file-mapped: they live in the page cache,
  which MemAvailable counts as free), less the same hidden rows.

A plan whose pools do not fit that memory, or a device that has no memory left for them, fails at startup
(:class:`~clefserve.errors.StartupError`, stating the sizes), never mid-request.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from clefserve.config import EngineConfig
from clefserve.errors import StartupError
from clefserve.model.config import BackboneConfig
from clefserve.model.device import available_memory

log = logging.getLogger(__name__)

MIB = 1 << 20
GIB = 1 << 30


def element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def kv_bytes_per_block(model: BackboneConfig, block_size: int, dtype: torch.dtype) -> int:
    """K and V of ``block_size`` tokens in every attention layer."""
    per_token = 2 * model.num_key_value_heads * model.head_dim * element_size(dtype)
    return block_size * len(model.full_layers) * per_token


def gdn_bytes_per_slot(model: BackboneConfig, dtype: torch.dtype) -> int:
    """Conv state (model dtype) + recurrent state (fp32) of every GDN layer, for one sequence."""
    conv = model.conv_dim * (model.linear_conv_kernel_dim - 1) * element_size(dtype)
    recurrent = model.linear_num_value_heads * model.linear_key_head_dim * model.linear_value_head_dim * 4
    return len(model.linear_layers) * (conv + recurrent)


@dataclass(frozen=True)
class MemoryBudget:
    """The memory the pools may take, and what was set aside before them (for the log and the errors)."""

    free_bytes: int  # free memory measured after loading the weights (device memory, or MemAvailable)
    where: str = "cpu"
    weight_bytes: int = 0  # the loaded weights (already out of free_bytes, except the file-mapped ones)
    file_mapped_bytes: int = 0  # CPU: weights that free_bytes still counts as free
    activation_bytes: int = 0  # GPU: warm-up peak of one step, plus one layer's gathered K/V
    hidden_bytes: int = 0  # hidden rows kept by the running decision sequences
    total_bytes: int | None = None

    @property
    def usable_bytes(self) -> int:
        return self.free_bytes - self.file_mapped_bytes - self.activation_bytes - self.hidden_bytes

    def describe(self) -> str:
        where = f"{self.where} ({self.total_bytes / GIB:.1f} GiB)" if self.total_bytes else self.where
        parts = [f"{where}: {self.free_bytes / GIB:.2f} GiB free after loading "
                 f"{self.weight_bytes / GIB:.2f} GiB of weights"]
        if self.file_mapped_bytes:
            parts.append(f"{self.file_mapped_bytes / GIB:.2f} GiB of them file-mapped (counted as used)")
        if self.activation_bytes:
            parts.append(f"activation peak {self.activation_bytes / GIB:.2f} GiB")
        if self.hidden_bytes:
            parts.append(f"hidden rows of running sequences {self.hidden_bytes / GIB:.2f} GiB")
        parts.append(f"{self.usable_bytes / GIB:.2f} GiB left for the pools")
        return ", ".join(parts)


def hidden_row_bytes(model: BackboneConfig, config: EngineConfig, dtype: torch.dtype) -> int:
    """The final hidden rows that ``--max-num-seqs`` decision records of ``--max-length`` tokens keep."""
    return config.max_num_seqs * config.max_length * model.hidden_size * element_size(dtype)


def measure_memory(model: torch.nn.Module, config: EngineConfig) -> MemoryBudget:
    """The memory left for the pools once ``model`` (a loaded Backbone) is in place; on a GPU this runs the
    warm-up forward (see the module docstring)."""
    mc, dtype, device = model.config, model.dtype, model.device
    hidden = hidden_row_bytes(mc, config, dtype)
    weights = model.weight_bytes
    if device.type == "cuda":
        activation = _cuda_activation_peak(model, config)
        free, total = torch.cuda.mem_get_info(device)
        history = 2 * config.max_length * mc.num_key_value_heads * mc.head_dim * element_size(dtype)
        where = f"{device} {torch.cuda.get_device_name(device)}"
        return MemoryBudget(int(free), where, weights, 0, activation + history, hidden, int(total))
    return MemoryBudget(available_memory(device), str(device), weights, model.file_mapped_bytes, 0, hidden)


def _cuda_activation_peak(model: torch.nn.Module, config: EngineConfig) -> int:
    """Peak bytes allocated beyond the weights by one ``--prefill-chunk-size`` step and a continuation of it
    (the attention path with history), through the model's own ops."""
    from clefserve.model.cache import SequenceState

    device = model.device
    tokens = max(1, min(config.prefill_chunk_size, config.max_length))
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    ids = torch.zeros(tokens, dtype=torch.long, device=device)
    try:
        with torch.inference_mode():
            state = SequenceState()
            model.run_sequence(ids, state)
            model.run_sequence(ids[: max(1, tokens // 2)], state)
            del state
        torch.cuda.synchronize(device)
    except torch.OutOfMemoryError as exc:
        raise StartupError(
            f"a warm-up step of {tokens} tokens does not fit {device} next to the weights "
            f"({model.weight_bytes / GIB:.2f} GiB): lower --prefill-chunk-size or use a larger GPU"
        ) from exc
    peak = torch.cuda.max_memory_allocated(device) - base
    torch.cuda.empty_cache()
    log.info("warm-up step of %d tokens on %s: activation peak %.2f GiB", tokens, device, peak / GIB)
    return int(peak)


@dataclass(frozen=True)
class PoolPlan:
    block_size: int
    num_blocks: int
    kv_block_bytes: int
    gdn_slots: int
    gdn_slot_bytes: int
    kv_budget_bytes: int
    prefix_cache_bytes: int = 0

    @property
    def kv_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def kv_bytes(self) -> int:
        return self.num_blocks * self.kv_block_bytes

    @property
    def gdn_bytes(self) -> int:
        return self.gdn_slots * self.gdn_slot_bytes

    def describe(self) -> str:
        return (
            f"KV pool: {self.num_blocks} blocks x {self.block_size} tokens = {self.kv_tokens} tokens, "
            f"{self.kv_bytes / MIB:.1f} MiB ({self.kv_block_bytes} B/block); "
            f"GDN state pool: {self.gdn_slots} slots, {self.gdn_bytes / MIB:.1f} MiB "
            f"({self.gdn_slot_bytes} B/slot)"
        )


def plan_pools(
    model: BackboneConfig,
    config: EngineConfig,
    dtype: torch.dtype,
    device: torch.device,
    memory_budget_bytes: int | MemoryBudget | None = None,
) -> PoolPlan:
    """``memory_budget_bytes``: the measured :class:`MemoryBudget` (the engine passes
    :func:`measure_memory`'s), one made up by a test (a fake device), or a plain number of bytes that stands
    in for the free memory when sizing (tests and tools that size pools exactly: no fit check)."""
    if config.block_size < 1 or config.max_num_seqs < 1:
        raise ValueError("--block-size and --max-num-seqs must be at least 1")
    block_bytes = kv_bytes_per_block(model, config.block_size, dtype)
    budget_info = memory_budget_bytes if isinstance(memory_budget_bytes, MemoryBudget) else None
    if budget_info is not None:
        free = budget_info.usable_bytes
        if free <= 0:
            raise StartupError(f"the release does not fit: {budget_info.describe()}; lower --max-num-seqs, "
                               "--max-length or --prefill-chunk-size, or use a larger device")
    elif memory_budget_bytes is not None:
        free = int(memory_budget_bytes)
    else:
        free = available_memory(device)
    if config.kv_cache_mb is not None:
        budget = int(config.kv_cache_mb) * MIB
        source = f"--kv-cache-mb {config.kv_cache_mb}"
    else:
        budget = int(config.kv_fraction * free)
        source = f"--kv-fraction {config.kv_fraction} of {free / MIB:.0f} MiB free"
        if budget_info is not None:
            source += " after the reserves"
    if block_bytes == 0:
        # no attention layers: blocks cost nothing, so give every running sequence max_length tokens
        num_blocks = config.max_num_seqs * -(-config.max_length // config.block_size)
    else:
        num_blocks = budget // block_bytes
    if num_blocks < 1:
        raise ValueError(
            f"KV budget of {budget} B ({source}) is smaller than one block of {block_bytes} B; "
            "raise --kv-fraction / --kv-cache-mb or lower --block-size"
        )
    slot_bytes = gdn_bytes_per_slot(model, dtype)
    left = free - num_blocks * block_bytes - config.max_num_seqs * slot_bytes
    if budget_info is not None and left < 0:
        raise StartupError(
            f"the pools do not fit: KV pool {num_blocks * block_bytes / GIB:.2f} GiB ({source}) + GDN state "
            f"pool {config.max_num_seqs * slot_bytes / GIB:.2f} GiB ({config.max_num_seqs} slots of "
            f"{slot_bytes / MIB:.1f} MiB) > {free / GIB:.2f} GiB; {budget_info.describe()}; lower "
            "--kv-fraction / --kv-cache-mb or --max-num-seqs")
    prefix_bytes = prefix_cache_budget(config, left)
    plan = PoolPlan(
        block_size=config.block_size,
        num_blocks=int(num_blocks),
        kv_block_bytes=block_bytes,
        gdn_slots=config.max_num_seqs,
        gdn_slot_bytes=slot_bytes,
        kv_budget_bytes=budget,
        prefix_cache_bytes=prefix_bytes,
    )
    log.info("%s [%s]%s", plan.describe(), source, f"; {budget_info.describe()}" if budget_info else "")
    if plan.kv_tokens < config.max_length:
        log.warning(
            "the KV pool holds %d tokens, fewer than --max-length %d: longer records will be refused",
            plan.kv_tokens, config.max_length,
        )
    return plan


def prefix_cache_budget(config: EngineConfig, left_bytes: int) -> int:
    """``--prefix-cache-mb`` in bytes, capped at half of ``left_bytes`` (what the pools leave free)."""
    if not config.prefix_cache:
        return 0
    wanted = round(config.prefix_cache_mb * MIB)
    cap = max(0, left_bytes // 2)
    if wanted > cap:
        log.warning("--prefix-cache-mb %s does not fit next to the pools: the prefix cache gets %.1f MiB, "
                    "half of the %.0f MiB they leave free", config.prefix_cache_mb, cap / MIB,
                    max(0, left_bytes) / MIB)
        return cap
    return wanted
