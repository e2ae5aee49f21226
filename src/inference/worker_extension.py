"""Methods vLLM mixes into each of its workers (`--worker-extension-cls`), reached through
`collective_rpc`. vLLM adds this class to the worker's bases and never calls its __init__.
"""

from __future__ import annotations


class WeightReloadExtension:
    def asyncrl_reload_weights(self, path: str) -> dict[str, int]:
        """Reload every weight in place from the safetensors under `path`; return, per engine
        request the worker holds (vLLM's internal id), how many tokens it had sampled before.

        The counts are where the in-flight requests switch policy version: the engine is paused
        between two steps when this runs, so token `count` onwards is sampled by the new weights.
        `model_runner.requests` (vllm 0.32's V1 runner, the one the CPU backend uses: the V2
        runner needs Triton) holds every request scheduled and not yet finished, preempted ones
        included, and `output_token_ids` is extended right after each sampling step (the CPU
        backend turns async scheduling off, so there are no placeholder tokens in it).

        The worker's own reload_weights is the path that works on the CPU backend, which packs
        linear weights into its matmul layout at load time (a plain model.load_weights would try
        to copy into the emptied `.weight` tensors). It does not re-pack a tied lm_head, though:
        with tied embeddings the logits kept coming from the OLD packed copy while the embedding
        changed (../shared/VLLM_CPU_NOTES.md), so re-run the lm_head's post-load processing.
        """
        sampled = {rid: len(state.output_token_ids)
                   for rid, state in self.model_runner.requests.items()}
        self.reload_weights(weights_path=path)
        model = self.model_runner.get_model()
        hf_config = self.model_runner.model_config.hf_text_config
        lm_head = getattr(model, "lm_head", None)
        if getattr(hf_config, "tie_word_embeddings", False) and lm_head is not None:
            quant_method = getattr(lm_head, "quant_method", None)
            if quant_method is not None:
                quant_method.process_weights_after_loading(lm_head)
        return sampled
