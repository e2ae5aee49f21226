"""The SFT data station (`rl sft`): the [sft] datasets' conversations rendered, tokenized and masked
to what the assistant wrote (data.py, assistant_mask.py), written for the trainer."""

# The station's interface: the start-up check (orchestrator/preflight.py) and `rl sft`'s data step.
from orchestrator.sft.data import prepare, sft_setup

__all__ = ["prepare", "sft_setup"]
