#!/usr/bin/env bash
# The GPU figures of docs/performance.md, on a machine with two H200s:
#   push   weight push over NCCL vs a raw NCCL broadcast of the same buckets
#   e2e    the two-GPU run: embedded engine on GPU 0, learner on GPU 1 (configs/gpu_two_h200.toml)
#   async  bench_async.py on the same config: sync vs async, same steps
#   buffer the buffer benchmark pinned to two of the host's cores (BUFFER_CPUS, default 0,1), then
#          the trajectory codec's (compiled against reference path)
#   engine the embedded engine on one GPU: its -m gpu tests, the token draw (bench_sampling.py:
#          unseeded vs seeded, top_p 1.0 and 0.95), the decode kernels, the throughput
#          table (1/64/128/256 concurrent vs HF generate); engine_grpo: the GRPO-shaped load with
#          prompt sharing on and off, and peak memory against engine.embedded.mem_fraction
#   engine_ab the engine before and after a change on one machine: the GRPO load (AB_TOP_P) and
#          greedy at AB_BATCHES (default 1,256) for ENGINE_AB_BASE (a checkout carried with the tree,
#          default .base) and for this tree, back to back; HBM_TBPS sets the rooflines (4.8: H200)
#   learner_ab the learner before and after a change on one machine: bench_learner at the 0.51B
#          shape (no HF baseline; LEARNER_AB_ARGS adds options, e.g. another shape; each step's
#          time in its JSON) and bench_moe's grouped learner side (LEARNER_AB_PARTS, default
#          "dense moe"), for LEARNER_AB_BASE (a checkout carried with the tree, default .base) and
#          for this tree, alternating for LEARNER_AB_ROUNDS rounds (default 2)
#   learner_options_ab  one [learner] option (LEARNER_OPTIONS_A, default cuda_graphs=off) against
#          the defaults on this tree: bench_learner at the 0.51B shape, each side in processes of
#          its own, alternating for LEARNER_AB_ROUNDS rounds (default 3)
#   learner the learner on one GPU: its -m gpu tests (megatron optimizer vs MasterAdamW, packed
#          vs padded, recomputation, export after DistributedOptimizer steps, resume, the
#          Triton log-prob and SwiGLU kernels), bench_swiglu.py (the SwiGLU kernels against
#          megatron's fusion), then bench_learner.py --full (0.51B Qwen3 shape, 8 x 1,024
#          vs HF; RL lengths auto / packed / padded; plain megatron-core step; recomputation;
#          the options without fast paths; LEARNER_BENCH_ARGS may add --variants and --profile "$OUT")
#   onegpu the quickstart (4 steps) on one GPU: engine on the CPU, engine on the learner's GPU
#          (push over gloo, push.backend = auto), and the latter with NCCL forced
#   onegpu_async  bench_async.py on one GPU (engine and learner sharing it): the quickstart's task,
#          sync vs async with pinned evaluation, ONEGPU_SEEDS seeds (default 0 1 2)
#   onegpu_learn  bench_async.py on configs/gpu_one_h200.toml (a 0.6B model warmed up on the GPU,
#          engine and learner sharing it, memory split by the launcher): sync vs async, 30 steps,
#          evaluation every 5 versions, LEARN_SEEDS seeds (default 0 1 2; about 5 minutes each on
#          an H100; a seed cut short by LEARN_S: bench_async.py --summarize --out its directory)
#   twogpu_learn  the same on two GPUs: engine on GPU 0, learner on GPU 1, the push over NCCL
#   twogpu_parallel  the learner across two GPUs, each beside its one-GPU row from the same
#          machine: bench_learner at the Qwen3-4B shape at TP 1 and at TP 2 (torchrun, log-probs
#          against the same weights at TP 1, MFU per GPU, peak memory per rank), bench_moe's
#          grouped learner side at EP 1 and at EP 2 (log-probs against EP 1). Each run writes
#          $OUT/parallel_<name>.json and .log; PARALLEL_ONLY="learner_4b_tp2" runs only those named
#   roofline  one H200, about 7 minutes (ROOFLINE_BUDGET_S, default 460, caps the whole part:
#          each run gets at most what is left): the embedded engine at the 0.6B Qwen3 shape at 1
#          and 256 requests (prompt 32, 128 new) vs HF generate, the GRPO load (64 prompts x 8,
#          512 new, prompt sharing on; fanout n vs n requests; top_p 1.0 and 0.95), 64 requests
#          at a 4,096-token context (64 new tokens), each beside its decode roofline (4.8 TB/s);
#          bench_learner at the 0.51B and the Qwen3-4B shape with MFU and the HF baseline in its
#          own process (the 4B first). Each run writes $OUT/roofline_<name>.json and .log;
#          ROOFLINE_ONLY="engine_grpo learner_4b" runs only the runs named
#   SUITE="push e2e" bash bench/gpu_suite.sh [overrides for the e2e/async runs...]
# The image has torch and transformers but not megatron-core, pyzmq or pydantic: their wheels
# travel in .whl/ (docs/development.md).
set -uo pipefail
OUT=${OUT:-/tmp/gpu_suite}
SUITE=${SUITE:-push e2e buffer}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi -L
# The roofline part's runs: name, seconds at most, command line (tests/unit/project/
# test_bench_suite.py parses each with its bench's own argument parser).
ROOFLINE_RUNS=(
  "engine_table|120|bench/bench_engine.py --model qwen3-0.5b --device cuda --dtype bfloat16 --batches 1,256 --prompt-len 32 --new-tokens 128"
  "engine_grpo|120|bench/bench_engine.py --grpo --model qwen3-0.5b --device cuda --dtype bfloat16 --grpo-prompts 64 --grpo-n 8 --grpo-prompt-len 256 --new-tokens 512 --grpo-sharing on --grpo-fanout both --grpo-top-p 1.0,0.95"
  "engine_context4096|110|bench/bench_engine.py --model qwen3-0.5b --device cuda --dtype bfloat16 --batches 64 --context 4096 --new-tokens 64"
  "learner_4b|170|bench/bench_learner.py --hidden 2560 --layers 36 --heads 32 --kv-heads 8 --head-dim 128 --ffn 9728 --warmup 2 --steps 3 --baseline hf"
  "learner_0.5b|100|bench/bench_learner.py --warmup 2 --steps 4 --baseline hf"
)
# The twogpu_parallel part's runs: name, seconds at most, processes (2: under torchrun, one a
# GPU), command line (tests/unit/project/test_bench_suite.py parses each with its bench's parser).
PARALLEL_RUNS=(
  "learner_4b_tp1|200|1|bench/bench_learner.py --hidden 2560 --layers 36 --heads 32 --kv-heads 8 --head-dim 128 --ffn 9728 --warmup 2 --steps 3 --baseline none"
  "learner_4b_tp2|300|2|bench/bench_learner.py --tensor-parallel 2 --hidden 2560 --layers 36 --heads 32 --kv-heads 8 --head-dim 128 --ffn 9728 --warmup 2 --steps 3"
  "moe_ep1|200|1|bench/bench_moe.py --part learner --sides grouped --warmup 2 --steps 3"
  "moe_ep2|300|2|bench/bench_moe.py --part learner --expert-parallel 2 --warmup 2 --steps 3"
)
for part in $SUITE; do
  case $part in
    twogpu_parallel)
      for run in "${PARALLEL_RUNS[@]}"; do
        IFS='|' read -r name limit nproc cmd <<<"$run"
        if [[ -n ${PARALLEL_ONLY:-} && " $PARALLEL_ONLY " != *" $name "* ]]; then
          echo "== parallel $name: not in PARALLEL_ONLY"
          continue
        fi
        launch=(python3)
        ((nproc > 1)) && launch=(python3 -m torch.distributed.run --nproc-per-node "$nproc"
          --master-addr 127.0.0.1 --master-port "$((29500 + RANDOM % 1000))")
        echo "== parallel $name (at most $limit s): ${launch[*]} $cmd"
        # shellcheck disable=SC2086
        timeout -k 10 "$limit" "${launch[@]}" $cmd --json "$OUT/parallel_$name.json" \
          >"$OUT/parallel_$name.log" 2>&1
        echo "exit $?"
        grep -v -i warn "$OUT/parallel_$name.log" | grep -v '^ \|^[{}]' | tail -12
      done ;;
    roofline)
      budget=${ROOFLINE_BUDGET_S:-460}
      start=$SECONDS
      for run in "${ROOFLINE_RUNS[@]}"; do
        IFS='|' read -r name limit cmd <<<"$run"
        if [[ -n ${ROOFLINE_ONLY:-} && " $ROOFLINE_ONLY " != *" $name "* ]]; then
          echo "== roofline $name: not in ROOFLINE_ONLY"
          continue
        fi
        left=$((budget - (SECONDS - start)))
        if ((left < 30)); then
          echo "== roofline $name: skipped, ${left} s of ROOFLINE_BUDGET_S=$budget left"
          continue
        fi
        ((limit > left)) && limit=$left
        echo "== roofline $name (at most $limit s): python3 $cmd"
        # shellcheck disable=SC2086
        timeout -k 10 "$limit" python3 $cmd --json "$OUT/roofline_$name.json" >"$OUT/roofline_$name.log" 2>&1
        echo "exit $? after $((SECONDS - start)) s of the part"
        grep -v -i warn "$OUT/roofline_$name.log" | grep -v '^ \|^[{}]' | tail -14
      done ;;
    push)
      echo "== weight push: learner rank 0 on GPU 0, engine on GPU 1"
      timeout "${PUSH_S:-150}" python3 bench/bench_engine.py --push --model qwen3-0.5b \
        --device cuda --bucket-mb 512 --reps 3 >"$OUT/push.log" 2>&1
      echo "exit $?"; grep -v -i warn "$OUT/push.log" | tail -8 ;;
    e2e)
      echo "== end to end on two GPUs"
      timeout "${E2E_S:-300}" python3 -m slime_async run configs/gpu_two_h200.toml \
        run.run_dir=/tmp/gpu_run "$@" >"$OUT/e2e.log" 2>&1
      echo "exit $?"; grep -v -i warn "$OUT/e2e.log" | tail -20
      cp /tmp/gpu_run/metrics/*.jsonl "$OUT/" 2>/dev/null
      tar czf "$OUT/logs.tgz" -C /tmp/gpu_run logs 2>/dev/null ;;
    async)
      echo "== sync vs async on two GPUs"
      timeout "${ASYNC_S:-420}" python3 bench/bench_async.py --steps "${ASYNC_STEPS:-12}" \
        --out /tmp/bench_gpu configs/gpu_two_h200.toml "$@" >"$OUT/bench_async.log" 2>&1
      echo "exit $?"; tail -18 "$OUT/bench_async.log"
      cp /tmp/bench_gpu/summary.json "$OUT/bench_async.json" 2>/dev/null ;;
    engine)
      echo "== embedded engine: -m gpu tests"
      timeout "${ENGINE_TEST_S:-240}" python3 -m pytest -q -m gpu -p no:cacheprovider \
        tests/gpu/test_engine_gpu.py 2>&1 | tee "$OUT/engine_tests.log" | tail -15
      echo "== embedded engine: one step's draw, unseeded vs seeded (eager, compiled)"
      for top_p in 1.0 0.95; do
        timeout "${SAMPLING_S:-90}" python3 bench/bench_sampling.py --device cuda --top-p "$top_p" \
          2>&1 | grep -v -i warn | tee -a "$OUT/engine_sampling.log" | tail -8
      done
      echo "== embedded engine: decode kernels and steps"
      timeout "${KERNELS_S:-150}" python3 bench/bench_engine.py --kernels --model qwen3-0.5b \
        --device cuda 2>&1 | grep -v -i warn | tee "$OUT/engine_kernels.log"
      echo "== embedded engine vs HF generate"
      timeout "${TABLE_S:-300}" python3 bench/bench_engine.py --model qwen3-0.5b --device cuda \
        --dtype bfloat16 --batches 1,64,128,256 --new-tokens 128 2>&1 | grep -v -i warn \
        | tee "$OUT/engine_table.log" | tail -12 ;;
    engine_ab)
      # The engine before and after a change on this one machine: ENGINE_AB_BASE is a checkout of
      # the other code carried with the tree (git worktree add --detach .base main; carry .base).
      base=${ENGINE_AB_BASE:-.base}
      [[ -f $base/bench/bench_engine.py ]] || { echo "engine_ab: no checkout at $base"; continue; }
      out=$(cd "$OUT" && pwd)
      n=0
      for load in "--grpo --grpo-sharing on --grpo-fanout n --grpo-top-p ${AB_TOP_P:-1.0}" \
                  "--batches ${AB_BATCHES:-1,256} --new-tokens 128"; do
        for tree in "$base" .; do
          n=$((n + 1))
          log="$out/engine_ab_$n.log"
          echo "== engine_ab $tree: $load (log $log)"
          # shellcheck disable=SC2086
          (cd "$tree" && PYTHONPATH=/tmp/site:$PWD timeout "${AB_S:-90}" python3 \
            bench/bench_engine.py --model qwen3-0.5b --device cuda --dtype bfloat16 \
            --hbm-tbps "${HBM_TBPS:-4.8}" $load >"$log" 2>&1)
          echo "exit $?"
          grep -v -i warn "$log" | grep -A1 "^batch\|prefix_sharing=" | grep -v "^--"
        done
      done ;;
    learner_ab)
      # The learner before and after a change on this one machine (LEARNER_AB_BASE: a checkout
      # of the other code carried with the tree, as for engine_ab), the two trees alternating
      # for LEARNER_AB_ROUNDS rounds (the spread between processes is part of the answer).
      base=${LEARNER_AB_BASE:-.base}
      [[ -f $base/bench/bench_learner.py ]] || { echo "learner_ab: no checkout at $base"; continue; }
      out=$(cd "$OUT" && pwd)
      for round in $(seq 1 "${LEARNER_AB_ROUNDS:-2}"); do
        for tree in "$base" .; do
          tag=this; [[ $tree == "$base" ]] && tag=base
          tag=${tag}_$round
          for part in ${LEARNER_AB_PARTS:-dense moe}; do
            log="$out/learner_ab_${part}_$tag.log"
            echo "== learner_ab round $round, $tree: $part (log $log)"
            if [[ $part == dense ]]; then
              # shellcheck disable=SC2086
              (cd "$tree" && PYTHONPATH=/tmp/site:$PWD timeout "${AB_S:-150}" python3 \
                bench/bench_learner.py --warmup 3 --steps 5 --baseline none ${LEARNER_AB_ARGS:-} \
                --json "$out/learner_ab_dense_$tag.json" >"$log" 2>&1)
              echo "exit $?"; grep "^learner RL step\|^learner step:" "$log"
            else
              (cd "$tree" && PYTHONPATH=/tmp/site:$PWD timeout "${AB_S:-150}" python3 \
                bench/bench_moe.py --part learner --sides grouped --warmup 3 --steps 5 >"$log" 2>&1)
              echo "exit $?"; grep "^learner side" "$log" | cut -c1-400
            fi
          done
        done
      done ;;
    learner_options_ab)
      # One [learner] option against the defaults on this tree and machine: bench_learner at
      # the 0.51B shape in processes of their own, "A" (LEARNER_OPTIONS_A, default
      # cuda_graphs=off) and the defaults alternating for LEARNER_AB_ROUNDS rounds (default 3).
      for round in $(seq 1 "${LEARNER_AB_ROUNDS:-3}"); do
        for side in a defaults; do
          opts=""; [[ $side == a ]] && opts=${LEARNER_OPTIONS_A:-cuda_graphs=off}
          log="$OUT/learner_options_ab_${side}_$round.log"
          echo "== learner_options_ab round $round: ${opts:-the defaults} (log $log)"
          # shellcheck disable=SC2086
          timeout "${AB_S:-150}" python3 bench/bench_learner.py --warmup 3 --steps 8 \
            --baseline none --options "$opts" ${LEARNER_AB_ARGS:-} \
            --json "$OUT/learner_options_ab_${side}_$round.json" >"$log" 2>&1
          echo "exit $?"; grep "^learner step:" "$log"
        done
      done ;;
    engine_grpo)
      echo "== GRPO-shaped load, prompt sharing on and off"
      timeout "${GRPO_S:-400}" python3 bench/bench_engine.py --grpo --model qwen3-0.5b \
        --device cuda 2>&1 | grep -v -i warn | tee "$OUT/engine_grpo.log" | tail -12 ;;
    learner)
      echo "== learner: -m gpu tests"
      # About 100 s with eager layer ops and 225 s with the compiled ones (their compilation and
      # the compiled-vs-eager runs) on an H100.
      timeout "${LEARNER_TEST_S:-300}" python3 -m pytest -q -m gpu -p no:cacheprovider \
        tests/gpu/test_learner_gpu.py 2>&1 | tee "$OUT/learner_tests.log" | tail -25
      echo "== the SwiGLU kernels against megatron's fusion (8,192 tokens, F 3,072 and 9,728)"
      timeout "${SWIGLU_S:-120}" python3 bench/bench_swiglu.py --hbm-tbps "${HBM_TBPS:-4.8}" \
        2>&1 | grep -v -i warn | tee "$OUT/bench_swiglu.log" | tail -15
      echo "== learner benchmark"
      # shellcheck disable=SC2086
      timeout "${LEARNER_BENCH_S:-200}" python3 bench/bench_learner.py \
        ${LEARNER_BENCH_ARGS:---full --warmup 1 --steps 2} \
        --json "$OUT/bench_learner.json" >"$OUT/bench_learner.log" 2>&1
      echo "exit $?"; grep -v -i warn "$OUT/bench_learner.log" | grep -v '^ \|^[{}]' | tail -30 ;;
    buffer)
      # Pinned to two cores: a stand-in for the 2-core dev machine (all three processes share them).
      echo "== buffer benchmark (host CPUs ${BUFFER_CPUS:-0,1})"
      timeout "${BUFFER_S:-100}" taskset -c "${BUFFER_CPUS:-0,1}" python3 bench/bench_buffer.py \
        --seconds "${BUFFER_SECONDS:-1.5}" >"$OUT/buffer.log" 2>&1
      echo "exit $?"; tail -16 "$OUT/buffer.log"
      taskset -c "${BUFFER_CPUS:-0,1}" python3 bench/bench_codec.py --sizes 4,64,1024 ;;
    onegpu)
      # The quickstart on a one-GPU machine, off the buffer's cores: the learner on the GPU with
      # the engine on the CPU (the quickstart as written), the engine on the learner's own GPU
      # (push.backend = auto chooses gloo for both), and the same with NCCL forced (the
      # failure auto avoids: NCCL refuses two ranks on one device).
      echo "== the quickstart on one GPU (host CPUs ${ONEGPU_CPUS:-2-15})"
      QS="configs/quickstart.toml learner.num_steps=${ONEGPU_STEPS:-4} eval.interval=0
        learner.save_interval=0 run.progress=plain"
      ONGPU="engine.embedded.device=cuda engine.embedded.kv_cache_tokens=16384"
      for case in "engine_cpu:" "engine_gpu:$ONGPU" "engine_gpu_nccl:$ONGPU push.backend=nccl"; do
        name=${case%%:*}
        ( timeout "${ONEGPU_S:-240}" taskset -c "${ONEGPU_CPUS:-2-15}" python3 -m slime_async run \
            $QS ${case#*:} run.run_dir="/tmp/onegpu_$name" >"$OUT/onegpu_$name.log" 2>&1
          echo "$name exit $?" >>"$OUT/onegpu_exits.txt"
          grep -h -E "weight push over|invalid usage|push/" "/tmp/onegpu_$name"/logs/learner*.log \
            2>/dev/null | head -3 >"$OUT/onegpu_$name.push.txt" ) &
      done
      wait
      for name in engine_cpu engine_gpu engine_gpu_nccl; do
        echo "-- $name: $(grep "^$name " "$OUT/onegpu_exits.txt")"
        cat "$OUT/onegpu_$name.push.txt"; tail -4 "$OUT/onegpu_$name.log"
      done ;;
    onegpu_async)
      # Time to sync's final pinned-evaluation accuracy on one GPU, one bench_async run per seed.
      for seed in ${ONEGPU_SEEDS:-0 1 2}; do
        echo "== sync vs async on one GPU, seed $seed"
        timeout "${ONEGPU_ASYNC_S:-300}" taskset -c "${ONEGPU_CPUS:-2-15}" python3 \
          bench/bench_async.py --steps "${ONEGPU_ASYNC_STEPS:-60}" --eval-interval 20 \
          --out "/tmp/bench_onegpu_$seed" configs/quickstart.toml engine.embedded.device=cuda \
          eval.samples=4 learner.save_interval=0 "run.seed=$seed" "$@" \
          >"$OUT/onegpu_async_$seed.log" 2>&1
        echo "exit $?"; tail -6 "$OUT/onegpu_async_$seed.log"
        cp "/tmp/bench_onegpu_$seed/summary.json" "$OUT/onegpu_async_$seed.json" 2>/dev/null
      done ;;
    onegpu_learn|twogpu_learn)
      gpus=(); [[ $part == twogpu_learn ]] && gpus=('run.learner_cuda_devices="1"')
      for seed in ${LEARN_SEEDS:-0 1 2}; do
        echo "== sync vs async, $part, the 0.6B learning config, seed $seed"
        timeout "${LEARN_S:-420}" python3 bench/bench_async.py --steps "${LEARN_STEPS:-30}" \
          --out "/tmp/bench_${part}_$seed" configs/gpu_one_h200.toml "${gpus[@]}" \
          "run.seed=$seed" "$@" >"$OUT/${part}_$seed.log" 2>&1
        echo "exit $?"; tail -6 "$OUT/${part}_$seed.log"
        cp "/tmp/bench_${part}_$seed/summary.json" "$OUT/${part}_$seed.json" 2>/dev/null
      done ;;
  esac
done
