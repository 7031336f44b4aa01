"""Hugging Face <-> megatron-core weights, TP- and EP-aware, for every family of `families.py`.

Layouts (megatron-core local spec):
- `linear_qkv` holds q, k and v interleaved per query group: for each of the `ng` kv heads,
  its `nh / ng` query heads, then its key head, then its value head (`[ng * (r + 2) * hd, H]`).
  A TP rank holds `ng / tp` whole groups, so a shard is a contiguous slice of that layout.
- `linear_fc1` holds gate and up fused; a TP rank holds `cat(gate_shard, up_shard)`, not a
  slice of `cat(gate, up)`.
- Column-parallel weights (embedding, qkv, fc1, output layer) shard dim 0; row-parallel
  (`linear_proj`, `linear_fc2`) dim 1; norms are replicated.
- Routed experts are split by index over EP ranks, never over TP (`expert_tensor_parallel_size
  = 1`): local expert i of EP rank r is expert r * (E / ep) + i. Grouped experts
  (`mlp.experts.weight1 [E_local, 2I, H]`, `weight2 [E_local, H, I]`, `moe_layer.py`) stack
  the local experts' `linear_fc1` / `linear_fc2`; megatron's SequentialMLP keeps one module per
  expert (`mlp.experts.local_experts.{i}.linear_fc{1,2}.weight`).

The family says the HF names of each layer's parameters and how its checkpoint stores gate and
up (`Family.layer_names`, `expert_names`, `fc1_from_hf`, `fc1_to_hf`). Conversions are
reshapes and concatenations only, so HF -> Megatron -> HF is bit-exact.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from slime_async.models.arch import ModelArch
from slime_async.models.families import family_of

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "generation_config.json",
)
_TOP_NAMES = {  # megatron -> HF names outside the decoder layers, the same in every family
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "output_layer.weight": "lm_head.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
}
_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
_EXPERT = re.compile(r"mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight")
_STACKED = re.compile(r"mlp\.experts\.weight([12])")
_STACKED_FC = {"1": "linear_fc1", "2": "linear_fc2"}


class ConversionError(ValueError):
    """Weights and architecture disagree; the message names the tensor."""


# ---------------------------------------------------------------- names and shard layout


def is_expert(mname: str) -> bool:
    """Whether megatron parameter `mname` belongs to one routed expert (sharded over EP)."""
    return ".mlp.experts." in mname


def hf_names(mname: str, arch: ModelArch, ep_rank: int = 0, ep_size: int = 1) -> list[str]:
    """The HF tensor names that make up Megatron parameter `mname` (in merge order); expert
    parameters of EP rank `ep_rank` of `ep_size` name their global expert."""
    if mname in _TOP_NAMES:
        return [_TOP_NAMES[mname]]
    m = _LAYER.fullmatch(mname)
    if not m:
        raise ConversionError(f"no HF name for megatron parameter {mname!r}")
    family = family_of(arch.family)
    e = _EXPERT.fullmatch(m.group(2))
    st = _STACKED.fullmatch(m.group(2))
    if st:  # every local expert's tensors, expert after expert
        local = arch.num_experts // ep_size
        fc = _STACKED_FC[st.group(1)]
        names = tuple(n for i in range(local) for n in family.expert_names(ep_rank * local + i, fc))
    elif e:
        g = ep_rank * (arch.num_experts // ep_size) + int(e.group(1))
        names = family.expert_names(g, e.group(2))
    else:
        names = family.layer_names.get(m.group(2))
    if names is None:
        raise ConversionError(f"no HF name for megatron parameter {mname!r}")
    return [f"model.layers.{m.group(1)}.{s}" for s in names]


def is_stacked_expert(mname: str) -> bool:
    """Whether `mname` stacks all local experts along its dim 0 (grouped experts)."""
    return _STACKED.search(mname) is not None


def partition_dim(mname: str) -> int | None:
    """The dim a TP rank's shard of `mname` is cut along (None: replicated over TP)."""
    if is_expert(mname):
        return None
    if mname.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return 1
    if mname.endswith(
        ("word_embeddings.weight", "output_layer.weight", "linear_qkv.weight", "linear_qkv.bias")
    ) or mname.endswith("linear_fc1.weight"):
        return 0
    return None


def _qkv_merge(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, arch: ModelArch) -> torch.Tensor:
    """q [nh*hd, *rest], k/v [ng*hd, *rest] -> [ng*(r+2)*hd, *rest] grouped per kv head."""
    ng, hd = arch.num_kv_heads, arch.head_dim
    r = arch.num_heads // ng
    rest = q.shape[1:]
    if q.shape[0] != ng * r * hd or k.shape[0] != ng * hd or v.shape[0] != ng * hd:
        raise ConversionError(
            f"q/k/v shapes {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)} do not match "
            f"{arch.num_heads} heads, {ng} kv heads, head_dim {hd}"
        )
    parts = [q.view(ng, r, hd, *rest), k.view(ng, 1, hd, *rest), v.view(ng, 1, hd, *rest)]
    return torch.cat(parts, dim=1).reshape(ng * (r + 2) * hd, *rest)


def _qkv_split(qkv: torch.Tensor, arch: ModelArch) -> list[torch.Tensor]:
    ng, hd = arch.num_kv_heads, arch.head_dim
    r = arch.num_heads // ng
    rest = qkv.shape[1:]
    g = qkv.view(ng, r + 2, hd, *rest)
    q = g[:, :r].reshape(ng * r * hd, *rest)
    k = g[:, r].reshape(ng * hd, *rest)
    v = g[:, r + 1].reshape(ng * hd, *rest)
    return [q.contiguous(), k.contiguous(), v.contiguous()]


def hf_to_megatron_shard(
    mname: str, hf: list[torch.Tensor], arch: ModelArch, tp_rank: int, tp_size: int
) -> torch.Tensor:
    """This TP rank's shard of Megatron parameter `mname` from its full HF tensors."""
    if is_stacked_expert(mname):
        fc1 = mname.endswith("weight1")
        fam = family_of(arch.family)
        per = len(fam.expert_names(0, "linear_fc1" if fc1 else "linear_fc2"))
        groups = [hf[i : i + per] for i in range(0, len(hf), per)]
        return torch.stack([torch.cat(fam.fc1_from_hf(g), 0) if fc1 else g[0] for g in groups])
    if mname.endswith("linear_fc1.weight"):
        hf = family_of(arch.family).fc1_from_hf(hf)
        if is_expert(mname):
            return torch.cat(hf, dim=0)
        gate, up = (t.chunk(tp_size, dim=0)[tp_rank] for t in hf)
        return torch.cat([gate, up], dim=0)
    full = _qkv_merge(*hf, arch) if "linear_qkv" in mname else hf[0]
    dim = partition_dim(mname)
    return full if dim is None or tp_size == 1 else full.chunk(tp_size, dim=dim)[tp_rank]


def megatron_shards_to_hf(
    mname: str, shards: list[torch.Tensor], arch: ModelArch, ep_rank: int = 0, ep_size: int = 1
) -> list[tuple[str, torch.Tensor]]:
    """HF (name, tensor) pairs from the TP shards (rank order) of Megatron parameter `mname`
    (an expert parameter: its one tensor, from EP rank `ep_rank` of `ep_size`)."""
    names = hf_names(mname, arch, ep_rank, ep_size)
    if is_stacked_expert(mname):
        (stacked,) = shards
        if mname.endswith("weight2"):
            return [(n, t.detach().contiguous()) for n, t in zip(names, stacked, strict=True)]
        fam = family_of(arch.family)
        tensors = [t for w in stacked for t in fam.fc1_to_hf(*w.chunk(2, dim=0))]
        return [(n, t.detach().contiguous()) for n, t in zip(names, tensors, strict=True)]
    if mname.endswith("linear_fc1.weight"):
        halves = [s.chunk(2, dim=0) for s in shards]
        gate = torch.cat([h[0] for h in halves], dim=0)
        up = torch.cat([h[1] for h in halves], dim=0)
        return list(zip(names, family_of(arch.family).fc1_to_hf(gate, up), strict=True))
    dim = partition_dim(mname)
    full = shards[0] if dim is None or len(shards) == 1 else torch.cat(shards, dim=dim)
    if "linear_qkv" in mname:
        return list(zip(names, _qkv_split(full, arch), strict=True))
    return [(names[0], full.detach().contiguous())]


# ---------------------------------------------------------------- HF checkpoints on disk


class HFCheckpoint:
    """The safetensors files of an HF model directory, read lazily by tensor name."""

    def __init__(self, model_dir: str | Path):
        self.dir = Path(model_dir)
        index = self.dir / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = [p.name for p in sorted(self.dir.glob("*.safetensors"))]
        if not files:
            raise ConversionError(f"{self.dir}: no *.safetensors weights")
        self._handles = {f: safe_open(str(self.dir / f), framework="pt") for f in files}
        self._where = {n: f for f, h in self._handles.items() for n in h.keys()}  # noqa: SIM118

    def names(self) -> set[str]:
        return set(self._where)

    def get(self, name: str) -> torch.Tensor:
        if name not in self._where:
            raise ConversionError(f"{self.dir}: tensor {name!r} is missing")
        return self._handles[self._where[name]].get_tensor(name)


def load_hf_into_model(model: torch.nn.Module, hf_dir: str | Path, arch: ModelArch) -> None:
    """Copy an HF checkpoint into this TP rank's Megatron parameters (every one, checked)."""
    from megatron.core import parallel_state  # after megatron_compat.apply() (see there)

    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    ep_size = parallel_state.get_expert_model_parallel_world_size()
    ckpt = HFCheckpoint(hf_dir)
    used: set[str] = set()
    with torch.no_grad():
        for mname, param in model.named_parameters():
            names = hf_names(mname, arch, ep_rank, ep_size)
            shard = hf_to_megatron_shard(
                mname, [ckpt.get(n) for n in names], arch, tp_rank, tp_size
            )
            if shard.shape != param.shape:
                raise ConversionError(
                    f"{names}: HF shape gives {tuple(shard.shape)} for {mname}, "
                    f"model has {tuple(param.shape)} (tp={tp_size})"
                )
            param.copy_(shard)
            used.update(names)
    # Tied models may still store lm_head; rotary caches are recomputed.
    ignorable = {"lm_head.weight"} if arch.tie_word_embeddings else set()
    if ep_size > 1:  # the other EP ranks' experts are theirs to load
        family = family_of(arch.family)
        ignorable |= {n for n in ckpt.names() if family.is_hf_expert(n)}
    left = {n for n in ckpt.names() - used - ignorable if not n.endswith("rotary_emb.inv_freq")}
    if left:
        raise ConversionError(
            f"{hf_dir}: tensors not used by the {arch.family} model: {sorted(left)[:8]}"
        )


def export_hf_tensors(
    model: torch.nn.Module, arch: ModelArch, gather: Callable[[torch.Tensor], list[torch.Tensor]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named, HF-layout tensors of the model, one Megatron parameter at a time.

    `gather(local) -> [shard of each TP rank]` is a collective: every TP rank iterates in step.
    """
    for mname, param in model.named_parameters():
        local = param.detach()
        shards = gather(local) if partition_dim(mname) is not None else [local]
        yield from megatron_shards_to_hf(mname, shards, arch)


def write_hf_dir(
    out_dir: str | Path,
    tensors: Iterator[tuple[str, torch.Tensor]],
    hf_config: dict,
    tokenizer_dir: str | Path | None = None,
    shard_bytes: int = 4 << 30,
) -> Path:
    """A complete HF model directory: config.json, safetensors (sharded past `shard_bytes`), tokenizer."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors:
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t.detach().to("cpu").contiguous()
        size += nbytes
    meta = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], str(out / "model.safetensors"), metadata=meta)
    else:
        weight_map = {}
        total = 0
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(out / fname), metadata=meta)
            for name, t in shard.items():
                weight_map[name] = fname
                total += t.numel() * t.element_size()
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    if tokenizer_dir is not None:
        copy_tokenizer_files(tokenizer_dir, out)
    return out


def copy_tokenizer_files(src: str | Path, dst: str | Path) -> None:
    """Copy the tokenizer (and generation config) files that exist in `src`."""
    for name in TOKENIZER_FILES:
        f = Path(src) / name
        if f.is_file() and Path(src).resolve() != Path(dst).resolve():
            shutil.copy2(f, Path(dst) / name)
