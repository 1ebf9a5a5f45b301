"""`tandem replay FILE`: replay a recording or a library session, print where tokens came from.

Without ``--url`` the server runs in this process (`build_app` on a free port of 127.0.0.1,
with the config's model and home; forced mode turns allow_forced_output on for it), and a
``{"restart": true}`` row restarts it. ``--compare`` replays twice in one process, caches on and
then off (the `caches` knob), and prints both and their ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import msgspec

from tandem.config import Config, load_config
from tandem.replay.record import read_rows
from tandem.replay.runner import (
    MODES,
    InProcessServer,
    Replayer,
    UrlTarget,
    format_compare,
    format_table,
    report,
)


def add_replay_parser(sub) -> argparse.ArgumentParser:
    from tandem.config import add_config_flags

    p = sub.add_parser("replay", help="replay a recorded session and report its caches",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("file", help="a recording (serve --record-dir) or a sessions/*.jsonl file")
    p.add_argument("--url", default=None,
                   help="a running server (http://HOST:PORT); default: one in this process")
    p.add_argument("--mode", choices=MODES, default="verbatim",
                   help="verbatim: the bodies as recorded; forced: the engine writes each "
                        "recorded answer (the server must allow_forced_output)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--compare", action="store_true",
                   help="replay caches on, then off, in this process, and print the ratios")
    p.add_argument("--max-tokens", type=int, default=256,
                   help="cap on what a request generates where no answer is forced "
                        "(0: as recorded)")
    add_config_flags(p)
    return p


def replay_main(args: argparse.Namespace) -> int:
    from tandem.logs import configure_logging

    config = load_config(cli_args=args)
    # A replayed session must not write itself into the suffix store it may later be measured
    # against (spec: a store that has seen a benchmark's prompts inflates it).
    config = msgspec.structs.replace(config, speculation=msgspec.structs.replace(
        config.speculation, suffix_store_readonly=True))
    # The table goes to stdout; the server's info lines would bury it.
    configure_logging(args.log_level or "warning")
    if args.compare and args.url:
        print("tandem replay: --compare runs its own servers; drop --url", file=sys.stderr)
        return 2
    try:
        rows = read_rows(args.file)
    except (OSError, ValueError) as e:
        print(f"tandem replay: {e}", file=sys.stderr)
        return 2
    result = asyncio.run(replay(rows, config, mode=args.mode, url=args.url,
                                compare=args.compare, max_tokens=args.max_tokens or None))
    if args.json:
        print(json.dumps(result))
    elif args.compare:
        print("caches on\n" + format_table_doc(result["on"]))
        print("\ncaches off\n" + format_table_doc(result["off"]))
        print(format_compare(result["on"], result["off"]))
    else:
        print(format_table_doc(result))
    docs = [result["on"], result["off"]] if args.compare else [result]
    return 1 if any(d["totals"]["errors"] for d in docs) else 0


def format_table_doc(doc: dict[str, Any]) -> str:
    from tandem.replay.runner import Turn

    return format_table([Turn(**t) for t in doc["turns"]], doc["totals"])


async def replay(rows: list[dict[str, Any]], config: Config, *, mode: str = "verbatim",
                 url: str | None = None, compare: bool = False, loaded: Any = None,
                 max_tokens: int | None = 256) -> dict[str, Any]:
    """The report of one replay (``{"turns", "totals"}``), or with ``compare``
    ``{"on": ..., "off": ...}``. ``loaded``: the model to serve in process (None: load the
    config's); with ``url`` it only lends its tokenizer."""
    if url is not None:
        tokenizer, template = _url_tokenizer(config, loaded)
        replayer = Replayer(rows, mode=mode, tokenizer=tokenizer, template=template,
                            max_tokens=max_tokens)
        async with UrlTarget(url) as target:
            return report(await replayer.run(target))
    if loaded is None:
        from tandem.devices import engine_device
        from tandem.models import load_model

        loaded = load_model(config.server.model, config.models_dir(), config.engine.dtype,
                            engine_device(config))
    server = config.server
    if mode == "forced":
        server = msgspec.structs.replace(server, allow_forced_output=True)
    config = msgspec.structs.replace(config, server=msgspec.structs.replace(
        server, host="127.0.0.1", port=0))

    async def once(cfg: Config) -> dict[str, Any]:
        replayer = Replayer(rows, mode=mode, tokenizer=loaded.tokenizer,
                            template=getattr(loaded.tokenizer, "chat_template", None),
                            max_tokens=max_tokens)
        async with InProcessServer(cfg, loaded) as target:
            return report(await replayer.run(target))

    if not compare:
        return await once(config)
    on = await once(msgspec.structs.replace(
        config, cache=msgspec.structs.replace(config.cache, caches=True)))
    off = await once(msgspec.structs.replace(
        config, cache=msgspec.structs.replace(config.cache, caches=False), server=
        msgspec.structs.replace(config.server, record_dir="")))
    return {"on": on, "off": off}


def _url_tokenizer(config: Config, loaded: Any) -> tuple[Any, str | None]:
    """The tokenizer that counts a foreign server's prompts: the given model's, else tiny's
    vocabulary (tandem's default model), written under home once."""
    if loaded is not None:
        return loaded.tokenizer, getattr(loaded.tokenizer, "chat_template", None)
    from tandem.models.tokenizer import load_tokenizer, write_qwen_tokenizer

    folder = Path(config.models_dir()) / "tokenizer"
    if not (folder / "tokenizer_config.json").is_file():
        write_qwen_tokenizer(folder)
    return load_tokenizer(folder), None
