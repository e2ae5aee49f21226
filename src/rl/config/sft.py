"""The [sft] table: supervised fine-tuning (`rl sft`) on the assistant turns of chat rows.

    [[sft.datasets]]
    path = "data/chats.jsonl"          # rows with "messages", or prompt/completion pairs
    [[sft.eval_datasets]]
    path = "data/heldout.jsonl"

The rows come from the same dataset forms as RL's (rl/config/datasets.py: jsonl, parquet, HF
datasets directories, reasoning-gym tasks, functions), are rendered by the model's chat template
(orchestrator.prompts.chat_template, orchestrator.prompts.chat_template_kwargs and orchestrator.prompts.system_prompt,
as the RL run that follows will render them) and trained on the assistant's tokens only. The
trainer's own keys apply as in RL: [trainer.optim], [trainer.lora], packing, checkpoints, dtype.
"""

from __future__ import annotations

from pydantic import Field, model_validator

from rl.config.section import Section
from rl.config.datasets import DatasetConfig


class SftConfig(Section):
    datasets: list[DatasetConfig] = []
    """Training rows, mixed by weight. Each row has `messages` (messages_key: OpenAI chat form,
    tool calls and tool messages included) or a prompt (prompt_key) and a completion
    (completion_key): one user turn and the assistant's answer. Function datasets: their first
    `size` rows."""
    eval_datasets: list[DatasetConfig] = []
    """Held-out rows: their loss (mean negative log-likelihood per assistant token) is logged as
    eval/loss (and eval/<name>/loss) before the first step, every eval_every steps and after the
    last. Empty: none."""
    batch_size: int = Field(32, ge=1)
    """Conversations per optimizer step (all ranks together)."""
    eval_every: int = Field(0, ge=0)
    """Held-out loss every this many steps too; 0: at the first step and after the last only."""
    eval_rows: int = Field(500, ge=1)
    """Conversations per eval dataset used for the held-out loss (its first rows)."""
    label_smoothing: float = Field(0.0, ge=0, lt=1)
    """Label smoothing of the training loss, as torch's cross_entropy(label_smoothing=): keeps the
    model's sampling distribution broad, which leaves RL something to choose from. The step's
    record then has smoothed_loss instead of nll; the held-out loss is never smoothed."""

    eval_generate: bool = False
    """Also evaluate by generation, the number that says when to stop SFT and start RL: at step 0,
    every eval_every steps and after the last, the weights published at those steps go to a server
    of rl sft's own (`rl eval --follow`, a child process; its log logs/eval.log) that runs
    [orchestrator.eval] (the datasets, sampling and scoring `rl run` and `rl eval` use) and
    appends eval/<dataset>/accuracy, reward and pass@k to metrics.jsonl. Training does not wait
    for it, except for the last step's. Needs [[orchestrator.eval.datasets]]."""

    save_every: int = Field(0, ge=0)
    """Publish weights/step_N (HF format, a model `rl run` starts from) every this many steps too;
    0: only after the last step."""

    @model_validator(mode="after")
    def _named_once(self) -> SftConfig:
        for key, sets in (("sft.datasets", self.datasets), ("sft.eval_datasets", self.eval_datasets)):
            names = [d.label for d in sets]
            if len(set(names)) != len(names):
                raise ValueError(f"{key}: two datasets are named alike ({names}): give each a name")
        return self
