"""The learner role: batches of whole groups -> Megatron-core training step -> weights to engines.

process.py     the `slime-async learner` process loop (`run_learner`): buffer, steps, push,
               version announcements, checkpoints and commits
trainer.py     `Learner`: builds the model and the components below and holds them; HF export,
               checkpoints, the public API
parallel.py    `ParallelLayout`: the process groups, ranks, device, the data-parallel sum
microbatches.py  `MicroBatches`: micro-batch planning, collation, the forward pass to log-probs
updates.py     `Updates`: optimizer, step and version, the updates over mini-batches (RL and SFT)
ppo_step.py    `PPOStep`: the RL step (advantages, pi_prox, routing replay's checks, the loss)
stale_tokens.py  `StaleTokens`: the stale-token policy (mask or count tokens beyond the bound)
logprobs.py    chunked log-probs / entropy over the vocabulary-parallel output (Triton kernels
               in logprobs_triton.py on a GPU)
options.py, megatron_optim.py, export.py  speed options; megatron-core's DDP + optimizer; export
batch.py       typed groups (`TrainGroup`), rows, micro-batch planning, collation
optim.py       AdamW on fp32 master weights, the LR schedule
checkpoint.py  dist_checkpointing save/load with the run's extra state
"""
