"""What a batch reports while it runs and when it ends: a progress bar, or log lines with ``--quiet``."""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

log = logging.getLogger("clefserve.batch")

POSTFIX_EVERY_S = 0.5
LOG_EVERY_S = 30.0


@dataclass
class Tally:
    """Counts of this run. ``answered`` and ``errors`` are written to OUTPUT; ``failed`` (internal errors)
    and ``abandoned`` (stopped early) are not, and a rerun does them again."""

    answered: int = 0
    errors: int = 0
    failed: int = 0
    abandoned: int = 0
    skipped: int = 0  # already in OUTPUT
    duplicates: int = 0  # an id seen earlier in this input
    tokens: int = 0
    cached_tokens: int = 0

    @property
    def written(self) -> int:
        return self.answered + self.errors

    @property
    def progressed(self) -> int:
        """Records that no longer need doing in this run (what the bar counts)."""
        return self.answered + self.errors + self.duplicates

    def cached_share(self) -> float:
        return self.cached_tokens / self.tokens if self.tokens else 0.0


def _eta(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class Progress:
    def __init__(self, total: int | None, quiet: bool, log_every_s: float = LOG_EVERY_S) -> None:
        """``total``: records this run is expected to do (the input's, less those already in OUTPUT)."""
        self.total, self.quiet, self.log_every_s = total, quiet, log_every_s
        self.started = time.monotonic()
        self._shown = 0
        self._last_postfix = 0.0
        self._last_log = self.started
        self._bar: Any = None
        if not quiet:
            from tqdm import tqdm

            self._bar = tqdm(total=total, unit="rec", desc="clef-serve batch", file=sys.stderr,
                             dynamic_ncols=True, smoothing=0.05, mininterval=0.2)

    def elapsed(self) -> float:
        return max(time.monotonic() - self.started, 1e-9)

    def rates(self, tally: Tally) -> dict[str, Any]:
        elapsed = self.elapsed()
        rate = tally.progressed / elapsed
        left = None
        if self.total is not None and rate > 0:
            left = max(0, self.total - tally.progressed) / rate
        return {"done": tally.progressed, "total": self.total, "records_per_s": round(rate, 2),
                "tokens_per_s": round(tally.tokens / elapsed, 1),
                "cached_share": round(tally.cached_share(), 4), "errors": tally.errors,
                "failed": tally.failed, "eta_s": None if left is None else round(left)}

    def update(self, tally: Tally) -> None:
        now = time.monotonic()
        if self._bar is not None:
            new = tally.progressed - self._shown
            if new:
                self._bar.update(new)
                self._shown = tally.progressed
            if now - self._last_postfix >= POSTFIX_EVERY_S:
                self._last_postfix = now
                self._bar.set_postfix_str(self._postfix(tally), refresh=False)
        elif now - self._last_log >= self.log_every_s:
            self._last_log = now
            r = self.rates(tally)
            log.info("progress %d/%s records, %.1f records/s, %.0f tokens/s, %.0f%% cached, %d errors, "
                     "ETA %s",
                     r["done"], r["total"] if r["total"] is not None else "?", r["records_per_s"],
                     r["tokens_per_s"], 100 * r["cached_share"], r["errors"], _eta(r["eta_s"]), extra=r)

    def _postfix(self, tally: Tally) -> str:
        r = self.rates(tally)
        text = f"{r['tokens_per_s']:,.0f} tok/s, {100 * r['cached_share']:.0f}% cached, {tally.errors} errors"
        return text + (f", {tally.failed} failed" if tally.failed else "")

    def close(self, tally: Tally) -> None:
        if self._bar is not None:
            self.update(tally)
            self._bar.set_postfix_str(self._postfix(tally), refresh=True)
            self._bar.close()

    def summary(self, tally: Tally) -> tuple[str, dict[str, Any]]:
        """One line for people and the same numbers as fields."""
        elapsed = self.elapsed()
        fields = {**asdict(tally), "elapsed_s": round(elapsed, 3),
                  "records_per_s": round(tally.progressed / elapsed, 2),
                  "tokens_per_s": round(tally.tokens / elapsed, 1),
                  "cached_share": round(tally.cached_share(), 4)}
        parts = [f"{tally.answered:,} answered", f"{tally.errors:,} errors"]
        if tally.skipped:
            parts.append(f"{tally.skipped:,} already in OUTPUT (skipped)")
        if tally.duplicates:
            parts.append(f"{tally.duplicates:,} repeated ids (skipped)")
        if tally.failed:
            parts.append(f"{tally.failed:,} FAILED with internal errors (not written)")
        if tally.abandoned:
            parts.append(f"{tally.abandoned:,} abandoned (not written)")
        text = (f"clef-serve batch: {', '.join(parts)} in {elapsed:.1f} s; "
                f"{fields['records_per_s']:,.1f} records/s, {fields['tokens_per_s']:,.0f} tokens/s, "
                f"{100 * fields['cached_share']:.1f}% of tokens from the prefix cache")
        return text, fields
