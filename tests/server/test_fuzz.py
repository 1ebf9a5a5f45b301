"""Property-based fuzzing of the whole server: whatever a client sends to any route, the answer
is never a 5xx (a 503 with Retry-After is fine), every error is in the OpenAI format (in a
stream too), a stream ends with [DONE], and the server is still alive after the case.

The cases come from scripts/fuzzcases.py, the generators scripts/fuzz_server.py runs by the
thousand against a real server. Hypothesis draws a seed per example and the generators draw
from ``random.Random(seed)``: handing them ``st.randoms()`` instead made 41 distinct cases out
of 130 (its draws cluster near zero), a seed makes 130. A seed's case is not shrunk (a smaller
seed is just another case); the failing case is printed as a curl line (``note``), and
``derandomize`` makes CI run the same seeds every time. To replay the seed hypothesis names:
``fuzzcases.generation_case(random.Random(seed), "small", route=..., max_tokens=MAX_TOKENS,
long_max=LONG_MAX)`` (or the test's own generator) gives its case again.

The server is `tandem serve`'s own coroutine (tandem.serve.serve) over the small real model, on
its own loop in a thread, one per test function; after a case that went wrong it is started
again if it died, so that one fatal case does not fail every later example.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import random
import sys
import threading
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, given, note, settings
from hypothesis import strategies as st

from tandem.serve import serve

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import fuzzcases  # noqa: E402

HOST = "127.0.0.1"
WINDOW = 128  # a long prompt is refused fast, and a clamped max_tokens decodes little
BODY_LIMIT = 64 * 1024
MAX_TOKENS = 3
LONG_MAX = 8 * 1024  # the longest generated string: within the body limit, past the window
CASE_TIMEOUT_S = 20.0  # an answer later than this counts as a frozen server
START_TIMEOUT_S = 120.0

FUZZ = settings(deadline=None, derandomize=True, database=None, print_blob=False,
                phases=[Phase.explicit, Phase.generate],
                # one server serves every example of a test: that is the point
                suppress_health_check=[HealthCheck.function_scoped_fixture])
SEEDS = st.integers(0, 2 ** 64 - 1)


class ThreadServer:
    """tandem.serve.serve on a loop of its own in a thread, bound to a free loopback port."""

    def __init__(self, config, loaded) -> None:
        self.config = config
        self.loaded = loaded
        self.starts = 0
        self.thread: threading.Thread | None = None
        self.port = 0

    def start(self) -> None:
        ready: concurrent.futures.Future[int] = concurrent.futures.Future()

        async def main() -> int:
            self.loop = asyncio.get_running_loop()
            self.stop_event = asyncio.Event()
            bound = self.loop.create_future()
            bound.add_done_callback(lambda f: ready.set_result(f.result()))
            return await serve(self.config, self.loaded, ready=bound, stop=self.stop_event)

        def run() -> None:
            try:
                asyncio.run(main())
            except BaseException as e:  # a failed start must not leave the test waiting
                if not ready.done():
                    ready.set_exception(e)
                raise
            if not ready.done():
                ready.set_exception(RuntimeError("the server stopped before it listened"))

        self.thread = threading.Thread(target=run, name="fuzz-server", daemon=True)
        self.thread.start()
        self.port = ready.result(timeout=START_TIMEOUT_S)
        self.starts += 1

    def alive(self) -> bool:
        return self.thread is not None and self.thread.is_alive() and \
            fuzzcases.healthy(HOST, self.port)

    def settle(self, timeout_s: float) -> None:
        """After a case that went wrong: give a server on its way down the time to get there
        (an engine fault stops it a moment after its answer), then start a fresh one if it
        died."""
        if self.thread is not None and timeout_s > 0:
            self.thread.join(timeout_s)
        if not self.alive():
            self.close()
            self.start()

    def close(self) -> None:
        if self.thread is None:
            return
        if self.thread.is_alive():
            self.loop.call_soon_threadsafe(self.stop_event.set)
            self.thread.join(60)  # a frozen server stays behind as a daemon thread
        self.thread = None


@pytest.fixture
def server(small_loaded, make_config):
    s = ThreadServer(make_config(port=0, window=WINDOW, max_body_bytes=BODY_LIMIT), small_loaded)
    s.start()
    yield s
    s.close()


def check(server: ThreadServer, case: fuzzcases.Case) -> None:
    """The property, for one case: a sound answer, then a live server."""
    note(case.describe())
    try:
        answer = fuzzcases.send(case, HOST, server.port, timeout_s=CASE_TIMEOUT_S)
    except OSError as e:
        answer = None
        note(f"connection failed: {e!r}")
    found = fuzzcases.problems(case, answer)
    if not found and not server.alive():
        found.append("the server is dead after this case")
    if found:
        note(f"answer: {answer.status if answer else None} {answer.body[:300] if answer else ''}")
        server.settle(0.5 if answer is None or answer.status >= 500 else 0.0)
    assert not found, "; ".join(found)


def fuzz_model(server: ThreadServer) -> str:
    return server.loaded.name


@settings(FUZZ, max_examples=130)
@given(seed=SEEDS)
def test_no_chat_request_gets_a_5xx_or_takes_the_server_down(server, seed):
    rng = random.Random(seed)
    check(server, fuzzcases.generation_case(rng, fuzz_model(server), route="/v1/chat/completions",
                                            max_tokens=MAX_TOKENS, long_max=LONG_MAX))


@settings(FUZZ, max_examples=90)
@given(seed=SEEDS)
def test_no_completion_request_gets_a_5xx_or_takes_the_server_down(server, seed):
    rng = random.Random(seed)
    check(server, fuzzcases.generation_case(rng, fuzz_model(server), route="/v1/completions",
                                            max_tokens=MAX_TOKENS, long_max=LONG_MAX))


@settings(FUZZ, max_examples=100)
@given(seed=SEEDS)
def test_no_request_to_the_admin_and_other_routes_gets_a_5xx(server, seed):
    """Memory limits, every GET, model lookups, unknown paths and wrong methods."""
    rng = random.Random(seed)
    case = fuzzcases.limits_case(rng) if rng.random() < 0.4 else \
        fuzzcases.route_case(rng, fuzz_model(server))
    check(server, case)


@settings(FUZZ, max_examples=60)
@given(seed=SEEDS)
def test_no_tokenize_or_detokenize_body_gets_a_5xx(server, seed):
    """Every form of /tokenize and /detokenize with hostile values, forms mixed, wrong types."""
    rng = random.Random(seed)
    check(server, fuzzcases.tokenize_case(rng, fuzz_model(server)))


@settings(FUZZ, max_examples=40)
@given(seed=SEEDS)
def test_no_image_part_gets_a_5xx(server, seed):
    """Hostile image_url parts: garbage, truncated or foreign payloads, a claimed huge canvas,
    other schemes, wrong shapes: each a 4xx naming its part."""
    rng = random.Random(seed)
    check(server, fuzzcases.image_case(rng, fuzz_model(server)))


@settings(FUZZ, max_examples=80)
@given(seed=SEEDS)
def test_no_malformed_body_gets_a_5xx(server, seed):
    """Random bytes, truncated, non-object or deeply nested JSON, a wrong Content-Type."""
    rng = random.Random(seed)
    check(server, fuzzcases.malformed_case(rng, fuzz_model(server), body_limit=BODY_LIMIT))


def test_a_seed_draws_the_same_cases_every_time():
    """scripts/fuzz_server.py --seed replays a run: the generators draw only from their rng."""
    def draw(seed: int) -> list[str]:
        rng = random.Random(seed)
        return [fuzzcases.http_case(rng, "small").describe() for _ in range(200)] + \
            [fuzzcases.raw_case(rng, "small", "127.0.0.1:1").describe() for _ in range(50)]

    assert draw(7) == draw(7)
    assert draw(7) != draw(8)


def test_numbers_no_float_holds_are_written_as_json_numbers():
    text = fuzzcases.dumps({"t": fuzzcases.Raw("1e999"), "x": float("inf"),
                            "n": [float("nan"), -0.0]})
    assert text == '{"t": 1e999, "x": 1e999, "n": [NaN, -0.0]}'


def test_the_fuzz_script_refuses_a_host_that_is_not_loopback():
    import fuzz_server

    assert fuzz_server.loopback_target("http://127.0.0.1:8000") == ("127.0.0.1", 8000)
    assert fuzz_server.loopback_target("http://localhost:9")[1] == 9
    for url in ("http://10.0.0.1:8000", "http://192.168.1.1", "https://127.0.0.1:1",
                "ftp://127.0.0.1"):
        with pytest.raises(SystemExit, match="loopback|http://"):
            fuzz_server.loopback_target(url)
