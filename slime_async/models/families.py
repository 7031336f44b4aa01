"""The model families, by HF `model_type`: the one list that the learner's model builder, the
HF <-> megatron conversion and the embedded engine read. A family's folder says what it is."""

from __future__ import annotations

from slime_async.models.family import Family, UnsupportedModel
from slime_async.models.glm4 import Glm4
from slime_async.models.llama import Llama, Qwen2, Qwen3
from slime_async.models.qwen3_moe import Qwen3Moe

FAMILIES: dict[str, Family] = {
    f.model_type: f for f in (Llama(), Qwen2(), Qwen3(), Glm4(), Qwen3Moe())
}


def family_of(model_type: str | None) -> Family:
    """The family of an HF `model_type`; UnsupportedModel naming the families for another."""
    if model_type not in FAMILIES:
        raise UnsupportedModel(f"model_type {model_type!r} is not one of {tuple(FAMILIES)}")
    return FAMILIES[model_type]


def import_hf_modeling() -> list[str]:
    """Import transformers' modeling module of each family (what the embedded engine's model
    classes come from); returns those that failed to import. For a process that forks engines
    (launch/preload.py): a child then finds them imported."""
    import importlib

    failed = []
    for model_type in FAMILIES:
        name = f"transformers.models.{model_type}.modeling_{model_type}"
        try:
            importlib.import_module(name)
        except ImportError:
            failed.append(name)
    return failed
