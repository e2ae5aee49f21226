"""Methods vLLM mixes into each of its workers (`--worker-extension-cls`), reached through
`collective_rpc`. vLLM adds this class to the worker's bases and never calls its __init__, so
state lives in attributes read with getattr.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from pathlib import Path

# Under vLLM's logger: worker processes print only what vLLM's own logging config covers.
log = logging.getLogger("vllm.asyncrl")


class WeightReloadExtension:
    def asyncrl_reload_weights(self, path: str) -> None:
        """Reload every weight in place from the safetensors under `path`, the engine paused
        between two steps.

        Nothing here reads the model runner's request state: which tokens the new weights
        sampled is labelled above the runners, by the engine core (inference/reload.py sets
        vLLM's weight version before the engine resumes), so the reload is the same on vLLM's
        V1 and V2 runners and with async scheduling (tests/inference/test_vllm_contract.py pins what is
        touched).

        The worker's own reload_weights is the path that works on the CPU backend, which packs
        linear weights into its matmul layout at load time (a plain model.load_weights would try
        to copy into the emptied `.weight` tensors). It does not re-pack a tied lm_head, though:
        with tied embeddings the logits kept coming from the OLD packed copy while the embedding
        changed (../shared/VLLM_CPU_NOTES.md): _asyncrl_fix_tied_lm_head repairs it.
        """
        NothingToLoad.install(self.model_runner.get_model(), self._asyncrl_tied_lm_head())
        with self._asyncrl_refreshing_tied_lm_head(), self._asyncrl_cleared_on_failure():
            self.reload_weights(weights_path=path)
        repack_cpu_experts(self.model_runner.get_model())

    # --- versions checked on every worker before any loads (inference/staging.py) ---------

    def asyncrl_stage_full(self, path: str) -> dict:
        """With weight_sync.delta: the full version at `path`, read and checked against its
        digest before the engine is touched (kept as the base later deltas are rebuilt from);
        vLLM's own reload reads the files again at commit, from the page cache. {} or
        {"refused": why} (an answer, not an error: vLLM would log a traceback for it)."""
        from inference import staging

        return staging.stage(self, staging.full_files, path)

    def asyncrl_stage_delta(self, path: str) -> dict:
        """The version the delta at `path` describes, rebuilt from the base (held in memory, or
        read from its sibling directory) and checked against the version's checksum; loaded at
        commit from memory exactly as from the full file (the same loader, the same bytes). Only
        the changed values are read from `path`."""
        from inference import staging

        return staging.stage(self, staging.delta_files, path)

    def asyncrl_stage_broadcast(self, manifest_path: str) -> dict:
        """A version arriving by the trainer's broadcast (staging.broadcast says what is received
        and checked before the commit); the sender learns at commit or discard whether it loaded."""
        from inference import staging

        return staging.stage(self, staging.broadcast, manifest_path)

    def asyncrl_commit(self) -> dict:
        """Load the version staged (every worker passed its checks): {"base": the base held,
        and the checksum this worker computed, the bytes it received, seconds}."""
        from inference import staging

        return staging.commit(self)

    def asyncrl_discard(self) -> dict:
        """Drop the version staged (some worker refused it)."""
        from inference import staging

        return staging.discard(self)

    def _asyncrl_load_tensors(self, tensors) -> None:
        """Reload every weight from (name, tensor) pairs, as asyncrl_reload_weights does from files."""
        NothingToLoad.install(self.model_runner.get_model(), self._asyncrl_tied_lm_head())
        with self._asyncrl_refreshing_tied_lm_head(), self._asyncrl_cleared_on_failure():
            self.reload_weights(weights_iterator=tensors)
        repack_cpu_experts(self.model_runner.get_model())

    def _asyncrl_held(self) -> list | None:
        """[run id, version, checksum] of the base this worker holds, if any."""
        base = getattr(self, "_asyncrl_base", None)
        return None if base is None else [base.digest.run_id, base.digest.version, base.digest.checksum]

    def _asyncrl_base_for(self, manifest, directory: Path):
        """The delta's base (a BaseVersion): the one held if it is the one named, else read from
        `directory`."""
        from inference.delta_rebuild import BaseVersion, raise_refused

        base = getattr(self, "_asyncrl_base", None)
        if base is not None and base.digest == manifest.base:
            return base
        base = BaseVersion.read(str(directory))
        if base.digest != manifest.base:
            raise_refused(f"version {manifest.version} is a delta against version {manifest.base_version} of run "
                          f"{manifest.run_id} ({manifest.base_checksum}), but {directory} holds version "
                          f"{base.digest.version} of run {base.digest.run_id} ({base.digest.checksum})")
        return base

    @contextmanager
    def _asyncrl_cleared_on_failure(self):
        """Around a reload_weights call: when it raises, leave no layer mid-load
        (_end_interrupted_reload), so that the engine can run and the next reload (the server's
        rollback to the version it served: inference/reload_failure.py) starts clean."""
        try:
            yield
        except BaseException:
            loaded, kept = _end_interrupted_reload(self.model_runner.get_model())
            log.warning("reload failed half-way: %d layers had taken the new weights, %d keep their own",
                        loaded, kept)
            raise

    def _asyncrl_tied_lm_head(self):
        """The lm_head when it is tied to the input embedding (and has a quant_method), else None."""
        lm_head = getattr(self.model_runner.get_model(), "lm_head", None)
        if not getattr(self.model_runner.model_config.hf_text_config, "tie_word_embeddings", False):
            return None
        return lm_head if getattr(lm_head, "quant_method", None) is not None else None

    @contextmanager
    def _asyncrl_refreshing_tied_lm_head(self):
        """Around a reload_weights call: afterwards, make a tied lm_head compute from the new
        weights (see _asyncrl_fix_tied_lm_head). Nothing is fixed when the reload raises."""
        lm_head = self._asyncrl_tied_lm_head()
        twin = _packed_twin(self.model_runner.get_model(), lm_head) if lm_head is not None else None
        packed_before = twin.cpu_linear if twin is not None else None
        yield
        if lm_head is not None:
            self._asyncrl_fix_tied_lm_head(lm_head, twin, packed_before)

    def _asyncrl_fix_tied_lm_head(self, lm_head, twin, packed_before) -> None:
        """reload_weights leaves a tied lm_head computing from its OLD packed weights on the CPU
        backend, which packs each linear weight into its matmul layout (a closure in the layer's
        `cpu_linear`). The lm_head shares its Parameter with the embedding, and the checkpoint
        has no lm_head.weight to load into it, so the reload only puts that Parameter back
        (updated in place) and never re-runs the lm_head's post-load processing: the logits kept
        coming from the old embedding (../shared/VLLM_CPU_NOTES.md).

        Re-running that processing here (a new oneDNN-packed copy of the embedding) is correct
        but took 0.34-0.48 s for the 151,936 x 896 embedding of a 0.5B model, on top of a ~2 s
        reload (benchmarks/tied_lm_head_reload.py). The reload has already made that very copy:
        it does run the embedding module's own post-load processing, which on CPU packs the same
        Parameter the same way (dispatch_cpu_unquantized_gemm, remove_weight=False) into a
        `cpu_linear` that the embedding itself never calls (lookups do not go through it). So
        the lm_head takes that one, at no cost, and its own old packed copy is freed (one copy
        of the embedding less in memory). Computing the logits from the live weight with a
        plain torch linear would also avoid the re-pack, but made the lm_head matmul 2.7-3.6x
        slower and 8 x 64 decoding ~30% slower on the 0.5B model (benchmarks/lm_head_decode.py).

        Falls back to re-packing whenever that does not hold: no twin module with a `cpu_linear`
        (GPU backends: there the processing is a no-op), another quantization method, or a twin
        whose `cpu_linear` this reload did not rebuild.
        """
        from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

        if (twin is not None and twin.weight is lm_head.weight
                and isinstance(lm_head.quant_method, UnquantizedEmbeddingMethod)
                and isinstance(getattr(twin, "quant_method", None), UnquantizedEmbeddingMethod)
                and callable(getattr(twin, "cpu_linear", None)) and twin.cpu_linear is not packed_before):
            lm_head.cpu_linear = twin.cpu_linear
            return
        lm_head.quant_method.process_weights_after_loading(lm_head)

    # --- routed experts (inference/routing_capture.py) --------------------------------------

    def asyncrl_record_routing(self) -> dict:
        """Record every MoE layer's expert choice per token from now on; returns the MoE layers'
        indices, top_k and the rows' dtype."""
        from inference.routing_capture import bind

        return bind(self)

    def asyncrl_take_routing(self, external_ids: list[str]) -> dict[str, dict]:
        """The recorded rows of the engine requests made from these ids, handed over once."""
        return self._asyncrl_routing.take(external_ids)

    # --- weight sync by broadcast (rl/weights/broadcast.py) ----------------------------------------

    def asyncrl_init_broadcaster(self, address: str, rank_offset: int, world_size: int, timeout_s: float,
                                 who: str) -> int:
        """Join the trainer's broadcast group as rank rank_offset + this worker's rank; blocks
        until every member joined (or timeout_s). Returns the rank."""
        from rl.weights import broadcast as bc

        rank = rank_offset + self.rank
        self._asyncrl_group = bc.join_group(address, rank, world_size, timeout_s, self.device,
                                            who=f"{who} worker {self.rank}")
        return rank


def repack_cpu_experts(model) -> int:
    """After a reload: re-pack every MoE layer's expert weights for vLLM's CPU MoE kernel; returns
    how many layers. The kernel computes from weights packed into its micro-GEMM layout at load
    (fused_moe/experts/cpu_moe.py process_weights_after_loading). A reload treats the second load
    as a weight update: it copies the new weights, as loaded, into that packed storage and skips
    the kernel's packing (unquantized_fused_moe_method.py _setup_kernel), so the experts computed
    from scrambled weights (tests/inference/test_routing_vllm.py reloads and compares). Packing again from
    what was just copied in puts it right. GPU kernels read the weights as loaded: left alone."""
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
        from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner
    except ImportError:  # another vLLM layout: no such kernel to fix
        return 0
    repacked = 0
    for module in model.modules():
        if not isinstance(module, MoERunner):
            continue
        layer = module.routed_experts
        experts = getattr(getattr(layer.quant_method, "moe_kernel", None), "fused_experts", None)
        if isinstance(experts, CPUUnquantizedExperts):  # quantized CPU experts: not tried here
            experts.process_weights_after_loading(layer)
            repacked += 1
    return repacked


class NothingToLoad(logging.Filter):
    """Drops vLLM's "<Layer>: Failed to load weights" for layers no checkpoint holds weights for,
    which every reload printed (vllm 0.32, model_loader/reload/layerwise.py
    finalize_layerwise_processing says it of each layer the reload loaded nothing into): a tied
    lm_head (its weight is the embedding's, reloaded with it; _asyncrl_fix_tied_lm_head makes it
    compute from them) and layers whose only tensors are non-persistent buffers (a rotary
    embedding's cos/sin cache, computed at start). Only classes all of whose layers are such:
    the warning for any layer that should have had weights still shows."""

    LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
    MESSAGE = "%s: Failed to load weights"

    def __init__(self, layers: set[str]):
        super().__init__()
        self.layers = layers

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.msg == self.MESSAGE and len(record.args) == 1 and record.args[0] in self.layers)

    @classmethod
    def install(cls, model, tied_lm_head) -> None:
        """Once per process: the filter for `model`'s weightless layer classes."""
        logger = logging.getLogger(cls.LOGGER)
        if any(isinstance(f, cls) for f in logger.filters):
            return
        weightless: dict[str, bool] = {}
        for module in model.modules():
            params, buffers = dict(module.named_parameters(recurse=False)), dict(module.named_buffers(recurse=False))
            none_to_load = module is tied_lm_head or (
                not params and bool(buffers) and buffers.keys() <= module._non_persistent_buffers_set)
            name = type(module).__name__
            weightless[name] = weightless.get(name, True) and none_to_load
        logger.addFilter(cls({name for name, yes in weightless.items() if yes}))


def _packed_twin(model, lm_head):
    """The module other than `lm_head` that holds the very same weight Parameter (the input
    embedding of a tied model) when the CPU backend gave it a packed matmul (`cpu_linear`, set
    only by vLLM's CPU dispatch); else None. On GPU backends: None."""
    if not hasattr(lm_head, "cpu_linear"):
        return None
    weight = getattr(lm_head, "weight", None)
    for module in model.modules():
        if module is not lm_head and getattr(module, "weight", None) is weight and hasattr(module, "cpu_linear"):
            return module
    return None


def _end_interrupted_reload(model) -> tuple[int, int]:
    """After vLLM's reload_weights raised half-way: put every layer still waiting for weights back
    on its own tensors and forget what it had buffered. Returns how many layers with weights of
    their own had been loaded before the failure, and how many were put back.

    vLLM 0.32 reloads layer by layer (model_loader/reload/layerwise.py): it first moves every
    layer onto the meta device and wraps its weight loaders to buffer the incoming tensors; a
    layer is materialised, loaded, re-packed and copied back into its own tensors once all of
    its weights have arrived. Nothing undoes that when the load raises (a misshapen tensor, a
    file cut short): the layers not reached stay on meta, and the engine's next step died with
    "Tensor on device cpu is not on the expected device meta!" (measured), and the layer that
    raised keeps the bad tensor buffered, for the next reload to load again (layerwise.py's
    online_process_loader buffers before it checks the shape). Here those
    layers get back the tensors they had (the old weights); the layers completed before the
    failure keep the new ones. Pinned to vllm 0.32's layerwise module."""
    from vllm.model_executor.model_loader.reload import layerwise

    loaded = kept = 0
    for layer in model.modules():
        info = layerwise.LAYERWISE_INFO.get(layer)
        own = bool(layerwise.get_layer_tensors(layer))
        if info is None or not info.can_load():
            loaded += own and info is not None
            continue
        kept += own
        if info.kernel_tensors is not None:
            layerwise._place_kernel_tensors(layer, info)
        for tensor in layerwise.get_layer_tensors(layer).values():
            if hasattr(tensor, "weight_loader"):
                tensor.weight_loader = layerwise._get_original_loader(tensor)
        info.reset()
    if hasattr(model, "_original_do_torchao_reload"):
        model._do_torchao_reload = model._original_do_torchao_reload
    layerwise.LOADING_LAYERS.clear()
    return loaded, kept
