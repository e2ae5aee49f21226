"""Methods vLLM mixes into each of its workers (`--worker-extension-cls`), reached through
`collective_rpc`. vLLM adds this class to the worker's bases and never calls its __init__, so
state lives in attributes read with getattr.
"""

from __future__ import annotations

import logging
import time

# Under vLLM's logger: worker processes print only what vLLM's own logging config covers.
log = logging.getLogger("vllm.asyncrl")


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
        sampled = self._asyncrl_sampled()
        self.reload_weights(weights_path=path)
        self._asyncrl_fix_tied_lm_head()
        return sampled

    def _asyncrl_sampled(self) -> dict[str, int]:
        return {rid: len(state.output_token_ids) for rid, state in self.model_runner.requests.items()}

    def _asyncrl_fix_tied_lm_head(self) -> None:
        model = self.model_runner.get_model()
        hf_config = self.model_runner.model_config.hf_text_config
        lm_head = getattr(model, "lm_head", None)
        if getattr(hf_config, "tie_word_embeddings", False) and lm_head is not None:
            quant_method = getattr(lm_head, "quant_method", None)
            if quant_method is not None:
                quant_method.process_weights_after_loading(lm_head)

    # --- weight sync by broadcast (rl/broadcast.py) ----------------------------------------

    def asyncrl_init_broadcaster(self, address: str, rank_offset: int, world_size: int, timeout_s: float,
                                 who: str) -> int:
        """Join the trainer's broadcast group as rank rank_offset + this worker's rank; blocks
        until every member joined (or timeout_s). Returns the rank."""
        from rl import broadcast as bc

        rank = rank_offset + self.rank
        self._asyncrl_group = bc.join_group(address, rank, world_size, timeout_s, self.device,
                                            who=f"{who} worker {self.rank}")
        return rank

    def asyncrl_receive_weights(self, manifest_path: str) -> dict[str, int]:
        """Like asyncrl_reload_weights, with the tensors streaming in from the trainer's
        broadcast instead of files: each bucket is received when vLLM's loader reaches it."""
        from rl import broadcast as bc

        group = getattr(self, "_asyncrl_group", None)
        if group is None:
            raise RuntimeError("this worker is not in a broadcast group (POST /init_broadcaster first)")
        if getattr(self, "_asyncrl_broken", None):
            raise RuntimeError(f"the broadcast group is out of step since an earlier failure "
                               f"({self._asyncrl_broken}); restart the servers and the trainer")
        with open(manifest_path, "rb") as f:
            manifest = bc.Manifest.from_json(f.read())
        sampled = self._asyncrl_sampled()
        start = time.perf_counter()
        try:
            incoming = bc.Incoming(group, manifest)
        except Exception as e:
            self._asyncrl_broken = str(e)
            raise
        ok = False
        try:
            self.reload_weights(weights_iterator=incoming.tensors())
            self._asyncrl_fix_tied_lm_head()
            ok = True
        finally:
            # Runs after a failed load too: the sender is told (its error names this worker)
            # and the next version's collectives still line up.
            try:
                incoming.finish(ok)
            except Exception as e:
                self._asyncrl_broken = str(e)
                raise
        log.info("received version %d by broadcast (%d buckets, %.1f MB) in %.3f s", manifest.version,
                 len(manifest.buckets), manifest.total_bytes / 2**20, time.perf_counter() - start)
        return sampled
