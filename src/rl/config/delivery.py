"""`[transport]` (how batches reach the trainer) and `[weight_sync]` (how weights reach the
servers). Each is one of its kinds, a table of its own (a pydantic discriminated union on `kind`):
a key one kind alone reads (transport.address, weight_sync.bucket_mb) exists only in that kind's
table, so setting it for another kind is refused (rl/config/load.py names the kind it needs).
A table written without `kind` is the first kind ("files")."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BeforeValidator, Field, field_validator

from rl.addresses import HostPort, ZmqEndpoint, check_zmq_endpoint
from rl.config.section import Section


class FilesTransport(Section):
    kind: Literal["files"] = "files"
    """How batches reach the trainer: "files", rollouts/step_n in the run directory; or "zmq",
    ZMQ PUSH/PULL (its own keys: address, bind)."""


class ZmqTransport(Section):
    kind: Literal["zmq"] = "zmq"
    """How batches reach the trainer: ZMQ PUSH/PULL (see [transport] kind = "files")."""

    address: ZmqEndpoint = "tcp://127.0.0.1:5557"
    """ZMQ address the orchestrator connects to, and the trainer binds unless `bind` is set
    (tcp://host:port or ipc:///path)."""

    bind: str = ""
    """ZMQ address trainer rank 0 binds when it differs from `address`, e.g. tcp://*:5557 when
    the orchestrator runs on another host. Empty: address."""

    @field_validator("bind")
    @classmethod
    def _bind_form(cls, bind: str) -> str:
        return check_zmq_endpoint(bind) if bind else bind


class _WeightSyncCommon(Section):
    delta: bool = False
    """Publish each version as the values that changed since the last full version (bit for bit;
    docs/weight_deltas.md) instead of the whole model: written to weights/step_n/delta.safetensors,
    or with kind "broadcast" only the changed values sent. Servers keep that full version in host
    memory (one more copy of the weights) and rebuild each version from it, checked against the
    version's checksum. Full weights only (not with trainer.lora.rank > 0)."""

    full_every: int = Field(8, ge=1)
    """With delta: a full version every this many versions (a delta grows with the distance from
    its base), and always the first one a trainer publishes (after a restart too)."""


class FilesWeightSync(_WeightSyncCommon):
    kind: Literal["files"] = "files"
    """"files": the trainer writes weights/step_n and every server reloads from it. "broadcast":
    trainer rank 0 streams the weights to every inference worker over a collective (NCCL on GPU,
    gloo on CPU); weights/step_n then holds only the bucket manifest + STABLE (its own keys:
    address, bucket_mb; its bound: timeouts.broadcast_s)."""


class BroadcastWeightSync(_WeightSyncCommon):
    kind: Literal["broadcast"] = "broadcast"
    """Weights streamed from trainer rank 0 to every inference worker (see [weight_sync] kind =
    "files")."""

    address: HostPort = "127.0.0.1:29710"
    """host:port where trainer rank 0 hosts the broadcast group's rendezvous store; servers
    must reach it."""

    bucket_mb: int = Field(256, ge=1)
    """Weights travel in packed buckets of at most this size (MiB)."""


def _files_unless_named(table: Any) -> Any:
    """A table without `kind` is the "files" kind (the default)."""
    return {"kind": "files", **table} if isinstance(table, dict) and "kind" not in table else table


TransportConfig = Annotated[Union[FilesTransport, ZmqTransport], Field(discriminator="kind"),
                            BeforeValidator(_files_unless_named)]
WeightSyncConfig = Annotated[Union[FilesWeightSync, BroadcastWeightSync], Field(discriminator="kind"),
                             BeforeValidator(_files_unless_named)]

# Each table's kinds, by `kind`: which kind a key belongs to (rl/config/load.py, the docs).
KINDS = {"transport": {"files": FilesTransport, "zmq": ZmqTransport},
         "weight_sync": {"files": FilesWeightSync, "broadcast": BroadcastWeightSync}}
