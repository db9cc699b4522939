"""`python -m broker show` against a real redis-server, real groups and the tiny tokenizer."""

from __future__ import annotations

import dataclasses
import io
import os
import re
import subprocess
import sys

import msgpack
import numpy as np
from rich.console import Console

from broker.archive import Archive
from broker.codec import decode, encode
from broker.keys import RunKeys
from broker.messages import ErrorCategory, FinishReason, TrajectoryGroup, Truncation
from farm.show.html import render_html
from farm.show.terminal import render
from farm.show.view import build_view
from learner.config import BatchRules
from tests.broker.helpers import make_group as make_big_group
from tests.farm.show.helpers import Episode, Step, arithmetic, make_group


def positions(text: str, needles: list[str]) -> list[int]:
    """Where each needle first occurs after the previous one (-1: missing or out of order)."""
    out, at = [], 0
    for needle in needles:
        at = text.find(needle, at)
        out.append(at)
        if at < 0:
            return out
        at += len(needle)
    return out


def turn_texts(tag: str) -> list[str]:
    """Every observation and completion of `arithmetic(tag)`, in conversation order."""
    return [
        text for ep in arithmetic(tag) for s in ep.steps for text in (s.observation, s.completion)
    ]


def test_latest_group_shows_turns_in_order_with_marks_and_numbers(run, codec, tiny_model_dir):
    run.publish(make_group(codec, "older", arithmetic("A")))
    entry = run.publish(make_group(codec, "newest", arithmetic("B")))
    code, out, err = run.cli("show", "--tokenizer", str(tiny_model_dir))
    assert code == 0, err
    assert "newest" in out and entry in out and "older" not in out
    assert -1 not in positions(out, turn_texts("B")), out
    # the trained completion of every turn is labelled with its token count
    for ep in arithmetic("B"):
        for step in ep.steps:
            n = len(codec.encode(step.completion)) + 1  # + the end-of-turn token
            assert re.search(rf"trained \({n}\) +{re.escape(step.completion)}<\|im_end\|>", out)
    assert out.count("prompt (") == 4  # one prompt span per turn: 2 + 1 + 1
    # GRPO over returns 1, 0.5, 0: (R - 0.5) / 0.408 -> +1.225, 0, -1.225, in episode order
    advantages = re.findall(r"advantage ([+-]\d\.\d{3})", out)
    assert advantages == ["+1.225", "+1.225", "+0.000", "-1.225"]
    assert re.findall(r"reward ([+-]\d\.\d{3})", out) == ["+0.000", "+1.000", "+0.500", "+0.000"]
    assert re.findall(r"weights v(\d+)", out) == ["3", "4", "3", "3"]
    assert "error category format: no answer found" in out
    assert out.count("· terminated · return") == 2


def test_show_by_group_id_pages_back_past_malformed_entries(run, codec, tiny_model_dir):
    first = run.publish(make_group(codec, "wanted", arithmetic("W")))
    for i in range(30):  # more than a page of newer entries, some malformed
        if i % 7 == 0:
            run.add_raw({b"k": b"group", b"v": b"3", b"b": b"\xc1 not msgpack"})
        else:
            run.publish(make_group(codec, f"later-{i}", arithmetic(f"L{i}")))
    code, out, err = run.cli("show", "--group", "wanted", "--tokenizer", str(tiny_model_dir))
    assert code == 0, err
    assert f"{first} in {{shw}}:trajectories" in out
    assert -1 not in positions(out, turn_texts("W"))
    code, out, err = run.cli("show", "--entry", first)
    assert code == 0, err
    assert "wanted" in out and "tokenizer  none: token ids shown" in out
    ids = " ".join(str(i) for i in codec.encode("W ep0 says 5"))
    assert ids in out  # without a tokenizer the ids themselves


def test_a_partitioned_run_is_searched_in_every_partition(run, codec, monkeypatch):
    """With --partitions, `show` finds a group in whichever partition it was published,
    and the latest group of them all; `trajectories:N` still names one partition."""
    monkeypatch.setenv("FARM_PARTITIONS", "3")
    keys = RunKeys(run.keys.run, partitions=3)
    # Explicit ids: entries of different streams added in one millisecond share an id.
    early, late, newest = "10-1", "20-1", "30-1"
    for p, entry, name in ((1, early, "in-p1"), (2, late, "in-p2"), (0, newest, "in-p0")):
        group = encode(make_group(codec, name, arithmetic(name[-1])))
        run.client.xadd(keys.trajectories(p), group, id=entry)  # type: ignore[arg-type]
    code, out, err = run.cli("show", "--group", "in-p1")
    assert code == 0, err
    assert f"{early} in {keys.trajectories(1)}" in out
    code, out, err = run.cli("show", "--entry", late)
    assert code == 0 and "in-p2" in out, err
    code, out, err = run.cli("show")
    assert code == 0 and "in-p0" in out, err
    run.client.delete(keys.trajectories(0))
    code, out, err = run.cli("show")  # now the newest is partition 2's
    assert code == 0 and f"{late} in {keys.trajectories(2)}" in out, err
    code, _, err = run.cli("show", "--stream", "trajectories:2", "--group", "in-p1")
    assert code == 3 and f"not found in {keys.trajectories(2)}" in err
    code, _, err = run.cli("show", "--group", "nope")
    assert code == 3
    assert f"not found in {', '.join(keys.all_trajectories)}" in err
    # Each stream numbers its own entries: an id in two partitions needs --stream.
    for p in (0, 1):
        run.client.xadd(
            keys.trajectories(p), encode(make_group(codec, f"twin{p}", arithmetic("T"))), id="40-1"
        )
    code, _, err = run.cli("show", "--entry", "40-1")
    assert code == 2
    assert f"entry 40-1 is in {keys.trajectories(0)}, {keys.trajectories(1)}" in err
    code, out, err = run.cli("show", "--entry", "40-1", "--stream", "trajectories:1")
    assert code == 0 and "twin1" in out, err


def test_missing_group_and_entry_exit_3_naming_them(run, codec):
    run.publish(make_group(codec, "g", arithmetic("G")))
    run.add_raw({b"k": b"group", b"v": b"3", b"b": b"junk"})
    code, out, err = run.cli("show", "--group", "nope")
    assert code == 3 and out == ""
    assert "group 'nope' not found in {shw}:trajectories (1 malformed entries" in err
    code, _, err = run.cli("show", "--entry", "1-1")
    assert code == 3 and "entry 1-1 not found" in err
    code, _, err = run.cli("show", "--group", "g", "--html", "/nonexistent/dir/page.html")
    assert code == 2 and "cannot write /nonexistent/dir/page.html" in err
    code, _, err = run.cli("show", "--entry", "latest")
    assert code == 2 and "entry id 'latest' is not a stream id" in err
    code, _, err = run.cli("show", "--stream", "trajectories:0", "--group", "x")
    assert code == 3
    run.client.delete(run.keys.trajectories())
    code, _, err = run.cli("show")
    assert code == 3 and "the latest entry not found in {shw}:trajectories" in err


def test_malformed_entries_exit_4_with_the_codec_reason(run, codec):
    good = make_group(codec, "fine", arithmetic("F"))
    run.publish(good)
    # the id peeks fine, the rest of the body is not a group
    run.add_raw({b"k": b"group", b"v": b"3", b"b": msgpack.packb(["broken", "not a task"])})
    code, out, err = run.cli("show", "--group", "broken")
    assert code == 4 and out == ""
    assert "is not a readable group: undecodable 'group' body" in err
    body = encode(make_group(codec, "future", arithmetic("N")))[b"b"]
    future = run.add_raw({b"k": b"group", b"v": b"99", b"b": body})
    code, _, err = run.cli("show")
    assert code == 4 and f"entry {future}" in err and "unsupported schema version 99" in err
    task_entry = run.add_raw(encode(good.task), run.keys.tasks)
    code, _, err = run.cli("show", "--stream", "tasks", "--entry", task_entry)
    assert code == 4 and "expected 'group', got 'task'" in err
    code, out, err = run.cli("show", "--group", "fine")  # the command still works
    assert code == 0 and "fine" in out


def test_archived_segments_show_without_redis(run, codec, tiny_model_dir, tmp_path, monkeypatch):
    ids = [run.publish(make_group(codec, f"a{i}", arithmetic(f"R{i}"))) for i in range(5)]
    code, out, err = run.cli(
        "archive", "trajectories", "--out", str(tmp_path), "--segment-entries", "2"
    )
    assert code == 0 and "archived 5 entries" in out, err
    assert len(Archive(tmp_path).segments) == 3
    # nothing listens here: an archive must not need Redis
    monkeypatch.setenv("FARM_REDIS_URL", "redis://127.0.0.1:1/0")
    monkeypatch.setenv("FARM_REDIS_WAIT", "0.2")
    tok = ["--tokenizer", str(tiny_model_dir)]
    code, out, err = run.cli("show", "--archive", str(tmp_path), "--group", "a1", *tok)
    assert code == 0, err
    assert f"{ids[1]} in {tmp_path}" in out and -1 not in positions(out, turn_texts("R1"))
    code, out, err = run.cli("show", "--archive", str(tmp_path), *tok)
    assert code == 0 and f"{ids[4]} in {tmp_path}" in out and "R4 ep2" in out
    code, out, err = run.cli("show", "--archive", str(tmp_path), "--entry", ids[2], *tok)
    assert code == 0 and "R2 ep1 says four-ish" in out
    code, _, err = run.cli("show", "--archive", str(tmp_path), "--group", "a9")
    assert code == 3 and "group 'a9' not found in" in err
    # a reader touches nothing: an archiver's half-written segment stays
    (tmp_path / "seg-writing.tmp").write_bytes(b"half")
    code, _, err = run.cli("show", "--archive", str(tmp_path), *tok)
    assert code == 0 and (tmp_path / "seg-writing.tmp").read_bytes() == b"half"
    code, _, err = run.cli("show", "--archive", str(tmp_path / "none"))
    assert code == 2 and "is not an archive" in err


def test_learner_config_gives_rules_and_tokenizer(run, codec, tiny_model_dir, tmp_path):
    episodes = arithmetic("C")
    overlong = Episode(
        (Step("C what is 2+2?", "C ep3 rambles on", 1.0),),
        finish=FinishReason.TRUNCATED,
        truncation=Truncation.CONTEXT,
    )
    run.publish(make_group(codec, "cfg", [*episodes, overlong]))
    toml = tmp_path / "learner.toml"
    toml.write_text(f'model = "{tiny_model_dir}"\nalgorithm = "rloo"\noverlong = "mask"\n')
    code, out, err = run.cli("show", "--learner-config", str(toml))
    assert code == 0, err
    assert f"tokenizer  {tiny_model_dir}" in out and "advantage  rloo, gamma 1" in out
    # RLOO over returns 1, 0.5, 0, 1: R_i - mean of the others
    advantages = re.findall(r"advantage ([+-]\d\.\d{3})", out)
    assert advantages == ["+0.500", "+0.500", "-0.167", "-0.833", "+0.500"]
    assert "episode 3 · truncated:context · return +1.000 · not trained" in out
    assert re.search(r"not trained \(\d+\) +C ep3 rambles on", out)
    toml.write_text('model = "/nonexistent/model"\n')
    code, _, err = run.cli("show", "--learner-config", str(toml))
    assert code == 2 and "cannot load a tokenizer from /nonexistent/model" in err
    toml.write_text("algorithm = 'nope'\n")
    code, _, err = run.cli(
        "show", "--learner-config", str(toml), "--tokenizer", str(tiny_model_dir)
    )
    assert code == 2 and "learner config" in err and "algorithm" in err


def test_recorded_console_has_marks_without_colour(codec):
    group = make_group(codec, "rec", arithmetic("K"))
    again = decode(encode(group))  # what a reader gets off the wire
    assert isinstance(again, TrajectoryGroup)
    view = build_view(
        again, "1-0", "here", BatchRules(), decode=lambda ids: codec.decode(ids, skip_special=False)
    )
    console = Console(record=True, width=160, color_system=None, file=io.StringIO())
    render(view, console)
    text = console.export_text()
    assert -1 not in positions(text, turn_texts("K"))
    assert text.count("trained (") == 4 and "not trained" not in text
    # the markup-looking text of a completion is printed as written
    assert "<script>document.title='pwned'</script>" in text


def test_first_token_of_a_sequence_is_not_trained(codec):
    # a turn whose prompt side is empty: its first completion token has nothing before it
    group = make_group(codec, "edge", arithmetic("E"))
    first = group.trajectories[1].turns[0]
    bare = type(first)(
        np.zeros(0, np.int32), first.completion_ids, first.logprobs, 3, 0.5, True, False
    )
    trajs = list(group.trajectories)
    trajs[1] = type(trajs[1])((bare,), FinishReason.TERMINATED, sample_index=1)
    view = build_view(
        type(group)("edge", group.task, tuple(trajs), "w"),
        "1-0",
        "here",
        BatchRules(),
        decode=lambda ids: codec.decode(ids, skip_special=False),
    )
    spans = view.episodes[1].turns[0].completion
    assert [(s.trained, s.tokens) for s in spans] == [
        (False, 1),
        (True, len(first.completion_ids) - 1),
    ]
    assert spans[0].text + spans[1].text == "E ep1 says four-ish<|im_end|>"


def test_a_reader_that_leaves_early_is_not_an_error(run, redis_server):
    # ~200 KB of ids: more than a pipe holds, so `show` is still writing when the reader goes
    run.publish(make_big_group("big", tokens=25_000))
    env = {**os.environ, "FARM_REDIS_URL": redis_server.url, "FARM_RUN": "shw"}
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
    proc = subprocess.Popen([sys.executable, "-m", "broker", "show"], env=env, **pipes)
    assert proc.stdout is not None and proc.stdout.readline().startswith(b"group")
    proc.stdout.close()  # as `head -1` does
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err.decode()[-3000:]
    assert b"Traceback" not in err


def test_the_broker_command_hands_show_its_arguments_and_run(run, codec, redis_server, tmp_path):
    """`python -m broker show` runs in `farm.show` (above the learner): the run settings
    (here from a TOML file and a flag), the show options and the exit status carry over."""
    run.publish(make_group(codec, "g", arithmetic("G")))
    toml = tmp_path / "broker.toml"
    toml.write_text(f'redis_url = "{redis_server.url}"\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("FARM_")}
    argv = [sys.executable, "-m", "broker", "--config", str(toml), "--run", "shw", "show"]
    pipes = {"capture_output": True, "text": True, "timeout": 120, "env": env}
    missing = subprocess.run([*argv, "--group", "nope"], **pipes)
    assert missing.returncode == 3 and missing.stdout == ""
    assert "group 'nope' not found in {shw}:trajectories" in missing.stderr
    found = subprocess.run([*argv, "--group", "g"], **pipes)
    assert found.returncode == 0, found.stderr[-3000:]
    assert re.match(r"group +g\b", found.stdout), found.stdout[:300]


def test_control_characters_are_written_out(codec):
    hostile = Episode((Step("what is 2+2?", "bell\x07 clear\x1b[2J osc\x1b]52;c;eA==\x07 4", 1.0),))
    group = make_group(codec, "ctl\x1b[31m", [hostile, *arithmetic("Z")[:1]])
    view = build_view(
        group, "1-0", "here", BatchRules(), decode=lambda ids: codec.decode(ids, skip_special=False)
    )
    console = Console(record=True, width=200, color_system=None, file=io.StringIO())
    render(view, console)
    text = console.export_text()
    page = render_html(view)
    for out in (text, page):
        assert "\x1b" not in out and "\x07" not in out
        assert "bell\\x07 clear\\x1b[2J osc\\x1b]52;c;eA==\\x07 4" in out
        assert "ctl\\x1b[31m" in out


def test_an_episode_without_turns_and_a_skipped_group(codec):
    detail = "no server answered"
    broken = Episode((), FinishReason.ERROR, ErrorCategory.INFERENCE, detail)
    group = make_group(codec, "infra", [*arithmetic("I")[:2], broken])
    view = build_view(
        group, "1-0", "here", BatchRules(), decode=lambda ids: codec.decode(ids, skip_special=False)
    )
    assert view.skipped == "infra" and not view.episodes[2].trained
    console = Console(record=True, width=200, color_system=None, file=io.StringIO())
    render(view, console)
    text = console.export_text()
    assert "learner    skips it: infra" in text
    assert (
        "episode 2 · error · error category inference: no server answered · return +0.000" in text
    )
    assert "no turns" in text
    assert '<div class="turn note">no turns</div>' in render_html(view)


def test_the_reasoning_a_parser_split_off_is_shown_apart_from_the_answer(codec):
    """`Turn.reasoning_tokens` (wire schema 6): the first tokens of a completion are the
    model's reasoning; show labels them, in the terminal and on the page."""
    group = make_group(codec, "think", arithmetic("R"))
    first = group.trajectories[0].turns[0]
    thought = dataclasses.replace(first, reasoning_tokens=4)
    trajs = list(group.trajectories)
    trajs[0] = dataclasses.replace(trajs[0], turns=(thought, *trajs[0].turns[1:]))
    again = decode(encode(dataclasses.replace(group, trajectories=tuple(trajs))))
    view = build_view(
        again, "1-0", "here", BatchRules(), decode=lambda ids: codec.decode(ids, skip_special=False)
    )
    turn = view.episodes[0].turns[0]
    whole = codec.decode(first.completion_ids, skip_special=False)
    assert "".join(s.text for s in turn.reasoning) == codec.decode(first.completion_ids[:4])
    assert "".join(s.text for s in (*turn.reasoning, *turn.completion)) == whole
    assert not view.episodes[0].turns[1].reasoning
    console = Console(record=True, width=160, color_system=None, file=io.StringIO())
    render(view, console)
    assert "reasoning 4 tokens" in console.export_text()
    assert 'class="trained reasoning"' in render_html(
        view
    ) or 'class="untrained reasoning"' in render_html(view)
