"""Load a checkpoint (`builtin:NAME` or a local Hugging Face directory) into a Decoder.

No downloads: a name that is neither a built-in nor an existing directory is an error.

Weights come from `model.safetensors` or the shards listed in `model.safetensors.index.json`.
Names are checked before any tensor is read: every parameter the Decoder needs must be present
(missing ones are listed), and any tensor the Decoder has no place for is an error too (except
the rotary `inv_freq` buffers some old checkpoints carry, and `lm_head.weight` of a model with
tied embeddings, which transformers ignores as well).

dtype: "auto" takes the checkpoint's `torch_dtype` (float32 if absent). On CPU an "auto"
float16 becomes float32 with a warning: CPU float16 kernels are slow and some are missing,
while bfloat16 is well supported and kept. An explicit dtype is always honoured.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from pdserve.config import ModelConfig
from pdserve.model.builtin import ensure_builtin
from pdserve.model.cpu_features import cpu_flags, dtype_advice
from pdserve.model.decoder import Decoder
from pdserve.model.spec import ModelSpec, torch_dtype_of
from pdserve.model.tokenizer import Tokenizer

log = logging.getLogger(__name__)

BUILTIN_PREFIX = "builtin:"
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)
# HF projection -> (fused Decoder parameter, index of its row block)
_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


@dataclass(frozen=True)
class LoadedModel:
    """A ready-to-run model. The engine owns it for its lifetime; nothing here is mutated."""

    spec: ModelSpec
    model: Decoder
    tokenizer: Tokenizer
    path: Path
    dtype: torch.dtype
    name: str


def load_model(cfg: ModelConfig) -> LoadedModel:
    """Resolve, parse, build and fill the model described by `cfg`."""
    path = resolve_model_path(cfg)
    spec = ModelSpec.from_hf_config(json.loads((path / "config.json").read_text()))
    dtype = resolve_dtype(cfg.dtype, spec, cfg.device)
    if torch.device(cfg.device).type == "cpu" and (advice := dtype_advice(dtype, cpu_flags())):
        log.info("%s", advice)
    max_positions = cfg.max_model_len or spec.max_position_embeddings
    model = Decoder(spec, dtype=dtype, device=cfg.device, max_positions=max_positions)
    load_weights(model, path)
    model.eval()
    name = cfg.model if cfg.model.startswith(BUILTIN_PREFIX) else path.name
    return LoadedModel(spec, model, Tokenizer.from_dir(path), path, dtype, name)


def resolve_model_path(cfg: ModelConfig) -> Path:
    """The model directory: a generated built-in, or an existing local directory."""
    if cfg.model.startswith(BUILTIN_PREFIX):
        return ensure_builtin(cfg.model.removeprefix(BUILTIN_PREFIX), Path(cfg.cache_dir))
    path = Path(cfg.model).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(
            f"model {cfg.model!r} is not a local directory (hub downloads are not supported; "
            f"use a local Hugging Face directory or builtin:tiny / builtin:small)"
        )
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} has no config.json")
    return path


def resolve_dtype(requested: str, spec: ModelSpec, device: str) -> torch.dtype:
    """The compute dtype (see the module docstring for the "auto" rule)."""
    if requested != "auto":
        return torch_dtype_of(requested)
    dtype = torch_dtype_of(spec.torch_dtype)
    if dtype == torch.float16 and torch.device(device).type == "cpu":
        log.warning("checkpoint is float16; running float32 on CPU (pass dtype to override)")
        return torch.float32
    return dtype


def load_weights(model: Decoder, path: Path) -> None:
    """Copy every checkpoint tensor into the model (name and shape checked first)."""
    files = _weight_files(path)
    names = {n: f for f in files for n in _tensor_names(f)}
    expected = set(_expected_hf_names(model))
    _check_names(expected, set(names), model.spec, path)
    params = dict(model.named_parameters())
    for file in files:
        with safe_open(str(file), framework="pt") as reader:
            for name in reader.keys():  # noqa: SIM118 (safe_open is not a dict)
                if name in expected:
                    _copy_in(params, name, reader.get_tensor(name), model.spec)


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / s for s in shards]
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    raise FileNotFoundError(
        f"{path} has neither model.safetensors nor model.safetensors.index.json "
        f"(only safetensors checkpoints are supported)"
    )


def _tensor_names(file: Path) -> list[str]:
    with safe_open(str(file), framework="pt") as reader:
        return list(reader.keys())


def _expected_hf_names(model: Decoder) -> Iterator[str]:
    """The Hugging Face tensor names that fill `model`'s parameters, fused ones split."""
    unfused: dict[str, list[str]] = {}
    for hf, (ours, _) in _FUSED.items():
        unfused.setdefault(ours, []).append(hf)
    for name, _ in model.named_parameters():
        prefix = "" if name.startswith("lm_head.") else "model."
        module, _, leaf = name.rpartition(".")
        head, _, last = module.rpartition(".")
        for part in unfused.get(last, [last]):
            yield f"{prefix}{head}.{part}.{leaf}" if head else f"{prefix}{part}.{leaf}"


def _check_names(expected: set[str], found: set[str], spec: ModelSpec, path: Path) -> None:
    missing = sorted(expected - found)
    unexpected = sorted(
        n
        for n in found - expected
        if not n.endswith(_IGNORED_SUFFIXES)
        and not (n == "lm_head.weight" and spec.tie_word_embeddings)
    )
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {path} does not match {spec.architecture}: "
            f"missing {_preview(missing)}; unexpected {_preview(unexpected)}"
        )


def _preview(names: list[str], limit: int = 8) -> str:
    if not names:
        return "none"
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def _copy_in(
    params: dict[str, torch.nn.Parameter], hf_name: str, tensor: torch.Tensor, spec: ModelSpec
) -> None:
    name, rows = _target(hf_name.removeprefix("model."), spec)
    dest = params[name].data[rows]
    if dest.shape != tensor.shape:
        raise ValueError(
            f"{hf_name}: checkpoint shape {tuple(tensor.shape)} != expected {tuple(dest.shape)}"
        )
    dest.copy_(tensor)


def _target(name: str, spec: ModelSpec) -> tuple[str, slice]:
    """Decoder parameter and row range that an HF tensor (without `model.`) fills."""
    module, _, leaf = name.rpartition(".")
    head, _, last = module.rpartition(".")
    if last not in _FUSED:
        return name, slice(None)
    fused, index = _FUSED[last]
    sizes = (
        (spec.q_size, spec.kv_size, spec.kv_size)
        if fused == "qkv_proj"
        else (spec.intermediate_size, spec.intermediate_size)
    )
    start = sum(sizes[:index])
    return f"{head}.{fused}.{leaf}", slice(start, start + sizes[index])
