#!/usr/bin/env bash
# The paired staleness grid (docs/staleness.md, "The experiment"): lags x losses x SEEDS paired
# seeds, every point compared with on-policy (lag 0) seed by seed, with 95% intervals and a TOST
# verdict at +-MARGIN points. Resumable: the same command skips finished runs. From the repo root:
#
#   OUT=runs/staleness-grid JOBS=8 bash configs/staleness/grid.sh
#
# JOBS runs at once (each keeps about 2 cores busy: JOBS = cores / 2). SEEDS: the paired pilot
# (docs/benchmarks/2026-12-02-staleness-paired-pilot.md) says 20 resolve about +-5.6 points; the
# summary (summary.md, summary.json, plots/paired_difference.png) is written when it ends and
# can be redone alone with SUMMARY_ONLY=1. TIME_LIMIT (seconds) stops it cleanly for a resume.
set -eu
OUT=${OUT:-runs/staleness-grid}
JOBS=${JOBS:-8}
SEEDS=${SEEDS:-20}
LAGS=${LAGS:-0,2,4,8,16}
LOSSES=${LOSSES:-ppo_clip,tis,decoupled_ppo,mis,m2po,dppo,seq_mask,cispo,vcpo,mu_band}
MARGIN=${MARGIN:-2.0}
EXTRA=${EXTRA:-}
PY=${PY:-python3}
args=()
[ -n "${TIME_LIMIT:-}" ] && args+=(--time-limit "$TIME_LIMIT")
[ -n "${SUMMARY_ONLY:-}" ] && args+=(--summary-only)
REFERENCE_LOSS=${LOSSES%%,*}
# shellcheck disable=SC2086  # EXTRA is a list of KEY=VALUE overrides
exec nice -n "${NICE:-0}" $PY -m slime_async sweep \
  configs/quickstart.toml configs/staleness/arithmetic.toml $EXTRA \
  --grid buffer.fixed_lag="$LAGS" --grid algo.loss="$LOSSES" \
  --exclude "buffer.fixed_lag=0 algo.loss=${LOSSES#*,}" \
  --seeds "$SEEDS" --jobs "$JOBS" --metric eval/accuracy_sampled --target-accuracy 0.6 \
  --reference "buffer.fixed_lag=0 algo.loss=$REFERENCE_LOSS" --equivalence "$MARGIN" \
  --out "$OUT" "${args[@]}"
