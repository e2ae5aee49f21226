"""The trainer loop: wait for batch n, take one policy-gradient step, publish weights/step_n.

Step n consumes batch n and turns version n-1 into version n (docs/architecture.md). One step:
trainer/data.py plans micro-batches (packing, rank balance, loss weights), trainer/model.py runs
the forward pass, trainer/loss.py turns logits into the loss, trainer/optim.py steps,
trainer/publish.py publishes, trainer/checkpoint.py saves every checkpoint_every steps.
"""

from __future__ import annotations

import logging
import time

import torch
import torch.distributed as dist
from transformers import AutoConfig

from rl.batch import BatchError
from rl.config import RunConfig
from rl.config.trainer import BatchingConfig
from rl.faults import crash_point
from rl.heartbeat import PeerReporter, PeerWatch, heartbeat_path, set_phase
from trainer.preflight import trainer_state_refusal
from rl.rundir import RunDir, remove_quietly
from rl.transport.interface import BatchReceiver
from rl.transport.registry import batch_receiver
from trainer import checkpoint
from trainer.compute_dtype import cpu_flags, resolve_dtype, slow_bf16_warning
from trainer.context_parallel import ContextShare
from trainer.data import MicroBatch, loss_weights, rank_micro_batches, receive_batch, to_device
from trainer.loss import STATS, policy_loss
from trainer.metrics import TrainerMetrics
from trainer.model import load_model, micro_batch_logprobs
from trainer.optim import build_optimizer
from trainer.parallel import build_layout, clip_grad_norm, init_distributed
from trainer.policy import Policy
from trainer.profiling import StepProfiler
from trainer.publish import make_publisher
from trainer.routing_replay import routing_for
from trainer.sampling_mask import NO_TRUNCATION, NoTruncation, Truncation
from trainer.tunings import TUNINGS, tuning_kind

log = logging.getLogger("trainer")

# Per micro-batch counts from the Keep Sampling Mask (trainer/sampling_mask.py), summed with the
# loss's STATS.
_MASK_SUMS = ("truncated_tokens", "mask_misses", "mask_replayed")


def rows_per_micro_batch(t: BatchingConfig, seq_len: int, context: int) -> int:
    """Packed rows (of seq_len) or padded samples per micro-batch. micro_batch_tokens is what one
    rank holds, and a context group splits each row over its `context` ranks: it holds `context`
    times that."""
    return max(1, t.micro_batch_tokens * context // seq_len) if t.pack else t.micro_batch_size


def routing_record(mb: MicroBatch, share: ContextShare) -> tuple:
    """(routing, routed, trained) for the routers' hooks (RoutingReplay.recorded): under context
    parallelism the routers see this rank's share of each row, so the record is cut alike, and
    so is `trained` for a micro-batch without a record (a rank's padding micro-batch), whose
    shape is the one the hooks' stand-in record takes."""
    trained = torch.zeros(mb.tokens.shape, dtype=torch.bool)
    trained[:, :-1] = mb.loss_mask > 0  # position t predicts token t + 1
    routing, routed = mb.routing, mb.routed
    if share.size > 1:
        trained = share.local(trained, False)
        if routing is not None:
            routing, routed = share.local(routing, 0), share.local(routed, False)
    return routing, routed, trained


class Trainer:
    """One rank's trainer: the model (and reference), the publisher, and the step on a batch."""

    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        self.run = RunDir(cfg.output_dir)
        # Under ZMQ, ranks 1+ sit in a broadcast while rank 0 publishes and then waits for the
        # next batch: the collective timeout must outlast both (rank 0 reports its own timeouts).
        self.device = init_distributed(cfg.trainer.timeouts.batch_s + cfg.timeouts.broadcast_s + 1800)
        # The mesh (trainer/parallel.py): which share of the batch, and of each row, is this rank's.
        self.layout = build_layout(cfg.trainer.parallel, self.device)
        self.rank, self.world = self.layout.rank, self.layout.world
        self.metrics = TrainerMetrics(cfg, self.rank, self.device, self.world)  # served with trainer.metrics_port
        torch.manual_seed(cfg.seed)
        if cfg.trainer.torch_threads:
            torch.set_num_threads(cfg.trainer.torch_threads)
        hf_config = AutoConfig.from_pretrained(cfg.model)
        self.tied = bool(getattr(hf_config.get_text_config(), "tie_word_embeddings", False))
        self.vocab_size = hf_config.get_text_config().vocab_size
        pad_id = getattr(hf_config.get_text_config(), "pad_token_id", None)
        self.pad_id = 0 if pad_id is None else pad_id
        self.dtype = self.compute_dtype(cfg, hf_config)
        tuning = TUNINGS[tuning_kind(cfg)]
        self.model, self.lora = load_model(cfg, self.device, trainable=True, lora_slots=tuning.slots(cfg),
                                           dtype=self.dtype, layout=self.layout)
        self.tuning = tuning(self.model, self.lora)
        self.flash = self.model.config._attn_implementation.startswith("flash")
        if self.rank == 0:
            log.info("attention: %s, dtype: %s, %d rank(s): data %d x context %d x expert %d",
                     self.model.config._attn_implementation, self.dtype, self.world, *self.layout.sizes)
        loss = cfg.trainer.loss
        self.reference = (load_model(cfg, self.device, trainable=False, dtype=self.dtype, layout=self.layout)[0] if loss.kl_coef > 0
                          and loss.kl_target == "reference" and self.tuning.own_reference else None)
        self.publisher = make_publisher(cfg, self.run, self.rank, self.model, self.lora, self.tied)
        # MoE models only: replays the engine's routing (trainer.mismatch.routing_replay) and reports agreement.
        self.routing = routing_for(self.model, cfg.trainer.mismatch.routing_replay)
        self.profiler = StepProfiler(cfg.trainer.profile_steps, self.run.logs, self.run.root / "profile",
                                     self.rank, self.device)
        self.policy = None  # multi-run: one per run (trainer/runs.py)
        if not cfg.trainer.lora.multi_run:
            self.policy = self.new_policy(cfg, self.run, self.tuning.first_slot)

    def compute_dtype(self, cfg: RunConfig, hf_config) -> str:
        """trainer.model.dtype resolved for this device, once (trainer/compute_dtype.py), with its warning
        for bfloat16 asked of a CPU that only emulates it."""
        flags = cpu_flags() if self.device.type == "cpu" else set()
        if self.rank == 0 and (warning := slow_bf16_warning(cfg.trainer.model.dtype, self.device.type, flags)):
            log.warning(warning)
        return resolve_dtype(cfg.trainer.model.dtype, self.device.type, flags, hf_config.get_text_config().hidden_size,
                             cfg.trainer.model.attention)

    def new_policy(self, cfg: RunConfig, run: RunDir, slot: int | None) -> Policy:
        """A run's policy in `slot`, its weights fresh there (tuning.reset)."""
        self.tuning.reset(slot, cfg.seed)
        params = self.tuning.params(slot)
        return Policy(cfg, run, params, *build_optimizer(params, cfg.trainer.optim, cfg.max_steps), slot=slot)

    def start_step(self, policy: Policy, resume: bool) -> int:
        """1, or the step after the policy's latest complete checkpoint when resuming."""
        run = policy.run
        if refusal := trainer_state_refusal(run, resume):  # asyncrl.main refused a single run already
            raise SystemExit(refusal)
        latest = checkpoint.latest(run)
        if not resume:
            return 1
        if self.rank == 0:
            policy.recorded = run.recorded_steps("trainer")
        if latest is None:
            # Before the first checkpoint: step 0's state is the base model and fresh optimizer
            # state; the batches since step 1 are kept (prune_rollouts), so replaying them
            # republishes the same versions the killed trainer did.
            if self.rank == 0:
                log.info("--resume: no checkpoint yet in %s: replaying from step 1 on the base model", run.root)
            return 1
        state = self.tuning.checkpoint_state(policy)
        record = checkpoint.load(run, latest, state, policy.scheduler)
        if record is not None and self.rank == 0 and latest not in policy.recorded:
            # Killed between this checkpoint and its record: the record the checkpoint kept.
            self.append_record(policy, {**record, "recovered": True})
        self.tuning.restored(policy, state)
        policy.last_checkpoint = latest
        if self.rank == 0:
            log.info("resumed from checkpoints/step_%d: next batch is %d (%s)", latest, latest + 1, run.root)
        return latest + 1

    def train(self) -> None:
        policy = self.policy
        first = self.start_step(policy, self.cfg.resume)
        # Only rank 0 reads batches (receive_batch shares the bytes).
        receiver = self.receiver(policy)
        try:
            for step in range(first, self.cfg.max_steps + 1):
                with self.profiler.around(step):
                    self.train_one(policy, receiver, step)
        finally:
            if receiver is not None:
                receiver.close()
            self.publisher.close()
        log.info("done: %d steps", self.cfg.max_steps)

    def receiver(self, policy: Policy) -> BatchReceiver | None:
        cfg = policy.cfg
        if self.rank != 0:
            return None
        # While it waits for a batch, the trainer says so within seconds if the orchestrator
        # died or froze (and keeps waiting: a restarted orchestrator resumes where it left off).
        watch = PeerWatch(heartbeat_path(cfg, "orchestrator"), "orchestrator", cfg.timeouts.heartbeat_s)
        orchestrator = PeerReporter(watch, log, f"waiting for it to come back (trainer.timeouts.batch_s = "
                                    f"{cfg.trainer.timeouts.batch_s:.0f} s)")
        return batch_receiver(cfg.transport, policy.run, keep=bool(cfg.checkpoints.every),
                             on_wait=orchestrator.poll)

    def micro_batches(self, batch, policy: Policy) -> list[MicroBatch]:
        # Packing is the trainer's (its memory); the normalisation is the run's (its loss).
        t, loss = self.cfg.trainer.batching, policy.cfg.trainer.loss
        weights = loss_weights(batch, loss.normalization, loss.norm_length or policy.cfg.seq_len)
        per = rows_per_micro_batch(t, self.cfg.seq_len, self.layout.context.size)
        return rank_micro_batches(batch, self.layout.batch_rank, self.layout.batch_ranks,
                                  row_len=self.cfg.seq_len if t.pack else None,
                                  per_micro_batch=per, pad_id=self.pad_id, weights=weights)

    def train_one(self, policy: Policy, receiver: BatchReceiver | None, step: int) -> None:
        cfg = policy.cfg
        set_phase(f"waiting for batch {step}")
        batch, waited = receive_batch(receiver, step, self.cfg.trainer.timeouts.batch_s, self.device)
        if int(batch.tokens.max()) >= self.vocab_size:
            raise BatchError(f"batch {step}: token id {int(batch.tokens.max())} is outside the model's "
                             f"vocabulary ({self.vocab_size}): was it made for another model?")
        set_phase(f"training step {step}")
        start = time.perf_counter()
        lr = policy.scheduler.get_last_lr()[0]
        stats = self.train_step(self.micro_batches(batch, policy), policy)
        step_s = time.perf_counter() - start
        set_phase(f"publishing version {step}")
        write_s = self.publisher.publish(policy, step)
        tokens = int(batch.lengths.sum())
        record = {
            "program": "trainer", "step": step, "wait_s": waited, "step_s": step_s, "write_s": write_s,
            "lr": lr, "tokens": tokens, "loss_tokens": int(batch.loss_mask.sum()),
            "trainer_tokens_per_s": tokens / step_s if step_s > 0 else 0.0,
            "max_staleness": int(step - 1 - batch.versions.min()), **stats,
            **({"run": cfg.run_name} if cfg.run_name else {}),
        }
        self.metrics.step(record, self.model, self.dtype)
        ckpt_s = 0.0
        every = cfg.checkpoints.every
        if every and (step % every == 0 or step == cfg.max_steps):
            set_phase(f"checkpointing step {step}")
            # Kept without checkpoint_s (not known until saved): a recovered record lacks it.
            ckpt_s = self.save_checkpoint(policy, step, record)
            crash_point("trainer.checkpointed", step)
        if self.rank == 0:
            record["checkpoint_s"] = ckpt_s
            self.append_record(policy, record)
            log.info(
                "%sstep %d loss %.4f grad_norm %.3f entropy %.3f clipped %.3f masked %.3f mismatch_kl %.2e | "
                "waited %.2fs step %.2fs (%.0f tok/s) write %.2fs%s", f"[{cfg.run_name}] " if cfg.run_name else "",
                step, stats["loss"], stats["grad_norm"], stats["entropy"], stats["clipped_frac"],
                stats["masked_frac"], stats["mismatch_kl"], waited, step_s, record["trainer_tokens_per_s"], write_s,
                f" checkpoint {ckpt_s:.2f}s" if ckpt_s else "",
            )
            self.warn_mismatch(policy, step, record)
            self.routing.warn_unrecorded(step, record)
            self.prune_rollouts(policy, step)
        crash_point("trainer.after_step", step)

    def warn_mismatch(self, policy: Policy, step: int, stats: dict) -> None:
        """stats: the step's metrics record."""
        threshold = policy.cfg.trainer.mismatch.kl_warn
        if threshold and stats["mismatch_kl"] > threshold:
            # Truncated sampling scored over the full vocabulary is the usual silent cause.
            hint = ("" if policy.cfg.trainer.mismatch.sampling_mask or not stats["truncated_frac"] else
                    "; samples drawn with top_k/top_p/min_p are scored over the full vocabulary "
                    "(trainer.mismatch.sampling_mask = false)")
            log.warning("step %d: mismatch_kl %.2e above trainer.mismatch.kl_warn %.1e: the trainer and the "
                        "engine disagree about the sampled tokens (staleness %d, sampling_mask_miss_frac %.2e)%s",
                        step, stats["mismatch_kl"], threshold, stats["max_staleness"],
                        stats["sampling_mask_miss_frac"], hint)

    def append_record(self, policy: Policy, record: dict) -> None:
        """Rank 0: one record per step in metrics.jsonl, across restarts: a step replayed after a
        resume (trained again from an earlier checkpoint, to the same result) writes none."""
        if record["step"] not in policy.recorded:
            policy.run.append_metrics(record)
            policy.recorded.add(record["step"])

    def save_checkpoint(self, policy: Policy, step: int, record: dict | None = None) -> float:
        seconds = checkpoint.save(policy.run, step, self.tuning.checkpoint_state(policy), policy.scheduler,
                                  policy.cfg.checkpoints.keep, record if self.rank == 0 else None)
        policy.last_checkpoint = step
        return seconds

    def prune_rollouts(self, policy: Policy, step: int) -> None:
        """Keep the last keep_rollouts batches, and every batch a resume from the latest
        checkpoint would need again."""
        keep_from = step - policy.cfg.trainer.files.keep_rollouts
        if policy.cfg.checkpoints.every:
            keep_from = min(keep_from, policy.last_checkpoint)
        for old in policy.run.rollout_steps():
            if old <= keep_from:
                remove_quietly(policy.run.rollout_dir(old))

    def forward_logprobs(self, model: torch.nn.Module, mb: MicroBatch,
                         truncation: Truncation | NoTruncation = NO_TRUNCATION,
                         smoothing: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
        return micro_batch_logprobs(model, mb, self.device, single_row=self.flash, truncation=truncation,
                                    smoothing=smoothing, context=self.layout.context)

    @torch.no_grad()
    def reference_logprobs(self, mb: MicroBatch, sampling_mask: bool) -> torch.Tensor:
        # The same per-token temperatures (and sampling mask, its kept set rebuilt from the
        # reference's own logits) as the policy's: the KL compares the two at the
        # distributions the samples were drawn from.
        truncation = mb.truncation(self.vocab_size) if sampling_mask else NO_TRUNCATION
        return self.tuning.reference_logprobs(lambda model: self.forward_logprobs(model, mb, truncation),
                                              self.reference)[0]

    def routing_recorded(self, mb: MicroBatch):
        """Around a micro-batch's forward and backward: the engine's routing for the MoE layers'
        hooks (trainer/routing_replay.py; NoRouting for a dense model)."""
        return self.routing.recorded(*routing_record(mb, self.layout.context))

    def train_step(self, micro_batches: list[MicroBatch], policy: Policy) -> dict:
        # loss_weight already divides by the whole batch's normaliser (trainer/data.py), so the
        # summed loss does not depend on how samples fall into micro-batches and ranks. FSDP2
        # averages gradients over ranks; scaling by the world size turns that back into the sum.
        # The metrics add up on the device and are read once, after the last micro-batch: reading
        # them per micro-batch would make the host wait for each backward before queuing the next
        # forward, leaving the GPU idle meanwhile.
        loss_cfg = policy.cfg.trainer.loss
        use_reference = loss_cfg.kl_coef > 0 and loss_cfg.kl_target == "reference"
        sums = torch.zeros(1 + len(STATS), dtype=torch.float64, device=self.device)
        mask_sums = torch.zeros(len(_MASK_SUMS), dtype=torch.float64)

        for mb in micro_batches:
            reference = self.reference_logprobs(mb, policy.cfg.trainer.mismatch.sampling_mask) if use_reference else None
            # Found whatever the setting: truncated_frac is reported (and named in the warning)
            # also when the mask is off.
            truncation = mb.truncation(self.vocab_size)
            with self.routing_recorded(mb):
                with self.tuning.active(policy.slot):
                    logprobs, entropy = self.forward_logprobs(
                        self.model, mb, truncation if policy.cfg.trainer.mismatch.sampling_mask else NO_TRUNCATION)
                self.routing.end_forward()
                d = {k: to_device(v, self.device) for k, v in (
                    ("inference_logprobs", mb.inference_logprobs), ("advantages", mb.advantages),
                    ("loss_mask", mb.loss_mask), ("loss_weight", mb.loss_weight), ("sequence_ids", mb.sequence_ids))}
                out = policy_loss(logprobs, cfg=loss_cfg, entropy=entropy, reference_logprobs=reference, **d)
                # The adapter stays active through backward (and the replayed routing): activation
                # checkpointing re-runs the forward hooks there.
                with self.tuning.active(policy.slot):
                    (out.loss * self.world).backward()
            sums += torch.cat([out.loss.detach()[None], out.stats]).double()
            mask_sums += torch.tensor(truncation.sums(), dtype=torch.float64)
        grad_norm = clip_grad_norm(policy.params, policy.cfg.trainer.optim.max_grad_norm)
        policy.optimizer.step()
        policy.optimizer.zero_grad(set_to_none=True)
        policy.scheduler.step()
        routing = self.routing.take_sums()
        if not self.layout.counts_once:  # the loss and the mask's sums: whole rows, alike on a context group
            sums.zero_()
            mask_sums.zero_()
        ours = len(sums) + len(mask_sums)
        sums = torch.cat([sums, mask_sums.to(self.device), routing.to(self.device)])  # NCCL reduces only device tensors
        dist.all_reduce(sums)
        sums = sums.cpu().tolist()
        routing_sums = sums[ours:]
        loss, tokens, masked, clipped, ratio, kl, entropy, ref_kl, truncated, misses, replayed = sums[:ours]
        n = max(tokens, 1.0)
        return {**self.routing.metrics(routing_sums),
                "loss": loss, "clipped_frac": clipped / n, "masked_frac": masked / n, "ratio_mean": ratio / n,
                "mismatch_kl": kl / n, "entropy": entropy / n, "kl": ref_kl / n,
                "truncated_frac": truncated / n, "sampling_mask_miss_frac": misses / max(truncated, 1.0),
                "sampling_mask_replayed_frac": replayed / max(truncated, 1.0),
                "grad_norm": float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)}
