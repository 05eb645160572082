"""vLLM's command-line forms for `pdserve serve`, mapped onto pdserve's own flags.

A user with vLLM habits can write

    pdserve serve MODEL --dtype half --served-model-name NAME \\
        --kv-transfer-config '{"kv_connector":"PdserveConnector","kv_role":"kv_producer",
                               "kv_connector_extra_config":{"mode":"push"}}'

and gets the same instance as with pdserve's flags (`--model`, `--dtype float16`,
`--role prefill --kv-transfer push`). The mapping (docs/cli.md has it as a table):

- `MODEL` (positional) is `--model`; giving both with different values is an error;
- `--dtype half|float16|bfloat16|float|float32|auto`: `half` is float16, `float` float32
  (`pdserve.config.dtype_name`);
- `--kv-transfer-config JSON`: `kv_role` kv_producer -> `--role prefill`, kv_consumer ->
  `--role decode`, kv_both -> `--role both`; `kv_connector` PdserveConnector (or
  `pdserve`) takes `mode` (pull|push, default push) and `transport` (tcp|nixl, default
  tcp) from `kv_connector_extra_config`; vLLM's NixlConnector means pull over nixl and
  NixlPushConnector push over nixl (pdserve's design with NIXL as the transport). The JSON
  is applied where pdserve's own flags were left at their defaults: an explicit
  `--role`/`--kv-transfer`/`--transport` that disagrees with it is an error.

`apply` runs after argparse, on the parsed namespace, and reports a bad form through
`parser.error` (the subcommand's usage and one line).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

KV_ROLES = {"kv_producer": "prefill", "kv_consumer": "decode", "kv_both": "both"}
# connector name -> (transfer mode or None: from extra config, transport or None: likewise)
CONNECTORS: dict[str, tuple[str | None, str | None]] = {
    "PdserveConnector": (None, None),
    "pdserve": (None, None),
    "NixlConnector": ("pull", "nixl"),
    "NixlPushConnector": ("push", "nixl"),
}
EXTRA_KEYS = {"mode": ("pull", "push"), "transport": ("tcp", "nixl")}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The positional MODEL and `--kv-transfer-config`."""
    parser.add_argument(
        "model_tag",
        nargs="?",
        metavar="MODEL",
        help="the model, as vLLM takes it (the same as --model)",
    )
    parser.add_argument(
        "--kv-transfer-config",
        type=_json_object,
        metavar="JSON",
        help="vLLM's P/D config: kv_role (kv_producer: prefill, kv_consumer: decode, kv_both: "
        "both), kv_connector (PdserveConnector with kv_connector_extra_config mode pull|push "
        "and transport tcp|nixl; NixlConnector: pull over nixl; NixlPushConnector: push over "
        "nixl); see docs/cli.md",
    )


def apply(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Fold the vLLM forms into pdserve's flags (in place); `parser.error` on a bad one."""
    try:
        _apply_model(args, parser)
        if args.kv_transfer_config is not None:
            _apply_kv_config(args, parser, args.kv_transfer_config)
    except ValueError as exc:
        parser.error(str(exc))


def _apply_model(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    tag = args.model_tag
    if tag is None:
        return
    default = parser.get_default("model")
    if args.model not in (default, tag):
        raise ValueError(f"the model is given twice: {tag!r} and --model {args.model!r}")
    args.model = tag


def _apply_kv_config(
    args: argparse.Namespace, parser: argparse.ArgumentParser, cfg: dict[str, Any]
) -> None:
    unknown = set(cfg) - {"kv_connector", "kv_role", "kv_connector_extra_config"}
    unknown -= {"kv_connector_module_path", "kv_buffer_device", "engine_id"}
    if unknown:
        raise ValueError(f"--kv-transfer-config: unknown keys {sorted(unknown)}")
    role = KV_ROLES.get(cfg.get("kv_role", "kv_both"))
    if role is None:
        raise ValueError(f"--kv-transfer-config: kv_role must be one of {sorted(KV_ROLES)}")
    mode, transport = _connector(cfg)
    _set(args, parser, "role", role)
    _set(args, parser, "kv_transfer", mode)
    _set(args, parser, "transport", transport)
    if cfg.get("engine_id"):
        _set(args, parser, "engine_id", str(cfg["engine_id"]))


def _connector(cfg: dict[str, Any]) -> tuple[str, str]:
    name = cfg.get("kv_connector", "PdserveConnector")
    if name not in CONNECTORS:
        raise ValueError(
            f"--kv-transfer-config: kv_connector {name!r} is not one pdserve runs "
            f"(choose from {sorted(CONNECTORS)})"
        )
    extra = cfg.get("kv_connector_extra_config") or {}
    if not isinstance(extra, dict):
        raise ValueError("--kv-transfer-config: kv_connector_extra_config must be an object")
    for key, value in extra.items():
        allowed = EXTRA_KEYS.get(key)
        if allowed is None or value not in allowed:
            raise ValueError(
                f"--kv-transfer-config: kv_connector_extra_config {key}={value!r} "
                f"(known: {', '.join(f'{k} in {v}' for k, v in EXTRA_KEYS.items())})"
            )
    fixed_mode, fixed_transport = CONNECTORS[name]
    return (
        fixed_mode or extra.get("mode", "push"),
        fixed_transport or extra.get("transport", "tcp"),
    )


def _set(args: argparse.Namespace, parser: argparse.ArgumentParser, dest: str, value: str) -> None:
    """Set `dest` from the JSON unless the user gave a different value explicitly."""
    current = getattr(args, dest)
    if current != parser.get_default(dest) and current != value:
        flag = "--" + dest.replace("_", "-")
        raise ValueError(f"--kv-transfer-config says {value!r} but {flag} says {current!r}")
    setattr(args, dest, value)


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def config_file_args(path: str) -> list[str]:
    """vLLM's `--config FILE`: a YAML mapping of flag names (dashes or underscores) to
    values, as command-line words to put before the real ones (so that those override).
    `true` is the bare flag, `false` its `--no-` form, a list repeats the values after the
    flag, a mapping goes as JSON (`kv-transfer-config`). ValueError for an unreadable file."""
    import yaml

    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except (OSError, yaml.YAMLError) as exc:
        raise ValueError(f"--config {path}: {exc}") from None
    if data is None:
        return []
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: must be a mapping of flag names to values")
    words: list[str] = []
    for key, value in data.items():
        flag = "--" + str(key).replace("_", "-")
        if value is True:
            words.append(flag)
        elif value is False:
            words.append("--no-" + flag[2:])
        elif isinstance(value, list):
            words += [flag, *map(str, value)]
        elif isinstance(value, dict):
            words += [flag, json.dumps(value)]
        else:
            words += [flag, str(value)]
    return words
