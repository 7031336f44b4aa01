"""What the weight push asks of each engine besides the broadcast: its layout in the group, and
the weight-update session every update runs in (SGLang 0.5.23).

Layout (`engine_ranks`, read from GET /server_info's server args): SGLang numbers an engine's
ranks in the update group `rank_offset + tp_rank` (srt/model_executor/model_runner_components/
weight_updater.py: init_weights_update_group), so an engine adds `tp_size` ranks. Pipeline
stages get no rank of their own and data-parallel replicas are refused outright
(srt/managers/tokenizer_control_mixin.py: init/destroy/update_weights... assert
`dp_size == 1`, an HTTP 500): an engine with pp_size > 1 or dp_size > 1 is refused at connect
(`EngineLayoutError`). Attention DP lives inside the TP ranks (srt/arg_groups/parallel_hook.py:
tp_size % attn_dp_size == 0) and adds none; 0.5.23 reports its width as `attn_dp_size` with
`dp_size` the replicas, while the deprecated spelling `dp_size N` + `enable_dp_attention` means
attention-DP width N and one replica (parallel_hook.py: handle_deprecated_dp_attention).

Sessions (`UpdateSessions`): srt/managers/scheduler_components/weight_updater.py answers an
update from distributed (or from tensor) outside a session with success false, before it joins
the broadcast, so the learner would broadcast into a group that member never entered. Every push
therefore sends POST /begin_weight_update {} to each member before its first bucket and
POST /end_weight_update {} after its last, also when the push fails midway. A 404 on begin is a
server older than the feature: that engine is pushed to without sessions (logged once per URL,
counted each push). Any other refusal of begin fails the push before a broadcast starts, but one:
a session left open (a learner that died in a push) answers begin with 400 "already open"; it is
ended and begun again (logged, counted).
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

from slime_async.actors.engine.client import EngineClient, EngineError, EngineRequestError

log = logging.getLogger(__name__)


class PushError(RuntimeError):
    """A push step failed on an engine; the message names the engine URL and the step."""

    def __init__(self, url: str, step: str, message: str):
        super().__init__(f"weight push, step {step}, engine {url}: {message}")
        self.url, self.step = url, step


class EngineLayoutError(PushError):
    """An engine whose layout SGLang's weight-update group does not cover (a configuration
    error: the push refuses it at connect and does not retry)."""


def engine_layout(info: dict[str, Any]) -> tuple[int, int, int, int]:
    """(tp, pp, dp replicas, attention-DP width) from an engine's /server_info."""
    tp = int(info.get("tp_size") or 1)
    pp = int(info.get("pp_size") or 1)
    dp = int(info.get("dp_size") or 1)
    if "attn_dp_size" in info:  # SGLang 0.5.23: dp_size counts replicas
        attn_dp = int(info.get("attn_dp_size") or 1)
    elif info.get("enable_dp_attention"):  # the deprecated spelling: dp_size is the width
        attn_dp, dp = dp, 1
    else:
        attn_dp = 1
    return tp, pp, dp, attn_dp


def engine_ranks(url: str, info: dict[str, Any]) -> int:
    """Ranks an engine adds to the weight group (its tp_size); raises EngineLayoutError for a
    layout SGLang's update group does not cover (see the module docstring)."""
    tp, pp, dp, attn_dp = engine_layout(info)
    why = []
    if pp > 1:
        why.append(
            "pipeline stages get no ranks of their own in SGLang's weight-update group "
            "(rank = rank_offset + tp_rank), so the stages would not all receive the weights"
        )
    if dp > 1:
        why.append(
            "SGLang refuses data-parallel replicas in init/update/destroy of the group "
            "(assert dp_size == 1: HTTP 500); start one engine per replica instead"
        )
    if why:
        layout = f"tp_size={tp}, pp_size={pp}, dp_size={dp}" + (
            f", attn_dp_size={attn_dp}" if attn_dp > 1 else ""
        )
        raise EngineLayoutError(
            url, "connect", f"refused: its layout ({layout}) cannot take the push: {'; '.join(why)}"
        )
    return tp


class UpdateSessions:
    """Opens and ends the weight-update session of each member around one push.

    `submit` runs a coroutine on the pusher's event-loop thread; `clients` are the pusher's."""

    def __init__(
        self,
        clients: dict[str, EngineClient],
        submit: Callable[[Coroutine], concurrent.futures.Future],
        timeout_s: float,
        end_timeout_s: float = 30.0,
    ):
        self.clients = clients
        self.submit = submit
        self.timeout_s = timeout_s
        self.end_timeout_s = end_timeout_s
        self.sessionless: set[str] = set()
        """Engines that answered 404 on /begin_weight_update (older servers)."""
        self.counts = {"opened": 0, "ended": 0, "end_failures": 0, "skipped": 0, "reclaimed": 0}
        """opened / ended: sessions begun / ended; end_failures: ends that failed or could not
        be sent (each logged); skipped: pushes to an engine without the session routes;
        reclaimed: sessions found open at begin (left by a failed push) and ended first."""

    def _results(
        self, call: str, urls: list[str], timeout_s: float
    ) -> dict[str, BaseException | None]:
        """Send `call` to every engine at once: url -> None (done) or the error."""
        futs = {u: self.submit(getattr(self.clients[u], call)()) for u in urls}
        deadline = time.monotonic() + timeout_s
        out: dict[str, BaseException | None] = {}
        for url, f in futs.items():
            try:
                f.result(timeout=max(0.0, deadline - time.monotonic()))
                out[url] = None
            except concurrent.futures.TimeoutError:
                f.cancel()
                out[url] = TimeoutError(f"POST /{call} to {url}: no answer in {timeout_s:.0f}s")
            except Exception as e:
                out[url] = e
        return out

    def begin(self, urls: list[str]) -> list[str]:
        """Open a session on each of `urls` (those without the routes are skipped); returns the
        engines with an open session. A refusal raises PushError naming the engine and what it
        said, after the sessions this call opened are ended again."""
        skip = [u for u in urls if u in self.sessionless]
        self.counts["skipped"] += len(skip)
        results = self._results(
            "begin_weight_update", [u for u in urls if u not in skip], self.timeout_s
        )
        opened = [u for u, e in results.items() if e is None]
        for url in [u for u, e in results.items() if _already_open(e)]:
            log.warning(
                "engine %s already holds an open weight-update session (left by a push that "
                "failed or a learner that died in one): ending it and beginning again",
                url,
            )
            self.counts["reclaimed"] += 1
            self.end([url], reclaim=True)
            results.update(self._results("begin_weight_update", [url], self.timeout_s))
            if results[url] is None:
                opened.append(url)
        self.counts["opened"] += len(opened)
        for url, e in results.items():
            if isinstance(e, EngineRequestError) and e.status == 404:
                self.sessionless.add(url)
                self.counts["skipped"] += 1
                log.warning(
                    "engine %s has no /begin_weight_update (404: a server older than SGLang's "
                    "weight-update sessions): it is pushed to without sessions",
                    url,
                )
        failed = {u: e for u, e in results.items() if e is not None and u not in self.sessionless}
        if failed:
            self.end(opened)
            url, e = next(iter(failed.items()))
            said = e.message if isinstance(e, EngineError) else str(e)
            raise PushError(
                url, "begin_weight_update", f"refused ({said}); no weights were broadcast"
            )
        return opened

    def end(self, urls: list[str], skip: dict[str, str] | None = None, reclaim: bool = False):
        """End the sessions of `urls`; never raises. Engines in `skip` (url -> why: hung or
        stuck, they cannot answer) are not asked. Each failure is logged and counted; returns
        url -> what failed."""
        skip = {u: why for u, why in (skip or {}).items() if u in urls}
        results = self._results(
            "end_weight_update", [u for u in urls if u not in skip], self.end_timeout_s
        )
        failed: dict[str, str] = {u: f"not asked: {why}" for u, why in skip.items()}
        for url, e in results.items():
            if e is None:
                self.counts["ended"] += 0 if reclaim else 1
            else:
                failed[url] = e.message if isinstance(e, EngineError) else str(e)
        for url, why in failed.items():
            self.counts["end_failures"] += 1
            log.error(
                "weight push: the weight-update session of engine %s was not ended: %s", url, why
            )
        return failed


def _already_open(e: BaseException | None) -> bool:
    """SGLang's answer to a begin while a session is open (weight_updater.py: begin_weight_update)."""
    return isinstance(e, EngineRequestError) and e.status == 400 and "already open" in e.message
