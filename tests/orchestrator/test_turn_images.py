"""Pictures in the built-in tool loop's and text environments' turns (issue 62;
orchestrator/rollout/turn_images.py, tool_episode.py, text_environment.py): a tool that returns a
picture (tasks/shapes_tools.py ShapesTools: `look(board)`), a text environment whose start and
observation are pictures (ShapesTurns). Each turn's request carries one placeholder per picture
of the episode so far and the PNGs; the engine's expansion is checked; the samples keep the
pictures in placeholder order.

- Without an engine (generate scripted, as test_agent_images.py's Scripted): the requests'
  wire form turn by turn; the samples' ids are AutoProcessor's rendering of the whole
  conversation with the pictures in order; bad pictures fail the episode by name and count;
  a text-only model; an engine that expands otherwise; a model that writes the placeholder.
- On the real engine (`rl inference` on models/tiny-vlm, shared with test_agent_images.py:
  tests/picture_episodes.py): every request's prompt as the engine expanded it is the trajectory so far,
  whose pieces are AutoProcessor's; the engine's logprobs are float64 transformers' with the
  episode's pictures within the derived bound, and miss it with the pictures swapped."""

from __future__ import annotations

import asyncio
import base64
import io
import logging
import re

import numpy as np
import pytest
from PIL import Image

from orchestrator.prompts.queue import Prompt
from orchestrator.rendering import template_messages
from orchestrator.rendering.tokenizer import load_tokenizer
from orchestrator.rollout.tool_parsers import ToolCall
from picture_episodes import (AlwaysLooks, Recorded, Scripted, TEXT_MODEL, VLM, engine_against_float64, pixels,
                              turn_rollouts)
from tasks.shapes import QUESTION
from tasks.shapes_agent import AGAIN
from tasks.shapes_tools import ShapesTools, ShapesTurns, board_of


EOU = "<end_of_utterance>"


def processor():
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(VLM)


def processor_ids(text: str, pictures: list[bytes]) -> list[int]:
    inputs = processor()(text=[text], images=[[Image.open(io.BytesIO(p)) for p in pictures]] if pictures else None,
                         return_tensors="pt")
    return inputs["input_ids"][0].tolist()


def chat_text(messages: list[dict], generation: bool) -> str:
    return processor().apply_chat_template(template_messages(messages), add_generation_prompt=generation,
                                           tokenize=False)


def boards_shown(messages: list[dict]) -> list[bytes]:
    """The PNGs of the boards the conversation's tool calls asked for, in order (the calls of
    the last turn, which no turn would read, are not run)."""
    return [board_of(c["function"]["arguments"]["board"])[0]
            for m in messages[:-1] if m["role"] == "assistant" for c in m.get("tool_calls", [])]


def conversation_of(sample, conversations: list[list[dict]]) -> list[dict]:
    """The conversation whose boards are the sample's pictures (episodes end in any order)."""
    got = [pixels(p).tolist() for p in sample.images]
    [messages] = [m for m in conversations if [pixels(p).tolist() for p in boards_shown(m)[:len(got)]] == got]
    return messages


def written_by(r, text: str = " 3") -> list[int]:
    """The model's turn: `text`, then the end-of-turn token."""
    eou = r.fast.token_to_id(EOU)
    return r.encode(text, add_special_tokens=False) + ([eou] if eou is not None else r.kind.stop_token_ids[:1])


# --- without an engine -------------------------------------------------------------------------


def test_the_python_forms_of_a_picture_become_openai_content():
    from orchestrator.rollout.turn_images import content_of

    png = board_of("forms")[0]
    picture = Image.open(io.BytesIO(png))

    def shown(part) -> list:
        assert part["type"] == "image_url" and part["image_url"]["url"].startswith("data:image/png;base64,")
        return pixels(base64.b64decode(part["image_url"]["url"].split(",", 1)[1])).tolist()

    assert content_of("text") == "text"
    assert [shown(p) for p in content_of(picture)] == [pixels(png).tolist()]
    parts = content_of(["Board 7.", picture, {"type": "image", "image": picture}, {"type": "text", "text": "!"}])
    assert parts[0] == {"type": "text", "text": "Board 7."} and parts[3] == {"type": "text", "text": "!"}
    assert shown(parts[1]) == shown(parts[2]) == pixels(png).tolist()
    url = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    assert content_of([url]) == [url]  # checked when rendered
    assert content_of(["a", "b"]) is None and content_of([{"type": "text", "text": "a"}]) is None  # JSON, as before
    assert content_of({"a": 1}) is None and content_of([]) is None and content_of([picture, 3]) is None


def test_a_tool_that_returns_a_picture_sends_it_then_and_later_and_keeps_it_in_order():
    env = Recorded()
    r = turn_rollouts(env, "tasks.shapes_tools:ShapesTools")
    written = written_by(r)
    generate = Scripted(written)
    group = asyncio.run(r.group(Prompt(0, next(env.dataset(0))), "g0", generate))
    assert group.failed == 0 and len(group.samples) == 2
    image = load_tokenizer(str(VLM)).token_to_id("<image>")
    requests = [q for q in generate.asked if q.request_id.startswith("g0-e0-")]
    assert [q.request_id for q in requests] == ["g0-e0-t0", "g0-e0-t1", "g0-e0-t2"]
    # One placeholder per picture so far, the pictures of every earlier turn carried again;
    # each request's ids extend the previous one's with what was sampled.
    assert [len(q.images or []) for q in requests] == [0, 1, 2]
    assert [q.prompt_token_ids.count(image) for q in requests] == [0, 1, 2]
    for before, after in zip(requests, requests[1:]):
        assert after.prompt_token_ids[:len(before.prompt_token_ids) + len(written)] == before.prompt_token_ids + written
        assert after.images[:len(before.images or [])] == (before.images or [])
    for sample in group.samples:
        messages = conversation_of(sample, env.conversations)
        shown = boards_shown(messages)
        assert len(shown) == 2 and pixels(shown[0]).tolist() != pixels(shown[1]).tolist()
        assert [pixels(p).tolist() for p in sample.images] == [pixels(p).tolist() for p in shown]
        # The whole conversation as AutoProcessor renders it (the model's turns " 3", which the
        # template renders back as sampled), the boards in order, then the last turn's tokens.
        said = [{**m, "content": m["content"].strip()} if m["role"] == "assistant" else m for m in messages]
        want = processor_ids(chat_text(said[:-1], True), shown) + written
        assert sample.tokens == want
        assert [t for t, m in zip(sample.tokens, sample.loss_mask) if m] == written * 3


def test_a_text_environments_pictures_are_the_processors_in_order():
    env = ShapesTurns()
    r = turn_rollouts(env, "tasks.shapes_tools:ShapesTurns", max_turns=2)
    written = written_by(r)
    generate = Scripted(written)
    row = next(env.dataset(0))
    group = asyncio.run(r.group(Prompt(0, row), "g0", generate))
    assert group.failed == 0 and len(group.samples) == 2
    first, second = (board_of(name)[0] for name in row["boards"])
    assert [len(q.images) for q in generate.asked if q.request_id.startswith("g0-e0-")] == [1, 2]
    text = f"<image>{QUESTION} 3{EOU}\n<image>{AGAIN}"  # the episode in raw text, as the model reads it
    for sample in group.samples:
        assert sample.tokens == processor_ids(text, [first, second]) + written
        assert [pixels(p).tolist() for p in sample.images] == [pixels(first).tolist(), pixels(second).tolist()]


def junk(board: str):
    """A tool whose picture is not one."""
    return [{"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgpqdW5r"}}, "junk"]


def bomb(board: str):
    """A tool whose picture declares 81M pixels."""
    out = io.BytesIO()
    Image.new("1", (9000, 9000)).save(out, format="PNG")
    return [Image.open(io.BytesIO(out.getvalue())), "big"]


def three(board: str):
    """Three boards a call: the second call's makes six pictures."""
    return [Image.open(io.BytesIO(board_of(f"{board}/{i}")[0])) for i in range(3)]


def a_path(board: str):
    """A picture named by a path on the orchestrator's side."""
    return [{"type": "image_url", "image_url": {"url": "/etc/passwd"}}]


@pytest.mark.parametrize("tool, says", [
    (junk, "turn 0: tool junk: content[0]: unreadable image"),
    (bomb, "turn 0: tool bomb: content[0]: "),  # the decompression bomb, named below
    (three, "turn 1: tool three: content[1]: 6 images, more than the 4"),
    (a_path, "turn 0: tool a_path: content[0]: '/etc/passwd': an image_url from an agent, a tool or an environment "
             "must be a data: URL")])
def test_a_bad_picture_from_a_tool_fails_the_episode_by_name(tool, says, caplog):
    class Parser(AlwaysLooks):
        def parse(self, text):
            return text, [ToolCall(tool.__name__, {"board": "b"})]

    r = turn_rollouts(Recorded(tools=[tool]), "tasks.shapes_tools:ShapesTools", group_size=3)
    r.kind.tool_episode.parser = Parser()
    written = written_by(r)
    with caplog.at_level(logging.WARNING, logger="orchestrator"):
        row = {"prompt": "Look.", "board": "b", "answer": "3"}
        group = asyncio.run(r.group(Prompt(0, row), "g5", Scripted(written)))
    assert group.failed == 3 and group.samples == []
    assert group.error.startswith("ImageError: " + says), group.error
    if tool is bomb:
        assert "decompression bomb" in group.error
    lines = [m for m in caplog.messages if "failed in" in m]
    assert len(lines) == 1 and lines[0].startswith("episode g5-e") and says in lines[0], caplog.messages


def test_a_bad_picture_in_a_text_environments_observation_fails_the_episode_by_name():
    class Broken(ShapesTurns):
        def episode(self, row):
            episode = super().episode(row)
            step = episode.step

            def broken(completion):
                turn = step(completion)
                if turn.observation:
                    turn.observation = [junk("")[0], "junk"]
                return turn

            episode.step = broken
            return episode

    r = turn_rollouts(Broken(), "tasks.shapes_tools:ShapesTurns", max_turns=2)
    written = written_by(r)
    group = asyncio.run(r.group(Prompt(0, next(Broken().dataset(0))), "g6", Scripted(written)))
    assert group.failed == 2 and group.error.startswith("ImageError: turn 0: observation: content[0]: unreadable image")
    assert "0x" not in group.error  # (PIL names its buffer by address: each episode's line would differ)


def test_a_picture_returning_tool_on_a_text_only_model_fails_with_one_line(caplog):
    r = turn_rollouts(Recorded(), "tasks.shapes_tools:ShapesTools", model=TEXT_MODEL)
    written = written_by(r)

    async def text_engine(request):
        assert not request.images
        return await Scripted(written)(request)

    with caplog.at_level(logging.WARNING, logger="orchestrator"):
        group = asyncio.run(r.group(Prompt(0, next(ShapesTools().dataset(0))), "g1", text_engine))
    assert group.failed == 2
    lines = [m for m in caplog.messages if "failed in" in m]
    assert len(lines) == 1 and lines[0].endswith(
        "ImageError: turn 0: tool look: content[0]: a picture, and the model has no image processor "
        "(processor_config.json): it reads text only"), lines


def test_an_engine_that_expands_otherwise_fails_the_episode():
    r = turn_rollouts(Recorded(), "tasks.shapes_tools:ShapesTools")
    written = written_by(r)
    group = asyncio.run(r.group(Prompt(0, next(ShapesTools().dataset(0))), "g2", Scripted(written, expanded=[1, 2])))
    assert group.failed == 2 and re.search(r"^ImageError: g2-e[01]-t1: the server expanded the image placeholders to 2 "
                                           r"ids, the model's processor to \d+", group.error), group.error


def test_a_model_that_writes_the_placeholder_ends_its_episode_before_the_picture():
    """The sampled <image> was text to the engine that sampled it; sent again beside a picture
    it would be a second placeholder: the episode ends there (trained on, without the picture)."""
    r = turn_rollouts(Recorded(), "tasks.shapes_tools:ShapesTools")
    written = written_by(r, " 3<image>")
    generate = Scripted(written)
    group = asyncio.run(r.group(Prompt(0, next(ShapesTools().dataset(0))), "g3", generate))
    assert group.failed == 0 and [len(s.images) for s in group.samples] == [0, 0]
    assert sorted(q.request_id for q in generate.asked) == ["g3-e0-t0", "g3-e1-t0"]


class PictureFirst(ShapesTools):
    """ShapesTools whose opening question holds its board (its own messages(row))."""

    def messages(self, row: dict) -> list[dict]:
        png = board_of(row["board"])[0]
        return [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(png).decode()}},
            {"type": "text", "text": row["prompt"]}]}]


def test_the_start_up_room_check_measures_an_openings_pictures_as_the_model_reads_them():
    """The opening's pictures counted expanded (as the processor expands them), not as their one
    placeholder: a tool environment's opening is AutoProcessor's ids for it, tools included; a
    text environment's start its text's tokens and each picture's expansion."""
    from orchestrator.rendering import image_support
    from orchestrator.rollout.text_environment import TextEpisodes
    from orchestrator.rollout.tool_environment import ToolEpisodes
    from orchestrator.rollout.tool_functions import load_tools
    from rl.config import load_config

    tokenizer, hf = load_tokenizer(str(VLM)), processor()
    env = PictureFirst()
    row = next(env.dataset(0))
    cfg, _ = load_config(["--model", str(VLM), "--seq_len", "512", "--orchestrator.environment.class",
                          "test_turn_images:PictureFirst"])
    measured = ToolEpisodes.start_up(cfg, env)(tokenizer)(row)
    schemas = [t.schema for t in load_tools(env.tools, "PictureFirst.tools").values()]
    text = hf.apply_chat_template(template_messages(env.messages(row)), tools=schemas, add_generation_prompt=True,
                                  tokenize=False)
    assert measured == len(processor_ids(text, [board_of(row["board"])[0]]))

    turns = ShapesTurns()
    first = next(turns.dataset(0))
    cfg, _ = load_config(["--model", str(VLM), "--seq_len", "512", "--orchestrator.environment.class",
                          "tasks.shapes_tools:ShapesTurns"])
    start = turns.episode(first).start()
    words = "".join(p for p in start if isinstance(p, str)) if isinstance(start, list) else start
    expansion = len(processor_ids(image_support(VLM).image_token, [board_of(first["boards"][0])[0]]))
    assert TextEpisodes.start_up(cfg, turns)(tokenizer)(first) == len(tokenizer.encode(words).ids) + expansion


def test_a_text_environment_whose_opening_fits_only_unexpanded_is_refused_at_start_up(tmp_path):
    """`rl orchestrator --dry-run`: ShapesTurns' opening is 14 tokens with its picture as one
    placeholder and 32 as the model reads it; with room for 31 it exits 2 naming the key, with
    room for 32 it starts."""
    import subprocess

    from conftest import rl_command

    def dry(seq_len: int) -> subprocess.CompletedProcess:
        return subprocess.run(rl_command("orchestrator", "--model", str(VLM), "--output_dir", str(tmp_path / "run"),
                                         "--seq_len", str(seq_len), "--orchestrator.sampling.max_tokens", "8",
                                         "--orchestrator.environment.class", "tasks.shapes_tools:ShapesTurns",
                                         "--dry-run"), capture_output=True, text=True, timeout=300)

    refused, fits = dry(8 + 31), dry(8 + 32)
    assert refused.returncode == 2, refused.stderr[-2000:]
    assert "orchestrator.environment.class = 'tasks.shapes_tools:ShapesTurns'" in refused.stderr
    assert "the longest is 32 tokens" in refused.stderr, refused.stderr[-2000:]
    assert fits.returncode == 0, fits.stderr[-2000:]


# --- on the real engine ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from picture_episodes import played_on_engine

    return played_on_engine(tmp_path_factory)


def tool_samples(engine) -> list:
    groups = engine["tools"]["groups"]
    assert all(g.failed == 0 and len(g.samples) == 2 for g in groups), [g.error for g in groups]
    return [s for g in groups for s in g.samples]


@pytest.mark.slow
def test_the_engine_expanded_each_turns_prompt_as_the_processor_does(engine):
    played = engine["tools"]
    samples, eou = tool_samples(engine), played["eou"]
    with_two = 0
    for s in samples:
        if not s.images:  # turn 0 cut at max_tokens, or the model wrote <image>: no picture shown
            continue
        messages = conversation_of(s, played["conversations"])
        shown = boards_shown(messages)[:len(s.images)]
        with_two += len(shown) == 2
        assert [pixels(p).tolist() for p in s.images] == [pixels(p).tolist() for p in shown]
        # Pieces: the opening, each model turn as sampled, then the text the template puts
        # between (the model's turn closed, the tool's message, the next generation prompt),
        # each piece AutoProcessor's ids with that turn's board.
        model = [i for i, m in enumerate(s.loss_mask) if m]
        runs = np.split(np.asarray(model), np.where(np.diff(model) > 1)[0] + 1)
        want = processor_ids(chat_text(messages[:1], True), [])
        for k, run in enumerate(runs):
            turn = s.tokens[run[0]:run[-1] + 1]
            want += turn
            if k + 1 < len(runs):
                before = chat_text(messages[:2 + 2 * k], False)
                after = chat_text(messages[:3 + 2 * k], True)
                closing = before[before.rfind(EOU) + len(EOU):]  # the template's after the model's turn
                closing = closing if turn[-1] in eou else EOU + closing  # (its end-of-turn, if another stop ended it)
                want += processor_ids(closing + after[len(before):], [shown[k]])
        assert s.tokens == want
    assert with_two >= 2, with_two
    # Each request as sent: one placeholder per picture; as the engine expanded it: the
    # trajectory so far, a model turn next.
    image = load_tokenizer(str(VLM)).token_to_id("<image>")
    expanded = 0
    for request, response in played["seen"].values():
        assert request.prompt_token_ids.count(image) == len(request.images or [])
        prompt = response.prompt_token_ids if request.images else request.prompt_token_ids  # (text: as sent)
        expanded += bool(request.images)
        [sample] = [s for s in samples if s.tokens[:len(prompt)] == prompt][:1]
        assert sample.loss_mask[len(prompt)] == 1
    assert expanded >= 4, expanded


@pytest.mark.slow
def test_the_text_environments_samples_are_the_processors_with_both_boards(engine):
    played = engine["turns"]
    for row, group in zip(played["rows"], played["groups"]):
        assert group.failed == 0 and len(group.samples) == 2, group.error
        first, second = (board_of(name)[0] for name in row["boards"])
        for s in group.samples:
            if len(s.images) < 2:  # the model wrote <image> or ran out of room: the episode ended
                continue
            start = processor_ids(f"<image>{QUESTION}", [first])
            assert s.tokens[:len(start)] == start and not any(s.loss_mask[:len(start)])
            answered = len(start) + next(i for i, m in enumerate(s.loss_mask[len(start):]) if not m)
            observation = processor_ids(f"\n<image>{AGAIN}", [second])
            assert s.tokens[answered:answered + len(observation)] == observation
            assert all(s.loss_mask[answered + len(observation):])
            assert [pixels(p).tolist() for p in s.images] == [pixels(first).tolist(), pixels(second).tolist()]


def all_samples(engine) -> dict:
    return {"episodes": [(None, [s]) for s in tool_samples(engine)]
            + [(None, [s]) for g in engine["turns"]["groups"] for s in g.samples]}


@pytest.mark.slow
def test_the_engine_sampled_after_the_episodes_pictures_in_their_order(engine):
    played = all_samples(engine)
    own = engine_against_float64(played)
    assert len(own) >= 16 and all(abs(e - x) <= tol for e, x, tol in own), [x for x in own if abs(x[0] - x[1]) > x[2]]
    # The samples with two pictures, the pictures swapped: the model turns after both miss the bound.
    swapped = engine_against_float64(played, lambda s: s.images[::-1] if len(s.images) == 2 else None)
    moved = sum(abs(e - x) > tol for e, x, tol in swapped)
    assert moved > len(swapped) // 2, (moved, len(swapped))
