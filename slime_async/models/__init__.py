"""Models of the learner: megatron-core GPTModels built from HF configs, HF <-> Megatron conversion,
and the tokenizer loader. Toy models for tests live in `slime_async.testing.models`."""
