"""Models: the architecture read from an HF config (`arch.py`), the megatron-core GPTModel built
from it (`megatron.py`), HF <-> Megatron weight conversion (`convert.py`), the embedded engine's
per-layer math (`layer_math.py`) and the tokenizer loader.

Each model family has a folder (`llama/`, `glm4/`, `qwen3_moe/`) holding what it does
differently from the Llama-style decoder, in the four parts of `family.py`; `families.py` maps
HF model types to them. Toy models for the examples, benchmarks and tests: `toy.py`.
"""
