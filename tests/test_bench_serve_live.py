"""`pdserve bench serve` with vLLM's flags against a live `pdserve serve builtin:tiny`: each
dataset kind (random, ShareGPT, custom) and the chat endpoint.

builtin:tiny's tokenizer is byte-level without BOS, so a text's token count is its length in
bytes: the expected lengths below are computed that way and compared exactly where the
benchmark promises exactness (token-id prompts, ShareGPT lengths from the server's /tokenize,
`ignore_eos` outputs).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from procs import PdserveProcess

from pdserve.bench.dataset import DEFAULT_CUSTOM_OUTPUT_LEN, RandomDatasetConfig
from pdserve.bench.metrics import load_result
from pdserve.bench.serve import CHAT_ENDPOINT, BenchConfig, run_benchmark
from pdserve.cli import main as cli_main


@pytest.fixture(scope="module")
def server() -> Iterator[PdserveProcess]:
    args = ["serve", "--model", "builtin:tiny", "--max-model-len", "2048", "--threads", "1"]
    with PdserveProcess([*args, "--num-kv-blocks", "256", "--log-level", "warning"]) as proc:
        yield proc


def _bench(tmp_path: Path, server: PdserveProcess, *argv: str) -> Path:
    """Run the CLI with --save-result as a switch; the one result file it wrote."""
    out = tmp_path / "results"
    common = ["--base-url", server.url, "--disable-tqdm", "--save-result", "--result-dir", str(out)]
    assert cli_main(["bench", "serve", *common, *argv]) == 0
    (path,) = out.iterdir()
    return path


def _nbytes(text: str) -> int:
    return len(text.encode())


def test_random_with_vllm_flags(tmp_path: Path, server: PdserveProcess) -> None:
    path = _bench(
        tmp_path, server, "--dataset-name", "random", "--random-input-len", "32",
        "--random-output-len", "6", "--num-prompts", "4", "--request-rate", "50", "--seed", "1",
        "--max-concurrency", "2", "--metric-percentiles", "50,99", "--label", "lab",
    )  # fmt: skip
    assert path.name.startswith("lab-50qps-concurrency2-builtin-tiny-")
    r = load_result(path)
    assert (r.completed, r.failed, r.dataset_name, r.backend) == (4, 0, "random", "openai")
    assert r.input_lens == [32] * 4 and r.output_lens == [6] * 4
    data = json.loads(path.read_text())
    assert data["p50_ttft_ms"] == pytest.approx(r.median_ttft_ms)
    assert data["p99_ttft_ms"] == r.p99_ttft_ms and "p50_e2el_ms" in data


def test_sharegpt(tmp_path: Path, server: PdserveProcess) -> None:
    exchanges = [
        ("What is a KV cache?", "Keys and values of past tokens."),
        ("Name a prime number.", "Seven."),
        ("Translate 'chat' to English.", "Cat, in this case."),
    ]
    convs = [
        {
            "id": str(i),
            "conversations": [{"from": "human", "value": p}, {"from": "gpt", "value": a}],
        }
        for i, (p, a) in enumerate(exchanges)
    ]
    convs.append({"id": "single", "conversations": [{"from": "human", "value": "one turn only"}]})
    data = tmp_path / "sharegpt.json"
    data.write_text(json.dumps(convs))
    path = _bench(
        tmp_path, server, "--dataset-name", "sharegpt", "--dataset-path", str(data),
        "--num-prompts", "10",
    )  # fmt: skip
    r = load_result(path)
    assert (r.completed, r.failed, r.num_prompts, r.dataset_name) == (3, 0, 3, "sharegpt")
    # Lengths from the server's /tokenize: each reply's length is its output length.
    sent = sorted(zip(r.input_lens, r.output_lens, strict=True))
    assert sent == sorted((_nbytes(p), _nbytes(a)) for p, a in exchanges)


def test_custom_on_the_chat_backend(tmp_path: Path, server: PdserveProcess) -> None:
    data = tmp_path / "custom.jsonl"
    lines = [
        {"prompt": "Say something about trains.", "output_tokens": 5},
        {"prompt": "And about boats?", "max_tokens": 3},
        {"prompt": "Planes, finally."},
    ]
    data.write_text("".join(json.dumps(line) + "\n" for line in lines))
    path = _bench(
        tmp_path, server, "--backend", "openai-chat", "--dataset-name", "custom",
        "--dataset-path", str(data),
    )  # fmt: skip
    r = load_result(path)
    assert (r.completed, r.failed, r.endpoint, r.backend) == (3, 0, CHAT_ENDPOINT, "openai-chat")
    assert r.output_lens == [5, 3, DEFAULT_CUSTOM_OUTPUT_LEN]
    template = _chat_template_tokens(server)
    assert r.input_lens == [_nbytes(line["prompt"]) + template for line in lines]


def _chat_template_tokens(server: PdserveProcess) -> int:
    body = {"messages": [{"role": "user", "content": ""}]}
    return httpx.post(f"{server.url}/tokenize", json=body, timeout=10).json()["count"]


def test_chat_endpoint_random_text(server: PdserveProcess) -> None:
    cfg = BenchConfig(
        base_url=server.url,
        endpoint=CHAT_ENDPOINT,
        random=RandomDatasetConfig(input_len=200, output_len=8),
        num_prompts=5,
        max_concurrency=5,
        disable_tqdm=True,
    )
    r = asyncio.run(run_benchmark(cfg))
    assert (r.completed, r.failed) == (5, 0), r.errors
    assert r.output_lens == [8] * 5 and all(len(itl) == 7 for itl in r.itls)
    assert all(t is not None and t > 0 for t in r.ttfts)
    assert r.mean_itl_ms is not None and r.mean_itl_ms > 0 and r.mean_tpot_ms > 0
    # Word prompts sized with /tokenize's tokens per word: about 200 tokens of content.
    template = _chat_template_tokens(server)
    assert all(150 <= n - template <= 250 for n in r.input_lens), r.input_lens
    assert r.dataset_name == "random" and r.backend == "openai-chat"
