"""The trainer's model: loaded from the starting checkpoint and FSDP2-sharded, and the forward
pass of one micro-batch (packed or padded) to per-token logprobs: through the model's
LogprobHead (trainer/logprob_head.py: chunked, loss tokens only) where it has one, else from
full logits."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from rl.config import RunConfig
from trainer.data import MicroBatch
from trainer.logprob_head import LogprobHead, TokenQuery, install
from trainer.lora import LoRA
from trainer.loss import token_logprobs_and_entropy
from trainer.parallel import apply_fsdp
from trainer.sampling_mask import Truncation

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


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
    slots (trainer/lora.py), created before sharding so FSDP2 manages them too. A frozen model
    (the KL reference) is stored in the compute dtype: it has no optimizer to need float32
    masters, and the mixed-precision policy would cast it to that dtype in every forward anyway,
    so bfloat16 halves its memory and changes none of its logits."""
    # Packed rows carry no attention mask: transformers derives the block-diagonal mask (sdpa)
    # or the varlen boundaries (flash attention) from the restarting position ids.
    dtype = torch.float32 if trainable else _DTYPES[cfg.trainer.dtype]
    model = AutoModelForCausalLM.from_pretrained(
        cfg.model, dtype=dtype, attn_implementation=attention_implementation(cfg.trainer.attention, cfg.trainer.dtype)).to(device)
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
    install(model, cfg.trainer.logits_chunk_tokens)
    apply_fsdp(model, _DTYPES[cfg.trainer.dtype], offload=not trainable and cfg.trainer.reference_offload)
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


def micro_batch_logprobs(model: torch.nn.Module, mb: MicroBatch, device: torch.device, single_row: bool,
                         truncation: Truncation | None = None, smoothing: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprobs, entropy) [R, T-1] of a micro-batch's tokens, each under its own sample's
    temperature (mb.temperature): the distribution the engine sampled it from, which a batch
    mixing datasets with different sampling settings makes differ from sample to sample. With
    `truncation` (mb.truncation(vocab)), over the kept set (the sampler's recorded one, else rebuilt
    from top_k/top_p/min_p); with
    `smoothing`, label-smoothed (trainer/loss.py token_logprobs_and_entropy)."""
    head = model.get_output_embeddings()
    if not isinstance(head, LogprobHead):
        logits = forward_logits(model, mb, device, single_row)
        return token_logprobs_and_entropy(logits, mb.tokens.to(device), mb.temperature.to(device), truncation,
                                          smoothing)
    with head.asked(micro_batch_query(mb, device, truncation, smoothing)):
        out = forward_logits(model, mb, device, single_row)  # [R, T, 2]: (logprob, entropy)
    if truncation is not None:
        truncation.misses, truncation.replayed = head.misses, head.replayed
    return out[:, :-1, 0], out[:, :-1, 1]


def micro_batch_query(mb: MicroBatch, device: torch.device, truncation: Truncation | None,
                      smoothing: float = 0.0) -> TokenQuery:
    """The head's query for a micro-batch: at [r, t] the token t+1 of row r, wanted where the
    loss uses it. Per-predicted-token fields ([R, T-1]) get a last column that is never wanted."""
    def widen(x: torch.Tensor, fill) -> torch.Tensor:
        return torch.cat([x, torch.full_like(x[:, :1], fill)], 1).to(device)

    tokens = mb.tokens.to(device)
    trunc = None if truncation is None else Truncation(
        widen(truncation.top_k, -1), widen(truncation.top_p, 1.0), widen(truncation.min_p, 0.0),
        widen(truncation.select, False), None if truncation.kept is None else widen(truncation.kept, -1))
    return TokenQuery(targets=widen(tokens[:, 1:], 0), wanted=widen(mb.loss_mask > 0, False),
                      temperature=widen(mb.temperature.float(), 1.0), truncation=trunc, smoothing=smoothing)
