"""Logprobs equal `log_softmax` of transformers' logits on the same random weights (float32,
1e-4), for generated and prompt tokens, on one engine and through P/D (pull and push), where
the first token's logprobs are computed on P and travel to D with the token."""

from __future__ import annotations

import uuid

import pytest
import torch
from test_model_hf_parity import load, make_hf_model, save_hf_dir

from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.types import EngineRequest, RequestOutput, SamplingParams
from pdserve.model.builtin import ensure_builtin
from tests.pd_harness import Pair, make_engine

transformers = pytest.importorskip("transformers")

K = 5
TOL = 1e-4


@pytest.fixture(scope="module")
def hf_and_loaded(tmp_path_factory):
    tok_dir = ensure_builtin("tiny", tmp_path_factory.mktemp("builtin"))
    hf = make_hf_model("Qwen3", {"tie_word_embeddings": False}, seed=5)
    return hf, load(save_hf_dir(hf, tmp_path_factory.mktemp("qwen3") / "m", tok_dir))


def prompt(n: int, seed: int = 3) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 250, (n,), generator=gen).tolist()


def hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    """log_softmax of transformers' logits at every position of `ids`."""
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)


def run(engine: LLMEngine, ids: list[int], sp: SamplingParams) -> list[RequestOutput]:
    rid = uuid.uuid4().hex
    engine.add_request(EngineRequest(request_id=rid, prompt_token_ids=ids, params=sp))
    outs = []
    while engine.has_work():
        outs += [o for o in engine.step() if o.request_id == rid]
    engine.check_integrity()
    return outs


def assert_matches(lp, expected_row: torch.Tensor, token: int, k: int = K) -> None:
    assert lp is not None and lp.token_id == token
    assert abs(lp.logprob - expected_row[token].item()) < TOL
    assert lp.rank == int((expected_row > expected_row[token]).sum()) + 1
    top = expected_row.topk(k)
    assert lp.top_ids == top.indices.tolist()
    torch.testing.assert_close(torch.tensor(lp.top_logprobs), top.values, atol=TOL, rtol=0)


def assert_generated(hf, ids: list[int], tokens: list[int], lps: list) -> None:
    expected = hf_logprobs(hf, ids + tokens)
    assert len(lps) == len(tokens) > 0
    for i, (tok, lp) in enumerate(zip(tokens, lps, strict=True)):
        assert_matches(lp, expected[len(ids) + i - 1], tok)


@pytest.mark.parametrize("chunk", [1024, 16])  # one prefill step, or chunks of 16 tokens
def test_generated_and_prompt_logprobs_match_transformers(hf_and_loaded, chunk):
    hf, lm = hf_and_loaded
    cfg = EngineConfig(
        cache=CacheConfig(block_size=16, num_blocks=64),
        scheduler=SchedulerConfig(max_num_batched_tokens=chunk, max_num_seqs=8),
    )
    engine = LLMEngine(lm, cfg)
    ids = prompt(45)
    sp = SamplingParams(
        max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=K, prompt_logprobs=K
    )
    outs = run(engine, ids, sp)
    tokens = [t for o in outs for t in o.new_token_ids]
    lps = [lp for o in outs for lp in o.new_logprobs or []]
    assert_generated(hf, ids, tokens, lps)
    prompt_lps = outs[0].prompt_logprobs
    assert [o.prompt_logprobs is not None for o in outs] == [True] + [False] * (len(outs) - 1)
    assert len(prompt_lps) == len(ids) and prompt_lps[0] is None
    expected = hf_logprobs(hf, ids)
    for t in range(1, len(ids)):
        assert_matches(prompt_lps[t], expected[t - 1], ids[t])


def test_sampled_tokens_get_raw_logprobs_and_k_zero_only_the_token(hf_and_loaded):
    """Sampling at a temperature, with penalties and a bias: the logprobs stay those of the
    model's own distribution; k = 0 gives the token's logprob and rank only."""
    hf, lm = hf_and_loaded
    engine = LLMEngine(lm, EngineConfig(cache=CacheConfig(block_size=16, num_blocks=64)))
    ids = prompt(20, seed=9)
    sp = SamplingParams(
        max_tokens=5,
        temperature=0.8,
        seed=1,
        ignore_eos=True,
        logprobs=0,
        presence_penalty=0.5,
        logit_bias=((7, 3.0),),
    )
    outs = run(engine, ids, sp)
    tokens = [t for o in outs for t in o.new_token_ids]
    lps = [lp for o in outs for lp in o.new_logprobs or []]
    expected = hf_logprobs(hf, ids + tokens)
    for i, (tok, lp) in enumerate(zip(tokens, lps, strict=True)):
        assert_matches(lp, expected[len(ids) + i - 1], tok, k=0)
        assert lp.top_ids == [] and lp.top_logprobs == []


def test_no_logprobs_unless_asked(hf_and_loaded):
    _, lm = hf_and_loaded
    engine = LLMEngine(lm, EngineConfig(cache=CacheConfig(block_size=16, num_blocks=64)))
    outs = run(engine, prompt(10), SamplingParams(max_tokens=3, temperature=0.0))
    assert all(o.new_logprobs is None and o.prompt_logprobs is None for o in outs)


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_pd_first_token_logprobs_travel_from_p(hf_and_loaded, mode):
    hf, lm = hf_and_loaded
    pair = Pair(make_engine(lm, "prefill", mode), make_engine(lm, "decode", mode), mode)
    try:
        ids = prompt(40, seed=11)
        sp = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=K)
        p_sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, logprobs=K)
        pair.generate("r", ids, sp, p_sp)
        outs = pair.outputs["r"]
        tokens = pair.tokens("r")
        lps = [lp for o in outs for lp in o.new_logprobs or []]
        assert_generated(hf, ids, tokens, lps)
        p_out = pair.finished("r-p")
        assert p_out.new_logprobs == [lps[0]]  # P's own answer carries it too
        pair.settle()
    finally:
        pair.close()


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_pd_without_p_logprobs_reports_none_for_the_first_token(hf_and_loaded, mode):
    """A P leg that did not ask for logprobs sends none; D reports None for that token
    rather than a wrong value, and its own tokens still get theirs."""
    hf, lm = hf_and_loaded
    pair = Pair(make_engine(lm, "prefill", mode), make_engine(lm, "decode", mode), mode)
    try:
        ids = prompt(24, seed=12)
        sp = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, logprobs=2)
        pair.generate("r", ids, sp)
        lps = [lp for o in pair.outputs["r"] for lp in o.new_logprobs or []]
        tokens = pair.tokens("r")
        assert lps[0] is None
        expected = hf_logprobs(hf, ids + tokens)
        for i in range(1, len(tokens)):
            assert_matches(lps[i], expected[len(ids) + i - 1], tokens[i], k=2)
        pair.settle()
    finally:
        pair.close()
