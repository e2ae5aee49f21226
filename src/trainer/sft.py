"""Supervised fine-tuning on the trainer's own machinery: `rl sft` (asyncrl/main.py) runs the data step
(orchestrator/sft/data.py), then this loop on every rank.

The same model loading, FSDP2 sharding, LoRA or full tuning (trainer/tuning.py), packing and rank
balance (trainer/data.py), optimizer and schedule, checkpoints and exact --resume, and
step-versioned HF weights (trainer/publish.py: weights/step_N, a `model` for `rl run`) as the RL
trainer; only the loss differs: the mean negative log-likelihood of the assistant's tokens
(trainer.loss.normalization decides the mean: per token by default), label-smoothed with
sft.label_smoothing (the held-out loss never is). Batch n's conversations are
a function of the data, the seed and n (rl/sft_data.py batch_rows): a resumed run replays the
same batches from its checkpoint on.
"""

from __future__ import annotations

import logging
import signal
import time

import numpy as np
import torch
import torch.distributed as dist

from rl.batch import Batch
from rl.config import RunConfig
from rl.faults import crash_point
from rl.heartbeat import set_phase
from rl.stop_signal import raise_on_sigterm
from rl.sft_data import SftData, batch_rows, sft_data_dir
from trainer.data import MicroBatch
from trainer.parallel import clip_grad_norm
from trainer.policy import Policy
from trainer.trainer import Trainer

log = logging.getLogger("trainer")


def as_batch(data: SftData, rows: list[int], step: int) -> Batch:
    """Conversations in the batch format the RL trainer takes (advantages and logprobs unused),
    sliced from the arrays as they are: no per-token Python lists on the step's path. Image
    chats carry their PNG bytes as an RL batch does: the micro-batches hand them to the
    model's vision path (trainer/vision.py) in the order of the packed rows' placeholders."""
    pieces = [data.row(i) for i in rows]
    tokens = np.concatenate([t for t, _ in pieces])
    n, k = len(tokens), len(rows)
    mask = np.concatenate([m for _, m in pieces])
    # The assistant's tokens count as sampled (version 0), the rest as given (-1): an image token is a
    # placeholder only where it was given (trainer/vision.py).
    return Batch(step=step, tokens=tokens.astype(np.int64), loss_mask=mask,
                 logprobs=np.zeros(n, np.float32), advantages=np.ones(n, np.float32),
                 token_versions=np.where(mask > 0, 0, -1).astype(np.int64), lengths=data.lengths[rows].astype(np.int64),
                 rewards=np.zeros(k, np.float32), versions=np.zeros(k, np.int64),
                 temperatures=np.ones(k, np.float32), top_p=np.ones(k, np.float32),
                 top_k=np.full(k, -1, np.int64), min_p=np.zeros(k, np.float32),
                 kept_counts=np.zeros(n, np.int32), kept_ids=np.zeros(0, np.int32), **batch_images(data, rows))


def batch_images(data: SftData, rows: list[int]) -> dict[str, np.ndarray]:
    """Batch.image_counts / image_sizes / image_bytes of these conversations; none without images."""
    images = [data.images(i) for i in rows]
    if not any(images):
        return {}
    flat = [im for ims in images for im in ims]
    return {"image_counts": np.asarray([len(ims) for ims in images], np.int64),
            "image_sizes": np.asarray([len(im) for im in flat], np.int64),
            "image_bytes": np.frombuffer(b"".join(flat), np.uint8).copy()}


class SftTrainer(Trainer):
    def __init__(self, cfg: RunConfig):
        super().__init__(cfg)
        folder = sft_data_dir(self.run)
        self.data = SftData.read(folder / "train.safetensors")
        eval_file = folder / "eval.safetensors"
        self.eval_data = SftData.read(eval_file) if eval_file.exists() else None
        # The held-out batches, one per eval dataset, built once: every evaluation reads the same rows.
        self.eval_batches = [] if self.eval_data is None else [
            (name, as_batch(self.eval_data, self.eval_data.rows_of(d).tolist(), 0))
            for d, name in enumerate(self.eval_data.names)]

    def train(self) -> None:
        policy = self.policy
        first = self.start_step(policy, self.cfg.resume)
        try:
            if first == 1 and self.eval_data is not None:
                self.log_eval(policy, 0)
            for step in range(first, self.cfg.max_steps + 1):
                with self.profiler.around(step):
                    self.sft_one(policy, step)
        finally:
            self.publisher.close()
        log.info("done: %d steps", self.cfg.max_steps)

    def sft_one(self, policy: Policy, step: int) -> None:
        cfg, s = self.cfg, self.cfg.sft
        set_phase(f"training step {step}")
        batch = as_batch(self.data, batch_rows(self.data, cfg.seed, s.batch_size, step), step)
        start = time.perf_counter()
        lr = policy.scheduler.get_last_lr()[0]
        stats = self.sft_step(self.micro_batches(batch, policy), policy)
        step_s = time.perf_counter() - start
        last = step == cfg.max_steps
        evaluated = last or bool(s.eval_every and step % s.eval_every == 0)
        write_s = 0.0
        # sft.eval_generate: the generation evaluation (rl eval --follow) takes the published weights.
        if last or (s.save_every and step % s.save_every == 0) or (s.eval_generate and evaluated):
            set_phase(f"publishing version {step}")
            write_s = self.publisher.publish(policy, step)
        tokens = int(batch.lengths.sum())
        record = {"program": "trainer", "step": step, "step_s": step_s, "write_s": write_s, "lr": lr,
                  "tokens": tokens, "loss_tokens": int(batch.loss_mask.sum()),
                  "epoch": step * s.batch_size / self.data.num_rows,
                  "trainer_tokens_per_s": tokens / step_s if step_s > 0 else 0.0, **stats}
        every = cfg.checkpoints.every
        ckpt_s = self.save_checkpoint(policy, step, record) if every and (step % every == 0 or last) else 0.0
        if self.rank == 0:
            record["checkpoint_s"] = ckpt_s
            self.append_record(policy, record)
            log.info("step %d loss %.4f grad_norm %.3f lr %.2e epoch %.2f | step %.2fs (%.0f tok/s)%s%s", step,
                     stats["loss"], stats["grad_norm"], lr, record["epoch"], step_s, record["trainer_tokens_per_s"],
                     f" write {write_s:.2f}s" if write_s else "", f" checkpoint {ckpt_s:.2f}s" if ckpt_s else "")
        if self.eval_data is not None and evaluated:
            self.log_eval(policy, step)
        crash_point("trainer.after_step", step)

    def nll(self, policy: Policy, mb: MicroBatch, smoothing: float = 0.0
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(weighted loss, summed NLL, trained tokens) of a micro-batch; with `smoothing`, the
        label-smoothed loss and its sum instead of the NLL."""
        with self.tuning.active(policy.slot):
            logprobs, _ = self.forward_logprobs(self.model, mb, smoothing=smoothing)
        mask = mb.loss_mask.to(self.device)
        loss = -(logprobs * mb.loss_weight.to(self.device)).sum()
        return loss, -(logprobs.detach() * mask).sum(), mask.sum()

    def sft_step(self, micro_batches: list[MicroBatch], policy: Policy) -> dict:
        # As in the RL step (trainer/trainer.py): loss_weight divides by the whole batch's
        # normaliser, so micro-batches and ranks add up; FSDP2 averages over ranks, hence * world.
        sums = torch.zeros(3, dtype=torch.float64)
        smoothing = self.cfg.sft.label_smoothing
        for mb in micro_batches:
            loss, nll, tokens = self.nll(policy, mb, smoothing)
            with self.tuning.active(policy.slot):
                (loss * self.world).backward()
            sums += torch.tensor([loss.item(), nll.item(), tokens.item()], dtype=torch.float64)
        grad_norm = clip_grad_norm(policy.params, self.cfg.trainer.optim.max_grad_norm)
        policy.optimizer.step()
        policy.optimizer.zero_grad(set_to_none=True)
        policy.scheduler.step()
        sums = sums.to(self.device) * float(self.layout.counts_once)  # whole rows: alike on a context group
        dist.all_reduce(sums)
        loss, nll, tokens = sums.cpu().tolist()
        # Smoothed, the per-token mean is the smoothed loss's, not an NLL: named for what it is.
        return {"loss": loss, ("smoothed_loss" if smoothing else "nll"): nll / max(tokens, 1.0),
                "grad_norm": float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)}

    @torch.no_grad()
    def eval_loss(self, policy: Policy) -> dict[str, float]:
        """Mean NLL per assistant token of each eval dataset (eval/<name>/loss, as RL's
        eval/<name>/<metric>) and over all of them (eval/loss)."""
        out, total = {}, np.zeros(2)
        for name, batch in self.eval_batches:
            sums = torch.zeros(2, dtype=torch.float64)
            for mb in self.micro_batches(batch, policy):
                _, nll, tokens = self.nll(policy, mb)
                sums += torch.tensor([nll.item(), tokens.item()], dtype=torch.float64)
            sums = sums.to(self.device) * float(self.layout.counts_once)
            dist.all_reduce(sums)
            nll, tokens = sums.cpu().tolist()
            out[f"eval/{name}/loss"] = nll / max(tokens, 1.0)
            total += (nll, tokens)
        out["eval/loss"] = total[0] / max(total[1], 1.0)
        return out

    def log_eval(self, policy: Policy, step: int) -> None:
        set_phase(f"held-out loss at step {step}")
        self.model.eval()
        try:
            losses = self.eval_loss(policy)
        finally:
            self.model.train()
        if self.rank == 0:
            policy.run.append_metrics({"program": "eval", "step": step, **losses})
            log.info("held-out loss at step %d: %s", step, ", ".join(f"{k} {v:.4f}" for k, v in losses.items()))


def main(cfg: RunConfig) -> None:
    raise_on_sigterm(lambda: SystemExit(128 + signal.SIGTERM))  # as the RL trainer (trainer/main.py)
    trainer = SftTrainer(cfg)
    try:
        trainer.train()
    finally:
        dist.destroy_process_group()
