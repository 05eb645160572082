"""The offline Python API (`from pdserve import LLM, SamplingParams`): greedy outputs equal a
`pdserve serve` process's for the same model and prompts, for text, token ids and chat."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest

from tests.procs import PdserveProcess

pytestmark = pytest.mark.timeout(300)

TEXTS = ["Hello", "The sky is blue because", "a" * 300]
IDS = [[5, 6, 7], [100 + i % 150 for i in range(200)]]
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def llm():
    from pdserve import LLM

    return LLM("builtin:tiny", threads=1)


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    with PdserveProcess(["serve", "builtin:tiny", "--threads", "1"]) as p:
        yield p.url


def served(url: str, prompt: object, n: int) -> tuple[list[int], str]:
    body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True}
    body["return_token_ids"] = True
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()
    return r["choices"][0].get("token_ids"), r["choices"][0]["text"]


def test_generate_equals_the_server(llm, server: str) -> None:
    from pdserve import SamplingParams

    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outs = llm.generate([*TEXTS, *IDS], params)
    assert [o.prompt for o in outs] == [*TEXTS, None, None]
    for prompt, out in zip([*TEXTS, *IDS], outs, strict=True):
        seq = out.outputs[0]
        assert len(seq.token_ids) == 12 and seq.finish_reason == "length"
        token_ids, text = served(server, prompt, 12)
        assert (seq.token_ids, seq.text) == (token_ids, text), prompt


def test_chat_equals_the_server(llm, server: str) -> None:
    from pdserve import SamplingParams

    (out,) = llm.chat(CHAT, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    body = {"messages": CHAT, "max_tokens": 10, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{server}/v1/chat/completions", json=body, timeout=120).json()
    assert out.outputs[0].text == r["choices"][0]["message"]["content"]
    assert len(out.prompt_token_ids) == r["usage"]["prompt_tokens"]


def test_each_prompt_may_have_its_own_params(llm) -> None:
    from pdserve import SamplingParams

    a, b = llm.generate(["x", "y"], [SamplingParams(max_tokens=2), SamplingParams(max_tokens=5)])
    assert (len(a.outputs[0].token_ids), len(b.outputs[0].token_ids)) <= (2, 5)
    with pytest.raises(ValueError, match="2 sampling params for 3 prompts"):
        llm.generate(["x", "y", "z"], [SamplingParams(), SamplingParams()])


def test_a_prompt_the_engine_refuses_comes_back_with_its_error(llm) -> None:
    from pdserve import SamplingParams

    (out,) = llm.generate([[1] * 100_000], SamplingParams(max_tokens=1))
    assert out.error and out.outputs[0].finish_reason == "error"


def test_import_pdserve_stays_light() -> None:
    code = "import sys, pdserve; assert 'torch' not in sys.modules; print(pdserve.__version__)"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
