"""Turning one entry of a request's ``images`` into an upright RGB picture, safely.

Accepted: raw base64 and ``data:image/<type>;base64,<payload>`` URLs of PNG, JPEG, WebP, GIF (first frame)
and BMP files. Never accepted: URLs (``http(s)://`` and any other scheme) and file paths. The reference's
loader (transformers' ``load_image``) fetches URLs and reads local files; this module has no code that
could do either, so a request can never make the server open a connection or read a file.

Then, as the reference does: the EXIF orientation is applied and the picture converted to RGB (alpha is
dropped, not composited). A decompression bomb is refused from the pixel count its header declares,
before any pixel is decoded.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import re
import warnings
from dataclasses import dataclass

from PIL import Image, ImageOps

from clefserve.errors import RequestError

FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
DEFAULT_MAX_IMAGE_PIXELS = 40_000_000
DEFAULT_MAX_IMAGE_BYTES = 5 << 20
_DATA_URL = re.compile(r"data:image/[A-Za-z0-9.+-]+((?:;[A-Za-z0-9=._+-]+)*);base64,", re.IGNORECASE)
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*:")
_WHITESPACE = re.compile(rb"[ \t\r\n\f\v]+")
_PATH_PREFIXES = ("/", "./", "../", "~", "\\\\")
_WINDOWS_DRIVE = re.compile(r"[A-Za-z]:[\\/]")


@dataclass(frozen=True)
class DecodedImage:
    """An upright RGB picture and a digest of its pixels (what the caches key on)."""

    image: Image.Image
    digest: str

    @property
    def size(self) -> tuple[int, int]:
        """(width, height), Pillow's order."""
        return self.image.size


def base64_length(raw_bytes: int) -> int:
    """Characters of the padded base64 text of ``raw_bytes`` bytes."""
    return 4 * ((raw_bytes + 2) // 3)


def max_text_length(max_bytes: int) -> int:
    """Longest ``images[i]`` string worth decoding: base64 of ``max_bytes`` plus line breaks and a data URL
    head."""
    encoded = base64_length(max_bytes)
    return encoded + encoded // 32 + 256


def pixel_digest(image: Image.Image) -> str:
    """blake2b-256 of an RGB picture's size and pixels."""
    width, height = image.size
    digest = hashlib.blake2b(digest_size=32)
    digest.update(f"{image.mode}:{width}x{height}:".encode())
    digest.update(image.tobytes())
    return digest.hexdigest()


def _fail(field: str, message: str, status: int = 422) -> RequestError:
    return RequestError(f"{field}: {message}", status=status, error_type="invalid_image")


def _payload(text: str, field: str) -> str:
    """The base64 payload of a data URL or raw base64 entry; anything that names a resource is refused."""
    head = text[:64].lstrip()
    lowered = head.lower()
    if lowered.startswith("data:"):
        match = _DATA_URL.match(text.lstrip())
        if match is None:
            raise _fail(field, "a data URL must have the form data:image/<type>;base64,<base64 data>")
        return text.lstrip()[match.end():]
    if lowered.startswith(("http://", "https://")):
        raise _fail(field, "image URLs are never fetched; send the image itself as base64 or as a "
                           "data:image/...;base64, URL")
    if _SCHEME.match(head) and not _WINDOWS_DRIVE.match(head):
        raise _fail(field, f"{head.split(':', 1)[0][:16]!r} URLs are not accepted; send base64 or a "
                           "data:image/...;base64, URL")
    # a base64 text may begin with "/" (JPEG base64 always does), so only refuse what base64 can't be
    looks_like_path = head.startswith(_PATH_PREFIXES) or _WINDOWS_DRIVE.match(head)
    if looks_like_path and re.search(r"[^A-Za-z0-9+/=\s]", text[:4096]):
        raise _fail(field, "file paths are never read; send the image itself as base64 or as a "
                           "data:image/...;base64, URL")
    return text


def _base64_bytes(payload: str, field: str) -> bytes:
    try:
        data = payload.encode("ascii")
    except UnicodeEncodeError:
        raise _fail(field, "is not base64 (it holds non-ASCII characters)") from None
    # line breaks and spaces (MIME-style base64) are ignored, as the reference's decoder does
    data = _WHITESPACE.sub(b"", data)
    if not data:
        raise _fail(field, "is empty; expected a base64-encoded image")
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise _fail(field, f"is not valid base64 ({exc})") from None


def decode_image(text: object, index: int, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
                 max_bytes: int = DEFAULT_MAX_IMAGE_BYTES) -> DecodedImage:
    """Decode ``images[index]`` or raise a :class:`RequestError` naming it."""
    field = f"images[{index}]"
    # Pillow refuses more than twice its own bound before we see the size; keep ours the one that counts
    Image.MAX_IMAGE_PIXELS = max(Image.MAX_IMAGE_PIXELS or 0, max_pixels)
    if not isinstance(text, str):
        raise _fail(field, f"must be a string (base64 or a data:image/...;base64, URL), not "
                           f"{type(text).__name__}")
    if len(text) > max_text_length(max_bytes):
        raise _fail(field, f"is larger than {max_bytes} bytes (--max-image-bytes)", status=413)
    data = _base64_bytes(_payload(text, field), field)
    if len(data) > max_bytes:
        raise _fail(field, f"is larger than {max_bytes} bytes (--max-image-bytes)", status=413)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        try:
            image = Image.open(io.BytesIO(data), formats=FORMATS)
        except Image.DecompressionBombError:
            raise _fail(field, f"declares more than {max_pixels} pixels (--max-image-pixels)",
                        status=413) from None
        except Image.UnidentifiedImageError:
            raise _fail(field, f"is not an image in a supported format ({', '.join(FORMATS)})") from None
        except (OSError, SyntaxError, ValueError, EOFError) as exc:
            raise _fail(field, f"is not a readable image ({exc})") from None
        width, height = image.size
        if width * height > max_pixels:  # from the header: nothing decoded yet
            raise _fail(field, f"declares {width}x{height} = {width * height} pixels; at most {max_pixels} "
                               "are accepted (--max-image-pixels)", status=413)
        if width < 1 or height < 1:
            raise _fail(field, f"has no pixels ({width}x{height})")
        try:
            image.load()  # the first frame only, for animated GIF and WebP
            image = ImageOps.exif_transpose(image)
            image = image.convert("RGB")
        except Image.DecompressionBombError:
            raise _fail(field, f"declares more than {max_pixels} pixels (--max-image-pixels)",
                        status=413) from None
        except (OSError, SyntaxError, ValueError, EOFError, MemoryError) as exc:
            raise _fail(field, f"is truncated or corrupt ({exc})") from None
    return DecodedImage(image, pixel_digest(image))
