"""opencode, the real client, against tandem serve: scripts/opencode_e2e.sh installs it from npm,
runs two headless turns and checks from the journal that the second resumed from a cache. Skipped
where npm is missing, or where the script cannot set up (exit 77: the registry is unreachable)."""

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "opencode_e2e.sh"
TIMEOUT_S = 600


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("npm") is None, reason="npm is not installed")
def test_opencode_resumes_its_second_turn_from_a_cache():
    # Its own process group: on a timeout the server it started goes down with it.
    proc = subprocess.Popen(["bash", str(SCRIPT)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "PYTHON": sys.executable})
    try:
        out, err = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.communicate()
        pytest.fail(f"scripts/opencode_e2e.sh ran past {TIMEOUT_S} s")
    done = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    if done.returncode == 77:
        pytest.skip("opencode could not be set up: " + done.stderr.strip().splitlines()[-1])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "PASS" in done.stdout

