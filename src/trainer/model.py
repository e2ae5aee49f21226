"""The trainer's model: loaded from the starting checkpoint and FSDP2-sharded, and the forward
pass of one micro-batch (packed or padded) to per-token logprobs: through the model's
LogprobHead (trainer/logprob_head.py: chunked, loss tokens only) where it has one, else from
full logits."""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

from rl.config import RunConfig
from trainer import context_parallel, packed_attention
from trainer.context_parallel import ContextShare
from trainer.compiled_layers import compile_layers, compile_wanted
from trainer.data import MicroBatch, to_device
from trainer.expert_parallel import apply_expert_parallel
from trainer.logprob_head import LogprobHead, TokenQuery, install
from trainer.lora import LoRA
from trainer.loss import token_logprobs_and_entropy
from trainer.parallel import Layout, apply_fsdp
from trainer.routing_replay import routers
from trainer.sampling_mask import NO_TRUNCATION, NoTruncation, Truncation
from trainer import vision

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def attention_implementation(choice: str, dtype: str, device: torch.device) -> str:
    """trainer.model.attention resolved. auto: flash_attention_2 on CUDA in bfloat16 where the flash-attn
    package is installed (Ampere or newer), else "varlen" (trainer/packed_attention.py: torch's own
    flash kernel where it runs, elsewhere SDPA per document): sdpa would give packed rows a
    block-diagonal [T, T] mask, a billion elements per call at 32k tokens."""
    if choice != "auto":
        return choice
    from transformers.utils import is_flash_attn_2_available

    if dtype == "bfloat16" and device.type == "cuda" and is_flash_attn_2_available() \
            and torch.cuda.get_device_capability(device)[0] >= 8:
        return "flash_attention_2"
    return packed_attention.NAME


def load_model(cfg: RunConfig, device: torch.device, trainable: bool, lora_slots: int = 0, *, dtype: str,
               layout: Layout | None = None) -> tuple[torch.nn.Module, LoRA | None]:
    """The starting model, FSDP2-sharded, computing in `dtype` (trainer.model.dtype resolved:
    trainer/compute_dtype.py); with lora_slots, frozen and carrying that many adapter slots
    (trainer/lora.py), created before sharding so FSDP2 manages them too. A frozen model (the KL
    reference) is stored in the compute dtype: it has no optimizer to need float32 masters, and
    the mixed-precision policy would cast it to that dtype in every forward anyway, so bfloat16
    halves its memory and changes none of its logits. With trainer.model.compile, each decoder layer's
    forward is compiled (trainer/compiled_layers.py) after the logprob head's probe and before
    sharding."""
    attention = attention_implementation(cfg.trainer.model.attention, dtype, device)
    if attention == packed_attention.NAME:
        packed_attention.register(device, _DTYPES[dtype])
    if cfg.trainer.parallel.context > 1:  # rows split across ranks: the split-aware attention
        attention = context_parallel.NAME
        context_parallel.register()
    # Packed rows carry no attention mask: transformers derives the block-diagonal mask (sdpa)
    # or the varlen boundaries (flash attention) from the restarting position ids; "varlen" gets
    # them from forward_logits.
    sees = vision.is_vision_language(AutoConfig.from_pretrained(cfg.model))
    auto = AutoModelForImageTextToText if sees else AutoModelForCausalLM
    model = auto.from_pretrained(
        cfg.model, dtype=torch.float32 if trainable else _DTYPES[dtype], attn_implementation=attention).to(device)
    lora = None
    if trainable:
        model.train()
        if sees:
            vision.freeze(model, cfg.trainer.vision.train_tower)
        if cfg.trainer.model.activation_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if lora_slots:
            lora = LoRA(model, cfg.trainer.lora, lora_slots)
            model.to(device)
    else:
        model.eval()
        model.requires_grad_(False)
    if sees:
        vision.bidirectional(model)
    install(model, cfg.trainer.model.logits_chunk_tokens)
    if compile_wanted(cfg.trainer.model.compile, device.type, lora is not None, bool(routers(model))):
        compile_layers(model)
    experts = layout.experts if layout is not None else None
    if cfg.trainer.parallel.expert > 1:
        assert experts is not None, "expert parallelism needs the trainer's layout"
        apply_expert_parallel(model, experts["expert"])
    apply_fsdp(model, _DTYPES[dtype], offload=not trainable and cfg.trainer.model.reference_offload, experts=experts)
    if sees:  # after sharding: the hook runs inside the root's forward (trainer/vision.py)
        vision.install(model, cfg.model)
    return model, lora


def forward_logits(model: torch.nn.Module, mb: MicroBatch, device: torch.device, single_row: bool) -> torch.Tensor:
    """Logits [R, T, V] of a micro-batch. `single_row`: packed rows go through the model as one
    row, because transformers' flash-attention path finds packed samples (varlen) only in a batch
    of one row; with several it would let samples attend across boundaries. (sdpa handles rows
    itself, and one long row would make its [L, L] mask R^2 times bigger; "varlen" flattens the
    rows itself, its documents cut at the boundaries computed here, on the host.)"""
    tokens = to_device(mb.tokens, device)
    positions = None if mb.position_ids is None else to_device(mb.position_ids, device)
    mask = None if mb.attention_mask is None else to_device(mb.attention_mask, device)
    documents = {}
    if model.config._attn_implementation == packed_attention.NAME:
        lengths = packed_attention.document_lengths(mb.position_ids, mb.attention_mask, mb.tokens.shape)
        documents, mask = packed_attention.boundaries(lengths, device), None
    flat = single_row and positions is not None and tokens.shape[0] > 1
    if getattr(model, "asyncrl_vision", None) is not None:  # a VLM (trainer/vision.py install): every forward
        documents["images"] = (mb.images or [], None if mb.sampled is None else to_device(mb.sampled, device))
    logits = model(
        input_ids=tokens.reshape(1, -1) if flat else tokens,
        position_ids=positions.reshape(1, -1) if flat else positions,
        attention_mask=mask,
        use_cache=False,  # with a KV cache object, transformers ignores packed position ids
        **documents,
    ).logits
    return logits.reshape(*tokens.shape, -1) if flat else logits


def micro_batch_logprobs(model: torch.nn.Module, mb: MicroBatch, device: torch.device, single_row: bool,
                         truncation: Truncation | NoTruncation = NO_TRUNCATION,
                         smoothing: float = 0.0, context: ContextShare | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprobs, entropy) [R, T-1] of a micro-batch's tokens, each under its own sample's
    temperature (mb.temperature): the distribution the engine sampled it from, which a batch
    mixing datasets with different sampling settings makes differ from sample to sample. With
    `truncation` (mb.truncation(vocab)), over the kept set (the sampler's recorded one, else rebuilt
    from top_k/top_p/min_p); with
    `smoothing`, label-smoothed (trainer/loss.py token_logprobs_and_entropy). With `context` of
    several ranks, each runs its share of every row (split_logprobs)."""
    head = model.get_output_embeddings()
    if context is not None and context.size > 1:
        return split_logprobs(model, mb, device, context, truncation, smoothing)
    if not isinstance(head, LogprobHead):
        logits = forward_logits(model, mb, device, single_row)
        return token_logprobs_and_entropy(logits, to_device(mb.tokens, device), to_device(mb.temperature, device),
                                          truncation, smoothing)
    with head.asked(micro_batch_query(mb, device, truncation, smoothing)):
        out = forward_logits(model, mb, device, single_row)  # [R, T, 2]: (logprob, entropy)
    truncation.counted(head.counts)
    return out[:, :-1, 0], out[:, :-1, 1]


def micro_batch_query(mb: MicroBatch, device: torch.device, truncation: Truncation | NoTruncation,
                      smoothing: float = 0.0) -> TokenQuery:
    """The head's query for a micro-batch: at [r, t] the token t+1 of row r, wanted where the
    loss uses it. Per-predicted-token fields ([R, T-1]) get a last column that is never wanted.
    The wanted positions' indices are found here, on the host's copy: on the device that would
    be a round trip per micro-batch (nonzero's size depends on the data)."""
    def widen(x: torch.Tensor, fill) -> torch.Tensor:
        return to_device(torch.cat([x, torch.full_like(x[:, :1], fill)], 1), device)

    wanted = torch.cat([mb.loss_mask > 0, torch.zeros_like(mb.loss_mask[:, :1], dtype=torch.bool)], 1)
    return TokenQuery(targets=widen(mb.tokens[:, 1:], 0), wanted=to_device(wanted, device),
                      temperature=widen(mb.temperature.float(), 1.0), truncation=truncation.mapped(widen),
                      smoothing=smoothing,
                      where=to_device(wanted.reshape(-1).nonzero().squeeze(1), device))


def split_logprobs(model: torch.nn.Module, mb: MicroBatch, device: torch.device, share: ContextShare,
                   truncation: Truncation | NoTruncation, smoothing: float) -> tuple[torch.Tensor, torch.Tensor]:
    """micro_batch_logprobs under context parallelism (trainer/context_parallel.py): the model and
    its LogprobHead run on this rank's share of every row, with the whole rows' positions and
    documents; the group's shares are gathered into whole rows, alike on every rank."""
    head = model.get_output_embeddings()
    if not isinstance(head, LogprobHead):
        raise ValueError(f"trainer.parallel.context > 1 needs the chunked logprob head: {type(model).__name__} "
                         "changes its logits after the lm_head, or trainer.model.logits_chunk_tokens = 0")
    if mb.images is not None:
        raise ValueError("trainer.parallel.context > 1 with images: not supported (each share would need its "
                         "placeholders' image features; docs/vlm.md)")
    rows, width = mb.tokens.shape
    padded = share.span(width)[0]
    tail = torch.arange(padded - width).expand(rows, -1)  # the padding: a document of its own
    if mb.position_ids is not None:
        positions = torch.cat([mb.position_ids, tail], 1)
        lengths = packed_attention.document_lengths(positions, None, torch.Size((rows, padded)))
    else:  # padded rows: real tokens at 0.., as transformers positions them, then their padding
        positions = torch.arange(padded).expand(rows, -1)
        real = torch.cat([mb.attention_mask, torch.zeros_like(tail)], 1)
        lengths = packed_attention.document_lengths(None, real, torch.Size((rows, padded)))
    pieces = context_parallel.pieces(share, lengths, rows, padded)
    whole = micro_batch_query(mb, device, truncation, smoothing)
    wanted = share.local(torch.cat([mb.loss_mask > 0, torch.zeros_like(mb.loss_mask[:, :1], dtype=torch.bool)], 1),
                         False)
    query = TokenQuery(targets=share.local(whole.targets, 0), wanted=share.local(whole.wanted, False),
                       temperature=share.local(whole.temperature, 1.0), truncation=whole.truncation.mapped(share.local),
                       smoothing=smoothing, where=to_device(wanted.reshape(-1).nonzero().squeeze(1), device))
    with head.asked(query):
        out = model(input_ids=to_device(share.local(mb.tokens, 0), device),
                    position_ids=to_device(share.local(positions, 0), device),
                    use_cache=False, context_pieces=pieces).logits  # [R, n, 2]: (logprob, entropy)
    if isinstance(truncation, Truncation):  # the kept sets' counts, from every share
        counts = head.counts.clone()
        torch.distributed.all_reduce(counts, group=share.group)
        truncation.counted(counts)
    out = context_parallel.gather_identical(out, share, 1)[:, :width]
    return out[:, :-1, 0], out[:, :-1, 1]
