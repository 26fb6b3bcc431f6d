"""Rebuild docs/console.png, the README's picture of the console answering the demo ticket.

Starts the server on the demo model, sends the demo ticket a few times (so the engine panel's charts have a
minute to show), opens the console in headless Chromium at 1280 px, asks the preloaded ticket and saves the
top of the page. Needs the browser: ``bash scripts/install_browser.sh``.

    python scripts/console_screenshot.py [--out docs/console.png]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import httpx

from clefserve.testing.browser import Browser
from clefserve.testing.server_process import ROOT, ServerProcess

MAX_BYTES = 200_000  # the README picture stays under 200 KB


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "console.png")
    parser.add_argument("--height", type=int, default=860)
    args = parser.parse_args()
    demo = json.loads((ROOT / "clefserve" / "console" / "demo-request.json").read_text())
    with tempfile.TemporaryDirectory() as tmp, \
            ServerProcess(None, Path(tmp) / "server.log", "--log-level", "warning") as server:
        for i in range(12):  # a little traffic for the charts
            body = {**demo, "state": {**demo["state"], "message": f"{demo['state']['message']} ({i % 3})"}}
            httpx.post(f"{server.url}/v1/systemone", json=body, timeout=60).raise_for_status()
            time.sleep(0.4)
        with Browser(1280, args.height) as browser:
            browser.color_scheme("light")
            browser.set_size(1280, args.height)
            browser.open(server.url + "/")
            browser.wait(lambda d: browser.js(
                "return [...document.querySelectorAll('#questions [name=question-id]')].map(e => e.value)")
                == list(demo["questions"]))
            browser.js("document.querySelector('#submit').click()")
            browser.wait(lambda d: browser.js(
                "return document.querySelectorAll('#answers .answer').length") == 3, timeout=60)
            time.sleep(2.5)  # one engine refresh that counts the console's own request
            browser.js("document.activeElement.blur(); window.scrollTo(0, 0)")
            browser.screenshot(args.out)
    size = args.out.stat().st_size
    print(f"wrote {args.out} ({size / 1024:.0f} KiB)")
    if size > MAX_BYTES:
        print(f"too large for the README: over {MAX_BYTES:,} bytes")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
