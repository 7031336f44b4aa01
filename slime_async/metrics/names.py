"""Every metric name that a role writes and something else reads: defined here and nowhere else.

Writers (`actors/learner/process.py`, `actors/generator/loop.py`) build their records from these
constants; readers (`slime-async run`'s progress line and summary, `slime-async plot`, the
benchmarks) look them up by the same constants. The loss's own metrics are named by
`slime_async/algos/metrics.py` (`finalize_metrics`); the ones read elsewhere are listed here.
"""

# ----- learner records: metrics/learner.jsonl, one per optimizer step ---------------------------
REWARD = "reward"
"""Mean reward of the trajectories trained on in this step."""
ACCURACY = "accuracy"
"""Share of those trajectories whose answer is correct (the reward's `correct` part, else reward > 0)."""
RESPONSE_LEN = "response_len/mean"
"""Mean response length in model tokens."""
RESPONSE_LEN_MAX = "response_len/max"
"""Longest response in model tokens."""
TRAJECTORIES = "trajectories"
"""Trajectories in the step's batch."""
STALENESS_MEAN = "staleness/mean"
"""Learner version at delivery minus the oldest model-token version, mean over trajectories."""
STALENESS_MAX = "staleness/max"
"""The largest staleness in the batch."""
STALENESS_HIST = "staleness/hist"
"""An integer histogram of the same, per trajectory."""
VERSION = "version"
"""The learner's policy version after the step."""
GROUPS_KEPT = "groups_kept"
"""Groups trained on after the algorithm's filter (e.g. DAPO's zero-variance filter)."""
GROUPS_GIVEN = "groups_given"
"""Groups the step received."""
LOSS = "loss"
GRAD_NORM = "grad_norm"
LR = "lr"
TOKENS = "tokens"
"""Loss tokens of the step (the token denominator)."""
SEQUENCES = "sequences"
TOKENS_TOTAL = "tokens_total"
"""Prompt and response tokens of the step."""
PADDING_FRAC = "padding_frac"
"""Share of the micro-batches' tokens that are padding."""
IW_MEAN = "is_weight"
"""Mean importance weight pi/mu over model tokens (losses that clip a ratio report RATIO)."""
IW_MAX = "is_weight_max"
RATIO = "ratio"
RATIO_MAX = "ratio_max"
CLIP_FRAC = "clip_frac"
LEARNER_WAIT_S = "learner/wait_s"
"""Seconds of the step spent waiting for a batch."""
LEARNER_WAIT_PCT = "learner/wait_pct"
"""The same as a % of the step's wall time."""
TRAIN_SECONDS = "train/seconds"
TRAIN_TOKENS_PER_S = "train/tokens_per_s"
PUSH_S = "push/seconds"
"""Wall time of the weight push after this step (0 when none)."""
STEP_SECONDS = "step/seconds"
LEARNER_GC_S = "learner/gc_s"
"""Seconds rank 0 spent in Python's garbage collections since the previous record (the whole
process: a collection stops every thread)."""
LEARNER_GC_LONG = "learner/gc_long"
"""Rank 0's collections so far longer than learner.gc_warning_s (each logged)."""
CHECKPOINT_S = "learner/checkpoint_s"
"""Wall time of the checkpoint saved after the previous step (in the next step's record; a
run's last checkpoint is in the learner's log only)."""
TIME_FORWARD_BACKWARD = "time/forward_backward_s"
TIME_OPTIMIZER = "time/optimizer_s"
TIME_STEP = "time/step_s"

# ----- generator records: metrics/generator<i>.jsonl; `step` is the policy version it last saw --
GEN_TOKENS_PER_S = "gen/tokens_per_s"
GENERATOR_IDLE_PCT = "generator/idle_pct"
"""% of wall time with no rollout in flight."""
GEN_INFLIGHT = "gen/inflight"
GEN_REWARD_MEAN = "gen/reward/mean"
GEN_REWARD_STD = "gen/reward/std"
GEN_RESPONSE_LEN_MEAN = "gen/response_len/mean"
GEN_RESPONSE_LEN_MAX = "gen/response_len/max"
GEN_RESUMES = "gen/resumes"
GEN_ROUTING_MISSING = "gen/routing_missing"
"""Routing replay: generations whose engine answers lacked routed experts for some tokens (or
did not fit); their trajectories carry none and the learner routes them itself (logged)."""
GEN_CACHED_PROMPT_TOKENS = "gen/cached_prompt_tokens"
"""Prompt tokens the engines served from their prefix caches (meta_info.cached_tokens) instead of
prefilling them; shared only among requests keyed by one weight version (extra_key)."""
GEN_TOKENS_OVER_CACHED_PREFIX = "gen/tokens_over_cached_prefix"
"""Output tokens of requests that took part of their prompt from an engine's prefix cache."""
GEN_PREFIX_KEY_BEHIND = "gen/prefix_key_behind"
"""Requests that took a cached prefix under the key of an older weight version than the one that
answered them (the engine was updated after the latest answer; the reused KV may be of the older
weights; each logged)."""
GEN_ENGINE_ERRORS = "gen/engine_errors"
"""Engine calls of rollouts that failed after the pool's own fail-over (the rollout is retried)."""
GEN_ENGINE_FAILOVERS = "gen/engine_failovers"
"""Engine calls the pool saw fail on one engine and sent again (to another, or after a wait)."""
GEN_ENGINES_HUNG = "gen/engines_hung"
"""Times an engine was reported hung by this generator's probes (no answer for
engine.liveness.hung_after_s; logged with its URL and what timed out), engines behind a router
included."""
GEN_ENGINES_DOWN = "gen/engines_down"
"""Times an engine was marked down by a failed request or probe (logged)."""
GEN_ENGINES_BACK = "gen/engines_back"
"""Times a down or hung engine answered 200 again and was used again (logged)."""
GEN_HUNG_CANCELLED = "gen/requests_given_up_hung"
"""Requests in flight on an engine when it was reported hung, given up and sent again elsewhere."""
GEN_ENGINE_BEHIND = "gen/engine_behind"
"""Engine answers thrown away because their tokens came from weights older than the version the
learner had announced when the call was sent (an engine that restarted from the base model, or
still holds a dead learner's weights); the call went to another engine or waited (logged)."""
GEN_GROUPS_STARTED = "gen/groups_started"
GEN_GROUPS_PUSHED = "gen/groups_pushed"
GEN_TRAJECTORIES_PUSHED = "gen/trajectories_pushed"
GEN_GROUPS_DROPPED = "gen/groups_dropped"
GEN_PLUGIN_ERRORS = "gen/plugin_errors"
GEN_ROLLOUT_RETRIES = "gen/rollout_retries"
GEN_ADMISSION_REQUESTS = "gen/admission_requests"
GEN_ADMISSION_WAIT_S = "gen/admission_wait_s"
GEN_GROUPS_STALE = "gen/groups_stale"
"""Groups the buffer stored but dropped at once as beyond max_staleness (AckStatus.STALE): counted
in gen/groups_dropped too, never in gen/groups_pushed."""
GEN_GROUPS_REDONE = "gen/groups_redone"
"""Groups whose rollout or reward failed and that were started again from their prompt."""
GEN_REWARD_RETRIES = "gen/reward_retries"
"""Reward calls that raised or timed out and were made again after a back-off."""
GEN_PLUGIN_ERROR_RATE = "gen/plugin_error_rate"
"""Share of the last generator.plugin_error_window group attempts that failed (NaN before any)."""
GEN_BUFFER_RESENDS = "gen/buffer_resends"
"""Puts and requests the producer client sent again after no answer from the buffer (logged)."""
GEN_BUFFER_BUSY = "gen/buffer_busy_replies"
"""Puts the buffer refused as full and the client sent again later (backpressure)."""
GEN_BUFFER_SEND_WAITS = "gen/buffer_send_waits"
"""Sends that waited because ZeroMQ's queue to the buffer was full (logged, bounded by give_up_s)."""

# ----- weight push (learner records; counters since the learner started) ------------------------
PUSH_RESYNCS = "push/resyncs"
"""Weight groups rebuilt after an engine restarted, came back or left, or a push failed (logged)."""
PUSH_FAILED = "push/failed"
"""Pushes that failed midway (engines left paused until the resync push; each logged)."""
PUSH_FLUSH_REFUSED = "push/flush_refused"
"""/flush_cache answers of 400 (requests still running) while the push polled for 200."""
PUSH_ENGINES_LEFT_OUT = "push/engines_left_out"
"""Pushes that left out an engine that was down (it rejoins when it answers again; logged)."""
PUSH_ENGINES = "push/engines"
"""Engines in the current weight-update group."""
PUSH_ENGINES_HUNG = "push/engines_hung"
"""Times the push's probes reported an engine hung (no answer for engine.liveness.hung_after_s;
logged with its URL and what timed out); a hung member ends the push step waiting for it."""
PUSH_ENGINES_BACK = "push/engines_back"
"""Times a down or hung engine answered the push's probes again (it rejoins at the next push)."""
PUSH_STUCK_ENGINES = "push/stuck_engines"
"""Engines whose update call never completed within push.timeout_s although they answer probes
(a member stuck in the group's collective): left out of the group and restarted through
`slime-async run` (each logged)."""
PUSH_RESTART_REQUESTS = "push/restart_requests"
"""Engine restarts the push asked `slime-async run` for (stuck engines; each logged)."""
PUSH_STALLS = "push/stalls"
"""Push steps reported as stalled: unfinished after push.report_after_s (each logged with the step
and the engines waited for)."""
PUSH_SESSIONS_OPENED = "push/sessions_opened"
"""Weight-update sessions opened (POST /begin_weight_update), one per engine and push."""
PUSH_SESSIONS_ENDED = "push/sessions_ended"
"""Weight-update sessions ended (POST /end_weight_update), also after a push that failed."""
PUSH_SESSION_END_FAILURES = "push/session_end_failures"
"""Sessions whose end failed or could not be sent (a hung engine; each logged with the engine)."""
PUSH_SESSIONS_SKIPPED = "push/sessions_skipped"
"""Pushes to an engine without the session routes (404: a server older than the feature;
logged once per engine), made without a session."""
PUSH_SESSIONS_RECLAIMED = "push/sessions_reclaimed"
"""Sessions found open at begin (left by a failed push or a dead learner), ended and begun again
(each logged)."""
PUSH_STOPPED_BROADCASTS = "push/stopped_broadcasts"
"""Broadcasts stopped because a member's update call failed (it never joined) or it hung: the
group is closed at once instead of waiting out its timeout (each logged)."""
PUSH_ENGINES_REFUSED = "push/engines_refused_layout"
"""Engines refused at connect for a layout SGLang's weight-update group does not cover
(pp_size or dp_size > 1; logged with the layout)."""

# ----- colocated weight push, tensors by handle (learner records; counters since it started) -----
PUSH_IPC_ENGINES = "push/ipc_engines"
"""Engines that get the weights by CUDA IPC handle (`/update_weights_from_tensor`), not the group."""
PUSH_IPC_BYTES = "push/ipc_bytes"
"""Bytes pushed by handle (each bucket once, however many engines took it)."""
PUSH_IPC_SECONDS = "push/ipc_seconds"
"""Seconds spent in /update_weights_from_tensor calls (summed over engines and buckets)."""
PUSH_IPC_GB_PER_S = "push/ipc_gb_per_s"
"""GB/s of the last push that went by handle (its bytes over its send step's wall time)."""
PUSH_IPC_FALLBACKS = "push/ipc_fallbacks"
"""Engines moved to the broadcast after refusing the handles (404, or they did not open there;
each logged): that push fails and its resync push uses the group."""
PUSH_IPC_FLAT_REFUSED = "push/ipc_flat_refused"
"""Engines that refused a flattened bucket (400 naming `flattened_bucket`; logged): they get the
tensors one by one, one handle each, from then on."""

# ----- buffer stats (`slime-async buffer`, `ConsumerClient.stats()`, buffer_final.json) ---------
BUF_INCOMPLETE_TIMEOUT = "incomplete_timeout"
"""Drop reason (stats `dropped`, `dropped_trajectories`): an incomplete group that received no
member for `buffer.group_timeout_s`."""
BUF_PRODUCERS_EXPIRED = "producers_expired"
"""Stats `counts`: producer ids forgotten (disconnected and silent for `buffer.producer_idle_s`)."""
BUF_CONSUMERS_EXPIRED = "consumers_expired"
"""Stats `counts`: consumer ids forgotten the same way."""
BUF_DISCONNECTS = "disconnects"
"""Stats `counts`: client connections that closed while holding an id (the id is free again)."""
BUF_VERSION_REWINDS = "version_rewinds"
"""Stats `counts`: version announcements that went back (a restarted learner's new session)."""
BUF_WAL_DAMAGED_REGIONS = "wal_damaged_regions"
"""Stats `counts`: unreadable regions of the write-ahead log the buffer started without
(`buffer.wal_on_damage = "continue"`; each logged with its segment and offsets)."""
BUF_WAL_GROUPS_LOST = "wal_groups_lost"
"""Stats `counts`: groups named by later log records whose data was in lost records."""
BUF_WAL_MAY_REPEAT = "wal_groups_may_repeat"
"""Stats `counts`: held groups whose delivery may have been among lost records (sent again)."""
BUF_WAL_DAMAGE = "wal_damage"
"""Drop reason: an incomplete group whose missing members were in lost log records."""
BUF_WAL_TORN_BYTES = "wal_torn_tail_bytes"
"""Stats `counts`: bytes of a torn last record cut off at start (a crash mid-write)."""
BUF_WAL_DISK_FULL = "wal_disk_full"
"""Refusal reason (stats `rejected`, the `Error` of a put): the log's disk is full."""
BUF_IDS_RELEASED = "ids_released"
"""Stats `counts`: ids forgotten when their connection closed (they had stored nothing)."""
BUF_IDS_EVICTED = "ids_evicted"
"""Stats `counts`: disconnected ids forgotten early to make room in a full id table."""
BUF_ADMISSION_AWAITING_LEARNER = "admission_awaiting_learner"
"""Stats `counts`: admission requests answered with no grant because the buffer restarted from
its log and the learner has not announced its version since (logged once per restart)."""
BUF_SUPERSEDED = "superseded"
"""Drop reason (`buffer.stale_policy = "drop"`): a group with a model token of a version the run
left behind (made by a learner that died after its last checkpoint; `slime_async/queue/lineage.py`)."""
BUF_SUPERSEDED_DELIVERED = "superseded_delivered"
"""Stats `counts`: groups with superseded tokens delivered under "keep" or "mask" (the learner
counts their tokens in `stale/superseded_tokens`)."""

# ----- learner records: mini-batch updates, skips, stale tokens, pi_prox -----------------------
UPDATES = "learner/updates"
"""Optimizer updates applied in this step (ppo_epochs x mini_batches, less the skipped ones)."""
SKIPPED_UPDATES = "learner/skipped_updates"
"""Prefix: `learner/skipped_updates/<reason>` counts mini-batch updates not applied this step,
by reason: empty (no trajectory on any rank), zero_gradient (Adam would still move the weights
by its momentum), non_finite (a NaN/inf gradient norm)."""
BATCH_SKIPPED = "learner/batch_skipped"
"""1 when no update of the batch was applied: the weights and the policy version did not change."""
VERSION_FRESH = "learner/fresh_version"
"""At start-up: the fresh version under which a restarted learner continues its checkpoint's
weights, because the run had used versions past the checkpoint's (the dead learner's later steps,
now superseded); absent when none was needed."""
VERSION_RESUMED_FROM = "learner/resumed_from_version"
"""At start-up, with `learner/fresh_version`: the checkpoint's version those weights had."""
LINE_POSITION = "learner/line_position"
"""Updates from version 0 to this step's version along the run's line of weights: the version
less the versions restarts left behind (equals the version in a run without restarts)."""
STALE_OVER_BOUND_TOKENS = "stale/over_bound_tokens"
"""Model tokens older than buffer.max_staleness in this step's batch (trained on under "keep")."""
STALE_SUPERSEDED_TOKENS = "stale/superseded_tokens"
"""Model tokens of a superseded version in this step's batch (weights the run left behind: no
staleness on the current line); counted within stale/over_bound_tokens, and masked with it."""
STALE_MASKED_TOKENS = "stale/masked_tokens"
"""Model tokens whose loss mask the learner zeroed (buffer.stale_policy = "mask")."""
STALE_MASKED_GROUPS = "stale/masked_groups"
"""Groups with at least one masked token."""
STALE_MASKED_LEN = "stale/masked_groups_response_len"
"""Mean response length (model tokens) of those groups' trajectories."""
STALE_MASKED_REWARD = "stale/masked_groups_reward"
"""Mean reward of those groups' trajectories."""
STALE_KEPT_LEN = "stale/kept_groups_response_len"
"""Mean response length of the other groups' trajectories (to compare with the masked ones)."""
STALE_KEPT_REWARD = "stale/kept_groups_reward"
"""Mean reward of the other groups' trajectories."""
PROX_INTERP_ERR = "prox/interp_abs_err"
"""algo.prox_source = "interpolate": mean |interpolated - exact| log pi_prox over model tokens."""
PROX_BEHAVIOR_ERR = "prox/behavior_abs_err"
"""On the same batches: mean |log mu - exact log pi_prox| (the error of taking pi_prox = mu)."""
BUFFER_DROPPED_GROUPS = "buffer/dropped_stale_groups"
"""Groups the buffer dropped as stale so far (buffer.stale_policy = "drop")."""
BUFFER_DROPPED_LEN = "buffer/dropped_stale_response_len"
"""Mean response length of the trajectories of those groups."""
BUFFER_DROPPED_REWARD = "buffer/dropped_stale_reward"
"""Mean reward of the trajectories of those groups."""
STALENESS_LEARNER_MAX = "staleness/learner_max"
"""The learner's own version before the step minus the oldest model-token version of the batch:
staleness on the learner's clock, not the buffer's (with push.interval P up to max_staleness +
P - 1; the end-to-end test checks it independently of the buffer's bookkeeping)."""
MOE_ROUTING_DIFF = "moe/routing_diff_frac"
"""learner.routing_replay: fraction of (token, MoE layer) pairs whose top-k experts under the
learner's own router differ from the ones replayed from generation, over every forward pass of
the step (pi_prox and each update; padding excluded)."""
MOE_REPLAY_TOKENS = "moe/replayed_tokens"
"""learner.routing_replay: (token, MoE layer) pairs replayed in the step, over every forward."""
MOE_REPLAY_MISSING = "moe/replay_missing_trajectories"
"""learner.routing_replay: trajectories of the step that carried no routed_experts (an engine
that did not return them); they went through the learner's own routing."""
MOE_AUX_LOSS = "moe/aux_loss"
"""learner.moe_aux_loss_coeff > 0: the load-balancing loss (before its coefficient) as
transformers computes it, averaged over the step's updates."""
MOE_Z_LOSS = "moe/z_loss"
"""learner.moe_z_loss_coeff > 0: the router z-loss (before its coefficient), averaged over the
step's updates."""
COMPILE_FALLBACKS = "learner/compile_fallbacks"
"""learner.torch_compile with the compiled layer ops in use: torch.compile'd functions of the
learner's process (its RMSNorm and RoPE, megatron's SwiGLU) that dynamo has given up recompiling
so far, past its recompile limit; each runs eagerly from then on (slower, same results)."""
CUDA_GRAPHS = "learner/cuda_graphs"
"""learner.cuda_graphs in use: the step's training micro-batches by how their model pass ran, as
`learner/cuda_graphs/<what>`: `replays` (through a captured graph) and `captures` (shapes
captured this step), both reported when 0, `eager/<reason>` when any (eagerly: `first_seen` a shape's first micro-batch, `packed`,
`shape_limit` past learner.cuda_graph_shapes, `capture_failed`)."""
PACKED_MICRO_BATCHES = "learner/packed_micro_batches"
"""Training micro-batches of the step that ran packed (several rows in one, no padding); with
learner.pack_sequences unset (auto) a mini-batch is packed when padded micro-batches would spend
at least learner.pack_min_padding of their tokens on padding."""

# ----- staleness research: fixed lag, pinned evaluation, sweeps ---------------------------------
STALENESS_LEARNER_MIN = "staleness/learner_min"
"""The learner's own version before the step minus the NEWEST model-token version of the batch:
with staleness/learner_max, the range of lags actually trained (fixed lag k: both equal k)."""
FIXED_LAG_WAIT_S = "fixed_lag/wait_s"
"""buffer.fixed_lag: seconds the learner held its push until the groups of the version the
engines serve had arrived (so no rollout crosses a weight update)."""
BUFFER_DROPPED_ALL = "buffer/dropped_groups"
"""Groups the buffer dropped so far, every reason (stale, fixed_lag_late, fixed_lag_spans_versions,
incomplete_timeout, ...; buffer_final.json `dropped` has them by reason)."""
IW_ESS = "is_weight_ess"
"""Normalised effective sample size of the behaviour weights, (sum w)^2 / (n sum w^2), in (0, 1]."""
IS_TRUNCATED_FRAC = "is_truncated_frac"
"""Share of model tokens whose behaviour weight pi_prox/mu was cut at the bound (is_mode
"truncate": clamped to is_low or is_high)."""
EVAL_HOLD_S = "eval/hold_s"
"""Seconds the learner held its push after this step until the pinned evaluation was done."""
# metrics/eval.jsonl, written by generator 0, one record per evaluated version (`step` = version)
EVAL_VERSION = "eval/version"
"""The policy version every token of every evaluation answer came from."""
EVAL_ACC_GREEDY = "eval/accuracy_greedy"
"""Share of held-out records whose greedy answer (temperature 0) is correct."""
EVAL_ACC_SAMPLED = "eval/accuracy_sampled"
"""Share of sampled answers (eval.samples per record, eval.temperature) that are correct."""
EVAL_PASS_AT_K = "eval/pass_at_k"
"""Share of records with at least one correct sampled answer (k = eval.samples)."""
EVAL_EXAMPLES = "eval/examples"
"""Held-out records evaluated."""
EVAL_RESPONSE_LEN = "eval/response_len"
"""Mean answer length in tokens (greedy and sampled)."""
EVAL_RERUNS = "eval/reruns"
"""Answers generated again because they held a token of another version (total so far)."""
EVAL_DISCARDED = "eval/discarded"
"""Evaluations discarded (the engines served a newer version before they were done; so far)."""
EVAL_SEEDS_IGNORED = "eval/seeds_ignored"
"""Engines that ignore `sampling_seed` (SGLang without deterministic inference; checked when the
generator started): above 0, the seeded sampled answers are not pinned."""
EVAL_SECONDS = "eval/seconds"
"""Wall time of the evaluation."""
EVAL_LEARNER_STEP = "eval/learner_step"
"""The learner step whose weights were evaluated (version v = after step v without skips)."""
EVAL_POSITION = "eval/line_position"
"""The evaluated version's updates from version 0 along the run's line of weights (the version
itself in a run without learner restarts; see `learner/line_position`)."""
IS_DROPPED_FRAC = "is_dropped_frac"
"""Share of model tokens whose behaviour weight was set to 0 (is_mode "mask", the `mis` loss: the
weight left [is_low, is_high]; and aipo's drops)."""
RATIO_OUTSIDE = "ratio_outside"
"""Share of model tokens whose PPO ratio (pi_theta / mu for naive ppo_clip, pi_theta / pi_prox for
the decoupled losses) lies outside [1 - eps_clip_low, 1 + eps_clip_high], whatever the advantage's
sign (clip_frac counts only those whose gradient the clip cut); per lag as `ratio_outside/lag_k`."""
SEQ_IW_ESS = "seq_is_weight_ess"
"""Normalised ESS of the whole answers' behaviour weights W_i = prod_t pi_prox / mu,
(sum W)^2 / (n sum W^2) in [1/n, 1]: what a reward on the whole answer sees (the token ESS does
not); per lag as `seq_is_weight_ess/lag_k` (an answer's lag is its oldest token's)."""
LOG_RATIO_M2 = "log_ratio_m2"
"""Second moment of the behaviour log-ratio, mean over model tokens of (log pi_prox / mu)^2
(M2PO's M2); per lag as `log_ratio_m2/lag_k`."""
SEQ_MAX_LOG_RATIO = "seq_max_log_ratio"
"""Mean over answers of each answer's largest |log pi_prox / mu| (`seq_max_log_ratio_max`: the
largest of all); per lag as `seq_max_log_ratio/lag_k`."""
LR_ESS_SCALE = "lr_ess_scale"
"""vcpo: mean over the step's updates of the factor sqrt(ESS) applied to the learning rate."""

# ----- supervisor records: metrics/supervisor.jsonl, one per role failure -----------------------
SUP_FAILURES = "supervisor/failures"
"""Role exits that were not the role finishing its work, all roles, since this supervisor
started (each one restarted or stopping the run; the reason is in logs/supervisor.log)."""
SUP_RESTARTS = "supervisor/restarts"
"""Roles restarted by `run.restart_failed`, all roles, since this supervisor started."""
SUP_ROLE_RESTARTS = "supervisor/restarts/"
"""Prefix: `supervisor/restarts/<role>` counts the restarts of one role."""
SUP_HUNG_RESTARTS = "supervisor/hung_restarts"
"""Engines restarted because they answered no probe for engine.liveness.restart_after_s (each
logged with the reason; counted in supervisor/restarts too)."""
SUP_REQUESTED_RESTARTS = "supervisor/requested_restarts"
"""Engines restarted because the learner's push asked for it (an engine stuck in its update call;
the reason is logged; counted in supervisor/restarts too)."""
SUP_ROLE_EXIT = "supervisor/exit_code/"
"""Prefix: `supervisor/exit_code/<role>`: the exit code of the failure this record is about
(negative: killed by that signal)."""

# ----- Slurm job records: metrics/slurm.jsonl, one per start of the job (`slime-async slurm`) ---
SLURM_JOB_ID = "slurm_job_id"
"""The Slurm job id (the same across requeues)."""
SLURM_RESTART_COUNT = "slurm_restart_count"
"""SLURM_RESTART_COUNT at this start: 0 the first time, n after the n-th requeue."""
SLURM_RESUMED = "slurm_resumed"
"""1 when this start resumed the run directory (`run --resume`), 0 when it started the run."""
