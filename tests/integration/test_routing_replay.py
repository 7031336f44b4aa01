"""Routing replay that survives async, end to end on the CPU with a tiny Qwen3-MoE: one rollout
whose response spans an in-flight weight update (per-token versions) and an aborted-and-resumed
request, through the embedded engine's /generate, the engine client and `ctx.generate`. Its
routed experts must be, row for row, the experts the engine's own forward passes chose: each
position with the weights that computed it, over the KV cache it was computed on (replayed here
with HF transformers and a KV cache whose weights are switched at the same tokens)."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request

import numpy as np
import pytest
import torch

from slime_async.actors.engine.client import EngineClient
from slime_async.actors.generator.rollout import RolloutContext
from slime_async.models.toy import make_tiny_model
from tests.support.engine_util import start_engine

SHAPE = dict(num_layers=3, hidden_size=64, num_experts=8, num_experts_per_tok=2)
PROMPT = [2, 10, 11, 12, 13, 14]


def _post(url: str, path: str, body: dict) -> dict:
    req = urllib.request.Request(
        url + path, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read() or b"{}")


def _steps(url: str) -> int:
    with urllib.request.urlopen(url + "/get_server_info", timeout=10) as resp:
        return int(json.loads(resp.read())["decode_steps"])


def _sharp_router(model_dir) -> None:
    """Router logits far apart (no near-ties between the engine's and HF's attention math)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.mul_(8.0)
    model.save_pretrained(model_dir, safe_serialization=True)


def _hf_routing(dirs: list, tokens: list[int], version_of: list[int], start: int, end: int):
    """[end - start, layers, k]: HF over `tokens`, position p fed with the weights of version
    `version_of[p]` (dirs[v]) on a KV cache built the same way; rows [start, end)."""
    from transformers import AutoModelForCausalLM, DynamicCache

    models = [AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval() for d in dirs]
    rows: list[torch.Tensor] = []
    cache = DynamicCache()
    with torch.inference_mode():
        for p in range(end):
            model = models[version_of[p]]
            picked: list[torch.Tensor] = []
            gates = [layer.mlp.gate for layer in model.model.layers]
            hooks = [
                g.register_forward_hook(lambda m, i, o, into=picked: into.append(o[2]))
                for g in gates
            ]
            try:
                model(
                    input_ids=torch.tensor([[tokens[p]]]),
                    past_key_values=cache,
                    use_cache=True,
                    position_ids=torch.tensor([[p]]),
                )
            finally:
                for h in hooks:
                    h.remove()
            rows.append(torch.stack([x[0] for x in picked]))  # [layers, k]
    return torch.stack(rows[start:end]).numpy()


@pytest.mark.timeout(600)  # 600 tokens on a CPU engine plus the HF replay: minutes under load
def test_routing_survives_a_weight_push_and_a_resumed_request(tmp_path):
    dirs = []
    for seed in range(3):  # the weights of versions 0, 1, 2: different routers
        d = make_tiny_model(tmp_path / f"w{seed}", "qwen3_moe", seed=seed, **SHAPE)
        _sharp_router(d)
        dirs.append(d)
    child, url = start_engine(dirs[0], tmp_path, "engine.embedded.max_context_len=1024")
    try:
        gen = asyncio.run(_rollout(url, dirs))
    finally:
        child.stop()
    versions = gen.versions
    assert gen.resumes == 1 and {0, 1, 2} <= set(versions), versions
    tokens = PROMPT + gen.token_ids
    end = len(tokens) - 1  # every token but the last was fed
    layers, k = SHAPE["num_layers"], SHAPE["num_experts_per_tok"]
    got = gen.routed_experts.reshape(end, layers, k)
    n1 = sum(v < 2 for v in versions)  # the aborted request's tokens (before version 2)
    # The aborted request: position p fed by the forward that sampled output token p - P + 1
    # (the prompt by its prefill), with that token's weights, on its own KV cache.
    p_len = len(PROMPT)
    version_of = [versions[max(0, p - p_len + 1)] for p in range(end)]
    first = _hf_routing(dirs, tokens, version_of, 0, p_len + n1 - 1)
    # The resumed request: its prefill recomputed everything with version 2; rows from its
    # first fed position on.
    second = _hf_routing(dirs, tokens, [2] * end, p_len + n1 - 1, end)
    want = np.concatenate([first, second])
    # Top-k order is HF's (descending probability) in both: compare as sets per layer.
    assert np.array_equal(np.sort(got, -1), np.sort(want, -1)), np.argwhere(
        np.sort(got, -1) != np.sort(want, -1)
    )[:5]
    # The earlier segments' routing differs from what the last segment's prefill computes for
    # the same positions (version 2 over everything): keeping only the last segment, or
    # recomputing at the end, loses it.
    redo = _hf_routing(dirs, tokens, [2] * end, 0, p_len + n1 - 1)
    assert (np.sort(redo, -1) != np.sort(first, -1)).any(-1).mean() > 0.3


async def _rollout(url: str, dirs: list):
    """One ctx.generate; meanwhile: after some tokens an in-place update to version 1 (the
    request keeps running), after more a pause that aborts it, version 2, and continue."""
    client = EngineClient(url)
    client.return_routed_experts = True
    ctx = RolloutContext(client, tokenizer=None, apply_chat_template=False)
    sampling = {"max_new_tokens": 600, "temperature": 1.0, "ignore_eos": True}
    try:
        task = asyncio.create_task(ctx.generate(PROMPT, sampling))
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, _drive, url, dirs)
        return await asyncio.wait_for(task, 300)
    finally:
        await client.close()


def _drive(url: str, dirs: list) -> None:
    def after(steps: int) -> None:
        deadline = time.monotonic() + 120
        while _steps(url) < steps:
            assert time.monotonic() < deadline, f"the engine did not reach {steps} decode steps"
            time.sleep(0.002)

    base = _steps(url)
    after(base + 8)
    _post(url, "/pause_generation", {"mode": "in_place"})
    out = _post(
        url,
        "/update_weights_from_disk",
        {"model_path": str(dirs[1]), "weight_version": "1", "flush_cache": False},
    )
    assert out["success"], out
    _post(url, "/continue_generation", {})
    after(_steps(url) + 8)
    _post(url, "/pause_generation", {"mode": "abort"})
    out = _post(
        url, "/update_weights_from_disk", {"model_path": str(dirs[2]), "weight_version": "2"}
    )
    assert out["success"], out
    _post(url, "/continue_generation", {})
