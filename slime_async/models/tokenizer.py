"""Load a model directory's tokenizer the same way in every role (engine, generator, learner)."""

from __future__ import annotations

import json
from pathlib import Path


def load_tokenizer(model_dir: str | Path):
    """The tokenizer of an HF model directory, offline.

    A directory whose tokenizer_config names `PreTrainedTokenizerFast` (our own tiny models) is
    loaded with exactly that class: transformers 5's AutoTokenizer would substitute the model
    family's tokenizer for some families (qwen2), which changes the vocabulary.
    """
    path = Path(model_dir)
    cfg_path = path / "tokenizer_config.json"
    if cfg_path.is_file():
        cls = json.loads(cfg_path.read_text()).get("tokenizer_class")
        if cls == "PreTrainedTokenizerFast":
            from transformers import PreTrainedTokenizerFast

            return PreTrainedTokenizerFast.from_pretrained(path, local_files_only=True)
    # AutoTokenizer's module loads every family's tokenizer mapping: about 3 s of CPU more than
    # the class above on a 2-core machine, so only for the directories that need it.
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)
