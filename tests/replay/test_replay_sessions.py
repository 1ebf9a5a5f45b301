"""Replay of recordings and of the session library, in process on the small real model: a
recording replays to the same answers, forced mode writes the recorded answer token for token,
every short library session replays without an error, and the per-turn table is the journal's."""

import json
import os
import stat

import pytest
import structlog

from conftest import SESSIONS
from tandem.cli import main
from tandem.replay.forced import answer_message, forced_text
from tandem.replay.main import replay
from tandem.replay.record import read_rows
from tandem.replay.runner import InProcessServer

SHORT = sorted(p.name for p in SESSIONS.glob("*.jsonl"))


def _recordings(config) -> list[list[dict]]:
    folder = config.record_path()
    return [read_rows(p) for p in sorted(folder.glob("*.jsonl"))]


def _journal(config) -> dict[str, dict]:
    rows = [json.loads(line) for line in config.journal_path().read_text().splitlines()]
    return {r["request_id"]: r for r in rows if r.get("kind") == "request"}


def test_the_library_has_short_sessions_and_a_long_one():
    assert {"opencode_short.jsonl", "openwebui_short.jsonl", "two_folders.jsonl",
            "restart.jsonl"} <= set(SHORT)
    assert (SESSIONS / "opencode_long.jsonl.gz").is_file()
    assert sum(p.stat().st_size for p in SESSIONS.iterdir()) < 2 << 20


async def test_a_recording_replays_to_the_same_answers(replay_loaded, replay_config):
    rows = read_rows(SESSIONS / "opencode_short.jsonl")
    config = replay_config(record_dir="first")
    first = await replay(rows, config, mode="forced", loaded=replay_loaded)
    assert first["totals"]["errors"] == 0
    [recorded] = _recordings(config)
    assert len(recorded) == len(rows)
    folder = config.record_path()
    for path in folder.iterdir():
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    for row, original in zip(recorded, rows):
        assert set(row) == {"t", "route", "headers", "body", "response"}
        assert row["route"] == "/v1/chat/completions"
        assert row["headers"] == original["headers"]  # x-session-id and user-agent, no other
        assert row["response"]["status"] == 200
        assert row["response"]["cache_source"] in ("cold", "resident", "end", "park", "pin")
    # The recording is a replay input: its responses, forced again, give the same tokens and
    # the same prompts.
    again = replay_config(record_dir="second")
    second = await replay(recorded, again, mode="forced", loaded=replay_loaded)
    [rerecorded] = _recordings(again)
    assert [r["response"]["token_ids"] for r in rerecorded] == \
        [r["response"]["token_ids"] for r in recorded]
    assert [t["prompt_tokens"] for t in second["turns"]] == \
        [t["prompt_tokens"] for t in first["turns"]]


async def test_forced_mode_writes_exactly_the_recorded_answer(replay_loaded, replay_config):
    rows = read_rows(SESSIONS / "openwebui_short.jsonl")[:4]  # an answer, title, tags, follow-up
    config = replay_config(record_dir="rec")
    await replay(rows, config, mode="forced", loaded=replay_loaded)
    [recorded] = _recordings(config)
    tok = replay_loaded.tokenizer
    for row, original in zip(recorded, rows):
        want = forced_text(answer_message(original["response"]))
        assert row["response"]["token_ids"] == tok.encode(want)
        assert row["response"]["content"] == original["response"]["content"]
        assert row["response"]["reasoning"] == original["response"]["reasoning"]


@pytest.mark.parametrize("name", SHORT)
async def test_each_short_library_session_replays_and_its_table_is_the_journals(
        name, replay_loaded, replay_config):
    rows = read_rows(SESSIONS / name)
    config = replay_config()
    result = await replay(rows, config, mode="forced", loaded=replay_loaded)
    turns = result["turns"]
    assert result["totals"]["errors"] == 0, turns
    assert len(turns) == sum(1 for r in rows if not r.get("restart"))
    assert result["totals"]["distinct"] > 0
    # The caches serve every session a part of its prompts at least.
    assert result["totals"]["forwarded"] < sum(t["prompt_tokens"] for t in turns)
    if name == "restart.jsonl":
        after = rows.index({"restart": True})
        # The stop wrote the conversation to the spill; the new server read it back into a
        # slot before its first request, so the turn after the restart resumes at its end.
        assert turns[after]["source"] == "end"
    # Each turn's numbers are its journal row's.
    journal = _journal(config)
    assert len(journal) == len(turns)
    for turn in turns:
        row = journal[turn["request_id"]]
        assert turn["prompt_tokens"] == row["prompt_tokens"]
        assert turn["cached"] == row["cached_tokens"]
        assert turn["reread"] == row["reread_tokens"]
        assert turn["source"] == row["cache_source"]
        assert turn["ttft_ms"] == row["ttft_ms"]
    assert result["totals"]["forwarded"] == sum(r["reread_tokens"] for r in journal.values())


def test_replay_json_with_compare_has_both_runs(replay_loaded, tmp_path, capsys):
    rows = read_rows(SESSIONS / "openwebui_short.jsonl")
    path = tmp_path / "three.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows[:2] + rows[4:6]))
    try:
        code = main(["replay", str(path), "--mode", "forced",
                     "--json", "--compare", "--model", str(replay_loaded.path),
                     "--home", str(tmp_path / "home"), "--window", "4096",
                     "--prefix-chunk", "128"])
    finally:
        structlog.reset_defaults()  # the CLI logged to capsys's stderr, closed after this test
    assert code == 0
    doc = json.loads(capsys.readouterr().out)
    assert set(doc) == {"on", "off"}
    for run in doc.values():
        assert set(run) == {"turns", "totals"}
        assert {"forwarded", "distinct", "ttft_ms_median", "ttft_ms_p90",
                "sources"} <= set(run["totals"])
        assert {"turn", "session", "prompt_tokens", "cached", "reread", "new", "source",
                "ttft_ms"} <= set(run["turns"][0])
    assert set(doc["off"]["totals"]["sources"]) <= {"cold", "engine"}
    assert doc["on"]["totals"]["forwarded"] < doc["off"]["totals"]["forwarded"]


async def test_replay_by_url_reaches_a_running_server_and_skips_a_restart(replay_loaded,
                                                                          replay_config):
    rows = read_rows(SESSIONS / "openwebui_short.jsonl")
    rows = rows[:1] + [{"restart": True}] + rows[4:5]
    config = replay_config(allow_forced_output=True)
    async with InProcessServer(config, replay_loaded) as server:
        result = await replay(rows, config, mode="forced", url=server.base_url + "/v1",
                              loaded=replay_loaded)
    assert result["totals"]["errors"] == 0
    assert [t["source"] for t in result["turns"]][0] == "cold"
    assert result["turns"][1]["source"] != "cold"  # the server was not restarted
