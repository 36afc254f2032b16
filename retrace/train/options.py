"""Each training setting declared once: a config dataclass field carries its default and its meaning
(`setting`), and the trainer's click options are generated from those fields (`click_options`).

The option of field `foo_bar` is `--foo-bar` (or the field's `flag`), its type follows the annotation: a
bool is a flag, `bool | None` an on/off pair (`--bf16/--no-bf16`), `list[int] | None` and
`tuple[float, ...]` take comma-separated numbers; its default is the field's (or `cli_default`, where the
command resolves the value itself), shown in --help. Fields with `cli=False` are set from Python only.

Only click and the standard library are imported here: `retrace --help` stays fast.
"""

from __future__ import annotations

import dataclasses
import typing

import click

_MISSING = dataclasses.MISSING


def setting(default=_MISSING, help: str = "", *, flag: str | None = None, choices: tuple[str, ...] | None = None,
            cli: bool = True, cli_default=_MISSING, default_factory=_MISSING):
    """A config field with its default and meaning (the --help text of its option)."""
    meta = {"help": help, "flag": flag, "choices": choices, "cli": cli, "cli_default": cli_default}
    if default_factory is not _MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def _floats(s: str | None) -> tuple[float, ...] | None:
    if s is None:
        return None
    try:
        return tuple(float(x) for x in s.split(",") if x.strip())
    except ValueError:
        raise click.BadParameter(f"expected comma-separated numbers, got {s!r}") from None


def _ints(s: str | None) -> list[int] | None:
    if s is None:
        return None
    try:
        return [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {s!r}") from None


def _option(f: dataclasses.Field, hint) -> click.Option | None:
    meta = f.metadata
    if not meta.get("cli", False):
        return None
    default = meta["cli_default"] if meta["cli_default"] is not _MISSING else f.default
    name = meta["flag"] or "--" + f.name.replace("_", "-")
    args = typing.get_args(hint)
    base = next((a for a in args if a is not type(None)), hint) if args and type(None) in args else hint
    kw: dict = {"help": meta["help"] or None}
    if hint is bool:
        return click.option(name, f.name, is_flag=True, **kw)
    if base is bool:  # bool | None
        return click.option(f"{name}/--no-{name[2:]}", f.name, default=default, **kw)
    if typing.get_origin(base) in (list, tuple):
        parse = _ints if typing.get_args(base)[0] is int else _floats
        shown = None if default is None else ",".join(f"{x:g}" for x in default)
        return click.option(name, f.name, default=shown, show_default=shown is not None,
                            callback=lambda _ctx, _p, v: parse(v), **kw)
    typ = click.Choice(list(meta["choices"])) if meta["choices"] else base
    return click.option(name, f.name, type=typ, default=default, show_default=default is not None, **kw)


def cli_fields(cls) -> list[str]:
    """The names of the fields of `cls` that are click options."""
    return [f.name for f in dataclasses.fields(cls) if f.metadata.get("cli", False)]


def click_options(cls):
    """Decorator: a click option per CLI field of the config dataclass `cls` (in field order); the command
    receives them under the field names (build the config with `from_options`)."""
    hints = typing.get_type_hints(cls)
    opts = [o for f in dataclasses.fields(cls) if (o := _option(f, hints[f.name])) is not None]

    def deco(fn):
        for o in reversed(opts):
            fn = o(fn)
        return fn

    return deco


def from_options(cls, values: dict, **overrides):
    """The config `cls` from a command's keyword arguments (its CLI fields; other keys are ignored)."""
    return cls(**{**{k: values[k] for k in cli_fields(cls) if k in values}, **overrides})


__all__ = ["setting", "click_options", "cli_fields", "from_options"]
