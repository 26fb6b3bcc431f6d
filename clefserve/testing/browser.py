"""Headless Chromium from Debian's packages, driven by Selenium: the console's tests and its screenshot.

Nothing is downloaded: the browser and its driver come from ``apt-get install -y chromium chromium-driver``
(``scripts/install_browser.sh``; ``.ci/run`` runs it), the driver from ``pip install selenium`` (the ``test``
extra). Selenium is pointed at both binaries, so its own driver manager never goes to the network.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from clefserve.testing.server_process import ROOT

INSTALL_HINT = ("install Debian's browser with 'bash scripts/install_browser.sh' as root (apt-get install -y "
                "chromium chromium-driver) and selenium with pip install -e '.[test]'")
# Screenshots and other files the tests leave for people to look at (never committed: .gitignore).
ARTIFACTS = Path(os.environ.get("CLEF_TEST_ARTIFACTS", ROOT / "test-artifacts")) / "console"
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--disable-dev-shm-usage", "--hide-scrollbars", "--force-device-scale-factor=1")


def _binary(*names: str) -> str | None:
    for name in names:
        found = shutil.which(name)
        if found:
            return found
    return None


def browser_problem() -> str | None:
    """Why no browser can be started here (with how to fix it), or None."""
    if _binary("chromium", "chromium-browser") is None or _binary("chromedriver") is None:
        return f"chromium or chromedriver is not installed: {INSTALL_HINT}"
    try:
        import selenium  # noqa: F401
    except ImportError:
        return f"selenium is not installed: {INSTALL_HINT}"
    return None


class Browser:
    """One headless Chromium with a fresh profile, logging the console and the network."""

    def __init__(self, width: int = 1280, height: int = 900) -> None:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service

        problem = browser_problem()
        if problem is not None:
            raise RuntimeError(problem)
        chromium, driver = _binary("chromium", "chromium-browser"), _binary("chromedriver")
        assert chromium is not None and driver is not None
        self.profile = tempfile.mkdtemp(prefix="clef-console-chromium-")
        options = webdriver.ChromeOptions()
        options.binary_location = chromium
        for flag in (*CHROMIUM_FLAGS, f"--user-data-dir={self.profile}", f"--window-size={width},{height}"):
            options.add_argument(flag)
        options.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
        self.driver = webdriver.Chrome(service=Service(driver), options=options)
        self.driver.set_page_load_timeout(30)
        self.console: list[dict[str, Any]] = []
        self.requests: list[str] = []

    def quit(self) -> None:
        try:
            self.driver.quit()
        finally:
            shutil.rmtree(self.profile, ignore_errors=True)

    def drain_logs(self) -> None:
        """Move the browser's console messages and the URLs it requested into ``console`` / ``requests``."""
        self.console += self.driver.get_log("browser")
        for entry in self.driver.get_log("performance"):
            message = json.loads(entry["message"])["message"]
            if message["method"] == "Network.requestWillBeSent":
                self.requests.append(message["params"]["request"]["url"])

    def reset_logs(self) -> None:
        self.drain_logs()
        self.console.clear()
        self.requests.clear()

    def errors(self) -> list[dict[str, Any]]:
        self.drain_logs()
        return [e for e in self.console if e["level"] in ("SEVERE", "ERROR")]

    def open(self, url: str) -> None:
        self.driver.get("about:blank")
        self.reset_logs()
        self.driver.get(url)

    def wait(self, condition: Callable[[Any], Any], timeout: float = 30, message: str = "") -> Any:
        from selenium.webdriver.support.ui import WebDriverWait

        return WebDriverWait(self.driver, timeout, poll_frequency=0.1).until(condition, message)

    def js(self, script: str, *args: Any) -> Any:
        return self.driver.execute_script(script, *args)

    def set_size(self, width: int, height: int) -> None:
        self.driver.set_window_size(width, height)
        # the window's outer size includes no chrome in headless mode, but make the viewport exact anyway
        self.driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", {
            "width": width, "height": height, "deviceScaleFactor": 1, "mobile": width < 600})

    def color_scheme(self, scheme: str) -> None:
        self.driver.execute_cdp_cmd("Emulation.setEmulatedMedia", {
            "features": [{"name": "prefers-color-scheme", "value": scheme}]})

    def screenshot(self, path: Path, full_page: bool = False) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        params: dict[str, Any] = {"format": "png"}
        if full_page:
            width = self.js("return document.documentElement.clientWidth")
            height = self.js("return document.documentElement.scrollHeight")
            params.update(captureBeyondViewport=True, clip={"x": 0, "y": 0, "width": width, "height": height,
                                                            "scale": 1})
        shot = self.driver.execute_cdp_cmd("Page.captureScreenshot", params)
        path.write_bytes(base64.b64decode(shot["data"]))
        return path

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc: object) -> None:
        self.quit()
