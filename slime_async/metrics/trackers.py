"""Every role's metrics records of one job into ONE wandb run and ONE TensorBoard directory.

    tracker = JobTracker(run_dir, ["wandb", "tensorboard"], wandb_mode="offline",
                         project="slime-async", config=cfg.model_dump(mode="json"))
    tracker.poll()    # forward the records appended to metrics/*.jsonl since the last poll
    tracker.close()   # the last records, then finish the wandb run and flush the event files

The roles write their records to `<run_dir>/metrics/<role>.jsonl` only (`MetricsLogger`); the
process that supervises the job (`slime-async run`, locally or as the Ray driver) forwards them
from there. So the learner's, the generators' and the evaluation's numbers land in one wandb run
and one TensorBoard directory, each name prefixed by its role (`learner/reward`,
`generator0/generator/tokens_per_s`, `eval/...`), on one shared x axis: the policy version
(`policy_version`; the learner's record carries the version after its step, a generator's and
the evaluation's are keyed by it).

Resume: `<run_dir>/tracking.json` keeps the wandb run id, how far each metrics file has been
forwarded (byte offsets) and wandb's step counter, written after every poll that forwarded
something. `run --resume` therefore continues the same wandb run (`id` + `resume="allow"`) and the
same TensorBoard directory, sending each record once; a supervisor killed between forwarding and
writing the state sends at most that poll's records again.

wandb and TensorBoard are imported only when listed (wandb takes ~0.9 s to import on the
2-core machine). Memory: one poll's new records.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

TRACKERS = ("wandb", "tensorboard")
STATE_FILE = "tracking.json"
TENSORBOARD_DIR = "tensorboard"
POLICY_VERSION = "policy_version"
"""The shared x axis of every role's curves in wandb (TensorBoard's step is the same number)."""


def policy_version(role: str, record: Mapping[str, Any]) -> int:
    """The policy version a record belongs to: the learner's carries `version` (after its step);
    every other role keys its records by the version (`step`)."""
    v = record.get("version") if role == "learner" else None
    return int(v if isinstance(v, int | float) else record.get("step", 0))


class JobTracker:
    """Forwards `<run_dir>/metrics/*.jsonl` to the listed trackers; one per job."""

    def __init__(
        self,
        run_dir: str | Path,
        trackers: Sequence[str],
        *,
        wandb_mode: str = "offline",
        project: str = "slime-async",
        config: Mapping[str, Any] | None = None,
    ):
        unknown = sorted(set(trackers) - set(TRACKERS))
        if unknown:
            raise ValueError(f"run.trackers: unknown {unknown} (expected some of {TRACKERS})")
        if wandb_mode not in ("offline", "online", "disabled"):
            raise ValueError(f"run.wandb {wandb_mode!r}: expected offline, online or disabled")
        self.run_dir = Path(run_dir)
        self.metrics_dir = self.run_dir / "metrics"
        self.state_path = self.run_dir / STATE_FILE
        self.state: dict[str, Any] = {"offsets": {}, "wandb_step": 0}
        if self.state_path.is_file():
            self.state.update(json.loads(self.state_path.read_text()))
        self._wandb_run: Any = None
        self._tb: Any = None
        if "tensorboard" in trackers:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:
                raise ValueError(
                    'run.trackers lists "tensorboard" but the tensorboard package is missing: '
                    "pip install 'slime_async[tensorboard]'"
                ) from e
            # Appends a new event file to the directory: TensorBoard reads them all as one run.
            self._tb = SummaryWriter(log_dir=str(self.run_dir / TENSORBOARD_DIR))
        if "wandb" in trackers and wandb_mode != "disabled":
            import wandb

            self._wandb = wandb
            self.state.setdefault("wandb_id", uuid.uuid4().hex[:12])
            self._wandb_run = wandb.init(
                # wandb's own console capture would wrap the supervisor's progress display.
                settings=wandb.Settings(silent=True, console="off"),
                dir=str(self.run_dir),
                mode=wandb_mode,
                project=project,
                name=self.run_dir.resolve().name,
                id=self.state["wandb_id"],
                resume="allow",
                config=dict(config or {}),
            )
            self._wandb_run.define_metric(POLICY_VERSION)
            self._wandb_run.define_metric("*", step_metric=POLICY_VERSION)
        if self.active:
            self._save_state()

    @property
    def active(self) -> bool:
        return self._wandb_run is not None or self._tb is not None

    def describe(self) -> list[str]:
        """One line per active tracker: where its data goes."""
        lines = []
        if self._wandb_run is not None:
            run = self._wandb_run
            where = (
                f"offline in {self.run_dir / 'wandb'} (upload: wandb sync {self.run_dir}/wandb/"
                "offline-run-*)"
                if run.settings.mode == "offline"
                else f"{run.url}"
            )
            lines.append(f"wandb run {run.id} ({run.project}): {where}")
        if self._tb is not None:
            lines.append(f"TensorBoard: tensorboard --logdir {self.run_dir / TENSORBOARD_DIR}")
        return lines

    def poll(self) -> int:
        """Forward every complete record appended since the last poll; how many were sent."""
        if not self.active or not self.metrics_dir.is_dir():
            return 0
        sent = 0
        offsets = self.state["offsets"]
        for path in sorted(self.metrics_dir.glob("*.jsonl")):
            start = int(offsets.get(path.name, 0))
            if path.stat().st_size <= start:
                continue
            with open(path, "rb") as f:
                f.seek(start)
                data = f.read()
            end = data.rfind(b"\n") + 1  # an unfinished last line waits for the next poll
            for line in data[:end].splitlines():
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line torn by a crash; MetricsTail skips it too
                if isinstance(rec, dict) and isinstance(rec.get("step"), int):
                    self.emit(path.stem, rec)
                    sent += 1
            offsets[path.name] = start + end
        if sent:
            self._save_state()
            if self._tb is not None:
                self._tb.flush()
        return sent

    def emit(self, role: str, record: Mapping[str, Any]) -> None:
        """One role's record to every tracker (numbers as scalars, histogram dicts as histograms)."""
        version = policy_version(role, record)
        walltime = record.get("time")
        values = {k: v for k, v in record.items() if k not in ("step", "time")}
        if self._tb is not None:
            for key, value in values.items():
                tag = f"{role}/{key}"
                if isinstance(value, dict):
                    _tb_histogram(self._tb, tag, value, version, walltime)
                elif isinstance(value, int | float) and math.isfinite(value):
                    self._tb.add_scalar(tag, value, global_step=version, walltime=walltime)
        if self._wandb_run is not None:
            out: dict[str, Any] = {POLICY_VERSION: version}
            for key, value in values.items():
                if isinstance(value, dict):
                    if value.get("counts"):
                        counts, edges = histogram_edges(value)
                        out[f"{role}/{key}"] = self._wandb.Histogram(np_histogram=(counts, edges))
                elif value is not None:
                    out[f"{role}/{key}"] = value
            # wandb's own step counts records across roles and resumes (it must only grow);
            # the curves are drawn against policy_version.
            self.state["wandb_step"] += 1
            self._wandb_run.log(out, step=self.state["wandb_step"])

    def close(self) -> None:
        """Forward what is left, then finish the wandb run and close the event files."""
        if not self.active:
            return
        try:
            self.poll()
        finally:
            if self._wandb_run is not None:
                self._wandb_run.finish()
                self._wandb_run = None
            if self._tb is not None:
                self._tb.close()
                self._tb = None
            self._save_state()

    def _save_state(self) -> None:
        tmp = self.state_path.with_name(self.state_path.name + ".tmp")
        tmp.write_text(json.dumps(self.state, indent=1) + "\n")
        os.replace(tmp, self.state_path)


def histogram_edges(h: Mapping[str, list]) -> tuple[list[int], list[float]]:
    """(counts, bin edges) of a metrics histogram: integer values get unit bins around them."""
    counts = [int(c) for c in h["counts"]]
    if "edges" in h:
        return counts, [float(e) for e in h["edges"]]
    values = [float(v) for v in h["values"]]
    return counts, [v - 0.5 for v in values] + [(values[-1] if values else 0.0) + 0.5]


def _tb_histogram(
    writer: Any, tag: str, h: Mapping[str, list], step: int, walltime: float | None
) -> None:
    counts, edges = histogram_edges(h)
    n = sum(counts)
    if not n:
        return
    mids = [(a + b) / 2 for a, b in itertools.pairwise(edges)]
    writer.add_histogram_raw(
        tag,
        min=edges[0],
        max=edges[-1],
        num=n,
        sum=sum(c * x for c, x in zip(counts, mids, strict=True)),
        sum_squares=sum(c * x * x for c, x in zip(counts, mids, strict=True)),
        bucket_limits=edges[1:],
        bucket_counts=counts,
        global_step=step,
        walltime=walltime,
    )


def check_trackers(trackers: Sequence[str], wandb_mode: str = "offline") -> None:
    """Refuse, before anything starts, a tracker whose package is missing (wandb only when it
    will be used: `run.wandb = "disabled"` never imports it)."""
    import importlib.util

    for name, install in (("wandb", "wandb"), ("tensorboard", "'slime_async[tensorboard]'")):
        if name == "wandb" and wandb_mode == "disabled":
            continue
        if name in trackers and importlib.util.find_spec(name) is None:
            raise ValueError(
                f'run.trackers lists "{name}" but the {name} package is not installed: '
                f"pip install {install} (or drop it from run.trackers)"
            )


def job_tracker(cfg: Any, run_dir: str | Path) -> JobTracker:
    """The tracker of `cfg`'s job (`run.trackers`, `run.wandb`, `run.wandb_project`)."""
    return JobTracker(
        run_dir,
        cfg.run.trackers,
        wandb_mode=cfg.run.wandb,
        project=cfg.run.wandb_project,
        config=cfg.model_dump(mode="json"),
    )
