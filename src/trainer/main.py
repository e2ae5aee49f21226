"""The trainer loop: wait for batch n, take one policy-gradient step, publish weights/step_n.

    rl trainer @ configs/demo.toml [--resume]
    torchrun --nproc-per-node 2 -m trainer @ configs/demo.toml

Step n consumes batch n and turns version n-1 into version n (docs/architecture.md). One step:
trainer/data.py plans micro-batches (packing, rank balance, loss weights), trainer/loss.py turns
logits into the loss, trainer/optim.py steps, trainer/weights.py (or trainer/broadcast.py)
publishes, trainer/checkpoint.py saves every checkpoint_every steps.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from transformers import AutoConfig, AutoModelForCausalLM

from rl.batch import BatchError
from rl.config import RunConfig
from rl.faults import crash_point
from rl.heartbeat import PeerReporter, PeerWatch, heartbeat_path, set_phase
from rl.preflight import trainer_state_refusal
from rl.rundir import RunDir, remove_quietly
from rl.transport import BatchReceiver
from trainer import checkpoint
from trainer.data import MicroBatch, loss_weights, rank_micro_batches, receive_batch
from trainer.lora import LoRA
from trainer.loss import policy_loss, token_logprobs_and_entropy
from trainer.optim import build_optimizer
from trainer.parallel import apply_fsdp, init_distributed
from trainer.weights import gather_full_state_dict, prune_weights, write_adapter, write_weights

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


def load_model(cfg: RunConfig, device: torch.device, trainable: bool, lora_slots: int = 0
               ) -> tuple[torch.nn.Module, LoRA | None]:
    """The starting model, FSDP2-sharded; with lora_slots, frozen and carrying that many adapter
    slots (trainer/lora.py), created before sharding so FSDP2 manages them too."""
    # Packed rows carry no attention mask: transformers derives the block-diagonal mask (sdpa)
    # or the varlen boundaries (flash attention) from the restarting position ids.
    model = AutoModelForCausalLM.from_pretrained(
        cfg.model, dtype=torch.float32, attn_implementation=attention_implementation(cfg.trainer.attention, cfg.trainer.dtype)).to(device)
    lora = None
    if trainable:
        model.train()
        if cfg.trainer.activation_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if lora_slots:
            lora = LoRA(model, cfg.trainer.lora, lora_slots)
            model.to(device)
    else:
        model.eval()
        model.requires_grad_(False)
    apply_fsdp(model, _DTYPES[cfg.trainer.dtype])
    return model, lora


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


def micro_batch_logprobs(model: torch.nn.Module, mb: MicroBatch, device: torch.device, single_row: bool
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprobs, entropy) [R, T-1] of a micro-batch's tokens, each under its own sample's
    temperature (mb.temperature): the distribution the engine sampled it from, which a batch
    mixing datasets with different sampling settings makes differ from sample to sample."""
    logits = forward_logits(model, mb, device, single_row)
    return token_logprobs_and_entropy(logits, mb.tokens.to(device), mb.temperature.to(device))


@dataclass
class Policy:
    """What one optimizer step updates and by which rules: the whole model (full fine-tuning),
    or one run's adapter in one LoRA slot (trainer/runs.py)."""

    cfg: RunConfig
    """The run's config: its loss, optimizer, max_steps, checkpointing."""
    run: RunDir
    params: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    slot: int | None = None
    last_checkpoint: int = 0


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
        self.vocab_size = hf_config.get_text_config().vocab_size
        pad_id = getattr(hf_config.get_text_config(), "pad_token_id", None)
        self.pad_id = 0 if pad_id is None else pad_id
        lora = cfg.trainer.lora
        slots = (lora.slots if lora.multi_run else 1) if lora.rank else 0
        self.model, self.lora = load_model(cfg, self.device, trainable=True, lora_slots=slots)
        self.flash = self.model.config._attn_implementation.startswith("flash")
        if self.rank == 0:
            log.info("attention: %s", self.model.config._attn_implementation)
        loss = cfg.trainer.loss
        # With LoRA the reference is the base model itself: the forward pass without an adapter.
        self.reference = (load_model(cfg, self.device, trainable=False)[0] if
                          loss.kl_coef > 0 and loss.kl_target == "reference" and self.lora is None else None)
        self.broadcaster = None
        if cfg.weight_sync.kind == "broadcast" and self.rank == 0:
            from trainer.broadcast import WeightBroadcaster

            self.broadcaster = WeightBroadcaster(cfg, self.run, self.tied)  # waits for the servers to join
        self.policy = None  # multi-run: one per run (trainer/runs.py)
        if self.lora is None:
            self.policy = self.new_policy(cfg, self.run, None)
        elif not lora.multi_run:
            self.lora.reset(0, cfg.seed)
            self.policy = self.new_policy(cfg, self.run, 0)

    def new_policy(self, cfg: RunConfig, run: RunDir, slot: int | None) -> Policy:
        params = list(self.model.parameters()) if slot is None else list(self.lora.params(slot).values())
        return Policy(cfg, run, params, *build_optimizer(params, cfg.trainer.optim, cfg.max_steps), slot=slot)

    def start_step(self, policy: Policy, resume: bool) -> int:
        """1, or the step after the policy's latest complete checkpoint when resuming."""
        run = policy.run
        if refusal := trainer_state_refusal(run, resume):  # rl.cli refused a single run already
            raise SystemExit(refusal)
        latest = checkpoint.latest(run)
        if not resume:
            return 1
        if latest is None:
            log.info("--resume: nothing to resume in %s, starting at step 1", run.root)
            return 1
        state = self.checkpoint_state(policy)
        checkpoint.load(run, latest, state, policy.scheduler)
        if policy.slot is None:
            set_state_dict(self.model, policy.optimizer, model_state_dict=state["model"],
                           optim_state_dict=state["optim"])
        policy.last_checkpoint = latest
        if self.rank == 0:
            log.info("resumed from checkpoints/step_%d: next batch is %d (%s)", latest, latest + 1, run.root)
        return latest + 1

    def checkpoint_state(self, policy: Policy) -> dict:
        """What a checkpoint holds, as tensors of this rank's sharding: the whole model and its
        optimizer, or the run's adapter and its optimizer state under slot-independent names."""
        if policy.slot is None:
            # get_state_dict materialises the optimizer's (empty) state first, so DCP has
            # tensors of the right sharding to load into.
            model_sd, optim_sd = get_state_dict(self.model, policy.optimizer)
            return {"model": model_sd, "optim": optim_sd}
        adapter = self.lora.params(policy.slot)
        optim = {}
        for name, param in adapter.items():
            state = policy.optimizer.state[param]
            if not state:  # AdamW's own initial state, so a load has tensors to fill
                state.update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(param),
                             exp_avg_sq=torch.zeros_like(param))
            optim.update({f"{name}.{k}": v for k, v in state.items()})
        return {"adapter": adapter, "optim": optim}

    def train(self) -> None:
        policy = self.policy
        first = self.start_step(policy, self.cfg.resume)
        # Only rank 0 reads batches (receive_batch shares the bytes).
        receiver = self.receiver(policy)
        try:
            for step in range(first, self.cfg.max_steps + 1):
                self.train_one(policy, receiver, step)
        finally:
            if receiver is not None:
                receiver.close()
            if self.broadcaster is not None:
                self.broadcaster.close()
        log.info("done: %d steps", self.cfg.max_steps)

    def receiver(self, policy: Policy) -> BatchReceiver | None:
        cfg = policy.cfg
        if self.rank != 0:
            return None
        # While it waits for a batch, the trainer says so within seconds if the orchestrator
        # died or froze (and keeps waiting: a restarted orchestrator resumes where it left off).
        watch = PeerWatch(heartbeat_path(cfg, "orchestrator"), "orchestrator", cfg.heartbeat_timeout_s)
        orchestrator = PeerReporter(watch, log, f"waiting for it to come back (trainer.batch_timeout_s = "
                                    f"{cfg.trainer.batch_timeout_s:.0f} s)")
        return BatchReceiver(cfg.transport, policy.run, keep=bool(cfg.trainer.checkpoint_every),
                             on_wait=orchestrator.poll)

    def micro_batches(self, batch, policy: Policy) -> list[MicroBatch]:
        # Packing is the trainer's (its memory); the normalisation is the run's (its loss).
        t, loss = self.cfg.trainer, policy.cfg.trainer.loss
        weights = loss_weights(batch, loss.normalization, loss.norm_length or policy.cfg.seq_len)
        per = max(1, t.micro_batch_tokens // self.cfg.seq_len) if t.pack else t.micro_batch_size
        return rank_micro_batches(batch, self.rank, self.world, row_len=self.cfg.seq_len if t.pack else None,
                                  per_micro_batch=per, pad_id=self.pad_id, weights=weights)

    def train_one(self, policy: Policy, receiver: BatchReceiver | None, step: int) -> None:
        cfg = policy.cfg
        set_phase(f"waiting for batch {step}")
        batch, waited = receive_batch(receiver, step, self.cfg.trainer.batch_timeout_s, self.device)
        if int(batch.tokens.max()) >= self.vocab_size:
            raise BatchError(f"batch {step}: token id {int(batch.tokens.max())} is outside the model's "
                             f"vocabulary ({self.vocab_size}): was it made for another model?")
        set_phase(f"training step {step}")
        start = time.perf_counter()
        lr = policy.scheduler.get_last_lr()[0]
        stats = self.train_step(self.micro_batches(batch, policy), policy)
        step_s = time.perf_counter() - start
        set_phase(f"publishing version {step}")
        write_s = self.publish(policy, step)
        ckpt_s = 0.0
        every = cfg.trainer.checkpoint_every
        if every and (step % every == 0 or step == cfg.max_steps):
            set_phase(f"checkpointing step {step}")
            ckpt_s = self.save_checkpoint(policy, step)
        if self.rank == 0:
            tokens = int(batch.lengths.sum())
            record = {
                "program": "trainer", "step": step, "wait_s": waited, "step_s": step_s, "write_s": write_s,
                "checkpoint_s": ckpt_s, "lr": lr, "tokens": tokens, "loss_tokens": int(batch.loss_mask.sum()),
                "trainer_tokens_per_s": tokens / step_s if step_s > 0 else 0.0,
                "max_staleness": int(step - 1 - batch.versions.min()), **stats,
            }
            if cfg.run_name:
                record["run"] = cfg.run_name
            policy.run.append_metrics(record)
            log.info(
                "%sstep %d loss %.4f grad_norm %.3f entropy %.3f clipped %.3f masked %.3f kl %.2e | "
                "waited %.2fs step %.2fs (%.0f tok/s) write %.2fs%s", f"[{cfg.run_name}] " if cfg.run_name else "",
                step, stats["loss"], stats["grad_norm"], stats["entropy"], stats["clipped_frac"],
                stats["masked_frac"], stats["mismatch_kl"], waited, step_s, record["trainer_tokens_per_s"], write_s,
                f" checkpoint {ckpt_s:.2f}s" if ckpt_s else "",
            )
            self.prune_rollouts(policy, step)
        crash_point("trainer.after_step", step)

    def save_checkpoint(self, policy: Policy, step: int) -> float:
        seconds = checkpoint.save(policy.run, step, self.checkpoint_state(policy), policy.scheduler,
                                  policy.cfg.trainer.keep_checkpoints)
        policy.last_checkpoint = step
        return seconds

    def prune_rollouts(self, policy: Policy, step: int) -> None:
        """Keep the last keep_rollouts batches, and every batch a resume from the latest
        checkpoint would need again."""
        t = policy.cfg.trainer
        keep_from = step - t.keep_rollouts
        if t.checkpoint_every:
            keep_from = min(keep_from, policy.last_checkpoint)
        for old in policy.run.rollout_steps():
            if old <= keep_from:
                remove_quietly(policy.run.rollout_dir(old))

    def forward_logprobs(self, model: torch.nn.Module, mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
        return micro_batch_logprobs(model, mb, self.device, single_row=self.flash)

    @torch.no_grad()
    def reference_logprobs(self, mb: MicroBatch) -> torch.Tensor:
        # The same per-token temperatures as the policy's: the KL compares the two at the
        # distributions the samples were drawn from.
        if self.lora is not None:
            with self.lora.use(None):
                return self.forward_logprobs(self.model, mb)[0]
        return self.forward_logprobs(self.reference, mb)[0]

    def train_step(self, micro_batches: list[MicroBatch], policy: Policy) -> dict:
        # loss_weight already divides by the whole batch's normaliser (trainer/data.py), so the
        # summed loss does not depend on how samples fall into micro-batches and ranks. FSDP2
        # averages gradients over ranks; scaling by the world size turns that back into the sum.
        loss_cfg = policy.cfg.trainer.loss
        use_reference = loss_cfg.kl_coef > 0 and loss_cfg.kl_target == "reference"
        sums = torch.zeros(len(_SUMS) + 1, dtype=torch.float64)

        def slot():
            return self.lora.use(policy.slot) if self.lora is not None else contextlib.nullcontext()

        for mb in micro_batches:
            reference = self.reference_logprobs(mb) if use_reference else None
            with slot():
                logprobs, entropy = self.forward_logprobs(self.model, mb)
            d = {k: v.to(self.device) for k, v in (("inference_logprobs", mb.inference_logprobs),
                                                   ("advantages", mb.advantages), ("loss_mask", mb.loss_mask),
                                                   ("loss_weight", mb.loss_weight), ("sequence_ids", mb.sequence_ids))}
            out = policy_loss(logprobs, cfg=loss_cfg, entropy=entropy, reference_logprobs=reference, **d)
            # The adapter stays active through backward: activation checkpointing re-runs the
            # forward hooks there.
            with slot():
                (out.loss * self.world).backward()
            sums += torch.tensor([out.loss.item()] + [getattr(out, k) for k in _SUMS], dtype=torch.float64)
        grad_norm = torch.nn.utils.clip_grad_norm_(policy.params, policy.cfg.trainer.optim.max_grad_norm)
        policy.optimizer.step()
        policy.optimizer.zero_grad(set_to_none=True)
        policy.scheduler.step()
        sums = sums.to(self.device)  # NCCL reduces only device tensors
        dist.all_reduce(sums)
        loss, tokens, masked, clipped, ratio, kl, entropy, ref_kl = sums.cpu().tolist()
        n = max(tokens, 1.0)
        return {"loss": loss, "clipped_frac": clipped / n, "masked_frac": masked / n, "ratio_mean": ratio / n,
                "mismatch_kl": kl / n, "entropy": entropy / n, "kl": ref_kl / n,
                "grad_norm": float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)}

    def publish(self, policy: Policy, step: int) -> float:
        cfg = policy.cfg
        if policy.slot is not None:
            tensors = self.lora.gather(policy.slot)  # collective: all ranks
            if self.rank != 0:
                return 0.0
            seconds = write_adapter(policy.run, step, tensors, self.lora.peft_config(str(self.cfg.model)))
            prune_weights(policy.run, cfg.trainer.keep_weights)
            return seconds
        state_dict = gather_full_state_dict(self.model)  # collective: all ranks
        if self.rank != 0:
            return 0.0
        if self.broadcaster is not None:
            # weights/step_n then holds the bucket manifest + STABLE; the tensors go over the wire.
            return self.broadcaster.publish(step, state_dict)
        seconds = write_weights(policy.run, step, state_dict, self.cfg.model, self.tied,
                                cfg.trainer.weights_shard_mb << 20)
        prune_weights(policy.run, cfg.trainer.keep_weights)
        return seconds


def main(cfg: RunConfig) -> None:
    def on_sigterm(*_):
        # Unwind like an error: receivers close, the process group is destroyed, and the
        # heartbeat file goes, so peers read "stopped" rather than wait out a silence.
        raise SystemExit(128 + signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_sigterm)
    trainer = Trainer(cfg)
    try:
        if cfg.trainer.lora.multi_run:
            from trainer.runs import MultiRun

            MultiRun(trainer).serve()
        else:
            trainer.train()
    finally:
        dist.destroy_process_group()
