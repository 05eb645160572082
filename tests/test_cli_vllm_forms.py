"""`pdserve serve` takes vLLM's command-line forms (pdserve.server.vllm_forms, pdserve.cli):
a positional model, `--kv-transfer-config` JSON for each role, vLLM's dtype names, a YAML
`--config` file that the command line overrides, `pdserve --version`; a subcommand's mistakes
are reported with that subcommand's usage, and a model pdserve cannot load in one line."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve import __version__
from pdserve.cli import parse_args
from pdserve.config import ConnectorConfig
from pdserve.httpd.protocol import PollFilter
from pdserve.options import from_args
from pdserve.server.serve_args import configs_from_args


def kv(role: str, connector: str = "PdserveConnector", **extra: str) -> str:
    cfg = {"kv_connector": connector, "kv_role": role}
    if extra:
        cfg["kv_connector_extra_config"] = extra  # type: ignore[assignment]
    return json.dumps(cfg)


def refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


def test_the_model_may_be_positional() -> None:
    assert parse_args(["serve", "builtin:small"]).model == "builtin:small"
    assert parse_args(["serve", "--model", "builtin:small"]).model == "builtin:small"
    assert parse_args(["serve", "builtin:small", "--model", "builtin:small"]).model == (
        "builtin:small"
    )


def test_two_different_models_are_refused_with_serves_usage(capsys) -> None:
    err = refused(["serve", "builtin:small", "--model", "/models/other"], capsys)
    assert err.startswith("usage: pdserve serve") and "given twice" in err


def test_an_unknown_flag_shows_the_subcommands_usage(capsys) -> None:
    err = refused(["serve", "builtin:tiny", "--no-such-flag"], capsys)
    assert err.startswith("usage: pdserve serve") and "--no-such-flag" in err


@pytest.mark.parametrize(
    ("given", "dtype"),
    [
        ("half", "float16"),
        ("float16", "float16"),
        ("bfloat16", "bfloat16"),
        ("float", "float32"),
        ("float32", "float32"),
        ("auto", "auto"),
    ],
)
def test_vllm_dtype_names(given: str, dtype: str) -> None:
    args = parse_args(["serve", "--dtype", given])
    assert configs_from_args(args)[0].model.dtype == dtype


def test_an_unknown_dtype_is_refused(capsys) -> None:
    assert "unknown dtype 'fp8'" in refused(["serve", "--dtype", "fp8"], capsys)


@pytest.mark.parametrize(
    ("config", "role", "mode", "transport"),
    [
        (kv("kv_producer", mode="push"), "prefill", "push", "tcp"),
        (kv("kv_consumer", mode="pull"), "decode", "pull", "tcp"),
        (kv("kv_both"), "both", "push", "tcp"),
        (kv("kv_consumer", mode="push", transport="nixl"), "decode", "push", "nixl"),
        (kv("kv_producer", "NixlConnector"), "prefill", "pull", "nixl"),
        (kv("kv_consumer", "NixlPushConnector"), "decode", "push", "nixl"),
    ],
)
def test_kv_transfer_config_maps_onto_pdserves_flags(
    config: str, role: str, mode: str, transport: str
) -> None:
    args = parse_args(["serve", "builtin:tiny", "--kv-transfer-config", config])
    assert (args.role, args.kv_transfer, args.transport) == (role, mode, transport)
    ccfg = from_args(ConnectorConfig, args, engine_id="e")
    assert (ccfg.role, ccfg.mode) == (role, mode)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ("not json", "not valid JSON"),
        ("[1]", "must be a JSON object"),
        (kv("kv_master"), "kv_role must be one of"),
        (kv("kv_consumer", "LMCacheConnector"), "is not one pdserve runs"),
        (kv("kv_consumer", mode="teleport"), "mode='teleport'"),
        (json.dumps({"kv_role": "kv_consumer", "kv_rank": 1}), "unknown keys ['kv_rank']"),
    ],
)
def test_bad_kv_transfer_configs_are_refused(config: str, message: str, capsys) -> None:
    err = refused(["serve", "--kv-transfer-config", config], capsys)
    assert message in err and err.startswith("usage: pdserve serve")


def test_kv_transfer_config_must_agree_with_explicit_flags(capsys) -> None:
    argv = ["serve", "--role", "decode", "--kv-transfer-config", kv("kv_producer")]
    assert "--role says 'decode'" in refused(argv, capsys)
    same = ["serve", "--role", "prefill", "--kv-transfer-config", kv("kv_producer")]
    assert parse_args(same).role == "prefill"


def test_a_config_file_gives_defaults_the_command_line_overrides(tmp_path: Path) -> None:
    path = tmp_path / "serve.yaml"
    path.write_text(
        "model: builtin:small\n"
        "dtype: half\n"
        "port: 1234\n"
        "served_model_name: chat\n"
        "engine-process: true\n"
        "no-push-layerwise: true\n"
        "kv-transfer-config:\n"
        "  kv_role: kv_consumer\n"
        "  kv_connector_extra_config: {mode: push}\n"
    )
    args = parse_args(["serve", "--config", str(path), "--port", "999"])
    engine, server = configs_from_args(args)
    assert (engine.model.model, engine.model.dtype) == ("builtin:small", "float16")
    assert (server.port, server.served_model_name) == (999, "chat")
    assert args.engine_process and not args.push_layerwise
    assert (args.role, args.kv_transfer) == ("decode", "push")


def test_a_bad_config_file_is_one_line(tmp_path: Path, capsys) -> None:
    missing = tmp_path / "missing.yaml"
    assert "No such file" in refused(["serve", "--config", str(missing)], capsys)
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("no_such_flag: 3\n")
    assert "unrecognized arguments: --no-such-flag" in refused(
        ["serve", "--config", str(unknown)], capsys
    )


def test_version(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_args(["--version"])
    assert exc.value.code == 0 and capsys.readouterr().out.strip() == f"pdserve {__version__}"


@pytest.mark.parametrize("model", ["Qwen/Qwen3-0.6B", "EMPTY"])
def test_a_model_pdserve_cannot_load_is_one_line(model: str, tmp_path: Path) -> None:
    if model == "EMPTY":
        model = str(tmp_path)  # an empty folder
    run = subprocess.run(
        [sys.executable, "-m", "pdserve", "serve", model, "--port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = run.stdout + run.stderr
    assert run.returncode == 2, out
    assert "Traceback" not in out
    errors = [line for line in out.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and ("not a local directory" in out or "no config.json" in out)


def access_record(path: str) -> logging.LogRecord:
    args = ("127.0.0.1:5000", "GET", path, "1.1", 200)
    fmt = '%s - "%s %s HTTP/%s" %d'
    return logging.LogRecord("uvicorn.access", logging.INFO, "", 0, fmt, args, None)


def test_polls_stay_out_of_the_access_log() -> None:
    f = PollFilter()
    assert not f.filter(access_record("/health"))
    assert not f.filter(access_record("/load?x=1"))
    assert f.filter(access_record("/v1/completions"))
