#!/usr/bin/env python3
"""Fuzz a running tandem server (or any OpenAI-compatible one) on this machine.

    python scripts/fuzz_server.py http://127.0.0.1:8000 [--cases 3000] [--seed 0] [--token T]

Sends ``--cases`` hostile requests, one at a time, each on a fresh connection: well-formed
bodies with hostile values and malformed bodies on both generation routes (streaming and not),
memory limits, every GET route, unknown routes and wrong methods (scripts/fuzzcases.py, the
generators tests/server/test_fuzz.py runs under hypothesis), plus raw-socket cases (malformed
request lines and headers, bad lengths and chunking, headers a byte at a time, a client that
leaves mid-request). Meanwhile a prober thread GETs /health every 50 ms and times it: a probe
over 100 ms is a loop stall; a /health that fails (refused, not 200, no answer in 5 s) and does
not come back within 5 s is a death, and the run stops there, printing the last cases sent
(or, with --revive-s, waits for whatever supervises the server to start it again).

It prints: tried / 2xx / 4xx / 5xx (503 with Retry-After apart) / no answer / deaths / loop
stalls, a line per case kind, and a reproducer (a curl line) for every case whose answer broke
a property: a 5xx other than 503 with Retry-After, an error not in the OpenAI format, a cut or
unterminated stream, no answer to a well-formed HTTP request. Exit status 0 when there was none.
It stops by itself after --cases or --max-seconds, whichever comes first, and puts the memory
limits back as it found them. Only loopback addresses are fuzzed: any other host is refused.
"""

from __future__ import annotations

import argparse
import collections
import ipaddress
import json
import random
import socket
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fuzzcases  # noqa: E402

PROBE_INTERVAL_S = 0.05
STALL_S = 0.1
DEATH_GRACE_S = 5.0


def loopback_target(url: str) -> tuple[str, int]:
    """(host, port) of ``url``; SystemExit unless every address it names is a loopback one."""
    parts = urlsplit(url if "//" in url else f"http://{url}")
    if parts.scheme != "http" or not parts.hostname:
        raise SystemExit(f"fuzz_server: {url!r} is not an http:// URL")
    port = parts.port or 80
    try:
        infos = socket.getaddrinfo(parts.hostname, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise SystemExit(f"fuzz_server: cannot resolve {parts.hostname!r}: {e}") from None
    addresses = {info[4][0] for info in infos}
    if not addresses or not all(ipaddress.ip_address(a.split("%")[0]).is_loopback
                                for a in addresses):
        raise SystemExit(f"fuzz_server: {parts.hostname!r} is not a loopback address "
                         f"({', '.join(sorted(addresses))}); this tool fuzzes only a server on "
                         "this machine")
    host = parts.hostname if ":" not in parts.hostname else sorted(addresses)[0]
    return host, port


class Prober(threading.Thread):
    """GET /health every PROBE_INTERVAL_S: its latencies, the stalls among them, and the
    outages (a run of failed probes: refused, not 200, or no answer in DEATH_GRACE_S)."""

    def __init__(self, host: str, port: int, token: str | None) -> None:
        super().__init__(name="health-prober", daemon=True)
        self.host, self.port, self.token = host, port, token
        self.stopping = threading.Event()
        self.latencies: list[float] = []
        self.stalls = 0
        self.outages = 0
        self.down = False  # in an outage now
        self.lock = threading.Lock()

    def probe(self) -> bool:
        start = time.monotonic()
        try:
            answer = fuzzcases.send(fuzzcases.Case("health", "GET", "/health"), self.host,
                                    self.port, timeout_s=DEATH_GRACE_S, token=self.token)
            ok = answer is not None and answer.status == 200
        except OSError:
            ok = False
        latency_s = time.monotonic() - start
        with self.lock:
            if ok:
                self.latencies.append(latency_s)
                self.stalls += latency_s > STALL_S
            elif not self.down:
                self.outages += 1
            self.down = not ok
        return ok

    def run(self) -> None:
        while not self.stopping.wait(PROBE_INTERVAL_S):
            self.probe()

    def wait_up(self, wait_s: float) -> bool:
        """Whether the server answers /health again within ``wait_s``."""
        deadline = time.monotonic() + wait_s
        while not self.probe():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.25)
        return True


def model_of(host: str, port: int, token: str | None) -> str:
    answer = fuzzcases.send(fuzzcases.Case("models", "GET", "/v1/models"), host, port,
                            timeout_s=10, token=token)
    try:
        return json.loads(answer.body)["data"][0]["id"]
    except (AttributeError, ValueError, KeyError, IndexError, TypeError):
        return "tiny"


def memory_limits(host: str, port: int, token: str | None) -> dict | None:
    try:
        answer = fuzzcases.send(fuzzcases.Case("memory", "GET", "/v1/memory"), host, port,
                                timeout_s=10, token=token)
        return json.loads(answer.body)["limits"] if answer and answer.status == 200 else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def restore_limits(host: str, port: int, token: str | None, limits: dict | None) -> None:
    if not limits:
        return
    case = fuzzcases.Case("limits", "POST", "/v1/memory/limits", json.dumps(limits).encode(),
                          {"Content-Type": "application/json"})
    try:
        answer = fuzzcases.send(case, host, port, timeout_s=10, token=token)
    except OSError:
        answer = None
    if answer is None or answer.status != 200:
        print(f"could not put the memory limits back to {limits}", file=sys.stderr)


def raw_problems(answer: fuzzcases.Answer | None) -> list[str]:
    """A raw case may be closed without an answer; only a 5xx is wrong."""
    if answer is None:
        return []
    if answer.status >= 500 and not (answer.status == 503 and "retry-after" in answer.headers):
        return [f"{answer.status}"]
    return []


def status_class(answer: fuzzcases.Answer | None) -> str:
    if answer is None:
        return "none"
    if answer.status == 503 and answer.headers.get("retry-after", "").isdigit():
        return "503ra"
    return f"{answer.status // 100}xx"


def draw(rng: random.Random, args: argparse.Namespace, model: str, host: str, port: int,
         ) -> fuzzcases.Case | fuzzcases.RawCase:
    if rng.random() < args.raw_share:
        return fuzzcases.raw_case(rng, model, f"[{host}]:{port}" if ":" in host else
                                  f"{host}:{port}")
    return fuzzcases.http_case(rng, model, max_tokens=args.max_tokens, long_max=args.long_max,
                               body_limit=args.body_limit, framing=True)


def run_case(case, host: str, port: int, args: argparse.Namespace,
             ) -> tuple[fuzzcases.Answer | None, list[str], bool]:
    """(answer, what it broke, whether the connection was refused)."""
    try:
        if isinstance(case, fuzzcases.RawCase):
            cut = case.kind in ("raw_slow", "raw_cut")  # never complete: the server may wait
            data = fuzzcases.exchange(host, port, case.chunks, delay_s=case.delay_s,
                                      timeout_s=2.0 if cut else min(args.timeout, 10.0))
            answer = fuzzcases.parse_answer(data)
            return answer, raw_problems(answer), False
        answer = fuzzcases.send(case, host, port, timeout_s=args.timeout, token=args.token)
        return answer, fuzzcases.problems(case, answer), False
    except ConnectionRefusedError:
        return None, ["connection refused"], True
    except OSError as e:
        return None, [f"connection failed: {type(e).__name__}"], False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("url", help="the server, e.g. http://127.0.0.1:8000 (loopback only)")
    parser.add_argument("--cases", type=int, default=3000, help="cases to send (3000)")
    parser.add_argument("--seed", type=int, default=0, help="the run's seed (0): same seed, "
                        "same cases")
    parser.add_argument("--token", default=None, help="sent as Authorization: Bearer on every "
                        "request (a server with admin_token or api_key)")
    parser.add_argument("--max-seconds", type=float, default=900.0,
                        help="stop after this long whatever --cases says (900)")
    parser.add_argument("--timeout", type=float, default=30.0,
                        help="seconds a case may take before it counts as unanswered (30)")
    parser.add_argument("--raw-share", type=float, default=0.1,
                        help="share of raw-socket cases (0.1)")
    parser.add_argument("--max-tokens", type=int, default=8,
                        help="largest max_tokens of an otherwise ordinary request (8)")
    parser.add_argument("--long-max", type=int, default=20_000,
                        help="longest generated string, in bytes (20000)")
    parser.add_argument("--body-limit", type=int, default=200_000,
                        help="longest malformed body, in bytes (200000)")
    parser.add_argument("--revive-s", type=float, default=0.0,
                        help="after a death, wait this long for a supervisor to restart the "
                        "server, and go on if it does (0: stop at the first death)")
    parser.add_argument("--replay", type=int, default=None, metavar="I",
                        help="send only case #I of this seed (a reproducer from a report)")
    parser.add_argument("--model", default=None, help="model name (default: /v1/models' first)")
    parser.add_argument("--show", type=int, default=20, help="reproducers printed (20)")
    args = parser.parse_args(argv)

    host, port = loopback_target(args.url)
    if not fuzzcases.healthy(host, port):
        print(f"fuzz_server: no healthy server at {host}:{port} (GET /health)", file=sys.stderr)
        return 2
    model = args.model or model_of(host, port, args.token)
    rng = random.Random(args.seed)
    if args.replay is not None:
        for _ in range(args.replay):
            draw(rng, args, model, host, port)
        case = draw(rng, args, model, host, port)
        print(case.describe(10_000))
        answer, found, _ = run_case(case, host, port, args)
        print(f"answer: {answer.status if answer else None} "
              f"{answer.body[:2000] if answer else b''!r}")
        print(f"broke: {'; '.join(found) or 'nothing'}; healthy after: "
              f"{fuzzcases.healthy(host, port)}")
        return 1 if found else 0

    limits = memory_limits(host, port, args.token)
    prober = Prober(host, port, args.token)
    prober.start()
    counts: collections.Counter[str] = collections.Counter()
    by_kind: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    failures: list[tuple[int, str, list[str]]] = []
    recent: collections.deque[str] = collections.deque(maxlen=5)
    started = time.monotonic()
    tried = 0
    stopped_dead = False
    print(f"fuzzing {host}:{port} (model {model!r}), {args.cases} cases, seed {args.seed}",
          flush=True)
    for i in range(args.cases):
        if time.monotonic() - started > args.max_seconds:
            print(f"stopping after {args.max_seconds:.0f} s", flush=True)
            break
        case = draw(rng, args, model, host, port)
        recent.append(f"#{i} {case.describe(300)}")
        answer, found, refused = run_case(case, host, port, args)
        tried += 1
        cls = status_class(answer)
        counts[cls] += 1
        by_kind[case.kind][cls] += 1
        if found:
            counts["problems"] += 1
            by_kind[case.kind]["problems"] += 1
            failures.append((i, case.describe(1000), found))
        # A refused connection, or a /health that fails after an unanswered case: the server is
        # down (the prober counts the outage); wait for it, or stop.
        if refused or prober.down or (answer is None and not prober.probe()):
            prober.probe()  # counts the outage if the prober has not seen it yet
            print(f"the server stopped answering after case #{i}; the last cases:", flush=True)
            for line in recent:
                print("  " + line, flush=True)
            if not prober.wait_up(args.revive_s):
                stopped_dead = True
                break
            print("  it is back; going on", flush=True)
        if (i + 1) % 500 == 0:
            print(f"  {i + 1} cases, {time.monotonic() - started:.0f} s, "
                  f"{counts['problems']} broke a property", flush=True)
    if not stopped_dead:
        prober.probe()  # the last case's aftermath
    prober.stopping.set()
    prober.join(DEATH_GRACE_S + 1)
    elapsed_s = time.monotonic() - started
    if not prober.down:
        restore_limits(host, port, args.token, limits)

    lat = sorted(prober.latencies) or [0.0]
    print()
    print(f"tried {tried} in {elapsed_s:.0f} s: 2xx {counts['2xx']}, 4xx {counts['4xx']}, "
          f"5xx {counts['5xx']} (and 503 with Retry-After {counts['503ra']}), "
          f"no answer {counts['none']}")
    print(f"deaths {prober.outages}; loop stalls over {STALL_S * 1000:.0f} ms {prober.stalls} "
          f"(of {len(prober.latencies)} /health probes: p50 {lat[len(lat) // 2] * 1000:.1f} ms, "
          f"p99 {lat[int(len(lat) * 0.99)] * 1000:.1f} ms, max {lat[-1] * 1000:.0f} ms)")
    print(f"cases that broke a property: {len(failures)}")
    print()
    print(f"{'kind':<20}{'tried':>7}{'2xx':>7}{'4xx':>7}{'5xx':>7}{'503ra':>7}{'none':>7}"
          f"{'broke':>7}")
    for kind in sorted(by_kind):
        c = by_kind[kind]
        print(f"{kind:<20}{sum(c[k] for k in ('2xx', '3xx', '4xx', '5xx', '503ra', 'none')):>7}"
              f"{c['2xx']:>7}{c['4xx']:>7}{c['5xx']:>7}{c['503ra']:>7}{c['none']:>7}"
              f"{c['problems']:>7}")
    for i, line, found in failures[:args.show]:
        print(f"\n#{i}: {'; '.join(found)}\n  {line}")
    if len(failures) > args.show:
        print(f"\n... and {len(failures) - args.show} more")
    return 0 if not failures and not prober.outages else 1


if __name__ == "__main__":
    sys.exit(main())
