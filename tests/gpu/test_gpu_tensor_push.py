"""The colocated push on a GPU: an embedded engine process on cuda:0, the learner (this process)
on the same GPU. push.backend = auto sees the engine on the learner's GPU and pushes by CUDA IPC
handle (`/update_weights_from_tensor`, no group); the engine's greedy tokens then equal HF's with
the pushed weights, and nothing went through host memory: the request carries CUDA handles only
(a few hundred bytes a tensor, no shared-memory file), and no pushed tensor was copied off the
GPU on this side. The CPU paths are in tests/integration/test_engine_tensor_push.py."""

import base64
import json
import urllib.request

import pytest
import torch
from transformers import AutoModelForCausalLM

from slime_async.actors.engine.tensor_push import flatten, request_body
from slime_async.actors.engine.weight_push import WeightPusher
from slime_async.metrics import names as M
from slime_async.models.toy import make_tiny_model
from tests.support.engine_util import hf_greedy, push_config, start_engine

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
PROMPT = [2, 9, 10, 11]


@pytest.mark.gpu
@needs_cuda
def test_push_by_cuda_ipc_to_an_engine_on_the_learners_gpu(tmp_path, monkeypatch):
    d0 = make_tiny_model(tmp_path / "v0", family="qwen3", seed=1)
    d1 = make_tiny_model(tmp_path / "v1", family="qwen3", seed=2)
    torch.cuda.set_device(0)
    model = AutoModelForCausalLM.from_pretrained(d1, dtype=torch.float32)
    want = hf_greedy(model, PROMPT, 8)[0]  # on the CPU, as tests/gpu/test_engine_gpu.py
    named = [(n, p.detach().to("cuda:0")) for n, p in model.named_parameters()]

    body = request_body(named[:1], weight_version="one")
    raw = base64.b64decode(body["serialized_named_tensors"][0])
    assert b"rebuild_cuda_tensor" in raw and b"rebuild_storage_filename" not in raw
    assert len(raw) < 2048 < named[0][1].numel() * named[0][1].element_size()
    # a flattened bucket: one handle for all its tensors (what the pusher sends)
    flat = base64.b64decode(request_body(flatten(named))["serialized_named_tensors"][0])
    assert flat.count(b"rebuild_cuda_tensor") == 1 and b"rebuild_storage_filename" not in flat

    child, url = start_engine(
        d0, tmp_path, "engine.embedded.device=cuda:0", "engine.embedded.dtype=float32"
    )
    pusher = WeightPusher([url], push_config(backend="auto", timeout_s=120))
    try:
        # the request itself, by hand: the engine opens the handle (which releases it here)
        req = urllib.request.Request(
            f"{url}/update_weights_from_tensor",
            data=json.dumps({**body, "flush_cache": False}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=60) as r:
            assert json.loads(r.read())["success"] is True
        del body, raw
        pusher.connect()
        assert list(pusher.ipc) == [url] and pusher.group is None
        assert "shares the learner's GPU" in pusher.ipc[url]
        off_gpu = []
        to = torch.Tensor.to

        def watched_to(self, *args, **kwargs):
            out = to(self, *args, **kwargs)
            if self.is_cuda and not out.is_cuda:
                off_gpu.append(tuple(self.shape))
            return out

        monkeypatch.setattr(torch.Tensor, "to", watched_to)
        stats = pusher.push([named[:4], named[4:]], version=3)
        monkeypatch.undo()
        assert stats["failed"] == 0.0 and off_gpu == []
        assert pusher.served_versions() == {url: 3}
        m = pusher.metrics()
        assert m[M.PUSH_IPC_ENGINES] == 1.0 and m[M.PUSH_IPC_FALLBACKS] == 0.0
        assert m[M.PUSH_IPC_FLAT_REFUSED] == 0.0
        req = urllib.request.Request(
            f"{url}/generate",
            data=json.dumps(
                {
                    "input_ids": PROMPT,
                    "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True},
                }
            ).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=60) as r:
            got = json.loads(r.read())["output_ids"]
        assert got == want
        # the learner may change its tensors once the engine answered: the engine has its copy
        for _, t in named:
            t.zero_()
        with urllib.request.urlopen(req, timeout=60) as r:
            assert json.loads(r.read())["output_ids"] == want
    finally:
        pusher.close()
        child.stop()
