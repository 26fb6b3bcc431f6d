"""Our preprocessing gives the pixel values of transformers' ``Qwen2VLImageProcessorPil``, to the bit."""

from __future__ import annotations

import json

import numpy as np
import pytest

from clefserve.errors import ReleaseError, RequestError
from clefserve.vision.decode import decode_image
from clefserve.vision.preprocess import PreprocessorConfig, preprocess, smart_resize
from tests.image_samples import as_base64, assorted, picture

CONFIGS = {
    "qwen3.5-like": PreprocessorConfig(
        patch_size=16, temporal_patch_size=2, merge_size=2, min_pixels=2048, max_pixels=49152,
        image_mean=(0.5, 0.5, 0.5), image_std=(0.5, 0.5, 0.5)),
    "qwen2-vl-defaults": PreprocessorConfig(),
    "patch14-merge1-t1": PreprocessorConfig(
        patch_size=14, temporal_patch_size=1, merge_size=1, min_pixels=196, max_pixels=14 * 14 * 40,
        image_mean=(0.2, 0.4, 0.6), image_std=(0.3, 0.25, 0.7)),
}
SIZES = [(1, 1), (2, 3), (37, 91), (91, 37), (64, 64), (300, 199), (400, 300), (1000, 7), (1201, 803)]


def oracle(config: PreprocessorConfig):
    from transformers import Qwen2VLImageProcessorPil

    kwargs = config.to_dict()
    for key in ("image_processor_type", "processor_class"):
        kwargs.pop(key)
    return Qwen2VLImageProcessorPil(**kwargs)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_pixel_values_equal_the_oracle(name: str) -> None:
    config = CONFIGS[name]
    processor = oracle(config)
    pictures = [picture(w, h, seed=i) for i, (w, h) in enumerate(SIZES)]
    pictures += [decode_image(as_base64(data), 0).image for _, data, _ in assorted()]
    for image in pictures:
        expected = processor(images=[image], return_tensors="np")
        ours = preprocess(image, config)
        assert ours.grid == tuple(expected["image_grid_thw"][0].tolist()), image.size
        assert ours.pixels.dtype == np.float32
        assert np.array_equal(ours.pixels, expected["pixel_values"]), image.size


def test_smart_resize_bounds() -> None:
    for height, width in [(1, 1), (5, 900), (4000, 3000), (33, 33), (10_000, 60)]:
        h, w = smart_resize(height, width, 32, 2048, 49152)
        assert h % 32 == 0 and w % 32 == 0
        assert 2048 <= h * w <= 49152 or (h == 32 or w == 32)
    with pytest.raises(ValueError, match="aspect ratio"):
        smart_resize(1, 201, 32, 2048, 49152)


def test_extreme_aspect_ratio_is_a_request_error() -> None:
    with pytest.raises(RequestError, match=r"images\[3\]: its aspect ratio 250.0 is above 200"):
        preprocess(picture(500, 2), CONFIGS["qwen3.5-like"], "images[3]")


def test_config_file_parsing(tmp_path) -> None:
    assert PreprocessorConfig.from_folder(tmp_path) is None
    raw = {"size": {"shortest_edge": 4096, "longest_edge": 65536}, "patch_size": 16, "merge_size": 2,
           "temporal_patch_size": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(raw))
    config = PreprocessorConfig.from_folder(tmp_path)
    assert (config.min_pixels, config.max_pixels, config.factor) == (4096, 65536, 32)
    # min_pixels / max_pixels override size, as in Qwen's processor
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({**raw, "max_pixels": 9999}))
    assert PreprocessorConfig.from_folder(tmp_path).max_pixels == 9999
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({**raw, "image_std": [0.5, 0, 0.5]}))
    with pytest.raises(ReleaseError, match="image_std"):
        PreprocessorConfig.from_folder(tmp_path)
    (tmp_path / "preprocessor_config.json").write_text("{not json")
    with pytest.raises(ReleaseError, match="not valid JSON"):
        PreprocessorConfig.from_folder(tmp_path)
