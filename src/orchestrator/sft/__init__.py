"""The SFT data station (`rl sft`): the [sft] datasets' conversations rendered, tokenized and masked
to what the assistant wrote (data.py, assistant_mask.py), written for the trainer."""
