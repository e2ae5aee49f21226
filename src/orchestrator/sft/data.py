"""`rl sft`'s data step: the [sft] datasets' rows rendered by the model's chat template, tokenized,
with the assistant's tokens marked (orchestrator/sft/assistant_mask.py), written for the trainer as
output_dir/sft_data/{train,eval}.safetensors (rl/sft_data.py).

Image chats (rows whose messages hold OpenAI image parts, as the RL datasets take them:
orchestrator/prompts/images.py) are rendered as the server and the RL run render them: each
image's placeholder expanded as the model's processor expands it, the expansion never trained on
(context, like the user's text), and the images kept as PNG bytes for the trainer's vision path.

It runs before the model loads. A row that cannot be trained on (no assistant turn, longer than
seq_len, a template error, a malformed row) is skipped and counted; each kind of problem is one
line per dataset, with its count and first row. A dataset left with no usable row is a
ConfigError naming it: exit 2 before anything trains.
"""

from __future__ import annotations

import itertools
import logging
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from orchestrator.callables import load_callable
from orchestrator.prompts import load_table
from orchestrator.rendering import (ChatTemplate, ImageError, decode, has_images, image_parts, image_support,
                                    load_tokenizer, png, read_source, stop_token_ids, template_messages)
from orchestrator.sft.assistant_mask import MaskError, conversation_tokens
from rl.config import ConfigError, RunConfig
from rl.config.datasets import DatasetConfig
from rl.rundir import RunDir
from rl.sft_data import SftData, sft_data_dir

log = logging.getLogger("sft")


@dataclass
class Skipped:
    """Rows skipped per kind of problem, with the first row of each."""

    counts: Counter = field(default_factory=Counter)
    first: dict[str, str] = field(default_factory=dict)

    def add(self, kind: str, where: str) -> None:
        self.counts[kind] += 1
        self.first.setdefault(kind, where)


def dataset_rows(spec: DatasetConfig, seed: int, limit: int) -> Iterator[dict]:
    """At most `limit` rows, in the dataset's own order (batches shuffle them, rl/sft_data.py)."""
    if spec.function:
        rows = load_callable(spec.function, f"dataset {spec.label}: function")(seed)
        return itertools.islice(rows, min(limit, spec.size))
    table = load_table(spec, seed)
    return (table[i] for i in range(min(limit, len(table))))


def conversation(row, spec: DatasetConfig, system_prompt: str) -> tuple[list[dict], list[dict] | None]:
    """A row's messages (a prompt/completion pair becomes a user and an assistant turn) and its
    tool schemas (a "tools" field, as an OpenAI request carries them)."""
    if not isinstance(row, dict):
        raise MaskError("not a JSON object")
    messages = row.get(spec.messages_key)
    if messages is None:
        prompt, completion = row.get(spec.prompt_key), row.get(spec.completion_key)
        if not isinstance(prompt, str) or not isinstance(completion, (str, int, float)):
            raise MaskError(f"neither {spec.messages_key!r} nor {spec.prompt_key!r} and {spec.completion_key!r}")
        messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": str(completion)}]
    if not isinstance(messages, list) or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                                 for m in messages):
        raise MaskError(f"{spec.messages_key!r} is not a list of messages with roles")
    system = system_prompt if spec.prompts.system_prompt is None else spec.prompts.system_prompt
    if system and messages and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": system}, *messages]
    tools = row.get("tools")
    return messages, tools if isinstance(tools, list) else None


class Tokenize:
    """A row's tokens and mask: through the chat template, or, without one, prompt + completion
    + the end of sequence (only the completion and its end trained on)."""

    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        self.tokenizer = load_tokenizer(str(cfg.model))
        self.template = ChatTemplate.configured(cfg.orchestrator, cfg.model)
        stops = stop_token_ids(cfg.model, self.tokenizer, self.template)
        self.end = stops[:1]
        self.images = image_support(cfg.model)
        if self.images is not None:
            self.image_id = self.tokenizer.token_to_id(self.images.image_token)
            self.expansion = self.tokenizer.encode(self.images.expansion(), add_special_tokens=False).ids

    def __call__(self, row, spec: DatasetConfig) -> tuple[list[int], list[int], list[bytes]]:
        """(ids, assistant mask, the images' PNG bytes in the order of their placeholders)."""
        messages, tools = conversation(row, spec, self.cfg.orchestrator.prompts.system_prompt)
        images: list[bytes] = []
        if has_images(messages):
            images = self.read_images(messages, row, spec)
            messages = template_messages(messages)
        if self.template is not None:
            ids, mask = conversation_tokens(self.template, self.tokenizer, messages, tools)
        else:
            ids, mask = self.raw(messages)
        if images:
            ids, mask = self.expand(ids, mask, len(images))
        if len(ids) > self.cfg.seq_len:
            raise MaskError(f"longer than seq_len {self.cfg.seq_len}", f"{len(ids)} tokens")
        return ids, mask, images

    def read_images(self, messages: list[dict], row: dict, spec: DatasetConfig) -> list[bytes]:
        """The chat's images as PNG bytes, decoded and bounded as the RL run's prompts are
        (orchestrator/prompts/images.py); a bad one skips the row, named by its part."""
        if self.images is None:
            raise MaskError("an image part, and the model reads text only", f"{self.cfg.model} has no processor_config.json")
        # Paths are confined to the working directory and the dataset's own directory.
        roots = [Path.cwd()] + ([Path(spec.path).parent] if spec.path else [])
        try:
            sources = image_parts(messages, row.get("images") if isinstance(row, dict) else ())
            if len(sources) > self.images.max_images:
                raise ImageError(f"{len(sources)} images, more than the {self.images.max_images} a prompt may hold")
            return [png(decode(read_source(s, roots), self.images.max_pixels, f"image {i}"))
                    for i, s in enumerate(sources)]
        except ImageError as e:
            raise MaskError("a bad image", str(e)) from None

    def expand(self, ids: list[int], mask: list[int], count: int) -> tuple[list[int], list[int]]:
        """Each placeholder token replaced by the processor's expansion (special tokens only, so
        this is the expanded text's tokenization), none of it trained on."""
        found = ids.count(self.image_id)
        if found != count:
            raise MaskError("image placeholders differ from the images",
                            f"the chat template wrote {found} {self.images.image_token} for {count} images")
        out_ids, out_mask = [], []
        for t, m in zip(ids, mask):
            if t == self.image_id:
                out_ids += self.expansion
                out_mask += [0] * len(self.expansion)
            else:
                out_ids.append(t)
                out_mask.append(m)
        return out_ids, out_mask

    def raw(self, messages: list[dict]) -> tuple[list[int], list[int]]:
        roles = [m["role"] for m in messages if m["role"] != "system"]
        if roles != ["user", "assistant"]:
            raise MaskError("a chat conversation, and the model has no chat template",
                            "without one only prompt/completion rows train (or set orchestrator.prompts.chat_template)")
        prompt = self.tokenizer.encode(messages[-2]["content"], add_special_tokens=False).ids
        answer = self.tokenizer.encode(messages[-1]["content"], add_special_tokens=False).ids + self.end
        return prompt + answer, [0] * len(prompt) + [1] * len(answer)


def prepare_split(cfg: RunConfig, specs: list[DatasetConfig], tokenize: Tokenize, key: str, limit: int) -> SftData:
    tokens, masks, lengths, owner, images, counts = [], [], [], [], [], []
    for d, spec in enumerate(specs):
        skipped, kept = Skipped(), 0
        for i, row in enumerate(dataset_rows(spec, cfg.seed, limit)):
            try:
                ids, mask, pngs = tokenize(row, spec)
            except MaskError as e:
                skipped.add(e.kind, f"row {i}" + (f", {e.detail}" if e.detail else ""))
                continue
            tokens.append(np.asarray(ids, dtype=np.int64))
            masks.append(np.asarray(mask, dtype=np.uint8))
            lengths.append(len(ids))
            owner.append(d)
            images += pngs
            counts.append(len(pngs))
            kept += 1
        for kind, count in skipped.counts.items():
            log.warning("%s %s: %d row(s) skipped: %s (first: %s)", key, spec.label, count, kind, skipped.first[kind])
        if not kept:
            problems = "; ".join(f"{n} {k} (first: {skipped.first[k]})" for k, n in skipped.counts.items())
            raise ConfigError(f"{key} {spec.label}: no usable row ({problems or 'the dataset is empty'})")
    pictures = {} if not images else dict(
        image_bytes=np.frombuffer(b"".join(images), dtype=np.uint8).copy(),
        image_sizes=np.asarray([len(b) for b in images], dtype=np.int64), image_counts=np.asarray(counts, dtype=np.int64))
    return SftData(np.concatenate(tokens), np.concatenate(masks), np.asarray(lengths, dtype=np.int64),
                   np.asarray(owner, dtype=np.int64), [s.label for s in specs], [s.weight for s in specs], **pictures)


def prepare(cfg: RunConfig) -> None:
    """Write the train (and eval) split for the trainer; ConfigError on a dataset with no usable row."""
    tokenize = Tokenize(cfg)
    out = sft_data_dir(RunDir(cfg.output_dir))
    out.mkdir(parents=True, exist_ok=True)
    for name, specs, limit in (("train", cfg.sft.datasets, 1 << 62), ("eval", cfg.sft.eval_datasets, cfg.sft.eval_rows)):
        path = out / f"{name}.safetensors"
        if not specs:
            path.unlink(missing_ok=True)
            continue
        data = prepare_split(cfg, specs, tokenize, f"sft.{'datasets' if name == 'train' else 'eval_datasets'}", limit)
        data.write(path)
        trained = int(data.loss_mask.sum())
        pictures = "" if data.image_counts is None else f", {int(data.image_counts.sum())} image(s)"
        log.info("%s: %d conversation(s), %d tokens (%d trained: %.0f%%)%s from %s", name, data.num_rows,
                 len(data.tokens), trained, 100 * trained / len(data.tokens), pictures, ", ".join(data.names))


def sft_setup(cfg: RunConfig) -> None:
    """Start-up check of `rl sft`: what it cannot do, and the first rows of each dataset usable
    (all of them are read by prepare, before the model loads)."""
    if not cfg.sft.datasets:
        raise ConfigError("sft.datasets is empty: list the rows to train on ([[sft.datasets]])")
    if cfg.weight_delivery == "broadcast":
        raise ConfigError('weight_sync.kind = "broadcast": rl sft writes its weights as files (no servers to '
                          'stream them to); leave weight_sync.kind unset')
    if cfg.trainer.lora.multi_run:
        raise ConfigError("trainer.lora.multi_run = true: rl sft trains one run; set it false")
    if cfg.trainer.loss.kl_coef:
        raise ConfigError("trainer.loss.kl_coef > 0: rl sft has no KL penalty; set it to 0")
    if cfg.sft.eval_generate and not (cfg.orchestrator.eval.datasets or cfg.orchestrator.eval.environments):
        raise ConfigError("sft.eval_generate = true but [[orchestrator.eval.datasets]] is empty: list the rows "
                          "to evaluate by generation there (or [[orchestrator.eval.environments]])")
    tokenize = Tokenize(cfg)
    loader = logging.getLogger("orchestrator")
    for key, specs in (("sft.datasets", cfg.sft.datasets), ("sft.eval_datasets", cfg.sft.eval_datasets)):
        for spec in specs:
            # A file's malformed rows are reported once, when prepare reads it whole.
            loader.disabled = True
            try:
                rows = list(dataset_rows(spec, cfg.seed, 8))
            finally:
                loader.disabled = False
            problems = []
            for i, row in enumerate(rows):
                try:
                    tokenize(row, spec)
                    break
                except MaskError as e:
                    problems.append(f"row {i}: {e}")
            else:
                raise ConfigError(f"{key} {spec.label}: none of its first rows is usable "
                                  f"({'; '.join(problems[:2]) or 'the dataset is empty'})")
