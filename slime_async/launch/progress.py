"""The terminal display of a run: step, ETA and the key numbers of the latest learner record.

On a TTY it is a `rich` progress bar redrawn in place; elsewhere (CI logs, `> file`) it prints
one plain line per update, at most every `min_interval_s` seconds, and always the last step:

    step 12/100 (12%) | eta 3m05s | reward 0.531 | accuracy 0.400 | staleness 1.20 | gen 1.2k tok/s | train 3.4k tok/s

With a pinned evaluation (eval.interval) the last evaluated version and its greedy and
sampled accuracy on the held-out set replace the training reward and accuracy:

    step 60/250 (24%) | eta 1m31s | eval v 50 | greedy 0.890 | sampled 0.585 | staleness 1.69 | ...
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Mapping
from typing import Any, TextIO

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Column

from slime_async import metrics as m

# (record key, label, format) in display order.
KEY_NUMBERS: tuple[tuple[str, str, str], ...] = (
    (m.EVAL_VERSION, "eval v", "{:.0f}"),
    (m.EVAL_ACC_GREEDY, "greedy", "{:.3f}"),
    (m.EVAL_ACC_SAMPLED, "sampled", "{:.3f}"),
    (m.REWARD, "reward", "{:.3f}"),
    (m.ACCURACY, "accuracy", "{:.3f}"),
    (m.STALENESS_MEAN, "staleness", "{:.2f}"),
    (m.GEN_TOKENS_PER_S, "gen", "{} tok/s"),
    (m.TRAIN_TOKENS_PER_S, "train", "{} tok/s"),
    (m.SUP_RESTARTS, "restarts", "{:.0f}"),  # present only after a role failed
)


def _si(x: float) -> str:
    for unit, scale in (("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.1f}{unit}"
    return f"{x:.0f}"


def _duration(s: float) -> str:
    s = int(max(s, 0))
    h, rem = divmod(s, 3600)
    mins, secs = divmod(rem, 60)
    return f"{h}h{mins:02d}m" if h else f"{mins}m{secs:02d}s"


def summary_text(numbers: Mapping[str, Any]) -> str:
    """`reward 0.531 | accuracy 0.400 | ...` for the key numbers present in `numbers`."""
    parts = []
    # With a pinned evaluation (eval.interval) its accuracies replace the training reward.
    skip = (m.REWARD, m.ACCURACY) if m.EVAL_VERSION in numbers else ()
    for key, label, fmt in KEY_NUMBERS:
        v = numbers.get(key)
        if key in skip:
            continue
        if isinstance(v, (int, float)) and math.isfinite(v):
            parts.append(f"{label} {fmt.format(_si(v) if 'tok/s' in fmt else v)}")
    return " | ".join(parts)


class ProgressDisplay:
    """Updated by the run loop with each new metrics record; `close()` when the run ends."""

    def __init__(
        self,
        total_steps: int,
        mode: str = "auto",
        stream: TextIO | None = None,
        min_interval_s: float = 10.0,
        start_step: int = 0,
    ):
        self.total = total_steps
        self.stream = stream or sys.stdout
        if mode == "auto":
            mode = "rich" if self.stream.isatty() else "plain"
        if mode not in ("rich", "plain", "off"):
            raise ValueError(f"progress mode {mode!r}: expected auto, rich, plain or off")
        self.mode = mode
        self.min_interval_s = min_interval_s
        self.numbers: dict[str, Any] = {}
        self.step = start_step
        self._pace_from: tuple[float, int] | None = None
        self._last_print = -math.inf
        self._bar = None
        if mode == "rich":
            # Step and ETA keep their width; the numbers take what is left and are cut at the end.
            self._bar = Progress(
                TextColumn("step"),
                MofNCompleteColumn(),
                BarColumn(bar_width=16),
                TextColumn("eta"),
                TimeRemainingColumn(),
                TextColumn(
                    "{task.fields[numbers]}",
                    table_column=Column(ratio=1, no_wrap=True, overflow="ellipsis"),
                ),
                console=Console(file=self.stream),
                expand=True,
            )
            self._task = self._bar.add_task(
                "run", total=total_steps, completed=start_step, numbers=""
            )
            self._bar.start()

    def eta_s(self) -> float | None:
        """Seconds left at the mean pace since the first step seen (None before the second):
        start-up (model loading, engines) is not a step and must not stretch the estimate."""
        if self._pace_from is None:
            return None
        t0, step0 = self._pace_from
        done = self.step - step0
        if done <= 0:
            return None
        return (time.monotonic() - t0) / done * max(self.total - self.step, 0)

    def update(self, step: int, record: Mapping[str, Any]) -> None:
        """A new record at `step`; the key numbers it carries replace the previous ones."""
        if self._pace_from is None:
            self._pace_from = (time.monotonic(), step)
        self.step = step
        self.numbers.update({k: v for k, v in record.items() if v is not None})
        if self.mode == "rich":
            self._bar.update(self._task, completed=step, numbers=summary_text(self.numbers))
        elif self.mode == "plain":
            now = time.monotonic()
            if now - self._last_print >= self.min_interval_s or step >= self.total:
                self._last_print = now
                self._print(self.line())

    def line(self) -> str:
        eta = self.eta_s()
        pct = 100 * self.step // self.total if self.total else 100
        head = f"step {self.step}/{self.total} ({pct}%) | eta {_duration(eta) if eta is not None else '?'}"
        rest = summary_text(self.numbers)
        return f"{head} | {rest}" if rest else head

    def message(self, text: str) -> None:
        """A line of text above the bar (or in the plain log): role started, died, restarted."""
        if self.mode == "rich":
            self._bar.console.print(text, markup=False, highlight=False)
        elif self.mode == "plain":
            self._print(text)

    def _print(self, text: str) -> None:
        print(text, file=self.stream, flush=True)

    def close(self) -> None:
        """Stop redrawing; later updates and messages (if any) come as plain lines."""
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
            self.mode = "plain"
