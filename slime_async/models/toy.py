"""Tiny Qwen3/Llama-shaped models and a character tokenizer for examples, benchmarks and tests.

Made offline (no model hub is needed): a character-level tokenizer and random-init causal LMs of
each supported family, so the quickstart, the examples, the benchmarks and the tests build their
own models. `make_tiny_model(dir, family="qwen3")` writes a complete HF directory (config.json,
model.safetensors, tokenizer.json, tokenizer_config.json) that `AutoModelForCausalLM` and
`AutoTokenizer` load with `local_files_only=True`.
"""

from __future__ import annotations

import json
import string
from pathlib import Path
from typing import Literal

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

PAD, EOS, BOS = "<pad>", "<eos>", "<bos>"
# Role markers for the examples' chat template (single tokens, so masks stay token-exact).
SPECIAL_TOKENS = [PAD, EOS, BOS, "<user>", "<assistant>", "<tool>", "<call>", "</call>"]
CHARS = string.digits + string.ascii_letters + " +-*/=()?.,:;!<>_#\n'\"%"

# A chat template over the special tokens: every message is `<role>content<eos>`.
CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}<eos>{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)

Family = Literal["llama", "qwen2", "qwen3", "glm4", "qwen3_moe"]

# Qwen3-0.6B's shape with tied embeddings: about 0.5B parameters (0.15B of them the 151,936-token
# embedding). The GPU benchmarks and the two-GPU run use it randomly initialised.
QWEN3_05B_SHAPE = dict(
    hidden_size=1024,
    num_layers=28,
    num_heads=16,
    num_kv_heads=8,
    intermediate_size=3072,
    vocab_size=151936,
    tie_word_embeddings=True,
    max_position_embeddings=40960,  # as Qwen3-0.6B: long-context benches fit
    rope_theta=1_000_000.0,
)


def char_tokenizer():
    """A PreTrainedTokenizerFast with one token per character plus SPECIAL_TOKENS."""

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in CHARS:
        vocab.setdefault(ch, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=PAD))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        eos_token=EOS,
        bos_token=BOS,
        chat_template=CHAT_TEMPLATE,
    )


def tiny_config(
    family: Family = "qwen3",
    vocab_size: int = 128,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 512,
    tie_word_embeddings: bool = False,
    rope_theta: float = 10000.0,
    num_experts: int = 8,
    num_experts_per_tok: int = 2,
    moe_intermediate_size: int = 32,
    norm_topk_prob: bool = True,
    mlp_only_layers: tuple[int, ...] = (),
    decoder_sparse_step: int = 1,
    partial_rotary_factor: float = 0.5,
):
    """An HF config of `family` with the given shape (GQA when num_kv_heads < num_heads).

    glm4: q/k/v biases, `partial_rotary_factor` of each head rotated (interleaved), the extra
    norms. qwen3_moe: `num_experts` experts of width `moe_intermediate_size`, top
    `num_experts_per_tok`, dense MLPs on `mlp_only_layers`."""

    model_type = family
    kwargs = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        rms_norm_eps=1e-6,
        hidden_act="silu",
        dtype="float32",
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
    )
    if family in ("qwen3", "qwen3_moe", "glm4"):
        kwargs["head_dim"] = hidden_size // num_heads
    if family == "qwen3_moe":
        kwargs.update(
            num_experts=num_experts,
            num_experts_per_tok=num_experts_per_tok,
            moe_intermediate_size=moe_intermediate_size,
            norm_topk_prob=norm_topk_prob,
            mlp_only_layers=list(mlp_only_layers),
            decoder_sparse_step=decoder_sparse_step,
        )
    if family == "glm4":
        kwargs["attention_bias"] = True
    cfg = AutoConfig.for_model(model_type, **kwargs)
    # transformers 5 keeps RoPE settings in rope_parameters; older versions in rope_theta.
    if getattr(cfg, "rope_parameters", None) is not None:
        cfg.rope_parameters = {
            **cfg.rope_parameters,
            "rope_theta": rope_theta,
            "rope_type": "default",
        }
        if family == "glm4":
            cfg.rope_parameters["partial_rotary_factor"] = partial_rotary_factor
    else:
        cfg.rope_theta = rope_theta
    return cfg


def make_tiny_model(out_dir: str | Path, family: Family = "qwen3", seed: int = 0, **shape) -> Path:
    """Write a random-init tiny HF causal LM plus the char tokenizer into `out_dir`."""

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = char_tokenizer()
    shape.setdefault("vocab_size", max(128, len(tok)))
    cfg = tiny_config(family, **shape)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    if family == "glm4":
        # HF initialises norms to 1 and biases to 0: random ones, so a test notices a norm or
        # bias that the conversion drops or misplaces.
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("layernorm.weight") or name.endswith("bias"):
                    p.copy_(
                        1.0 + 0.1 * torch.randn_like(p)
                        if name.endswith("weight")
                        else 0.1 * torch.randn_like(p)
                    )
    if family == "qwen3_moe":
        with torch.no_grad():  # HF initialises the router to zeros: every token would tie
            for layer in model.model.layers:
                gate = getattr(layer.mlp, "gate", None)
                if gate is not None:
                    gate.weight.normal_(0.0, 0.5)
    model.save_pretrained(out, safe_serialization=True)
    save_tokenizer(tok, out)
    return out


def save_tokenizer(tok, out_dir: str | Path) -> None:
    """Save the char tokenizer so AutoTokenizer loads it as is, whatever the model family.

    transformers 5 otherwise picks the family's own tokenizer class (Qwen2Tokenizer, ...),
    which adds tokens and normalises text.
    """

    out = Path(out_dir)
    tok.save_pretrained(out)
    path = out / "tokenizer_config.json"
    data = json.loads(path.read_text())
    data["tokenizer_class"] = "PreTrainedTokenizerFast"
    path.write_text(json.dumps(data, indent=2) + "\n")
