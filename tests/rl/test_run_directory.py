"""Atomic batch files with checksums, and STABLE as the only signal that weights are complete."""

from __future__ import annotations

import pytest

from rl.batch import Batch, BatchError
from rl.rundir import RunDir, mark_stable, write_file_atomic
from samples import single_turn, write_batch


def make_batch(step: int = 1) -> Batch:
    samples = [
        single_turn([5, 6, 7], [8, 9], [-0.5, -1.5], [0, 0], reward=0.75, advantage=0.25),
        # An in-flight weight update landed after its first token: versions 1 then 2.
        single_turn([5], [8, 9, 10], [-0.1, -0.2, -0.3], [1, 2, 2], reward=0.25, advantage=-0.25,
                           temperature=0.7, top_p=0.9, top_k=20, min_p=0.05),
    ]
    return Batch.from_samples(step, samples)


def test_batch_round_trip(tmp_path):
    write_batch(make_batch(3), tmp_path / "step_3")
    b = Batch.read(tmp_path / "step_3")
    assert (b.step, b.num_samples) == (3, 2)
    # How each sample was drawn: the defaults, and a dataset's own settings.
    assert b.temperatures.tolist() == pytest.approx([1.0, 0.7])
    assert (b.top_p.tolist(), b.top_k.tolist(), b.min_p.tolist()) == (pytest.approx([1.0, 0.9]), [-1, 20],
                                                                     pytest.approx([0.0, 0.05]))
    assert b.tokens.tolist() == [5, 6, 7, 8, 9, 5, 8, 9, 10]
    assert b.loss_mask.tolist() == [0, 0, 0, 1, 1, 0, 1, 1, 1]
    assert b.logprobs.tolist() == pytest.approx([0, 0, 0, -0.5, -1.5, 0, -0.1, -0.2, -0.3])
    assert b.advantages.tolist() == [0, 0, 0, 0.25, 0.25, 0, -0.25, -0.25, -0.25]
    assert b.token_versions.tolist() == [-1, -1, -1, 0, 0, -1, 1, 2, 2]
    assert b.versions.tolist() == [0, 1]  # the oldest token of each sample
    assert [b.tokens[s].tolist() for s in b.sample_slices()] == [[5, 6, 7, 8, 9], [5, 8, 9, 10]]


def test_batch_write_leaves_no_partial_directory(tmp_path):
    write_batch(make_batch(), tmp_path / "step_1")
    assert [p.name for p in tmp_path.iterdir()] == ["step_1"]  # the temporary name is gone
    assert sorted(p.name for p in (tmp_path / "step_1").iterdir()) == ["batch.safetensors", "meta.json"]


@pytest.mark.parametrize("damage", ["truncate", "flip", "remove"])
def test_damaged_batch_is_refused_naming_the_file(tmp_path, damage):
    write_batch(make_batch(), tmp_path / "step_1")
    data = tmp_path / "step_1" / "batch.safetensors"
    raw = data.read_bytes()
    if damage == "truncate":
        data.write_bytes(raw[: len(raw) // 2])
    elif damage == "flip":
        data.write_bytes(raw[:-1] + bytes([raw[-1] ^ 0xFF]))
    else:
        data.unlink()
    with pytest.raises(BatchError, match="batch.safetensors"):
        Batch.read(tmp_path / "step_1")


def test_only_stable_weights_count(tmp_path):
    run = RunDir(tmp_path)
    run.make()
    for n in (1, 2, 3):
        run.weights_dir(n).mkdir()
        write_file_atomic(run.weights_dir(n) / "model.safetensors", b"x")
    assert run.latest_stable_weights() is None
    mark_stable(run.weights_dir(1))
    mark_stable(run.weights_dir(2))
    assert run.latest_stable_weights() == 2  # step_3 is still being written


def test_atomic_write_replaces_whole_file(tmp_path):
    target = tmp_path / "f"
    write_file_atomic(target, b"old")
    write_file_atomic(target, b"new contents")
    assert target.read_bytes() == b"new contents"
    assert [p.name for p in tmp_path.iterdir()] == ["f"]


def test_a_checkpoint_step_directory_goes_with_its_last_part(tmp_path):
    run = RunDir(tmp_path)
    for program in ("orchestrator", "trainer"):
        (run.checkpoint_dir(7) / program).mkdir(parents=True)
        (run.checkpoint_dir(7) / program / "STABLE").write_bytes(b"")
    run.remove_checkpoint(7, "orchestrator")
    assert run.checkpoint_steps("trainer") == [7] and run.checkpoint_steps("orchestrator") == []
    run.remove_checkpoint(7, "trainer")
    assert not run.checkpoint_dir(7).exists()


def _encoded_with(**changes) -> tuple[bytes, bytes]:
    """A batch whose fields were tampered with after it was made, re-encoded with a valid
    checksum: what a buggy or hostile writer could produce."""
    b = make_batch()
    for name, value in changes.items():
        setattr(b, name, value)
    return b.encode()


@pytest.mark.parametrize("change, message", [
    (lambda b: {"advantages": b.advantages * float("nan")}, "'advantages' holds NaN"),
    (lambda b: {"rewards": b.rewards[:1]}, "'rewards' has 1 values, expected 2"),
    (lambda b: {"logprobs": b.logprobs.astype("float64")}, "'logprobs' is float64"),
    (lambda b: {"tokens": -b.tokens}, "negative token ids"),
    (lambda b: {"loss_mask": b.loss_mask * 3}, "loss_mask holds values other than 0 and 1"),
    (lambda b: {"lengths": b.lengths + 1}, "lengths do not add up"),
    (lambda b: {"step": 0}, "step 0 is not a positive integer"),
])
def test_a_well_checksummed_but_malformed_batch_is_refused_naming_the_field(change, message):
    meta, payload = _encoded_with(**change(make_batch()))
    with pytest.raises(BatchError, match=f"^src: .*{message}".replace("(", r"\(").replace("[", r"\[")):
        Batch.decode(meta, payload, "src")


def test_meta_that_lies_about_the_sample_count_is_refused():
    meta, payload = make_batch().encode()
    meta = meta.replace(b'"num_samples": 2', b'"num_samples": 5')
    with pytest.raises(BatchError, match="2 samples, but meta.json says 5"):
        Batch.decode(meta, payload, "src")


def test_servers_announce_their_url_and_are_found_by_it(tmp_path):
    """A server's heartbeat is named after the host and port of its URL and carries the URL:
    that is how an orchestrator on another host finds it. Files that are not a server's, or
    carry no URL, are not servers."""
    from rl.config import InferenceConfig
    from rl.heartbeat import Heartbeat, announced_url, server_heartbeat_path, server_heartbeats

    def announced_servers(output_dir):  # as the orchestrator's discover loop reads them
        return {url: path for path in server_heartbeats(output_dir) if (url := announced_url(path))}

    urls = ["http://10.0.0.5:8000", "http://10.0.0.6:8000", "http://[fd00::7]:8001"]
    beats = [Heartbeat(server_heartbeat_path(tmp_path, u), every_s=60, url=u).start() for u in urls]
    (tmp_path / "heartbeats" / "trainer").write_text("1@h 0\n1 0s training\n")
    (tmp_path / "heartbeats" / "inference-old").write_text("1@h 0\n1 0s starting\n")  # no URL line
    try:
        found = announced_servers(tmp_path)
        assert sorted(found) == sorted(urls)
        assert found["http://10.0.0.5:8000"].name == "inference-10.0.0.5-8000"
        assert len({p.name for p in found.values()}) == 3  # same port, other hosts: other files
    finally:
        for b in beats:
            b.stop()
    assert announced_servers(tmp_path) == {}  # a clean stop removes the announcement

    assert InferenceConfig(host="10.0.0.5", port=8001).url == "http://10.0.0.5:8001"
    assert InferenceConfig(host="0.0.0.0").url.startswith("http://") and "0.0.0.0" not in InferenceConfig(host="0.0.0.0").url
    assert InferenceConfig(advertise_url="https://gpu7.lab:443").url == "https://gpu7.lab:443"
