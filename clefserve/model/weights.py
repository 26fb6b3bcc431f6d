"""Loading backbone weights from a release folder's safetensors (never pickles).

Accepts ``model.safetensors`` or a sharded ``model.safetensors.index.json``; text weights under
``model.language_model.`` (ConditionalGeneration) or ``model.`` (CausalLM); vision and MTP tensors are
skipped. Any missing, unexpected or mis-shaped tensor is one :class:`ReleaseError` that names it.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from clefserve.errors import ReleaseError, StartupError
from clefserve.model.backbone import Backbone
from clefserve.model.config import BackboneConfig
from clefserve.model.device import available_memory
from clefserve.model.layers import Linear
from clefserve.model.ops import Ops, gemm

log = logging.getLogger(__name__)

SKIPPED_PREFIXES = ("model.visual.", "visual.", "mtp.", "model.mtp.", "model.language_model.mtp.")
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
# Kept in fp32 whatever the weight dtype: cheap, and they feed fp32 math (norm scales, decay rates).
FP32_SUFFIXES = ("norm.weight", "A_log", "dt_bias")
PROGRESS_BYTES = 256 << 20
GIB = 1 << 30
MIB = 1 << 20


def checkpoint_name(config: BackboneConfig, param: str) -> str:
    return param if param.startswith("lm_head.") else config.weight_prefix + param


def expected_tensors(config: BackboneConfig) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Checkpoint name -> (our parameter name, shape), from the module definition itself."""
    with torch.device("meta"):
        skeleton = Backbone(config)
    out = {}
    for name, param in skeleton.named_parameters():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        out[checkpoint_name(config, name)] = (name, tuple(param.shape))
    return out


def expected_weight_bytes(config: BackboneConfig, dtype: torch.dtype) -> int:
    """Bytes the backbone's weights take once loaded in ``dtype`` (norms and decay rates stay fp32)."""
    total = 0
    for name, shape in expected_tensors(config).values():
        target = torch.float32 if name.endswith(FP32_SUFFIXES) else dtype
        total += math.prod(shape) * torch.empty((), dtype=target).element_size()
    return total


def weights_fit_error(weight_bytes: int, free_bytes: int, where: str, dtype: torch.dtype) -> str | None:
    """The startup message when the weights cannot fit the free device memory, else None."""
    if weight_bytes <= free_bytes:
        return None
    name = str(dtype).removeprefix("torch.")
    return (f"the release does not fit {where}: its weights take {weight_bytes / GIB:.2f} GiB in {name}, "
            f"{free_bytes / GIB:.2f} GiB of device memory is free; use a larger GPU or a smaller release")


def _check_weights_fit(config: BackboneConfig, dtype: torch.dtype, device: torch.device) -> None:
    if device.type != "cuda":
        return
    free, total = torch.cuda.mem_get_info(device)
    where = f"{device} ({torch.cuda.get_device_name(device)}, {total / GIB:.1f} GiB)"
    problem = weights_fit_error(expected_weight_bytes(config, dtype), free, where, dtype)
    if problem:
        raise StartupError(problem)


def weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ReleaseError(f"{index}: not a safetensors index with a weight_map ({exc})") from exc
        files = sorted({folder / name for name in weight_map.values()})
        for file in files:
            if file.suffix != ".safetensors":
                raise ReleaseError(f"{index} names {file.name}: only safetensors weight files are loaded")
            if not file.is_file():
                raise ReleaseError(f"{index} names {file.name}, which is missing from {folder}")
        return files
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    pickled = sorted(p.name for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickled:
        raise ReleaseError(
            f"{folder} holds {', '.join(pickled)}: only safetensors weights are loaded "
            "(pickled checkpoints can run code); convert them to model.safetensors"
        )
    raise ReleaseError(f"{folder}: no model.safetensors or model.safetensors.index.json")


def read_tensors(file: Path, wanted: Callable[[str], bool]) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of one safetensors file whose names ``wanted`` accepts; a file that is not safetensors
    is a :class:`ReleaseError` that names it."""
    try:
        handle = safe_open(str(file), framework="pt", device="cpu")
    except Exception as exc:  # safetensors raises its own error types
        raise ReleaseError(f"{file.name}: not a readable safetensors file ({exc})") from exc
    with handle:
        for key in handle.keys():  # noqa: SIM118 - safe_open has no __iter__
            if wanted(key):
                yield key, handle.get_tensor(key)


def _tensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    total = sum(f.stat().st_size for f in files)
    done, started = 0, time.monotonic()
    for i, file in enumerate(files, 1):
        yield from read_tensors(file, lambda key: not key.startswith(SKIPPED_PREFIXES))
        done += file.stat().st_size
        if total >= PROGRESS_BYTES:
            log.info(
                "loading weights: shard %d/%d, %.1f/%.1f GB, %.0f s",
                i,
                len(files),
                done / 1e9,
                total / 1e9,
                time.monotonic() - started,
            )


def load_backbone(
    folder: str | Path,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    ops: Ops | None = None,
    widen: bool | None = None,
) -> Backbone:
    """The backbone of a release folder in ``dtype`` on ``device``. ``widen``: hold the layers' projection
    weights in fp32 when they fit (None: where this machine computes ``dtype`` projections in fp32, see
    :mod:`clefserve.model.ops.gemm`)."""
    folder = Path(folder)
    device = torch.device(device)
    config = BackboneConfig.from_folder(folder)
    expected = expected_tensors(config)
    _check_weights_fit(config, dtype, device)
    state: dict[str, torch.Tensor] = {}
    mapped: dict[int, int] = {}  # data pointer -> bytes of the tensors that are still the files' memory
    for key, tensor in _tensors(weight_files(folder)):
        if key == "lm_head.weight" and config.tie_word_embeddings:
            continue  # tied: the embedding matrix is the output matrix
        if key not in expected:
            raise ReleaseError(f"unexpected tensor {key!r} {tuple(tensor.shape)} in the weights of {folder}")
        name, shape = expected[key]
        if tuple(tensor.shape) != shape:
            raise ReleaseError(f"tensor {key!r} has shape {tuple(tensor.shape)}, expected {shape}")
        target = torch.float32 if name.endswith(FP32_SUFFIXES) else dtype
        try:
            state[name] = tensor.to(device=device, dtype=target)
        except torch.OutOfMemoryError as exc:
            loaded = sum(t.numel() * t.element_size() for t in state.values())
            raise StartupError(
                f"the release does not fit {device}: out of memory at tensor {key!r} after "
                f"{loaded / GIB:.2f} GiB of {expected_weight_bytes(config, dtype) / GIB:.2f} GiB of weights"
            ) from exc
        if state[name].data_ptr() == tensor.data_ptr():
            mapped[tensor.data_ptr()] = tensor.numel() * tensor.element_size()
    missing = [key for key, (name, _) in expected.items() if name not in state]
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise ReleaseError(f"missing tensor {missing[0]!r}{more} in the weights of {folder}")
    if config.tie_word_embeddings:
        state["lm_head.weight"] = state["embed_tokens.weight"]
    with torch.device("meta"):
        model = Backbone(config, ops)
    model.load_state_dict(state, strict=True, assign=True)
    model.requires_grad_(False)
    if widen is None:
        widen = gemm.compute_dtype(device, dtype) != dtype
    if widen and device.type == "cpu" and dtype in gemm.LOW_PRECISION:
        _widen_projections(model)
    held = {p.data_ptr() for p in model.parameters()}
    model.file_mapped_bytes = sum(size for pointer, size in mapped.items() if pointer in held)
    return model.eval()


def _widen_projections(model: Backbone) -> None:
    """fp32 copies of the layers' projection weights (:func:`clefserve.model.ops.gemm.widen_weights`) when
    they take at most ``WIDEN_SHARE`` of the memory still free; else each call widens its weight."""
    projections = [m for m in model.layers.modules() if isinstance(m, Linear)]
    need, free = gemm.widened_bytes(projections), available_memory(model.device)
    if need > gemm.WIDEN_SHARE * free:
        log.info("projection weights stay %s: fp32 copies would take %.1f MiB of %.2f GiB free; each "
                 "projection widens its weight per call", model.dtype, need / MIB, free / GIB)
        return
    gemm.widen_weights(projections)
    log.info("projection weights held as fp32 copies for this CPU's fp32 arithmetic: %.1f MiB (%.2f GiB was "
             "free)", need / MIB, free / GIB)
