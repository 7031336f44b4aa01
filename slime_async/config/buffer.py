"""`[buffer]`: the ZeroMQ trajectory buffer (slime_async/queue/), and the rule for the addresses it
may bind (`bind_refusal`: applied by the buffer at its start and when any command loads a config)."""

import ipaddress
from typing import Literal
from urllib.parse import urlsplit

from pydantic import Field

from slime_async.config.base import Section


class CurveConfig(Section):
    """CurveZMQ keys for cross-node runs; empty means no encryption (loopback only)."""

    server_secret_key: str | None = None
    """Path of the buffer's secret key file (written by `slime-async keygen`)."""
    server_public_key: str | None = None
    """Path of the buffer's public key file; clients need it to connect."""
    client_secret_key: str | None = None
    """Path of this client's secret key file (its public key is derived from it)."""
    authorized_clients_dir: str | None = None
    """Directory of client public keys the buffer accepts; others are refused."""


class BufferConfig(Section):
    producer_endpoint: str = "tcp://127.0.0.1:5555"
    """Where generators send trajectories (ZeroMQ endpoint, tcp:// or ipc://)."""
    consumer_endpoint: str = "tcp://127.0.0.1:5556"
    """Where the learner requests batches and commits them."""
    allow_non_loopback: bool = False
    """Bind to a non-loopback address without CURVE keys (off: refuse)."""
    max_staleness: int = Field(4, ge=0)
    """The staleness bound: versions between the weights the engines hold (the version the learner
    announced after its last push) and a token's version. Admission throttles generation so a
    group started now is trained within it; `stale_policy` decides about a group that still
    crosses it. Must be >= push.interval - 1 (the engines' lag behind the learner)."""
    stale_policy: Literal["drop", "mask", "keep"] = "keep"
    """A group that crosses max_staleness anyway (a long or multi-turn rollout): "drop" it in the
    buffer (counted, and the producer is told: AckStatus.STALE), "mask" (the learner zeroes the
    loss mask of its tokens older than the bound, trains the rest), or "keep" (train on all of it;
    the bounded importance weight pi_prox/mu corrects it). "keep" is the default because it is the
    only one that does not select against long responses: a group crosses the bound because it
    took long to generate, so dropping it removes long responses from training (measured: 13
    groups dropped in one quickstart run, async responses 128 vs 192 tokens in sync mode), and
    masking removes their early tokens. Admission already keeps almost every group in bound."""
    order: Literal["oldest_first", "freshest_first"] = "oldest_first"
    """Which ready groups are delivered first."""
    capacity_trajectories: int = Field(8192, ge=1)
    """Most trajectories held at once; producers are told to wait beyond it."""
    capacity_bytes: int = Field(1 << 30, ge=1)
    """Most payload bytes held at once; producers are told to wait beyond it."""
    max_message_bytes: int = Field(64 << 20, ge=1024)
    """Largest message accepted; bigger ones are rejected with an error."""
    wal_dir: str | None = None
    """Write-ahead log directory; None disables durability (relative paths are under the run dir)."""
    wal_sync: Literal["none", "flush", "fsync"] = "flush"
    """When an appended record is made durable before its ack: OS buffer flush or fsync."""
    wal_segment_bytes: int = Field(64 << 20, ge=1 << 16)
    """Size at which the log rolls to a new segment (old fully-committed segments are deleted)."""
    wal_on_damage: Literal["refuse", "continue"] = "refuse"
    """What the buffer does at start when records of its log cannot be read (a bad checksum, bytes
    overwritten; a torn last record from a crash is normal and is cut off): "refuse" to start,
    naming the segment, the byte range, the records lost and what follows them, since
    acknowledged data may be in them; "continue" with what is readable: each damaged segment is
    kept in `<wal_dir>/damaged/` (never deleted), the losses are logged and counted, and a
    learner resuming past batches the buffer no longer holds is told which."""
    wal_reserve_bytes: int = Field(16 << 20, ge=0)
    """Disk space the log keeps allocated in `<wal_dir>/reserve` and gives back when the disk
    fills, so that delivering and committing what the buffer holds still works while puts are
    refused ("WAL disk full"). Puts are accepted again once it can be allocated again with as
    much space left beside it. 0: no reserve."""
    wal_low_space_bytes: int = Field(1 << 30, ge=0)
    """A warning is logged (once, counted in the stats' `wal.low_space_warnings`) when the log's
    disk has less free space than this. 0: no warning."""
    groups_per_step: int = Field(8, ge=1)
    """Groups per learner step assumed by admission until the learner announces its own."""
    grant_timeout_s: float = Field(30.0, gt=0)
    """Admission grants of a producer silent for this long are released (it vanished)."""
    request_timeout_s: float = Field(5.0, gt=0)
    """Clients resend a request not answered within this (reconnecting first)."""
    give_up_s: float = Field(300.0, gt=0)
    """Clients raise BufferUnavailable after trying this long without any answer."""
    curve: CurveConfig = CurveConfig()
    """CurveZMQ authentication and encryption."""
    # ----- hostile input and bounded memory
    max_get_wait_s: float = Field(600.0, gt=0)
    """Longest `timeout_s` a get may ask the buffer to hold it (longer ones are refused)."""
    max_version_jump: int = Field(1000, ge=1)
    """Most versions one announcement may move the learner's clock forward (a restarted
    learner, its earlier session gone, may set any version below 2**31)."""
    max_frames: int = Field(4097, ge=2)
    """Most frames in one message (header + trajectories); beyond it the message is refused
    and its frames are discarded as they are read, never kept."""
    group_timeout_s: float = Field(900.0, gt=0)
    """An incomplete group that received no member for this long is dropped (counted,
    reason "incomplete_timeout"): it would hold admission's budget for ever."""
    producer_idle_s: float = Field(600.0, gt=0)
    """A producer id whose session disconnected and that sent nothing for this long is
    forgotten (its sequence ledger and grants; counted "producers_expired")."""
    max_producers: int = Field(4096, ge=1)
    """Most producer ids known at once; a hello beyond it is refused."""
    max_consumers: int = Field(64, ge=1)
    """Most consumer ids known at once; a request from one more is refused."""
    max_ids_per_connection: int = Field(8, ge=1)
    """Most producer (or consumer) ids one client connection may hold; one more is refused
    ("too_many_ids"). A client object uses one id; the bound keeps one connection from filling
    the id tables. Ids that stored nothing are forgotten when their connection closes."""
    peer_timeout_s: float = Field(30.0, gt=0)
    """ZeroMQ heartbeats: a client connection silent for this long is closed, so a vanished
    client's session (its producer or consumer id) is released."""
    # ----- fixed lag: clean staleness ablations
    fixed_lag: int | None = Field(None, ge=0)
    """Train every batch exactly this many versions after the policy that generated it (None:
    off, the staleness bound alone). Admission grants groups_per_step groups per version (the
    first version: (fixed_lag + 1) x groups_per_step, the batches of the first steps, whose lag
    ramps 0, 1, ..., fixed_lag - 1 since no older policy exists), the buffer delivers at version
    v only groups generated at v - fixed_lag, drops later ones ("fixed_lag_late") and groups whose
    tokens span versions ("fixed_lag_spans_versions"), and the learner holds each push, the last
    one too, until the groups of the version the engines serve have arrived, so no rollout
    crosses a weight update (the generators must run until the learner has finished: a
    generator.num_epochs that ends their data earlier stops the run at fixed_lag_timeout_s).
    Every batch makes a version, also one whose updates were all skipped (zero gradient: it keeps
    the weights). 0 is synchronous on-policy RL. Needs push.interval = 1 and max_staleness >= it.
    fixed_lag_timeout_s also bounds the learner's wait for a batch."""
    fixed_lag_timeout_s: float = Field(600.0, gt=0)
    """With fixed_lag: longest the learner waits for the groups of the current version before
    pushing the next one (the last push too), and for a batch; past it the learner stops with an
    error naming the version."""


def is_loopback(endpoint: str) -> bool:
    """True for ipc://, inproc:// and tcp:// endpoints on a loopback address."""
    scheme = endpoint.split("://", 1)[0]
    if scheme in ("ipc", "inproc"):
        return True
    host = urlsplit(endpoint).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # an interface name or "*"


def bind_refusal(cfg: BufferConfig) -> str | None:
    """Why the buffer refuses to bind `cfg`'s endpoints (None: it binds them): a non-loopback
    address without CURVE keys, unless `allow_non_loopback` says the network is trusted."""
    if cfg.curve.server_secret_key or cfg.allow_non_loopback:
        return None
    for name in ("producer_endpoint", "consumer_endpoint"):
        endpoint = getattr(cfg, name)
        if not is_loopback(endpoint):
            return (
                f"buffer.{name}={endpoint!r} is not a loopback address and no CURVE keys are "
                "configured; run `slime-async keygen DIR` and set buffer.curve.*, or set "
                "buffer.allow_non_loopback=true on a trusted network"
            )
    return None
