"""Decoding ``images[i]``: the same upright RGB pixels as the reference's loader, and hostile input refused.

transformers' ``load_image`` (what Cloudflare's reference calls) is the oracle for accepted input. For the
rest, every refusal is a RequestError naming ``images[i]``, and nothing is ever fetched or read.
"""

from __future__ import annotations

import base64
import socket

import numpy as np
import pytest

from clefserve.errors import RequestError
from clefserve.vision.decode import decode_image, max_text_length, pixel_digest
from tests.image_samples import (
    as_base64,
    as_data_url,
    assorted,
    exif_rotated_jpeg,
    file_bytes,
    picture,
    png_declaring,
)

SAMPLES = assorted()


def reference_load(text: str):
    from transformers.image_utils import load_image

    return load_image(text)


@pytest.mark.parametrize("name", [name for name, _, _ in SAMPLES])
def test_accepted_pictures_decode_as_the_reference_does(name: str) -> None:
    _, data, fmt = next(s for s in SAMPLES if s[0] == name)
    for text in (as_base64(data), as_base64(data, line_breaks=True), as_data_url(data, fmt)):
        ours = decode_image(text, 0)
        expected = np.asarray(reference_load(text))
        assert ours.image.mode == "RGB"
        assert np.array_equal(np.asarray(ours.image), expected), name
        assert ours.digest == pixel_digest(ours.image)


def test_exif_orientation_is_applied() -> None:
    ours = decode_image(as_base64(exif_rotated_jpeg(96, 40, orientation=6)), 0)
    assert ours.size == (40, 96)  # stored landscape, shown portrait


def test_gif_first_frame_only() -> None:
    from tests.image_samples import animated_gif

    ours = decode_image(as_base64(animated_gif(30, 20)), 0)
    first = np.asarray(picture(30, 20, 0).convert("P").convert("RGB"))
    assert np.array_equal(np.asarray(ours.image), first)


def test_digest_depends_on_pixels_only() -> None:
    image = picture(20, 10)
    png, bmp = file_bytes(image, "PNG"), file_bytes(image, "BMP")
    assert decode_image(as_base64(png), 0).digest == decode_image(as_data_url(bmp, "BMP"), 1).digest
    other = as_base64(file_bytes(picture(20, 10, seed=1), "PNG"))
    assert decode_image(as_base64(png), 0).digest != decode_image(other, 0).digest


def _hostile(tmp_path) -> list[tuple[str, object, int]]:
    real_file = tmp_path / "picture.png"
    real_file.write_bytes(file_bytes(picture(8, 8), "PNG"))
    png = file_bytes(picture(64, 64), "PNG")
    jpeg = file_bytes(picture(64, 64), "JPEG")
    return [
        ("https URL", "https://example.com/cat.png", 422),
        ("http URL", "http://127.0.0.1:9/cat.png", 422),
        ("ftp URL", "ftp://example.com/cat.png", 422),
        ("file URL", f"file://{real_file}", 422),
        ("absolute path of a real picture", str(real_file), 422),
        ("relative path", "./picture.png", 422),
        ("not base64", "this is not an image!", 422),
        ("base64 of text", base64.b64encode(b"hello, world, not a picture").decode(), 422),
        ("empty", "", 422),
        ("bad padding", as_base64(png)[:-2] + "=", 422),
        ("truncated PNG", as_base64(png[: len(png) // 2]), 422),
        ("truncated JPEG", as_base64(jpeg[: len(jpeg) // 2]), 422),
        ("decompression bomb", as_base64(png_declaring(100_000, 100_000)), 413),
        ("TIFF (not accepted)", as_data_url(file_bytes(picture(8, 8), "TIFF"), "TIFF"), 422),
        ("data URL of text", "data:text/plain;base64," + base64.b64encode(b"hi").decode(), 422),
        ("data URL without base64", "data:image/png," + as_base64(png), 422),
        ("a number", 12345, 422),
        ("an object", {"url": "https://example.com/cat.png"}, 422),
        ("too many bytes", "A" * (max_text_length(1 << 20) + 4), 413),
    ]


def test_hostile_input_is_refused_naming_the_entry(tmp_path, monkeypatch) -> None:
    attempts: list[object] = []

    def no_network(*args, **kwargs):
        attempts.append(args)
        raise AssertionError("a connection was attempted")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    opened: list[str] = []
    real_open = open

    def watch_open(file, *args, **kwargs):
        opened.append(str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr("builtins.open", watch_open)
    for index, (name, value, status) in enumerate(_hostile(tmp_path)):
        with pytest.raises(RequestError) as caught:
            decode_image(value, index, max_pixels=40_000_000, max_bytes=1 << 20)
        assert caught.value.message.startswith(f"images[{index}]: "), (name, caught.value.message)
        assert caught.value.status == status, (name, caught.value.message)
    assert not attempts
    assert not [f for f in opened if "picture.png" in f]


def test_pixel_limit_is_checked_before_decoding() -> None:
    data = as_base64(file_bytes(picture(300, 200), "PNG"))
    with pytest.raises(RequestError, match=r"images\[2\]: declares 300x200 = 60000 pixels"):
        decode_image(data, 2, max_pixels=59_999)
    assert decode_image(data, 2, max_pixels=60_000).size == (300, 200)


def test_byte_limit() -> None:
    data = file_bytes(picture(64, 64), "PNG")
    with pytest.raises(RequestError, match=r"images\[0\]: is larger than 100 bytes"):
        decode_image(as_base64(data), 0, max_bytes=100)
    assert decode_image(as_base64(data), 0, max_bytes=len(data)).size == (64, 64)
