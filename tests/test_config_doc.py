"""docs/configuration.md is generated from the settings classes and kept up to date."""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from app import config_doc

ROOT = Path(__file__).resolve().parent.parent


class Queue(BaseModel):
    """Settings of one queue."""

    depth: int = Field(3, ge=1, description="Requests held before new ones are refused.")


class ShortQueue(Queue):
    depth: int = Field(2, ge=1)


class Demo(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="DEMO_", env_nested_delimiter="__")

    colour: Literal["red", "blue"] = Field("red", description="Paint colour.")
    queue: ShortQueue = Field(default_factory=ShortQueue)


class DemoWithAField(Demo):
    retries: int | None = Field(None, ge=0, description="Attempts before giving up.")


def test_the_configuration_reference_matches_the_settings_classes():
    written = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    generated = config_doc.render()
    diff = "\n".join(
        difflib.unified_diff(
            written.splitlines(), generated.splitlines(), "written", "generated", lineterm=""
        )
    )
    assert written == generated, f"run `make docs` to regenerate docs/configuration.md:\n{diff}"


def test_a_field_added_to_a_settings_class_appears_in_its_table():
    before = config_doc.render(Demo)
    after = config_doc.render(DemoWithAField)
    row = "| `DEMO_RETRIES` | int, ≥ 0, optional | *unset* | Attempts before giving up. |"
    assert row not in before
    assert row in after


def test_a_nested_setting_is_named_with_the_delimiter_and_shows_its_subclass_default():
    text = config_doc.render(Demo)
    assert "| `DEMO_COLOUR` | `red` or `blue` | `red` | Paint colour. |" in text
    # ShortQueue overrides the default and keeps the description its base class gives.
    assert (
        "| `DEMO_QUEUE__DEPTH` | int, ≥ 1 | `2` | Requests held before new ones are refused. |"
        in text
    )


def test_paths_inside_the_repository_are_shown_relative_to_its_root():
    class Paths(BaseSettings):
        model_config = SettingsConfigDict(env_prefix="DEMO_")

        inside: str = Field(str(ROOT / "models" / "formula" / "default"))
        outside: str = Field("/opt/models/formula")

    text = config_doc.render(Paths)
    assert "| `DEMO_INSIDE` | str | `models/formula/default` |" in text
    assert "| `DEMO_OUTSIDE` | str | `/opt/models/formula` |" in text
    assert str(ROOT) not in text


def test_check_fails_on_a_stale_file_and_passes_on_a_fresh_one(tmp_path, capsys):
    reference = tmp_path / "configuration.md"
    reference.write_text(config_doc.render().replace("TEXEL_DEVICE", "TEXEL_DEV"))
    assert config_doc.main(["--check", "--file", str(reference)]) == 1
    assert "stale" in capsys.readouterr().err

    reference.write_text(config_doc.render())
    assert config_doc.main(["--check", "--file", str(reference)]) == 0


def test_the_readme_stays_short_and_names_only_real_settings():
    """The README is a page (at most 8,000 bytes; the rest lives in docs/), and every
    `TEXEL_*` variable it names is one the reference lists."""
    readme = (ROOT / "README.md").read_bytes()
    assert len(readme) <= 8000, f"README.md is {len(readme)} bytes; move detail to docs/"
    reference = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    named = set(re.findall(r"`(TEXEL_[A-Z0-9_]+)", readme.decode("utf-8")))
    assert named, "the README names no settings"
    assert {name for name in named if f"`{name}`" not in reference} == set()
