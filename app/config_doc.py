"""The configuration reference, generated from the settings classes in `app/settings.py`.

The settings classes are the single source of truth: this module walks their fields with
pydantic's `model_fields` and prints one Markdown table per group (the top-level settings,
then each nested model), giving each setting's environment variable, type, default and
description. Nothing here names a setting, so a field added to the classes appears in the
next generated file.

    python -m app.config_doc > docs/configuration.md   # regenerate (`make docs`)
    python -m app.config_doc --check                     # exit 1 if that file is stale
"""

from __future__ import annotations

import argparse
import inspect
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import annotated_types
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

ROOT = Path(__file__).resolve().parent.parent
DOC_PATH = ROOT / "docs" / "configuration.md"


class Group:
    """One table: the settings of one class, reached from the top settings by `path`."""

    def __init__(self, path: tuple[str, ...], doc: str) -> None:
        self.path = path
        self.doc = doc
        self.rows: list[tuple[str, str, str, str]] = []


def render(settings_cls: type[BaseModel] | None = None) -> str:
    """The Markdown reference of `settings_cls` (Texel's `Settings` by default)."""
    if settings_cls is None:
        from app.settings import Settings

        settings_cls = Settings
    config = getattr(settings_cls, "model_config", {})
    prefix = config.get("env_prefix", "") or ""
    delimiter = config.get("env_nested_delimiter") or "__"
    case_sensitive = bool(config.get("case_sensitive", False))

    def env_name(path: tuple[str, ...]) -> str:
        name = prefix + delimiter.join(path)
        return name if case_sensitive else name.upper()

    groups: list[Group] = []
    _collect(settings_cls, (), _own_doc(settings_cls), None, env_name, groups)

    intro = f"Texel reads its settings from environment variables with the prefix `{prefix}`"
    nested = [group for group in groups if group.path and group.rows]
    if nested:
        example = nested[0].rows[0][0]
        intro += f"; a nested setting joins its names with `{delimiter}` (`{example}`)"
    intro += "." + ("" if case_sensitive else " Names are not case-sensitive.")
    lines = [
        "# Configuration",
        "",
        "<!-- Generated from app/settings.py by `python -m app.config_doc` (`make docs`). "
        "Edit the settings classes, not this file. -->",
        "",
        intro,
        "A default of *unset* means Texel chooses at start-up; the description says how.",
    ]
    for group in groups:
        if not group.rows:
            continue
        title = ".".join(group.path) if group.path else "Server"
        pattern = env_name(group.path) + (delimiter if group.path else "") + "*"
        lines += ["", f"## {title} (`{pattern}`)", ""]
        if group.doc:
            lines += [group.doc, ""]
        lines += ["| variable | type | default | description |", "|---|---|---|---|"]
        for variable, type_text, default, description in group.rows:
            lines.append(f"| `{variable}` | {type_text} | {default} | {description} |")
    lines.append("")
    return "\n".join(lines)


def _collect(
    cls: type[BaseModel],
    path: tuple[str, ...],
    doc: str,
    instance: BaseModel | None,
    env_name: Callable[[tuple[str, ...]], str],
    groups: list[Group],
) -> None:
    group = Group(path, doc)
    groups.append(group)
    nested: list[tuple[str, type[BaseModel], str, BaseModel | None]] = []
    for name, field in cls.model_fields.items():
        key = _env_key(name, field)
        model_cls = _model_class(field.annotation)
        if model_cls is not None:
            default = _default(field, instance, name)
            nested_doc = _description(cls, name, field) or _own_doc(model_cls)
            nested.append(
                (key, model_cls, nested_doc, default if isinstance(default, BaseModel) else None)
            )
            continue
        group.rows.append(
            (
                env_name((*path, key)),
                _type_text(field),
                _default_text(_default(field, instance, name)),
                _cell(_description(cls, name, field)),
            )
        )
    for key, model_cls, nested_doc, default in nested:
        _collect(model_cls, (*path, key), nested_doc, default, env_name, groups)


def _env_key(name: str, field: FieldInfo) -> str:
    alias = field.validation_alias if isinstance(field.validation_alias, str) else field.alias
    return alias or name


def _model_class(annotation: Any) -> type[BaseModel] | None:
    """The settings class a field nests, if it nests one (also inside `X | None`)."""
    if inspect.isclass(annotation) and issubclass(annotation, BaseModel):
        return annotation
    if _is_union(annotation):
        models = [arg for arg in get_args(annotation) if _model_class(arg) is not None]
        if len(models) == 1:
            return models[0]
    return None


def _default(field: FieldInfo, instance: BaseModel | None, name: str) -> Any:
    # A nested default built by its factory may differ from its class's defaults.
    if instance is not None and name in type(instance).model_fields:
        return getattr(instance, name)
    if field.default_factory is not None:
        try:
            return field.default_factory()
        except Exception:
            return PydanticUndefined
    return field.default


def _description(cls: type[BaseModel], name: str, field: FieldInfo) -> str:
    """The field's description; one that a subclass overrides without a description
    keeps the one its base class gives."""
    if field.description:
        return field.description
    for base in cls.__mro__[1:]:
        fields = getattr(base, "model_fields", None)
        if isinstance(fields, dict) and name in fields and fields[name].description:
            return fields[name].description
    return ""


def _own_doc(cls: type) -> str:
    """The class's docstring, or its nearest project base class's: never pydantic's."""
    for klass in cls.__mro__:
        if klass.__module__.split(".")[0] in ("pydantic", "pydantic_settings", "builtins"):
            break
        doc = klass.__dict__.get("__doc__")
        if doc:
            return " ".join(inspect.cleandoc(doc).split())
    return ""


def _type_text(field: FieldInfo) -> str:
    text, optional = _annotation_text(field.annotation)
    bounds = _bounds(field)
    if bounds:
        text += ", " + ", ".join(bounds)
    if optional:
        text += ", optional"
    return _cell(text)


def _annotation_text(annotation: Any) -> tuple[str, bool]:
    """A readable type and whether it admits None."""
    if annotation is None or annotation is type(None):
        return "none", True
    if get_origin(annotation) is Literal:
        values = [f"`{_scalar(value)}`" for value in get_args(annotation)]
        if len(values) == 1:
            return values[0], False
        return ", ".join(values[:-1]) + " or " + values[-1], False
    if _is_union(annotation):
        args = get_args(annotation)
        optional = any(arg is type(None) for arg in args)
        parts = [_annotation_text(arg)[0] for arg in args if arg is not type(None)]
        return " or ".join(parts), optional
    origin = get_origin(annotation)
    if origin in (list, tuple, set, frozenset):
        args = [arg for arg in get_args(annotation) if arg is not Ellipsis]
        inner = _annotation_text(args[0])[0] if args else "any"
        return f"list of {inner}", False
    if origin is dict:
        return "mapping", False
    if inspect.isclass(annotation):
        return ("path" if issubclass(annotation, Path) else annotation.__name__), False
    return str(annotation).replace("typing.", ""), False


def _is_union(annotation: Any) -> bool:
    return get_origin(annotation) in (Union, types.UnionType)


def _bounds(field: FieldInfo) -> list[str]:
    signs = {
        annotated_types.Gt: ("gt", ">"),
        annotated_types.Ge: ("ge", "≥"),
        annotated_types.Lt: ("lt", "<"),
        annotated_types.Le: ("le", "≤"),
        annotated_types.MinLen: ("min_length", "length ≥"),
        annotated_types.MaxLen: ("max_length", "length ≤"),
        annotated_types.MultipleOf: ("multiple_of", "multiple of"),
    }
    out = []
    for constraint in field.metadata:
        for kind, (attribute, sign) in signs.items():
            if isinstance(constraint, kind):
                out.append(f"{sign} {_scalar(getattr(constraint, attribute))}")
    return out


def _default_text(value: Any) -> str:
    if value is PydanticUndefined:
        return "required"
    if value is None:
        return "*unset*"
    if isinstance(value, list | tuple | set | frozenset):
        if not value:
            return "empty"
        return _cell(", ".join(f"`{_scalar(item)}`" for item in value))
    return _cell(f"`{_scalar(value)}`")


def _scalar(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, str | Path):
        return _repo_relative(value)
    return str(value)


def _repo_relative(value: str | Path) -> str:
    """A path inside the repository, relative to its root; anything else unchanged."""
    text = str(value)
    path = Path(text)
    if path.is_absolute():
        try:
            return path.resolve().relative_to(ROOT).as_posix()
        except ValueError:
            pass
    return text


def _cell(text: str) -> str:
    """Text fit for one Markdown table cell: one line, pipes escaped, and `<` outside
    code spans escaped so that `<key>` is not read as an HTML tag."""
    parts = " ".join(text.split()).split("`")
    parts[::2] = [part.replace("<", "&lt;") for part in parts[::2]]
    return "`".join(parts).replace("|", "\\|")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m app.config_doc",
        description="Print the configuration reference generated from app/settings.py.",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="print nothing; exit 1 if the reference file differs from the generated text",
    )
    parser.add_argument(
        "--file",
        type=Path,
        default=DOC_PATH,
        help="the reference file --check compares (default: docs/configuration.md)",
    )
    args = parser.parse_args(argv)
    text = render()
    if not args.check:
        sys.stdout.write(text)
        return 0
    current = args.file.read_text(encoding="utf-8") if args.file.exists() else ""
    if current != text:
        print(
            f"{_repo_relative(args.file)} is stale: regenerate it with `make docs` "
            "(python -m app.config_doc > docs/configuration.md)",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
