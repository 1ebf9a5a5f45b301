"""The actor runtime's costs, each against its plain counterpart measured in the same run.

1. One `ask` round trip (tell + handle + reply) against a plain await of a coroutine and a plain
   function call that do the same work.
2. The engine actor's per-token hand-off: a worker thread hands each decoded token to the event
   loop with `loop.call_soon_threadsafe(queue.put_nowait, token)` and the loop awaits
   `queue.get()`; against a plain function call per token on the thread, and against the same
   queue fed from the loop itself. Also the one-way latency of a single hand-off (ping-pong, so
   the queue is never backed up), which is what a streamed token waits.
3. The prefill plan (issue 12): asking the resident and the park for their offers (each lends
   its holdings), building the PrefillPlan on the loop and giving the holdings back, per
   request, p50 and p99, with 17 grid anchors, a pinned head and a parked session held; against
   the same offers computed by plain function calls over the same holdings.
4. Requests per second of a tiny completion over loopback HTTP: a server process (this script with
   --serve) answers POST /v1/completions by asking a trivial actor, and POST /v1/baseline with the
   same body without any actor; a client here keeps N requests in flight. When
   tandem.server.app.build_app is importable, also the whole server on the embedded tiny model.

These machines are shared and noisy: read the ratios, not the absolute times. Each timing is the
best of several repeats.

    .venv/bin/python scripts/bench_runtime.py [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
import msgspec
import structlog
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tandem.actors import Actor, Message, Supervisor  # noqa: E402
from tandem.actors.loop import install_uvloop  # noqa: E402


class Echo(Message):
    """Sender: the benchmark (an ask). Receiver: EchoActor, which answers with `n`. Ownership: none."""

    n: int


class EchoActor(Actor):
    async def handle(self, msg: Message) -> object | None:
        match msg:
            case Echo(n=n):
                return n
        raise TypeError(f"echo takes no {type(msg).__name__}")


class Complete(Message):
    """Sender: the bench server's route (an ask). Receiver: FakeCompleter. Ownership: none."""

    prompt: str
    max_tokens: int


class Completed(msgspec.Struct, frozen=True):
    text: str
    prompt_tokens: int
    completion_tokens: int


class FakeCompleter(Actor):
    """Stands in for the engine: "generates" max_tokens copies of the prompt's last word."""

    async def handle(self, msg: Message) -> object | None:
        match msg:
            case Complete(prompt=prompt, max_tokens=max_tokens):
                return _complete(prompt, max_tokens)
        raise TypeError(f"completer takes no {type(msg).__name__}")


def _complete(prompt: str, max_tokens: int) -> Completed:
    words = prompt.split() or [""]
    return Completed(" ".join([words[-1]] * max_tokens), len(words), max_tokens)


# -- timing helpers ---------------------------------------------------------------------------


def best_per_op_s(run: Callable[[], float], repeats: int) -> float:
    """`run` returns seconds per operation; keep the best (least disturbed) repeat."""
    return min(run() for _ in range(repeats))


async def best_per_op_s_async(run: Callable[[], Awaitable[float]], repeats: int) -> float:
    results = [await run() for _ in range(repeats)]
    return min(results)


# -- 1. ask round trip ------------------------------------------------------------------------


async def bench_ask(n: int, repeats: int) -> dict[str, float]:
    supervisor = Supervisor()
    echo = supervisor.add(EchoActor("echo"))

    async def plain_handler(msg: Echo) -> int:
        return msg.n

    def plain_function(msg: Echo) -> int:
        return msg.n

    async def asks() -> float:
        start = time.perf_counter()
        for i in range(n):
            await echo.ask(Echo(i), 1.0)
        return (time.perf_counter() - start) / n

    async def awaits() -> float:
        start = time.perf_counter()
        for i in range(n):
            await plain_handler(Echo(i))
        return (time.perf_counter() - start) / n

    def calls() -> float:
        start = time.perf_counter()
        for i in range(n):
            plain_function(Echo(i))
        return (time.perf_counter() - start) / n

    async with supervisor:
        await asks()  # warm up
        ask_s = await best_per_op_s_async(asks, repeats)
    await_s = await best_per_op_s_async(awaits, repeats)
    call_s = best_per_op_s(calls, repeats)
    return {"ask": ask_s, "await": await_s, "call": call_s}


async def bench_thread_ask(n: int, repeats: int) -> float:
    """An ask from another thread, waited on there: what the engine thread pays for each call
    of the state store's port (tandem/actors/store.py)."""
    supervisor = Supervisor()
    echo = supervisor.add(EchoActor("echo"))
    loop = asyncio.get_running_loop()

    def asks() -> float:
        start = time.perf_counter()
        for i in range(n):
            asyncio.run_coroutine_threadsafe(echo.ask(Echo(i), 1.0), loop).result()
        return (time.perf_counter() - start) / n

    async with supervisor:
        await asyncio.to_thread(asks)  # warm up
        best = min([await asyncio.to_thread(asks) for _ in range(repeats)])
    return best


# -- 2. per-token hand-off from a worker thread -----------------------------------------------


async def bench_handoff(n: int, repeats: int) -> dict[str, float]:
    loop = asyncio.get_running_loop()

    async def threaded() -> float:
        queue: asyncio.Queue[int] = asyncio.Queue()

        def produce() -> None:
            for token in range(n):
                loop.call_soon_threadsafe(queue.put_nowait, token)

        start = time.perf_counter()
        worker = threading.Thread(target=produce, name="bench-decode")
        worker.start()
        for _ in range(n):
            await queue.get()
        elapsed = time.perf_counter() - start
        worker.join()
        return elapsed / n

    async def same_loop() -> float:
        queue: asyncio.Queue[int] = asyncio.Queue()
        start = time.perf_counter()
        for token in range(n):
            queue.put_nowait(token)
            await queue.get()
        return (time.perf_counter() - start) / n

    def plain_calls() -> float:
        sink: list[int] = []
        start = time.perf_counter()
        for token in range(n):
            sink.append(token)
        return (time.perf_counter() - start) / n

    await threaded()  # warm up
    threaded_s = await best_per_op_s_async(threaded, repeats)
    same_loop_s = await best_per_op_s_async(same_loop, repeats)
    call_s = best_per_op_s(plain_calls, repeats)
    latencies_s = await handoff_latencies(max(200, n // 10))
    return {
        "threaded": threaded_s,
        "same_loop": same_loop_s,
        "call": call_s,
        "latency_p50": statistics.median(latencies_s),
        "latency_p99": statistics.quantiles(latencies_s, n=100)[98],
    }


async def handoff_latencies(n: int) -> list[float]:
    """One token at a time: the thread waits until the loop has taken the previous one."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[float] = asyncio.Queue()
    taken = threading.Event()
    latencies_s: list[float] = []

    def produce() -> None:
        for _ in range(n):
            taken.clear()
            loop.call_soon_threadsafe(queue.put_nowait, time.perf_counter())
            if not taken.wait(5.0):
                raise TimeoutError("the event loop took no token in 5 s")

    worker = threading.Thread(target=produce, name="bench-latency")
    worker.start()
    for _ in range(n):
        sent_s = await queue.get()
        latencies_s.append(time.perf_counter() - sent_s)
        taken.set()
    worker.join()
    return latencies_s


# -- 3. HTTP requests per second --------------------------------------------------------------


def completion_body(completed: Completed, model: str) -> dict:
    return {
        "id": "cmpl-bench",
        "object": "text_completion",
        "created": 0,
        "model": model,
        "choices": [{"index": 0, "text": completed.text, "finish_reason": "length"}],
        "usage": {
            "prompt_tokens": completed.prompt_tokens,
            "completion_tokens": completed.completion_tokens,
            "total_tokens": completed.prompt_tokens + completed.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": 0},
        },
    }


async def serve() -> None:
    """The bench server: run until stdin closes (the parent exits or stops us)."""
    supervisor = Supervisor()
    completer = supervisor.add(FakeCompleter("engine"))
    app = web.Application()

    async def via_actor(request: web.Request) -> web.Response:
        body = await request.json()
        completed = await completer.ask(
            Complete(body["prompt"], int(body.get("max_tokens", 16))), 5.0, sender="server"
        )
        assert isinstance(completed, Completed)
        return web.json_response(completion_body(completed, body["model"]))

    async def baseline(request: web.Request) -> web.Response:
        body = await request.json()
        completed = _complete(body["prompt"], int(body.get("max_tokens", 16)))
        return web.json_response(completion_body(completed, body["model"]))

    app.router.add_post("/v1/completions", via_actor)
    app.router.add_post("/v1/baseline", baseline)
    async with supervisor:
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        print(port, flush=True)  # the parent reads this line
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, sys.stdin.read)  # returns at EOF
        await runner.cleanup()


async def serve_real() -> None:
    """The whole tandem server (tandem.server.app.build_app) over the embedded tiny model."""
    import tempfile

    from tandem.config import load_config
    from tandem.models import load_model
    from tandem.server.app import build_app

    scratch = tempfile.TemporaryDirectory(prefix="tandem-bench-")  # removed when the run ends
    config = load_config(cli_args={"home": scratch.name})
    loaded = load_model("tiny", config.models_dir(), config.engine.dtype)
    runner = web.AppRunner(build_app(config, loaded), access_log=None)
    await runner.setup()  # starts the actors
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    print(runner.addresses[0][1], loaded.name, flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await runner.cleanup()


async def drive(
    base: str, path: str, concurrency: int, duration_s: float, model: str = "bench",
    max_tokens: int = 8,
) -> float:
    body = json.dumps({"model": model, "prompt": "the quick brown fox", "max_tokens": max_tokens})
    headers = {"Content-Type": "application/json"}
    done = 0
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def one() -> None:
            async with session.post(base + path, data=body, headers=headers) as response:
                response.raise_for_status()
                await response.read()

        for _ in range(concurrency * 4):  # warm up the connections
            await one()
        deadline = time.perf_counter() + duration_s

        async def client() -> None:
            nonlocal done
            while time.perf_counter() < deadline:
                await one()
                done += 1

        start = time.perf_counter()
        async with asyncio.TaskGroup() as group:
            for _ in range(concurrency):
                group.create_task(client())
        return done / (time.perf_counter() - start)


class BenchServer:
    """This script in --serve or --serve-real mode, in its own process; it stops at EOF on stdin."""

    def __init__(self, mode: str, use_uvloop: bool) -> None:
        command = [sys.executable, __file__, mode] + ([] if use_uvloop else ["--no-uvloop"])
        self.process = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert self.process.stdout is not None
        first = self.process.stdout.readline().split()  # "PORT [MODEL]"; empty if it died
        if not first:
            self.close()
            raise RuntimeError(f"the bench server did not start (exit {self.process.returncode})")
        self.base = f"http://127.0.0.1:{first[0]}"
        self.model = first[1] if len(first) > 1 else "bench"

    def close(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()
        try:
            self.process.wait(30.0)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


async def bench_http(
    concurrencies: list[int], duration_s: float, repeats: int, use_uvloop: bool
) -> list[tuple[int, float, float]]:
    server = BenchServer("--serve", use_uvloop)
    try:
        rows = []
        for concurrency in concurrencies:
            actor_rps = max([await drive(server.base, "/v1/completions", concurrency, duration_s)
                             for _ in range(repeats)])
            plain_rps = max([await drive(server.base, "/v1/baseline", concurrency, duration_s)
                             for _ in range(repeats)])
            rows.append((concurrency, actor_rps, plain_rps))
        return rows
    finally:
        server.close()


async def bench_real_app(duration_s: float, use_uvloop: bool) -> str:
    """Requests/s of the real server (engine on the tiny model, max_tokens=1), one in flight."""
    try:
        import tandem.server.app  # noqa: F401
    except ImportError as exc:
        return f"not measured: {exc}"
    try:
        server = BenchServer("--serve-real", use_uvloop)
    except RuntimeError as exc:
        return f"not measured: {exc}"
    try:
        rps = await drive(server.base, "/v1/completions", 1, duration_s, server.model, 1)
    except aiohttp.ClientError as exc:
        return f"not measured: {type(exc).__name__}: {exc}"
    finally:
        server.close()
    return f"{rps:,.1f} req/s (model {server.model}; bound by the model's forward, not the runtime)"


# -- report -----------------------------------------------------------------------------------


def _tiers_holding_17_anchors_a_pin_and_a_park():
    """The tiers after real turns on the third test model (16-row grid): a conversation of 280
    tokens (17 anchors), a compaction of it (its head pinned), another session (the compacted
    one parked); the rows in place then hold 17 anchors again."""
    from tandem.cache.memory import MemoryAccountant
    from tandem.cache.resident import ResidentPrefix
    from tandem.engine import Engine, SamplingParams
    from tandem.models.third import ThirdModel

    engine = Engine(ThirdModel(), window=2048, prefix_chunk=16)
    composer = ResidentPrefix(engine, MemoryAccountant(
        {level: 256 << 20 for level in ("anchors", "end", "stash", "park", "pin",
                                        "prompt_end")}), keep_newest=32)

    def turn(prompt, session):
        composer.begin(prompt, 2, session)
        out = engine.generate(prompt, SamplingParams(max_tokens=2), on_chunk=composer.on_chunk,
                              on_prefill=composer.on_prefill).token_ids
        composer.finish(prompt + out)

    def prompt(n, seed):
        return [(i * 7 + seed * 31 + 5) % 97 for i in range(n)]

    turn(prompt(280, 1), "a")
    turn(prompt(280, 2), "a")  # shares no chunk: a compaction, the old head pinned
    turn(prompt(280, 3), "b")  # another session: a's rows parked
    held, parked = composer.give_back()
    assert len(held.anchors.copies) == 17 and parked.pin.pinned and parked.park.parked
    return held, parked, list(engine.token_ids)


async def bench_plan(n: int) -> dict[str, float]:
    from tandem.actors.engine_actor import build_plan
    from tandem.actors.tier_messages import GenerationEnded, OfferTiers
    from tandem.actors.tiers import ParkActor, ResidentActor
    from tandem.cache.namespace import SHARED
    from tandem.cache.resident import (ParkOffer, ResidentOffer, Resume, choose, park_offer,
                                       resident_offer)

    held, parked, rows = _tiers_holding_17_anchors_a_pin_and_a_park()
    prompt = rows + [(i * 3) % 97 for i in range(40)]  # the conversation's next turn
    supervisor = Supervisor()
    resident = supervisor.add(ResidentActor("resident", holdings=held))
    park = supervisor.add(ParkActor("park", holdings=parked))
    await supervisor.start()
    times = []
    try:
        for i in range(n):
            t0 = time.perf_counter()
            r = await resident.ask(OfferTiers(f"r{i}", prompt, rows), 5.0)
            p = await park.ask(OfferTiers(f"r{i}", prompt, rows,
                                          rows_namespace=r.rows_namespace), 5.0)
            mine = ResidentOffer(Resume(r.start, r.source, guest=r.guest), r.shared,
                                 r.continuing, r.decisive)
            theirs = ParkOffer(p.pin_point, p.park_point)
            plan = build_plan(f"r{i}", prompt, 16, mine, theirs, choose(mine, theirs),
                              r.holdings, p.holdings)
            times.append(time.perf_counter() - t0)
            resident.try_tell(GenerationEnded(f"r{i}", "finished", rows, plan.resident))
            park.try_tell(GenerationEnded(f"r{i}", "finished", rows, plan.park))
    finally:
        await supervisor.stop()
    plain = []
    for _ in range(n):
        t0 = time.perf_counter()
        resident_offer(held, prompt, SHARED, rows)
        park_offer(parked, prompt, SHARED, rows, SHARED)
        plain.append(time.perf_counter() - t0)
    times.sort()
    plain.sort()
    return {"p50": times[len(times) // 2], "p99": times[int(len(times) * 0.99)],
            "plain_p50": plain[len(plain) // 2], "source": plan.source, "start": plan.start,
            "rows": len(rows)}


def us(seconds: float) -> str:
    return f"{seconds * 1e6:9.2f} us"


async def run(args: argparse.Namespace) -> None:
    n_ask = 5_000 if args.quick else 20_000
    n_tokens = 20_000 if args.quick else 100_000
    repeats = 3 if args.quick else 5
    duration_s = 1.0 if args.quick else 2.0
    loop_name = type(asyncio.get_running_loop()).__module__.split(".")[0]
    print(f"event loop: {loop_name}; python {sys.version.split()[0]}; best of {repeats} repeats\n")

    ask = await bench_ask(n_ask, repeats)
    print(f"ask round trip ({n_ask:,} asks)")
    print(f"  {'actor ask':34s}{us(ask['ask'])}")
    print(f"  {'plain await of a coroutine':34s}{us(ask['await'])}   ask / await = {ask['ask'] / ask['await']:8.1f}x")
    print(f"  {'plain function call':34s}{us(ask['call'])}   ask / call  = {ask['ask'] / ask['call']:8.1f}x")

    thread_ask = await bench_thread_ask(n_ask // 4, repeats)
    print(f"  {'ask from a worker thread, waited':34s}{us(thread_ask)}   thread / ask = "
          f"{thread_ask / ask['ask']:8.1f}x  (the store port's cost a call)")

    handoff = await bench_handoff(n_tokens, repeats)
    print(f"\nper-token hand-off, worker thread -> event loop ({n_tokens:,} tokens)")
    print(f"  {'call_soon_threadsafe + Queue.get':34s}{us(handoff['threaded'])}")
    print(f"  {'same-loop put_nowait + await get':34s}{us(handoff['same_loop'])}   "
          f"thread / loop = {handoff['threaded'] / handoff['same_loop']:8.1f}x")
    print(f"  {'plain function call on the thread':34s}{us(handoff['call'])}   "
          f"thread / call = {handoff['threaded'] / handoff['call']:8.1f}x")
    print(f"  {'one-way latency, one at a time':34s}p50 {handoff['latency_p50'] * 1e6:.1f} us, "
          f"p99 {handoff['latency_p99'] * 1e6:.1f} us")

    plan = await bench_plan(500 if args.quick else 2_000)
    print(f"\nthe prefill plan: offers from the resident and the park, the plan, the give-back "
          f"(17 anchors, a pin, a park; {plan['rows']} rows in place; resumes at "
          f"{plan['start']} from {plan['source']})")
    print(f"  {'p50 / p99 a request':34s}{us(plan['p50'])} / {plan['p99'] * 1e6:.2f} us   "
          f"(goal: p50 under 1,000 us)")
    print(f"  {'the same offers, plain calls, p50':34s}{us(plan['plain_p50'])}   "
          f"actors / plain = {plan['p50'] / plan['plain_p50']:8.1f}x")

    rows = await bench_http(args.concurrency, duration_s, 1 if args.quick else 2,
                            loop_name == "uvloop")
    print(f"\nPOST /v1/completions over loopback HTTP ({duration_s:.0f} s a point, client in this process)")
    print(f"  {'in flight':>9s} {'via actor req/s':>16s} {'no actor req/s':>15s} {'actor / plain':>14s}")
    for concurrency, actor_rps, plain_rps in rows:
        print(f"  {concurrency:9d} {actor_rps:16,.0f} {plain_rps:15,.0f} {actor_rps / plain_rps:14.2f}")
    if not args.no_real_app:
        real = await bench_real_app(duration_s, loop_name == "uvloop")
        print(f"\nthe whole tandem server (build_app), max_tokens=1, 1 in flight: {real}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer iterations (a smoke run)")
    ap.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")],
                    default=[1, 16], help="requests in flight, comma-separated (default 1,16)")
    ap.add_argument("--no-uvloop", action="store_true")
    ap.add_argument("--no-real-app", action="store_true",
                    help="skip the measurement of tandem.server.app.build_app on the tiny model")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--serve-real", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if not args.no_uvloop:
        install_uvloop()
    # The supervisor's start / stop lines would break up the table; warnings and errors still show.
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    if args.serve:
        asyncio.run(serve())
    elif args.serve_real:
        asyncio.run(serve_real())
    else:
        asyncio.run(run(args))


if __name__ == "__main__":
    main()
