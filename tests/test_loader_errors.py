"""A bad release folder gets one clear error naming what is wrong."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from clefserve.errors import ReleaseError
from clefserve.model.weights import load_backbone
from clefserve.testing.release import ReleaseSpec, build_release

SPEC = ReleaseSpec(head=None, num_hidden_layers=4)


@pytest.fixture()
def folder(tmp_path: Path, make_release) -> Path:
    source = make_release(SPEC, seed=3)
    target = tmp_path / "release"
    shutil.copytree(source, target)
    return target


def rewrite_weights(folder: Path, edit) -> None:
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path))


def expect(folder: Path, *fragments: str) -> None:
    with pytest.raises(ReleaseError) as info:
        load_backbone(folder)
    for fragment in fragments:
        assert fragment in str(info.value), str(info.value)


def test_missing_tensor_is_named(folder):
    rewrite_weights(folder, lambda t: t.pop("model.language_model.layers.2.linear_attn.A_log"))
    expect(folder, "missing tensor", "model.language_model.layers.2.linear_attn.A_log")


def test_unexpected_tensor_is_named(folder):
    rewrite_weights(
        folder, lambda t: t.update({"model.language_model.layers.0.bogus.weight": torch.zeros(2)})
    )
    expect(folder, "unexpected tensor", "model.language_model.layers.0.bogus.weight")


def test_misshaped_tensor_is_named(folder):
    key = "model.language_model.layers.3.self_attn.q_proj.weight"
    rewrite_weights(folder, lambda t: t.update({key: torch.zeros(3, 3)}))
    expect(folder, key, "(3, 3)", "expected")


def test_unsupported_architecture(folder):
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["LlamaForCausalLM"]
    config["model_type"] = "llama"
    (folder / "config.json").write_text(json.dumps(config))
    expect(folder, "unsupported architecture", "LlamaForCausalLM")


def test_pickled_weights_are_refused(folder):
    (folder / "model.safetensors").unlink()
    (folder / "pytorch_model.bin").write_bytes(b"not loaded, never unpickled")
    expect(folder, "pytorch_model.bin", "only safetensors")


def test_no_weights_at_all(folder):
    (folder / "model.safetensors").unlink()
    expect(folder, "no model.safetensors")


def test_missing_config(folder):
    (folder / "config.json").unlink()
    expect(folder, "no config.json")


def test_index_naming_a_missing_shard(tmp_path):
    folder = build_release(tmp_path / "sharded", SPEC, seed=3, shards=3)
    (folder / "model-00002-of-00003.safetensors").unlink()
    expect(folder, "model-00002-of-00003.safetensors", "missing")


@torch.inference_mode()
def test_sharded_with_vision_and_mtp_tensors_loads_like_single_file(tmp_path, make_release):
    single = load_backbone(make_release(SPEC, seed=3))
    extra = {"model.visual.blocks.0.attn.qkv.weight": torch.zeros(4, 4), "mtp.fc.weight": torch.zeros(4, 4)}
    sharded = load_backbone(build_release(tmp_path / "sharded", SPEC, seed=3, shards=3, extra_tensors=extra))
    ids = torch.arange(50)
    assert torch.equal(single.run_sequence(ids)[0], sharded.run_sequence(ids)[0])


def test_dtype_and_device_are_the_callers(make_release):
    model = load_backbone(make_release(SPEC, seed=3), dtype=torch.bfloat16, device="cpu")
    assert model.dtype == torch.bfloat16
    assert model.layers[0].linear_attn.A_log.dtype == torch.float32  # decay rates stay fp32


def test_loading_reports_progress_for_large_folders(make_release, monkeypatch, caplog):
    import clefserve.model.weights as weights

    monkeypatch.setattr(weights, "PROGRESS_BYTES", 0)
    with caplog.at_level("INFO", logger="clefserve.model.weights"):
        load_backbone(make_release(SPEC, seed=3))
    assert any("loading weights: shard 1/1" in r.getMessage() for r in caplog.records)
