"""The trainer loop: wait for batch n, take one policy-gradient step, publish weights/step_n.

    rl trainer @ configs/demo.toml [--resume]
    torchrun --nproc-per-node 2 -m trainer @ configs/demo.toml

Step n consumes batch n and turns version n-1 into version n (docs/architecture.md). One step:
trainer/data.py plans micro-batches (packing, rank balance, loss weights), trainer/loss.py turns
logits into the loss, trainer/optim.py steps, trainer/weights.py (or trainer/broadcast.py)
publishes, trainer/checkpoint.py saves every checkpoint_every steps.
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
from trainer import checkpoint
from trainer.data import MicroBatch, loss_weights, rank_micro_batches, receive_batch
from trainer.loss import policy_loss, token_logprobs_and_entropy
from trainer.optim import build_optimizer
from trainer.parallel import apply_fsdp, init_distributed
from trainer.weights import gather_full_state_dict, prune_weights, write_weights

log = logging.getLogger("trainer")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_SUMS = ("tokens", "masked_tokens", "clipped_tokens", "ratio_sum", "mismatch_kl_sum", "entropy_sum", "kl_sum")


def attention_implementation(choice: str, dtype: str) -> str:
    if choice != "auto":
        return choice
    from transformers.utils import is_flash_attn_2_available

    # flash attention computes in half precision only: with float32 compute, sdpa.
    if dtype == "bfloat16" and torch.cuda.is_available() and is_flash_attn_2_available():
        return "flash_attention_2"
    return "sdpa"


def load_model(cfg: RunConfig, device: torch.device, trainable: bool) -> torch.nn.Module:
    # Packed rows carry no attention mask: transformers derives the block-diagonal mask (sdpa)
    # or the varlen boundaries (flash attention) from the restarting position ids.
    model = AutoModelForCausalLM.from_pretrained(
        cfg.model, dtype=torch.float32, attn_implementation=attention_implementation(cfg.trainer.attention, cfg.trainer.dtype)).to(device)
    if trainable:
        model.train()
        if cfg.trainer.activation_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.eval()
        model.requires_grad_(False)
    apply_fsdp(model, _DTYPES[cfg.trainer.dtype])
    return model


def forward_logits(model: torch.nn.Module, mb: MicroBatch, device: torch.device, single_row: bool) -> torch.Tensor:
    """Logits [R, T, V] of a micro-batch. `single_row`: packed rows go through the model as one
    row, because transformers' flash-attention path finds packed samples (varlen) only in a batch
    of one row; with several it would let samples attend across boundaries. (sdpa handles rows
    itself, and one long row would make its [L, L] mask R^2 times bigger.)"""
    tokens = mb.tokens.to(device)
    positions = None if mb.position_ids is None else mb.position_ids.to(device)
    flat = single_row and positions is not None and tokens.shape[0] > 1
    logits = model(
        input_ids=tokens.reshape(1, -1) if flat else tokens,
        position_ids=positions.reshape(1, -1) if flat else positions,
        attention_mask=None if mb.attention_mask is None else mb.attention_mask.to(device),
        use_cache=False,  # with a KV cache object, transformers ignores packed position ids
    ).logits
    return logits.reshape(*tokens.shape, -1) if flat else logits


class Trainer:
    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        self.run = RunDir(cfg.output_dir)
        # Under ZMQ, ranks 1+ sit in a broadcast while rank 0 publishes and then waits for the
        # next batch: the collective timeout must outlast both (rank 0 reports its own timeouts).
        self.device = init_distributed(cfg.trainer.batch_timeout_s + cfg.weight_sync.timeout_s + 1800)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        torch.manual_seed(cfg.seed)
        if cfg.trainer.torch_threads:
            torch.set_num_threads(cfg.trainer.torch_threads)
        hf_config = AutoConfig.from_pretrained(cfg.model)
        self.tied = bool(getattr(hf_config.get_text_config(), "tie_word_embeddings", False))
        pad_id = getattr(hf_config.get_text_config(), "pad_token_id", None)
        self.pad_id = 0 if pad_id is None else pad_id
        self.model = load_model(cfg, self.device, trainable=True)
        self.flash = self.model.config._attn_implementation.startswith("flash")
        if self.rank == 0:
            log.info("attention: %s", self.model.config._attn_implementation)
        loss = cfg.trainer.loss
        self.reference = (load_model(cfg, self.device, trainable=False)
                          if loss.kl_coef > 0 and loss.kl_target == "reference" else None)
        self.optimizer, self.scheduler = build_optimizer(self.model, cfg.trainer.optim, cfg.max_steps)
        self.broadcaster = None
        if cfg.weight_sync.kind == "broadcast" and self.rank == 0:
            from trainer.broadcast import WeightBroadcaster

            self.broadcaster = WeightBroadcaster(cfg, self.run, self.tied)  # waits for the servers to join
        self.last_checkpoint = 0

    def start_step(self) -> int:
        """1, or the step after the latest complete checkpoint under --resume."""
        latest = checkpoint.latest(self.run)
        if not self.cfg.resume:
            if self.run.weight_steps():
                raise SystemExit(f"output_dir {self.run.root} already holds weights from an earlier run; "
                                 "pass --resume to continue it, or choose another output_dir")
            return 1
        if latest is None:
            if self.run.weight_steps():
                raise SystemExit(f"--resume: no complete trainer checkpoint under {self.run.checkpoints}, "
                                 "but weights exist; cannot continue that run exactly")
            log.info("--resume: nothing to resume in %s, starting at step 1", self.run.root)
            return 1
        checkpoint.load(self.run, latest, self.model, self.optimizer, self.scheduler)
        self.last_checkpoint = latest
        if self.rank == 0:
            log.info("resumed from checkpoints/step_%d: next batch is %d", latest, latest + 1)
        return latest + 1

    def train(self) -> None:
        first = self.start_step()
        # Under ZMQ only rank 0 binds the socket (receive_batch shares the bytes).
        receiver = BatchReceiver(self.cfg.transport, self.run, keep=bool(self.cfg.trainer.checkpoint_every)) if (
            self.cfg.transport.kind == "filesystem" or self.rank == 0) else None
        try:
            for step in range(first, self.cfg.max_steps + 1):
                self.train_one(receiver, step)
        finally:
            if receiver is not None:
                receiver.close()
            if self.broadcaster is not None:
                self.broadcaster.close()
        log.info("done: %d steps", self.cfg.max_steps)

    def micro_batches(self, batch) -> list[MicroBatch]:
        t = self.cfg.trainer
        weights = loss_weights(batch, t.loss.normalization, t.loss.norm_length or self.cfg.seq_len)
        per = max(1, t.micro_batch_tokens // self.cfg.seq_len) if t.pack else t.micro_batch_size
        return rank_micro_batches(batch, self.rank, self.world, row_len=self.cfg.seq_len if t.pack else None,
                                  per_micro_batch=per, pad_id=self.pad_id, weights=weights)

    def train_one(self, receiver: BatchReceiver | None, step: int) -> None:
        batch, waited = receive_batch(receiver, self.cfg.transport.kind, step, self.cfg.trainer.batch_timeout_s,
                                      self.device)
        start = time.perf_counter()
        lr = self.scheduler.get_last_lr()[0]
        stats = self.train_step(self.micro_batches(batch), batch.temperature)
        step_s = time.perf_counter() - start
        write_s = self.publish(step)
        ckpt_s = 0.0
        every = self.cfg.trainer.checkpoint_every
        if every and (step % every == 0 or step == self.cfg.max_steps):
            ckpt_s = checkpoint.save(self.run, step, self.model, self.optimizer, self.scheduler,
                                     self.cfg.trainer.keep_checkpoints)
            self.last_checkpoint = step
        if self.rank == 0:
            tokens = int(batch.lengths.sum())
            record = {
                "program": "trainer", "step": step, "wait_s": waited, "step_s": step_s, "write_s": write_s,
                "checkpoint_s": ckpt_s, "lr": lr, "tokens": tokens, "loss_tokens": int(batch.loss_mask.sum()),
                "trainer_tokens_per_s": tokens / step_s if step_s > 0 else 0.0,
                "max_staleness": int(step - 1 - batch.versions.min()), **stats,
            }
            self.run.append_metrics(record)
            log.info(
                "step %d loss %.4f grad_norm %.3f entropy %.3f clipped %.3f masked %.3f kl %.2e | "
                "waited %.2fs step %.2fs (%.0f tok/s) write %.2fs%s",
                step, stats["loss"], stats["grad_norm"], stats["entropy"], stats["clipped_frac"],
                stats["masked_frac"], stats["mismatch_kl"], waited, step_s, record["trainer_tokens_per_s"], write_s,
                f" checkpoint {ckpt_s:.2f}s" if ckpt_s else "",
            )
            self.prune_rollouts(step)

    def prune_rollouts(self, step: int) -> None:
        """Keep the last keep_rollouts batches, and every batch a resume from the latest
        checkpoint would need again."""
        keep_from = step - self.cfg.trainer.keep_rollouts
        if self.cfg.trainer.checkpoint_every:
            keep_from = min(keep_from, self.last_checkpoint)
        for old in self.run.rollout_steps():
            if old <= keep_from:
                remove_quietly(self.run.rollout_dir(old))

    def forward_logprobs(self, model: torch.nn.Module, mb: MicroBatch, temperature: float):
        logits = forward_logits(model, mb, self.device, single_row=self.flash)
        return token_logprobs_and_entropy(logits, mb.tokens.to(self.device), temperature)

    def train_step(self, micro_batches: list[MicroBatch], temperature: float) -> dict:
        # loss_weight already divides by the whole batch's normaliser (trainer/data.py), so the
        # summed loss does not depend on how samples fall into micro-batches and ranks. FSDP2
        # averages gradients over ranks; scaling by the world size turns that back into the sum.
        sums = torch.zeros(len(_SUMS) + 1, dtype=torch.float64)
        for mb in micro_batches:
            logprobs, entropy = self.forward_logprobs(self.model, mb, temperature)
            reference = None
            if self.reference is not None:
                with torch.no_grad():
                    reference, _ = self.forward_logprobs(self.reference, mb, temperature)
            d = {k: v.to(self.device) for k, v in (("inference_logprobs", mb.inference_logprobs),
                                                   ("advantages", mb.advantages), ("loss_mask", mb.loss_mask),
                                                   ("loss_weight", mb.loss_weight), ("sequence_ids", mb.sequence_ids))}
            out = policy_loss(logprobs, cfg=self.cfg.trainer.loss, entropy=entropy, reference_logprobs=reference, **d)
            (out.loss * self.world).backward()
            sums += torch.tensor([out.loss.item()] + [getattr(out, k) for k in _SUMS], dtype=torch.float64)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.trainer.optim.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        sums = sums.to(self.device)  # NCCL reduces only device tensors
        dist.all_reduce(sums)
        loss, tokens, masked, clipped, ratio, kl, entropy, ref_kl = sums.cpu().tolist()
        n = max(tokens, 1.0)
        return {"loss": loss, "clipped_frac": clipped / n, "masked_frac": masked / n, "ratio_mean": ratio / n,
                "mismatch_kl": kl / n, "entropy": entropy / n, "kl": ref_kl / n,
                "grad_norm": float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)}

    def publish(self, step: int) -> float:
        state_dict = gather_full_state_dict(self.model)  # collective: all ranks
        if self.rank != 0:
            return 0.0
        if self.broadcaster is not None:
            # weights/step_n then holds the bucket manifest + STABLE; the tensors go over the wire.
            return self.broadcaster.publish(step, state_dict)
        seconds = write_weights(self.run, step, state_dict, self.cfg.model, self.tied,
                                self.cfg.trainer.weights_shard_mb << 20)
        prune_weights(self.run, self.cfg.trainer.keep_weights)
        return seconds


def main(cfg: RunConfig) -> None:
    trainer = Trainer(cfg)
    try:
        trainer.train()
    finally:
        dist.destroy_process_group()
