"""Learner side of the weight push: rank 0 broadcasts HF-named tensors to every engine.

    connect():  destroy the previous group (this pusher's, or a dead learner's named in
                `state_path`) on every engine, then with a FRESH group name:
                POST /init_weights_update_group (live engines, concurrently) while this process
                hosts the TCPStore at master_addr:master_port; group = 1 + sum(engine ranks)
    push(buckets, version):
        check the engines (GET /model_info): one that restarted (its weight_version is not the
        last pushed one) or came back, or one that is gone -> rebuild the group with the live ones
        POST /pause_generation {mode}                       abort (default) | retract | in_place
        abort, retract: poll POST /flush_cache until 200    (bounded: push.flush_timeout_s)
        POST /begin_weight_update {}                        (404: an older server, no session)
        per bucket: POST /update_weights_from_distributed {names, dtypes, shapes, group_name,
                    flush_cache: false, weight_version (last bucket only)} to all members, and
                    while those calls are in flight broadcast(src=0) each tensor in `names` order
        POST /end_weight_update {}                          (always, also after a failure)
        POST /continue_generation

Why this order (SGLang 0.5.23): a flush fails while requests run, and an update asked to flush
whose flush fails answers 400 with the weights loaded but the old cache kept (srt/managers/
scheduler_components/weight_updater.py: flush_cache_after_weight_update). So the update never
flushes;
the pause empties the engine first (abort: running requests end with finish reason abort and the
generator resumes them; retract: they are re-queued and recomputed after the push, nothing is
lost but the recompute), and /flush_cache is polled until it succeeds. in_place keeps running
requests and their KV cache (no flush at all; their later tokens come from the new weights and
the response's `weight_versions` spans say which). The version is sent with the last bucket only,
so an engine never reports a version it holds only part of. SGLang 0.5.23 refuses an update
outside a weight-update session, and the layout it puts in the group is `tp_size` ranks per engine
(no pipeline stages, no data-parallel replicas): `push_session.py`.

An engine on the learner's own GPU (or every engine, with push.backend = "ipc") is no member of
the group: each bucket goes to it by CUDA IPC handle, `POST /update_weights_from_tensor`, in the
same send step (`tensor_push.py`); a pool of such engines only builds no group. One that answers
404 or cannot open the handles fails that push and is in the group from its resync push on.

A failed call or a timeout names the engine and the step. An update call that fails while its
bucket is being broadcast (that member never joined the broadcast) stops the push at once: the
learner's end of the group is shut down (`WeightGroup.abort`), so every other member's receive fails
too, the group is destroyed, and the push fails naming the engine and the bucket. A push that fails midway leaves the
engines paused (their weights are mixed) and marks the group for a rebuild: `resync_needed()` is
then true and the learner pushes again, which rebuilds the group with the live engines and
continues them. The rebuild closes the learner's end of the old group FIRST (dropping every
reference, so the backend closes its connections): a member still waiting in that group's
broadcast then fails at once and serves the destroy and init calls, which SGLang runs on the same
scheduler thread; the other order leaves it blocked until its own weight-sync timeout (300 s)
while the learner waits for it. A handshake that does not complete names each engine that did
not join and what it says of itself (GET /server_info). Only SGLang's fields are used, so the
same code pushes to real SGLang servers (give it the engines' own URLs, not a router's). Each
engine's ranks come from /server_info (`push_session.engine_ranks`). Control calls carry the admin
key when one is set (`client.ADMIN_ROUTES`). Memory: one bucket at a time (the caller's iterator
produces them); HTTP calls run on a private event-loop thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import json
import logging
import socket
import threading
import time
import uuid
from collections.abc import Coroutine, Iterable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import torch

from slime_async.actors.engine.client import (
    EngineClient,
    EngineError,
    EngineRequestError,
    parse_weight_version,
)
from slime_async.actors.engine.push_session import (
    EngineLayoutError,
    PushError,
    UpdateSessions,
    engine_ranks,
)
from slime_async.actors.engine.push_watch import PushLiveness, RestartRequester, StallWatch
from slime_async.actors.engine.tensor_push import ROUTE, TensorSender, fallback_reason, flatten
from slime_async.actors.engine.weight_sync import (
    WeightGroup,
    choose_backend,
    colocated_engines,
    gpu_uuid,
    init_weight_group,
    listen_socket,
    routable_address,
)
from slime_async.config import PushConfig
from slime_async.config.engine import LivenessConfig
from slime_async.metrics import names as M

log = logging.getLogger(__name__)


__all__ = ["EngineLayoutError", "PushError", "WeightPusher", "routable_address"]


class WeightPusher:
    """Synchronous API for the learner: connect(), push(buckets, version), close()."""

    def __init__(
        self,
        urls: list[str],
        push: PushConfig,
        master_port: int | None = None,
        group_prefix: str = "slime_async_weights",
        api_key: str | None = None,
        device: str | torch.device | None = None,
        probe_timeout_s: float = 5.0,
        state_path: str | Path | None = None,
        liveness: LivenessConfig | None = None,
        request_restart: RestartRequester | None = None,
        admin_api_key: str | None = None,
    ):
        """Push to the engines at `urls` as `push` says (its backend, pause mode, group address
        and timeouts); `push.interval` and `push.bucket_bytes` are the caller's. `liveness`:
        how the engines are probed while the learner runs (`push_watch.py`); `request_restart`:
        asks the launcher to restart an engine stuck in its update call. `api_key`,
        `admin_api_key`: engine.api_key and engine.admin_api_key (control calls carry the admin
        key when it is set)."""
        if not urls:
            raise ValueError("WeightPusher needs at least one engine URL")
        self.urls = [u.rstrip("/") for u in urls]
        self.ipc_setting = push.backend if push.backend in ("auto", "ipc") else None
        """auto: engines on the learner's GPU get tensors by handle; ipc: every engine does."""
        self.auto_backend = push.backend in ("auto", "ipc")
        """Choose the backend at each (re)connect from the engines' /server_info."""
        self.backend = "gloo" if self.auto_backend else push.backend
        self.ipc: dict[str, str] = {}
        """Members pushed by handle (`tensor_push.py`), and why; the group holds the others."""
        self.sender = TensorSender(push.timeout_s)
        self.master_addr = push.master_addr or routable_address()
        self.master_port = master_port
        self.group_prefix = group_prefix
        self.device = torch.device(device or ("cuda" if push.backend == "nccl" else "cpu"))
        self.ranks: dict[str, int] = {}
        """Each engine's ranks in the group (`engine_ranks`), read once from /server_info."""
        self.infos: dict[str, dict[str, Any]] = {}
        """Each engine's /server_info as of its last (re)join (its ranks and device)."""
        self.pause_mode = push.pause_mode
        self.timeout_s = push.timeout_s
        self.flush_timeout_s = push.flush_timeout_s
        self.probe_timeout_s = probe_timeout_s
        self.resync_wait_s = push.resync_wait_s
        self.state_path = Path(state_path) if state_path else None
        self.clients = {
            u: EngineClient(
                u, api_key, timeout_s=push.timeout_s, max_retries=0, admin_api_key=admin_api_key
            )
            for u in self.urls
        }
        self.group: WeightGroup | None = None
        self.group_name: str | None = None
        self.members: list[str] = []
        self.pushed_version: str | None = None
        """The version every member holds in full (None before the first push)."""
        self._broken = False
        self._left_holding: dict[str, str] = {}
        """Engines left out while hung or stuck, and the group name they may still hold."""
        self.counters = {
            "resyncs": 0,
            "failed_pushes": 0,
            "flush_polls": 0,
            "engines_left_out": 0,
            "stopped_broadcasts": 0,
            "engines_refused": 0,
        }
        """resyncs: group rebuilds after a restart or a failure; failed_pushes: pushes that
        failed midway (each logged); flush_polls: /flush_cache answers that were 400;
        engines_left_out: pushes that left a down engine out (each logged); stopped_broadcasts:
        broadcasts stopped because a member's update call failed (each logged);
        engines_refused: engines refused at connect for their layout (each logged)."""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="weight-push-http", daemon=True
        )
        self._thread.start()
        self.liveness = PushLiveness(
            self.urls, liveness or LivenessConfig(), api_key, self._loop, request_restart
        )
        self.stall = StallWatch(push, self._stalled)
        self.sessions = UpdateSessions(self.clients, self._submit, push.timeout_s)

    # ---- plumbing ----------------------------------------------------------------------------

    def _submit(self, coro: Coroutine) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def _each(self, urls: list[str], method: str, *args: Any, **kwargs: Any):
        return {u: self._submit(getattr(self.clients[u], method)(*args, **kwargs)) for u in urls}

    def _wait(self, step: str, futs: dict[str, concurrent.futures.Future], timeout_s=None):
        """Every engine's result; the first failure or timeout raises PushError naming both. An
        engine reported hung meanwhile ends the wait at once; one whose update call outlives
        `push.timeout_s` while it answers its probes is stuck (`PushLiveness.mark_stuck`)."""
        waited = timeout_s or self.timeout_s
        deadline = time.monotonic() + waited
        self.stall.step(step, list(futs))
        out = {}
        for url, f in futs.items():
            while url not in out:
                left = deadline - time.monotonic()
                try:
                    out[url] = f.result(timeout=max(0.0, min(0.25, left)))
                except concurrent.futures.TimeoutError:
                    hung = self.liveness.hung(url)
                    if hung:
                        raise PushError(url, step, f"the engine is hung ({hung})") from None
                    if left > 0:
                        continue
                    self._timed_out(url, step, waited)
                    raise PushError(url, step, f"no answer in {waited:.0f}s") from None
                except EngineError as e:
                    if e.status is None and "Timeout" in e.message:  # the call's own timeout
                        self._timed_out(url, step, waited)
                    raise PushError(url, step, str(e)) from e
                except Exception as e:
                    raise PushError(url, step, str(e)) from e
        return out

    def _timed_out(self, url: str, step: str, waited: float) -> None:
        """An update call that outlived its timeout while the engine answers its probes: the
        engine is stuck in the group's collective (`PushLiveness.mark_stuck`)."""
        if step == "update_weights_from_distributed" and not self.liveness.hung(url):
            self.liveness.mark_stuck(url, f"its update call did not complete in {waited:.0f}s")

    def _stalled(self, urls: list[str], why: str) -> None:
        """The stall watchdog's last act: ask for restarts of the engines the push waited for."""
        for url in urls:
            if url in self.clients:
                self.liveness.mark_stuck(url, why)

    def _settle(self, step: str, futs: dict[str, concurrent.futures.Future], timeout_s: float):
        """Wait for every call, failures logged (best effort: destroy, continue)."""
        for url, f in futs.items():
            try:
                f.result(timeout=timeout_s)
            except Exception as e:  # logged, the caller goes on
                log.warning("weight push, step %s, engine %s: %s", step, url, e or type(e).__name__)

    def _probe(self) -> dict[str, str | None]:
        """url -> its weight_version (a string), or None when it does not answer (or is hung or
        stuck: then it is not asked)."""

        async def one(c: EngineClient) -> str | None:
            if self.liveness.unavailable(c.url):
                return None
            for path in ("/model_info", "/get_model_info"):  # current route, then the older one
                try:
                    info = await c.call("GET", path, timeout_s=self.probe_timeout_s, max_retries=0)
                except EngineRequestError:
                    continue
                except EngineError:
                    return None
                return str(info.get("weight_version")) if isinstance(info, dict) else None
            return None

        futs = {u: self._submit(one(c)) for u, c in self.clients.items()}
        return {u: f.result(timeout=self.probe_timeout_s + 5) for u, f in futs.items()}

    def served_versions(self) -> dict[str, int | None]:
        """url -> the weight version it serves now ("default" is 0), None when it does not answer."""
        return {
            u: parse_weight_version(v) if v is not None else None for u, v in self._probe().items()
        }

    # ---- the group ---------------------------------------------------------------------------

    def connect(self, versions: dict[str, str | None] | None = None) -> None:
        """(Re)build the group with every engine that answers: destroy first, fresh name."""
        try:
            self._connect(versions)
        finally:
            self.stall.idle()  # the stall watchdog watches a connect or a push, nothing else

    def _connect(self, versions: dict[str, str | None] | None) -> None:
        versions = versions if versions is not None else self._probe()
        live = [u for u in self.urls if versions.get(u) is not None]
        if not live:
            raise PushError(",".join(self.urls), "connect", "no engine answers GET /model_info")
        self._destroy()
        stale = self._previous_group_name()
        if stale:  # a dead learner's group: its engines would keep the name (and its ranks)
            self._settle(
                "destroy stale group", self._each(live, "destroy_weights_update_group", stale), 30
            )
        for url in [u for u in live if u in self._left_holding]:  # back after being hung
            old = self._left_holding.pop(url)
            self._settle(
                "destroy left group", self._each([url], "destroy_weights_update_group", old), 30
            )
        members, live = live, self._split_ipc(live)
        if not live:  # every engine by handle: no group
            self.group_name, self.members = None, members
            self._write_state()
            return
        ranks = self._ranks(live)
        if self.auto_backend:
            if not all(u in self.infos for u in live):
                self._server_infos([u for u in live if u not in self.infos])
            self.backend, why = choose_backend(gpu_uuid(), {u: self.infos[u] for u in live})
            self.device = torch.device("cuda" if self.backend == "nccl" else "cpu")
            log.info("weight push over %s: %s (push.backend = auto)", self.backend, why)
        world = 1 + sum(ranks)
        try:  # held from here until the store takes it over: the port cannot be taken meanwhile
            listener = listen_socket(self.master_addr, self.master_port or 0)
        except OSError as e:
            raise PushError(",".join(live), "init_weights_update_group", str(e)) from e
        port = listener.getsockname()[1]
        name = f"{self.group_prefix}_{uuid.uuid4().hex[:12]}"
        offsets = [1 + sum(ranks[:i]) for i in range(len(live))]
        futs = {
            u: self._submit(
                self.clients[u].init_weights_update_group(
                    self.master_addr, port, off, world, name, self.backend
                )
            )
            for u, off in zip(live, offsets, strict=True)
        }
        try:
            self.group = self._host_group(port, world, name, futs, listener)
        except PushError:
            raise
        except Exception as e:
            said = {u: str(f.exception()) for u, f in futs.items() if f.done() and f.exception()}
            raise PushError(
                ",".join(live),
                "init_weights_update_group",
                f"handshake at {self.master_addr}:{port} failed: {e}; engines said: {said}",
            ) from e
        self._wait("init_weights_update_group", futs)
        self.group_name, self.members = name, members
        self._write_state()
        left_out = sorted(set(self.urls) - set(live))
        log.info(
            "weight-update group %s at %s:%d: %d engines, world size %d%s",
            name,
            self.master_addr,
            port,
            len(live),
            world,
            f"; down, left out: {left_out}" if left_out else "",
        )

    def _split_ipc(self, live: list[str]) -> list[str]:
        """Choose the engines pushed by handle (logged with why); returns the group's engines.
        An engine that refused the handles before (`TensorSender.fell_back`) stays out."""
        self.ipc = {}
        if self.ipc_setting is None:
            return live
        self._server_infos([u for u in live if u not in self.infos])
        if self.ipc_setting == "ipc":
            chosen = {u: "push.backend = ipc" for u in live}
        else:
            chosen = colocated_engines(gpu_uuid(), {u: self.infos[u] for u in live})
        for url, why in chosen.items():
            refused = self.sender.stats.why_fallback.get(url)
            if refused:
                log.info(
                    "weight push to %s by broadcast: it refused the handles (%s)", url, refused
                )
            else:
                self.ipc[url] = why
                log.info("weight push to %s by handle (%s): %s", url, ROUTE, why)
        return [u for u in live if u not in self.ipc]

    def _host_group(
        self, port: int, world: int, name: str, futs, listener: socket.socket
    ) -> WeightGroup:
        """Host rank 0 of the group while the engines join; an engine whose init call fails ends
        the wait at once (named), and the wait is logged every 10 s (never silent). When the wait
        fails, the message names each engine whose init call had not returned and why, as far
        as the engine itself can tell (`_why_not_joined`)."""
        result: concurrent.futures.Future = concurrent.futures.Future()
        http_ports = {urlsplit(u).port or 80 for u in self.urls}  # `WeightGroup.abort` spares them

        def host() -> None:
            try:
                result.set_result(
                    init_weight_group(
                        self.master_addr,
                        port,
                        0,
                        world,
                        name,
                        self.backend,
                        self.device,
                        self.timeout_s,
                        keep_ports=http_ports,
                        listener=listener,
                    )
                )
            except BaseException as e:  # handed to the waiting thread
                result.set_exception(e)

        threading.Thread(target=host, name="weight-group-host", daemon=True).start()
        self.stall.step("init_weights_update_group", list(futs))
        t0 = time.monotonic()
        last_log = t0
        while True:
            try:
                return result.result(timeout=0.2)
            except concurrent.futures.TimeoutError:
                pass
            except Exception as e:  # the rendezvous here failed or timed out
                waiting = [u for u, f in futs.items() if not f.done()]
                why = "; ".join(f"{u}: {self._why_not_joined(u, name)}" for u in waiting)
                raise PushError(
                    ",".join(waiting) or ",".join(futs),
                    "init_weights_update_group",
                    f"group {name} at {self.master_addr}:{port} not formed after "
                    f"{time.monotonic() - t0:.0f}s ({e}); did not join: "
                    f"{why or 'none (every engine answered)'}",
                ) from e
            for url, f in futs.items():
                hung = None if f.done() else self.liveness.hung(url)
                if hung:
                    raise PushError(
                        url, "init_weights_update_group", f"the engine is hung ({hung})"
                    )
                if f.done() and f.exception() is not None:
                    raise PushError(
                        url,
                        "init_weights_update_group",
                        f"{f.exception()} (group store at {self.master_addr}:{port}; "
                        "push.master_addr must be reachable from the "
                        "engine's node); did not join: "
                        f"{url}: {self._why_not_joined(url, name)}",
                    )
            now = time.monotonic()
            if now - last_log >= 10:
                last_log = now
                waiting = [u for u, f in futs.items() if not f.done()]
                why = "; ".join(f"{u}: {self._why_not_joined(u, name)}" for u in waiting)
                log.warning(
                    "weight-update group %s: waited %.0fs of %.0fs at %s:%d for %s",
                    name,
                    now - t0,
                    self.timeout_s,
                    self.master_addr,
                    port,
                    why,
                )

    def _why_not_joined(self, url: str, name: str) -> str:
        """What an engine that has not answered its init call says of itself (GET /server_info
        and /model_info, short timeouts): not answering at all, busy on its scheduler thread
        (e.g. still in the collective of an earlier group: SGLang serves weight calls there one
        at a time), or in the group already while its answer is on the way."""

        async def one() -> str:
            c = self.clients[url]
            try:
                info = await c.call(
                    "GET", "/server_info", timeout_s=self.probe_timeout_s, max_retries=0
                )
            except EngineError as e:
                return f"does not answer GET /server_info ({e})"
            if not isinstance(info, dict):
                return "answers, but /server_info is not a map"
            groups = info.get("weight_groups")
            if isinstance(groups, list) and name in groups:
                return "has joined (its answer is still on the way)"
            busy = []
            if groups:
                busy.append(f"still holds groups {groups}")
            if info.get("running"):
                busy.append(f"{info['running']} requests running")
            return "its init call is queued or blocked on its scheduler thread" + (
                f" ({', '.join(busy)})" if busy else ""
            )

        try:
            return self._submit(one()).result(timeout=self.probe_timeout_s + 5)
        except Exception as e:
            return f"no answer to a status probe ({e or type(e).__name__})"

    def _ranks(self, urls: list[str]) -> list[int]:
        missing = [u for u in urls if u not in self.ranks]
        if missing:
            for u, info in self._server_infos(missing).items():
                try:
                    self.ranks[u] = engine_ranks(u, info)
                except EngineLayoutError as e:
                    self.counters["engines_refused"] += 1
                    log.error("%s", e)
                    raise
        return [self.ranks[u] for u in urls]

    def _server_infos(self, urls: list[str]) -> dict[str, dict[str, Any]]:
        infos = self._wait("server_info", self._each(urls, "get_server_info"))
        for u, info in infos.items():
            self.infos[u] = info if isinstance(info, dict) else {}
        return {u: self.infos[u] for u in urls}

    def _destroy(self) -> None:
        """Tear the group down here FIRST, then on the members. After a push that failed midway
        a member may still sit in the broadcast on its scheduler thread, where it cannot serve
        the destroy call (nor the next group's init: SGLang runs both on the same thread);
        closing our end of the group ends that broadcast with an error at once. The other order
        leaves the member busy until the destroy call's own timeout."""
        if self.group is None:
            self.members = []  # an all-IPC pool holds no group
            return
        group, self.group = self.group, None
        if self._broken:
            # After a failed push a member may still wait in a collective of this group (it took
            # a tensor the others never got): shut our connections now, whatever still holds a
            # reference to the backend (a failed broadcast's work object), so it fails at once.
            group.abort()
        try:
            group.destroy()
        except Exception as e:  # a group whose peer died may not tear down cleanly
            log.warning("destroying weight-update group %s here: %s", self.group_name, e)
        del group  # the last reference: the backend closes its connections
        gc.collect()  # ... now, also when a reference cycle held it
        # A hung or stuck member cannot serve the call (its restart drops the group anyway).
        in_group = [u for u in self.members if u not in self.ipc]
        reachable = [u for u in in_group if not self.liveness.unavailable(u)]
        for url in set(in_group) - set(reachable):
            self._left_holding[url] = self.group_name  # told to destroy it when it is back
        self._settle(
            "destroy_weights_update_group",
            self._each(reachable, "destroy_weights_update_group", self.group_name),
            30,
        )
        self.members = []

    def _previous_group_name(self) -> str | None:
        if self.state_path is None or not self.state_path.is_file():
            return None
        try:
            name = json.loads(self.state_path.read_text()).get("group_name")
        except (OSError, ValueError):
            return None
        return name if name != self.group_name else None

    def _write_state(self) -> None:
        if self.state_path is not None:
            self.state_path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.state_path.with_suffix(".tmp")
            tmp.write_text(json.dumps({"group_name": self.group_name, "members": self.members}))
            tmp.replace(self.state_path)

    def resync_needed(self) -> bool:
        """True when the group must be rebuilt and the weights pushed again now: a push failed
        midway, or an engine restarted (lost the group and the weights) or came back."""
        if self._broken:
            return True
        if not self.members or self.pushed_version is None:
            return False
        versions = self._probe()
        return self._changed(versions)

    def _changed(self, versions: dict[str, str | None]) -> bool:
        for u in self.urls:
            v = versions.get(u)
            if u in self.members and v is None:
                log.warning("engine %s does not answer: the weight group is rebuilt without it", u)
                return True
            if v is not None and u not in self.members:
                log.warning("engine %s is back: it rejoins the weight group", u)
                return True
            if u in self.members and self.pushed_version is not None and v != self.pushed_version:
                log.warning(
                    "engine %s serves version %r, not %r: it restarted; it rejoins the "
                    "weight group and gets the current weights",
                    u,
                    v,
                    self.pushed_version,
                )
                return True
        return False

    def metrics(self) -> dict[str, float]:
        """The counters as metric records (names in slime_async.metrics.names)."""
        return {
            M.PUSH_RESYNCS: float(self.counters["resyncs"]),
            M.PUSH_FAILED: float(self.counters["failed_pushes"]),
            M.PUSH_FLUSH_REFUSED: float(self.counters["flush_polls"]),
            M.PUSH_ENGINES_LEFT_OUT: float(self.counters["engines_left_out"]),
            M.PUSH_ENGINES: float(len(self.members)),
            M.PUSH_ENGINES_HUNG: float(self.liveness.watch.counts["hung"]),
            M.PUSH_ENGINES_BACK: float(self.liveness.watch.counts["back"]),
            M.PUSH_STUCK_ENGINES: float(self.liveness.counts["stuck"]),
            M.PUSH_RESTART_REQUESTS: float(self.liveness.counts["restart_requests"]),
            M.PUSH_STALLS: float(self.stall.stalls),
            M.PUSH_SESSIONS_OPENED: float(self.sessions.counts["opened"]),
            M.PUSH_SESSIONS_ENDED: float(self.sessions.counts["ended"]),
            M.PUSH_SESSION_END_FAILURES: float(self.sessions.counts["end_failures"]),
            M.PUSH_SESSIONS_SKIPPED: float(self.sessions.counts["skipped"]),
            M.PUSH_SESSIONS_RECLAIMED: float(self.sessions.counts["reclaimed"]),
            M.PUSH_STOPPED_BROADCASTS: float(self.counters["stopped_broadcasts"]),
            M.PUSH_ENGINES_REFUSED: float(self.counters["engines_refused"]),
            **self._ipc_metrics(),
        }

    def _ipc_metrics(self) -> dict[str, float]:
        s = self.sender.stats
        return {
            M.PUSH_IPC_ENGINES: float(sum(u in self.ipc for u in self.members)),
            M.PUSH_IPC_BYTES: s.bytes,
            M.PUSH_IPC_SECONDS: s.seconds,
            M.PUSH_IPC_GB_PER_S: s.last_gb_per_s,
            M.PUSH_IPC_FALLBACKS: float(s.fallbacks),
            M.PUSH_IPC_FLAT_REFUSED: float(s.flat_refused),
        }

    # ---- the push ----------------------------------------------------------------------------

    def push(
        self, buckets: Iterable[list[tuple[str, torch.Tensor]]], version: int | str
    ) -> dict[str, float]:
        """Send every bucket; the engines report `version` from this push on. Returns bytes,
        seconds, bytes_per_s, buckets, tensors, engines, failed (1.0: the push failed midway,
        the engines stay paused and `resync_needed()` is true) and the seconds of each part
        reached (`PHASES`, as `<name>_s`)."""
        t0 = time.perf_counter()
        try:
            return self._push(buckets, version, t0)
        finally:
            self.stall.idle()

    def _push(self, buckets, version: int | str, t0: float) -> dict[str, float]:
        self.stall.step("probe", self.urls)
        versions = self._probe()
        deadline = time.monotonic() + self.resync_wait_s
        while time.monotonic() < deadline and (
            all(v is None for v in versions.values())
            or any(versions[u] is None and not self.liveness.unavailable(u) for u in self.members)
        ):
            # A member just went down (restarting?), or none answers: give them resync_wait_s
            # to come back before leaving them out (an engine already left out is not waited for,
            # nor a hung or stuck one while another engine answers).
            time.sleep(0.5)
            versions = self._probe()
        if not self.members or self._broken or self._changed(versions):
            if self.members or self._broken:
                self.counters["resyncs"] += 1
            try:
                self.connect(versions)
            except EngineLayoutError:  # a configuration error: trying again would not help
                raise
            except PushError as e:  # e.g. a member hung during the handshake: try again later
                self._broken = True
                self.counters["failed_pushes"] += 1
                log.error("weight push of version %s: the group was not rebuilt: %s", version, e)
                return {"seconds": time.perf_counter() - t0, "bytes_per_s": 0.0, "failed": 1.0}
            self._broken = False
        down = [u for u in self.urls if u not in self.members]
        if down:
            self.counters["engines_left_out"] += 1
            why = {u: self.liveness.unavailable(u) or "down" for u in down}
            log.warning("pushing version %s without %s (they rejoin when back)", version, why)
        stats = {"bytes": 0.0, "buckets": 0.0, "tensors": 0.0}
        lap = _Laps(stats, t0)
        lap("probe")
        members = list(self.members)
        try:
            self._wait("pause_generation", self._each(members, "pause_generation", self.pause_mode))
            if self.pause_mode in ("abort", "retract"):
                self._flush(members)
            lap("pause")
            opened = self.sessions.begin(members)  # refused: nothing was broadcast
            lap("begin")
            try:
                self._send(buckets, str(version), members, stats)
            except BaseException:
                unavailable = {u: why for u in opened if (why := self.liveness.unavailable(u))}
                self.sessions.end(opened, skip=unavailable)  # logged, counted; the error stands
                raise
            lap("transfer")
            failed = self.sessions.end(opened)
            lap("end")
            if failed:  # the weights are in, but not finalized there: rebuilt and pushed again
                url, why = next(iter(failed.items()))
                raise PushError(url, "end_weight_update", why)
        except BaseException as e:
            self._broken = True
            self.counters["failed_pushes"] += 1
            log.error(
                "weight push of version %s failed; engines stay paused until the group is "
                "rebuilt and the weights pushed again: %s",
                version,
                e,
            )
            stats.update(seconds=time.perf_counter() - t0, bytes_per_s=0.0, failed=1.0)
            stats["engines"] = float(len(members))
            if isinstance(e, PushError | EngineError | RuntimeError):
                return stats
            raise
        self.pushed_version = str(version)
        try:
            self._wait("continue_generation", self._each(members, "continue_generation"))
            lap("continue")
        except PushError as e:  # the weights are in; the group is rebuilt and the rest continued
            self._broken = True
            self.counters["failed_pushes"] += 1
            log.error("weight push of version %s: %s; the group is rebuilt", version, e)
            stats.update(seconds=time.perf_counter() - t0, bytes_per_s=0.0, failed=1.0)
            stats["engines"] = float(len(members))
            return stats
        seconds = time.perf_counter() - t0
        stats.update(
            seconds=seconds,
            bytes_per_s=stats["bytes"] / seconds if seconds > 0 else 0.0,
            engines=float(len(members)),
            failed=0.0,
        )
        log.info(
            "pushed version %s to %d engines: %.1f MB in %d buckets, %.3f s, %.2f GB/s (ms: %s)",
            version,
            len(members),
            stats["bytes"] / 1e6,
            stats["buckets"],
            seconds,
            stats["bytes_per_s"] / 1e9,
            ", ".join(f"{p} {1e3 * stats[f'{p}_s']:.1f}" for p in PHASES if f"{p}_s" in stats),
        )
        return stats

    def _flush(self, members: list[str]) -> None:
        """Poll /flush_cache on each engine until it answers 200 (bounded, named)."""
        deadline = time.monotonic() + self.flush_timeout_s
        pending = list(members)
        delay = 0.02
        while pending:
            done = self._wait("flush_cache", self._each(pending, "flush_cache"))
            refused = [u for u in pending if not done[u]]
            self.counters["flush_polls"] += len(refused)
            pending = refused
            if not pending:
                return
            if time.monotonic() > deadline:
                raise PushError(
                    pending[0],
                    "flush_cache",
                    f"still refused (400: requests running) "
                    f"after {self.flush_timeout_s:.0f}s (push.flush_timeout_s)",
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.5)

    def _send(self, buckets, version: str, everyone: list[str], stats: dict[str, float]) -> None:
        members = [u for u in everyone if u not in self.ipc]  # the group's; the others by handle
        by_handle = [u for u in everyone if u in self.ipc]
        t0 = time.perf_counter()
        it = iter(buckets)
        bucket = next(it, None)
        while bucket is not None:
            following = next(it, None)
            number = int(stats["buckets"]) + 1
            sent = self._send_by_handle(bucket, by_handle, version if following is None else None)
            tensors = [(n, t.detach().to(self.device).contiguous()) for n, t in bucket if members]
            futs = self._each(
                members,
                "update_weights_from_distributed",
                [n for n, _ in tensors],
                [str(t.dtype).removeprefix("torch.") for _, t in tensors],
                [list(t.shape) for _, t in tensors],
                self.group_name,
                weight_version=version if following is None else None,
                flush_cache=False,
            )
            self.stall.step(f"broadcast of bucket {number}", members)
            for _, t in tensors:
                self._broadcast(t, futs, number, members)
            self._wait_by_handle(sent)
            try:
                self._wait("update_weights_from_distributed", futs)
            except PushError as e:
                cause = e.__cause__
                # NCCL broadcasts are queued on the GPU, not waited for above: a member that
                # answered without joining leaves them pending; abort the group now.
                nccl = self.group is not None and self.group.backend == "nccl"
                if nccl and isinstance(cause, EngineError) and cause.status is not None:
                    self._stop_broadcast(e.url, number, f"its update call failed: {cause}")
                raise
            nbytes = sum(t.numel() * t.element_size() for _, t in bucket)
            stats["bytes"] += nbytes
            stats["ipc_bytes"] = stats.get("ipc_bytes", 0.0) + (nbytes if by_handle else 0.0)
            stats["tensors"] += len(bucket)
            stats["buckets"] += 1
            bucket = following
        if by_handle:
            self.sender.count(stats["ipc_bytes"], time.perf_counter() - t0)

    def _send_by_handle(self, bucket, urls: list[str], version: str | None) -> dict:
        """Start one bucket's `/update_weights_from_tensor` calls; the returned calls hold the
        tensors until the engines answer (`_wait_by_handle`)."""
        if not urls:
            return {}
        named = [(n, t.detach()) for n, t in bucket]
        # flattened once for every engine that takes the format (tensor_push: one handle a bucket)
        flat = flatten(named) if any(u not in self.sender.one_by_one for u in urls) else None
        self.stall.step(f"{ROUTE} ({len(named)} tensors)", urls)
        ranks = {u: int(self.infos.get(u, {}).get("tp_size") or 1) for u in urls}
        return {
            u: self._submit(self.sender.send(self.clients[u], named, ranks[u], version, flat))
            for u in urls
        }

    def _wait_by_handle(self, sent: dict) -> None:
        """Wait for the handle calls; an engine that refuses the path (404, or the handles did
        not open there) is moved to the broadcast: the push fails here, counted and logged, and
        the resync push rebuilds the group with that engine in it."""
        if not sent:
            return
        try:
            self._wait(ROUTE.removeprefix("/"), sent)
        except PushError as e:
            why = fallback_reason(e.__cause__) if e.__cause__ is not None else None
            if why is None:
                raise
            self.sender.fell_back(e.url, why)
            raise PushError(e.url, ROUTE, f"{why}; the resync push uses the broadcast") from None

    def _broadcast(
        self, t: torch.Tensor, futs: dict[str, concurrent.futures.Future], bucket: int, members
    ) -> None:
        """Broadcast one tensor while watching the members' update calls: one that fails (that
        member answered without joining) or a member reported hung stops it at once
        (`_stop_broadcast`); waiting would block until the group's timeout. NCCL only queues the
        broadcast on the GPU (the host does not wait; `_send` watches the calls after the
        bucket)."""
        assert self.group is not None
        if self.group.backend == "nccl":
            self.group.broadcast(t)
            return
        work = self.group.broadcast_async(t)
        delay = 0.0002
        while not work.is_completed():
            for url, f in futs.items():
                if f.done() and f.exception() is not None:
                    e = f.exception()
                    said = e.message if isinstance(e, EngineError) else str(e)
                    self._stop_broadcast(url, bucket, f"its update call failed: {said}")
            hung = {u: why for u in members if (why := self.liveness.hung(u))}
            if hung:
                url, why = next(iter(hung.items()))
                self._stop_broadcast(url, bucket, f"the engine is hung ({why})")
            time.sleep(delay)
            delay = min(delay * 2, 0.02)
        failure = None
        try:
            work.wait()
        except Exception as e:
            failure = str(e)
        if failure is not None:  # raised outside the handler: no chained traceback
            # holds the group, whose connections must close when it is destroyed
            raise PushError(",".join(members), f"broadcast of bucket {bucket}", failure)

    def _stop_broadcast(self, url: str, bucket: int, why: str) -> None:
        """Stop a broadcast that a member will never receive: shut the learner's end of the
        group down (every other member's receive fails at once), destroy the group (the rebuild
        path, `_destroy`), and raise PushError naming the engine and the bucket. The next push
        rebuilds the group (`resync_needed()` is true)."""
        assert self.group is not None
        self.counters["stopped_broadcasts"] += 1
        log.error(
            "weight push: engine %s will not receive bucket %d (%s): stopping the broadcast "
            "and closing group %s",
            url,
            bucket,
            why,
            self.group_name,
        )
        self.group.abort()
        self._destroy()
        raise PushError(url, f"update_weights_from_distributed of bucket {bucket}", why)

    def close(self) -> None:
        """Destroy the group on the engines and here; stop the probes and the HTTP thread."""
        self._destroy()
        self.stall.close()
        self.liveness.close()
        if self.state_path is not None and self.state_path.is_file():
            self.state_path.unlink(missing_ok=True)
        if self._thread.is_alive():
            self._settle("close", {u: self._submit(c.close()) for u, c in self.clients.items()}, 10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)

    def __enter__(self) -> WeightPusher:
        self.connect()
        return self

    def __exit__(self, *exc) -> None:
        self.close()


PHASES = ("probe", "pause", "begin", "transfer", "end", "continue")
"""The parts of a push, in order, each timed into its stats as `<name>_s`: probe (versions
asked, the group rebuilt when needed), pause (pause_generation, and the flush after an abort or
retract), begin (the sessions opened), transfer (every bucket: broadcast and by handle), end
(the sessions closed), continue (continue_generation)."""


class _Laps:
    """Writes the seconds since the previous lap into `stats[<name>_s]`."""

    def __init__(self, stats: dict[str, float], t0: float):
        self.stats, self.last = stats, t0

    def __call__(self, name: str) -> None:
        now = time.perf_counter()
        self.stats[f"{name}_s"] = now - self.last
        self.last = now
