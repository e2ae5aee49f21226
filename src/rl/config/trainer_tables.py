"""The tables of `[trainer]` that say what is learnt and on which ranks: `[trainer.optim]`,
`[trainer.loss]`, `[trainer.lora]`, `[trainer.parallel]`."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rl.config.section import Section


class OptimConfig(Section):
    lr: float = Field(3e-4, gt=0)
    """AdamW learning rate."""

    betas: tuple[float, float] = (0.9, 0.99)
    """AdamW betas."""

    weight_decay: float = Field(0.0, ge=0)
    """AdamW decoupled weight decay."""

    max_grad_norm: float = Field(1.0, gt=0)
    """Gradients are clipped to this global L2 norm."""

    schedule: Literal["constant", "linear", "cosine"] = "constant"
    """Learning-rate decay after warm-up, from lr down to lr * min_lr_ratio at max_steps."""

    warmup_steps: int = Field(0, ge=0)
    """Steps of linear warm-up from 0 to lr."""

    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    """Final learning rate of the linear and cosine schedules, as a fraction of lr."""


class LossConfig(Section):
    objective: Literal["ppo_clip", "truncated_is"] = "ppo_clip"
    """ppo_clip: -min(r*A, clip(r, 1-clip_low, 1+clip_high)*A). truncated_is: REINFORCE weighted
    by the detached ratio capped at tis_cap, -min(r, tis_cap).detach() * A * logprob (CISPO-style:
    every token keeps a gradient, however far off-policy). r = pi_trainer / pi_inference."""

    ratio_level: Literal["token", "sequence"] = "token"
    """token: one ratio per token. sequence: the geometric mean of a sample's token ratios, shared
    by all its tokens (GSPO); masking then drops whole samples."""

    clip_low: float = Field(0.2, ge=0, lt=1)
    """PPO clip: the ratio is held above 1 - clip_low for negative advantages."""

    clip_high: float = Field(0.28, ge=0)
    """PPO clip: the ratio is held below 1 + clip_high for positive advantages (DAPO's
    clip-higher keeps exploration alive)."""

    tis_cap: float = Field(2.0, gt=0)
    """truncated_is: cap of the importance weight."""

    mask_low: float | None = Field(None, ge=0)
    """Tokens (or samples, with ratio_level sequence) whose ratio is below this get no gradient
    at all (unset: no lower mask). Guards against engine/trainer mismatch (e.g. 0.125)."""

    mask_high: float | None = Field(None, gt=0)
    """Tokens (or samples) whose ratio is above this get no gradient (unset: none; e.g. 8)."""

    kl_coef: float = Field(0.0, ge=0)
    """Weight of a KL penalty (k3 estimator, per token) towards kl_target; 0 turns it off."""

    kl_target: Literal["reference", "inference"] = "reference"
    """reference: the starting model, kept frozen in the trainer (one more forward pass per
    micro-batch, and its memory). inference: the logprobs the engine sampled with."""

    normalization: Literal["token", "sequence", "constant"] = "token"
    """How per-token losses sum to the batch loss. token: divide by the batch's loss tokens (every
    token weighs the same). sequence: mean over each sample's tokens, then over samples (GRPO).
    constant: divide by samples * norm_length (Dr. GRPO: no length bias)."""

    norm_length: int = Field(0, ge=0)
    """normalization = constant: the constant per sample; 0 means seq_len."""


_ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class LoRAConfig(Section):
    rank: int = Field(0, ge=0, le=512)
    """LoRA rank; 0 trains every weight (full fine-tuning). With a rank, only the adapters train,
    weights/step_n holds a peft adapter, and servers load it with /load_lora_adapter: the base
    weights never move."""

    alpha: float = Field(16.0, gt=0)
    """LoRA alpha: the adapter's output is scaled by alpha / rank."""

    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapter's input (training only)."""

    target_modules: list[str] = Field(default_factory=lambda: list(_ALL_LINEAR), min_length=1)
    """Names of the linear layers that get an adapter (the last part of the module path)."""

    multi_run: bool = False
    """Trainer: train every run found under output_dir/runs/<name>/ at once, each from its own
    config (written there by its orchestrator), with its own adapter, optimizer and step counter.
    Runs join and leave while the trainer keeps going. See docs/lora.md."""

    slots: int = Field(4, ge=1)
    """multi_run: adapter slots, i.e. the most runs trained at once; a run that arrives while
    all are taken waits for one to free up."""

    idle_exit_s: float = Field(0, ge=0)
    """multi_run: exit once no run has been training for this long (after at least one run came
    and went); 0 serves until stopped."""


class ParallelConfig(Section):
    """How the trainer's ranks are laid out: data x context x expert = the world size, checked at
    start-up (docs/trainer.md, "Parallelism")."""

    data: int = Field(0, ge=0)
    """FSDP2 data-parallel ranks; 0: the world size divided by context x expert."""

    context: int = Field(1, ge=1)
    """Ranks that one packed row is split across (context parallelism): samples longer than one
    rank's memory holds."""

    expert: int = Field(1, ge=1)
    """Ranks that a mixture-of-experts model's experts are split across (expert parallelism)."""
