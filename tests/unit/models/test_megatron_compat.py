"""megatron-core on a CPU-only torch through slime_async.megatron_compat."""

import os
import subprocess
import sys

import torch

from slime_async import megatron_compat

# megatron.core is imported inside the tests, after megatron_compat.apply(): that order is what
# this file checks (see megatron_compat's docstring).


def test_apply_is_idempotent_and_patches_cuda_calls():
    assert megatron_compat.apply() is True
    assert megatron_compat.apply() is True
    assert torch.cuda.current_device() == torch.device("cpu")
    torch.cuda.synchronize()  # a no-op instead of an error


def test_causal_mask_shape_and_values():
    m = megatron_compat.causal_mask(4)
    assert m.shape == (1, 1, 4, 4) and m.dtype == torch.bool
    assert not m[0, 0].diagonal().any()
    assert m[0, 0, 0, 1] and not m[0, 0, 1, 0]


def test_tiny_gpt_model_trains_one_step_on_cpu(single_rank_megatron):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    megatron_compat.seed_model_parallel(0)
    config = TransformerConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=64,
        max_sequence_length=16,
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(0)
    ids = torch.randint(0, 64, (2, 12))
    pos = torch.arange(12).expand(2, 12)
    mask = megatron_compat.causal_mask(12)
    labels = torch.roll(ids, -1, dims=1)

    losses = []
    for _ in range(2):
        loss = model(ids, pos, mask, labels=labels).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[1] < losses[0]
    assert all(p.device.type == "cpu" for p in model.parameters())


def test_megatron_is_imported_without_torchs_compiler_or_wandb_and_both_come_back():
    """The import's two costs the CPU path never uses (docstring's item 9), in a fresh process:
    neither torch's compiler nor wandb is loaded by it; afterwards `torch.compile` is torch's own
    again and wandb imports."""
    code = (
        "import sys, torch\n"
        "compile_ = torch.compile\n"
        "from slime_async import megatron_compat\n"
        "assert megatron_compat.apply()\n"
        "import megatron.core.jit, megatron.core.models.gpt\n"
        "assert 'torch._inductor.compile_fx' not in sys.modules\n"
        "assert 'wandb' not in sys.modules, sys.modules.get('wandb')\n"
        "assert torch.compile is compile_\n"
        "assert megatron.core.jit.jit_fuser(len) is len\n"
        "import wandb\n"
        "print('ok')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]
