"""Our vectorised JointSchemaHead against the reference head with the same weights and hidden states."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from clefserve.errors import ReleaseError, RequestError
from clefserve.formats.clef import ClefEncoder, EncodedRecord, JointSchemaHead, load_head, random_head_tensors
from clefserve.formats.clef.head import padding_groups
from clefserve.testing.release import ReleaseSpec
from tests.oracles import jsm
from tests.request_gen import RequestGenerator

CONFIGS = [
    {"hidden_size": 64, "width": 32, "routing_layers": 2, "layers": 2, "heads": 4, "feedforward": 64},
    {"hidden_size": 48, "width": 16, "routing_layers": 1, "layers": 3, "heads": 2, "feedforward": 40},
    {"hidden_size": 32, "width": 24, "routing_layers": 3, "layers": 1, "heads": 3, "feedforward": 24},
]


def reference_record(record: EncodedRecord):
    ref = jsm()
    return ref.EncodedRecord(
        input_ids=record.input_ids,
        questions=tuple(
            ref.EncodedQuestion(
                question_id=q.question_id,
                question_type=q.type_index,
                question_span=q.question_span,
                option_spans=q.option_spans,
                option_ids=q.option_ids,
            )
            for q in record.questions
        ),
        record_id="r",
    )


def reference_logits(ref_head, hiddens, records, lm_head_weight) -> list[list[torch.Tensor]]:
    """The reference head over one right-padded batch (pads hold junk: they must not matter)."""
    lengths = [h.shape[0] for h in hiddens]
    width = max(lengths)
    batch = torch.randn(len(hiddens), width, hiddens[0].shape[1]) * 3
    ids = torch.zeros(len(hiddens), width, dtype=torch.long)
    mask = torch.zeros(len(hiddens), width, dtype=torch.long)
    for i, (h, r) in enumerate(zip(hiddens, records, strict=True)):
        batch[i, : len(h)] = h
        ids[i, : len(h)] = torch.tensor(r.input_ids)
        mask[i, : len(h)] = 1
    with torch.inference_mode():
        return ref_head(batch, ids, mask, [reference_record(r) for r in records], lm_head_weight)


def make_heads(config: dict, seed: int):
    weights = random_head_tensors(config, seed)
    ours = JointSchemaHead(**config)
    ours.load_state_dict(weights, strict=True)
    ref = jsm().JointSchemaHead(**config)
    ref.load_state_dict(weights, strict=True)
    return ours.eval(), ref.eval()


@pytest.fixture(scope="module")
def encoder(make_release) -> ClefEncoder:
    return ClefEncoder.from_folder(make_release(seed=4), max_length=1500)


def random_batch(encoder: ClefEncoder, seed: int, count: int, hidden_size: int):
    gen = torch.Generator().manual_seed(seed)
    records = []
    for request in RequestGenerator(seed).requests(4 * count):
        try:
            records.append(encoder.encode(request))
        except RequestError:  # schema too long for this budget: take the next one
            continue
        if len(records) == count:
            break
    hiddens = [torch.randn(len(r.input_ids), hidden_size, generator=gen) * 2 + 0.3 for r in records]
    vocab = encoder.tokenizer.get_vocab_size()
    lm_head = torch.randn(vocab, hidden_size, generator=gen) / hidden_size**0.5
    return records, hiddens, lm_head


@pytest.mark.parametrize("config", CONFIGS, ids=["default", "2heads-1route-3layers", "3heads-3route-1layer"])
@pytest.mark.parametrize("seed", [0, 1])
def test_matches_reference_head(encoder, config: dict, seed: int) -> None:
    ours, ref = make_heads(config, seed)
    records, hiddens, lm_head = random_batch(encoder, seed + 17, 6, config["hidden_size"])
    assert len({len(r.input_ids) for r in records}) > 1 and len({len(r.questions) for r in records}) > 1
    with torch.inference_mode():
        got = ours(hiddens, records, lm_head)
    want = reference_logits(ref, hiddens, records, lm_head)
    assert len(got) == len(want)
    worst = 0.0
    for g_rec, w_rec, record in zip(got, want, records, strict=True):
        assert [len(q) for q in g_rec] == [len(q.option_ids) for q in record.questions]
        for g, w in zip(g_rec, w_rec, strict=True):
            assert g.dtype == torch.float32 and g.shape == w.shape
            worst = max(worst, float((g - w).abs().max()))
    assert worst <= 1e-5, worst


def test_batch_does_not_change_a_record(encoder) -> None:
    ours, _ = make_heads(CONFIGS[0], 3)
    records, hiddens, lm_head = random_batch(encoder, 5, 5, 64)
    with torch.inference_mode():
        batched = ours(hiddens, records, lm_head)
        for i in range(len(records)):
            alone = ours([hiddens[i]], [records[i]], lm_head)[0]
            for a, b in zip(alone, batched[i], strict=True):
                torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_every_path_contributes(encoder) -> None:
    """With the random test weights, removing any one path moves the logits visibly."""
    config = CONFIGS[0]
    weights = random_head_tensors(config, 7)
    records, hiddens, lm_head = random_batch(encoder, 8, 3, 64)

    def run(changes: dict[str, torch.Tensor]) -> torch.Tensor:
        head = JointSchemaHead(**config)
        head.load_state_dict({**weights, **changes}, strict=True)
        with torch.inference_mode():
            return torch.cat([q for rec in head(hiddens, records, lm_head) for q in rec])

    base = run({})
    zero = torch.zeros_like
    changes = {
        "lexical": {"option_lexical_projection.weight": zero(weights["option_lexical_projection.weight"])},
        "context": {"option_context_projection.weight": zero(weights["option_context_projection.weight"])},
        "question": {"option_question_projection.weight": zero(weights["option_question_projection.weight"])},
        "global": {"global_projection.weight": zero(weights["global_projection.weight"])},
        "type": {"type_embedding.weight": zero(weights["type_embedding.weight"])},
        "routing": {"evidence_layers.0.attention.out_proj.weight":
                    zero(weights["evidence_layers.0.attention.out_proj.weight"])},
        "decoder": {"layers.0.self_attn.out_proj.weight":
                    zero(weights["layers.0.self_attn.out_proj.weight"])},
        "memory": {"memory_projection.weight": zero(weights["memory_projection.weight"])},
        "prior": {"prior_logit_scale": torch.tensor(-30.0)},
        "cosine": {"joint_logit_scale": torch.tensor(-30.0)},
        "residual": {"residual_scorer.3.weight": zero(weights["residual_scorer.3.weight"])},
    }
    for name, change in changes.items():
        moved = float((run(change) - base).abs().max())
        assert moved > 1e-2, (name, moved)


def test_parameter_names_match_the_release_layout() -> None:
    config = CONFIGS[0]
    ours = {k: tuple(v.shape) for k, v in JointSchemaHead(**config).state_dict().items()}
    ref = {k: tuple(v.shape) for k, v in jsm().JointSchemaHead(**config).state_dict().items()}
    assert ours == ref
    # clef-flash's configuration: 122 tensors, about 121.8M parameters (clef-format.md §1; the reference
    # module counts 121,762,820, 1,024 more than the hand count written there).
    flash_config = {"hidden_size": 4096, "width": 1024, "routing_layers": 2, "layers": 4, "heads": 16,
                    "feedforward": 4096}
    with torch.device("meta"):
        flash = JointSchemaHead(**flash_config)
        ref_flash = jsm().JointSchemaHead(**flash_config)
    assert len(flash.state_dict()) == 122
    assert sum(p.numel() for p in flash.parameters()) == sum(p.numel() for p in ref_flash.parameters())
    assert sum(p.numel() for p in flash.parameters()) == 121_762_820


@pytest.fixture
def release_copy(make_release, tmp_path):
    source = make_release(ReleaseSpec(head={"hidden_size": 64, "width": 16, "routing_layers": 1, "layers": 1,
                                            "heads": 2, "feedforward": 32}), seed=21)
    folder = tmp_path / "release"
    shutil.copytree(source, folder)
    return folder


def test_load_head(release_copy) -> None:
    head = load_head(release_copy, torch.float32, "cpu", hidden_size=64)
    saved = load_file(str(release_copy / "joint_head.safetensors"))
    state = head.state_dict()
    assert set(state) == set(saved)
    for name, tensor in saved.items():
        assert torch.equal(state[name], tensor)
    assert not any(p.requires_grad for p in head.parameters())
    assert load_head(release_copy, torch.bfloat16).residual_gate.dtype == torch.bfloat16


def _rewrite(folder, change) -> None:
    path = folder / "joint_head.safetensors"
    tensors = load_file(str(path))
    change(tensors)
    save_file(tensors, str(path))


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        (lambda t: t.pop("layers.0.norm2.bias"), "missing tensor 'layers.0.norm2.bias'"),
        (lambda t: t.update(extra=torch.zeros(2)), "unexpected tensor 'extra'"),
        (lambda t: t.update({"type_embedding.weight": torch.zeros(4, 16)}), "'type_embedding.weight'"),
    ],
)
def test_load_head_refuses_bad_weights(release_copy, change, fragment: str) -> None:
    _rewrite(release_copy, change)
    with pytest.raises(ReleaseError, match=re.escape(fragment)):
        load_head(release_copy)


def test_load_head_refuses_bad_config(release_copy) -> None:
    with pytest.raises(ReleaseError, match="hidden size"):
        load_head(release_copy, hidden_size=128)
    config_path = release_copy / "joint_head_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "heads": 3}))
    with pytest.raises(ReleaseError, match="not divisible"):
        load_head(release_copy)
    config_path.write_text(json.dumps({**config, "colour": 1}))
    with pytest.raises(ReleaseError, match="unknown key"):
        load_head(release_copy)
    config_path.write_text(json.dumps({**config, "dropout": 0.1}))
    load_head(release_copy)
    config_path.unlink()
    with pytest.raises(ReleaseError, match=r"joint_head_config\.json"):
        load_head(release_copy)
    (release_copy / "joint_head.safetensors").unlink()
    config_path.write_text(json.dumps(config))
    with pytest.raises(ReleaseError, match=r"joint_head\.safetensors"):
        load_head(release_copy)


@pytest.mark.parametrize(("lengths", "groups"), [
    ([], []),
    ([7], [[0]]),
    ([681, 3000, 681, 3000, 2900, 100], [[1, 3, 4], [0, 2], [5]]),
    ([100, 120, 130], [[2, 1, 0]]),  # 3 x 130 = 390 <= 1.25 x 350
    ([100, 200], [[1], [0]]),  # 2 x 200 = 400 > 1.25 x 300
])
def test_padding_groups_bound_the_padding(lengths: list[int], groups: list[list[int]]) -> None:
    assert padding_groups(lengths) == groups
    assert sorted(i for group in groups for i in group) == list(range(len(lengths)))
    for group in groups:
        assert len(group) * lengths[group[0]] <= 1.25 * sum(lengths[i] for i in group)
