"""Pictures in an agent's conversation (issue 62 item 2; orchestrator/rollout/agent_images.py,
agent_endpoint.py, agent_environment.py): an agent written against the official `openai` client
sends `image_url` parts (data: URLs) in its turns; the endpoint renders them with the model's
processor expansion, sends /generate with the pictures, and the episode's samples carry them in
placeholder order into the batch and the trainer.

- Without an engine (the endpoint's generate scripted): what a request with pictures sends; how
  requests with pictures become samples; bad pictures named by part, their episode failed and
  counted while the group goes on.
- On the real engine (`rl inference` on models/tiny-vlm, one server shared with
  test_turn_images.py: tests/picture_episodes.py):
  tasks/shapes_agent.py's two-turn agent, a board per turn; each sample's ids are AutoProcessor's
  for the conversation, its pictures the boards in order, the engine's logprobs float64
  transformers' with those pictures (not with them swapped), and the real trainer's logprobs on
  the samples the engine's within the derived bound (mismatch_kl)."""

from __future__ import annotations

import asyncio
import base64
import io
import logging
import random
import sys

import numpy as np
import openai
import pytest
from PIL import Image

from orchestrator.prompts.queue import Prompt
from orchestrator.rendering import ChatTemplate, image_support
from orchestrator.rendering.images import render_image_prompt
from orchestrator.rendering.tokenizer import load_tokenizer
from orchestrator.rollout.agent_environment import rebuilt
from picture_episodes import (SEQ_LEN, Scripted, TEXT_MODEL, VLM, agent_rollouts, engine_against_float64, pixels,
                              sampled)
from tasks.shapes import draw
from tasks.shapes_agent import ShapesAgent, picture_part


def boards(n: int, seed: str = "boards") -> list[bytes]:
    rng = random.Random(seed)
    return [draw(rng)[0] for _ in range(n)]


def rendered(messages: list[dict]):
    return render_image_prompt(ChatTemplate.load(VLM), image_support(VLM), load_tokenizer(str(VLM)), messages, [])


# --- without an engine -------------------------------------------------------------------------


def test_a_growing_conversation_keeps_its_pictures_and_another_picture_starts_a_new_sample():
    a, b, c = (bytes([i]) * 4 for i in (1, 2, 3))
    turns = [([1, 7, 2], sampled([10, 11]), [a]),
             ([1, 7, 2, 10, 11, 20, 7, 21], sampled([12]), [a, b]),       # grew: one sample, both pictures
             ([1, 7, 2, 10, 11, 20, 7, 21, 12, 30], sampled([13]), [c, b])]  # same ids, another first picture
    t = rebuilt(turns, reward=1.0)
    assert t.tokens == [1, 7, 2, 10, 11, 20, 7, 21, 12] and t.images == [a, b]
    [second] = t.parts
    assert second.tokens == [1, 7, 2, 10, 11, 20, 7, 21, 12, 30, 13] and second.images == [c, b]
    assert second.loss_mask == [0] * 10 + [1]  # what the first sample had sampled is context here
    assert t.episode == {"turns": 3, "samples": 2, "tokens": 20}


def test_a_request_with_pictures_sends_them_and_records_the_expanded_prompt():
    r = agent_rollouts(ShapesAgent())
    kind = r.kind
    written = r.encode(" 3", add_special_tokens=False) + kind.stop_token_ids[:1]
    generate = Scripted(written)
    first, second = boards(2)
    turn1 = [{"role": "user", "content": [picture_part(first), {"type": "text", "text": "How many?"}]}]
    turn2 = [*turn1, {"role": "assistant", "content": "3"},
             {"role": "user", "content": [{"type": "text", "text": "And here?"}, picture_part(second)]}]

    async def main():
        await kind.endpoint.start()
        key, record = kind.endpoint.open("g-e0", generate)
        async with openai.AsyncOpenAI(base_url=kind.endpoint.base_url, api_key=key, max_retries=0) as client:
            answers = [await client.chat.completions.create(model="m", messages=m) for m in (turn1, turn2)]
        await kind.endpoint.stop()
        return answers, record

    answers, record = asyncio.run(main())
    assert [a.choices[0].finish_reason for a in answers] == ["stop", "stop"]
    for request, messages, (ids, sample, images) in zip(generate.asked, (turn1, turn2), record.turns):
        want = rendered(messages)
        # One placeholder per picture on the wire, the pictures as PNG; the expanded ids recorded.
        assert request.prompt_token_ids == want.request_ids and ids == want.token_ids
        assert [base64.b64decode(x) for x in request.images] == images == want.images
    assert [pixels(p).tolist() for p in record.turns[1][2]] == [pixels(first).tolist(), pixels(second).tolist()]
    assert answers[1].usage.prompt_tokens == len(rendered(turn2).token_ids)


def bad_parts(tmp) -> list[tuple[list, str]]:
    """(content parts, what the refusal says besides the part's name)."""
    path = tmp / "board.png"
    path.write_bytes(boards(1)[0])
    bomb = io.BytesIO()
    Image.new("1", (9000, 9000)).save(bomb, format="PNG")  # 81M pixels declared, a small file
    good = picture_part(boards(1)[0])
    return [([{"type": "image_url", "image_url": {"url": str(path)}}], "must be a data: URL"),
            ([{"type": "image_url", "image_url": {"url": "https://example.com/x.png"}}], "must be a data: URL"),
            ([picture_part(b"\x89PNG junk")], "unreadable image"),
            ([{"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}], "not valid base64"),
            ([picture_part(bomb.getvalue())], "decompression bomb"),
            ([good] * 5, "5 images, more than the 4")]


def test_bad_pictures_are_refused_naming_the_part_and_fail_the_episode(tmp_path):
    kind = agent_rollouts(ShapesAgent()).kind

    async def nothing(request):
        raise AssertionError("nothing should be sampled")

    async def main():
        await kind.endpoint.start()
        said = []
        for parts, _ in bad_parts(tmp_path):
            key, record = kind.endpoint.open("g-e0", nothing)
            messages = [{"role": "user", "content": "Look."},
                        {"role": "assistant", "content": "Yes."}, {"role": "user", "content": parts}]
            async with openai.AsyncOpenAI(base_url=kind.endpoint.base_url, api_key=key, max_retries=0) as client:
                for attempt in range(2):  # the second: the episode has failed, whatever is asked
                    try:
                        await client.chat.completions.create(model="m", messages=messages[:1 if attempt else 3])
                    except openai.BadRequestError as e:
                        said.append(e.message)
            assert record.failure and record.turns == []
            kind.endpoint.close(key)
        await kind.endpoint.stop()
        return said

    said = asyncio.run(main())
    for k, (_, says) in enumerate(bad_parts(tmp_path)):
        refused, then = said[2 * k], said[2 * k + 1]
        assert "request 0: messages[2].content[" in refused and says in refused, refused
        assert "the episode has failed: request 0: messages[2].content[" in then, then


def test_pictures_for_a_text_only_model_are_refused():
    kind = agent_rollouts(ShapesAgent(), model=TEXT_MODEL).kind

    async def main():
        await kind.endpoint.start()
        key, record = kind.endpoint.open("g-e0", None)
        async with openai.AsyncOpenAI(base_url=kind.endpoint.base_url, api_key=key, max_retries=0) as client:
            with pytest.raises(openai.BadRequestError) as e:
                await client.chat.completions.create(model="m", messages=[
                    {"role": "user", "content": [picture_part(boards(1)[0])]}])
        await kind.endpoint.stop()
        return e.value.message, record

    message, record = asyncio.run(main())
    assert "request 0: an image part, and the model has no image processor" in message and record.failure


class OneBadBoard(ShapesAgent):
    """Its first episode shows a broken second board and, told so, answers on regardless (an
    agent that swallows the error); the others play as ShapesAgent does."""

    def __init__(self):
        self.episodes = 0

    async def conversation(self, row: dict, access) -> list[dict]:
        self.episodes += 1
        if self.episodes == 1:
            row = {**row, "boards": [row["boards"][0], base64.b64encode(b"\x89PNG junk").decode()]}
            try:
                return await super().conversation(row, access)
            except openai.BadRequestError:
                return [{"role": "assistant", "content": row["answers"][1]}]  # "right": still not trained on
        return await super().conversation(row, access)


def test_an_episode_with_a_bad_picture_fails_by_name_and_the_group_goes_on(caplog):
    env = OneBadBoard()
    r = agent_rollouts(env, group_size=3)
    written = r.encode(" 2", add_special_tokens=False) + r.kind.stop_token_ids[:1]
    row = next(env.dataset(0))
    with caplog.at_level(logging.WARNING, logger="orchestrator"):
        group = asyncio.run(r.group(Prompt(0, row), "g7", Scripted(written)))
    assert group.failed == 1 and len(group.episodes) == 2  # the other two episodes train
    assert sorted(len(s.images) for s in group.samples) == [1, 1, 2, 2]  # each: a sample a request
    lines = [m for m in caplog.messages if "failed in" in m]
    assert len(lines) == 1 and lines[0].startswith("episode g7-e") and "ImageError: request 1: messages[2].content[0]: " \
        "unreadable image" in lines[0], caplog.messages


def test_an_engine_that_expands_otherwise_fails_the_episode():
    r = agent_rollouts(ShapesAgent())
    written = r.encode(" 1", add_special_tokens=False) + r.kind.stop_token_ids[:1]
    group = asyncio.run(r.group(Prompt(0, next(ShapesAgent().dataset(0))), "g8", Scripted(written, expanded=[1, 2, 3])))
    assert group.failed == 2 and group.samples == []
    assert "request 0: the server expanded the image placeholders to 3 ids" in group.error, group.error


# --- on the real engine ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def played(tmp_path_factory):
    """The agent's episodes on `rl inference` (real vLLM, models/tiny-vlm: tests/picture_episodes.py, the
    server stopped once every kind's episodes are played: the trainer's run then has the cores)."""
    from picture_episodes import played_on_engine

    shared = played_on_engine(tmp_path_factory)
    return {**shared["agent"], "tmp": shared["tmp"]}


def processor_ids(messages: list[dict], pictures: list[bytes]) -> list[int]:
    """The model's own AutoProcessor on the conversation, the generation prompt after it."""
    from transformers import AutoProcessor

    from orchestrator.rendering import template_messages

    processor = AutoProcessor.from_pretrained(VLM)
    text = processor.apply_chat_template(template_messages(messages), add_generation_prompt=True, tokenize=False)
    inputs = processor(text=[text], images=[[Image.open(io.BytesIO(p)) for p in pictures]], return_tensors="pt")
    return inputs["input_ids"][0].tolist()


@pytest.mark.slow
def test_each_sample_is_the_processors_conversation_with_the_boards_in_order(played):
    for row, samples in played["episodes"]:
        first, second = (base64.b64decode(b) for b in row["boards"])
        assert pixels(first).tolist() != pixels(second).tolist()
        # The conversation as the agent sent it: two user turns with a board each, the model's first answer between.
        sent = [m for m in played["kept"] if m[0]["content"][0] == picture_part(first)]
        last = samples[-1]
        whole = [(m, processor_ids(m[:3], [first, second])) for m in sent]
        matched = [(m, ids) for m, ids in whole if last.tokens[:len(ids)] == ids]
        assert matched, (last.tokens, [ids for _, ids in whole])
        messages, ids = matched[0]
        # Its last request's prompt, placeholders expanded as AutoProcessor does, then what the model wrote.
        assert len(last.tokens) > len(ids) and all(last.loss_mask[len(ids):])
        assert [pixels(p).tolist() for p in last.images] == [pixels(first).tolist(), pixels(second).tolist()]
        opening = processor_ids(messages[:1], [first])
        assert samples[0].tokens[:len(opening)] == opening and sum(samples[0].loss_mask[:len(opening)]) == 0
        if len(samples) == 2:  # the first answer re-rendered otherwise than sampled: two samples
            assert [pixels(p).tolist() for p in samples[0].images] == [pixels(first).tolist()]
            assert sum(last.loss_mask[:len(ids)]) == 0
        else:
            assert len(samples) == 1 and sum(last.loss_mask[:len(ids)]) > 0
        assert {v for v, m in zip(last.versions, last.loss_mask) if m} == {0}


def own_pictures(played) -> list[tuple[float, float, float]]:
    if "own" not in played:  # (the two tests below share it)
        played["own"] = engine_against_float64(played)
    return played["own"]


@pytest.mark.slow
def test_the_engine_sampled_after_these_pictures_in_this_order(played):
    own = own_pictures(played)
    assert len(own) >= 16 and all(abs(e - x) <= tol for e, x, tol in own), [x for x in own if abs(x[0] - x[1]) > x[2]]
    # The samples with both boards, the boards swapped (the first turn's sample has one).
    swapped = engine_against_float64(played, lambda s: s.images[::-1] if len(s.images) == 2 else None)
    moved = sum(abs(e - x) > tol for e, x, tol in swapped)
    assert moved > len(swapped) // 2, (moved, len(swapped))


@pytest.mark.slow
def test_the_trainer_scores_the_episodes_as_the_engine_sampled_them(played, write_toml):
    """The real trainer (one rank, one step) on the episodes' samples: each sampled token's
    log ratio within twice the bound (two float32 programs), so mismatch_kl (mean k3 over the
    loss tokens) within the mean k3 of those bounds; the same batch with each sample's two
    boards swapped (a trainer pairing placeholders with the wrong pictures) is outside it."""
    import dataclasses

    from rl.batch import Batch
    from rl.rundir import RunDir
    from samples import write_batch
    from trainer_runs import run_trainer, trainer_metrics

    samples = [s for _, pieces in played["episodes"] for s in pieces]
    assert sum(len(s.images) == 2 for s in samples) >= 4
    swapped = [dataclasses.replace(s, images=s.images[::-1]) for s in samples]
    kls = {}
    for name, batch in (("own", samples), ("swapped", swapped)):
        run = RunDir(played["tmp"] / name)
        write_batch(Batch.from_samples(1, batch), run.rollout_dir(1))
        cfg = write_toml(f'model = "{VLM}"\noutput_dir = "{run.root}"\nmax_steps = 1\nseq_len = {SEQ_LEN}\n'
                         "[trainer]\ntorch_threads = 1\n[trainer.batching]\nmicro_batch_tokens = 512\n", f"{name}.toml")
        run_trainer([sys.executable, "-m", "trainer"], ["@", str(cfg)])
        [metrics] = trainer_metrics(run)
        kls[name] = metrics["mismatch_kl"]
    b = 2 * np.asarray([tol for _, _, tol in own_pictures(played)])
    assert kls["own"] <= float(np.mean(np.exp(b) - b - 1)) < kls["swapped"], (kls, len(b))
