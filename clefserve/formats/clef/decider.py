"""A whole Clef release in one object: encode requests, run the backbone and the head, answer."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from clefserve.confidence import CONFIDENCE_MODES
from clefserve.formats.clef.answers import build_response
from clefserve.formats.clef.encoder import DEFAULT_MAX_LENGTH, ClefEncoder
from clefserve.formats.clef.head import load_head
from clefserve.formats.clef.records import EncodedRecord
from clefserve.model.weights import load_backbone


class ClefDecider:
    def __init__(
        self,
        folder: str | Path,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        max_length: int = DEFAULT_MAX_LENGTH,
        *,
        confidence: str = "clef",
        question_ids: str = "prompt",
    ) -> None:
        """``confidence`` and ``question_ids``: the ``--confidence`` and ``--question-ids`` semantics
        (README "Semantics"); the defaults answer exactly as Cloudflare's reference."""
        if confidence not in CONFIDENCE_MODES:
            raise ValueError(f"confidence must be one of {CONFIDENCE_MODES}, not {confidence!r}")
        self.folder = Path(folder)
        self.confidence = confidence
        self.backbone = load_backbone(self.folder, dtype, device)
        self.head = load_head(self.folder, dtype, device, hidden_size=self.backbone.config.hidden_size)
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
        logits = self.logits(hiddens, records)
        return [
            self.answer(request, record, record_logits, raw)
            for request, record, record_logits in zip(requests, records, logits, strict=True)
        ]
