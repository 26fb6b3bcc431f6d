"""The console's static files and ``GET /v1/status`` over HTTP (no browser: see test_console_browser.py)."""

from __future__ import annotations

import json
import os
import re
import struct
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from clefserve.config import EngineConfig
from clefserve.server import create_app
from clefserve.server.console import CONTENT_SECURITY_POLICY, console_files
from clefserve.server.status import StatusResponse
from clefserve.testing.server_process import ROOT
from tests.http_fakes import FakeBackend
from tests.test_demo_serving import documented_request
from tests.test_observability import samples

KEY = "console-test-key-5f2a"
REQUEST = {"model": "m", "state": "s", "questions": {"q": {"type": "noul"}}}


class Tags(HTMLParser):
    """Every tag of a page with its attributes, and the text inside <script> and <style> elements."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.inline: list[str] = []
        self._open: str | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))
        self._open = tag if tag in ("script", "style") else None

    def handle_endtag(self, tag: str) -> None:
        self._open = None

    def handle_data(self, data: str) -> None:
        if self._open and data.strip():
            self.inline.append(data)


@pytest.fixture
def client() -> Iterator[TestClient]:
    with TestClient(create_app(FakeBackend(), EngineConfig())) as c:
        yield c


def test_the_console_page_has_a_strict_csp_and_no_inline_code(client: TestClient) -> None:
    page = client.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    csp = page.headers["content-security-policy"]
    assert csp == CONTENT_SECURITY_POLICY
    directives = dict(d.strip().split(" ", 1) for d in csp.split(";"))
    assert directives["default-src"] == "'self'"
    assert directives["script-src"] == "'self'"  # no 'unsafe-inline', no 'unsafe-eval'
    assert "unsafe" not in csp and "http" not in csp and "*" not in csp
    assert page.headers["x-content-type-options"] == "nosniff"
    tags = Tags()
    tags.feed(page.text)
    assert tags.inline == []  # no inline script or style element
    scripts = [attrs for tag, attrs in tags.tags if tag == "script"]
    assert scripts and all(attrs.get("src", "").startswith("/console/") for attrs in scripts)
    assert not any(name.startswith("on") for _, attrs in tags.tags for name in attrs)  # no inline handlers
    assert not any("style" in attrs for _, attrs in tags.tags)


def test_every_file_the_page_references_is_served_from_this_origin(client: TestClient) -> None:
    tags = Tags()
    tags.feed(client.get("/").text)
    references = {attrs.get("src") or attrs.get("href") for tag, attrs in tags.tags
                  if tag in ("script", "link", "img")}
    imports = set()
    for name, (content, _) in console_files().items():
        if name.endswith(".js"):
            imports |= {f"/console/{m}" for m in re.findall(r'from "\./([\w.-]+)"', content.decode())}
    for path in references | imports:
        assert path.startswith("/console/"), path
        response = client.get(path)
        assert response.status_code == 200, path
        assert response.headers["content-security-policy"] == CONTENT_SECURITY_POLICY
    assert client.get("/console/app.js").headers["content-type"].startswith("text/javascript")
    assert client.get("/console/console.css").headers["content-type"].startswith("text/css")
    # nothing outside the shipped files: no traversal, no module source
    for path in ("/console/__init__.py", "/console/..%2F..%2Fcli.py", "/console/missing.js"):
        assert client.get(path).status_code == 404, path


def test_the_console_code_names_no_other_origin() -> None:
    for name, (content, _) in console_files().items():
        text = content.decode()
        # the SVG namespace is an identifier, never fetched
        urls = set(re.findall(r"(?:https?:)?//[\w.-]+\.\w+[^\s\"')]*", text)) - {"http://www.w3.org/2000/svg"}
        assert not urls, (name, urls)
        # text is never parsed as markup or code
        unsafe = r"\.(?:inner|outer)HTML\b|insertAdjacentHTML|document\.write|\beval\(|new Function"
        assert not re.search(unsafe, text), name


def test_no_console_turns_the_page_off_but_not_the_status() -> None:
    with TestClient(create_app(FakeBackend(), EngineConfig(console=False))) as c:
        assert c.get("/").status_code == 404
        assert c.get("/console/app.js").status_code == 404
        assert c.get("/v1/status").status_code == 200


def test_the_console_flag_and_the_address_the_log_prints() -> None:
    from clefserve.cli import build_parser, console_address

    parser = build_parser()
    assert EngineConfig.from_args(parser.parse_args(["serve"])).console is True
    assert EngineConfig.from_args(parser.parse_args(["serve", "--no-console"])).console is False
    assert console_address("0.0.0.0", 8080) == "http://localhost:8080/"
    assert console_address("127.0.0.1", 9000) == "http://127.0.0.1:9000/"
    assert console_address("::1", 8080) == "http://[::1]:8080/"


def test_the_demo_example_is_the_readme_request() -> None:
    shipped = json.loads(console_files()["demo-request.json"][0])
    _, documented = documented_request()
    assert shipped == documented
    assert list(shipped["questions"]) == list(documented["questions"])


def test_status_needs_the_key_like_the_api() -> None:
    with TestClient(create_app(FakeBackend(), EngineConfig(api_key=KEY))) as c:
        assert c.get("/v1/status").status_code == 401
        assert c.get("/v1/status", headers={"Authorization": "Bearer wrong"}).status_code == 401
        response = c.get("/v1/status", headers={"Authorization": f"Bearer {KEY}"})
        assert response.status_code == 200
        assert response.json()["server"]["auth_required"] is True
        assert c.get("/").status_code == 200  # the page itself is public


def test_status_is_documented_and_matches_its_schema(client: TestClient) -> None:
    schema = client.get("/openapi.json").json()
    operation = schema["paths"]["/v1/status"]["get"]
    ref = operation["responses"]["200"]["content"]["application/json"]["schema"]["$ref"]
    assert ref.endswith("/StatusResponse")
    assert "StatusResponse" in schema["components"]["schemas"]
    assert "/" not in schema["paths"] and not any(p.startswith("/console") for p in schema["paths"])
    body = client.get("/v1/status").json()
    StatusResponse.model_validate(body)  # extra="forbid": the document names every field
    assert body["engine"] is None  # the fake backend has no engine
    assert "audit" not in body
    assert body["images"] == {"supported": False, "reason": "the model takes no images"}


ENGINE_STATS = dict.fromkeys(
    ("running", "waiting", "kv_blocks_total", "kv_blocks_free", "gdn_slots_total", "gdn_slots_free",
     "kv_bytes", "gdn_bytes", "tokens_per_second", "prefill_tokens", "steps", "finished", "cancelled",
     "failed", "rejected"), 0)


class AuditingBackend(FakeBackend):
    def stats(self) -> dict[str, Any]:
        return {**ENGINE_STATS, "audit": {"match": 41, "mismatch": 1, "skipped": 3, "max_difference": 2.5e-7,
                          "by_dtype": {"f32": 45}, "recent": [1, 2]}}


def test_status_passes_audit_counters_through_when_the_backend_reports_them() -> None:
    with TestClient(create_app(AuditingBackend(), EngineConfig())) as c:
        body = c.get("/v1/status").json()
    StatusResponse.model_validate(body)
    assert body["audit"] == {"match": 41, "mismatch": 1, "skipped": 3, "max_difference": 2.5e-7,
                             "by_dtype.f32": 45}  # nested objects flattened, lists left out


def test_status_counts_decisions_and_their_last_minute(client: TestClient) -> None:
    for _ in range(3):
        assert client.post("/v1/systemone", json=REQUEST).status_code == 200
    assert client.post("/v1/systemone", json={"model": "m"}).status_code == 422
    client.get("/health")
    body = client.get("/v1/status").json()
    requests = body["requests"]
    assert requests["total"] == 4 and requests["by_status"] == {"2xx": 3, "4xx": 1}
    minute = requests["last_minute"]
    assert minute["count"] == 4 and minute["errors"] == 1
    assert len(minute["series"]) == 60 and minute["series"][-1]["t"] == 0
    assert sum(point["count"] for point in minute["series"]) == 4
    assert minute["p50_ms"] is not None and minute["p50_ms"] <= minute["p95_ms"]


def test_status_reveals_no_paths_keys_or_environment(make_release, monkeypatch) -> None:
    from clefserve.formats.clef import ClefDecider
    from clefserve.formats.clef.engine_backend import EngineBackend

    folder = make_release(seed=3)
    monkeypatch.setenv("CLEF_STATUS_TEST_SECRET", "env-secret-9d1c")
    config = EngineConfig(weights=str(folder), api_key=KEY, max_num_seqs=2, kv_cache_mb=4, max_length=1024)
    backend = EngineBackend(ClefDecider(folder, max_length=1024), config, "clef-status")
    with TestClient(create_app(backend, config)) as c:
        text = c.get("/v1/status", headers={"Authorization": f"Bearer {KEY}"}).text
    secrets = [KEY, str(folder), folder.name, os.getcwd(), str(Path.home()), "env-secret-9d1c",
               str(Path(__file__).resolve().parents[1])]
    for secret in secrets:
        assert secret not in text, secret
    assert not re.search(r"(?<![\w.])/(?:tmp|home|root|usr|work|opt)/", text)


def test_status_reads_the_same_values_as_metrics(make_release) -> None:
    from clefserve.formats.clef import ClefDecider
    from clefserve.formats.clef.engine_backend import EngineBackend

    config = EngineConfig(max_num_seqs=2, kv_cache_mb=4, max_length=1024)
    backend = EngineBackend(ClefDecider(make_release(seed=3), max_length=1024), config, "clef-status")
    with TestClient(create_app(backend, config)) as c:
        for i in range(3):
            body = {**REQUEST, "state": f"the same state, asked again {i // 2}"}
            assert c.post("/v1/systemone", json=body).status_code == 200
        status = c.get("/v1/status").json()
        s = samples(c)
    StatusResponse.model_validate(status)
    engine = status["engine"]
    assert engine["kv_blocks"] == {"used": s["clef_engine_kv_blocks_used"],
                                   "cached": s["clef_engine_kv_blocks_cached"],
                                   "total": s["clef_engine_kv_blocks_total"]}
    assert engine["gdn_slots"] == {"used": 0, "total": 2} == {
        "used": s["clef_engine_gdn_slots_used"], "total": s["clef_engine_gdn_slots_total"]}
    assert engine["sequences"]["finished"] == s['clef_engine_sequences_total{outcome="finished"}'] == 3
    assert engine["prefill_tokens"] == s["clef_engine_prefill_tokens_total"] > 0
    prefix = engine["prefix_cache"]
    assert prefix["hits"] == s["clef_engine_prefix_cache_hits_total"] > 0
    assert prefix["hit_tokens"] == s["clef_engine_prefix_cache_hit_tokens_total"] > 0
    expected_rate = prefix["hit_tokens"] / (prefix["hit_tokens"] + engine["prefill_tokens"])
    assert prefix["token_hit_rate"] == pytest.approx(expected_rate, abs=1e-4)
    assert status["requests"]["total"] == s['clef_http_requests_total{method="POST",route="/v1/systemone",'
                                             'status="200"}'] == 3
    model = status["model"]
    assert (model["name"], model["ready"], model["phase"], model["dtype"], model["device"]) == (
        "clef-status", True, "ready", "f32", "cpu")
    assert model["ops"] == "torch-fast"  # --kernels auto on a CPU: the batched delta rule and split attention
    assert model["self_check"]["result"] == "not run"  # a backend built without the startup check


def test_the_readme_shows_the_console_picture() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "![The console answering the demo ticket](docs/console.png)" in readme
    assert "http://localhost:8080/" in readme
    picture = (ROOT / "docs" / "console.png").read_bytes()
    assert picture[:8] == b"\x89PNG\r\n\x1a\n" and len(picture) < 200_000
    width, height = struct.unpack(">II", picture[16:24])
    assert width == 1280 and height >= 700
