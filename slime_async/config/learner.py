"""`[learner]`: the Megatron-core learner."""

from typing import Literal

from pydantic import Field, model_validator

from slime_async.config.base import Section


class LearnerConfig(Section):
    model_path: str | None = None
    """HF model directory to start from (config, safetensors, tokenizer)."""
    load: str | None = None
    """Megatron torch_dist checkpoint directory to resume from (overrides model_path weights)."""
    save: str | None = None
    """Checkpoint directory (relative paths are under the run dir; None: <run_dir>/checkpoints)."""
    save_interval: int = Field(0, ge=0)
    """Save every this many optimizer steps (0: only at the end)."""
    save_hf_interval: int = Field(0, ge=0)
    """Every this many steps (and at the last) the checkpoint also holds a complete Hugging Face
    directory in `checkpoints/step_N/hf/` (config, safetensors, tokenizer), written before the
    checkpoint is complete; a multiple of `save_interval` (0: never; `slime-async export` makes
    one from any checkpoint later)."""
    token_record_interval: int = Field(1, ge=0)
    """Every this many steps the learner writes `token_records/step_N.npz`: per token of the
    batch its behaviour and learner log-probs, advantage and loss gradient, for `slime-async
    inspect` (21 bytes per response token; 0: never)."""
    token_record_keep: int = Field(0, ge=0)
    """Keep only the newest this many token records (0: all)."""
    tensor_parallel: int = Field(1, ge=1)
    """Tensor-parallel size (data parallel = world size / tensor_parallel)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Parameter and compute dtype (bfloat16 on GPU; fp32 master weights in the optimizer)."""
    lr: float = Field(1e-6, gt=0)
    """Peak learning rate."""
    min_lr: float = Field(0.0, ge=0)
    """Learning rate at the end of the cosine decay."""
    lr_warmup_steps: int = Field(0, ge=0)
    """Linear warm-up steps."""
    lr_decay_steps: int | None = None
    """Cosine decay length in steps (None: constant after warm-up)."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    adam_beta1: float = 0.9
    """AdamW beta1."""
    adam_beta2: float = 0.999
    """AdamW beta2."""
    adam_eps: float = 1e-8
    """AdamW epsilon."""
    clip_grad: float = Field(1.0, ge=0)
    """Global gradient-norm clip (0: off)."""
    groups_per_step: int = Field(8, ge=1)
    """Groups (prompts x group_size trajectories) consumed per optimizer step."""
    micro_batch_tokens: int = Field(4096, ge=1)
    """Most tokens in one micro-batch (after padding); micro-batches accumulate gradients."""
    num_steps: int = Field(100, ge=1)
    """Optimizer steps to train."""
    torch_threads: int = Field(0, ge=0)
    """CPU threads of each learner process (torch.set_num_threads); 0: torch's default."""
    gc_warning_s: float = Field(0.05, gt=0)
    """A garbage collection of a learner process longer than this is logged as a warning with its
    rank and counted (`learner/gc_long`); every rank freezes what start-up made out of the
    collector's sight before its first step, and rank 0 records each step's collection time
    (`learner/gc_s`)."""
    prox_compare_interval: int = Field(10, ge=0)
    """With algo.prox_source = "interpolate": also run the exact pi_prox forward pass on every this
    many-th batch and log how far the interpolation is from it (prox/interp_abs_err; 0: never)."""
    seed: int = 1234
    """Seed of parameter init and dropout (unset in a full config: run.seed)."""
    expert_parallel: int = Field(1, ge=1)
    """Expert-parallel size of a mixture-of-experts model: its experts are split over this many
    ranks, carved out of the data-parallel ranks (world size must be divisible by it)."""
    moe_aux_loss_coeff: float = Field(0.0, ge=0)
    """Weight of the MoE load-balancing loss, computed as transformers' Qwen3-MoE does
    (`load_balancing_loss_func`, pooled over every MoE layer and real token; its
    `router_aux_loss_coef`); 0: off."""
    moe_z_loss_coeff: float = Field(0.0, ge=0)
    """Weight of the MoE router z-loss, the mean over MoE layers and real tokens of
    `logsumexp(router logits)^2` (ST-MoE's); 0: off."""
    moe_experts: Literal["grouped", "sequential"] = "grouped"
    """How the learner runs a MoE layer's experts: "grouped" (two grouped GEMMs for all local
    experts, `torch._grouped_mm` on a GPU in bf16, an exact per-expert loop elsewhere) or
    "sequential" (megatron-core's SequentialMLP, one expert module after another; the same
    math, for comparison)."""
    routing_replay: bool = False
    """MoE: the learner's forward takes the experts each token went through at generation
    (`Trajectory.routed_experts`, which the engines return) instead of routing again."""
    optimizer: Literal["auto", "megatron", "master_adamw"] = "auto"
    """"megatron": megatron-core's DistributedDataParallel + (Distributed)Optimizer (GPU only);
    "master_adamw": torch AdamW on fp32 masters with one all-reduce per parameter (CPU and GPU);
    "auto": megatron on a GPU, master_adamw on the CPU."""
    use_distributed_optimizer: bool = True
    """With optimizer "megatron": shard fp32 master weights and Adam moments over the
    data-parallel ranks (gradients reduce-scattered, parameters all-gathered after each step)."""
    overlap_grad_reduce: bool = False
    """With optimizer "megatron": start each gradient bucket's reduction during the backward pass
    of a mini-batch's last micro-batch."""
    ddp_bucket_size: int | None = Field(None, ge=1)
    """With optimizer "megatron": parameters per gradient bucket (None: megatron's default)."""
    attention: Literal["auto", "sdpa", "local", "te"] = "auto"
    """Core attention: "sdpa" torch's fused kernels (flash / cuDNN / memory-efficient on GPU,
    exact math on CPU; packing through the variable-length flash kernel); "local" megatron's
    unfused DotProductAttention (no packing); "te" Transformer Engine's attention (must import);
    "auto": "te" where Transformer Engine imports, else "sdpa"."""
    pack_sequences: bool | None = None
    """Pack several sequences into one row with per-document causal attention instead of padding
    rows to the longest (needs attention "sdpa", no routing replay, no MoE at TP > 1).
    None (auto): on a GPU in bfloat16, each mini-batch is packed when padded micro-batches would
    spend at least `pack_min_padding` of their tokens on padding, else padded (on the H200
    packed rows ran 1.35-1.39x of padded ones at RL lengths 64-1,024, 0.85x at equal lengths);
    on the CPU padded. true: always packed (CUDA's variable-length flash kernel on a GPU in
    bfloat16, else a block-diagonal mask: the quadratic compute of the row's whole length)."""
    pack_min_padding: float = Field(0.1, ge=0.0, le=1.0)
    """With `pack_sequences` unset (auto): the share of padding in a mini-batch's padded
    micro-batches from which it is packed instead."""
    recompute: Literal["none", "selective", "full"] = "none"
    """Activation recomputation: "selective" recomputes core attention in the backward pass,
    "full" each transformer layer (keeps only layer inputs). GPU only (megatron's checkpointing
    saves the CUDA RNG state)."""
    logprob_chunk_tokens: int = Field(1024, ge=1)
    """Tokens per chunk of the output-layer log-prob / entropy computation: the logits held at
    once are `chunk x vocab / tensor_parallel` (fp32 with the torch kernel, the model's dtype
    with the Triton one). On the H200 4,096 ran 0.93x of 1,024 with the Triton kernel."""
    logprob_kernel: Literal["auto", "triton", "torch"] = "auto"
    """How each chunk's softmax statistics and gradient are computed: "triton" one fused kernel
    per direction that reads the chunk's logits once (GPU; `actors/learner/logprobs_triton.py`),
    "torch" the exact elementwise torch ops (fp32 on the CPU), "auto": "triton" on a GPU where
    Triton imports, else "torch"."""
    torch_compile: Literal["auto", "off"] = "auto"
    """The layers' pointwise ops as fused kernels, forward and backward: RMSNorm and RoPE
    torch.compile'd (`models/fused_ops.py`), and megatron's SwiGLU fusion (its function as
    `swiglu_kernel` says). "auto": on a GPU, after a check at start that they run and match
    eager torch (logged and eager if not); the CPU runs eager. "off": eager everywhere.
    Compiling takes some seconds at the first steps."""
    swiglu_kernel: Literal["auto", "triton", "megatron"] = "auto"
    """With the compiled layer ops, the MLP's SwiGLU forward and backward: "triton" two
    hand-written kernels that read and write each byte once (`models/swiglu_triton.py`),
    "megatron" megatron's own fusion, torch.compile'd by megatron (its backward kernel takes 5-7x
    its bytes' time). "auto": "triton" where the compiled ops are on (a GPU with Triton,
    `torch_compile` "auto") and the kernels pass their check at start, megatron's fusion where
    they fail it (logged). "triton" is refused at start where it cannot run (the CPU, no Triton,
    `torch_compile` "off", a failed check). Without the compiled ops the SwiGLU runs eagerly."""
    cuda_graphs: Literal["auto", "on", "off"] = "auto"
    """Training micro-batches' model forward and backward as CUDA graphs, one pair per
    micro-batch shape (rows padded to a multiple of 64 tokens; `actors/learner/graphs.py`): the
    host launches two graphs instead of thousands of kernels. A shape's first micro-batch runs
    eagerly, its second is captured. Needs a GPU, a dense model at tensor_parallel 1, optimizer
    "megatron" without overlap_grad_reduce, attention "sdpa" and recompute "none"; packed
    micro-batches run eagerly. "auto": on where all of that holds at data parallel 1 (the reason
    logged where not); "on": refused where it does not hold, taken at data parallel > 1 too;
    "off": eager."""
    cuda_graph_shapes: int = Field(16, ge=1)
    """With cuda_graphs: the most micro-batch shapes captured (they share one memory pool, the
    size of the largest); micro-batches of further shapes run eagerly, counted."""

    @model_validator(mode="after")
    def _hf_at_checkpoints(self) -> "LearnerConfig":
        # The HF export lives inside a checkpoint: it can only be written at a checkpoint step.
        if (
            self.save_hf_interval
            and self.save_interval
            and self.save_hf_interval % self.save_interval
        ):
            raise ValueError(
                f"learner.save_hf_interval = {self.save_hf_interval} is not a multiple of "
                f"learner.save_interval = {self.save_interval}: the HF export is written into a "
                "checkpoint, so only at checkpoint steps"
            )
        if self.save_hf_interval and not self.save_interval:
            raise ValueError(
                f"learner.save_hf_interval = {self.save_hf_interval} with learner.save_interval = "
                "0 (one checkpoint, at the end): set save_interval so that it divides "
                "save_hf_interval (the HF export is written into a checkpoint)"
            )
        return self
