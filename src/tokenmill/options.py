"""Command-line flags made from settings records, and records made from parsed flags.

    add_options(parser_or_group, EngineConfig)          # one flag per field
    config = options_from(args, EngineConfig)            # the record, validated

A field's flag is its name in kebab case unless its ``option`` metadata names another;
its help text and choices come from that metadata (``config.option``). Flags default to
None (absent), so the record's own defaults apply and an explicit value always wins.
Booleans take ``--x/--no-x``; ``tuple[str, ...]`` fields take the flag repeatedly.
Standard library only.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any, TypeVar

T = TypeVar("T")


def cli_fields(cls: type) -> list[dataclasses.Field]:
    """The fields of the settings record ``cls`` that are command-line options."""
    return [f for f in dataclasses.fields(cls) if f.metadata.get("cli", False)]


def flag_name(f: dataclasses.Field) -> str:
    return "--" + (f.metadata.get("flag") or f.name.replace("_", "-"))


def add_options(parser: argparse.ArgumentParser | argparse._ArgumentGroup, cls: type,
                skip: tuple[str, ...] = ()) -> None:
    """One flag per option field of ``cls`` (but those named in ``skip``)."""
    hints = typing.get_type_hints(cls)
    for f in cli_fields(cls):
        if f.name in skip:
            continue
        kind = hints[f.name]
        default = f.default if f.default is not dataclasses.MISSING else None
        help_text = f.metadata["help"]
        if default not in (None, (), "") and not isinstance(default, bool):
            help_text += f" (default: {default})"
        common = {"dest": f.name, "default": None, "help": help_text}
        if kind is bool:
            parser.add_argument(flag_name(f), action=argparse.BooleanOptionalAction, **common)
        elif typing.get_origin(kind) is tuple:
            parser.add_argument(flag_name(f), action="append", metavar="VALUE", **common)
        else:
            parser.add_argument(flag_name(f), type=f.metadata.get("parse") or _scalar(kind),
                                choices=f.metadata.get("choices"),
                                metavar=flag_name(f)[2:].upper().replace("-", "_"), **common)


def options_from(args: argparse.Namespace, cls: type[T], **values: Any) -> T:
    """``cls`` from the flags ``add_options`` added that were given, plus ``values``."""
    given = {f.name: getattr(args, f.name) for f in cli_fields(cls)
             if getattr(args, f.name, None) is not None}
    for f in cli_fields(cls):
        if f.name in given and isinstance(given[f.name], list):
            given[f.name] = tuple(given[f.name])
    return cls(**{**given, **values})


def _scalar(kind: Any) -> type:
    """The argparse type of a field annotated ``kind``: ``int | None`` -> int; a union of
    several scalar types (``str | int``) -> str, which the record parses itself."""
    if isinstance(kind, types.UnionType) or typing.get_origin(kind) is typing.Union:
        scalars = [k for k in typing.get_args(kind) if k is not type(None)]
        return scalars[0] if len(scalars) == 1 else str
    return kind
