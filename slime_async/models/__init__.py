"""Model helpers: tiny offline models for tests and examples; HF <-> Megatron live beside it."""
