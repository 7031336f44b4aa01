"""TensorBoard event files read back: every scalar of every event file in a directory."""

from __future__ import annotations

from pathlib import Path


def read_scalars(log_dir: str | Path) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value)] over all event files of `log_dir`, in file order."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.util import tensor_util

    out: dict[str, list[tuple[int, float]]] = {}
    for f in sorted(Path(log_dir).glob("events.out.tfevents.*")):
        for event in EventFileLoader(str(f)).Load():
            for v in event.summary.value:
                if v.metadata.plugin_data.plugin_name != "scalars":
                    continue
                value = float(tensor_util.make_ndarray(v.tensor).item())
                out.setdefault(v.tag, []).append((int(event.step), value))
    return out


def histogram_tags(log_dir: str | Path) -> set[str]:
    """Tags of the histograms written to `log_dir`."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    tags = set()
    for f in sorted(Path(log_dir).glob("events.out.tfevents.*")):
        for event in EventFileLoader(str(f)).Load():
            for v in event.summary.value:
                if v.metadata.plugin_data.plugin_name == "histograms":
                    tags.add(v.tag)
    return tags
