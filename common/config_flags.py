"""Command-line flags generated from a dataclass of options, so each option is defined once.

Contract: `add_flags(parser_or_group, Config, prefix, aliases)` adds `--field-name` for every field of
`Config` whose metadata does not say `cli: False` (type, default and help text from the field;
booleans become `--x/--no-x`; a numeric field whose metadata has `min` (or `max`) refuses a smaller (or
larger) value, with argparse's usage error; one whose metadata has `choices` takes only those); values
land in the namespace as "<prefix>.<field>". `aliases` maps a
field to extra flag names (kept names of older commands). `config_from(namespace, Config, prefix)`
builds the dataclass back from the parsed values.
"""
from __future__ import annotations

import argparse
from dataclasses import MISSING, fields, replace
from pathlib import Path


def add_flags(p, config_cls, prefix: str | None = None, aliases: dict[str, list[str]] | None = None) -> None:
    for f in fields(config_cls):
        if f.metadata.get("cli", True):
            add_flag(p, f.name, f.type, f.default, f.metadata.get("help", f.name),
                     dest=f"{prefix}.{f.name}" if prefix else f.name, aliases=(aliases or {}).get(f.name, ()),
                     minimum=f.metadata.get("min"), maximum=f.metadata.get("max"), choices=f.metadata.get("choices"))


def config_from(namespace: argparse.Namespace | dict, config_cls, prefix: str):
    values = vars(namespace) if isinstance(namespace, argparse.Namespace) else namespace
    ours = {k.split(".", 1)[1]: v for k, v in values.items() if k.startswith(prefix + ".")}
    return replace(config_cls(), **ours)


def add_flag(p, name: str, typ, default, help_text: str, dest: str | None = None, aliases=(), minimum=None,
             choices=None, maximum=None) -> None:
    flags = ["--" + name.replace("_", "-"), *aliases]
    dest = dest or name
    typ = str(typ)
    default = None if default is MISSING else default
    if typ.startswith("bool"):
        p.add_argument(*flags, dest=dest, action=argparse.BooleanOptionalAction, default=default, help=help_text)
        return
    conv = int if typ.startswith("int") else float if typ.startswith("float") else Path if "Path" in typ else str
    if minimum is not None or maximum is not None:
        conv = within(conv, minimum, maximum)
    shown = f" (default {default})" if default is not None else ""
    p.add_argument(*flags, dest=dest, type=conv, default=default, choices=choices,
                   metavar=name.upper() if choices is None else None, help=help_text + shown)


def within(conv, minimum=None, maximum=None):
    """`conv` (an argparse type) that refuses values below `minimum` or above `maximum`."""
    def checked(text: str):
        value = conv(text)
        if minimum is not None and value < minimum:
            raise argparse.ArgumentTypeError(f"{text} is below the minimum {minimum}")
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError(f"{text} is above the maximum {maximum}")
        return value
    checked.__name__ = conv.__name__  # argparse names the type in its "invalid <type> value" message
    return checked
