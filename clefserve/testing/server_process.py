"""A real ``clef-serve`` process on a free loopback port, for tests and benchmarks."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]


class ServerFailed(RuntimeError):
    """The server exited, failed to load, or did not turn ready in time; the message holds its log."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerProcess:
    def __init__(
        self, folder: Path | None, log: Path, *extra: str, threads: int = 1, env: dict[str, str] | None = None
    ) -> None:
        """``folder`` None serves the embedded demo model (no ``--w``)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        weights = [] if folder is None else ["--w", str(folder)]
        command = [sys.executable, "-m", "clefserve.cli", *weights, "--p", str(self.port),
                   "--host", "127.0.0.1", *extra]
        environment = {k: v for k, v in os.environ.items() if not k.startswith(("TYPESAFE_", "CLEF_"))}
        environment["OMP_NUM_THREADS"] = str(threads)
        environment.update(env or {})
        with log.open("wb") as out:
            self.process = subprocess.Popen(
                command, cwd=ROOT, env=environment, stdout=out, stderr=subprocess.STDOUT
            )

    def _probe_ready(self) -> httpx.Response | None:
        """``GET /ready``, or None while nothing listens; :class:`ServerFailed` once the process exited."""
        if self.process.poll() is not None:
            code = self.process.returncode
            raise ServerFailed(f"clef-serve exited with {code}:\n{self.log.read_text()}")
        try:
            return httpx.get(f"{self.url}/ready", timeout=2)
        except httpx.TransportError:
            return None

    def wait_ready(self, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            response = self._probe_ready()
            if response is not None:
                if response.status_code == 200:
                    return
                if "failed" in response.json().get("reason", ""):
                    raise ServerFailed(f"clef-serve could not load: {response.text}\n{self.log.read_text()}")
            time.sleep(0.1)
        raise ServerFailed(f"clef-serve not ready after {timeout_s}s:\n{self.log.read_text()}")

    def wait_refusal(self, text: str, timeout_s: float = 120) -> str:
        """Poll ``/ready`` until its 503 reason contains ``text``; the last reason (also on timeout). A 200
        on the way, or the process exiting, is :class:`ServerFailed`: this server must never turn ready."""
        deadline, reason = time.monotonic() + timeout_s, ""
        while time.monotonic() < deadline:
            response = self._probe_ready()
            if response is None:
                time.sleep(0.2)
                continue
            if response.status_code != 503:
                raise ServerFailed(f"/ready answered {response.status_code}:\n{self.log.read_text()[-3000:]}")
            reason = response.json().get("reason", "")
            if text in reason:
                break
            time.sleep(0.2)
        return reason

    def stop(self) -> int:
        self.process.terminate()
        try:
            return self.process.wait(15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait(5)

    def __enter__(self) -> ServerProcess:
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
