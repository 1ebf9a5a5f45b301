"""What the replay benchmarks (bench_sessions.py, bench_compaction.py) set up alike: the
config from their command line, without the suffix store, and the model it names."""

from __future__ import annotations

import argparse

import msgspec

from tandem.config import Config, add_config_flags, load_config
from tandem.devices import engine_device
from tandem.logs import configure_logging
from tandem.models import LoadedModel, load_model


def bench_config(parser: argparse.ArgumentParser
                 ) -> tuple[argparse.Namespace, Config, LoadedModel]:
    """``parser``'s arguments with the tandem config flags, the config they give and its model
    loaded; logging at warning unless ``--log-level`` says otherwise."""
    add_config_flags(parser)
    args = parser.parse_args()
    config = load_config(cli_args=args)
    # Benchmarks run without the suffix store: one that has seen these sessions (a former run,
    # real traffic) would draft their answers and inflate the figures (spec).
    config = msgspec.structs.replace(config, speculation=msgspec.structs.replace(
        config.speculation, suffix_store=False))
    configure_logging(args.log_level or "warning")
    return args, config, load_model(config.server.model, config.models_dir(), config.engine.dtype,
                                    engine_device(config))
