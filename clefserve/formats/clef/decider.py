"""A whole Clef release in one object: encode requests, run the backbone and the head, answer."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from clefserve.confidence import CONFIDENCE_MODES
from clefserve.errors import NonFiniteError, RequestError, all_finite
from clefserve.formats.clef.answers import build_response
from clefserve.formats.clef.encoder import DEFAULT_MAX_LENGTH, ClefEncoder
from clefserve.formats.clef.head import load_head, padding_groups
from clefserve.formats.clef.records import EncodedRecord
from clefserve.model.backbone import Backbone
from clefserve.model.device import DeviceFacts, check_dtype, device_facts
from clefserve.model.inputs import SequenceInputs
from clefserve.model.ops import gemm
from clefserve.model.ops.select import OpShapes, select_ops
from clefserve.model.weights import load_backbone
from clefserve.vision.inputs import ImageLimits
from clefserve.vision.release import ReleaseImages


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
        image_limits: ImageLimits | None = None,
        image_cache_bytes: int = 256 << 20,
    ) -> None:
        """``kernels``: ``auto``/``fast`` picks the fastest ops for the device, ``reference`` the plain
        torch ops (:mod:`clefserve.model.ops.select`). ``confidence`` and ``question_ids``: the
        ``--confidence`` and ``--question-ids`` semantics (README "Semantics"); the defaults answer exactly as
        Cloudflare's reference. ``image_limits``, ``image_cache_bytes``: requests with images, for a release
        with a vision tower."""
        facts = device_facts(torch.device(device))
        check_dtype(facts, dtype)  # before loading: a V100 refuses bf16 at once
        backbone = load_backbone(Path(folder), dtype, device)
        self._assemble(folder, backbone, max_length, kernels, confidence, question_ids, facts)
        # like the head, the vision tower computes in fp32 where low-precision GEMMs are slow
        self.images, self.images_refused = ReleaseImages.load(
            self.folder, self.encoder.vision_token_ids(), gemm.compute_dtype(backbone.device, dtype), device,
            image_limits, image_cache_bytes,
        )

    @property
    def takes_images(self) -> bool:
        return self.images is not None

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
        self.images, self.images_refused = None, "this decider was built without the release's vision tower"

    def encode(self, request: dict[str, Any]) -> EncodedRecord:
        """Ids and spans of a request; its pictures decoded and preprocessed (slow: not on the event loop)."""
        prepared = None
        if request.get("images"):
            if self.images is None:
                raise RequestError(f"images: {self.images_refused}", error_type="unsupported")
            prepared = self.images.prepare(request["images"])
        return self.encoder.encode(request, prepared)

    def inputs(self, record: EncodedRecord, fresh: bool = False, start: int = 0) -> SequenceInputs | None:
        """What the backbone needs beyond the ids: the vision tower's rows for the pictures (from the
        encoder cache when seen recently, unless ``fresh``) and the M-RoPE positions; None for a text
        record. ``start``: the first position that will run; pictures wholly before it are not encoded."""
        if not record.images:
            return None
        assert self.images is not None
        pictures = zip(record.images, record.prepared_images, strict=True)
        needed = [(image, prepared) for image, prepared in pictures if image.span.end > start]
        rows = self.images.embed([prepared for _, prepared in needed], use_cache=not fresh)
        embeds = tuple((image.span.start, r) for (image, _), r in zip(needed, rows, strict=True))
        return SequenceInputs(embeds=embeds, positions=record.positions())

    @torch.inference_mode()
    def logits(self, hiddens: list[torch.Tensor], records: list[EncodedRecord]) -> list[list[torch.Tensor]]:
        """The head over a batch of records, given each record's final-norm hidden rows. Records of
        similar length share one head call; a short record is not padded to a long one's length (the
        head attends over every token of its record, so padding would cost as much as the tokens)."""
        out: list[list[torch.Tensor]] = [[] for _ in records]
        for group in padding_groups([int(h.shape[0]) for h in hiddens]):
            answers = self.head([hiddens[i] for i in group], [records[i] for i in group],
                                self.backbone.lm_head.weight)
            for i, record_logits in zip(group, answers, strict=True):
                out[i] = record_logits
        return out

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
    def decide_batch(self, requests: list[dict[str, Any]], raw: bool = False,
                     fresh_images: bool = False) -> list[dict[str, Any]]:
        """Answer each request; the backbone runs record by record, the head once over the batch.

        ``raw`` adds unrounded ``x_probabilities`` to every answer; ``fresh_images`` encodes pictures
        without the encoder cache."""
        if not requests:
            return []
        records = [self.encode(request) for request in requests]
        hiddens = [
            self.backbone.run_sequence(torch.tensor(record.input_ids, dtype=torch.long),
                                       inputs=self.inputs(record, fresh_images))[0]
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
