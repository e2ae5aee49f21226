"""Which experts each MoE layer routed each token to, recorded in the engine per request and
position, for the trainer's routing replay (trainer.mismatch.routing_replay; inference.record_routing).

Why our own capture: vLLM's (enable_return_routed_experts) lives only in its V2 model runner,
which needs Triton, and the CPU backend runs the V1 runner (docs/moe.md). What both runners share
is the router: every MoE layer's router calls its `capture_fn` with the logical expert ids it
chose for the forward's tokens (vllm 0.32 fused_moe/router/base_router.py, before any expert
load-balancing remap). The recorder binds one to each MoE layer and, after each forward, files
the rows under their requests and positions from the runner's layout of that forward (request
order, query_start_loc, positions).

Rows are kept per position, the first one seen: a preempted request recomputes positions it had
already processed, and the row that counts is the one of the forward that sampled from it.
Prompt tokens served from the prefix cache run through no router, so the server turns prefix
caching off while it records (server.vllm_args). The last sampled token of a request is never fed
forward: its position has no row (nothing the trainer scores is predicted from it).
"""

from __future__ import annotations

from collections import OrderedDict
from functools import partial

import numpy as np

from rl.routing_rows import RoutingRows

# Finished requests' rows are kept until /generate takes them (right after the request ends); rows
# nobody takes (an aborted or abandoned request) are dropped oldest first past either bound: a
# Qwen3-30B-A3B row is 384 bytes, so an 8k-token request holds 3 MB.
KEEP_FINISHED = 4096
KEEP_FINISHED_BYTES = 256 * 2**20


def external_id(internal: str) -> str:
    """The id a request was made with: vLLM's internal id is it plus "-" and 8 random characters
    (v1/engine/input_processor.py assign_request_id). The recorder keys rows by it."""
    return internal[:-9]


class RoutingRecorder:
    """Binds to a vLLM model's MoE layers; fed each forward's layout by the worker extension."""

    def __init__(self, layers: list[int], top_k: int, num_experts: int):
        self.layers = layers
        self.top_k = top_k
        self.dtype = np.uint8 if num_experts <= 256 else np.uint16
        self.forward: list[np.ndarray | None] = [None] * len(layers)
        self.running: dict[str, RoutingRows] = {}
        self.finished: OrderedDict[str, RoutingRows] = OrderedDict()
        self.finished_bytes = 0

    @classmethod
    def bound_to(cls, model) -> RoutingRecorder:
        """A recorder fed by every MoE layer's router of a vLLM model."""
        from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

        runners = [m for m in model.modules() if isinstance(m, MoERunner)]
        if not runners:
            raise ValueError("inference.record_routing: the model has no mixture-of-experts layer")
        config = runners[0].moe_config
        recorder = cls(sorted({m.layer_id for m in runners}), config.experts_per_token, config.num_logical_experts)
        index = {layer: i for i, layer in enumerate(recorder.layers)}
        for m in runners:
            m.router.set_capture_fn(partial(recorder.capture, index[m.layer_id]))
        return recorder

    def describe(self) -> dict:
        return {"layers": self.layers, "top_k": self.top_k, "dtype": np.dtype(self.dtype).name}

    def capture(self, layer: int, topk_ids) -> None:
        # Copied now: the router's output buffer is reused by the next layer's forward.
        self.forward[layer] = topk_ids.to("cpu").numpy().astype(self.dtype, copy=True)

    def after_forward(self, req_ids: list[str], query_start_loc: np.ndarray, positions: np.ndarray) -> None:
        """File this forward's rows: request i's tokens are query_start_loc[i]:[i+1] of the
        forward, at the sequence positions `positions` gives them."""
        captured, self.forward = self.forward, [None] * len(self.layers)
        if any(c is None for c in captured):
            return  # a forward with no MoE layer run (none is expected; nothing half-filed)
        tokens = int(query_start_loc[len(req_ids)])
        experts = np.stack([c[:tokens] for c in captured], axis=1)  # [tokens, layers, top_k]
        for i, rid in enumerate(req_ids):
            start, end = int(query_start_loc[i]), int(query_start_loc[i + 1])
            if end > start:
                rows = self.running.get(external_id(rid))
                if rows is None:
                    rows = self.running[external_id(rid)] = RoutingRows(len(self.layers), self.top_k, self.dtype)
                rows.put(positions[start:end], experts[start:end])

    def finish(self, req_ids) -> None:
        for rid in req_ids:
            rows = self.running.pop(external_id(rid), None)
            if rows is not None:
                self.finished[external_id(rid)] = rows
                self.finished_bytes += rows.experts.nbytes
        while self.finished and (len(self.finished) > KEEP_FINISHED or self.finished_bytes > KEEP_FINISHED_BYTES):
            self.finished_bytes -= self.finished.popitem(last=False)[1].experts.nbytes

    def take(self, external_ids: list[str]) -> dict[str, dict]:
        """The rows of the engine requests made from these ids, removed from the recorder; ids with
        none are left out."""
        wanted = set(external_ids)
        out: dict[str, dict] = {}
        for external in wanted:
            rows = self.running.pop(external, None)
            if rows is None and (rows := self.finished.pop(external, None)) is not None:
                self.finished_bytes -= rows.experts.nbytes
            if rows is not None:
                out[external] = rows.encoded()
        return out


def bind(worker) -> dict:
    """Start recording in this worker (the extension's asyncrl_record_routing): bind the routers
    and wrap the model runner's execute_model, which runs one forward per call and leaves its
    layout in the runner's buffers until the next."""
    runner = worker.model_runner
    if not all(hasattr(runner, a) for a in ("input_batch", "query_start_loc", "positions")):
        raise RuntimeError(f"inference.record_routing: vLLM runs {type(runner).__module__}.{type(runner).__name__}, "
                           f"not the V1 model runner whose layout the recorder reads; unset "
                           f"VLLM_USE_V2_MODEL_RUNNER (the server sets it to 0 when recording)")
    recorder = RoutingRecorder.bound_to(runner.get_model())
    execute = runner.execute_model

    def execute_and_record(scheduler_output, *args, **kwargs):
        out = execute(scheduler_output, *args, **kwargs)
        tokens = scheduler_output.total_num_scheduled_tokens
        if tokens:
            n = runner.input_batch.num_reqs
            recorder.after_forward(list(runner.input_batch.req_ids[:n]), runner.query_start_loc.np[:n + 1].copy(),
                                   runner.positions[:tokens].to("cpu").numpy().copy())
        recorder.finish(scheduler_output.finished_req_ids)
        return out

    runner.execute_model = execute_and_record
    worker._asyncrl_routing = recorder
    return recorder.describe()
