"""How the settings are read: each setting's flag and HYDRA_* variable (flags win over
variables, which win over the defaults), the repeated --model NAME=PATH, and the table of
every flag (docs/operations.md "Every flag"). The settings themselves are settings.py's."""

from __future__ import annotations

import argparse
import os
from dataclasses import Field, fields
from typing import Any

from .help_texts import HELP
from .rules import CHOICES, Choices, validate
from .settings import Settings

# Spec §6.4 names these two variables; the rest follow HYDRA_<FLAG>.
_ENV_OVERRIDES = {
    "decode_result_ttl_s": "HYDRA_DECODE_RESULT_TTL_S",
    "decode_result_max": "HYDRA_DECODE_RESULT_MAX",
}


# What a flag's or variable's text is converted to: the type a setting is annotated with in
# Settings ("int | None" is int), so a new setting declares its type in the catalog alone.
_KINDS: dict[str, type] = {"int": int, "float": float, "bool": bool, "str": str, "tuple": tuple}


def _field_type(f: Field[Any]) -> type:
    annotation = f.type if isinstance(f.type, str) else f.type.__name__
    return _KINDS[annotation.split("|")[0].strip().partition("[")[0]]


def _env_bool(raw: str, name: str) -> bool:
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise SystemExit(f"{name}: expected a boolean (1/0, true/false), got {raw!r}")


def env_name(field_name: str) -> str:
    return _ENV_OVERRIDES.get(field_name, "HYDRA_" + field_name.upper())


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def _convert(kind: type, raw: str, name: str) -> Any:
    try:
        return kind(raw)
    except ValueError:
        raise SystemExit(f"{name}: expected {kind.__name__}, got {raw!r}") from None


# Settings filled from another flag's values (repeated --model NAME=PATH), with no flag of their own.
_NO_FLAG = frozenset({"named_models"})


def _comma_list(given: list[str]) -> tuple[str, ...]:
    return tuple(item for text in given for item in text.split(",") if item.strip())


def _help(name: str, choices: Choices, *, listed: bool) -> str:
    """A setting's help, its "{choices}" the words handed in: listed here, or (``listed``
    false: argparse's help) argparse's own ``%(choices)s``, read only when help is shown."""
    words = choices.get(name)
    if words is None:
        return HELP[name].replace("{choices}", "the words its caller gives")
    return HELP[name].replace("{choices}", ", ".join(words) if listed else "%(choices)s")


def add_arguments(parser: argparse.ArgumentParser, choices: Choices | None = None) -> None:
    """Every setting's flag; ``choices``: the words of settings a layer above decides."""
    defaults = Settings()
    words = {**CHOICES, **(choices or {})}
    for f in (f for f in fields(Settings) if f.name not in _NO_FLAG):
        if f.name == "model":  # one PATH, or NAME=PATH repeated
            parser.add_argument("--model", dest="model", action="append", default=None, help=f"{HELP['model']} [env "
                                "HYDRA_MODEL; default None]")
            continue
        default = getattr(defaults, f.name)
        kind = _field_type(f)
        help_text = f"{_help(f.name, words, listed=False)} [env {env_name(f.name)}; default {default}]"
        if kind is bool and default is not False:  # on, or decided, by default: --NAME and --no-NAME
            parser.add_argument(
                flag_name(f.name), dest=f.name, action=argparse.BooleanOptionalAction, default=None, help=help_text
            )
            continue
        if kind is bool:  # a switch: given means True
            parser.add_argument(
                flag_name(f.name), dest=f.name, action="store_const", const=True, default=None, help=help_text
            )
            continue
        if kind is tuple:  # repeatable, each a comma list (llama-server's --lora)
            parser.add_argument(flag_name(f.name), dest=f.name, action="append", default=None, help=help_text)
            continue
        parser.add_argument(
            flag_name(f.name), dest=f.name, type=kind, choices=words.get(f.name), default=None, help=help_text
        )


def settings_from(
    args: argparse.Namespace | None = None,
    env: dict[str, str] | None = None,
    *,
    choices: Choices | None = None,
    **overrides: Any,
) -> Settings:
    """Flags win over HYDRA_* variables, which win over defaults; ``choices``: as ``validate``'s."""
    env = dict(os.environ) if env is None else env
    defaults = Settings()
    values: dict[str, Any] = {}
    for f in (f for f in fields(Settings) if f.name not in _NO_FLAG):
        kind = _field_type(f)
        given = getattr(args, f.name, None) if args is not None else None
        if f.name == "model" and given is not None:
            values["model"], values["named_models"] = split_model_flags(given)
            continue
        if given is not None:
            values[f.name] = _comma_list(given) if kind is tuple else given
        elif env.get(env_name(f.name)):
            raw = env[env_name(f.name)]
            if kind is tuple:
                values[f.name] = _comma_list([raw])
            else:
                values[f.name] = (
                    _env_bool(raw, env_name(f.name)) if kind is bool else _convert(kind, raw, env_name(f.name))
                )
    values.update(overrides)
    settings = Settings(**{**{f.name: getattr(defaults, f.name) for f in fields(Settings)}, **values})
    validate(settings, choices)
    return settings


def split_model_flags(given: list[str]) -> tuple[str | None, tuple[str, ...]]:
    """--model flags as (one PATH alone, as always; or NAME=PATH each: an existing file is a PATH)."""
    named = [v for v in given if "=" in v and not os.path.isfile(v) and "/" not in v.partition("=")[0]]
    if len(given) == 1 and not named:
        return given[0], ()
    if len(named) != len(given):
        raise SystemExit("--model: give one PATH, or NAME=PATH for each of several models; got "
                         f"{', '.join(map(repr, given))}")
    return None, tuple(named)


def settings_table(choices: Choices | None = None) -> str:
    """Markdown table of every setting (docs/operations.md "Every flag")."""
    rows = ["| flag | env | default | meaning |", "|---|---|---|---|"]
    defaults = Settings()
    for f in (f for f in fields(Settings) if f.name not in _NO_FLAG):
        meaning = _help(f.name, {**CHOICES, **(choices or {})}, listed=True)
        rows.append(f"| `{flag_name(f.name)}` | `{env_name(f.name)}` | `{getattr(defaults, f.name)}` | {meaning} |")
    return "\n".join(rows)

