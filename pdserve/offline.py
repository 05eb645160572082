"""The Python API in vLLM's offline shape: an engine in this process, no server.

    from pdserve import LLM, SamplingParams

    llm = LLM("builtin:tiny")
    outs = llm.generate(["Hello", "The sky is"], SamplingParams(max_tokens=16, temperature=0))
    print(outs[0].outputs[0].text)
    llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=8))

`LLM` owns one `LLMEngine` (its scheduler, block pool and KV cache) and steps it on the
calling thread: `generate` and `chat` return when every prompt they were given has finished,
with the outputs in the order of the prompts. Prompts are batched by the engine's scheduler
exactly as a server's concurrent requests are, and greedy outputs equal a server's for the
same model and prompt. Not thread-safe: one call at a time.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from pdserve.config import CacheConfig, Dtype, EngineConfig, ModelConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.types import EngineRequest, FinishReason, SamplingParams

Prompt = str | Sequence[int]
Message = dict[str, Any]


@dataclass(frozen=True)
class CompletionOutput:
    """One generated sequence (vLLM's name and fields)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop", "length", or "error"


@dataclass(frozen=True)
class RequestOutput:
    """A finished prompt and what was generated for it (vLLM's shape)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    error: str | None = None  # why the engine refused or failed the request, if it did


class LLM:
    """An engine in this process; see the module docstring."""

    def __init__(
        self,
        model: str = "builtin:tiny",
        *,
        dtype: Dtype = "auto",
        max_model_len: int | None = None,
        seed: int = 0,
        num_kv_blocks: int | None = None,
        threads: int | None = None,
        device: str = "cpu",
    ) -> None:
        mc = replace(
            ModelConfig(),
            model=model,
            dtype=dtype,
            max_model_len=max_model_len,
            seed=seed,
            device=device,
        )
        cfg = EngineConfig(model=mc, cache=CacheConfig(num_blocks=num_kv_blocks), threads=threads)
        self.engine = LLMEngine.from_config(cfg)

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Complete each prompt (text, or token ids); one output per prompt, in order."""
        batch = _as_batch(prompts)
        ids = [self._encode(p) if isinstance(p, str) else list(p) for p in batch]
        texts = [p if isinstance(p, str) else None for p in batch]
        return self._run(ids, texts, _per_prompt(sampling_params, len(batch)))

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Answer each conversation (a list of {"role", "content"} messages, or a list of
        such lists), rendered with the model's chat template as the server renders it."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        rendered = [self.engine.tokenizer.apply_chat_template(list(c)) for c in conversations]
        ids = [self.engine.tokenizer.encode(r, add_special_tokens=False) for r in rendered]
        return self._run(ids, rendered, _per_prompt(sampling_params, len(ids)))

    def _encode(self, text: str) -> list[int]:
        return self.engine.tokenizer.encode(text, add_special_tokens=True)

    def _run(
        self, ids: list[list[int]], texts: list[str | None], params: list[SamplingParams]
    ) -> list[RequestOutput]:
        rids = [uuid.uuid4().hex for _ in ids]
        results = {rid: _Collect() for rid in rids}
        for rid, prompt, sp in zip(rids, ids, params, strict=True):
            er = EngineRequest(request_id=rid, prompt_token_ids=prompt, params=sp)
            self._take(results, self.engine.add_request(er))
        try:
            while not all(c.done for c in results.values()):
                if not self.engine.has_work():  # a bug, not a wait: nothing would end it
                    raise RuntimeError("the engine went idle with requests unfinished")
                self._take(results, self.engine.step())
        except BaseException:  # e.g. Ctrl-C: free what is still running
            for rid in rids:
                self.engine.abort_request(rid)
            raise
        return [
            results[rid].output(rid, text, prompt)
            for rid, text, prompt in zip(rids, texts, ids, strict=True)
        ]

    @staticmethod
    def _take(results: dict[str, _Collect], outputs: list[Any]) -> None:
        for out in outputs:
            if out.request_id in results:
                results[out.request_id].add(out)


class _Collect:
    """The outputs of one request as they come."""

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.text = ""
        self.done = False
        self.finish_reason: FinishReason | None = None
        self.error: str | None = None

    def add(self, out: Any) -> None:
        self.token_ids += out.new_token_ids
        self.text += out.new_text
        if out.finished:
            self.done, self.finish_reason, self.error = True, out.finish_reason, out.error

    def output(self, rid: str, prompt: str | None, ids: list[int]) -> RequestOutput:
        reason = self.finish_reason.value if self.finish_reason is not None else None
        seq = CompletionOutput(0, self.text, self.token_ids, reason)
        return RequestOutput(rid, prompt, ids, [seq], error=self.error)


def _as_batch(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    """One prompt (text, or a flat list of ids) or a list of them, as a list."""
    if isinstance(prompts, str):
        return [prompts]
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # type: ignore[list-item]
    return list(prompts)  # type: ignore[arg-type]


def _per_prompt(
    params: SamplingParams | Sequence[SamplingParams] | None, n: int
) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    if len(params) != n:
        raise ValueError(f"{len(params)} sampling params for {n} prompts")
    return list(params)
