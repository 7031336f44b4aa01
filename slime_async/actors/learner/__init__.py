"""The learner role: batches of whole groups -> Megatron-core training step -> weights to engines.

process.py     the `slime-async learner` process loop (`run_learner`): buffer, steps, push,
               version announcements, checkpoints and commits
trainer.py     `Learner`: one rank's model and optimizer, HF export, checkpoints; built from
ppo_step.py    the RL step: advantages, stale tokens, pi_prox, the loss
updates.py     optimizer updates over mini-batches (RL and SFT), skipped updates, step metrics
microbatches.py  micro-batch planning, collation and the forward pass to per-token log-probs
logprobs.py    chunked log-probs / entropy over the vocabulary-parallel output (Triton kernels
               in logprobs_triton.py on a GPU)
options.py, megatron_optim.py, export.py  speed options; megatron-core's DDP + optimizer; export
batch.py       typed groups (`TrainGroup`), rows, micro-batch planning, collation
optim.py       AdamW on fp32 master weights, the LR schedule
checkpoint.py  dist_checkpointing save/load with the run's extra state
"""
