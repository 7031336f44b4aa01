"""`[push]`: the learner's weights to the engines, every `interval` versions, while generation goes on.

Learner rank 0 builds one torch.distributed group with every engine (SGLang's recipe), pauses
them, broadcasts HF-named buckets through `/update_weights_from_distributed`, sets the version and
lets them continue (`slime_async/actors/engine/weight_push.py`). Both ends read this section: the
learner for the push, an embedded engine for its side of the group.
"""

from typing import Literal

from pydantic import Field, model_validator

from slime_async.config.base import Section

STALL_MARGIN_S = 30.0
"""What one push step may take beyond its longest configured wait (a last probe round, the call
that follows); push.stall_deadline_s must leave it."""


class PushConfig(Section):
    """Learner rank 0 pauses the engines, broadcasts the weights in HF-named buckets over one
    torch.distributed group, sets the new version and lets them continue; an embedded engine
    reads `group_timeout_s` for its side of the group."""

    interval: int = Field(1, ge=1)
    """Push the weights to the engines every this many optimizer steps (must be at most
    buffer.max_staleness + 1: between pushes the engines lag the learner by interval - 1)."""
    bucket_bytes: int = Field(256 << 20, ge=1 << 10)
    """Size of one bucket of HF-named tensors broadcast per update call."""
    master_addr: str | None = None
    """Address of the weight-update group's TCP store, hosted by learner rank 0, that every engine
    dials (SGLang's master_address). None: this node's routable address (never loopback unless
    nothing else exists); `slime-async run` with engines on loopback sets 127.0.0.1."""
    backend: Literal["auto", "nccl", "gloo", "ipc"] = "auto"
    """How the weights travel. auto: an engine on the learner's own GPU gets them by CUDA IPC
    handle (`/update_weights_from_tensor`, no copy), the others by a torch.distributed broadcast:
    NCCL when the learner and every such engine are on GPUs of their own, else gloo (an engine on
    the CPU); decided at each (re)connect from the engines' /server_info and logged. ipc: every
    engine by handle (same host; CPU tensors through shared memory). An engine that refuses the
    handles (404, or they do not open there) gets the broadcast from then on (logged, counted in
    push/ipc_fallbacks). nccl needs the learner on a GPU."""
    pause_mode: Literal["abort", "retract", "in_place"] = "abort"
    """How the engines are paused for a push. abort: running requests end with finish reason
    abort (the generator resumes them); retract: they are re-queued and recomputed after the
    push; in_place: they keep running under the new weights (no cache flush, which SGLang refuses
    while requests run; per-token versions come from the response's spans)."""
    flush_timeout_s: float = Field(60.0, gt=0)
    """Longest wait for an engine's /flush_cache to answer 200 after a pause (polled)."""
    timeout_s: float = Field(300.0, gt=0)
    """Longest wait for one push call (pause, one bucket's update, continue) per engine."""
    resync_wait_s: float = Field(60.0, ge=0)
    """How long a push waits for an engine that is down (restarting) before pushing without it;
    it rejoins the weight group, with the current weights, at a later push."""
    group_timeout_s: float = Field(300.0, gt=0)
    """How long a member of the weight-update group waits for its peers (handshake and each
    broadcast)."""
    report_after_s: float = Field(30.0, gt=0)
    """A push that has not finished one of its steps (the calls to every engine, one bucket's
    broadcast) for this long is reported: logged with the step and the engines it waits for, and
    counted in push/stalls."""
    stall_deadline_s: float = Field(600.0, gt=0)
    """A push stuck in one step for this long (a collective that ignores every timeout, e.g. NCCL
    with a member that never receives) ends the learner: it logs why, asks `slime-async run` to
    restart the engines it waited for, and exits with code 75, so the supervisor restarts it
    from its checkpoint (run.restart_failed). Must exceed every bounded wait of one step."""

    @model_validator(mode="after")
    def _stall_deadline(self) -> "PushConfig":
        """The stall deadline must leave every bounded wait of one push step its time."""
        longest = max(self.timeout_s, self.flush_timeout_s, self.resync_wait_s)
        if self.stall_deadline_s < longest + STALL_MARGIN_S:
            raise ValueError(
                f"push.stall_deadline_s = {self.stall_deadline_s} must exceed the longest wait of "
                f"one push step, max(push.timeout_s, push.flush_timeout_s, push.resync_wait_s) = "
                f"{longest}, by at least {STALL_MARGIN_S:g} s (the probes and calls around that "
                "wait): a push waiting within its limits would end the learner"
            )
        if self.report_after_s >= self.stall_deadline_s:
            raise ValueError(
                f"push.report_after_s = {self.report_after_s} must be below "
                f"push.stall_deadline_s = {self.stall_deadline_s}: a stuck push is reported "
                "before the learner gives up on it"
            )
        return self
