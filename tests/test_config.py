"""Command-line overrides of a config tree: casting, sections validated as a whole, clear errors."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from asyncrl.rl.config import ConfigError, help_text, parse_overrides, take_option


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
    with pytest.raises(ConfigError, match=r"^unknown config key --inner\.widht; did you mean --inner\.width\?$"):
        parse_overrides(Outer(), ["--inner.widht", "3"])
    with pytest.raises(ConfigError, match=r"^unknown config key --inner\.zzz; Inner has: cap, heads, on, pair, ratio, width$"):
        parse_overrides(Outer(), ["--inner.zzz", "3"])
    with pytest.raises(ConfigError, match=r"^unknown config key --ratio; did you mean --inner\.ratio\?$"):
        parse_overrides(Outer(), ["--ratio", "3"])  # a key given without its section
    with pytest.raises(ConfigError, match=r"^unknown config key --name\.x: --name is a value, not a section$"):
        parse_overrides(Outer(), ["--name.x", "3"])
    with pytest.raises(ConfigError, match=r"^--inner\.width wide: expected an integer, e.g\. --inner\.width 64$"):
        parse_overrides(Outer(), ["--inner.width", "wide"])
    with pytest.raises(ConfigError, match=r"^--inner\.on maybe: expected true or false, e.g\. --inner\.on true$"):
        parse_overrides(Outer(), ["--inner.on", "maybe"])
    with pytest.raises(ConfigError, match=r"^--inner\.cap x: expected a number or none, e.g\. --inner\.cap none$"):
        parse_overrides(Outer(), ["--inner.cap", "x"])
    with pytest.raises(ConfigError, match=r"^--inner\.pair 0\.9: expected 2 comma-separated values, each a number"):
        parse_overrides(Outer(), ["--inner.pair", "0.9"])  # a 1-tuple would reach the optimiser otherwise
    with pytest.raises(ConfigError, match=r"^--inner is a section, not a value: set its keys, e\.g\. --inner\.width 64$"):
        parse_overrides(Outer(), ["--inner", "3"])
    with pytest.raises(ConfigError, match=r"^--name needs a value, e\.g\. --name x$"):
        parse_overrides(Outer(), ["--name"])
    with pytest.raises(ConfigError, match=r"^--name needs a value"):
        parse_overrides(Outer(), ["--name", "--inner.width", "64"])  # the next flag is not its value
    with pytest.raises(ConfigError, match=r"^unexpected argument 'foo': overrides are --section\.key value"):
        parse_overrides(Outer(), ["foo", "x"])
    with pytest.raises(ConfigError, match=r"^unexpected argument 'name'; did you mean --name\?$"):
        parse_overrides(Outer(), ["name", "x"])
    with pytest.raises(ConfigError, match=r"^unexpected argument 'width=128'; did you mean --inner\.width 128\?$"):
        parse_overrides(Outer(), ["width=128"])
    with pytest.raises(ConfigError, match=r"^unexpected argument '-name'; did you mean --name\?$"):
        parse_overrides(Outer(), ["-name", "x"])


def test_a_validation_error_names_the_override_it_is_about():
    # The section is validated once with all its overrides; the message names the bad one, not the last.
    with pytest.raises(ConfigError, match=r"^--inner\.width 100: width / heads must be 32, not 100 / 2$"):
        parse_overrides(Outer(), ["--inner.width", "100", "--inner.ratio", "0.1"])
    with pytest.raises(ConfigError, match=r"^--inner\.heads 2, --inner\.width 128: width / heads"):
        parse_overrides(Outer(), ["--inner.heads", "2", "--inner.ratio", "0.1", "--inner.width", "128"])


@dataclass(frozen=True)
class WithPath:
    model_path: str = ""
    """A checkpoint directory; empty: the embedded one."""
    model: Inner = field(default_factory=Inner)
    """Shape of the embedded model."""


def test_a_value_given_to_a_section_points_at_its_path_sibling():
    with pytest.raises(ConfigError, match=r"^--model is a section \(shape of the embedded model\), not a value: set its "
                                          r"keys, e\.g\. --model\.width 64; a checkpoint directory is given with "
                                          r"--model_path /ckpt$"):
        parse_overrides(WithPath(), ["--model", "/ckpt"])


def test_take_option():
    assert take_option(["--a", "1", "--resume", "d", "--b", "2"], "--resume") == ("d", ["--a", "1", "--b", "2"])
    assert take_option(["--resume=d"], "--resume") == ("d", [])
    assert take_option(["--a", "1"], "--resume") == ("", ["--a", "1"])
    for argv in (["--resume"], ["--resume", "--a", "1"], ["--resume="]):
        with pytest.raises(ConfigError, match=r"^--resume needs a value: --resume RUN_DIR$"):
            take_option(argv, "--resume", "RUN_DIR")


def test_messages_are_one_line_for_every_key_of_the_real_config():
    from asyncrl.rl.config import _leaf_keys
    from asyncrl.rl.grpo import GRPOConfig

    for key in _leaf_keys(GRPOConfig()):
        for value in ("-1", "x", ""):
            try:
                parse_overrides(GRPOConfig(), [f"--{key}", value] if value else [f"--{key}"])
            except ConfigError as exc:
                assert "\n" not in str(exc) and f"--{key}" in str(exc), (key, value, str(exc))


def test_help_lists_every_key_with_its_default_and_docstring():
    text = help_text(Outer())
    assert "--inner.width 64\n      Width." in text and "--name 'x'" in text and "--inner.pair (0.9, 0.99)" in text
