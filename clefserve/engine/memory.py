"""Sizing the KV and GDN pools from the deployment flags and the memory left after loading the weights.

KV pool bytes = ``--kv-cache-mb`` MiB when given, else ``--kv-fraction`` x the memory left (GPU: free device
memory; CPU: MemAvailable). The GDN pool has one slot per ``--max-num-seqs`` and is sized on top of it.
The prefix cache (GDN snapshots and hidden rows, outside the KV pool) gets ``--prefix-cache-mb``, at most
half of what the pools leave free, so that activations keep room.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from clefserve.config import EngineConfig
from clefserve.model.config import BackboneConfig

log = logging.getLogger(__name__)

MIB = 1 << 20


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


def available_memory(device: torch.device) -> int:
    """Bytes still free for pools on ``device``: free CUDA memory, or MemAvailable on a CPU host."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    meminfo = Path("/proc/meminfo")
    if meminfo.is_file():
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("cannot tell the free memory (no MemAvailable in /proc/meminfo); use --kv-cache-mb")


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
    memory_budget_bytes: int | None = None,
) -> PoolPlan:
    """``memory_budget_bytes`` stands in for the measured free memory (tests, tools)."""
    if config.block_size < 1 or config.max_num_seqs < 1:
        raise ValueError("--block-size and --max-num-seqs must be at least 1")
    block_bytes = kv_bytes_per_block(model, config.block_size, dtype)
    free = memory_budget_bytes if memory_budget_bytes is not None else available_memory(device)
    if config.kv_cache_mb is not None:
        budget = int(config.kv_cache_mb) * MIB
        source = f"--kv-cache-mb {config.kv_cache_mb}"
    else:
        budget = int(config.kv_fraction * free)
        source = f"--kv-fraction {config.kv_fraction} of {free / MIB:.0f} MiB free"
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
    log.info("%s [%s]", plan.describe(), source)
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
