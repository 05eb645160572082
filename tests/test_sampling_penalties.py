"""Penalties, `logit_bias` and `min_tokens` against small reference implementations of their
definitions (vLLM's), and `repetition_penalty` against transformers'
`RepetitionPenaltyLogitsProcessor`; then greedy generation through the engine with them
against a reference loop over transformers' logits on the same weights."""

from __future__ import annotations

import math
import uuid

import pytest
import torch
from test_model_hf_parity import load, make_hf_model, save_hf_dir

from pdserve.config import CacheConfig, EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.penalties import process_logits
from pdserve.engine.types import EngineRequest, SamplingParams
from pdserve.model.builtin import ensure_builtin

transformers = pytest.importorskip("transformers")

V = 50


def reference(
    logits: list[float], p: SamplingParams, prompt: list[int], output: list[int], eos: set[int]
) -> list[float]:
    """The definitions, one token at a time."""
    out = list(logits)
    if len(output) < p.min_tokens:
        for t in set(p.stop_token_ids) | (set() if p.ignore_eos else eos):
            out[t] = -math.inf
    for t, b in p.logit_bias:
        out[t] += b
    for t in range(len(out)):
        if t in prompt or t in output:
            r = p.repetition_penalty
            out[t] = out[t] / r if out[t] > 0 else out[t] * r
        count = output.count(t)
        out[t] -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
    return out


CASES = [
    SamplingParams(presence_penalty=0.7),
    SamplingParams(frequency_penalty=-1.3),
    SamplingParams(repetition_penalty=1.8),
    SamplingParams(repetition_penalty=0.6),
    SamplingParams(logit_bias=((3, 5.0), (9, -100.0))),
    SamplingParams(min_tokens=4, stop_token_ids=(11,)),
    SamplingParams(min_tokens=4, ignore_eos=True),
    SamplingParams(
        presence_penalty=0.4, frequency_penalty=0.3, repetition_penalty=1.3, min_tokens=9
    ),
]


@pytest.mark.parametrize("p", CASES)
def test_processing_follows_the_definitions(p: SamplingParams) -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, V, generator=gen) * 3
    prompts = [[1, 2, 3, 3], [4], [7, 8]]
    outputs = [[2, 5, 5, 5], [], [8, 30, 30]]
    eos = {0, 49}
    expected = [reference(logits[i].tolist(), p, prompts[i], outputs[i], eos) for i in range(3)]
    untouched = SamplingParams()
    got = logits.clone()
    process_logits(got, [p, untouched, p], prompts, outputs, eos)
    torch.testing.assert_close(got[0], torch.tensor(expected[0]))
    torch.testing.assert_close(got[1], logits[1])  # a row that asks for nothing
    torch.testing.assert_close(got[2], torch.tensor(expected[2]))


@pytest.mark.parametrize("penalty", [0.5, 1.2, 2.0])
def test_repetition_penalty_equals_transformers(penalty: float) -> None:
    from transformers import RepetitionPenaltyLogitsProcessor

    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(1, V, generator=gen) * 4
    seen = [1, 4, 4, 17, 30, 49]
    expected = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([seen]), logits.clone())
    got = logits.clone()
    process_logits(got, [SamplingParams(repetition_penalty=penalty)], [seen[:3]], [seen[3:]], ())
    torch.testing.assert_close(got, expected)


@pytest.fixture(scope="module")
def hf_and_loaded(tmp_path_factory):
    tok_dir = ensure_builtin("tiny", tmp_path_factory.mktemp("builtin"))
    # Greedy on these weights repeats a token within 12 steps by a margin of 1-2 logits,
    # so each penalty below changes the output.
    hf = make_hf_model("Qwen3", {"tie_word_embeddings": False}, seed=5)
    return hf, load(save_hf_dir(hf, tmp_path_factory.mktemp("qwen3") / "m", tok_dir))


def engine_tokens(lm, ids: list[int], sp: SamplingParams) -> list[int]:
    engine = LLMEngine(lm, EngineConfig(cache=CacheConfig(block_size=16, num_blocks=64)))
    engine.add_request(EngineRequest(request_id=uuid.uuid4().hex, prompt_token_ids=ids, params=sp))
    tokens = []
    while engine.has_work():
        tokens += [t for o in engine.step() for t in o.new_token_ids]
    engine.check_integrity()
    return tokens


def reference_greedy(hf, ids: list[int], sp: SamplingParams, eos: set[int]) -> list[int]:
    out: list[int] = []
    while len(out) < sp.max_tokens:
        with torch.no_grad():
            logits = hf(torch.tensor([ids + out])).logits[0, -1].float().tolist()
        processed = reference(logits, sp, ids, out, eos)
        token = max(range(len(processed)), key=processed.__getitem__)
        out.append(token)
        if token in sp.stop_token_ids or (not sp.ignore_eos and token in eos):
            break
    return out


GREEDY = [
    SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, presence_penalty=1.5),
    SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, frequency_penalty=2.0),
    SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, repetition_penalty=2.0),
    SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logit_bias=((42, 100.0),)),
]


@pytest.mark.parametrize("sp", GREEDY)
def test_engine_greedy_with_processing_equals_the_reference(hf_and_loaded, sp) -> None:
    hf, lm = hf_and_loaded
    ids = [5, 9, 5, 9, 5, 9, 100, 101, 102]
    expected = reference_greedy(hf, ids, sp, set(lm.tokenizer.eos_token_ids))
    assert engine_tokens(lm, ids, sp) == expected
    plain = SamplingParams(max_tokens=sp.max_tokens, temperature=0.0, ignore_eos=True)
    assert engine_tokens(lm, ids, plain) != expected  # the processing changed the output


def test_min_tokens_holds_back_eos_and_stop_ids(hf_and_loaded) -> None:
    """EOS biased to the top: without min_tokens it comes first; with min_tokens=3 the
    request makes three other tokens (no stop id either), then ends on EOS."""
    _, lm = hf_and_loaded
    eos = min(lm.tokenizer.eos_token_ids)
    bias = ((eos, 100.0), (60, 50.0))
    base = SamplingParams(max_tokens=10, temperature=0.0, logit_bias=bias)
    assert engine_tokens(lm, [5, 6, 7], base) == [eos]
    held = SamplingParams(
        max_tokens=10, temperature=0.0, logit_bias=bias, min_tokens=3, stop_token_ids=(60,)
    )
    tokens = engine_tokens(lm, [5, 6, 7], held)
    assert len(tokens) == 4 and tokens[-1] == eos
    assert not set(tokens[:3]) & {eos, 60, *lm.tokenizer.eos_token_ids}


@pytest.mark.parametrize(
    "sp",
    [
        SamplingParams(logprobs=21),
        SamplingParams(prompt_logprobs=-1),
        SamplingParams(logit_bias=((300, 1.0),)),
        SamplingParams(logit_bias=((3, math.inf),)),
        SamplingParams(repetition_penalty=0.0),
        SamplingParams(presence_penalty=math.nan),
        SamplingParams(min_tokens=-1),
        SamplingParams(stop_token_ids=(-1,)),
    ],
)
def test_engine_refuses_params_it_cannot_run(hf_and_loaded, sp) -> None:
    """In-process callers (the offline API) get an error output, not a failed batch."""
    _, lm = hf_and_loaded
    engine = LLMEngine(lm, EngineConfig(cache=CacheConfig(block_size=16, num_blocks=64)))
    (out,) = engine.add_request(EngineRequest(request_id="bad", prompt_token_ids=[1, 2], params=sp))
    assert out.finished and out.finish_reason.value == "error" and out.error
    assert not engine.has_work()
