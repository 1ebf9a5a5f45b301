"""The recorder's files: a folder that was already there is made private too, and a torn last
row (a server killed mid write) is never glued to the next one."""

import json
import os
import stat

from tandem.replay.record import Recorder


def test_an_existing_record_folder_and_its_recordings_are_made_private(tmp_path):
    folder = tmp_path / "rec"
    folder.mkdir(mode=0o777)
    os.chmod(folder, 0o777)
    old = folder / "20260101T000000Z-1.jsonl"
    old.write_text('{"route": "/v1/chat/completions", "headers": {}, "body": {}}\n')
    os.chmod(old, 0o644)
    Recorder(folder).append({"route": "chat", "headers": {}, "body": {"n": 1}})
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in folder.iterdir())


def test_a_torn_row_is_never_glued_to_the_next(tmp_path):
    recorder = Recorder(tmp_path / "rec")
    recorder.append({"route": "chat", "headers": {}, "body": {"n": 1}})
    with open(recorder.path, "ab") as f:
        f.write(b'{"route": "chat", "body": {"n": 2')  # killed mid write
    recorder.append({"route": "chat", "headers": {}, "body": {"n": 3}})
    lines = recorder.path.read_bytes().splitlines()
    assert len(lines) == 3 and json.loads(lines[2])["body"] == {"n": 3}
