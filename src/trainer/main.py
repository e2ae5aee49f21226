"""The trainer loop: wait for batch n, take one policy-gradient step, publish weights/step_n.

    rl trainer @ configs/demo.toml
    torchrun --nproc-per-node 2 -m trainer @ configs/demo.toml

Step n consumes batch n and turns version n-1 into version n (docs/architecture.md).
"""

from __future__ import annotations

import logging
import time

import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoModelForCausalLM

from rl.config import RunConfig
from rl.rundir import RunDir, remove_quietly
from rl.transport import BatchReceiver
from trainer.data import MicroBatch, rank_micro_batches, receive_batch
from trainer.loss import clipped_pg_loss, token_logprobs
from trainer.parallel import apply_fsdp, init_distributed
from trainer.weights import gather_full_state_dict, prune_weights, write_weights

log = logging.getLogger("trainer")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class Trainer:
    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        self.run = RunDir(cfg.output_dir)
        self.device = init_distributed(cfg.trainer.batch_timeout_s + 600)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        torch.manual_seed(cfg.seed)
        if cfg.trainer.torch_threads:
            torch.set_num_threads(cfg.trainer.torch_threads)
        hf_config = AutoConfig.from_pretrained(cfg.model)
        self.tied = bool(getattr(hf_config.get_text_config(), "tie_word_embeddings", False))
        self.pad_id = hf_config.pad_token_id if hf_config.pad_token_id is not None else 0
        self.model = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=torch.float32).to(self.device)
        self.model.train()
        apply_fsdp(self.model, _DTYPES[cfg.trainer.dtype])
        self.broadcaster = None
        if cfg.weight_sync.kind == "broadcast" and self.rank == 0:
            from trainer.broadcast import WeightBroadcaster

            self.broadcaster = WeightBroadcaster(cfg, self.run, self.tied)  # waits for the servers to join
        opt = cfg.trainer.optim
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=opt.lr, betas=opt.betas, weight_decay=opt.weight_decay
        )

    def check_fresh(self) -> None:
        """Resuming is not supported yet: refuse to mix a new run into an old run's weights."""
        if self.run.weight_steps():
            raise SystemExit(
                f"output_dir {self.run.root} already holds weights from an earlier run; "
                "remove it or choose another output_dir"
            )

    def train(self) -> None:
        self.check_fresh()
        # Under ZMQ only rank 0 binds the socket (receive_batch shares the bytes).
        receiver = BatchReceiver(self.cfg.transport, self.run) if (
            self.cfg.transport.kind == "filesystem" or self.rank == 0) else None
        try:
            for step in range(1, self.cfg.max_steps + 1):
                self.train_one(receiver, step)
        finally:
            if receiver is not None:
                receiver.close()
        log.info("done: %d steps", self.cfg.max_steps)

    def train_one(self, receiver: BatchReceiver | None, step: int) -> None:
        batch, waited = receive_batch(receiver, self.cfg.transport.kind, step, self.cfg.trainer.batch_timeout_s,
                                      self.device)
        start = time.perf_counter()
        stats = self.train_step(rank_micro_batches(
            batch, self.rank, self.world, self.cfg.trainer.micro_batch_size, self.pad_id
        ), batch.temperature)
        step_s = time.perf_counter() - start
        write_s = self.publish(step)
        if self.rank == 0:
            record = {
                "program": "trainer", "step": step, "wait_s": waited, "step_s": step_s,
                "write_s": write_s, "tokens": int(batch.loss_mask.sum()),
                "max_staleness": int(step - 1 - batch.versions.min()),
                **stats,
            }
            self.run.append_metrics(record)
            log.info(
                "step %d loss %.4f grad_norm %.3f clipped %.3f kl %.2e | waited %.2fs step %.2fs write %.2fs",
                step, stats["loss"], stats["grad_norm"], stats["clipped_frac"],
                stats["mismatch_kl"], waited, step_s, write_s,
            )
            for old in self.run.rollout_steps():
                if old <= step - self.cfg.trainer.keep_rollouts:
                    remove_quietly(self.run.rollout_dir(old))

    def train_step(self, micro_batches: list[MicroBatch], temperature: float) -> dict:
        # Normalise by the loss tokens of the whole batch (all ranks): every token weighs the same
        # however the samples fall into micro-batches and ranks. FSDP averages gradients over
        # ranks, so scale by the world size to get the global sum back.
        local_tokens = sum(mb.loss_mask.sum() for mb in micro_batches)
        total = torch.tensor([float(local_tokens)], device=self.device)
        dist.all_reduce(total)
        scale = self.world / total.clamp(min=1.0)
        sums = torch.zeros(4, device=self.device)  # loss, clipped tokens, ratio, kl
        loss_cfg = self.cfg.trainer.loss
        for mb in micro_batches:
            tokens = mb.tokens.to(self.device)
            logits = self.model(input_ids=tokens, attention_mask=mb.attention_mask.to(self.device)).logits
            logprobs = token_logprobs(logits, tokens, temperature)
            out = clipped_pg_loss(
                logprobs, mb.inference_logprobs.to(self.device), mb.advantages.to(self.device),
                mb.loss_mask.to(self.device), loss_cfg.clip_low, loss_cfg.clip_high,
            )
            (out.loss_sum * scale).backward()
            sums += torch.stack([out.loss_sum.detach(), out.clipped_tokens.float(), out.ratio_sum, out.mismatch_kl_sum])
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.trainer.optim.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        dist.all_reduce(sums)
        n = total.clamp(min=1.0)
        loss, clipped, ratio, kl = (sums / n).tolist()
        return {"loss": loss, "clipped_frac": clipped, "ratio_mean": ratio, "mismatch_kl": kl,
                "grad_norm": float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)}

    def publish(self, step: int) -> float:
        state_dict = gather_full_state_dict(self.model)  # collective: all ranks
        if self.rank != 0:
            return 0.0
        if self.broadcaster is not None:
            # weights/step_n then holds the bucket manifest + STABLE; the tensors go over the wire.
            return self.broadcaster.publish(step, state_dict)
        seconds = write_weights(self.run, step, state_dict, self.cfg.model, self.tied)
        prune_weights(self.run, self.cfg.trainer.keep_weights)
        return seconds


def main(cfg: RunConfig) -> None:
    trainer = Trainer(cfg)
    try:
        trainer.train()
    finally:
        dist.destroy_process_group()
