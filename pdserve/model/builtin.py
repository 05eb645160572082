"""Built-in random-weight models (`builtin:tiny`, `builtin:small`), generated on first use.

Each is an ordinary Hugging Face directory (Qwen3ForCausalLM config, model.safetensors,
byte-level BPE tokenizer.json, tokenizer_config.json with a ChatML template,
generation_config.json) that transformers can load too.

Determinism: the bytes depend only on the recipe. Weights come from splitmix64, a counter-based
integer hash evaluated with numpy uint64 arithmetic, turned into float32 with one exact
integer-to-float conversion and one rounding multiply. Unlike torch's or numpy's samplers,
whose streams may change between versions, this is fixed forever and on every platform.

Concurrency: generation writes into a private temporary directory beside the target and
renames it into place; the rename is atomic, so readers see either nothing or a complete
model. When two processes race, the loser discards its copy and uses the winner's.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np
import tokenizers
from safetensors.numpy import save_file
from tokenizers import decoders, models, pre_tokenizers

RECIPE_VERSION = 1
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['content'] is string %}{%- set content = message['content'] %}"
    "{%- else %}{%- set content = message['content'] | map(attribute='text') | join('') %}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@dataclass(frozen=True)
class BuiltinRecipe:
    """Everything that determines a built-in model's bytes (hashed into its directory name).

    `logit_std`: target standard deviation of the random logits; large enough that greedy
    argmax is decided by the weights, not by float rounding differences between batchings.
    """

    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    logit_std: float = 4.0
    seed: int = 0


RECIPES: Mapping[str, BuiltinRecipe] = MappingProxyType(
    {
        "tiny": BuiltinRecipe(
            num_layers=2,
            hidden_size=64,
            intermediate_size=128,
            num_heads=4,
            num_kv_heads=2,
            head_dim=16,
            max_position_embeddings=4096,
        ),
        "small": BuiltinRecipe(
            num_layers=4,
            hidden_size=256,
            intermediate_size=768,
            num_heads=4,
            num_kv_heads=2,
            head_dim=64,
            max_position_embeddings=32768,
        ),
    }
)


def ensure_builtin(name: str, cache_dir: Path) -> Path:
    """Directory of built-in model `name` under `cache_dir`, generating it if missing."""
    if name not in RECIPES:
        raise ValueError(f"unknown built-in model {name!r}; available: {', '.join(RECIPES)}")
    recipe = RECIPES[name]
    cache_dir = Path(cache_dir)
    target = cache_dir / f"{name}-{recipe_hash(recipe)}"
    if target.is_dir():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = cache_dir / f".{target.name}.tmp-{os.getpid()}-{uuid.uuid4().hex}"
    try:
        tmp.mkdir()
        write_model_dir(recipe, tmp)
        os.rename(tmp, target)
    except OSError:
        if not target.is_dir():  # a real failure, not a lost race
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def recipe_hash(recipe: BuiltinRecipe) -> str:
    """Short hash of the recipe and generator version (changes => a new directory)."""
    blob = json.dumps(
        {"version": RECIPE_VERSION, "recipe": dataclasses.asdict(recipe)}, sort_keys=True
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def write_model_dir(recipe: BuiltinRecipe, path: Path) -> None:
    """Write every file of the model into the existing directory `path`."""
    tokenizer = build_tokenizer()
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    eos_ids = [tokenizer.token_to_id("<|im_end|>"), tokenizer.token_to_id("<|endoftext|>")]
    (path / "tokenizer.json").write_text(tokenizer.to_str(), encoding="utf-8")
    _write_json(path / "config.json", _hf_config(recipe, vocab, eos_ids))
    _write_json(path / "tokenizer_config.json", tokenizer_config_for(recipe, tokenizer))
    _write_json(
        path / "generation_config.json", {"eos_token_id": eos_ids, "pad_token_id": eos_ids[1]}
    )
    tensors = dict(_weights(recipe, vocab))
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


def build_tokenizer() -> tokenizers.Tokenizer:
    """Byte-level BPE over the 256-byte alphabet (no merges) plus the ChatML special tokens."""
    vocab = {char: byte for byte, char in enumerate(_byte_alphabet())}
    tokenizer = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([tokenizers.AddedToken(t, special=True) for t in SPECIAL_TOKENS])
    return tokenizer


def _byte_alphabet() -> list[str]:
    """GPT-2's byte -> printable character table, indexed by byte value.

    Printable Latin-1 bytes stand for themselves; the rest are shifted past U+0100 in order.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table, shifted = {}, 0
    for byte in range(256):
        if byte in printable:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(256 + shifted)
            shifted += 1
    alphabet = [table[b] for b in range(256)]
    if set(alphabet) != set(pre_tokenizers.ByteLevel.alphabet()):
        raise RuntimeError("byte alphabet disagrees with tokenizers' ByteLevel alphabet")
    return alphabet


def _hf_config(recipe: BuiltinRecipe, vocab: int, eos_ids: list[int]) -> dict[str, Any]:
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": vocab,
        "hidden_size": recipe.hidden_size,
        "intermediate_size": recipe.intermediate_size,
        "num_hidden_layers": recipe.num_layers,
        "num_attention_heads": recipe.num_heads,
        "num_key_value_heads": recipe.num_kv_heads,
        "head_dim": recipe.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": recipe.max_position_embeddings,
        "rms_norm_eps": recipe.rms_norm_eps,
        "rope_theta": recipe.rope_theta,
        "rope_scaling": None,
        "attention_bias": False,
        "tie_word_embeddings": True,
        "use_sliding_window": False,
        "bos_token_id": None,
        "eos_token_id": eos_ids[0],
        "torch_dtype": "float32",
    }


def tokenizer_config_for(recipe: BuiltinRecipe, tokenizer: tokenizers.Tokenizer) -> dict[str, Any]:
    """tokenizer_config.json of a built-in recipe: special tokens and chat template."""
    added = {str(tokenizer.token_to_id(t)): {"content": t, "special": True} for t in SPECIAL_TOKENS}
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": False,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": recipe.max_position_embeddings,
        "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": added,
        "chat_template": CHATML_TEMPLATE,
    }


def _weights(recipe: BuiltinRecipe, vocab: int) -> Iterator[tuple[str, np.ndarray]]:
    """HF-named float32 tensors. Linear weights ~ 1/sqrt(fan_in); norms are ones; the (tied)
    embedding is scaled so logits of a unit-RMS hidden state have std `logit_std`."""
    r, h = recipe, recipe.hidden_size
    embed_std = r.logit_std / np.sqrt(h)
    yield "model.embed_tokens.weight", _uniform(r.seed, "embed", (vocab, h), embed_std)
    yield "model.norm.weight", np.ones(h, np.float32)
    shapes = {
        "self_attn.q_proj": (r.num_heads * r.head_dim, h),
        "self_attn.k_proj": (r.num_kv_heads * r.head_dim, h),
        "self_attn.v_proj": (r.num_kv_heads * r.head_dim, h),
        "self_attn.o_proj": (h, r.num_heads * r.head_dim),
        "mlp.gate_proj": (r.intermediate_size, h),
        "mlp.up_proj": (r.intermediate_size, h),
        "mlp.down_proj": (h, r.intermediate_size),
    }
    for i in range(r.num_layers):
        prefix = f"model.layers.{i}."
        for part, shape in shapes.items():
            name = f"{prefix}{part}.weight"
            yield name, _uniform(r.seed, name, shape, 1 / np.sqrt(shape[1]))
        for norm, size in _layer_norms(r):
            yield f"{prefix}{norm}.weight", np.ones(size, np.float32)


def _layer_norms(r: BuiltinRecipe) -> list[tuple[str, int]]:
    return [
        ("input_layernorm", r.hidden_size),
        ("post_attention_layernorm", r.hidden_size),
        ("self_attn.q_norm", r.head_dim),
        ("self_attn.k_norm", r.head_dim),
    ]


def _uniform(seed: int, name: str, shape: tuple[int, ...], std: float) -> np.ndarray:
    """Uniform float32 tensor with standard deviation `std`, a pure function of (seed, name)."""
    key = int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little")
    bits = _splitmix64(np.uint64(key), int(np.prod(shape))) >> np.uint64(40)  # 24 bits
    centered = bits.astype(np.int64) - (1 << 23)  # exact integers in [-2^23, 2^23)
    half_width = np.float32(std * np.sqrt(3.0) / (1 << 23))
    return (centered.astype(np.float32) * half_width).reshape(shape)


def _splitmix64(key: np.uint64, n: int) -> np.ndarray:
    """n outputs of splitmix64 seeded with `key` (wrapping uint64 arithmetic)."""
    with np.errstate(over="ignore"):
        z = key + np.arange(1, n + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def _write_json(path: Path, data: Mapping[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
