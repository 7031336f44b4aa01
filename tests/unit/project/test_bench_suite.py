"""The GPU benches' arithmetic and command lines, checked on the CPU: the decode roofline and the
train-step FLOP count against shapes worked by hand and against the real HF models' parameter
counts; bench/gpu_suite.sh's roofline runs parsed by each bench's own argument parser; tiny CPU
runs of bench_engine.py (--grpo, --context) and bench_learner.py (HF baseline in its own
process) whose JSON carries the roofline / MFU columns; the CUDA-only paths refused with a
message, not a traceback."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from slime_async.models.toy import QWEN3_05B_SHAPE, tiny_config
from tests.support.repo import REPO, pythonpath_with_repo

sys.path.insert(0, str(REPO / "bench"))
import bench_engine
import bench_learner
import bench_moe
import roofline

ENV = {**os.environ, "PYTHONPATH": pythonpath_with_repo(), "CUDA_VISIBLE_DEVICES": ""}


def run_bench(*argv: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *argv], capture_output=True, text=True, timeout=timeout, env=ENV, cwd=REPO
    )


# ---- the arithmetic --------------------------------------------------------------------------


def test_decode_roofline_of_a_shape_worked_by_hand():
    # KV a token: 2 x 2 layers x 1 kv head x 4 x 2 B = 32 B; 2 requests, prompt 3, 2 new tokens:
    # contexts 4 then 5 each -> KV 32 x 2 x 9 = 576 B; weights 1,000 x 2 B x 2 steps = 4,000 B.
    shape = roofline.DecodeShape(params=1000, dtype_bytes=2, layers=2, kv_heads=1, head_dim=4)
    assert shape.kv_bytes_per_token == 32
    r = roofline.decode_roofline(shape, batch=2, prompt_len=3, new_tokens=2, hbm_tbps=1e-9)
    assert r["bytes_per_step"] == pytest.approx(4576 / 2)
    assert r["roofline_step_ms"] == pytest.approx(4576 / 1000 / 2 * 1e3)  # 1,000 B/s
    assert r["roofline_tokens_per_s"] == pytest.approx(4 / 4.576)
    assert r["mean_context"] == pytest.approx(4.5)
    # the 2 requests read their 3-token prompt once: 3 x 2 steps fewer keys, 192 B a step less
    once = roofline.decode_roofline(shape, 2, 3, 2, hbm_tbps=1e-9, group=2)
    assert once["bytes_per_step"] == pytest.approx((4576 - 32 * 6) / 2)
    assert once["mean_context"] == r["mean_context"] and once["prompt_read_by"] == 2


def test_decode_roofline_of_the_06b_shape_matches_the_documented_estimate():
    """docs/benchmarks/2026-12-01-embedded-engine-gpu.md: about 115 KB of KV a token, weights
    about 1.2 GB, roughly 200k tokens/s at 256 x 160 on 4.8 TB/s (one step's bytes)."""
    cfg = tiny_config("qwen3", **QWEN3_05B_SHAPE)
    cfg.head_dim = 128  # as bench_engine.make_model
    with torch.device("meta"):
        params = sum(p.numel() for p in AutoModelForCausalLM.from_config(cfg).parameters())
    shape = roofline.DecodeShape(params, 2, cfg.num_hidden_layers, cfg.num_key_value_heads, 128)
    assert shape.kv_bytes_per_token == 114_688
    assert 1.1e9 < shape.weight_bytes < 1.3e9
    last = roofline.decode_roofline(shape, 256, 159, 1, 4.8)  # one step at context 160
    assert 180e3 < last["roofline_tokens_per_s"] < 220e3
    # over a whole decode from 32 to 160 the contexts are shorter: a higher limit
    whole = roofline.decode_roofline(shape, 256, 32, 128, 4.8)
    assert whole["roofline_tokens_per_s"] > last["roofline_tokens_per_s"]


def test_the_engine_loops_timing_and_its_decode_steps_against_their_roofline():
    """bench_engine reads the engine's loop timing between two /get_server_info answers and
    puts the decode steps' device time against the roofline of a step of their mean batch."""
    before = {"loop_s": 1.0, "host_wait_s": 0.5, "decode_steps_timed": 10,
              "decode_rows_timed": 100, "decode_device_s": 0.2, "prefill_batches": 4,
              "prefill_s": 0.1, "prefill_device_s": 0.02}  # fmt: skip
    after = {"loop_s": 3.0, "host_wait_s": 0.75, "decode_steps_timed": 110,
             "decode_rows_timed": 3300, "decode_device_s": 1.8, "prefill_batches": 7,
             "prefill_s": 0.35, "prefill_device_s": 0.07}  # fmt: skip
    t = bench_engine.loop_timing(before, after)
    assert t["decode_steps"] == 100 and t["mean_decode_batch"] == 32
    assert t["prefills"] == 3 and t["prefill_s"] == pytest.approx(0.25)
    assert t["prefill_device_s"] == pytest.approx(0.05)
    assert "3 prefills: 0.250 s of host time (admission, launch), 0.050 s on the device" in (
        bench_engine.describe_loop(t)
    )
    assert t["decode_device_ms_per_step"] == pytest.approx(16.0)
    assert t["device_share_of_loop"] == pytest.approx(0.8)
    assert "100 decode steps (mean batch 32.0)" in bench_engine.describe_loop(t)
    shape = roofline.DecodeShape(params=1000, dtype_bytes=2, layers=2, kv_heads=1, head_dim=4)
    limit = roofline.decode_roofline(shape, 32, 3, 2, 1e-9)["roofline_step_ms"]
    got = bench_engine.decode_steps_of_roofline(t, shape, 3, 2, 1e-9)
    assert got == pytest.approx(limit / 16.0)
    cpu = bench_engine.loop_timing({}, {"loop_s": 0.5})
    assert bench_engine.decode_steps_of_roofline(cpu, shape, 3, 2, 1.0) is None
    assert "no decode step timed" in bench_engine.describe_loop(cpu)


def test_spy_summary_ranks_the_scheduler_threads_frames():
    """bench_engine --spy: py-spy's raw stacks of the scheduler thread, ranked on top of the stack
    and on it; other threads' samples are left out."""
    loop = "Thread.run (threading.py:1);Scheduler._loop (s.py:1);Scheduler._guarded (s.py:2)"
    raw = "\n".join(
        [
            f"{loop};Scheduler._launch (s.py:9);sample (sampling.py:267) 6",
            f"{loop};Scheduler._drain (s.py:20) 3",
            f"{loop};Scheduler._launch (s.py:9);DecodeGraphs.run (g.py:5) 1",
            "main (engine.py:1);EpollSelector.select (selectors.py:468) 50",
            "garbage line",
        ]
    )
    text = bench_engine.spy_summary(raw)
    assert text.startswith("py-spy: 10 samples of Scheduler._loop")
    top, stack = text.split("on the stack:")
    assert top.index("60.0%  sample (sampling.py:267)") < top.index("30.0%  Scheduler._drain")
    assert "70.0%  Scheduler._launch (s.py:9)" in stack and "Epoll" not in text
    assert "Scheduler._guarded" not in stack
    assert bench_engine.spy_summary("main (x.py:1) 4") == "py-spy: no samples of Scheduler._loop"


def test_decode_roofline_refuses_empty_shapes():
    shape = roofline.DecodeShape(1, 2, 1, 1, 1)
    with pytest.raises(ValueError, match="new_tokens 0"):
        roofline.decode_roofline(shape, 1, 1, 0, 4.8)


@pytest.mark.parametrize("tie", [True, False])
def test_non_embedding_params_match_the_hf_model(tie):
    shape = roofline.TrainShape(
        layers=3, hidden=64, heads=4, kv_heads=2, head_dim=24, ffn=96, vocab=128
    )
    cfg = tiny_config("qwen3", vocab_size=128, hidden_size=64, num_layers=3, num_heads=4,
                      num_kv_heads=2, intermediate_size=96, tie_word_embeddings=tie)  # fmt: skip
    cfg.head_dim = 24
    with torch.device("meta"):
        total = sum(p.numel() for p in AutoModelForCausalLM.from_config(cfg).parameters())
    outputs = 1 if tie else 2  # the embedding, and an untied output layer
    assert shape.non_embedding_params == total - outputs * 128 * 64


def test_train_flops_per_token_of_a_shape_worked_by_hand():
    shape = roofline.TrainShape(
        layers=2, hidden=8, heads=2, kv_heads=1, head_dim=4, ffn=16, vocab=10
    )
    # per layer: q, o 8 x (2 x 4); k, v 8 x 4 (GQA); q/k norms 2 x 4, layer norms 2 x 8;
    # MLP 3 x 8 x 16; then the final norm 8
    assert shape.non_embedding_params == 2 * (192 + 8 + 16 + 384) + 8 == 1208
    f = roofline.train_flops_per_token(shape, seq_len=6, response_len=3)
    body = 6 * 1208
    head = 6 * 10 * 8 * 3 / 6
    attention = 12 * 2 * 2 * 4 * (6 + 1) / 2  # keys 1..6 for the 6 causal queries: 3.5 each
    assert f == pytest.approx(body + head + attention)
    assert roofline.mfu(1e3, f, 1e-6) == pytest.approx(1e3 * f / 1e6)
    with pytest.raises(ValueError, match="response_len 7"):
        roofline.train_flops_per_token(shape, 6, 7)


def test_the_learner_flops_of_the_05b_shape_are_the_documented_3_gflop():
    """performance.md: about 3.4 GFLOP a token at the 0.51B shape, 8 x 1,024 (a rounder count)."""
    args = bench_learner.build_parser().parse_args([])
    group = bench_learner.make_group(args, np.random.default_rng(0))
    per_token = bench_learner.step_flops(args, [group]) / (args.batch * args.seq)
    assert 3.0e9 < per_token < 3.5e9


# ---- the suite's command lines ----------------------------------------------------------------


def roofline_runs() -> list[tuple[str, int, list[str]]]:
    text = (REPO / "bench" / "gpu_suite.sh").read_text()
    block = re.search(r"ROOFLINE_RUNS=\(\n(.*?)\n\)", text, re.S)
    assert block, "bench/gpu_suite.sh has no ROOFLINE_RUNS=( ... ) array"
    runs = []
    for line in block.group(1).splitlines():
        name, limit, cmd = line.strip().strip('"').split("|")
        runs.append((name, int(limit), cmd.split()))
    return runs


def test_the_roofline_runs_cover_the_planned_loads_within_the_budget():
    runs = {name: cmd for name, _, cmd in roofline_runs()}
    assert set(runs) == {
        "engine_table",
        "engine_grpo",
        "engine_context4096",
        "learner_0.5b",
        "learner_4b",
    }
    text = (REPO / "bench" / "gpu_suite.sh").read_text()
    budget = int(re.search(r"ROOFLINE_BUDGET_S:-(\d+)", text).group(1))
    assert budget <= 480  # one device call of 10 minutes, set-up included


@pytest.mark.parametrize("name,limit,cmd", roofline_runs(), ids=lambda x: str(x)[:20])
def test_each_roofline_run_parses_with_its_bench(name, limit, cmd, monkeypatch):
    script, argv = cmd[0], [*cmd[1:], "--json", "/tmp/x.json"]  # the suite appends --json
    assert limit > 0
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the suite runs on a GPU
    if script == "bench/bench_engine.py":
        args = bench_engine.resolve(bench_engine.build_parser().parse_args(argv))
        assert args.device == "cuda" and args.model == "qwen3-0.5b"
        if args.grpo:
            assert (args.grpo_prompts, args.grpo_n, args.grpo_new_tokens) == (64, 8, 512)
            assert args.grpo_top_p == "1.0,0.95"
        elif args.context:
            assert (args.prompt_len, args.batches) == (4096, "64")
        else:
            assert args.batches == "1,256" and args.prompt_len + args.new_tokens == 160
    elif script == "bench/bench_learner.py":
        args = bench_learner.build_parser().parse_args(argv)
        bench_learner.check_args(args)
        assert args.baseline == "hf"
        if name == "learner_4b":
            shape = (args.hidden, args.layers, args.heads, args.kv_heads, args.head_dim, args.ffn)
            assert shape == (2560, 36, 32, 8, 128, 9728)  # Qwen3-4B's config.json
    else:
        pytest.fail(f"{name}: unknown bench {script}")


def parallel_runs() -> list[tuple[str, int, int, list[str]]]:
    text = (REPO / "bench" / "gpu_suite.sh").read_text()
    block = re.search(r"PARALLEL_RUNS=\(\n(.*?)\n\)", text, re.S)
    assert block, "bench/gpu_suite.sh has no PARALLEL_RUNS=( ... ) array"
    runs = []
    for line in block.group(1).splitlines():
        name, limit, nproc, cmd = line.strip().strip('"').split("|")
        runs.append((name, int(limit), int(nproc), cmd.split()))
    return runs


def test_the_twogpu_parallel_part_pairs_each_two_gpu_row_with_its_one_gpu_row():
    runs = {name: (nproc, cmd) for name, _, nproc, cmd in parallel_runs()}
    assert set(runs) == {"learner_4b_tp1", "learner_4b_tp2", "moe_ep1", "moe_ep2"}
    assert {name: nproc for name, (nproc, _) in runs.items()} == {
        "learner_4b_tp1": 1, "learner_4b_tp2": 2, "moe_ep1": 1, "moe_ep2": 2
    }  # fmt: skip
    one, two = (
        bench_learner.build_parser().parse_args(runs[n][1][1:])
        for n in ("learner_4b_tp1", "learner_4b_tp2")
    )
    keys = (*bench_learner.SHAPE_KEYS, "warmup", "steps")
    assert [getattr(one, k) for k in keys] == [getattr(two, k) for k in keys]
    assert "twogpu_parallel)" in (REPO / "bench" / "gpu_suite.sh").read_text()


@pytest.mark.parametrize("name,limit,nproc,cmd", parallel_runs(), ids=lambda x: str(x)[:20])
def test_each_parallel_run_parses_with_its_bench_at_its_process_count(
    name, limit, nproc, cmd, monkeypatch
):
    """Each run's flags pass its bench's own checks in a world of `nproc` processes on a
    two-GPU host (the checks that refuse a TP/EP size the process count does not match)."""
    argv = [*cmd[1:], "--json", "/tmp/x.json"]  # the suite appends --json
    assert limit > 0
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    if cmd[0] == "bench/bench_learner.py":
        args = bench_learner.build_parser().parse_args(argv)
        bench_learner.check_args(args, world=nproc)
        assert args.tensor_parallel == nproc and args.baseline == "none"
        shape = (args.hidden, args.layers, args.heads, args.kv_heads, args.head_dim, args.ffn)
        assert shape == (2560, 36, 32, 8, 128, 9728)  # Qwen3-4B's config.json
        assert args.warmup >= 2  # CUDA graphs capture a shape at its second micro-batch
    elif cmd[0] == "bench/bench_moe.py":
        args = bench_moe.build_parser().parse_args(argv)
        bench_moe.check_args(args, world=nproc)
        assert args.expert_parallel == nproc and args.sides == "grouped"
        assert args.part == "learner"
    else:
        pytest.fail(f"{name}: unknown bench {cmd[0]}")


@pytest.mark.parametrize(
    "bench,argv,world,message",
    [
        (bench_learner, ["--tensor-parallel", "2"], 1, "torchrun --nproc-per-node 2"),
        (bench_learner, [], 2, "WORLD_SIZE is 2 but --tensor-parallel is 1"),
        (bench_learner, ["--tensor-parallel", "2", "--baseline", "hf"], 2, "runs on one GPU"),
        (bench_learner, ["--tensor-parallel", "2", "--full"], 2, "--full at --tensor-parallel"),
        (bench_moe, ["--expert-parallel", "2", "--part", "learner"], 1, "torchrun --nproc"),
        (bench_moe, ["--expert-parallel", "2"], 2, "--part both at --expert-parallel 2"),
        (bench_moe, ["--expert-parallel", "2", "--sides", "hf", "--part", "learner"], 2, "one GPU"),
        (bench_moe, ["--expert-parallel", "3", "--part", "learner"], 3, "not a multiple"),
    ],
)
def test_a_parallel_size_the_world_does_not_fit_is_refused_naming_the_fix(
    bench, argv, world, message
):
    args = bench.build_parser().parse_args(argv)
    with pytest.raises(SystemExit) as e:
        bench.check_args(args, world=world)
    assert message in str(e.value)


# ---- tiny CPU runs ------------------------------------------------------------------------------


def assert_roofline_row(row: dict, measured: str) -> None:
    frac = row[f"{measured}_of_roofline"]
    assert 0 < frac <= 1, row
    assert frac == pytest.approx(row[f"{measured}_tokens_per_s"] / row["roofline_tokens_per_s"])


def test_bench_engine_grpo_on_cpu_prints_and_writes_the_roofline(tmp_path):
    out = tmp_path / "grpo.json"
    r = run_bench(
        "bench/bench_engine.py", "--grpo", "--grpo-prompts", "2", "--grpo-n", "3",
        "--grpo-prompt-len", "20", "--new-tokens", "6", "--grpo-sharing", "on",
        "--grpo-fanout", "both", "--grpo-top-p", "1.0,0.95", "--json", str(out),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert (
        "| prompt sharing | fanout | top_p | tokens/s | prompt's keys read | roofline tok/s "
        "| fraction" in r.stdout
    )
    assert "HBM 4.8 TB/s" in r.stdout
    res = json.loads(out.read_text())
    assert not res["partial"] and res["hbm_tbps"] == 4.8
    assert [(x["fanout"], x["top_p"]) for x in res["rows"]] == [
        ("n", 1.0), ("n", 0.95), ("requests", 1.0), ("requests", 0.95)
    ]  # fmt: skip
    shape = roofline.DecodeShape(res["params"], 4, 2, 2, 16)  # the tiny model in float32
    assert res["kv_bytes_per_token"] == shape.kv_bytes_per_token
    for row in res["rows"]:
        assert row["tokens"] == 2 * 3 * 6  # ignore_eos: every sample ran to length
        assert_roofline_row(row, "engine")
        # on a CPU the engine reads every request's keys itself (decode_shared_prefix off)
        assert row["decode_shared_prefix"] == "off" and row["prompt_read_by"] == 1
        want = roofline.decode_roofline(shape, 6, 20, 6, 4.8)["roofline_tokens_per_s"]
        assert row["roofline_tokens_per_s"] == pytest.approx(want)


def test_bench_engine_context_on_cpu_prints_and_writes_the_roofline(tmp_path):
    out = tmp_path / "ctx.json"
    r = run_bench(
        "bench/bench_engine.py", "--batches", "2", "--context", "40", "--new-tokens", "4",
        "--hbm-tbps", "2.0", "--json", str(out),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert "| roofline tok/s | engine / roofline | HF / roofline |" in r.stdout
    assert "HBM 2.0 TB/s" in r.stdout
    res = json.loads(out.read_text())
    (row,) = res["rows"]
    assert res["prompt_len"] == 40 and row["mean_context"] == pytest.approx(40 + 2.5)
    assert_roofline_row(row, "engine")
    assert_roofline_row(row, "hf")
    assert row["hbm_tbps"] == 2.0
    # the engine process froze its start-up heap; its collections in the timed run are reported
    gc = row["engine_gc"]
    assert gc["frozen_objects"] > 0 and len(gc["collections"]) == 3 and gc["long"] >= 0
    assert "engine garbage collections: [" in r.stdout
    assert row["cuda_allocator"] == {"alloc_retries": 0, "device_mallocs": 0}  # no GPU


def test_bench_gc_runs_each_side_in_its_own_process(tmp_path):
    """The baseline serves without freezing, the other side after gc.freeze; both time every
    collection while they serve and one full collection after."""
    out = tmp_path / "gc.json"
    r = run_bench(
        "bench/bench_gc.py", "--batch", "3", "--new-tokens", "2", "--rounds", "2",
        "--json", str(out),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert "| side | full collections | their s |" in r.stdout
    base, frozen = json.loads(out.read_text())["sides"]
    assert (base["side"], frozen["side"]) == ("baseline", "frozen")
    assert base["frozen_objects"] == 0 < frozen["frozen_objects"]
    for side in (base, frozen):
        assert len(side["rounds_s"]) == 2 and len(side["gc_collections"]) == 3
        assert side["forced_full_collection_s"] > 0
    r = run_bench("bench/bench_gc.py", "--rounds", "0")
    assert r.returncode != 0 and "--rounds must be at least 1" in r.stderr


TINY_LEARNER = (
    "bench/bench_learner.py", "--hidden", "64", "--layers", "2", "--heads", "4",
    "--kv-heads", "2", "--ffn", "128", "--vocab", "128", "--batch", "2", "--seq", "64",
    "--warmup", "0", "--steps", "1",
)  # fmt: skip


def test_bench_learner_on_cpu_runs_the_hf_baseline_in_its_own_process(tmp_path):
    """... and a `--variants` learner (without `--full`), each timed step's seconds kept."""
    out = tmp_path / "learner.json"
    variant = "logprob_chunk_tokens=32"
    r = run_bench(*TINY_LEARNER, "--peak-tflops", "1e-6", "--variants", variant, "--json", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["partial"] is False  # rewritten after each figure, final at the end
    assert res["hf"]["side"] == "hf" and "--hf-child" in r.stdout
    assert res["peak_tflops"] == 1e-6
    for side in ("learner", "hf"):
        assert res[f"{side}_mfu"] == pytest.approx(
            res[f"{side}_tokens_per_s"] * res["flops_per_token"] / 1e6
        )
    assert res["ratio_learner_over_hf"] == pytest.approx(
        res["learner_tokens_per_s"] / res["hf_tokens_per_s"]
    )
    assert re.search(r"learner RL step \(recompute none\) +[\d,]+ +[\d.]+%", r.stdout)
    assert all(math.isfinite(x) for x in res["learner_losses"])
    assert res[f"variant_{variant}_tokens_per_s"] > 0
    assert len(res[f"variant_{variant}_step_s"]) == 1 == len(res["learner_step_s"])
    assert re.search(rf"{variant} +[\d,]+ .* vs the learner RL step", r.stdout)


@pytest.mark.parametrize(
    "argv,message",
    [
        (["bench/bench_engine.py", "--kernels"], "--kernels times Triton kernels"),
        (["bench/bench_engine.py", "--device", "cuda"], "--device cuda: no CUDA GPU here"),
        (["bench/bench_engine.py", "--grpo", "--grpo-top-p", "1.5"], "--grpo-top-p '1.5'"),
        (["bench/bench_learner.py", "--recompute", "full"], "--recompute full: megatron"),
    ],
)
def test_what_cannot_run_on_cpu_is_refused_with_a_message(argv, message):
    r = run_bench(*argv, timeout=120)
    assert r.returncode != 0
    assert message in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]


def children_of(pid: int) -> list[int]:
    kids = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            kids += [int(x) for x in f.read().split()]
    return kids


def test_a_timeouts_sigterm_stops_the_bench_and_its_engine(tmp_path):
    """gpu_suite.sh stops an overlong run with SIGTERM: the bench unwinds (exit 143), stopping
    the engine child it started on the way, instead of dying where it stands."""
    proc = subprocess.Popen(
        [
            *(sys.executable, "bench/bench_engine.py", "--grpo"),
            *("--grpo-prompts", "1", "--grpo-n", "2", "--new-tokens", "50000"),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=ENV,
        cwd=REPO,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        engine = []
        while not engine:  # readiness: the engine child process exists
            assert proc.poll() is None, proc.stderr.read()[-2000:]
            assert time.monotonic() < deadline, "no engine child of bench_engine.py within 120 s"
            engine = [p for p in children_of(proc.pid) if b"engine" in cmdline(p)]
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 143
        deadline = time.monotonic() + 30
        while os.path.exists(f"/proc/{engine[0]}") and b"engine" in cmdline(engine[0]):
            assert time.monotonic() < deadline, f"engine child {engine[0]} outlived the bench"
            time.sleep(0.1)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except (FileNotFoundError, ProcessLookupError):
        return b""


def test_a_failed_hf_child_leaves_the_learner_figures_and_says_why(tmp_path):
    out = tmp_path / "learner.json"
    r = run_bench(*TINY_LEARNER, "--hf-timeout", "0.5", "--json", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["hf"]["error"] == "the HF child ran past --hf-timeout 0.5 s"
    assert "ratio_learner_over_hf" not in res and res["learner_tokens_per_s"] > 0
    assert "HF baseline: no figure: the HF child ran past --hf-timeout" in r.stdout
    assert "HF step: no figure (the HF child ran past" in r.stdout


def test_the_options_ab_part_alternates_its_option_and_the_defaults_in_processes_of_their_own(
    tmp_path,
):
    """`SUITE=learner_options_ab`: each round runs bench_learner once with `--options A` and once
    with the defaults, in that order, each a process of its own, and every command line parses
    with the bench (its `--options` giving the learner keys A, or none). The GPU bench itself is
    not run here: `python3` on the suite's PATH records its argv, prints the step line the suite
    shows, and exits."""
    bin_dir, log = tmp_path / "bin", tmp_path / "argv.jsonl"
    bin_dir.mkdir()
    fake = bin_dir / "python3"
    fake.write_text(
        f"#!{sys.executable}\nimport json, sys\n"
        f"open({str(log)!r}, 'a').write(json.dumps(sys.argv[1:]) + '\\n')\n"
        "print('learner step: 1.0 ms, min 1.0, max 1.0 over 8 steps')\n"  # what the suite greps
    )
    fake.chmod(0o755)
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\necho GPU 0: fake\n")
    (bin_dir / "nvidia-smi").chmod(0o755)
    env = {
        **ENV,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "SUITE": "learner_options_ab",
        "LEARNER_AB_ROUNDS": "2",
        "LEARNER_OPTIONS_A": "cuda_graphs=off;torch_compile=off",
        "OUT": str(tmp_path / "out"),
    }
    r = subprocess.run(
        ["bash", "bench/gpu_suite.sh"], cwd=REPO, env=env, capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    runs = [json.loads(x) for x in log.read_text().splitlines()]
    runs = [a for a in runs if a[:1] == ["bench/bench_learner.py"]]  # not the wheels' install
    assert len(runs) == 4, runs
    keys = []
    for argv in runs:
        args = bench_learner.build_parser().parse_args(argv[1:])
        bench_learner.check_args(args)
        assert args.baseline == "none" and args.warmup >= 2  # a graph is captured at step 2
        keys.append(bench_learner.learner_keys(args.options))
    a = {"cuda_graphs": "off", "torch_compile": "off"}
    assert keys == [a, {}, a, {}]
    assert len({argv[argv.index("--json") + 1] for argv in runs}) == 4  # one JSON a process
