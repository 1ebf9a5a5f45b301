"""scripts/device_check.sh rehearsed on the CPU (DEVICE_CHECK_CPU=1): a lent GPU machine gives a
session minutes, so the script itself must not be what fails there. The same steps run (each
group's pytest, the server through HTTP, the bench, the table, the copies to $OUT); the GPU
tests skip, and the table must name every group with nothing failed, the server's two turns
(the second resumed in place) and the bench's rows."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GROUPS = ["test_kernel_devices", "test_device", "test_spill_writer", "test_oracle_device",
          "test_graphs", "test_capture_graphs", "test_fp8"]


def test_the_device_check_rehearsed_on_the_cpu_prints_its_table_and_fills_out(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    env = dict(os.environ, DEVICE_CHECK_CPU="1", PYTHON=sys.executable, OUT=str(out),
               TANDEM_HOME=str(tmp_path / "home"))
    run = subprocess.run(["bash", "scripts/device_check.sh"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    table = (out / "table.txt").read_text()
    assert "on the CPU (a rehearsal)" in table
    rows = {line.split("|")[1].strip(): line for line in table.splitlines()
            if line.startswith("| ")}
    for group in GROUPS:
        assert group in rows, (group, table)
        assert rows[group].split("|")[3].strip() == "0", rows[group]  # nothing failed
    assert "did not run" not in table and "did not finish" not in table
    bench = json.loads((out / "bench.json").read_text())
    assert [r["row"] for r in bench["rows"]] == ["prefill 1k", "decode 1k"]
    for r in bench["rows"]:
        assert r["tandem_tok_s"] > 0 and f"bench tiny {r['row']}" in table
    serve = json.loads((out / "serve.json").read_text())
    assert serve["ok"] and serve["device"] == "cpu" and serve["resumed"], serve
    assert [t["status"] for t in serve["turns"]] == [200, 200]
    assert serve["turns"][1]["cache"]["tier"] == "resident"
    assert "serve on cpu (float32)" in table and "resident end" in rows["serve on cpu (float32)"]
    logs = (out / "logs.txt").read_text()
    for log in ("kernels", "device", "oracle", "graphs", "fp8", "serve", "bench"):
        assert f"== {log}.log" in logs, log
    assert sorted(p.name for p in out.iterdir()) == [
        "bench.json", "logs.txt", "serve.json", "table.txt"]  # a lent machine sends back 8


def test_a_check_out_of_time_skips_what_is_left_and_still_prints_its_table(tmp_path):
    # a budget of 10 s leaves nothing after the 10 s margin: every step is skipped or cut to
    # one second, and the table still comes out (on a lent machine, before its limit kills it)
    out = tmp_path / "out"
    out.mkdir()
    env = dict(os.environ, DEVICE_CHECK_CPU="1", DEVICE_CHECK_SECONDS="10",
               PYTHON=sys.executable, OUT=str(out), TANDEM_HOME=str(tmp_path / "home"))
    run = subprocess.run(["bash", "scripts/device_check.sh"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 1, run.stdout[-4000:] + run.stderr[-4000:]
    table = (out / "table.txt").read_text()
    for group in ("kernels", "device", "oracle", "graphs", "fp8"):
        assert f"| {group}: did not run" in table, table
    assert "bench: did not finish" in table
    assert "skipped, out of time" in (out / "logs.txt").read_text()
