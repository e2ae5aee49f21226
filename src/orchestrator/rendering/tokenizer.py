"""The orchestrator's tokenizer: the model directory's tokenizer.json, read by the Rust `tokenizers`
library, without transformers.

Why not AutoTokenizer: with torch installed, `from transformers import AutoTokenizer` imports
torch and triton (transformers' auto classes import its generation code), ~4 s and ~380 MB for a
process that only turns text into ids and back, and triton's extensions printed ~30 "nanobind:
leaked ..." lines at every exit. The orchestrator only ever called the Rust tokenizer behind the
HF one (rollouts.py); tokenizer.json is that tokenizer's serialization (save_pretrained writes
it with tokenizer_config.json's special tokens and BOS/EOS template already applied).

Same ids: on every text the shipped tasks make, and on any ids decoded, it matches AutoTokenizer
(tests/orchestrator/test_tokenizer.py). Where they part, the file is right: transformers 5 rebuilds a tokenizer
of a known model type from its class's recipe, and turns the char-level tiny model's into a
byte-level BPE that silently drops a character outside the vocabulary; tokenizer.json is what
the model was trained with (scripts/make_tiny_model.py) and maps that character to <unk>.

A model directory without tokenizer.json (a sentencepiece file only, a hub id) still gets
AutoTokenizer, as before, imports included.
"""

from __future__ import annotations

import logging
from pathlib import Path

from tokenizers import Tokenizer

log = logging.getLogger("orchestrator")


def load_tokenizer(model: str):
    """A `tokenizers.Tokenizer` from `model`/tokenizer.json, else transformers' AutoTokenizer."""
    path = Path(model) / "tokenizer.json"
    if path.is_file():
        return Tokenizer.from_file(str(path))
    log.info("%s has no tokenizer.json: loading its tokenizer with transformers (imports torch)", model)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)
