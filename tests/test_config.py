"""The config tree: one knob, three spellings, one precedence, and no silent bad values."""

import argparse
import tomllib
from pathlib import Path

import msgspec
import pytest

from tandem.config import (
    KNOBS, Config, ConfigError, add_config_flags, default_home, default_toml, knobs, load_config,
)

REPO = Path(__file__).resolve().parents[1]
DEFAULT_TOML = REPO / "config" / "tandem.toml"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "tandem.toml"
    path.write_text(text)
    return path


def test_config_tandem_toml_is_the_struct_defaults_written_out():
    assert DEFAULT_TOML.read_text() == default_toml()
    with open(DEFAULT_TOML, "rb") as f:
        assert tomllib.load(f) == msgspec.to_builtins(Config())
    env = {"HOME": "/h"}
    assert load_config(DEFAULT_TOML, env=env) == load_config(env=env)


def test_every_knob_has_a_doc_a_flag_and_an_env_variable_derived_from_its_name():
    parser = argparse.ArgumentParser()
    add_config_flags(parser)
    flags = {opt for action in parser._actions for opt in action.option_strings}
    names = [k.name for k in knobs()]
    assert len(names) == len(set(names))
    for knob in knobs():
        assert knob.doc
        assert knob.flag == "--" + knob.name.replace("_", "-") and knob.flag in flags
        assert knob.env == "TANDEM_" + knob.name.upper()
    assert KNOBS["prefix_chunk"].toml == "[engine] prefix_chunk"


def test_file_then_environment_then_command_line_override_each_other(tmp_path):
    path = write(tmp_path, "[engine]\nprefix_chunk = 256\nwindow = 4096\n")
    env = {"TANDEM_PREFIX_CHUNK": "512", "TANDEM_PORT": "9000", "HOME": "/h"}
    assert load_config(env={"HOME": "/h"}).engine.prefix_chunk == 1024
    assert load_config(path, env={"HOME": "/h"}).engine.prefix_chunk == 256
    config = load_config(path, env=env)
    assert (config.engine.prefix_chunk, config.engine.window, config.server.port) == (512, 4096,
                                                                                       9000)
    config = load_config(path, env=env, cli_args=["--prefix-chunk", "2048", "--no-end-anchor"])
    assert config.engine.prefix_chunk == 2048
    assert config.engine.window == 4096 and config.server.port == 9000
    assert config.cache.end_anchor is False


def test_a_parsed_namespace_and_a_mapping_are_command_line_values(tmp_path):
    parser = argparse.ArgumentParser()
    parser.add_argument("--other")  # a subcommand's own argument is not a knob
    add_config_flags(parser)
    ns = parser.parse_args(["--resident-gb", "0.5", "--log-level", "debug", "--other", "x"])
    config = load_config(env={"HOME": "/h"}, cli_args=ns)
    assert config.cache.resident_gb == 0.5 and config.log_level == "debug"
    assert config.cache.cache_gb == 2.0
    assert load_config(env={"HOME": "/h"}, cli_args={"queue_limit": 3}).server.queue_limit == 3


def test_config_file_comes_from_the_flag_or_the_environment(tmp_path):
    path = write(tmp_path, "[server]\nport = 1234\n")
    assert load_config(env={"TANDEM_CONFIG": str(path), "HOME": "/h"}).server.port == 1234
    assert load_config(env={"HOME": "/h"}, cli_args=["--config", str(path)]).server.port == 1234


@pytest.mark.parametrize("source", ["toml", "env", "cli"])
def test_a_bad_value_is_an_error_naming_the_knob_in_its_three_spellings(tmp_path, source):
    kwargs = {
        "toml": {"path": write(tmp_path, "[cache]\nresident_gb = -1.0\n"), "env": {}},
        "env": {"env": {"TANDEM_RESIDENT_GB": "lots"}},
        "cli": {"env": {}, "cli_args": {"resident_gb": "-2"}},
    }[source]
    with pytest.raises(ConfigError) as e:
        load_config(**kwargs)
    message = str(e.value)
    for spelling in ("`resident_gb`", "[cache] resident_gb", "--resident-gb", "TANDEM_RESIDENT_GB"):
        assert spelling in message


def test_a_bad_flag_value_is_refused_while_parsing(capsys):
    parser = argparse.ArgumentParser()
    add_config_flags(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--port", "70000"])
    assert "TANDEM_PORT" in capsys.readouterr().err


@pytest.mark.parametrize("text, expected", [
    ("[server]\nprot = 1\n", "[server] prot"),
    ("[engine]\nport = 1\n", "it belongs in [server] port"),
    ("window = 5\n", "it belongs in [engine] window"),
    ("[server]\nport = \"8000\"\n", "--port"),
    ("[engine]\nwindow = 1.5\n", "--window"),
    ("[server\n", "not valid TOML"),
])
def test_unknown_misplaced_or_mistyped_toml_keys_are_errors(tmp_path, text, expected):
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, text), env={})
    assert expected in str(e.value)


def test_a_literal_knob_takes_only_its_choices():
    with pytest.raises(ConfigError, match="TANDEM_DTYPE"):
        load_config(env={"TANDEM_DTYPE": "float64"})
    assert load_config(env={"TANDEM_DTYPE": "bfloat16"}).engine.dtype == "bfloat16"


def test_every_file_lives_under_home(tmp_path):
    config = load_config(env={"XDG_CACHE_HOME": str(tmp_path)})
    assert config.home_path() == tmp_path / "tandem"
    assert config.models_dir() == tmp_path / "tandem" / "models"
    assert config.journal_path() == tmp_path / "tandem" / "journal.jsonl"
    assert config.record_path() is None
    assert load_config(env={"HOME": "/h"}).home_path() == Path("/h/.cache/tandem")
    assert default_home({"HOME": "/h"}) == Path("/h/.cache/tandem")
    config = load_config(env={"TANDEM_HOME": str(tmp_path / "a"), "TANDEM_RECORD_DIR": "rec"})
    assert config.journal_path() == tmp_path / "a" / "journal.jsonl"
    assert config.record_path() == tmp_path / "a" / "rec"


def test_config_is_frozen():
    with pytest.raises(AttributeError):
        Config().log_level = "debug"
