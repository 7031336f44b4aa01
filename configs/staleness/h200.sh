#!/usr/bin/env bash
# The staleness grid and sync-vs-async on a lent GPU host (one H200, 16 cores) in one call of a
# few minutes (docs/staleness.md, "The experiment"). Run from the repository root:
#
#   OUT=/some/dir TIME_LIMIT=300 bash configs/staleness/h200.sh
#
# 1. Pilot (device choice): the grid's on-policy point, 6 steps, once with the learner and the
#    engine on the GPU (many small runs share it) and once on the cores, both at once. The grid
#    runs where the pilot ran faster (GPU only if it took under 0.75x the cores' time).
# 2. The grid (`slime-async sweep`, JOBS points at once, stopping itself by TIME_LIMIT s) and
#    `bench/bench_async.py --parallel` (sync vs async, BENCH_STEPS steps, BENCH_CONFIG) at the
#    same time.
# 3. Summary and plots, then a tarball of everything but checkpoints and WALs in $OUT.
set -u
OUT=${OUT:-runs/h200-out}
WORK=${WORK:-runs/h200}
TIME_LIMIT=${TIME_LIMIT:-300}
JOBS=${JOBS:-6}
JOBS_CUDA=${JOBS_CUDA:-8}            # more at once when the runs are on the GPU (less CPU each)
SEEDS=${SEEDS:-3}
LAGS=${LAGS:-0,8,16}
LOSSES=${LOSSES:-ppo_clip,tis,decoupled_ppo,mis}
BENCH_STEPS=${BENCH_STEPS:-40}
EXTRA=${EXTRA:-}                       # overrides of the grid's config
MARGIN=${MARGIN:-2.0}                  # TOST margin in points against on-policy (lag 0)
# sync vs async on the quickstart's own settings (stable learning), evaluated as the grid is
BENCH_CONFIG=${BENCH_CONFIG:-"configs/quickstart.toml eval.max_examples=200 eval.samples=4"}
PY=${PY:-python3}
BASE="configs/quickstart.toml configs/staleness/arithmetic.toml"
METRIC=eval/accuracy_sampled
mkdir -p "$OUT" "$WORK"
t0=$(date +%s)
CUDA_ARGS="engine.embedded.device=cuda engine.embedded.kv_cache_tokens=16384 engine.embedded.compile=false
  engine.embedded.decode_attention=gathered learner.optimizer=master_adamw"

pilot() {  # pilot NAME ENV ARGS...: a 6-step run; its estimated seconds for the grid's steps
  local name=$1 env=$2
  shift 2
  local s=$(date +%s.%N)
  env $env timeout 150 $PY -m slime_async run $BASE $EXTRA buffer.fixed_lag=0 algo.loss=ppo_clip \
    learner.num_steps=6 eval.interval=0 learner.save_interval=0 \
    run.run_dir="$WORK/pilot-$name" run.progress=plain "$@" >"$WORK/pilot-$name.out" 2>&1
  local rc=$?
  # whole run + the grid's remaining steps at this run's median step time (start-up differs:
  # CUDA's initialisation on the GPU; per-step cost differs: one thread per role on the cores)
  $PY - "$WORK/pilot-$name" "$s" "$rc" "$name" <<'PYEOF' >>"$WORK/pilot.txt"
import json, statistics, sys, time
rd, t0, rc, name = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
wall = time.time() - t0
try:
    rows = [json.loads(x) for x in open(f"{rd}/metrics/learner.jsonl")]
    step = statistics.median(r["step/seconds"] for r in rows[1:])
except (OSError, ValueError, KeyError, statistics.StatisticsError):
    rows, step = [], float("nan")
print(f"{name} rc={rc} wall={wall:.1f} step_s={step:.2f} estimate={wall + (40 - len(rows)) * step:.1f}")
PYEOF
}
: >"$WORK/pilot.txt"
pilot cuda "CUDA_VISIBLE_DEVICES=0" $CUDA_ARGS &
pilot cpu "CUDA_VISIBLE_DEVICES=" &
wait
cat "$WORK/pilot.txt"
cuda_s=$(awk '/^cuda rc=0/ {split($5, a, "="); print a[2]}' "$WORK/pilot.txt")
cpu_s=$(awk '/^cpu rc=0/ {split($5, a, "="); print a[2]}' "$WORK/pilot.txt")
faster=$(awk -v g="${cuda_s:-0}" -v c="${cpu_s:-0}" 'BEGIN {print (g > 0 && (c == 0 || g < 0.75 * c))}')
if [ "$faster" = 1 ]; then
  DEVICE=cuda; DEV_ENV="CUDA_VISIBLE_DEVICES=0"; DEV_ARGS=$CUDA_ARGS; JOBS=$JOBS_CUDA
else
  DEVICE=cpu; DEV_ENV="CUDA_VISIBLE_DEVICES="; DEV_ARGS=""
fi
echo "device for the grid: $DEVICE (estimated 40-step run: cuda ${cuda_s:-failed} s, cpu ${cpu_s:-failed} s)" |
  tee -a "$WORK/pilot.txt"
left=$((TIME_LIMIT - ($(date +%s) - t0)))
[ "$left" -ge 60 ] || left=60

env $DEV_ENV timeout $((left + 30)) $PY bench/bench_async.py --parallel --steps "$BENCH_STEPS" \
  --eval-interval 10 --metric $METRIC --out "$WORK/bench_async" \
  $BENCH_CONFIG $DEV_ARGS learner.save_interval=0 >"$WORK/bench_async.txt" 2>&1 &
bench=$!

env $DEV_ENV $PY -m slime_async sweep $BASE $EXTRA $DEV_ARGS \
  --grid buffer.fixed_lag=$LAGS --grid algo.loss=$LOSSES \
  --exclude "buffer.fixed_lag=0 algo.loss=${LOSSES#*,}" --seeds "$SEEDS" --jobs "$JOBS" \
  --metric $METRIC --target-accuracy 0.6 --time-limit "$left" --out "$WORK/grid" \
  --reference "buffer.fixed_lag=0 algo.loss=${LOSSES%%,*}" --equivalence "$MARGIN" \
  >"$WORK/sweep.txt" 2>&1
echo "sweep exit $? after $(($(date +%s) - t0)) s"
wait $bench
echo "bench exit $? after $(($(date +%s) - t0)) s"
tail -n 40 "$WORK/sweep.txt"
tail -n 25 "$WORK/bench_async.txt"
tar -czf "$OUT/h200.tar.gz" --exclude=checkpoints --exclude=wal --exclude='*.pt' \
  --exclude=.cache -C "$WORK" .
ls -la "$OUT"
