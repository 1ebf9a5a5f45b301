"""Sessions, the journal and stop strings, without a server."""

import json

from tandem.server.generation import StopStrings
from tandem.server.journal import Journal, RequestRow
from tandem.server.sessions import hash_session, session_key


def test_the_body_conversation_id_wins_over_the_header_and_only_a_hash_comes_out():
    headers = {"x-session-id": "ses_header"}
    assert session_key({"conversation_id": "c1"}, headers) == hash_session("c1")
    assert session_key({"conversation": {"id": "c2"}}, headers) == hash_session("c2")
    assert session_key({"session_id": "c3"}, {}) == hash_session("c3")
    assert session_key({}, headers) == hash_session("ses_header")
    assert session_key({"conversation_id": ""}, {}) is None
    assert len(hash_session("c1")) == 16 and "c1" not in hash_session("c1")


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
                        "completion_tokens", "cached_tokens", "reread_tokens", "cache_source",
                        "ttft_ms", "decode_tok_s", "finish_reason", "status"}


def test_stop_strings_hold_back_a_possible_start_and_cut_at_the_first_match():
    stops = StopStrings(["END", "##"])
    out = [stops.feed(d) for d in ["hello E", "N", "ding", " #", "#tail"]]
    assert "".join(out) == "hello ENding "
    assert stops.matched and stops.flush() == ""
    plain = StopStrings([])
    assert plain.feed("abc") == "abc" and plain.flush() == ""
