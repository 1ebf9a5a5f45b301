"""Decode tokens/s with a JSON schema against without, side by side in one run (issue 18, part
5; goal: 0.9 or more).

The same engine and prompt decode ``--max-tokens`` tokens free and under a grammar, alternately
``--repeats`` times (the median of each is printed, so a neighbour's load on a shared machine
falls on both), for three cases:

- ``string``: a schema whose one field is a free string: the grammar mostly allows the raw
  argmax, and greedy computes no mask (the shortcut);
- ``records``: an array of records of enums, bounded integers and booleans: nearly every
  position of the random model's output is refused and masked;
- ``records sampled``: the same at temperature 0.8 (every position masked and drawn).

Each case prints tokens per second of wall time and per second of CPU time (the process's,
every torch thread: on a machine shared with other work, descheduled time falls out of it), the
ratio of each, how many positions computed a full mask (``masks``) and the grammar's own
microseconds a token (its matcher, masks and checks, timed inside; the sampler's own argmax
or draw runs inside it too, so sampled rows count the draw that free decoding also pays). The mask runs on the engine
thread, after the logits processors. The model is random (``tiny`` by default), so the text is
noise, but the grammar's work per token is what a real model's would be.

    .venv/bin/python scripts/bench_structured.py [--max-tokens 128] [--repeats 3]
        [tandem config flags: --model ...]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tandem.config import add_config_flags, load_config  # noqa: E402
from tandem.engine import Engine, SamplingParams  # noqa: E402
from tandem.grammar import TokenGrammar, from_lark  # noqa: E402
from tandem.logs import configure_logging  # noqa: E402
from tandem.models import load_model  # noqa: E402
from tandem.models.chat import encode_chat  # noqa: E402
from tandem.models.structured import build_lark  # noqa: E402

RECORD = {"type": "object", "additionalProperties": False,
          "required": ["city", "days", "sunny"],
          "properties": {"city": {"enum": ["Paris", "Rome", "Oslo", "Lima"]},
                         "days": {"type": "integer", "minimum": 1, "maximum": 30},
                         "sunny": {"type": "boolean"}}}
SCHEMAS = {
    "string": {"type": "object", "required": ["notes"], "additionalProperties": False,
               "properties": {"notes": {"type": "string"}}},
    "records": {"type": "object", "required": ["trips"], "additionalProperties": False,
                "properties": {"trips": {"type": "array", "items": RECORD, "minItems": 40}}},
}


class Timed(TokenGrammar):
    """The grammar with its own time kept: every call the engine makes of it."""

    spent_s = 0.0

    def choose(self, *args, **kw):
        t0 = time.perf_counter()
        try:
            return super().choose(*args, **kw)
        finally:
            self.spent_s += time.perf_counter() - t0

    def complete(self, *args, **kw):
        t0 = time.perf_counter()
        try:
            return super().complete(*args, **kw)
        finally:
            self.spent_s += time.perf_counter() - t0


def run(engine, prompt, params, grammar=None) -> tuple[float, float, int]:
    """(wall tok/s of decoding, CPU tok/s of the whole generation, tokens)."""
    c0 = time.process_time()
    result = engine.generate(prompt, params, **({"grammar": grammar} if grammar else {}))
    cpu_s = time.process_time() - c0
    n = len(result.token_ids)
    return result.decode_tok_s, n / cpu_s if cpu_s > 0 else 0.0, n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    add_config_flags(parser)
    args = parser.parse_args()
    config = load_config(cli_args=args)
    configure_logging(args.log_level or "warning")
    loaded = load_model(config.server.model, config.models_dir(), config.engine.dtype)
    tok = loaded.tokenizer
    engine = Engine(loaded.model, window=4096, prefix_chunk=config.engine.prefix_chunk,
                    num_threads=config.engine.num_threads)
    prompt = encode_chat(tok, [{"role": "user", "content": "List some trips as JSON."}],
                         enable_thinking=False)
    print(f"model {loaded.name}, {args.max_tokens} tokens a run, median of {args.repeats}")
    print(f"{'case':<17}{'free tok/s':>11}{'schema':>8}{'ratio':>7}{'free cpu':>10}"
          f"{'schema':>8}{'ratio':>7}{'tokens':>8}{'masks':>7}{'us/tok':>8}")
    for case, schema_name, temperature in (("string", "string", 0.0),
                                           ("records", "records", 0.0),
                                           ("records sampled", "records", 0.8)):
        grammar = from_lark(build_lark(thinking=False, special_ids=tok.special_ids,
                                       response_format={"type": "json_schema", "json_schema": {
                                           "name": schema_name,
                                           "schema": SCHEMAS[schema_name]}}))
        params = SamplingParams(max_tokens=args.max_tokens, temperature=temperature, seed=1,
                                stop_token_ids=tuple(tok.eos_ids))
        free, held = [], []
        engine.generate(prompt, params)  # warm: the prompt's rows in place for both
        for _ in range(args.repeats):
            free.append(run(engine, prompt, params))
            constrained = Timed(tok, grammar)
            held.append(run(engine, prompt, params, constrained))
        fw, fc = (statistics.median(r[i] for r in free) for i in (0, 1))
        hw, hc = (statistics.median(r[i] for r in held) for i in (0, 1))
        tokens = held[-1][2]
        per_token_us = constrained.spent_s / max(tokens, 1) * 1e6
        print(f"{case:<17}{fw:>11.1f}{hw:>8.1f}{hw / fw:>7.2f}{fc:>10.1f}{hc:>8.1f}"
              f"{hc / fc:>7.2f}{tokens:>8}{constrained.masks:>7}{per_token_us:>8.0f}")


if __name__ == "__main__":
    main()
