"""Multi-turn tool use: the model calls a calculator, the environment answers in tokens."""
