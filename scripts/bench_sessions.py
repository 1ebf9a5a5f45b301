"""Every library session replayed in forced mode, caches on against off, in one process.

    .venv/bin/python scripts/bench_sessions.py [--only NAME] [tandem config flags: --model ...]

Prints one markdown table (the README's "Sessions" table): session, turns, tokens forwarded over
distinct tokens with the caches on and off, and the TTFT median on against off. Ratios, measured
side by side: an absolute time on a shared machine means little.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_setup import bench_config  # noqa: E402

from tandem.replay.main import replay  # noqa: E402
from tandem.replay.record import read_rows  # noqa: E402
from tandem.replay.runner import ratio  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", action="append", default=None,
                        help="a session file name (repeatable); default: all of sessions/")
    args, config, loaded = bench_config(parser)
    files = sorted(p for p in (ROOT / "sessions").iterdir()
                   if p.name.endswith((".jsonl", ".jsonl.gz")))
    if args.only:
        files = [p for p in files if p.name in args.only]
    print(f"model {loaded.name}, prefix_chunk {config.engine.prefix_chunk}, window "
          f"{config.engine.window}\n")
    print("| session | turns | forwarded / distinct, on | off | TTFT median on, ms | off, ms "
          "| on / off |\n|---|---:|---:|---:|---:|---:|---:|", flush=True)
    for path in files:
        t0 = time.perf_counter()
        doc = asyncio.run(replay(read_rows(path), config, mode="forced", compare=True,
                                 loaded=loaded))
        on, off = doc["on"]["totals"], doc["off"]["totals"]
        m_on, m_off = on["ttft_ms_median"], off["ttft_ms_median"]
        errors = on["errors"] + off["errors"]
        name = path.name.split(".")[0] + (f" ({errors} errors)" if errors else "")
        print(f"| {name} | {len(doc['on']['turns'])} | "
              f"{ratio(on['forwarded'], on['distinct'])} | "
              f"{ratio(off['forwarded'], off['distinct'])} | {m_on:.0f} | {m_off:.0f} | "
              f"{m_on / m_off:.2f} |", flush=True)
        print(f"{path.name}: {time.perf_counter() - t0:.0f} s, sources on {on['sources']}, "
              f"off {off['sources']}", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
