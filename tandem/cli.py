"""``tandem``: serve, generate, replay. ``python -m tandem`` is the same program."""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time

from tandem.config import ConfigError, add_config_flags, load_config
from tandem.torch_thread import one_openmp_thread_here


def _generate_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("generate", help="generate from one prompt and exit",
                       description="Generate from one prompt on the engine (no server). The "
                                   "prompt is rendered with the model's chat template unless "
                                   "--raw or --prompt-ids is given.")
    p.add_argument("--prompt", default="Hello! Who are you?", help="the user message")
    p.add_argument("--prompt-ids", default=None,
                   help="comma-separated token ids, for a checkpoint without a tokenizer")
    p.add_argument("--raw", action="store_true", help="encode --prompt as is, no chat template")
    p.add_argument("--no-think", action="store_true", help="render with thinking off")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (the default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    add_config_flags(p)
    return p


def _serve_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("serve", help="run the OpenAI-compatible server",
                       description="Serve the model over an OpenAI-compatible HTTP API.")
    p.add_argument("--record", dest="record_dir", default=None, metavar="DIR",
                   help="record every request for `tandem replay` (the record_dir knob)")
    add_config_flags(p)
    return p


def _prompt_ids(args, loaded) -> list[int]:
    from tandem.models.chat import encode_chat

    if args.prompt_ids:
        try:
            return [int(x) for x in args.prompt_ids.split(",") if x.strip()]
        except ValueError:
            raise SystemExit("tandem generate: --prompt-ids takes comma-separated integers")
    if loaded.tokenizer is None:
        raise SystemExit("tandem generate: this checkpoint has no tokenizer; pass --prompt-ids")
    if args.raw:
        return loaded.tokenizer.encode(args.prompt)
    return encode_chat(loaded.tokenizer, [{"role": "user", "content": args.prompt}],
                       enable_thinking=not args.no_think)


INDEX_WAIT_S = 0.5  # the longest generate waits for the suffix array before it starts


def _open_suffix_store(config, loaded):
    """The suffix store for a one-shot generation; None when it is off, the checkpoint has no
    tokenizer, or the store is refused (said on stderr). Its suffix array is built on a thread
    of its own (seconds for a big store; the sort releases the GIL) and swapped in when ready:
    until then the drafter drafts from the prompt alone."""
    from tandem.cache.suffix import PersistentSuffixStore, SuffixStoreError

    spec = config.speculation
    if spec.speculation == "off" or not spec.suffix_store or loaded.tokenizer is None:
        return None
    try:
        store = PersistentSuffixStore(config.suffix_store_path(),
                                      tokenizer_sha256=loaded.tokenizer.sha256,
                                      cap_mb=spec.suffix_store_mb, scope=spec.suffix_store_scope,
                                      readonly=spec.suffix_store_readonly)
    except (SuffixStoreError, OSError) as exc:
        print(f"tandem generate: suffix store refused: {exc}", file=sys.stderr)
        return None
    if store.needs_rebuild:
        def build() -> None:
            one_openmp_thread_here()  # the sort's regions off the engine's team
            t0 = time.perf_counter()
            index = store.build_index()
            store.swap(index, (time.perf_counter() - t0) * 1000)

        thread = threading.Thread(target=build, name="tandem-suffix-index", daemon=True)
        thread.start()
        thread.join(timeout=INDEX_WAIT_S)  # a small store (1M tokens: 0.2 s) is ready at once
    return store


def generate_main(args) -> int:
    from tandem.devices import engine_device
    from tandem.engine import Engine, SamplingParams
    from tandem.logs import configure_logging
    from tandem.models import load_model
    from tandem.models.base import ModelError
    from tandem.models.graphs import engine_graphs

    config = load_config(cli_args=args)
    configure_logging(config.log_level)
    try:
        device = engine_device(config)
        engine_graphs(config, device)
        loaded = load_model(config.server.model, config.models_dir(), config.engine.dtype,
                            device, config.engine.cuda_graphs)
        prompt = _prompt_ids(args, loaded)
        engine = Engine(loaded.model, window=config.engine.window,
                        prefix_chunk=config.engine.prefix_chunk,
                        num_threads=config.engine.num_threads)
        stops = tuple(loaded.tokenizer.eos_ids) if loaded.tokenizer else ()
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                                stop_token_ids=stops)
        stream = None if args.json or loaded.tokenizer is None else loaded.tokenizer.stream_decoder()

        def on_token(token: int) -> bool:
            if stream is not None:
                sys.stdout.write(stream.push(token))
                sys.stdout.flush()
            return False

        store = _open_suffix_store(config, loaded)
        draft = None
        if config.speculation.speculation == "lookup":
            from tandem.cache.drafter import LookupDrafter

            draft = LookupDrafter(store).propose
        t0 = time.perf_counter()
        result = engine.generate(prompt, params, on_token=on_token, draft=draft,
                                 draft_max=config.speculation.draft_max)
        wall_ms = (time.perf_counter() - t0) * 1000
        if store is not None:
            store.add_request(prompt, result.token_ids)  # read-only beside a server: nothing
            store.close()
    except (ModelError, ValueError) as exc:
        print(f"tandem generate: {exc}", file=sys.stderr)
        return 2
    text = loaded.tokenizer.decode(result.token_ids) if loaded.tokenizer else None
    if args.json:
        print(json.dumps({
            "text": text, "token_ids": result.token_ids, "prompt_tokens": result.prompt_tokens,
            "completion_tokens": len(result.token_ids), "finish_reason": result.finish_reason,
            "prefill_ms": round(result.prefill_ms, 2),
            "decode_tok_s": round(result.decode_tok_s, 2), "wall_ms": round(wall_ms, 2),
            "num_threads": engine.num_threads, "model": loaded.name,
            "speculation": {"mode": config.speculation.speculation, "drafted": result.drafted,
                            "accepted": result.accepted}}))
    else:
        if stream is not None:
            sys.stdout.write(stream.finish())
            print()
        else:
            print(" ".join(map(str, result.token_ids)))
        print(f"[{result.prompt_tokens} prompt tokens, prefill {result.prefill_ms:.0f} ms, "
              f"{len(result.token_ids)} tokens at {result.decode_tok_s:.1f} tok/s, "
              f"{result.accepted}/{result.drafted} drafts accepted, "
              f"{result.finish_reason}]", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tandem", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _generate_parser(sub)
    _serve_parser(sub)
    from tandem.replay.main import add_replay_parser

    add_replay_parser(sub)
    args = parser.parse_args(argv)
    try:
        if args.command == "generate":
            return generate_main(args)
        if args.command == "replay":
            from tandem.replay.main import replay_main

            return replay_main(args)
        from tandem.serve import serve_main

        return serve_main(args)
    except ConfigError as exc:
        print(f"tandem: {exc}", file=sys.stderr)
        return 2
