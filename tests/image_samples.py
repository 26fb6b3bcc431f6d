"""Test pictures: assorted formats, modes and sizes as file bytes, raw base64 or data URLs."""

from __future__ import annotations

import base64
import io
import struct
import zlib

import numpy as np
from PIL import Image

MIME = {"PNG": "png", "JPEG": "jpeg", "WEBP": "webp", "GIF": "gif", "BMP": "bmp", "TIFF": "tiff"}
EXIF_ORIENTATION = 0x0112


def picture(width: int, height: int, seed: int = 0) -> Image.Image:
    """An RGB picture with structure (gradients, a disc) and noise, so resizing and patches matter."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    r = 255 * x / max(width - 1, 1)
    g = 255 * y / max(height - 1, 1)
    cy, cx = rng.uniform(0, height), rng.uniform(0, width)
    b = 255.0 * (((x - cx) ** 2 + (y - cy) ** 2) < (0.3 * max(width, height)) ** 2)
    rgb = np.stack([r, g, b], -1) + rng.normal(0, 25, (height, width, 3))
    return Image.fromarray(np.clip(rgb, 0, 255).astype(np.uint8), "RGB")


def file_bytes(image: Image.Image, fmt: str, **save: object) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **save)
    return buffer.getvalue()


def as_base64(data: bytes, line_breaks: bool = False) -> str:
    if line_breaks:  # MIME style, 76 characters a line
        return base64.encodebytes(data).decode()
    return base64.b64encode(data).decode()


def as_data_url(data: bytes, fmt: str) -> str:
    return f"data:image/{MIME[fmt]};base64,{as_base64(data)}"


def exif_rotated_jpeg(width: int, height: int, orientation: int = 6, seed: int = 0) -> bytes:
    """A JPEG stored ``width`` x ``height`` whose EXIF says to rotate it (6: 90 degrees clockwise)."""
    exif = Image.Exif()
    exif[EXIF_ORIENTATION] = orientation
    return file_bytes(picture(width, height, seed), "JPEG", exif=exif, quality=90)


def animated_gif(width: int, height: int, seed: int = 0) -> bytes:
    frames = [picture(width, height, seed).convert("P"), picture(width, height, seed + 1).convert("P")]
    buffer = io.BytesIO()
    frames[0].save(buffer, "GIF", save_all=True, append_images=frames[1:], duration=100, loop=0)
    return buffer.getvalue()


def png_declaring(width: int, height: int) -> bytes:
    """A tiny PNG whose header declares ``width`` x ``height`` (a decompression bomb's header)."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    data = zlib.compress(b"\x00" * 64)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", data) + chunk(b"IEND", b"")


def assorted(seed: int = 0) -> list[tuple[str, bytes, str]]:
    """(name, file bytes, format): every accepted format, the common modes, tiny/odd/large sizes."""
    p = picture
    rgba = p(45, 31, seed).convert("RGBA")
    rgba.putalpha(Image.fromarray(np.tile(np.arange(45, dtype=np.uint8) * 5, (31, 1))))
    palette_transparent = p(40, 40, seed + 3).convert("P")
    return [
        ("png-rgb-odd", file_bytes(p(37, 91, seed), "PNG"), "PNG"),
        ("png-l", file_bytes(p(64, 48, seed + 1).convert("L"), "PNG"), "PNG"),
        ("png-rgba", file_bytes(rgba, "PNG"), "PNG"),
        ("png-palette-transparency", file_bytes(palette_transparent, "PNG", transparency=0), "PNG"),
        ("png-tiny", file_bytes(p(2, 3, seed + 2), "PNG"), "PNG"),
        ("jpeg-rgb-large", file_bytes(p(400, 300, seed + 4), "JPEG", quality=85), "JPEG"),
        ("jpeg-l", file_bytes(p(50, 70, seed + 5).convert("L"), "JPEG"), "JPEG"),
        ("jpeg-cmyk", file_bytes(p(48, 40, seed + 6).convert("CMYK"), "JPEG"), "JPEG"),
        ("jpeg-exif-rotated", exif_rotated_jpeg(96, 40, 6, seed + 7), "JPEG"),
        ("webp-rgb", file_bytes(p(81, 33, seed + 8), "WEBP", quality=80), "WEBP"),
        ("webp-rgba", file_bytes(rgba, "WEBP", lossless=True), "WEBP"),
        ("gif-animated", animated_gif(30, 20, seed + 9), "GIF"),
        ("bmp-rgb", file_bytes(p(33, 17, seed + 10), "BMP"), "BMP"),
        ("bmp-palette", file_bytes(p(24, 24, seed + 11).convert("P"), "BMP"), "BMP"),
    ]
