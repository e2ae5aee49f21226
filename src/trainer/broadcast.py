"""Publishing weights by broadcast (`[weight_sync] kind = "broadcast"`), trainer rank 0 only.

Step n: weights/step_n/broadcast.json (the manifest: which tensor lies where in which bucket),
then STABLE, then the buckets over the group (rl/weights/broadcast.py). STABLE is what makes the
orchestrator POST /update_weights to every server, and each server's workers then join this
broadcast; so the same STABLE / notify handshake as for files orders it, and publish() returns
once every inference worker has loaded version n (DELIVERED is then written). The directory
holds no tensors, so keeping or pruning it costs nothing.

With weight_sync.delta (trainer/deltas.py): a full version's directory also holds digest.json;
a delta's holds delta.json, and its buckets carry only the changed values and their indices
(rl/weights/delta.py), which each worker applies to the full version it kept from the broadcast.
"""

from __future__ import annotations

import logging
import time

import torch

from rl.weights import broadcast as bc
from rl.weights import delta as wd
from rl.config import RunConfig
from rl.rundir import RunDir, mark_stable, remove_quietly, write_file_atomic
from trainer.weights import prune_weights

log = logging.getLogger("trainer")


class WeightBroadcaster:
    def __init__(self, cfg: RunConfig, run: RunDir, tied: bool, device: torch.device | None = None):
        """Host the group's store and wait (up to timeouts.broadcast_s) for every inference
        worker to join."""
        ws = cfg.weight_sync
        self.run, self.tied, self.keep = run, tied, cfg.trainer.files.keep_weights
        self.bucket_bytes = ws.bucket_mb << 20
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        start = time.perf_counter()
        log.info("weight broadcast: hosting the group at %s, waiting for the inference workers", ws.address)
        self.group = bc.host_group(ws.address, cfg.timeouts.broadcast_s, device)
        log.info("weight broadcast: %d inference worker(s) joined over %s in %.1f s", self.group.world_size - 1,
                 self.group.backend_name, time.perf_counter() - start)

    def publish(self, step: int, state_dict: dict[str, torch.Tensor], digest: wd.Digest | None = None) -> float:
        """Make version `step` serve on every inference worker; returns seconds taken. With
        `digest` (weight_sync.delta) the directory carries it: later deltas name this version."""
        if self.tied:
            # As for files (trainer/weights.py): vLLM ties lm_head to the embedding itself.
            state_dict = {k: v for k, v in state_dict.items() if k != "lm_head.weight"}
        extra = {} if digest is None else {wd.DIGEST: digest.to_json()}
        return self._send(step, state_dict, extra, "")

    def publish_delta(self, step: int, manifest: wd.Manifest, changes: dict[str, torch.Tensor]) -> float:
        """Version `step` as a delta: only the changed values and their indices go over the wire
        (the buckets hold `changes`); each worker rebuilds the version from the full version it
        keeps (inference/worker_extension.py). Returns seconds taken."""
        return self._send(step, changes, {wd.MANIFEST: manifest.to_json()},
                          f" as a delta against version {manifest.base_version} ({manifest.changed} values)")

    def _send(self, step: int, tensors: dict[str, torch.Tensor], files: dict[str, bytes], what: str) -> float:
        start = time.perf_counter()
        manifest = bc.make_manifest(step, tensors, self.bucket_bytes, self.group.backend_name)
        out = self.run.weights_dir(step)
        remove_quietly(out)  # a partial directory from a crash has no STABLE; start it over
        out.mkdir(parents=True)
        for name, data in files.items():
            write_file_atomic(out / name, data)
        write_file_atomic(out / bc.MANIFEST, manifest.to_json())
        mark_stable(out)
        bc.send_version(self.group, manifest, tensors)
        write_file_atomic(out / bc.DELIVERED, b"")
        # Each publisher prunes what it wrote itself (trainer/publish.py).
        prune_weights(self.run, self.keep)
        seconds = time.perf_counter() - start
        log.info("weight broadcast: version %d%s (%d buckets, %.1f MB) loaded on %d worker(s) in %.2f s", step, what,
                 len(manifest.buckets), manifest.total_bytes / 2**20, self.group.world_size - 1, seconds)
        return seconds

    def close(self) -> None:
        group, self.group = getattr(self, "group", None), None
        if group is not None:
            group.close()
