"""The browser console: static files from ``clefserve/console/`` at ``GET /`` and ``GET /console/{file}``.

The files are read once when the app is built; only those files are served (no path from a request ever
reaches the file system). Every response carries a strict Content-Security-Policy: scripts, styles and
requests from this origin only, no inline script, images also from ``data:``/``blob:`` URLs (the image
thumbnails the page makes from picked files). The page is public; the API calls it makes carry the key the
user types, so the API stays exactly as protected as without a console. ``--no-console`` leaves these routes
out (404).
"""

from __future__ import annotations

from importlib import resources

from fastapi import FastAPI, HTTPException
from fastapi.responses import Response

from clefserve.server.errors import error_detail

CONTENT_SECURITY_POLICY = "; ".join([
    "default-src 'self'",
    "script-src 'self'",
    "style-src 'self'",
    "img-src 'self' data: blob:",
    "connect-src 'self'",
    "font-src 'self'",
    "object-src 'none'",
    "base-uri 'none'",
    "form-action 'none'",
    "frame-ancestors 'none'",
])
HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}
MEDIA_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".json": "application/json",
    ".svg": "image/svg+xml",
    ".png": "image/png",
}
INDEX = "index.html"


def console_files() -> dict[str, tuple[bytes, str]]:
    """``{file name: (bytes, media type)}`` of the console's static files shipped in the package."""
    files: dict[str, tuple[bytes, str]] = {}
    for entry in resources.files("clefserve.console").iterdir():
        suffix = "." + entry.name.rsplit(".", 1)[-1] if "." in entry.name else ""
        if entry.is_file() and suffix in MEDIA_TYPES:
            files[entry.name] = (entry.read_bytes(), MEDIA_TYPES[suffix])
    return files


def add_console_routes(app: FastAPI) -> None:
    files = console_files()

    def serve(name: str) -> Response:
        found = files.get(name)
        if found is None:
            raise HTTPException(404, error_detail(f"no console file {name!r}", "not_found"))
        content, media_type = found
        return Response(content, media_type=media_type, headers=HEADERS)

    @app.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
    async def console_page() -> Response:
        return serve(INDEX)

    @app.api_route("/console/{name}", methods=["GET", "HEAD"], include_in_schema=False)
    async def console_asset(name: str) -> Response:
        return serve(name)
