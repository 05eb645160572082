"""`pdserve serve` flags: mapping onto the frozen configs, defaults, --help."""

from __future__ import annotations

import pytest

from pdserve.cli import parse_args
from pdserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, ServerConfig
from pdserve.server.serve import API_KEY_ENV
from pdserve.server.serve_args import configs_from_args


def test_defaults_match_config_dataclasses(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    engine, server = configs_from_args(parse_args(["serve"]))
    assert engine == EngineConfig()
    assert server == ServerConfig()


def test_flags_reach_the_configs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    argv = ["serve", "--model", "/m", "--dtype", "bfloat16", "--max-model-len", "512"]
    argv += ["--seed", "7", "--kv-cache-memory", "0.5", "--num-kv-blocks", "40"]
    argv += ["--block-size", "8", "--max-num-batched-tokens", "256", "--max-num-seqs", "4"]
    argv += ["--max-prefill-chunk", "64", "--threads", "1", "--host", "0.0.0.0", "--port", "0"]
    argv += ["--served-model-name", "m", "--api-key", "k", "--log-level", "debug"]
    argv += ["--no-enable-prefix-caching"]
    engine, server = configs_from_args(parse_args(argv))
    assert engine.model == ModelConfig(model="/m", dtype="bfloat16", max_model_len=512, seed=7)
    assert engine.cache == CacheConfig(
        block_size=8, kv_cache_memory_gib=0.5, num_blocks=40, enable_prefix_caching=False
    )
    assert engine.scheduler == SchedulerConfig(
        max_num_batched_tokens=256, max_num_seqs=4, max_prefill_chunk=64
    )
    assert engine.threads == 1
    assert server == ServerConfig(host="0.0.0.0", port=0, served_model_name="m", api_key="k")


def test_api_key_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    _, server = configs_from_args(parse_args(["serve"]))
    assert server.api_key == "from-env"
    _, server = configs_from_args(parse_args(["serve", "--api-key", "flag"]))
    assert server.api_key == "flag"


@pytest.mark.parametrize(
    "argv",
    [
        ["--port", "70000"],
        ["--max-model-len", "0"],
        ["--kv-cache-memory", "-1"],
        ["--dtype", "int3"],
        ["--log-level", "loud"],
    ],
)
def test_bad_flags_exit_2(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_args(["serve", *argv])
    assert exc.value.code == 2


def test_help_shows_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(["serve", "--help"])
    out = capsys.readouterr().out
    for flag in ("--model", "--kv-cache-memory", "--max-num-seqs", "--api-key", "--seed"):
        assert flag in out
    assert "(default: builtin:tiny)" in out
    assert "(default: 127.0.0.1)" in out


def test_transfer_switches_reach_the_connector_config() -> None:
    from pdserve.server.serve_args import pd_configs_from_args

    base = ["serve", "--role", "decode", "--kv-transfer", "pull"]
    default, _ = pd_configs_from_args(parse_args(base)) or (None, None)
    assert default is not None and default.push_layerwise is True
    cfg, _ = pd_configs_from_args(parse_args([*base, "--no-push-layerwise"])) or (None, None)
    assert cfg is not None and cfg.push_layerwise is False


def test_a_command_line_makes_the_config_serve_runs() -> None:
    """What a Ray instance actor hands `pdserve.server.serve.main` (pdserve.cluster)."""
    from pdserve.server.serve import ServeCommand
    from pdserve.server.serve_args import config_from_argv
    from pdserve.vllm.serve import VllmServeCommand

    argv = ["--role", "decode", "--kv-transfer", "push", "--side-channel-port", "5601"]
    cfg = config_from_argv([*argv, "--port", "8100", "--engine-process"])
    assert isinstance(cfg, ServeCommand) and cfg.server.port == 8100
    assert cfg.process.engine_process and cfg.pd is not None
    assert (cfg.pd[0].role, cfg.pd[0].mode, cfg.pd[0].side_port) == ("decode", "push", 5601)
    vllm = config_from_argv([*argv, "--engine", "vllm", "--model", "/ckpt"])
    assert isinstance(vllm, VllmServeCommand) and vllm.instance.side_port == 5601
    with pytest.raises(SystemExit):
        config_from_argv(["--role", "neither"])
