"""Command-line options declared on the config dataclasses: each option once (field, default,
help), argparse built from it, the config built back from the parsed namespace.

A field becomes a flag with `option(default, help=...)` in its frozen dataclass. A command's
module calls `add_options(parser, Config)` to get one argparse argument per such field, and
`from_args(Config, args, **computed)` to turn the namespace back into the config; the
namespace never leaves the command's module (configs are what is handed down).

What a flag takes from its field, unless the option says otherwise:
- its name: `--` and the field's name with dashes (`flag=` names another);
- its default: the field's (`flag_default=` where the command line's differs, as for a field
  without one; `env=` for a default read from the environment when the parser is built);
- its type: the annotation's (`int`, `float`, `str`, `Path`, `X | None` as `X`), or
  `parse=`, an argparse type function (`positive_int` ...);
- its choices: the values of a `Literal` annotation, in order (not with `parse=`, which
  checks its own);
- bool: `--x` stores True (default False); a default-True field names its `--no-x` flag,
  which stores False; `negatable=True` gives both `--x` and `--no-x`;
- an optional value: `nargs="?"` with `const=`, the value of the flag given alone.

Positional arguments are not declared here: a command adds its own with `add_argument` and
passes its value to `from_args` as a computed field.

A flag's namespace attribute (dest) is argparse's own name for it (`--kv-cache-memory` ->
`kv_cache_memory`; a `--no-x` flag -> `x`), so one flag may feed fields of several configs:
the others declare `from_flag("--kv-host", ...)` and declare nothing on the parser.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

_KEY = "pdserve.option"
_READS = "pdserve.reads"
_NO = "--no-"


class _Unset:
    """`Option.flag_default` when the option gives none."""

    def __repr__(self) -> str:
        return "UNSET"


UNSET: Any = _Unset()


@dataclasses.dataclass(frozen=True)
class Option:
    """How one config field appears on the command line (see the module docstring)."""

    help: str | None  # None: hidden from --help
    flag: str | None = None
    aliases: tuple[str, ...] = ()  # other names of the flag (older spellings)
    group: str | None = None  # the title of the argument group it is listed under
    metavar: str | tuple[str, ...] | None = None
    parse: Callable[[str], Any] | None = None
    choices: tuple[Any, ...] | None = None  # None: a Literal annotation's values, if any
    env: str | None = None
    flag_default: Any = UNSET  # the flag's default, where it is not the field's
    negatable: bool = False
    required: bool | None = None  # None: required when the field has no default
    nargs: str | int | None = None  # "+" or "*": see `_list_kwargs` on repeating it; "?"
    const: Any = None  # with nargs="?": the value of the flag given without one
    append: bool = False  # one value per use, the flag repeated for more

    def name(self, field: str) -> str:
        return self.flag or "--" + field.replace("_", "-")


def option(
    default: Any = dataclasses.MISSING,
    *,
    help: str | None,
    default_factory: Callable[[], Any] | Any = dataclasses.MISSING,
    **how: Any,
) -> Any:
    """A dataclass field that is also a command-line flag (keywords: `Option`'s fields)."""
    meta = {_KEY: Option(help=help, **how)}
    return dataclasses.field(default=default, default_factory=default_factory, metadata=meta)


def from_flag(flag: str, default: Any = dataclasses.MISSING) -> Any:
    """A dataclass field that takes the value of a flag another config declares."""
    return dataclasses.field(default=default, metadata={_READS: flag})


def dest(flag: str) -> str:
    """The namespace attribute of `flag` (argparse's name; `--no-x`: `x`)."""
    return flag.removeprefix(_NO).removeprefix("--").replace("-", "_")


def add_options(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    cls: type,
    *,
    only: tuple[str, ...] | None = None,
    group: str | None = None,
) -> None:
    """Add a flag for each `option` field of `cls` (the fields named in `only`, in that order,
    if given) to `parser`, under the field's group or else `group` (by title; made if new)."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for name in only if only is not None else tuple(fields):
        field = fields[name]
        opt = field.metadata.get(_KEY)
        if opt is None:
            continue
        target = group_titled(parser, opt.group or group)
        flags = (opt.name(name), *opt.aliases)
        target.add_argument(*flags, **_argparse_kwargs(field, opt, hints[name]))


def from_args(cls: type, args: argparse.Namespace, **computed: Any) -> Any:
    """The `cls` config of the parsed flags; `computed` gives the fields that are not a flag's
    value as parsed (and overrides the rest). A field whose flag the command line lacks keeps
    its default."""
    values: dict[str, Any] = {}
    for field in dataclasses.fields(cls):
        flag = field.metadata.get(_READS)
        opt = field.metadata.get(_KEY)
        if opt is not None:
            flag = opt.name(field.name)
        # A flag its command did not add (`add_options(..., only=...)`): the field's default.
        if flag is not None and field.name not in computed and hasattr(args, dest(flag)):
            value = getattr(args, dest(flag))
            values[field.name] = tuple(value) if isinstance(value, list) else value
    return cls(**values, **computed)


def _argparse_kwargs(field: dataclasses.Field, opt: Option, hint: Any) -> dict[str, Any]:
    default = _default(field, opt)
    kwargs: dict[str, Any] = {"dest": dest(opt.name(field.name)), "default": default}
    kwargs["help"] = argparse.SUPPRESS if opt.help is None else opt.help
    if opt.metavar is not None:
        kwargs["metavar"] = opt.metavar
    if _unwrap(hint) is bool:
        return kwargs | {"action": _bool_action(opt, default)}
    required = opt.required if opt.required is not None else _no_default(field)
    if required:
        kwargs["required"] = True
        del kwargs["default"]
    if opt.nargs == "?":
        kwargs |= {"nargs": "?", "const": opt.const}
    elif opt.nargs is not None or opt.append:
        kwargs |= _list_kwargs(opt, default, required)
    # A `parse` function checks its own values (its result may be a tuple of choices).
    choices = opt.choices if opt.choices is not None or opt.parse else _choices(hint)
    if choices is not None:
        kwargs["choices"] = choices
    kwargs["type"] = opt.parse or _scalar(hint, choices)
    return kwargs


def _bool_action(opt: Option, default: bool) -> Any:
    if opt.negatable:
        return argparse.BooleanOptionalAction
    return "store_false" if default else "store_true"


def _list_kwargs(opt: Option, default: Any, required: bool) -> dict[str, Any]:
    """A flag of several values: repeating it adds values where its default is empty;
    argparse would add them to a non-empty default, so there the last use's values replace
    it. A fixed count (`nargs=2`) is stored as given."""
    kwargs: dict[str, Any] = {} if opt.nargs is None else {"nargs": opt.nargs}
    if isinstance(opt.nargs, int):
        return kwargs
    if opt.append or not default:
        kwargs["action"] = "append" if opt.append else "extend"
        if not required:  # argparse copies it before adding to it
            kwargs["default"] = []
    elif not required:
        kwargs["default"] = list(default)
    return kwargs


def _default(field: dataclasses.Field, opt: Option) -> Any:
    if opt.flag_default is not UNSET:
        default = opt.flag_default
    elif field.default is not dataclasses.MISSING:
        default = field.default
    elif field.default_factory is not dataclasses.MISSING:
        default = field.default_factory()
    else:
        default = None
    if opt.env is not None:
        return os.environ.get(opt.env) or default
    return default


def _no_default(field: dataclasses.Field) -> bool:
    return field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING


def _unwrap(hint: Any) -> Any:
    """`X | None` -> `X`; `tuple[X, ...]` -> `X`."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        hint = args[0] if len(args) == 1 else hint
    if typing.get_origin(hint) is tuple:
        hint = typing.get_args(hint)[0]
    return hint


def _choices(hint: Any) -> tuple[Any, ...] | None:
    hint = _unwrap(hint)
    return typing.get_args(hint) if typing.get_origin(hint) is Literal else None


def _scalar(hint: Any, choices: tuple[Any, ...] | None) -> Callable[[str], Any]:
    if choices:
        return type(choices[0])
    hint = _unwrap(hint)
    if hint in (int, float, str, Path):
        return hint
    raise TypeError(f"no command-line type for {hint!r}: give the option a `parse`")


def group_titled(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup, title: str | None
) -> argparse.ArgumentParser | argparse._ArgumentGroup:
    """The argument group of `parser` titled `title` (made if new); `parser` for None."""
    if title is None or not isinstance(parser, argparse.ArgumentParser):
        return parser
    for g in parser._action_groups:
        if g.title == title:
            return g
    return parser.add_argument_group(title)


# -- argparse types shared by the commands ------------------------------------------------


def positive_int(text: str) -> int:
    """argparse type: an int >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def positive_float(text: str) -> float:
    """argparse type: a float > 0."""
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def port_number(text: str) -> int:
    """argparse type: a TCP port, 0 (any free one) included."""
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be in 0-65535, got {value}")
    return value


def key_value(text: str) -> tuple[str, str]:
    """argparse type: `KEY=VALUE` as (key, value), both stripped; the value may be empty."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key.strip(), value.strip()
