"""EngineArgs from YAML files, CLI flags and kwargs: errors name the key and the file;
precedence is defaults < file < flags / kwargs. Host only (no engine is built)."""
from __future__ import annotations

from pathlib import Path

import pytest

from jaxserve.cli import build_parser
from jaxserve.config import ConfigError, EngineArgs
from jaxserve.cli_args import engine_args_from_cli

REPO = Path(__file__).resolve().parents[2]


def _yaml(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "engine.yaml"
    p.write_text(text)
    return p


def _cli(*argv: str) -> EngineArgs:
    ns = build_parser().parse_args(["serve", *argv])
    return engine_args_from_cli(ns, model=ns.model_pos)


@pytest.mark.parametrize("text, needle", [
    ("max_num_seq: 8\n", "unknown key 'max_num_seq'"),
    ("max_num_seqs: eight\n", "max_num_seqs: expected int, got str"),
    ("enable_prefix_caching: 1\n", "enable_prefix_caching: expected bool"),
    ("token_buckets: 64\n", "token_buckets: expected list"),
    ("block_size: null\n", "block_size: may not be null"),
    ("max_num_seqs: 0\n", "max_num_seqs: 0 is below the minimum 1"),
    ("port: 70000\n", "port: 70000 is above the maximum 65535"),
    ("kv_cache_memory_fraction: 1.5\n", "kv_cache_memory_fraction: 1.5 is above the maximum"),
    ("dtype: float16\n", "dtype: 'float16' is not one of"),
    ("block_size: 64\nmax_num_batched_tokens: 32\n", "must be at least block_size (64)"),
    ("token_buckets: [16, 0]\n", "every bucket must be a positive int"),
    ("- max_num_seqs: 8\n", "must be a mapping"),
    ("max_num_seqs: [\n", "is not valid YAML"),
])
def test_bad_config_file_names_key_and_file(tmp_path, text, needle):
    p = _yaml(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        EngineArgs.from_sources(p)
    assert needle in str(e.value) and str(p) in str(e.value)


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        EngineArgs.from_sources(tmp_path / "nope.yaml")
    # the CLI reports it as a usage error (exit status 2), not a traceback
    from jaxserve.cli import main
    assert main(["serve", "--config", str(tmp_path / "nope.yaml")]) == 2


def test_empty_file_is_all_defaults(tmp_path):
    assert EngineArgs.from_sources(_yaml(tmp_path, "")) == EngineArgs()


def test_file_values_dashes_and_int_as_float(tmp_path):
    a = EngineArgs.from_sources(_yaml(tmp_path, "max-num-seqs: 8\nshutdown_timeout: 3\n"
                                                "token_buckets: [16, 64]\n"))
    assert (a.max_num_seqs, a.token_buckets) == (8, [16, 64])
    assert a.shutdown_timeout == 3.0 and isinstance(a.shutdown_timeout, float)


def test_kwargs_override_file(tmp_path):
    p = _yaml(tmp_path, "max_num_seqs: 8\nblock_size: 32\n")
    a = EngineArgs.from_sources(p, max_num_seqs=4)
    assert (a.max_num_seqs, a.block_size) == (4, 32)
    with pytest.raises(ConfigError, match="unknown setting"):
        EngineArgs.from_sources(p, max_num_seq=4)
    # an override is validated too, and the message names the file it was merged with
    with pytest.raises(ConfigError, match=f"max_num_seqs: 0 is below.*{p}"):
        EngineArgs.from_sources(p, max_num_seqs=0)


def test_cli_flags_override_file(tmp_path):
    p = _yaml(tmp_path, "max_num_seqs: 8\nenable_prefix_caching: true\nblock_size: 32\n"
                        "token_buckets: [16]\nmodel: /from/file\n")
    a = _cli("--config", str(p), "--max-num-seqs", "4", "--no-enable-prefix-caching",
             "--token-buckets", "32", "128")
    assert (a.max_num_seqs, a.enable_prefix_caching, a.token_buckets) == (4, False, [32, 128])
    assert a.block_size == 32 and a.model == "/from/file"      # not given: the file wins
    assert _cli("/from/flag", "--config", str(p)).model == "/from/flag"
    assert _cli().max_num_seqs == EngineArgs().max_num_seqs    # neither: the default


def test_cli_flag_values_are_checked(capsys):
    with pytest.raises(SystemExit):            # argparse: not an int
        build_parser().parse_args(["serve", "--max-num-seqs", "many"])
    with pytest.raises(SystemExit):            # argparse: not a choice
        build_parser().parse_args(["serve", "--dtype", "float16"])
    with pytest.raises(ConfigError, match="max_num_seqs: 0 is below"):
        _cli("--max-num-seqs", "0")
    capsys.readouterr()


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_engine_configs_load(path):
    a = EngineArgs.from_sources(path)
    assert a.max_num_batched_tokens >= a.block_size


def test_cpu_default_config_is_the_default():
    # The file spells out what the "auto" defaults resolve to on CPU for the default model
    # (max_model_len: min(8192, 2048)); everything else must equal the built-in default.
    assert EngineArgs.from_sources(REPO / "configs" / "cpu_default.yaml").replace(
        kv_cache_memory=None, attention_backend=None, dtype="auto", step_mode="auto",
        max_model_len=None, decode_steps=0) == EngineArgs()


@pytest.mark.parametrize("name", ["tpu_v5e-8_llama3-8b.yaml", "tpu_v6e-8_llama3-8b.yaml"])
def test_tpu_config_sharding_rules_resolve_beside_the_file(name, tmp_path, monkeypatch):
    """A TPU config loads from any working directory: its sharding_rules path is read
    relative to the config file, and the rules file it names parses."""
    from jaxserve.parallel.rules import ShardingRules
    monkeypatch.chdir(tmp_path)
    args = EngineArgs.from_sources(REPO / "configs" / name)
    rules = Path(args.sharding_rules)
    assert rules.is_absolute() and rules.is_file(), rules
    assert rules == (REPO / "configs" / "sharding" / "default.yaml").resolve()
    ShardingRules.load(args.sharding_rules)


def test_sharding_rules_relative_to_a_user_config(tmp_path, monkeypatch):
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "rules.yaml").write_text(
        (REPO / "configs" / "sharding" / "default.yaml").read_text())
    cfg = _yaml(tmp_path / "cfg", "sharding_rules: rules.yaml\n")
    monkeypatch.chdir(REPO)
    assert EngineArgs.from_sources(cfg).sharding_rules == str(tmp_path / "cfg" / "rules.yaml")
    abs_rules = str(REPO / "configs" / "sharding" / "default.yaml")
    cfg.write_text(f"sharding_rules: {abs_rules}\n")
    assert EngineArgs.from_sources(cfg).sharding_rules == abs_rules
