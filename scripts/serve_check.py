"""One conversation through the HTTP server on a device, the serve row of scripts/device_check.sh.

Starts ``tandem serve --device DEVICE`` on the embedded tiny model in a scratch home, checks
that /health names the device, asks a chat (temperature 0), sends it back with its answer and
one more user turn as a client does, and checks that both are answered 200 and that the second
resumed from the first's rows (``usage.tandem.cache``: a resident tier, rows cached). Prints
one line; ``--json`` writes what it saw. Exit 0 when all of it held.

    python scripts/serve_check.py --device cuda --json serve.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def _chat(base: str, messages: list[dict], max_tokens: int) -> tuple[int, dict, float]:
    body = json.dumps({"model": "tiny", "messages": messages, "max_tokens": max_tokens,
                       "temperature": 0}).encode()
    req = urllib.request.Request(f"{base}/v1/chat/completions", body,
                                 {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read()), time.perf_counter() - t0
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}"), time.perf_counter() - t0


def check(device: str, up_s: float) -> dict:
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    seen: dict = {"device_asked": device, "ok": False, "turns": []}
    with tempfile.TemporaryDirectory() as home:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
        server = subprocess.Popen(
            [sys.executable, "-m", "tandem", "serve", "--home", home, "--host", "127.0.0.1",
             "--port", str(port), "--device", device],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            deadline = time.monotonic() + up_s
            while True:
                try:
                    health = _get(f"{base}/health")
                    break
                except (OSError, ValueError):
                    if server.poll() is not None or time.monotonic() > deadline:
                        seen["error"] = "the server did not come up"
                        return seen
                    time.sleep(1)
            seen.update(device=health.get("device"), dtype=health.get("dtype"))
            messages = [{"role": "user", "content": "Explain a cache in one line."}]
            for max_tokens in (16, 8):
                status, reply, seconds = _chat(base, messages, max_tokens)
                usage = reply.get("usage") or {}
                turn = {"status": status, "seconds": round(seconds, 3),
                        "cache": (usage.get("tandem") or {}).get("cache"),
                        "completion_tokens": usage.get("completion_tokens")}
                seen["turns"].append(turn)
                if status != 200:
                    seen["error"] = f"turn {len(seen['turns'])}: {status} {reply.get('error')}"
                    return seen
                message = reply["choices"][0]["message"]
                messages += [{"role": "assistant", "content": message.get("content") or "",
                              "reasoning_content": message.get("reasoning_content")},
                             {"role": "user", "content": "Then?"}]
            second = seen["turns"][1]["cache"] or {}
            seen["resumed"] = second.get("tier") == "resident" and second.get("cached", 0) > 0
            on_device = str(seen["device"]).split(":")[0] == device.split(":")[0]
            seen["ok"] = seen["resumed"] and on_device
            if not on_device:
                seen["error"] = f"/health says device {seen['device']}"
            elif not seen["resumed"]:
                seen["error"] = f"the second turn did not resume: {second}"
            return seen
        finally:
            server.terminate()
            try:
                out, _ = server.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                server.kill()
                out, _ = server.communicate()
            tracebacks = out.count("Traceback")
            seen["tracebacks"] = tracebacks
            if tracebacks:
                seen["ok"] = False
                seen.setdefault("error", "a traceback in the server's output")
                sys.stdout.write(out[-4000:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--up-seconds", type=float, default=240.0,
                    help="how long the server may take to answer /health")
    ap.add_argument("--json", default=None, help="write what was seen here as JSON")
    args = ap.parse_args()
    # stopped by a timeout: unwind, so that the server is stopped too
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    seen = check(args.device, args.up_seconds)
    if args.json:
        Path(args.json).write_text(json.dumps(seen))
    turns = seen["turns"]
    print(f"serve on {seen.get('device')} ({seen.get('dtype')}): "
          + ", ".join(f"{t['status']} in {t['seconds']} s" for t in turns)
          + (f"; second turn {turns[1]['cache']}" if len(turns) > 1 else "")
          + ("" if seen["ok"] else f"; FAILED: {seen.get('error')}"))
    sys.exit(0 if seen["ok"] else 1)


if __name__ == "__main__":
    main()
