"""Sessions, the journal and stop strings, without a server."""

import hashlib
import json
import os
import stat

from tandem.server.generation import StopStrings
from tandem.server.journal import Journal, RequestRow
from tandem.server.sessions import hash_session, load_secret, session_key


def test_the_body_conversation_id_wins_over_the_header_and_only_a_hash_comes_out():
    headers = {"x-session-id": "ses_header"}
    key = b"k" * 32
    assert session_key({"conversation_id": "c1"}, headers, key) == hash_session("c1", key)
    assert session_key({"conversation": {"id": "c2"}}, headers, key) == hash_session("c2", key)
    assert session_key({"session_id": "c3"}, {}, key) == hash_session("c3", key)
    assert session_key({}, headers, key) == hash_session("ses_header", key)
    assert session_key({"conversation_id": ""}, {}, key) is None
    # 16 hex digits: a raw id with a letter past f can never show through (a raw "c1" could sit
    # inside a keyed hash by chance, one run in about 17).
    digest = hash_session("ses_header", key)
    assert len(digest) == 16 and set(digest) <= set("0123456789abcdef")


def test_the_journal_appends_rows_and_tails_the_newest_last(tmp_path):
    journal = Journal(tmp_path / "home" / "journal.jsonl")
    for i in range(5):
        journal.append(RequestRow(request_id=f"r{i}", t=float(i), session=None, route="chat",
                                  prompt_tokens=10, status=200))
    assert [r["request_id"] for r in journal.tail(2)] == ["r3", "r4"]
    journal.close()
    lines = (tmp_path / "home" / "journal.jsonl").read_text().splitlines()
    assert len(lines) == 5
    row = json.loads(lines[0])
    assert set(row) >= {"request_id", "t", "session", "route", "prompt_tokens",
                        "completion_tokens", "cached_tokens", "reread_tokens", "cache_source", "cache_tier",
                        "ttft_ms", "decode_tok_s", "finish_reason", "status"}


def test_stop_strings_hold_back_a_possible_start_and_cut_at_the_first_match():
    stops = StopStrings(["END", "##"])
    out = [stops.feed(d) for d in ["hello E", "N", "ding", " #", "#tail"]]
    assert "".join(out) == "hello ENding "
    assert stops.matched and stops.flush() == ""
    plain = StopStrings([])
    assert plain.feed("abc") == "abc" and plain.flush() == ""


def test_the_journal_is_private_and_a_torn_last_row_is_never_glued_to_the_next(tmp_path):
    home = tmp_path / "home"
    journal = Journal(home / "journal.jsonl")
    journal.append(RequestRow(request_id="r0", t=0.0, session=None, route="chat", status=200))
    journal.close()
    path = home / "journal.jsonl"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(home.stat().st_mode) == 0o700  # the journal made it
    # A kill -9 mid write leaves half a row; an older journal was world-readable.
    with open(path, "ab") as f:
        f.write(b'{"kind": "request", "request_id": "torn')
    os.chmod(path, 0o644)
    journal = Journal(path)
    journal.append(RequestRow(request_id="r1", t=1.0, session=None, route="chat", status=200))
    journal.close()
    lines = path.read_bytes().split(b"\n")
    assert lines[-1] == b"" and json.loads(lines[-2])["request_id"] == "r1"
    assert lines[1].endswith(b'"torn')
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_sessions_are_hashed_with_the_homes_secret_which_survives_restarts(tmp_path):
    home = tmp_path / "home"
    key = load_secret(home)
    assert len(key) == 32 and load_secret(home) == key  # the same key at the next start
    assert stat.S_IMODE((home / "session.key").stat().st_mode) == 0o600
    other = load_secret(tmp_path / "other")
    assert hash_session("c1", key) != hash_session("c1", other)
    assert hash_session("c1", key) != hashlib.sha256(b"c1").hexdigest()[:16]
    (home / "session.key").unlink()
    assert load_secret(home) != key  # recreated when missing
    # Total over any str: a header's undecodable bytes arrive as surrogate escapes, and a
    # conversation id may be an integer too long for str().
    assert len(hash_session("caf\udce9\ud800", key)) == 16
    assert session_key({"conversation_id": 10 ** 5000}, {}, key) is not None
