"""Weight sync by broadcast: the contract between trainer rank 0 (the sender) and every inference
worker (the receivers). See docs/architecture.md, "Weight sync by broadcast".

    bucket planning      named tensors, in the model's order, grouped into buckets of at most
                         weight_sync.bucket_mb (a bigger tensor gets a bucket of its own)
    packing              one bucket = one flat uint8 tensor: one collective per bucket
    manifest             weights/step_n/broadcast.json: version, buckets, per tensor name, dtype,
                         shape, offset, nbytes. JSON, never pickle: receivers parse what another
                         process wrote
    the group            a stateless process group (a TCPStore hosted by trainer rank 0 at
                         weight_sync.address, and a gloo or NCCL backend built on it directly),
                         so it touches neither the trainer's FSDP group nor vLLM's own groups
    one version          header (version, bucket count, bytes, manifest digest), the buckets,
                         then an acknowledgement all-reduce: the sender returns only once every
                         receiver has loaded the weights, or fails naming who did not

Importing this module is cheap: torch is imported inside the functions that need it.

Sender and receiver halves stay in this one file (longer than most): each step of the protocol
is written once, next to its counterpart, so the two sides cannot drift apart.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import socket
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

MANIFEST = "broadcast.json"
# Written by the sender once every receiver acknowledged the version: a server asked to load a
# delivered version it does not serve has missed its broadcast and must not wait for it.
DELIVERED = "DELIVERED"
FORMAT = "asyncrl-broadcast/1"
# Tensor offsets inside a bucket are aligned so that a uint8 slice can be viewed as any dtype
# (view(dtype) needs the offset to be a multiple of the element size); 64 covers all of them.
ALIGN = 64
_MAGIC = 0x61737963726C  # "asycrl": a header that is not ours fails loudly, not as a bad version

_DTYPES = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2,
           "int8": 1, "uint8": 1, "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1}  # name -> bytes

# Store keys (under the group's prefix).
_KEY_BACKEND = "backend"
_KEY_WORLD = "world_size"


class BroadcastError(RuntimeError):
    """The broadcast group failed; the message names the address."""


class BroadcastTimeout(BroadcastError, TimeoutError):
    """A member did not show up (or did not take part) within timeouts.broadcast_s."""


# --- the manifest --------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class BucketSpec:
    nbytes: int
    tensors: tuple[TensorSpec, ...]


@dataclass(frozen=True)
class Manifest:
    version: int
    buckets: tuple[BucketSpec, ...]
    backend: str = "gloo"
    total_bytes: int = 0

    def to_json(self) -> bytes:
        data = {
            "format": FORMAT, "version": self.version, "backend": self.backend,
            "total_bytes": self.total_bytes,
            "buckets": [{"nbytes": b.nbytes, "tensors": [
                {"name": t.name, "dtype": t.dtype, "shape": list(t.shape), "offset": t.offset,
                 "nbytes": t.nbytes} for t in b.tensors]} for b in self.buckets],
        }
        return json.dumps(data, indent=1).encode()

    @classmethod
    def from_json(cls, raw: bytes | str) -> Manifest:
        """Parse and check a manifest; a malformed one is a ValueError naming the field."""
        data = json.loads(raw)
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(f"not a {FORMAT} manifest (format: {data.get('format') if isinstance(data, dict) else None!r})")
        version, backend = data.get("version"), data.get("backend")
        if not isinstance(version, int) or version < 0:
            raise ValueError(f"manifest version: {version!r} is not a version")
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"manifest backend: {backend!r} is neither gloo nor nccl")
        buckets, total, names = [], 0, set()
        for i, b in enumerate(data.get("buckets", [])):
            nbytes = b.get("nbytes")
            if not isinstance(nbytes, int) or nbytes < 0:
                raise ValueError(f"manifest bucket {i}: nbytes {nbytes!r}")
            specs = []
            for t in b.get("tensors", []):
                spec = TensorSpec(t["name"], t["dtype"], tuple(t["shape"]), t["offset"], t["nbytes"])
                if spec.dtype not in _DTYPES:
                    raise ValueError(f"manifest tensor {spec.name}: unsupported dtype {spec.dtype!r}")
                if not all(isinstance(x, int) and x >= 0 for x in (spec.offset, spec.nbytes, *spec.shape)):
                    raise ValueError(f"manifest tensor {spec.name}: bad shape/offset/nbytes")
                if spec.nbytes != math.prod(spec.shape) * _DTYPES[spec.dtype]:
                    raise ValueError(f"manifest tensor {spec.name}: {spec.nbytes} bytes do not hold "
                                     f"{spec.dtype} {list(spec.shape)}")
                if spec.offset % ALIGN or spec.offset + spec.nbytes > nbytes:
                    raise ValueError(f"manifest tensor {spec.name}: [{spec.offset}, +{spec.nbytes}) "
                                     f"is misaligned or outside bucket {i} ({nbytes} bytes)")
                if spec.name in names:
                    raise ValueError(f"manifest tensor {spec.name}: listed twice")
                names.add(spec.name)
                specs.append(spec)
            buckets.append(BucketSpec(nbytes, tuple(specs)))
            total += nbytes
        if data.get("total_bytes") != total:
            raise ValueError(f"manifest total_bytes: {data.get('total_bytes')!r}, buckets sum to {total}")
        return cls(version, tuple(buckets), backend, total)

    def digest(self) -> int:
        """63 bits of the manifest's sha256: the header carries it, so a receiver that read a
        different manifest than the one being sent fails before unpacking garbage."""
        return int.from_bytes(hashlib.sha256(self.to_json()).digest()[:8], "little") >> 1

    @property
    def names(self) -> list[str]:
        return [t.name for b in self.buckets for t in b.tensors]


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"dtype {dtype} cannot be broadcast (supported: {', '.join(_DTYPES)})")
    return name


def plan_buckets(sizes: Iterable[tuple[str, int]], bucket_bytes: int) -> list[list[str]]:
    """Names per bucket, in the given order, each bucket at most bucket_bytes (aligned sizes);
    a tensor bigger than that gets a bucket of its own.

    The order is the caller's (the model's state-dict order), not sorted by name: vLLM's
    in-place reload buffers each layer's weights until the layer is complete, so weights that
    arrive layer by layer are released bucket by bucket while they stream in."""
    buckets: list[list[str]] = [[]]
    size = 0
    for name, nbytes in sizes:
        n = _align(nbytes)
        if buckets[-1] and size + n > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(name)
        size += n
    return [b for b in buckets if b]


def make_manifest(version: int, state_dict: Mapping[str, torch.Tensor], bucket_bytes: int,
                  backend: str = "gloo") -> Manifest:
    sizes = [(name, t.numel() * t.element_size()) for name, t in state_dict.items()]
    buckets = []
    for names in plan_buckets(sizes, bucket_bytes):
        specs, offset = [], 0
        for name in names:
            t = state_dict[name]
            nbytes = t.numel() * t.element_size()
            specs.append(TensorSpec(name, dtype_name(t.dtype), tuple(t.shape), offset, nbytes))
            offset += _align(nbytes)
        # The last tensor's padding is not sent.
        last = specs[-1]
        buckets.append(BucketSpec(last.offset + last.nbytes, tuple(specs)))
    return Manifest(version, tuple(buckets), backend, sum(b.nbytes for b in buckets))


def pack_bucket(bucket: BucketSpec, state_dict: Mapping[str, torch.Tensor], device=None) -> torch.Tensor:
    """The bucket's tensors copied into one flat uint8 tensor (on `device`, default CPU)."""
    import torch

    out = torch.zeros(bucket.nbytes, dtype=torch.uint8, device=device)
    for spec in bucket.tensors:
        t = state_dict[spec.name]
        if dtype_name(t.dtype) != spec.dtype or tuple(t.shape) != spec.shape:
            raise ValueError(f"{spec.name}: {t.dtype} {tuple(t.shape)} does not match the manifest "
                             f"({spec.dtype} {spec.shape})")
        if spec.nbytes:
            out[spec.offset:spec.offset + spec.nbytes].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
    return out


def unpack_bucket(bucket: BucketSpec, buf: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) views into `buf`, with the manifest's dtype and shape (no copy)."""
    import torch

    if buf.dtype != torch.uint8 or buf.dim() != 1 or buf.numel() != bucket.nbytes:
        raise ValueError(f"bucket buffer: expected {bucket.nbytes} uint8 bytes, got {buf.dtype} {tuple(buf.shape)}")
    return [(s.name, buf[s.offset:s.offset + s.nbytes].view(getattr(torch, s.dtype)).view(s.shape))
            for s in bucket.tensors]


# --- the group -----------------------------------------------------------------------------


def parse_address(address: str) -> tuple[str, int]:
    """"host:port" (or "[v6]:port") -> (host, port); ValueError with the reason."""
    host, sep, port = address.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"{address!r} is not host:port")
    return host, int(port)


def default_backend(device) -> str:
    return "nccl" if getattr(device, "type", str(device)) == "cuda" else "gloo"


# How a broadcast group's NCCL backend must behave, and why it is set through the environment.
# ProcessGroupNCCL reads these in its constructor (torch 2.13, ProcessGroupNCCL.cpp), and its
# Options (timeout, NCCL config, stream priority, split) have no field for any of them; so they
# are set around that one constructor call (scoped_env) and put back at once: the process's own
# NCCL groups (the trainer's FSDP group, vLLM's tensor-parallel groups, made before or after)
# keep whatever the process runs with.
#   TORCH_NCCL_BLOCKING_WAIT=1        no watchdog thread for this group (torch >= 2.6); work.wait()
#                                     blocks the calling thread until the collective completed or
#                                     Options._timeout passed, and then aborts the communicator
#                                     (ncclCommAbort: the kernel queued on the stream exits) and
#                                     raises DistBackendError in that thread. By default (async error
#                                     handling 3) the watchdog would rethrow in its own thread
#                                     instead: std::terminate, the engine or trainer gone.
#   TORCH_NCCL_ASYNC_ERROR_HANDLING=2 should a torch start the watchdog anyway (before 2.6 it ran
#                                     with blocking wait too): clean up only, never tear down. Not 0:
#                                     with TORCH_NCCL_DESYNC_DEBUG or TORCH_DISTRIBUTED_DEBUG=DETAIL
#                                     torch turns 0 into 3.
#   TORCH_NCCL_ENABLE_MONITORING=0    nor its heartbeat monitor, which ends the process when the
#   TORCH_NCCL_DUMP_ON_TIMEOUT=0      watchdog stalls or a timeout asks for a flight-recorder dump.
NCCL_ENV = {
    "TORCH_NCCL_BLOCKING_WAIT": "1",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",
    "TORCH_NCCL_ENABLE_MONITORING": "0",
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
}
# One scoped change of the environment at a time (os.environ is the process's).
_ENV_LOCK = threading.Lock()
# After an abort, how long the caller's CUDA stream may take to drain (a kernel that ncclCommAbort
# ended returns in milliseconds); at most the group's own timeout.
_DRAIN_S = 10.0


def backend_env(backend: str) -> dict[str, str]:
    """The environment `backend`'s constructor must see (nothing for gloo, whose timeouts raise
    in the waiting thread on their own)."""
    return dict(NCCL_ENV) if backend == "nccl" else {}


@contextmanager
def scoped_env(env: Mapping[str, str]):
    """`env` set while the block runs, then every key put back as it was (unset if it was)."""
    with _ENV_LOCK:
        before = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            yield
        finally:
            for k, v in before.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def make_backend(store, rank: int, world_size: int, backend: str, timeout):
    """The gloo or NCCL backend on `store`; NCCL with Options._timeout (the bound of every wait,
    blocking wait enforces it) and NCCL_ENV around its constructor."""
    import torch.distributed as dist

    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world_size, timeout)
    if backend != "nccl":
        raise ValueError(f"backend {backend!r}: expected gloo or nccl")
    from torch.distributed import distributed_c10d

    nccl = getattr(distributed_c10d, "ProcessGroupNCCL", None)  # absent from CPU builds
    if nccl is None:
        raise RuntimeError("this torch has no NCCL (torch.distributed.is_nccl_available() is False)")
    options = nccl.Options()
    options._timeout = timeout
    with scoped_env(backend_env("nccl")):
        return nccl(store, rank, world_size, options)


def _bounded(fn, seconds: float, name: str) -> tuple[bool, BaseException | None]:
    """Run fn in a daemon thread for at most `seconds`: (True, None) if it returned, (True, e) if
    it raised e, (False, None) if it still runs. For the calls that take no timeout (NCCL's
    communicator set-up, abort, shutdown); one that never returns is left behind, not waited on."""
    box: dict = {}

    def run():
        try:
            fn()
        except BaseException as e:  # handed to the caller
            box["error"] = e

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    thread.join(seconds)
    return not thread.is_alive(), box.get("error")


def _drained(query, seconds: float, poll_s: float = 0.005) -> bool:
    """Whether query() (a CUDA stream's: no work left) turns true within `seconds`."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            if query():
                return True
        except RuntimeError:  # a CUDA error: the stream is not usable either
            return False
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)


class Group:
    """A gloo or NCCL backend on its own TCPStore: no default process group involved, so the
    trainer's FSDP group and vLLM's groups never see it, and every call takes its own timeout.
    Rank 0 is the sender.

    Every wait is bounded by timeout_s and a failure raises in the calling thread (for NCCL:
    NCCL_ENV). A failed collective leaves the members out of step, so the group is then broken
    for good: it is aborted (no NCCL kernel stays queued on the caller's stream) and every later
    call raises at once, saying why."""

    def __init__(self, store, rank: int, world_size: int, backend: str, device, address: str,
                 timeout_s: float):
        import datetime

        import torch
        import torch.distributed as dist

        self.store, self.rank, self.world_size = store, rank, world_size
        self.backend_name, self.address, self.timeout_s = backend, address, timeout_s
        self.device = torch.device(device)
        self.pg, self.broken = None, ""
        timeout = datetime.timedelta(seconds=timeout_s)
        start = time.monotonic()
        try:
            # Every receiver registered (join_group) before any backend connects: NCCL's
            # communicator set-up has no timeout of its own, a member that never came would hang it.
            store.wait([f"asyncrl/member/{r}" for r in range(1, world_size)], timeout)
            # Prefixed: the store also carries our own keys (backend, world size, members).
            self.pg = make_backend(dist.PrefixStore("asyncrl/pg", store), rank, world_size, backend, timeout)
        except (RuntimeError, TimeoutError) as e:
            raise self._formation_error(e, start) from None
        if backend == "nccl":
            # Connect now, not at the first broadcast: a missing member shows at start-up. In a
            # thread: ncclCommInitRank waits for every member without a timeout.
            done, error = _bounded(lambda: self.pg.eager_connect_single_device(self.device), timeout_s,
                                   "asyncrl-nccl-connect")
            if not done or error is not None:
                self.broken = "the NCCL communicator was never set up"
                self._abort()
                raise self._formation_error(error or TimeoutError(
                    f"the NCCL communicator was not up within {timeout_s:g} s"), start)

    def _peers(self) -> str:
        """Who this member waits on: the trainer for a receiver, every receiver for the sender."""
        if self.rank != 0:
            return f"the trainer (rank 0, hosting {self.address})"
        return ", ".join(f"rank {r} ({self.member(r)})" for r in range(1, self.world_size)) or "no receiver"

    def _error(self, what: str, e: BaseException, start: float) -> BroadcastError:
        waited = time.monotonic() - start
        text = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
        cls = BroadcastTimeout if ("timeout" in text.lower() or "timed out" in text.lower()
                                   or waited >= self.timeout_s * 0.95) else BroadcastError
        return cls(f"weight broadcast group at {self.address} (rank {self.rank} of {self.world_size}, "
                   f"{self.backend_name}): {what} failed after {waited:.1f} s "
                   f"(timeouts.broadcast_s = {self.timeout_s:g}) with {self._peers()}: {text}")

    def _formation_error(self, e: BaseException, start: float) -> BroadcastError:
        err = self._error("forming the group", e, start)
        try:
            missing = [r for r in range(1, self.world_size) if not self.store.check([f"asyncrl/member/{r}"])]
        except RuntimeError:  # the store is gone (the trainer died): nothing more to say
            return err
        return type(err)(f"{err}; ranks that never joined: {missing or 'none'}")

    def _abort(self) -> bool:
        """Abort the backend (NCCL: every communicator of the group, ending its kernels), bounded."""
        if self.pg is None or not hasattr(self.pg, "abort"):
            return True
        done, error = _bounded(self.pg.abort, self.timeout_s, "asyncrl-abort")
        return done and error is None

    def _device_idle(self) -> bool:
        """After an abort: whether the caller's CUDA stream drained (a kernel still queued there
        would hang the engine's next step). Always true off CUDA."""
        if self.device.type != "cuda":
            return True
        import torch

        return _drained(torch.cuda.current_stream(self.device).query, min(_DRAIN_S, self.timeout_s))

    def _fail(self, what: str, e: BaseException, start: float) -> BroadcastError:
        """The error for a failed collective; marks the group broken and aborts it first."""
        err = self._error(what, e, start)
        self.broken = str(err)
        notes = []
        if not self._abort():
            notes.append(f"aborting the group did not finish within {self.timeout_s:g} s")
        if not self._device_idle():
            notes.append("this process's CUDA stream is still blocked after the abort: restart it")
        return type(err)("; ".join([str(err), *notes]))

    def _usable(self, what: str) -> None:
        if self.broken or self.pg is None:
            why = f"it broke earlier and was aborted ({self.broken})" if self.broken else "it is closed"
            raise BroadcastError(f"weight broadcast group at {self.address} (rank {self.rank} of "
                                 f"{self.world_size}, {self.backend_name}): {what} not attempted: {why}; "
                                 "restart the servers and the trainer")

    def _wait(self, work, what: str, start: float) -> None:
        import datetime

        import torch

        try:
            # NCCL (blocking wait) and gloo both raise here once timeout_s has passed; a False
            # (what Work.wait may return) is taken as the same.
            if work.wait(datetime.timedelta(seconds=self.timeout_s)) is False:
                raise TimeoutError(f"the collective did not complete within {self.timeout_s:g} s")
            if self.device.type == "cuda":
                # The NCCL kernel has completed (blocking wait); the caller's stream only waits on
                # its end event, which fired: the bytes are there after this.
                torch.cuda.current_stream(self.device).synchronize()
        except (RuntimeError, TimeoutError) as e:
            raise self._fail(what, e, start) from None

    def broadcast(self, tensor: torch.Tensor, what: str) -> None:
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        self._collective("broadcast", tensor, opts, what)

    def all_reduce_sum(self, tensor: torch.Tensor, what: str) -> None:
        import torch.distributed as dist

        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM
        self._collective("allreduce", tensor, opts, what)

    def _collective(self, name: str, tensor: torch.Tensor, opts, what: str) -> None:
        """Issue one collective with this group's timeout and wait for it, errors named."""
        import datetime

        self._usable(what)
        opts.timeout = datetime.timedelta(seconds=self.timeout_s)
        start = time.monotonic()
        try:
            work = getattr(self.pg, name)([tensor], opts)
        except (RuntimeError, TimeoutError) as e:
            raise self._fail(what, e, start) from None
        self._wait(work, what, start)

    def member(self, rank: int) -> str:
        """Who joined as `rank` (what the receiver registered), for error messages."""
        try:
            if self.store is not None and self.store.check([f"asyncrl/member/{rank}"]):
                return self.store.get(f"asyncrl/member/{rank}").decode()
        except RuntimeError:
            pass
        return "?"

    def close(self) -> None:
        """Shut a healthy group down, bounded (NCCL's shutdown flushes pending work); a broken
        one was aborted when it broke."""
        pg, self.pg = getattr(self, "pg", None), None
        if pg is not None and not self.broken and hasattr(pg, "shutdown"):
            _bounded(pg.shutdown, self.timeout_s, "asyncrl-shutdown")
        self.store = None


def _timeout_error(address: str, what: str, timeout_s: float, e: BaseException) -> BroadcastTimeout:
    return BroadcastTimeout(f"weight broadcast group at {address}: {what} within {timeout_s:g} s "
                            f"(timeouts.broadcast_s): {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")


def host_group(address: str, timeout_s: float, device) -> Group:
    """Sender side (trainer rank 0): host the store at `address`, wait for the receivers to say
    how many they are (every receiver writes the same world size, given by the orchestrator),
    then form the group with them (its error names the ranks that never joined)."""
    import datetime

    import torch.distributed as dist

    host, port = parse_address(address)
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        store = dist.TCPStore(host, port, None, True, timeout, wait_for_workers=False)
    except (RuntimeError, OSError) as e:
        raise BroadcastError(f"weight broadcast group at {address}: cannot host the rendezvous store "
                             f"(weight_sync.address): {e}") from None
    backend = default_backend(device)
    store.set(f"asyncrl/{_KEY_BACKEND}", backend)
    try:
        store.wait([f"asyncrl/{_KEY_WORLD}"], timeout)
    except (RuntimeError, TimeoutError) as e:
        raise _timeout_error(address, "no inference worker joined (the orchestrator posts /init_broadcaster "
                                      "to every server once they are healthy)", timeout_s, e) from None
    world_size = int(store.get(f"asyncrl/{_KEY_WORLD}"))
    return Group(store, 0, world_size, backend, device, address, timeout_s)


def join_group(address: str, rank: int, world_size: int, timeout_s: float, device, who: str = "") -> Group:
    """Receiver side (one inference worker): connect to the sender's store, register, check the
    world size agrees with the other receivers and the backend suits this device, form the group."""
    import datetime

    import torch.distributed as dist

    host, port = parse_address(address)
    if not 1 <= rank < world_size:
        raise ValueError(f"rank {rank} outside 1..{world_size - 1} (rank 0 is the trainer)")
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        # Waits up to timeout for the trainer to host the store.
        store = dist.TCPStore(host, port, None, False, timeout)
        store.wait([f"asyncrl/{_KEY_BACKEND}"], timeout)
    except (RuntimeError, TimeoutError) as e:
        raise _timeout_error(address, "the trainer's rendezvous store did not answer", timeout_s, e) from None
    agreed = store.compare_set(f"asyncrl/{_KEY_WORLD}", "", str(world_size)).decode()
    if agreed != str(world_size):
        raise BroadcastError(f"weight broadcast group at {address}: this worker was told world size "
                             f"{world_size}, another member {agreed}")
    backend = store.get(f"asyncrl/{_KEY_BACKEND}").decode()
    mine = default_backend(device)
    if backend != mine:
        raise BroadcastError(f"weight broadcast group at {address}: the trainer broadcasts with {backend}, "
                             f"this worker's device ({device}) needs {mine}")
    store.set(f"asyncrl/member/{rank}", who or f"{socket.gethostname()} pid {os.getpid()}")
    return Group(store, rank, world_size, backend, device, address, timeout_s)


# --- one version over the group ------------------------------------------------------------


def _header(manifest: Manifest):
    import torch

    return torch.tensor([_MAGIC, manifest.version, len(manifest.buckets), manifest.total_bytes,
                         manifest.digest()], dtype=torch.int64)


def send_version(group: Group, manifest: Manifest, state_dict: Mapping[str, torch.Tensor]) -> None:
    """Sender: header, buckets, then the acknowledgement; raises naming every receiver that did
    not load the version."""
    import torch

    v = manifest.version
    group.broadcast(_header(manifest).to(group.device), f"header of version {v}")
    for i, bucket in enumerate(manifest.buckets):
        group.broadcast(pack_bucket(bucket, state_dict, group.device),
                        f"bucket {i + 1}/{len(manifest.buckets)} of version {v}")
    status = torch.zeros(group.world_size, dtype=torch.int32, device=group.device)
    status[0] = 1
    group.all_reduce_sum(status, f"acknowledgement of version {v} (a receiver did not take part)")
    failed = [r for r, s in enumerate(status.tolist()) if s != 1]
    if failed:
        raise BroadcastError(f"weight broadcast group at {group.address}: version {v} failed to load on "
                             + ", ".join(f"rank {r} ({group.member(r)})" for r in failed))


class Incoming:
    """Receiver: one version arriving bucket by bucket. `tensors()` yields (name, view) pairs,
    receiving each bucket only when the consumer reaches it, into a buffer of its own (the
    consumer may keep views until it is done: vLLM's reload buffers a layer's weights until the
    layer is complete). `finish(ok)` receives what the consumer did not take, so the collective
    sequence stays aligned with the sender even after a failed load, then acknowledges."""

    def __init__(self, group: Group, manifest: Manifest):
        import torch

        self.group, self.manifest = group, manifest
        self.received = 0
        # Counted from what the collectives filled, not from the manifest: what a receiver says
        # it received (tests/rl/test_weight_delta_broadcast.py compares a delta's with a full one's).
        self.received_bytes = 0
        header = torch.zeros(5, dtype=torch.int64, device=group.device)
        group.broadcast(header, f"header of version {manifest.version}")
        got, want = header.tolist(), _header(manifest).tolist()
        if got != want:
            raise BroadcastError(
                f"weight broadcast group at {group.address}: expected version {manifest.version} "
                f"({len(manifest.buckets)} buckets, {manifest.total_bytes} bytes), the trainer sends "
                f"version {got[1]} ({got[2]} buckets, {got[3]} bytes{', another manifest' if got[1:4] == want[1:4] else ''}); "
                "the group is out of step and must be rebuilt (restart the servers and the trainer)")

    def _next(self) -> list[tuple[str, torch.Tensor]]:
        import torch

        i = self.received
        bucket = self.manifest.buckets[i]
        buf = torch.empty(bucket.nbytes, dtype=torch.uint8, device=self.group.device)
        self.group.broadcast(buf, f"bucket {i + 1}/{len(self.manifest.buckets)} of version {self.manifest.version}")
        self.received += 1
        self.received_bytes += buf.numel() * buf.element_size()
        return unpack_bucket(bucket, buf)

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        while self.received < len(self.manifest.buckets):
            yield from self._next()

    def finish(self, ok: bool) -> None:
        import torch

        while self.received < len(self.manifest.buckets):
            self._next()
        status = torch.zeros(self.group.world_size, dtype=torch.int32, device=self.group.device)
        status[self.group.rank] = 1 if ok else 2
        self.group.all_reduce_sum(status, f"acknowledgement of version {self.manifest.version}")


def read_manifest(directory) -> Manifest:
    from pathlib import Path

    return Manifest.from_json((Path(directory) / MANIFEST).read_bytes())

