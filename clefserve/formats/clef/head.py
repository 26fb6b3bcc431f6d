"""The Clef JointSchemaHead (clef-format.md §5), vectorised over the questions and options of a batch.

Parameter names and shapes equal the release's ``joint_head.safetensors``. Records of different lengths
are right-padded; every attention masks the padded keys, so a record's logits do not depend on the batch.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pad_sequence

from clefserve.errors import ReleaseError
from clefserve.formats.clef.records import EncodedRecord
from clefserve.model.layers import Embedding
from clefserve.model.weights import read_tensors

HEAD_CONFIG_KEYS = ("hidden_size", "width", "routing_layers", "layers", "heads", "feedforward")
MAX_LOG_SCALE = math.log(100.0)


class Attention(nn.Module):
    """Multi-head attention laid out like ``torch.nn.MultiheadAttention`` (q, k, v rows in ``in_proj``)."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.in_proj_weight = nn.Parameter(torch.empty(3 * width, width))
        self.in_proj_bias = nn.Parameter(torch.empty(3 * width))
        self.out_proj = nn.Linear(width, width)

    def forward(
        self, query: torch.Tensor, memory: torch.Tensor, key_mask: torch.Tensor | None
    ) -> torch.Tensor:
        """``query [B, L, W]`` attends to ``memory [B, S, W]``; ``key_mask [B, S]`` is True on real keys."""
        width = query.shape[-1]
        w_q, w_kv = self.in_proj_weight.split([width, 2 * width])
        b_q, b_kv = self.in_proj_bias.split([width, 2 * width])
        q = self._split_heads(F.linear(query, w_q, b_q))
        k, v = (self._split_heads(t) for t in F.linear(memory, w_kv, b_kv).chunk(2, dim=-1))
        mask = None if key_mask is None else key_mask[:, None, None, :]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out_proj(out.transpose(1, 2).flatten(2))

    def _split_heads(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        return x.view(batch, length, self.heads, width // self.heads).transpose(1, 2)


def _mlp(inputs: int, hidden: int, outputs: int) -> nn.Sequential:
    # Identity stands where the release has Dropout, so the Linear layers keep the indices 0 and 3.
    return nn.Sequential(nn.Linear(inputs, hidden), nn.GELU(), nn.Identity(), nn.Linear(hidden, outputs))


class EvidenceRoutingLayer(nn.Module):
    """Option queries read the sequence (no attention between options); the memory is re-normalised."""

    def __init__(self, width: int, heads: int, feedforward: int) -> None:
        super().__init__()
        self.query_norm = nn.LayerNorm(width)
        self.memory_norm = nn.LayerNorm(width)
        self.attention = Attention(width, heads)
        self.feedforward_norm = nn.LayerNorm(width)
        self.feedforward = _mlp(width, feedforward, width)

    def forward(
        self, queries: torch.Tensor, memory: torch.Tensor, memory_mask: torch.Tensor | None
    ) -> torch.Tensor:
        queries = queries + self.attention(self.query_norm(queries), self.memory_norm(memory), memory_mask)
        return queries + self.feedforward(self.feedforward_norm(queries))


class FieldDecoderLayer(nn.Module):
    """A pre-norm ``torch.nn.TransformerDecoderLayer`` (GELU) with the same parameter names."""

    def __init__(self, width: int, heads: int, feedforward: int) -> None:
        super().__init__()
        self.self_attn = Attention(width, heads)
        self.multihead_attn = Attention(width, heads)
        self.linear1 = nn.Linear(width, feedforward)
        self.linear2 = nn.Linear(feedforward, width)
        self.norm1 = nn.LayerNorm(width)
        self.norm2 = nn.LayerNorm(width)
        self.norm3 = nn.LayerNorm(width)

    def forward(
        self,
        fields: torch.Tensor,
        field_mask: torch.Tensor | None,
        memory: torch.Tensor,
        memory_mask: torch.Tensor | None,
    ) -> torch.Tensor:
        normed = self.norm1(fields)
        fields = fields + self.self_attn(normed, normed, field_mask)
        fields = fields + self.multihead_attn(self.norm2(fields), memory, memory_mask)
        return fields + self.linear2(F.gelu(self.linear1(self.norm3(fields))))


@dataclass
class _Layout:
    """Index tensors of one batch: where every question and option lives, flat and padded."""

    lengths: list[int]  # real length of each record
    questions_per_record: list[int]
    options_per_record: list[int]
    options_per_question: list[int]
    last_rows: torch.Tensor  # [B] flat row of each record's final token
    question_rows: torch.Tensor  # flat rows of every question span, concatenated
    question_offsets: torch.Tensor  # [Q] start of each question's rows in question_rows
    option_rows: torch.Tensor
    option_offsets: torch.Tensor  # [O]
    option_tokens: torch.Tensor  # token ids at option_rows
    question_types: torch.Tensor  # [Q]
    question_record: torch.Tensor  # [Q] record of each question
    question_slot: torch.Tensor  # [Q] index of the question within its record
    option_question: torch.Tensor  # [O] flat question of each option
    option_record: torch.Tensor  # [O]
    option_slot: torch.Tensor  # [O] index of the option within its record
    option_rank: torch.Tensor  # [O] index of the option within its question

    @classmethod
    def build(cls, records: list[EncodedRecord], lengths: list[int], device: torch.device) -> _Layout:
        for index, (record, length) in enumerate(zip(records, lengths, strict=True)):
            if length != len(record.input_ids):
                raise ValueError(f"record {index}: {length} hidden rows for {len(record.input_ids)} tokens")

        def tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=device)

        bases = _exclusive_cumsum(tensor(lengths))
        questions = [q for r in records for q in r.questions]
        per_record = tensor([len(r.questions) for r in records])
        per_question = tensor([len(q.option_spans) for q in questions])
        question_record = _repeat_arange(per_record)
        option_question = _repeat_arange(per_question)
        option_record = question_record[option_question]
        question_spans = tensor([list(q.question_span) for q in questions])
        question_spans += bases[question_record].unsqueeze(1)
        option_spans = tensor([list(s) for q in questions for s in q.option_spans])
        option_spans += bases[option_record].unsqueeze(1)
        question_rows, question_offsets = _span_rows(question_spans)
        option_rows, option_offsets = _span_rows(option_spans)
        input_ids = tensor([t for r in records for t in r.input_ids])
        options_per_record = torch.zeros_like(per_record).index_add_(0, question_record, per_question)
        return cls(
            lengths=list(lengths),
            questions_per_record=per_record.tolist(),
            options_per_record=options_per_record.tolist(),
            options_per_question=per_question.tolist(),
            last_rows=bases + tensor(lengths) - 1,
            question_rows=question_rows,
            question_offsets=question_offsets,
            option_rows=option_rows,
            option_offsets=option_offsets,
            option_tokens=input_ids[option_rows],
            question_types=tensor([q.type_index for q in questions]),
            question_record=question_record,
            question_slot=_rank_in_group(per_record),
            option_question=option_question,
            option_record=option_record,
            option_slot=_rank_in_group(options_per_record),
            option_rank=_rank_in_group(per_question),
        )


def _exclusive_cumsum(counts: torch.Tensor) -> torch.Tensor:
    return counts.cumsum(0) - counts


def _repeat_arange(counts: torch.Tensor) -> torch.Tensor:
    """Group index of each member: counts [2, 3] -> [0, 0, 1, 1, 1]."""
    return torch.repeat_interleave(torch.arange(len(counts), device=counts.device), counts)


def _rank_in_group(counts: torch.Tensor) -> torch.Tensor:
    """Index of each member within its group: counts [2, 3] -> [0, 1, 0, 1, 2]."""
    members = torch.arange(int(counts.sum()), device=counts.device)
    return members - torch.repeat_interleave(_exclusive_cumsum(counts), counts)


def _span_rows(spans: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Half-open spans [S, 2] -> (every row of every span concatenated, start of each span in it)."""
    lengths = spans[:, 1] - spans[:, 0]
    if bool((lengths <= 0).any()):
        raise ValueError("the head cannot average an empty span")
    rows = torch.repeat_interleave(spans[:, 0], lengths) + _rank_in_group(lengths)
    return rows, _exclusive_cumsum(lengths)


def _key_mask(counts: list[int], device: torch.device) -> torch.Tensor | None:
    """[B, max(counts)] True on real entries; None when nothing is padded."""
    if len(set(counts)) <= 1:
        return None
    return torch.arange(max(counts), device=device)[None, :] < torch.tensor(counts, device=device)[:, None]


def _span_means(values: torch.Tensor, rows: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` over each span: one gather-and-average (``embedding_bag``) for all spans."""
    return F.embedding_bag(rows, values, offsets, mode="mean")


def _pad(flat: torch.Tensor, group: torch.Tensor, slot: torch.Tensor, groups: int, size: int) -> torch.Tensor:
    out = flat.new_zeros(groups, size, *flat.shape[1:])
    out[group, slot] = flat
    return out


class JointSchemaHead(nn.Module):
    def __init__(
        self, hidden_size: int, width: int, routing_layers: int, layers: int, heads: int, feedforward: int
    ) -> None:
        super().__init__()
        self.config = {
            "hidden_size": hidden_size, "width": width, "routing_layers": routing_layers,
            "layers": layers, "heads": heads, "feedforward": feedforward,
        }
        self.hidden_norm = nn.LayerNorm(hidden_size)
        self.memory_projection = nn.Linear(hidden_size, width, bias=False)
        self.question_projection = nn.Linear(hidden_size, width, bias=False)
        self.option_question_projection = nn.Linear(hidden_size, width, bias=False)
        self.global_projection = nn.Linear(hidden_size, width, bias=False)
        self.option_context_projection = nn.Linear(hidden_size, width, bias=False)
        self.option_lexical_projection = nn.Linear(hidden_size, width, bias=False)
        self.type_embedding = Embedding(3, width)
        self.evidence_layers = nn.ModuleList(
            EvidenceRoutingLayer(width, heads, feedforward) for _ in range(routing_layers)
        )
        self.option_summary_norm = nn.LayerNorm(width)
        self.layers = nn.ModuleList(FieldDecoderLayer(width, heads, feedforward) for _ in range(layers))
        self.field_norm = nn.LayerNorm(width)
        self.option_norm = nn.LayerNorm(width)
        self.residual_scorer = _mlp(4 * width, width, 1)
        self.prior_logit_scale = nn.Parameter(torch.zeros(()))
        self.joint_logit_scale = nn.Parameter(torch.zeros(()))
        self.residual_gate = nn.Parameter(torch.zeros(()))

    def forward(
        self, hiddens: list[torch.Tensor], records: list[EncodedRecord], lm_head_weight: torch.Tensor
    ) -> list[list[torch.Tensor]]:
        """Per record, per question: the option logits in option order.

        ``hiddens[i]`` is the final-norm hidden state ``[T_i, H]`` of every token of ``records[i]``;
        ``lm_head_weight`` is the backbone's untied output matrix ``[V, H]``.
        """
        dtype, device = self.hidden_norm.weight.dtype, self.hidden_norm.weight.device
        lengths = [int(h.shape[0]) for h in hiddens]
        lay = _Layout.build(records, lengths, device)
        batch = len(records)

        x = self.hidden_norm(torch.cat(hiddens).to(device=device, dtype=dtype))  # [N, H]
        question_vectors = _span_means(x, lay.question_rows, lay.question_offsets)  # [Q, H]
        option_contexts = _span_means(x, lay.option_rows, lay.option_offsets)  # [O, H]
        lexical = F.embedding_bag(
            lay.option_tokens, lm_head_weight.to(device), lay.option_offsets, mode="mean"
        ).to(dtype)  # [O, H]
        global_vectors = x[lay.last_rows]  # [B, H]

        memory = pad_sequence(self.memory_projection(x).split(lengths), batch_first=True)  # [B, T, W]
        memory_mask = _key_mask(lengths, device)

        queries = (
            self.option_context_projection(option_contexts)
            + self.option_lexical_projection(lexical)
            + self.option_question_projection(question_vectors)[lay.option_question]
        )  # [O, W]
        padded = _pad(queries, lay.option_record, lay.option_slot, batch, max(lay.options_per_record))
        for layer in self.evidence_layers:
            padded = layer(padded, memory, memory_mask)
        routed = padded[lay.option_record, lay.option_slot]  # [O, W]

        # Attention-weighted summary of each question's routed options (a softmax within each question).
        base_fields = self.question_projection(question_vectors)  # [Q, W]
        affinity = (routed * base_fields[lay.option_question]).sum(-1) / math.sqrt(routed.shape[-1])
        grid = affinity.new_full((len(lay.options_per_question), max(lay.options_per_question)), -math.inf)
        grid[lay.option_question, lay.option_rank] = affinity
        weights = grid.softmax(-1)[lay.option_question, lay.option_rank]
        summaries = torch.zeros_like(base_fields)
        summaries.index_add_(0, lay.option_question, weights[:, None] * routed)

        fields = (
            base_fields
            + self.option_summary_norm(summaries)
            + self.global_projection(global_vectors)[lay.question_record]
            + self.type_embedding(lay.question_types)
        )
        padded = _pad(fields, lay.question_record, lay.question_slot, batch, max(lay.questions_per_record))
        field_mask = _key_mask(lay.questions_per_record, device)
        for layer in self.layers:
            padded = layer(padded, field_mask, memory, memory_mask)
        fields = self.field_norm(padded[lay.question_record, lay.question_slot])  # [Q, W]

        anchors = F.normalize(question_vectors + global_vectors[lay.question_record], dim=-1)
        prior_scale = self.prior_logit_scale.clamp(max=MAX_LOG_SCALE).exp()
        prior = prior_scale * (F.normalize(lexical, dim=-1) * anchors[lay.option_question]).sum(-1)

        options = self.option_norm(routed)
        option_fields = fields[lay.option_question]
        cosine = F.cosine_similarity(option_fields, options, dim=-1)
        features = torch.cat(
            [option_fields, options, option_fields * options, (option_fields - options).abs()], dim=-1
        )
        residual = self.residual_scorer(features).squeeze(-1)
        joint_scale = self.joint_logit_scale.clamp(max=MAX_LOG_SCALE).exp()
        logits = prior + torch.sigmoid(self.residual_gate) * (joint_scale * cosine + residual)  # [O]

        per_question = list(logits.split(lay.options_per_question))
        out, start = [], 0
        for count in lay.questions_per_record:
            out.append(per_question[start : start + count])
            start += count
        return out


# The most padding a batched head call may add, as a share of its records' tokens.
PADDING_WASTE = 0.25


def padding_groups(lengths: list[int], waste: float = PADDING_WASTE) -> list[list[int]]:
    """Indices of ``lengths`` in groups of similar length, longest first: a group padded to its longest
    record holds at most ``1 + waste`` times its records' tokens."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    total = 0
    for i in order:
        if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= (1 + waste) * (total + lengths[i]):
            groups[-1].append(i)
            total += lengths[i]
        else:
            groups.append([i])
            total = lengths[i]
    return groups


def read_head_config(folder: str | Path) -> dict[str, int]:
    path = Path(folder) / "joint_head_config.json"
    if not path.is_file():
        raise ReleaseError(f"{Path(folder)}: no joint_head_config.json")
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ReleaseError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(raw, dict):
        raise ReleaseError(f"{path}: must be a JSON object")
    # ``dropout`` is a constructor argument of the reference head that does nothing at inference.
    unknown = sorted(set(raw) - set(HEAD_CONFIG_KEYS) - {"dropout"})
    if unknown:
        raise ReleaseError(f"{path}: unknown key(s) {', '.join(map(repr, unknown))}")
    config = {}
    for key in HEAD_CONFIG_KEYS:
        value = raw.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ReleaseError(f"{path}: {key!r} must be a positive integer, got {value!r}")
        config[key] = value
    if config["width"] % config["heads"]:
        raise ReleaseError(f"{path}: width {config['width']} is not divisible by heads {config['heads']}")
    return config


def load_head(
    folder: str | Path,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    hidden_size: int | None = None,
) -> JointSchemaHead:
    """Load ``joint_head.safetensors`` strictly; ``hidden_size`` is the backbone's, checked when given."""
    folder = Path(folder)
    config = read_head_config(folder)
    if hidden_size is not None and config["hidden_size"] != hidden_size:
        raise ReleaseError(
            f"joint_head_config.json hidden size {config['hidden_size']} does not match the backbone's "
            f"hidden size {hidden_size}"
        )
    path = folder / "joint_head.safetensors"
    if not path.is_file():
        raise ReleaseError(f"{folder}: no joint_head.safetensors")
    with torch.device("meta"):
        head = JointSchemaHead(**config)
    expected = {name: tuple(p.shape) for name, p in head.named_parameters()}
    state: dict[str, torch.Tensor] = {}
    for key, tensor in read_tensors(path, lambda key: True):
        if key not in expected:
            raise ReleaseError(f"unexpected tensor {key!r} {tuple(tensor.shape)} in {path.name}")
        if tuple(tensor.shape) != expected[key]:
            raise ReleaseError(
                f"tensor {key!r} in {path.name} has shape {tuple(tensor.shape)}, expected {expected[key]}"
            )
        state[key] = tensor.to(device=device, dtype=dtype)
    missing = [name for name in expected if name not in state]
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise ReleaseError(f"missing tensor {missing[0]!r}{more} in {path.name}")
    head.load_state_dict(state, strict=True, assign=True)
    head.requires_grad_(False)
    return head.eval()


def random_head_tensors(head_config: dict, seed: int) -> dict[str, torch.Tensor]:
    """Random head weights for test releases, scaled so the prior, cosine and residual terms all matter."""
    gen = torch.Generator().manual_seed(seed)
    config = {key: head_config[key] for key in HEAD_CONFIG_KEYS}
    with torch.device("meta"):
        skeleton = JointSchemaHead(**config)
    norms = {
        f"{name}.{p}" for name, module in skeleton.named_modules()
        if isinstance(module, nn.LayerNorm) for p in ("weight", "bias")
    }

    def normal(shape: tuple[int, ...], std: float, mean: float = 0.0) -> torch.Tensor:
        return torch.randn(shape, generator=gen) * std + mean

    scalars = {"prior_logit_scale": 0.5, "joint_logit_scale": 1.0, "residual_gate": 0.5}
    out = {}
    for name, param in skeleton.named_parameters():
        shape = tuple(param.shape)
        if name in scalars:
            out[name] = torch.tensor(scalars[name]) + normal((), 0.1)
        elif name in norms:
            out[name] = normal(shape, 0.1, 1.0 if name.endswith("weight") else 0.0)
        elif name == "type_embedding.weight":
            out[name] = normal(shape, 0.5)
        elif name == "option_lexical_projection.weight":
            # lm_head rows of test releases have norm ~1 (std 1/sqrt(H)); std 1 gives this term unit scale.
            out[name] = normal(shape, 1.0)
        elif name.endswith("bias"):
            out[name] = normal(shape, 0.1)
        else:
            out[name] = normal(shape, 1.0 / math.sqrt(shape[-1]))
    return out
