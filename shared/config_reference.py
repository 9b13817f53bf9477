"""The reference of every ``config.toml`` key, generated from the Structs of :mod:`shared.config`.

Each key's type, range and default come from the Struct field (``msgspec.inspect``); its meaning from the
``Attributes:`` section of the Struct's docstring. ``sluice config --reference`` prints it as Markdown
(``docs/config.md`` is that output), and :func:`config_toml_keys` lists the keys a ``config.toml`` sets or shows
commented out, so a test can check that the shipped file mentions every key and no key that does not exist.
"""

from __future__ import annotations

import inspect
import json
import math
import re
from dataclasses import dataclass
from typing import Any

import msgspec
import msgspec.inspect as mi

from shared.config import Config


@dataclass(frozen=True)
class ConfigKey:
    """One key of ``config.toml``.

    Attributes:
        section: the TOML table (``model``, ``kv.retention.normal``, ``tiers`` for ``[[tiers]]``); "" = top level.
        key: the key's name in that table.
        array: the table is an array of tables (``[[tiers]]``, ``[[api_keys]]``, ``[[pools]]``).
        type_text: the type and range, e.g. ``int ≥ 1``, ``"auto" | "cpu"``.
        default_text: the default as a TOML value, or ``required``.
        meaning: from the Struct's docstring.
    """

    section: str
    key: str
    array: bool
    type_text: str
    default_text: str
    meaning: str

    @property
    def dotted(self) -> str:
        """``section.key`` (``tiers[].name`` for an array of tables)."""
        if not self.section:
            return self.key
        return f"{self.section}{'[]' if self.array else ''}.{self.key}"


_ATTRIBUTE = re.compile(r"^(\s*)([a-z_][a-z0-9_]*(?:,\s*[a-z_][a-z0-9_]*)*):\s?(.*)$")


def attribute_docs(cls: type) -> dict[str, str]:
    """Return ``{field: meaning}`` from the ``Attributes:`` section of ``cls``'s docstring (joined lines)."""
    doc = inspect.cleandoc(cls.__doc__ or "")
    lines = doc.splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.strip() == "Attributes:")
    except StopIteration:
        return {}
    docs: dict[str, str] = {}
    names: list[str] = []
    indent = None
    for line in lines[start + 1:]:
        if not line.strip():
            continue
        match = _ATTRIBUTE.match(line)
        if match and (indent is None or len(match.group(1)) == indent):
            indent = len(match.group(1))
            names = [name.strip() for name in match.group(2).split(",")]
            for name in names:
                docs[name] = match.group(3).strip()
        elif indent is not None and len(line) - len(line.lstrip()) > indent:
            for name in names:
                docs[name] += " " + line.strip()
        else:
            break
    return docs


def toml_value(value: Any) -> str:
    """Return ``value`` written as TOML (``inf`` for an infinite float, ``unset`` for None)."""
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and math.isinf(value):
        return "inf" if value > 0 else "-inf"
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items()) + "}" if value else "{}"
    return repr(value)


def _bound_text(value: int | float) -> str:
    """Return a range bound as text, a whole number without its ``.0``.

    ``typing.Annotated`` caches its aliases, and ``Meta(gt=0)`` equals ``Meta(gt=0.0)``: the same constraint reads as
    ``0`` or ``0.0`` depending on which module built the alias first, so the text must not depend on the spelling.
    """
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def _type_text(info: mi.Type) -> str:
    match info:
        case mi.BoolType():
            return "bool"
        case mi.StrType():
            return "string"
        case mi.IntType() | mi.FloatType():
            name = "int" if isinstance(info, mi.IntType) else "float"
            bounds = [f"{op} {_bound_text(v)}" for op, v in (("≥", info.ge), (">", info.gt), ("≤", info.le),
                                                              ("<", info.lt)) if v is not None]
            return f"{name} {' and '.join(bounds)}" if bounds else name
        case mi.LiteralType():
            return " | ".join(toml_value(v) for v in info.values)
        case mi.ListType() | mi.VarTupleType():
            return f"list of {_type_text(info.item_type)}"
        case mi.DictType():
            return f"table of {_type_text(info.value_type)}"
        case mi.UnionType():
            return " or ".join("none" if isinstance(t, mi.NoneType) else _type_text(t) for t in info.types)
    return type(info).__name__


def _field_default(field: mi.Field) -> Any:
    if field.default is not msgspec.NODEFAULT:
        return field.default
    if field.default_factory is not msgspec.NODEFAULT:
        return field.default_factory()
    return msgspec.NODEFAULT


def _walk(struct: mi.StructType, default: Any, section: str, array: bool) -> list[ConfigKey]:
    docs = attribute_docs(struct.cls)
    keys: list[ConfigKey] = []
    for field in struct.fields:
        if default is not msgspec.NODEFAULT and default is not None:
            value = getattr(default, field.name)
        else:
            value = _field_default(field)
        child = f"{section}.{field.name}" if section else field.name
        if isinstance(field.type, mi.StructType):
            keys += _walk(field.type, value, child, array=False)
        elif isinstance(field.type, mi.ListType) and isinstance(field.type.item_type, mi.StructType):
            keys += _walk(field.type.item_type, msgspec.NODEFAULT, child, array=True)
        else:
            default_text = "required" if value is msgspec.NODEFAULT else toml_value(value)
            keys.append(ConfigKey(section, field.name, array, _type_text(field.type), default_text,
                                  docs.get(field.name, "")))
    return keys


def config_keys() -> list[ConfigKey]:
    """Return every key of :class:`shared.config.Config`, in declaration order."""
    return _walk(mi.type_info(Config), Config(), "", array=False)


def render_markdown(keys: list[ConfigKey] | None = None) -> str:
    """Return the reference as Markdown: one table per TOML table, in declaration order."""
    keys = config_keys() if keys is None else keys
    out = ["# Configuration reference", "",
           "Generated from the Structs of `shared/config.py` by `sluice config --reference`; do not edit by hand.",
           "Every key is optional unless marked required; an unknown key is an error. Any key of a table can be",
           "overridden from the environment as `SLUICE_<SECTION>__<KEY>=value` (e.g. `SLUICE_GATEWAY__PORT=8001`).",
           "The commented `config.toml` at the repo root shows every key too."]
    section = None
    for key in keys:
        if key.section != section:
            section = key.section
            title = "top level" if not section else (f"[[{section}]]" if key.array else f"[{section}]")
            out += ["", f"## {title}", "", "| key | type | default | meaning |", "| --- | --- | --- | --- |"]
        meaning = key.meaning.replace("``", "`").replace("|", "\\|")
        type_text = key.type_text.replace("|", "\\|")
        out.append(f"| `{key.key}` | {type_text} | `{key.default_text}` | {meaning} |")
    return "\n".join(out) + "\n"


_TOML_HEADER = re.compile(r"^#?\s*\[\[?([a-z_][a-z0-9_.]*)\]\]?\s*(?:#.*)?$")
_TOML_KEY = re.compile(r"^#?\s*([a-z_][a-z0-9_]*)\s*=\s*\S")


def config_toml_keys(text: str) -> set[tuple[str, str]]:
    """Return the ``(section, key)`` pairs that a config.toml sets or shows commented out (``# key = value``).

    A commented table header (``# [registry]``) opens its section as a real one does.
    """
    found: set[tuple[str, str]] = set()
    section = ""
    for line in text.splitlines():
        line = line.strip()
        if header := _TOML_HEADER.match(line):
            section = header.group(1)
        elif key := _TOML_KEY.match(line):
            found.add((section, key.group(1)))
    return found
