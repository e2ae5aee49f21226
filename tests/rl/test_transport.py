"""Batches over ZMQ: the same payload as the run directory, checked the same way, and a real
2-rank trainer fed over ZMQ ends with exactly the weights it reaches when fed from files."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading

import pytest
import zmq
from safetensors.torch import load_file

from conftest import TINY_MODEL, free_port
from rl.batch import Batch, BatchError
from rl.config import FilesTransport, TransportConfig, ZmqTransport
from rl.rundir import RunDir
from rl.transport.registry import batch_receiver, batch_sender
from trainer_runs import write_batches
from samples import single_turn, write_batch

pytestmark = pytest.mark.slow


def batch(step: int) -> Batch:
    return Batch.from_samples(step, [
        single_turn([5, 6], [7, 8], [-0.5, -0.25], [step - 1, step - 1], reward=1.0, advantage=0.5),
        single_turn([5], [9], [-1.0], [step - 1], reward=0.0, advantage=-0.5)])


def send_all(cfg: TransportConfig, run: RunDir, batches: list[Batch]) -> None:
    async def go():
        sender = batch_sender(cfg, run)
        try:
            for b in batches:
                await sender.send(b, timeout_s=30)
        finally:
            sender.close()
    asyncio.run(go())


@pytest.mark.parametrize("address", ["ipc", "tcp"])
def test_batches_arrive_whole_and_in_step_order(tmp_path, address):
    addr = f"ipc://{tmp_path}/batches.sock" if address == "ipc" else f"tcp://127.0.0.1:{free_port()}"
    cfg = ZmqTransport(address=addr)
    run = RunDir(tmp_path)
    receiver = batch_receiver(cfg, run)
    try:
        # Sent out of order: the receiver holds batch 3 until 2 has been asked for.
        sender = threading.Thread(target=send_all, args=(cfg, run, [batch(1), batch(3), batch(2)]))
        sender.start()
        got = []
        for step in (1, 2, 3):
            got.append(receiver.receive(step, timeout_s=30).batch)
        sender.join()
    finally:
        receiver.close()
    assert [b.step for b in got] == [1, 2, 3]
    assert got[1].token_versions.tolist() == [-1, -1, 1, 1, -1, 1]
    assert not list(run.rollouts.glob("*"))  # nothing went through the filesystem


def test_a_foreign_or_corrupt_message_is_dropped_naming_the_address(tmp_path, caplog):
    """Anyone who can reach the socket can send anything: garbage is logged and dropped, never
    decoded as code, and the trainer goes on waiting for the real batch."""
    addr = f"ipc://{tmp_path}/b.sock"
    cfg = ZmqTransport(address=addr)
    receiver = batch_receiver(cfg, RunDir(tmp_path))
    push = zmq.Context.instance().socket(zmq.PUSH)
    push.connect(addr)
    try:
        push.send_multipart([b"hello", b"world"])
        meta, payload = batch(1).encode()
        push.send_multipart([b"asyncrl.batch", meta, payload[:-1] + b"x"])
        push.send_multipart([b"asyncrl.batch", meta, payload])
        with caplog.at_level("ERROR", logger="transport"):
            assert receiver.receive(1, timeout_s=10).batch.step == 1
    finally:
        push.close(linger=0)
        receiver.close()
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert any(f"{addr}: a message that is not an asyncrl batch" in e for e in errors), errors
    assert any("checksum mismatch" in e for e in errors), errors


def test_receiver_times_out_with_a_clear_message(tmp_path):
    cfg = ZmqTransport(address=f"ipc://{tmp_path}/c.sock")
    receiver = batch_receiver(cfg, RunDir(tmp_path))
    try:
        with pytest.raises(TimeoutError, match="no batch 1 at ipc://.*trainer.timeouts.batch_s"):
            receiver.receive(1, timeout_s=0.3)
    finally:
        receiver.close()


def test_two_rank_trainer_over_zmq_matches_the_filesystem_run(tmp_path, write_toml):
    source = RunDir(tmp_path / "source")
    write_batches(source, [1, 2])
    batches = [Batch.read(source.rollout_dir(n)) for n in (1, 2)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    finals = {}
    for kind in ("files", "zmq"):
        run = RunDir(tmp_path / kind)
        address = f"tcp://127.0.0.1:{free_port()}"
        cfg = write_toml(f'model = "{TINY_MODEL}"\noutput_dir = "{run.root}"\nmax_steps = 2\nseed = 3\n'
                         f'[transport]\nkind = "{kind}"\n' + (f'address = "{address}"\n' if kind == "zmq" else "") +
                         "[trainer.batching]\nmicro_batch_size = 2\n[trainer.optim]\nlr = 1e-4\n", f"{kind}.toml")
        if kind == "files":
            for b in batches:
                write_batch(b, run.rollout_dir(b.step))
        trainer = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                                    "--master-port", str(free_port()), "-m", "trainer", "@", str(cfg)],
                                   env=env, stderr=subprocess.PIPE, text=True)
        if kind == "zmq":
            send_all(ZmqTransport(address=address), run, batches)
        _, err = trainer.communicate(timeout=300)
        assert trainer.returncode == 0, err[-3000:]
        finals[kind] = load_file(run.weights_dir(2) / "model.safetensors")
    assert finals["zmq"].keys() == finals["files"].keys()
    for name, tensor in finals["zmq"].items():
        assert (tensor == finals["files"][name]).all(), name
    # With trainer checkpoints on (the default), rank 0 keeps what it received for a resume.
    assert RunDir(tmp_path / "zmq").rollout_steps() == [1, 2]


def test_zmq_receiver_keeps_batches_for_a_resumed_trainer(tmp_path):
    """A trainer resumed from an older checkpoint needs batches the orchestrator sent long ago:
    with keep, every batch received is written to rollouts/step_n and read from there first."""
    run = RunDir(tmp_path / "run")
    cfg = ZmqTransport(address=f"ipc://{tmp_path}/batches.sock")
    receiver = batch_receiver(cfg, run, keep=True)
    try:
        sender = threading.Thread(target=send_all, args=(cfg, run, [batch(1), batch(3), batch(2)]))
        sender.start()
        for n in (1, 2):
            assert receiver.receive(n, timeout_s=30).batch.step == n
        sender.join()
    finally:
        receiver.close()
    # Batch 3 arrived while the trainer still wanted 2: it was written to disk on arrival.
    assert run.rollout_steps() == [1, 2, 3]
    # The trainer dies and resumes from a checkpoint at step 1: nobody sends 2 and 3 again.
    again = batch_receiver(cfg, run, keep=True)
    try:
        for n in (2, 3):
            assert again.receive(n, timeout_s=5).batch.step == n
    finally:
        again.close()


def test_a_damaged_batch_file_is_set_aside_and_written_again_by_the_sender(tmp_path):
    """Filesystem: the trainer moves a damaged batch to rollouts/rejected/ with the reason and
    keeps waiting; the orchestrator still holds every batch whose version is not published and
    writes it again; the trainer then trains on the intact one."""
    run = RunDir(tmp_path)
    run.make()
    cfg = FilesTransport()
    sent = batch(1)

    async def scenario():
        sender = batch_sender(cfg, run)
        await sender.send(sent, timeout_s=5)
        data = run.rollout_dir(1) / "batch.safetensors"
        data.write_bytes(data.read_bytes()[:-10])  # truncated on the way to disk
        receiver = batch_receiver(cfg, run, poll_s=0.01)
        got = asyncio.create_task(asyncio.to_thread(receiver.receive, 1, 10))
        while not got.done():
            await sender.resend_rejected()
            await asyncio.sleep(0.05)
        sender.forget(trained=1)  # version 1 published: nothing left to keep
        return got.result(), sender.unconsumed

    received, unconsumed = asyncio.run(scenario())
    assert received.batch.tokens.tolist() == sent.tokens.tolist()
    assert unconsumed == {}
    (rejected,) = (run.rollouts / "rejected").iterdir()
    assert rejected.name == "step_1.1"
    assert "checksum mismatch" in (rejected / "REJECTED").read_text()
    assert run.rollout_steps() == [1]


def test_without_reject_a_damaged_batch_file_raises_naming_it(tmp_path):
    run = RunDir(tmp_path)
    write_batch(batch(1), run.rollout_dir(1))
    (run.rollout_dir(1) / "meta.json").write_text("{")
    with pytest.raises(BatchError, match=r"rollouts/step_1/meta.json: not valid JSON"):
        batch_receiver(FilesTransport(), run, reject_damaged=False).receive(1, 5)


def test_a_dropped_connection_is_reported_and_untrained_batches_go_again(tmp_path, caplog):
    """The trainer's end of the connection goes (its process, or its host's link: ZMTP
    heartbeats drop a silent connection): the orchestrator says so, and once a trainer is
    there again it gets every batch whose version is not published yet, since one in transit
    went down with the connection."""
    cfg = ZmqTransport(address=f"tcp://127.0.0.1:{free_port()}")
    run = RunDir(tmp_path)

    async def main():
        sender = batch_sender(cfg, run)
        watcher = asyncio.create_task(sender.watch_connection(timeout_s=30))
        receiver = batch_receiver(cfg, run)
        try:
            await sender.send(batch(1), timeout_s=30)
            await sender.send(batch(2), timeout_s=30)
            first = await asyncio.to_thread(receiver.receive, 1, 30)
            sender.forget(1)  # version 1 published: batch 1 is trained for good
            receiver.close()  # gone before batch 2 was taken
            # The next trainer connects once the orchestrator noticed (the order the test is
            # about), however long a loaded machine takes to say so (capped only against a hang).
            async def noticed() -> None:
                while "lost the connection to the trainer" not in caplog.text:
                    await asyncio.sleep(0.05)
            await asyncio.wait_for(noticed(), 120)
            again = batch_receiver(cfg, run)
            try:
                second = await asyncio.to_thread(again.receive, 2, 30)
            finally:
                again.close()
            return first.batch.step, second.batch.step
        finally:
            watcher.cancel()
            sender.close()

    with caplog.at_level("INFO"):
        assert asyncio.run(main()) == (1, 2)
    assert f"lost the connection to the trainer at {cfg.address}" in caplog.text
    assert "batch 2 sent again" in caplog.text and "batch 1 sent again" not in caplog.text
