"""The learner role: batches of whole groups -> Megatron-core training step -> weights to engines.

process.py     the `slime-async learner` process loop (`run_learner`): buffer, steps, push,
               version announcements, checkpoints and commits
trainer.py     `Learner`: one rank's model, per-token log-probs, the step, HF export
batch.py       typed groups (`TrainGroup`), rows, micro-batch planning, collation
optim.py       AdamW on fp32 master weights, the LR schedule
checkpoint.py  dist_checkpointing save/load with the run's extra state
"""
