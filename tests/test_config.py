"""Command-line overrides of a config tree: casting, sections validated as a whole, clear errors."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from asyncrl.rl.config import ConfigError, help_text, parse_overrides


@dataclass(frozen=True)
class Inner:
    width: int = 64
    """Width."""
    heads: int = 2
    """Heads; width / heads must be 32."""
    ratio: float = 0.5
    on: bool = True
    cap: float | None = None
    pair: tuple[float, float] = (0.9, 0.99)

    def __post_init__(self):
        if self.width // self.heads != 32:
            raise ValueError(f"width / heads must be 32, not {self.width} / {self.heads}")


@dataclass(frozen=True)
class Outer:
    name: str = "x"
    inner: Inner = field(default_factory=Inner)


def test_values_are_cast_to_the_field_types():
    c = parse_overrides(Outer(), ["--name", "run7", "--inner.ratio=0.25", "--inner.on", "false",
                                  "--inner.cap", "3", "--inner.pair", "0.8,0.95"])
    assert c == Outer("run7", Inner(ratio=0.25, on=False, cap=3.0, pair=(0.8, 0.95)))
    assert parse_overrides(c, ["--inner.cap", "none"]).inner.cap is None


def test_a_section_is_validated_once_with_all_its_overrides():
    c = parse_overrides(Outer(), ["--inner.width", "128", "--inner.heads", "4"])  # 128/2 alone would fail
    assert (c.inner.width, c.inner.heads) == (128, 4)
    with pytest.raises(ConfigError, match="width / heads must be 32, not 128 / 2"):
        parse_overrides(Outer(), ["--inner.width", "128"])


def test_errors_name_the_key_and_what_exists():
    with pytest.raises(ConfigError, match=r"unknown config key --inner\.widht; Inner has: cap, heads, on, pair, ratio, width"):
        parse_overrides(Outer(), ["--inner.widht", "3"])
    with pytest.raises(ConfigError, match="expected int, got 'wide'"):
        parse_overrides(Outer(), ["--inner.width", "wide"])
    with pytest.raises(ConfigError, match="expected true or false"):
        parse_overrides(Outer(), ["--inner.on", "maybe"])
    with pytest.raises(ConfigError, match="is a section"):
        parse_overrides(Outer(), ["--inner", "3"])
    with pytest.raises(ConfigError, match="needs a value"):
        parse_overrides(Outer(), ["--name"])
    with pytest.raises(ConfigError, match="expected --section.key value"):
        parse_overrides(Outer(), ["name", "x"])


def test_help_lists_every_key_with_its_default_and_docstring():
    text = help_text(Outer())
    assert "--inner.width 64\n      Width." in text and "--name 'x'" in text and "--inner.pair (0.9, 0.99)" in text
