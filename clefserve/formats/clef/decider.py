"""A whole Clef release in one object: encode requests, run the backbone and the head, answer."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from clefserve.confidence import CONFIDENCE_MODES
from clefserve.errors import NonFiniteError, all_finite
from clefserve.formats.clef.answers import build_response
from clefserve.formats.clef.encoder import DEFAULT_MAX_LENGTH, ClefEncoder
from clefserve.formats.clef.head import load_head
from clefserve.formats.clef.records import EncodedRecord
from clefserve.model.backbone import Backbone
from clefserve.model.device import DeviceFacts, check_dtype, device_facts
from clefserve.model.ops import gemm
from clefserve.model.ops.select import OpShapes, select_ops
from clefserve.model.weights import load_backbone


class ClefDecider:
    def __init__(
        self,
        folder: str | Path,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        max_length: int = DEFAULT_MAX_LENGTH,
        kernels: str = "auto",
        *,
        confidence: str = "clef",
        question_ids: str = "prompt",
    ) -> None:
        """``kernels``: ``auto``/``fast`` picks the fastest ops for the device, ``reference`` the plain
        torch ops (:mod:`clefserve.model.ops.select`). ``confidence`` and ``question_ids``: the
        ``--confidence`` and ``--question-ids`` semantics (README "Semantics"); the defaults answer exactly as
        Cloudflare's reference."""
        facts = device_facts(torch.device(device))
        check_dtype(facts, dtype)  # before loading: a V100 refuses bf16 at once
        backbone = load_backbone(Path(folder), dtype, device)
        self._assemble(folder, backbone, max_length, kernels, confidence, question_ids, facts)

    @classmethod
    def with_backbone(cls, folder: str | Path, backbone: Backbone, max_length: int = DEFAULT_MAX_LENGTH,
                      kernels: str = "auto", *, confidence: str = "clef",
                      question_ids: str = "prompt") -> ClefDecider:
        """The release's head and encoder around a backbone built elsewhere (benchmarks build a 9B-shaped
        random backbone directly on the GPU instead of writing and reading 18 GB of safetensors)."""
        self = cls.__new__(cls)
        self._assemble(folder, backbone, max_length, kernels, confidence, question_ids, None)
        return self

    def _assemble(self, folder: str | Path, backbone: Backbone, max_length: int, kernels: str,
                  confidence: str, question_ids: str, facts: DeviceFacts | None) -> None:
        if confidence not in CONFIDENCE_MODES:
            raise ValueError(f"confidence must be one of {CONFIDENCE_MODES}, not {confidence!r}")
        self.folder, self.backbone, self.confidence = Path(folder), backbone, confidence
        dtype, device = backbone.dtype, backbone.device
        backbone.set_ops(select_ops(device, dtype, kernels, OpShapes.from_config(backbone.config), facts))
        # the head is small: where low-precision GEMMs are slow (see ops.gemm) it runs in fp32 outright
        head_dtype = gemm.compute_dtype(device, dtype)
        self.head = load_head(self.folder, head_dtype, device, hidden_size=backbone.config.hidden_size)
        self.encoder = ClefEncoder.from_folder(self.folder, max_length, question_ids)

    def encode(self, request: dict[str, Any]) -> EncodedRecord:
        return self.encoder.encode(request)

    @torch.inference_mode()
    def logits(self, hiddens: list[torch.Tensor], records: list[EncodedRecord]) -> list[list[torch.Tensor]]:
        """The head over a batch of records, given each record's final-norm hidden rows."""
        return self.head(hiddens, records, self.backbone.lm_head.weight)

    def answer(
        self,
        request: dict[str, Any],
        record: EncodedRecord,
        logits: Sequence[torch.Tensor],
        raw: bool = False,
        cached_tokens: int | None = None,
    ) -> dict[str, Any]:
        return build_response(request, record, logits, raw, cached_tokens, self.confidence)

    @torch.inference_mode()
    def decide_batch(self, requests: list[dict[str, Any]], raw: bool = False) -> list[dict[str, Any]]:
        """Answer each request; the backbone runs record by record, the head once over the batch.

        ``raw`` adds unrounded ``x_probabilities`` to every answer."""
        if not requests:
            return []
        records = [self.encode(request) for request in requests]
        hiddens = [
            self.backbone.run_sequence(torch.tensor(record.input_ids, dtype=torch.long))[0]
            for record in records
        ]
        if not all_finite(hiddens):
            raise NonFiniteError("the hidden states")
        logits = self.logits(hiddens, records)
        if not all(all_finite(list(record_logits)) for record_logits in logits):
            raise NonFiniteError("the decision head's logits")
        return [
            self.answer(request, record, record_logits, raw)
            for request, record, record_logits in zip(requests, records, logits, strict=True)
        ]
