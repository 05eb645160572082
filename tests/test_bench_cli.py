"""`pdserve bench serve`'s flags: vLLM's spellings, pdserve's older ones, and bad input."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import pytest

from pdserve.bench.serve import (
    CHAT_ENDPOINT,
    COMPLETIONS_ENDPOINT,
    BenchConfig,
    ResultOutput,
    default_result_filename,
    result_path,
)
from pdserve.bench.serve_args import config_from_args
from pdserve.cli import main as cli_main
from pdserve.cli import parse_args
from pdserve.options import from_args


def _args(*argv: str) -> argparse.Namespace:
    return parse_args(["bench", "serve", *argv])


def _cfg(*argv: str) -> BenchConfig:
    return config_from_args(_args(*argv))


def _output(*argv: str) -> ResultOutput:
    return from_args(ResultOutput, _args(*argv))


def test_vllm_flags_map_to_the_config() -> None:
    cfg = _cfg(
        "--host", "10.0.0.2", "--port", "9000", "--backend", "openai-chat",
        "--dataset-name", "random", "--random-input-len", "300", "--random-output-len", "20",
        "--random-range-ratio", "0.25", "--num-prompts", "7", "--request-rate", "3.5",
        "--burstiness", "0.5", "--max-concurrency", "4", "--seed", "11",
        "--percentile-metrics", "ttft,e2el", "--metric-percentiles", "50,90,99.9",
    )  # fmt: skip
    assert cfg.base_url == "http://10.0.0.2:9000"
    assert (cfg.endpoint, cfg.chat) == (CHAT_ENDPOINT, True)
    assert (cfg.dataset, cfg.trace_path) == ("random", None)
    assert (cfg.random.input_len, cfg.random.output_len, cfg.random.range_ratio) == (300, 20, 0.25)
    assert cfg.num_prompts == 7 and cfg.seed == 11 and cfg.max_concurrency == 4
    assert (cfg.arrivals.request_rate, cfg.arrivals.burstiness) == (3.5, 0.5)
    assert cfg.percentile_metrics == ("ttft", "e2el")
    assert cfg.metric_percentiles == (50.0, 90.0, 99.9)


def test_pdserve_spellings_still_work_and_share_the_dest() -> None:
    old = _cfg("--input-len", "64", "--output-len", "8", "--range-ratio", "0.5")
    new = _cfg(
        "--random-input-len", "64", "--random-output-len", "8", "--random-range-ratio", "0.5"
    )
    assert old == new
    cfg = _cfg("--base-url", "http://h:1", "--trace", "t.jsonl")
    assert (cfg.base_url, cfg.dataset, cfg.trace_path) == ("http://h:1", "trace", Path("t.jsonl"))
    assert (cfg.endpoint, cfg.chat) == (COMPLETIONS_ENDPOINT, False)
    defaults = _cfg()
    assert defaults.percentile_metrics == ("ttft", "tpot", "itl", "e2el", "handoff")
    assert defaults.metric_percentiles == (90.0, 99.0) and defaults.dataset == "random"
    assert math.isinf(defaults.arrivals.request_rate)


@pytest.mark.parametrize(
    ("argv", "endpoint", "chat"),
    [
        (["--endpoint", "/v1/chat/completions"], CHAT_ENDPOINT, True),
        (["--backend", "vllm"], COMPLETIONS_ENDPOINT, False),
        (["--backend", "openai"], COMPLETIONS_ENDPOINT, False),
        (
            ["--backend", "openai-chat", "--endpoint", "/x/chat/completions"],
            "/x/chat/completions",
            True,
        ),
    ],
)
def test_backend_and_endpoint(argv: list[str], endpoint: str, chat: bool) -> None:
    cfg = _cfg(*argv)
    assert (cfg.endpoint, cfg.chat) == (endpoint, chat)


def test_file_datasets_and_their_output_len() -> None:
    cfg = _cfg(
        "--dataset-name", "sharegpt", "--dataset-path", "sg.json", "--sharegpt-output-len", "9"
    )
    assert (cfg.dataset, cfg.trace_path, cfg.file_output_len) == ("sharegpt", Path("sg.json"), 9)
    cfg = _cfg("--dataset-name", "custom", "--dataset-path", "c.jsonl", "--custom-output-len", "5")
    assert (cfg.dataset, cfg.file_output_len) == ("custom", 5)
    assert _cfg("--dataset-name", "custom", "--dataset-path", "c.jsonl").file_output_len is None


def test_save_result_as_a_switch_and_with_a_value(tmp_path: Path) -> None:
    switch = _args("--save-result", "--disable-tqdm")  # the switch does not eat the next flag
    assert switch.save_result == "" and switch.disable_tqdm
    with_value = _args("--save-result", "out.json")
    assert with_value.save_result == "out.json"
    assert _args().save_result is None


def test_result_path(tmp_path: Path) -> None:
    from test_bench_result import _result

    r = _result()  # label None, backend openai, model "m", rate inf, date 20260101-120000
    assert result_path(_output(), r) is None
    assert result_path(_output("--save-result", "a/b.json"), r) == Path("a/b.json")
    default = "openai-infqps-m-20260101-120000.json"
    assert result_path(_output("--save-result"), r) == Path(default)
    saved_in = _output("--save-result", "--result-dir", str(tmp_path))
    assert result_path(saved_in, r) == tmp_path / default
    named = _output("--result-dir", "d", "--result-filename", "x.json")
    assert result_path(named, r) == Path("d/x.json")
    both = _output("--save-result", "f.json", "--result-dir", "d")
    assert result_path(both, r) == Path("d/f.json")


def test_default_result_filename_follows_vllm() -> None:
    from test_bench_result import _result

    r = _result(rate=4.0)
    r.label, r.max_concurrency, r.model_id = "push", 8, "org/Qwen3:0.6B"
    assert default_result_filename(r) == "push-4qps-concurrency8-Qwen3-0.6B-20260101-120000.json"


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--dataset-name", "nope"], "invalid choice: 'nope'"),
        (["--backend", "tgi"], "invalid choice: 'tgi'"),
        (["--percentile-metrics", "ttft,bogus"], "not a list of metrics"),
        (["--metric-percentiles", "50,101"], "not a list of percentiles"),
        (["--random-input-len", "many"], "invalid int value"),
    ],
)
def test_bad_flags_are_argparse_errors(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture
) -> None:
    with pytest.raises(SystemExit) as exc:
        _args(*argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--dataset-name", "sharegpt"], "needs --dataset-path FILE"),
        (["--dataset-name", "random", "--dataset-path", "x.json"], "takes no --dataset-path"),
        (["--backend", "openai", "--endpoint", "/v1/chat/completions"], "does not speak"),
        (["--backend", "openai-chat", "--endpoint", "/v1/completions"], "does not speak"),
        (["--save-result", "a.json", "--result-filename", "b.json"], "give the file name once"),
    ],
)
def test_flags_that_do_not_go_together(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture
) -> None:
    # Checked before anything is sent (nothing listens on this port).
    assert cli_main(["bench", "serve", "--port", "9", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("pdserve bench serve: error:") and needle in err
    assert "\n" not in err
