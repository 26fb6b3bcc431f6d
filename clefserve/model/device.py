"""What the serving device can do: name, CUDA compute capability, bf16, memory.

Read once at startup; the kernel selection (:mod:`clefserve.model.ops.select`), the dtype check and the
memory planner take a :class:`DeviceFacts`, so tests can hand them any device (a V100, an H100) on a CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from clefserve.errors import StartupError
from clefserve.model.host_memory import host_available

DTYPE_NAMES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}


@dataclass(frozen=True)
class DeviceFacts:
    type: str  # "cpu" or "cuda"
    name: str
    capability: tuple[int, int] | None = None  # CUDA compute capability, (7, 0) for a V100
    total_bytes: int | None = None

    @property
    def is_cuda(self) -> bool:
        return self.type == "cuda"

    @property
    def sm(self) -> str:
        return f"sm{self.capability[0]}{self.capability[1]}" if self.capability else "no sm"

    @property
    def bf16(self) -> bool:
        """bf16 arithmetic in hardware: every CPU torch runs, CUDA from Ampere (sm80) on."""
        return not self.is_cuda or (self.capability is not None and self.capability >= (8, 0))

    def describe(self) -> str:
        if not self.is_cuda:
            return "cpu"
        memory = f", {self.total_bytes / (1 << 30):.1f} GiB" if self.total_bytes else ""
        return f"{self.name} ({self.sm}{memory})"


def device_facts(device: torch.device) -> DeviceFacts:
    if device.type != "cuda":
        return DeviceFacts(type=device.type, name=device.type)
    if not torch.cuda.is_available():
        raise StartupError(f"--d {device.index}: no CUDA device is available to this torch "
                           f"(torch {torch.__version__}, CUDA build {torch.version.cuda or 'none'})")
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index >= torch.cuda.device_count():
        raise StartupError(f"--d {index}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    props = torch.cuda.get_device_properties(index)
    return DeviceFacts(type="cuda", name=props.name, capability=(props.major, props.minor),
                       total_bytes=int(props.total_memory))


def available_memory(device: torch.device) -> int:
    """Bytes still free on ``device``: free CUDA memory, or on a CPU host MemAvailable capped by the
    process's memory cgroup limits (:mod:`clefserve.model.host_memory`)."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    available = host_available()
    if available is None:
        raise RuntimeError("cannot tell the free memory (no MemAvailable in /proc/meminfo); "
                           "use --kv-cache-mb")
    return available


def check_dtype(facts: DeviceFacts, dtype: torch.dtype) -> None:
    """Refuse a dtype the device cannot compute in (bf16 before Ampere: a V100 is sm70)."""
    if dtype == torch.bfloat16 and not facts.bf16:
        raise StartupError(
            f"--dtype bf16: {facts.describe()} has no bf16 arithmetic (CUDA GPUs have it from sm80, "
            "Ampere, on); use --dtype f16 (gates, norms and the recurrent state stay fp32) or --dtype f32"
        )
