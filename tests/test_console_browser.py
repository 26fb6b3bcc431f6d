"""The console in a real browser (headless Debian Chromium + Selenium) against real servers on the demo model.

Screenshots at 1280 px and 390 px (light and dark) are left in ``test-artifacts/console/`` for people to see.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shlex
import struct
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest

from clefserve.config import EngineConfig
from clefserve.server import create_app
from clefserve.testing.browser import ARTIFACTS, Browser, browser_problem
from clefserve.testing.server_process import ROOT, ServerProcess, free_port
from tests.http_fakes import FakeBackend

KEY = "console-browser-key-7c1e"
DEMO = json.loads((ROOT / "clefserve" / "console" / "demo-request.json").read_text())
HOSTILE_IMG = '<img src=x onerror="window.__pwned = 1">'
HOSTILE_SCRIPT = "<script>window.__pwned = 2</script>"

pytestmark = pytest.mark.slow


def require_browser() -> None:
    """Without the browser these tests skip, saying how to install it; in CI they must run."""
    problem = browser_problem()
    if problem is not None:
        if os.environ.get("CI"):
            pytest.fail(problem)
        pytest.skip(problem)


@pytest.fixture(scope="module")
def chromium() -> Iterator[Browser]:
    require_browser()
    b = Browser()
    try:
        yield b
    finally:
        b.quit()


@pytest.fixture
def browser(chromium: Browser) -> Iterator[Browser]:
    """The shared browser, left on a blank page after each test (a console page keeps polling its server)."""
    try:
        yield chromium
    finally:
        chromium.driver.get("about:blank")


def start(log_name: str, tmp_path_factory, *extra: str) -> ServerProcess:
    require_browser()  # skip before paying for a server
    log = tmp_path_factory.mktemp("console") / log_name
    server = ServerProcess(None, log, "--log-level", "warning", *extra)
    try:
        server.wait_ready()
    except BaseException:
        server.stop()
        raise
    return server


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[ServerProcess]:
    srv = start("server.log", tmp_path_factory)
    try:
        yield srv
    finally:
        srv.stop()


@contextmanager
def in_process_server(backend: FakeBackend, config: EngineConfig) -> Iterator[str]:
    """The real app over a fake backend (no model), served by uvicorn on a thread; yields its URL."""
    import uvicorn

    port = free_port()
    uv = uvicorn.Server(uvicorn.Config(create_app(backend, config), host="127.0.0.1", port=port,
                                       log_config=None, log_level="warning"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not uv.started and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        uv.should_exit = True
        thread.join(10)


@pytest.fixture
def auth_server() -> Iterator[str]:
    """Auth is the HTTP layer's, whatever the backend: a fake one answers, so no second model loads."""
    with in_process_server(FakeBackend(DEMO["model"]), EngineConfig(api_key=KEY)) as url:
        yield url


# ---- driving the page ----

def by_css(css: str) -> tuple[str, str]:
    from selenium.webdriver.common.by import By

    return By.CSS_SELECTOR, css


def find(b: Browser, css: str, root: Any = None) -> Any:
    return (root or b.driver).find_element(*by_css(css))


def find_all(b: Browser, css: str, root: Any = None) -> list[Any]:
    return (root or b.driver).find_elements(*by_css(css))


def type_into(element: Any, text: str) -> None:
    element.clear()
    element.send_keys(text)


def open_console(b: Browser, server: ServerProcess | str) -> None:
    b.open((server if isinstance(server, str) else server.url) + "/")
    b.wait(lambda d: d.execute_script("return document.querySelector('#stat-requests') !== null"
                                      " || document.querySelector('.engine-problem') !== null"),
           message="the engine panel never filled")


def wait_for_demo_example(b: Browser) -> None:
    b.wait(lambda d: [e.get_attribute("value") for e in find_all(b, "#questions [name=question-id]")]
           == list(DEMO["questions"]), message="the demo ticket was not preloaded")


def text_of(b: Browser, css: str) -> str:
    """The text of an element the engine panel redraws every 2 s (read in one go, never stale)."""
    return b.js("const e = document.querySelector(arguments[0]); return e ? e.textContent : null", css)


def requests_shown(b: Browser) -> int:
    return int(text_of(b, "#stat-requests").replace(",", ""))


def cards(b: Browser) -> list[Any]:
    return find_all(b, "#questions fieldset.question")


def build_request(b: Browser, state_text: str, questions: dict[str, dict[str, Any]]) -> None:
    """Type a whole request into the form, as a person would: remove what is there, add each question."""
    while cards(b):
        find(b, "[name=remove-question]", cards(b)[0]).click()
    type_into(find(b, "#state"), state_text)
    for qid, question in questions.items():
        find(b, f"#add-{question['type']}").click()
        type_into(find(b, "[name=question-id]", cards(b)[-1]), qid)
        if "instructions" in question:
            type_into(find(b, "[name=instructions]", cards(b)[-1]), question["instructions"])
        if question["type"] == "choice":
            for i, (label, description) in enumerate(question["criteria"].items()):
                if i >= len(find_all(b, "[name=option-label]", cards(b)[-1])):
                    find(b, "[name=add-option]", cards(b)[-1]).click()
                type_into(find_all(b, "[name=option-label]", cards(b)[-1])[i], label)
                type_into(find_all(b, "[name=option-description]", cards(b)[-1])[i], description or "")
        elif question["type"] == "score":
            for i, level in enumerate(question["criteria"]):
                if i >= len(find_all(b, "[name=level]", cards(b)[-1])):
                    find(b, "[name=add-level]", cards(b)[-1]).click()
                type_into(find_all(b, "[name=level]", cards(b)[-1])[i], level)


def submit_with_keyboard(b: Browser) -> None:
    from selenium.webdriver.common.keys import Keys

    find(b, "#state").send_keys(Keys.CONTROL, Keys.ENTER)


def wait_for_outcome(b: Browser) -> None:
    b.wait(lambda d: find_all(b, "#answers article.answer, #answers .error"), timeout=60,
           message="no answer and no error shown")


def shown_answers(b: Browser) -> list[dict[str, Any]]:
    return b.js("""
        return [...document.querySelectorAll('#answers article.answer')].map(a => ({
          id: a.dataset.question, type: a.dataset.type,
          summary: a.querySelector('.summary').textContent,
          bars: [...a.querySelectorAll('li.bar')].map(li => ({
            option: li.dataset.option, p: Number(li.dataset.probability),
            label: li.querySelector('.bar-label').textContent,
            value: li.querySelector('.bar-value').textContent,
            decided: li.classList.contains('decided'),
            width: li.querySelector('.bar-fill').style.width})),
        }));""")


def snippet(b: Browser, kind: str) -> str:
    find(b, f"#copy-{kind}").click()
    b.wait(lambda d: find(b, "#snippet").get_attribute("data-kind") == kind)
    return b.js("return document.querySelector('#snippet').textContent")


def curl_body(curl: str) -> dict[str, Any]:
    words = shlex.split(curl.replace("\\\n", " "))
    return json.loads(words[words.index("-d") + 1])


def assert_bars_equal_api(shown: list[dict[str, Any]], api: dict[str, Any]) -> None:
    assert [a["id"] for a in shown] == list(api["answers"])
    for answer in shown:
        want = api["answers"][answer["id"]]
        bars = answer["bars"]
        assert answer["type"] == want["type"]
        if want["type"] == "noul":
            assert [(b["option"], b["p"]) for b in bars] == [("true", want["noul"])]
            assert bars[0]["decided"] == (want["noul"] >= 0.5)
        else:
            assert {b["option"]: b["p"] for b in bars} == want["probabilities"]  # exactly the API's numbers
            assert [b["p"] for b in bars] == sorted((b["p"] for b in bars), reverse=True)
            decided = [b["option"] for b in bars if b["decided"]]
            if want["type"] == "choice":
                assert decided == [want["choice"]]
                assert want["choice"] in answer["summary"] and str(want["confidence"]) in answer["summary"]
            else:
                top = max(want["probabilities"], key=lambda k: want["probabilities"][k])
                assert decided == [top] and str(want["score"]) in answer["summary"]
                labels = {b["option"]: b["label"] for b in bars}
                assert all(labels[level] == f"{level} · {text}" for level, text in want["legend"].items())
        for bar in bars:
            assert bar["value"] == str(bar["p"])
            assert float(bar["width"].rstrip("%")) == pytest.approx(100 * bar["p"], abs=1e-6)


# ---- the tests ----

def test_the_page_loads_without_console_errors_or_other_origins(browser: Browser,
                                                                 server: ServerProcess) -> None:
    open_console(browser, server)
    wait_for_demo_example(browser)
    submit_with_keyboard(browser)
    wait_for_outcome(browser)
    assert shown_answers(browser), "the demo ticket got no answers"
    assert browser.errors() == []
    assert browser.requests, "no request was logged"
    foreign = [url for url in browser.requests if not url.startswith((server.url + "/", "data:", "blob:"))]
    assert foreign == []
    # every control is labelled
    unlabelled = browser.js("""
        return [...document.querySelectorAll('input, select, textarea, button')].filter(e =>
          !(e.labels && e.labels.length) && !e.getAttribute('aria-label')
          && !e.getAttribute('aria-labelledby')
          && !(e.tagName === 'BUTTON' && e.textContent.trim())).map(e => e.outerHTML);""")
    assert unlabelled == []


def test_a_request_built_in_the_form_shows_the_apis_answer(browser: Browser, server: ServerProcess) -> None:
    state = {"channel": "chat", "customer": {"name": "Bo", "plan": "enterprise"},
             "message": "The app crashes every time I log in since this morning; nothing works."}
    questions = {
        "team": {"type": "choice", "instructions": "Which team should handle this ticket?",
                 "criteria": {"technical": "Bugs, errors and outages", "account": "Logins and passwords",
                              "billing": None}},
        "urgency": {"type": "score", "instructions": "How urgent is this ticket?",
                    "criteria": ["Can wait", "Today", "Right now"]},
        "refund": {"type": "noul", "instructions": "Does the customer ask for a refund?"},
    }
    expected = {"model": DEMO["model"], "state": state, "questions": questions}
    open_console(browser, server)
    wait_for_demo_example(browser)
    build_request(browser, json.dumps(state), questions)
    assert curl_body(snippet(browser, "curl")) == expected
    assert list(curl_body(snippet(browser, "curl"))["questions"]) == list(questions)
    submit_with_keyboard(browser)
    wait_for_outcome(browser)
    shown = shown_answers(browser)
    api = httpx.post(f"{server.url}/v1/systemone", json=expected, timeout=60)
    assert api.status_code == 200, api.text
    assert_bars_equal_api(shown, api.json())
    usage = find(browser, "#answers .usage").text
    assert f"{api.json()['usage']['input_tokens']}" in usage
    assert len(find(browser, "#answer-request-id").text) >= 8


def test_copied_snippets_run_and_get_the_same_answers(browser: Browser, server: ServerProcess) -> None:
    open_console(browser, server)
    wait_for_demo_example(browser)
    api = httpx.post(f"{server.url}/v1/systemone", json=DEMO, timeout=60).json()
    curl = snippet(browser, "curl")
    assert curl_body(curl) == DEMO
    ran = subprocess.run(["bash", "-c", curl], capture_output=True, text=True, timeout=60)
    assert ran.returncode == 0, ran.stderr
    assert json.loads(ran.stdout)["answers"] == api["answers"]
    python = snippet(browser, "python")
    ran = subprocess.run([sys.executable, "-c", python], capture_output=True, text=True, timeout=120,
                         env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")})
    assert ran.returncode == 0, ran.stderr
    sdk = json.loads(ran.stdout)
    for qid, want in api["answers"].items():
        got = sdk["answers"][qid]
        for field in ("choice", "score", "noul", "confidence", "probabilities"):
            if field in want:
                assert got[field] == want[field], (qid, field)


def test_an_invalid_request_shows_the_servers_message(browser: Browser, server: ServerProcess) -> None:
    questions = {"team": {"type": "choice", "criteria": {"billing": None}}}
    open_console(browser, server)
    wait_for_demo_example(browser)
    build_request(browser, json.dumps({"message": "hello"}), questions)
    find_all(browser, "[name=remove-option]", cards(browser)[0])[-1].click()  # one option left
    assert len(find_all(browser, "[name=option-label]", cards(browser)[0])) == 1
    submit_with_keyboard(browser)
    wait_for_outcome(browser)
    direct = httpx.post(f"{server.url}/v1/systemone", timeout=30,
                        json={"model": DEMO["model"], "state": {"message": "hello"}, "questions": questions})
    assert direct.status_code == 422
    message = direct.json()["detail"][0]["msg"]
    error = find(browser, "#answers .error")
    assert error.get_attribute("data-status") == "422"
    assert message in error.text and "422" in error.text
    assert find_all(browser, "#answers article.answer") == []
    field_error = find(browser, ".field-error", cards(browser)[0])  # next to the question it names
    assert field_error.is_displayed() and field_error.text == f"criteria: {message}"
    browser.screenshot(ARTIFACTS / "console-invalid-request.png", full_page=True)


def test_a_wrong_key_shows_the_401_message_and_no_answers(browser: Browser, auth_server: str) -> None:
    open_console(browser, auth_server)
    assert "API key" in text_of(browser, "#engine")  # the status route is behind the key too
    type_into(find(browser, "#api-key"), "not-the-key")
    submit_with_keyboard(browser)
    wait_for_outcome(browser)
    direct = httpx.post(f"{auth_server}/v1/systemone", json=DEMO, timeout=30,
                        headers={"Authorization": "Bearer not-the-key"})
    assert direct.status_code == 401
    error = find(browser, "#answers .error")
    assert error.get_attribute("data-status") == "401"
    assert direct.json()["detail"]["message"] in error.text
    assert "authentication_error" in error.text
    assert find_all(browser, "#answers article.answer") == []
    # with the right key the same page answers, and the key stays in this tab's session storage only
    type_into(find(browser, "#api-key"), KEY)
    submit_with_keyboard(browser)
    browser.wait(lambda d: find_all(browser, "#answers article.answer"), timeout=60)
    assert browser.js("return sessionStorage.getItem('clef-console.api-key')") == KEY
    assert browser.js("return localStorage.length") == 0 and browser.js("return document.cookie") == ""


def test_markup_in_states_and_names_is_shown_as_text(browser: Browser, server: ServerProcess) -> None:
    state = {"note": HOSTILE_IMG, "html": HOSTILE_SCRIPT}
    questions = {
        HOSTILE_IMG: {"type": "choice", "instructions": HOSTILE_SCRIPT,
                      "criteria": {HOSTILE_IMG: HOSTILE_SCRIPT, HOSTILE_SCRIPT: HOSTILE_IMG}},
        "level": {"type": "score", "criteria": [HOSTILE_IMG, HOSTILE_SCRIPT]},
    }
    open_console(browser, server)
    wait_for_demo_example(browser)
    build_request(browser, json.dumps(state), questions)
    submit_with_keyboard(browser)
    wait_for_outcome(browser)
    shown = shown_answers(browser)
    assert [a["id"] for a in shown] == list(questions)
    assert {b["label"] for b in shown[0]["bars"]} == {HOSTILE_IMG, HOSTILE_SCRIPT}
    assert {b["label"] for b in shown[1]["bars"]} == {f"0 · {HOSTILE_IMG}", f"1 · {HOSTILE_SCRIPT}"}
    assert browser.js("return typeof window.__pwned") == "undefined"
    assert browser.js("return document.querySelectorAll('main img, main script').length") == 0
    assert browser.js("return document.querySelector('#state').value") == json.dumps(state)
    assert browser.errors() == []  # not even a blocked inline handler
    browser.screenshot(ARTIFACTS / "console-markup-as-text.png", full_page=True)
    assert not [url for url in browser.requests if url.rstrip("/").endswith("/x")]


def test_the_engine_panels_request_counter_rises(browser: Browser, server: ServerProcess) -> None:
    open_console(browser, server)
    before = requests_shown(browser)
    for i in range(3):
        body = {**DEMO, "state": {**DEMO["state"], "message": f"counter test {i}"}}
        assert httpx.post(f"{server.url}/v1/systemone", json=body, timeout=60).status_code == 200
    browser.wait(lambda d: requests_shown(browser) >= before + 3, timeout=10,
                 message="the request counter did not rise")
    assert requests_shown(browser) == before + 3
    assert float(text_of(browser, "#stat-rps")) > 0
    assert browser.js("return document.querySelectorAll('#engine svg.chart rect.bar-ok').length") > 0
    panel = text_of(browser, "#audit-panel")  # the server runs the live audit by default (1%)
    assert panel is not None and "fraction1.0%" in panel and "enabledtrue" in panel
    assert re.search(r"tolerance\d\.\d\de-\d|tolerance0\.0+[1-9]", panel), panel  # not rounded to 0


def test_images_are_off_with_the_reason_while_the_server_takes_none(browser: Browser,
                                                                    server: ServerProcess) -> None:
    open_console(browser, server)
    browser.wait(lambda d: "Images are off" in text_of(browser, "#image-note"))
    reason = httpx.get(f"{server.url}/v1/status", timeout=10).json()["images"]["reason"]
    assert reason in text_of(browser, "#image-note")
    assert browser.js("return document.querySelector('#image-input').disabled") is True


def tiny_png(width: int = 3, height: int = 2) -> bytes:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    rows = b"".join(b"\x00" + bytes([200, 30, 60]) * width for _ in range(height))
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows))
            + chunk(b"IEND", b""))


ENGINE_STATS = dict.fromkeys(
    ("running", "waiting", "kv_blocks_total", "kv_blocks_free", "gdn_slots_total", "gdn_slots_free",
     "kv_bytes", "gdn_bytes", "tokens_per_second", "prefill_tokens", "steps", "finished", "cancelled",
     "failed", "rejected"), 0)


class AuditingBackend(FakeBackend):
    def stats(self) -> dict[str, Any]:
        return {**ENGINE_STATS, "audit": {
            "match": 1234, "mismatch": 0, "skipped": 7, "skipped_because": {"no_pixels": 7},
            "fail_ready_after": 0, "reference_seconds": 12.345,
            "max_difference": {"buckets": [[1e-7, 1000], ["+Inf", 1234]], "sum": 2.468e-4, "count": 1234}}}


def test_the_audit_panel_appears_with_the_backends_audit_counters(browser: Browser) -> None:
    with in_process_server(AuditingBackend(), EngineConfig()) as url:
        open_console(browser, url)
        browser.wait(lambda d: text_of(browser, "#audit-panel") is not None, timeout=10)
        panel = text_of(browser, "#audit-panel")
        assert "match1,234" in panel and "mismatch0" in panel and "skipped7" in panel
        assert "skipped: no pixels7" in panel and "fail ready afternever" in panel
        assert "reference seconds12.3 s" in panel and "mean largest difference2.00e-7" in panel
        assert "sum" not in panel and "bucket" not in panel


def test_the_whole_flow_works_from_the_keyboard(browser: Browser) -> None:
    from selenium.webdriver.common.keys import Keys

    with in_process_server(FakeBackend("kbd-model"), EngineConfig()) as url:
        open_console(browser, url)
        while cards(browser):
            find(browser, "[name=remove-question]", cards(browser)[0]).send_keys(Keys.ENTER)
        find(browser, "#add-noul").send_keys(Keys.ENTER)
        focused = browser.driver.switch_to.active_element
        assert focused.get_attribute("name") == "question-id"  # the new question's id, ready to type
        focused.send_keys(Keys.CONTROL, "a")
        # id -> type -> remove -> instructions
        focused.send_keys("is_urgent", Keys.TAB, Keys.TAB, Keys.TAB, "Is it urgent?")
        browser.driver.switch_to.active_element.send_keys(Keys.CONTROL, Keys.ENTER)
        browser.wait(lambda d: find_all(browser, "#answers article.answer"), timeout=20)
        assert [a["id"] for a in shown_answers(browser)] == ["is_urgent"]
        assert browser.js("return document.querySelector('[name=instructions]').value") == "Is it urgent?"


class ImageBackend(FakeBackend):
    def image_support(self) -> dict[str, Any]:
        return {"supported": True, "max_images": 2, "max_image_bytes": 1 << 20}


@pytest.fixture
def image_server() -> Iterator[str]:
    """A server whose (fake) backend says it takes images."""
    with in_process_server(ImageBackend(), EngineConfig()) as url:
        yield url


def test_picked_images_become_data_urls_with_thumbnails(browser: Browser, image_server: str,
                                                         tmp_path) -> None:
    png = tiny_png()
    picture = tmp_path / "ticket-photo.png"
    picture.write_bytes(png)
    browser.open(image_server + "/")
    browser.wait(lambda d: browser.js("return document.querySelector('#image-input').disabled") is False)
    find(browser, "#image-input").send_keys(str(picture))
    browser.wait(lambda d: find_all(browser, "#image-list img"))
    thumbnail = find(browser, "#image-list img")
    data_url = "data:image/png;base64," + base64.b64encode(png).decode()
    assert thumbnail.get_attribute("src") == data_url and thumbnail.get_attribute("alt") == picture.name
    assert curl_body(snippet(browser, "curl"))["images"] == [data_url]
    find(browser, f"[aria-label='Remove image {picture.name}']").click()
    assert "images" not in curl_body(snippet(browser, "curl"))
    assert browser.errors() == []


class VisionBackend(ImageBackend):
    def stats(self) -> dict[str, Any]:
        return {**ENGINE_STATS, "images_encoded": 12, "patches_encoded": 4800, "vision_seconds": 3.25,
                "encoder_cache_hits": 6, "encoder_cache_misses": 2, "encoder_cache_evictions": 0,
                "encoder_cache_bytes": 3 << 20, "encoder_cache_budget_bytes": 256 << 20}

    def image_support(self) -> dict[str, Any]:
        return {**super().image_support(), "max_body_bytes": 9 << 20}


def test_the_vision_panel_shows_the_tower_and_its_encoder_cache(browser: Browser) -> None:
    with in_process_server(VisionBackend(), EngineConfig()) as url:
        open_console(browser, url)
        browser.wait(lambda d: text_of(browser, "#vision-panel") is not None, timeout=10)
        panel = text_of(browser, "#vision-panel")
        assert "pictures encoded12" in panel and "patches4,800" in panel, panel
        assert "encoder cache hit rate75.0%" in panel and "encoder cache hits · misses6 · 2" in panel, panel
        # the picker's limit is the body limit with images, not --max-body-bytes
        browser.wait(lambda d: "Up to 2 images" in text_of(browser, "#image-note"))
        assert "(9.0 MiB per request)" in text_of(browser, "#image-note")
        assert browser.errors() == []


def test_screenshots_at_1280_and_390_pixels(browser: Browser, server: ServerProcess) -> None:
    shots = []
    try:
        for scheme in ("light", "dark"):
            browser.color_scheme(scheme)
            browser.set_size(1280, 900)
            open_console(browser, server)
            wait_for_demo_example(browser)
            find(browser, "#submit").click()
            wait_for_outcome(browser)
            assert len(shown_answers(browser)) == 3
            background = browser.js("return getComputedStyle(document.body).backgroundColor")
            browser.js("document.activeElement.blur(); window.scrollTo(0, 0)")
            shots.append(browser.screenshot(ARTIFACTS / f"console-1280-{scheme}.png"))
            shots.append(browser.screenshot(ARTIFACTS / f"console-1280-{scheme}-full.png", full_page=True))
            browser.set_size(390, 844)
            assert browser.js("return document.documentElement.scrollWidth") <= 390  # nothing wider than 390
            shots.append(browser.screenshot(ARTIFACTS / f"console-390-{scheme}-full.png", full_page=True))
            if scheme == "light":
                light = background
            else:
                assert background != light  # the dark scheme follows the system's preference
    finally:
        browser.color_scheme("light")
        browser.set_size(1280, 900)
    for shot in shots:
        assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    print(f"console screenshots: {ARTIFACTS}")
