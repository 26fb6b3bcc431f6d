"""The embedded demo model (``clefserve/demo``): quality of the SHIPPED weights, through the serving code.

The held-out tickets come from the other template set of ``clefserve.testing.triage`` (other sentences,
state layouts, question wordings and descriptions than training) and a seed training never used. The
same set run with the Gated DeltaNet conv's key band zeroed must lose a lot of accuracy: the demo model
is a real detector of the fault this project exists to catch.
"""

from __future__ import annotations

import json

import pytest

from clefserve.demo import DEMO_FOLDER
from clefserve.formats.clef import ClefDecider
from clefserve.model.config import BackboneConfig
from clefserve.model.ops import reference_ops
from clefserve.model.ops.faults import FAULT_ENV, ops_from_environment, zeroed_band_ops
from clefserve.testing import triage
from clefserve.testing.triage import TriageMetrics, evaluate, generate

HELDOUT_SEED = 2027  # scripts/train_demo.py draws its data from other seeds
HELDOUT_COUNT = 200
RELEASE_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "joint_head.safetensors", "joint_head_config.json", "README.md")


@pytest.fixture(scope="module")
def decider() -> ClefDecider:
    return ClefDecider(DEMO_FOLDER)


@pytest.fixture(scope="module")
def heldout() -> list[triage.TriageExample]:
    return generate(HELDOUT_COUNT, HELDOUT_SEED, "heldout")


def _metrics(decider: ClefDecider, examples: list[triage.TriageExample]) -> TriageMetrics:
    return evaluate(examples, decider.decide_batch([e.request for e in examples]))


@pytest.fixture(scope="module")
def healthy(decider, heldout) -> TriageMetrics:
    return _metrics(decider, heldout)


def test_demo_release_is_complete_and_small():
    for name in RELEASE_FILES:
        assert (DEMO_FOLDER / name).is_file(), name
    assert sum(p.stat().st_size for p in DEMO_FOLDER.rglob("*") if p.is_file()) <= 8 << 20
    config = BackboneConfig.from_folder(DEMO_FOLDER)
    assert {"linear_attention", "full_attention"} <= set(config.layer_types)
    assert not config.tie_word_embeddings
    head_config = json.loads((DEMO_FOLDER / "joint_head_config.json").read_text())
    assert head_config["hidden_size"] == config.hidden_size


def test_heldout_templates_are_disjoint_from_training_templates():
    pools = [triage.ISSUES, triage.ISSUE_FRAMES, triage.DISTRACTORS, triage.URGENCY_CARRIERS,
             triage.REFUND_CARRIERS, triage.GREETINGS, triage.CLOSINGS, triage.TEAM_QUESTION,
             triage.URGENCY_QUESTION, triage.REFUND_QUESTION]

    def strings(value) -> set[str]:
        if isinstance(value, str):
            return {value} if value else set()
        if isinstance(value, dict):
            return set().union(*(strings(v) for v in value.values())) if value else set()
        if isinstance(value, list | tuple):
            return set().union(*(strings(v) for v in value)) if value else set()
        return set()

    shared = set()
    for pool in pools:
        shared |= strings(pool["train"]) & strings(pool["heldout"])
    assert not shared, shared
    train, held = generate(300, HELDOUT_SEED, "train"), generate(300, HELDOUT_SEED, "heldout")
    states = [{json.dumps(e.request["state"]) for e in examples} for examples in (train, held)]
    assert not states[0] & states[1]
    assert generate(5, 1, "heldout") == generate(5, 1, "heldout")


def test_demo_model_answers_heldout_tickets(healthy):
    assert healthy.choice_accuracy >= 0.90, healthy
    assert healthy.noul_accuracy >= 0.90, healthy
    assert healthy.score_mae <= 0.5, healthy


def test_zeroed_key_band_costs_the_demo_model_its_accuracy(decider, heldout, healthy):
    decider.backbone.set_ops(zeroed_band_ops(decider.backbone.config, "k"))
    try:
        broken = _metrics(decider, heldout)
    finally:
        decider.backbone.set_ops(reference_ops())
    assert healthy.choice_accuracy - broken.choice_accuracy >= 0.20, (healthy, broken)
    # The fault gives well-formed answers: only their quality shows it.
    assert _metrics(decider, heldout[:10]) == _metrics(decider, heldout[:10])


def test_fault_switch_is_read_from_the_environment(monkeypatch):
    config = BackboneConfig.from_folder(DEMO_FOLDER)
    monkeypatch.delenv(FAULT_ENV, raising=False)
    assert ops_from_environment(config) == reference_ops()
    monkeypatch.setenv(FAULT_ENV, "k")
    assert "zeroed-k-band" in ops_from_environment(config).name
    monkeypatch.setenv(FAULT_ENV, "key")
    with pytest.raises(ValueError, match=FAULT_ENV):
        ops_from_environment(config)


def _train(out, *extra: str) -> None:
    import subprocess
    import sys

    from clefserve.testing.server_process import ROOT

    script = ROOT / "scripts" / "train_demo.py"
    subprocess.run([sys.executable, str(script), "--out", str(out), "--steps", "3", "--batch", "2",
                    "--eval-size", "4", *extra],
                   check=True, capture_output=True, timeout=300, env={"OMP_NUM_THREADS": "1", "PATH": ""})


def test_the_training_script_is_seeded_and_writes_a_servable_release(tmp_path):
    """A few steps of scripts/train_demo.py: same seed, same bytes; another seed, other weights; and the
    folder loads with the serving code and answers triage requests."""
    _train(tmp_path / "a")
    _train(tmp_path / "b")
    _train(tmp_path / "c", "--seed", "1")
    weights = ("model.safetensors", "joint_head.safetensors", "tokenizer.json", "config.json")
    for name in weights:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    other = (tmp_path / "c" / "model.safetensors").read_bytes()
    assert (tmp_path / "a" / "model.safetensors").read_bytes() != other
    examples = generate(3, 5, "heldout")
    responses = ClefDecider(tmp_path / "a").decide_batch([e.request for e in examples])
    assert evaluate(examples, responses).count == 3
    assert "held-out templates" in (tmp_path / "a" / "README.md").read_text()
