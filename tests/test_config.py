"""Command-line overrides of a config tree: casting, sections validated as a whole, clear errors."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from asyncrl.rl.config.parse import ConfigError, help_text, parse_overrides, take_option


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
    c = parse_overrides(
        Outer(),
        ["--name", "run7", "--inner.ratio=0.25", "--inner.on", "false", "--inner.cap", "3", "--inner.pair", "0.8,0.95"],
    )
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
    with pytest.raises(
        ConfigError, match=r"^unknown config key --inner\.zzz; Inner has: cap, heads, on, pair, ratio, width$"
    ):
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
    with pytest.raises(
        ConfigError, match=r"^--inner is a section, not a value: set its keys, e\.g\. --inner\.width 64$"
    ):
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
    with pytest.raises(
        ConfigError,
        match=r"^--model is a section \(shape of the embedded model\), not a value: set its "
        r"keys, e\.g\. --model\.width 64; a checkpoint directory is given with "
        r"--model_path /ckpt$",
    ):
        parse_overrides(WithPath(), ["--model", "/ckpt"])


def test_take_option():
    assert take_option(["--a", "1", "--resume", "d", "--b", "2"], "--resume") == ("d", ["--a", "1", "--b", "2"])
    assert take_option(["--resume=d"], "--resume") == ("d", [])
    assert take_option(["--a", "1"], "--resume") == ("", ["--a", "1"])
    for argv in (["--resume"], ["--resume", "--a", "1"], ["--resume="]):
        with pytest.raises(ConfigError, match=r"^--resume needs a value: --resume RUN_DIR$"):
            take_option(argv, "--resume", "RUN_DIR")


def test_messages_are_one_line_for_every_key_of_the_real_config():
    from asyncrl.rl.config.grpo import GRPOConfig
    from asyncrl.rl.config.parse import _leaf_keys

    for key in _leaf_keys(GRPOConfig()):
        for value in ("-1", "x", ""):
            try:
                parse_overrides(GRPOConfig(), [f"--{key}", value] if value else [f"--{key}"])
            except ConfigError as exc:
                assert "\n" not in str(exc) and f"--{key}" in str(exc), (key, value, str(exc))


def test_help_lists_every_key_with_its_default_and_docstring():
    text = help_text(Outer())
    assert "--inner.width 64\n      Width." in text and "\n  --name x\n" in text and "\n  --inner.pair 0.9,0.99" in text


# --- the real config: sections, flat sub-sections, rules across sections ------------------------------


def _sections(config, key="grpo"):
    """(key, section) of every section of the tree, the root and flat sub-sections included."""
    import dataclasses

    yield key, config
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value):
            yield from _sections(value, f"{key}.{f.name}")


def test_every_section_is_frozen_keyword_only_and_documented_field_by_field():
    import dataclasses

    from asyncrl.rl.config import GRPOConfig
    from asyncrl.rl.config.tree import docstrings

    for key, section in _sections(GRPOConfig()):
        cls = type(section)
        assert cls.__dataclass_params__.frozen, key
        assert cls.__doc__ and not cls.__doc__.startswith(cls.__name__ + "("), f"{key}: no class docstring"
        for f in dataclasses.fields(cls):
            assert f.kw_only, f"{key}.{f.name} is not keyword-only"
            assert docstrings(cls).get(f.name), f"{key}.{f.name} has no docstring"


def test_a_flat_sub_section_is_set_through_its_parents_key():
    from asyncrl.rl.config import GRPOConfig

    c = parse_overrides(
        GRPOConfig(),
        [
            "--run.n_train",
            "123",
            "--run.sync-timeout-s=30",
            "--run.keep_checkpoints",
            "4",
            "--run.sampler_max_restarts",
            "0",
            "--run.steps",
            "9",
        ],
    )
    assert (
        c.run.data.n_train,
        c.run.deadlines.sync_timeout_s,
        c.run.checkpoints.keep_checkpoints,
        c.run.recovery.sampler_max_restarts,
        c.run.steps,
    ) == (123, 30.0, 4, 0, 9)
    with pytest.raises(ConfigError, match=r"^unknown config key --run\.data\.n_train; did you mean --run\.n_train\?$"):
        parse_overrides(GRPOConfig(), ["--run.data.n_train", "5"])  # the sub-section's name is no key
    with pytest.raises(ConfigError, match=r"^--run\.n_train 0: n_train must be >= 1, not 0$"):
        parse_overrides(GRPOConfig(), ["--run.n_train", "0"])  # its own validation names the parent's flag


def test_help_lists_a_flat_sub_sections_keys_in_its_parents_group():
    from asyncrl.rl.config import GRPOConfig

    text = help_text(GRPOConfig())
    run = text[text.index("\nrun:\n") : text.index("\nmodel:\n")]
    for key in ("steps 500", "n_train 50000", "checkpoint_every 50", "sync_timeout_s 300.0", "sampler_max_restarts 3"):
        assert f"\n  --run.{key}\n      " in run, key
    assert "--run.data." not in text and "--run.deadlines." not in text and "\nrun.data:" not in text


def test_config_json_is_flat_and_reads_back_as_an_old_run_s_did():
    import json

    from asyncrl.rl.config import GRPOConfig, config_to_dict
    from asyncrl.rl.config.stored import config_from_dict

    config = parse_overrides(
        GRPOConfig(),
        [
            "--run.n_train",
            "400",
            "--run.sync_timeout_s",
            "30",
            "--run.steps",
            "7",
            "--run.checkpoint_every",
            "5",
            "--sampler.temperature",
            "0.7",
        ],
    )
    written = json.loads(json.dumps(config_to_dict(config)))
    assert written["run"]["n_train"] == 400 and written["run"]["sync_timeout_s"] == 30.0
    assert not {"data", "checkpoints", "deadlines", "recovery"} & set(written["run"])
    # config.json as a run written before the sub-sections existed has it (every run key in "run",
    # the trainer's temperature a number), abridged: it reads into the same tree.
    old = {
        "run": {
            "steps": 7,
            "mode": "async",
            "n_train": 400,
            "n_heldout": 500,
            "checkpoint_every": 5,
            "keep_checkpoints": 2,
            "sync_timeout_s": 30.0,
            "sampler_max_restarts": 3,
        },
        "sampler": {"temperature": 0.7},
        "trainer": {"lr": 0.0001, "temperature": 0.7},
    }
    assert config_from_dict(GRPOConfig(), written) == config
    assert config_from_dict(GRPOConfig(), old).run == config.run
    assert config_from_dict(GRPOConfig(), old).trainer_config() == config.trainer_config()


def test_config_json_written_reads_back_typed_and_what_does_not_fit_is_a_config_error(tmp_path):
    from asyncrl.rl.checkpoint import CheckpointError
    from asyncrl.rl.config import GRPOConfig
    from asyncrl.rl.config.stored import load_run_config, write_run_config

    config = parse_overrides(
        GRPOConfig(), ["--trainer.betas", "0.8,0.9", "--run.steps", "7", "--sampler.temperature", "0.7"]
    )
    write_run_config(config, str(tmp_path))
    assert load_run_config(GRPOConfig(), str(tmp_path)) == config
    (tmp_path / "config.json").write_text('{"run": {"steps": "seven"}}')
    with pytest.raises(ConfigError, match="steps") as info:
        load_run_config(GRPOConfig(), str(tmp_path))
    assert not isinstance(info.value, CheckpointError)  # the config's own error, not the checkpoints'
    (tmp_path / "config.json").write_text('{"run": ')
    with pytest.raises(ConfigError, match="config.json is not valid JSON"):
        load_run_config(GRPOConfig(), str(tmp_path))
    with pytest.raises(ConfigError, match="no config.json there"):
        load_run_config(GRPOConfig(), str(tmp_path / "elsewhere"))


def test_the_trainer_takes_the_samplers_temperature():
    from asyncrl.rl.config import GRPOConfig, TrainerConfig

    c = parse_overrides(GRPOConfig(), ["--sampler.temperature", "0.7"])
    assert c.trainer.temperature is None and c.trainer_config().temperature == 0.7
    c = parse_overrides(GRPOConfig(), ["--sampler.temperature", "0.7", "--trainer.temperature", "0.7"])
    assert c.trainer_config().temperature == 0.7
    assert GRPOConfig().trainer_config().temperature == 1.0
    message = (
        r"^--trainer\.temperature 0\.5 differs from --sampler\.temperature 1: the trainer must score "
        r"completions at the temperature they were sampled at; [^\n]*--sampler\.temperature[^\n]*$"
    )
    with pytest.raises(ConfigError, match=message):
        parse_overrides(GRPOConfig(), ["--trainer.temperature", "0.5"])
    with pytest.raises(ConfigError, match=message):  # built in code: the same rule, the same words
        GRPOConfig(trainer=TrainerConfig(temperature=0.5))


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["--run.data_seed", "3"], r"^--run\.data_seed 3 differs from --warm_start\.data_seed 0: "),
        (["--run.n_heldout", "1001"], r"^--run\.n_heldout 1001 is more than --warm_start\.heldout_reserve 1000: "),
        (
            ["--sampler.max_new_tokens", "128"],
            r"^--sampler\.max_new_tokens 128: the embedded model "
            r"\(--model\.max_positions\) has 128 positions",
        ),
        (
            ["--trainer.loss.aggregation", "fixed_tokens"],
            r"^--trainer\.loss\.aggregation fixed_tokens divides by a token "
            r"budget: set --trainer\.loss\.token_budget N or --sampler\.max_new_tokens N$",
        ),
        (
            ["--trainer.loss.overlong_buffer", "16"],
            r"^--trainer\.loss\.overlong_buffer needs a length limit: set "
            r"--trainer\.loss\.overlong_max_tokens N or --sampler\.max_new_tokens N$",
        ),
        (
            ["--trainer.loss.overlong_buffer", "64", "--sampler.max_new_tokens", "32"],
            r"^--trainer\.loss\.overlong_buffer 64 is more than the length limit 32 ",
        ),
    ],
)
def test_a_rule_across_sections_names_both_flags(overrides, message):
    from asyncrl.rl.config import GRPOConfig

    with pytest.raises(ConfigError, match=message) as caught:
        parse_overrides(GRPOConfig(), overrides)
    assert "\n" not in str(caught.value)


def test_length_budgets_default_to_the_samplers_max_new_tokens():
    from asyncrl.rl.config import GRPOConfig

    c = parse_overrides(
        GRPOConfig(),
        [
            "--sampler.max_new_tokens",
            "48",
            "--trainer.loss.aggregation",
            "fixed_tokens",
            "--trainer.loss.overlong_buffer",
            "8",
        ],
    )
    assert (c.trainer.loss.token_budget, c.trainer.loss.overlong_max_tokens) == (0, 0)  # config.json keeps the 0s
    loss = c.trainer_config().loss
    assert (loss.token_budget, loss.overlong_max_tokens) == (48, 48)
    c = parse_overrides(
        GRPOConfig(),
        [
            "--trainer.loss.token_budget",
            "100",
            "--trainer.loss.aggregation",
            "fixed_tokens",
            "--trainer.loss.overlong_buffer",
            "8",
            "--trainer.loss.overlong_max_tokens",
            "40",
        ],
    )
    assert (c.trainer_config().loss.token_budget, c.trainer_config().loss.overlong_max_tokens) == (100, 40)


def test_rules_about_the_embedded_model_leave_a_checkpoint_alone():
    from asyncrl.rl.config import GRPOConfig

    c = parse_overrides(
        GRPOConfig(), ["--model_path", "/ckpt", "--run.data_seed", "3", "--sampler.max_new_tokens", "512"]
    )
    assert (c.run.data.data_seed, c.sampler.max_new_tokens) == (3, 512)  # the checkpoint's limit: preflight's


def test_where_the_evaluation_runs_is_one_of_three():
    from asyncrl.rl.config import GRPOConfig
    from asyncrl.rl.config.run import RunConfig

    assert RunConfig().eval_on == "auto"  # samplers with vLLM on a GPU, else the trainer: the CPU run as before
    assert parse_overrides(GRPOConfig(), ["--run.eval_on", "samplers"]).run.eval_on == "samplers"
    with pytest.raises(ValueError, match=r"^eval_on must be one of auto, trainer, samplers, not 'gpu'$"):
        RunConfig(eval_on="gpu")
    with pytest.raises(ConfigError, match=r"^--run\.eval_on sampler: eval_on must be one of auto, trainer, samplers"):
        parse_overrides(GRPOConfig(), ["--run.eval_on", "sampler"])


def test_delta_syncs_are_auto_on_or_off_and_auto_means_across_hosts():
    from asyncrl.rl.config import GRPOConfig
    from asyncrl.rl.config.run import RunConfig
    from asyncrl.rl.driver.fleet.sync_group import delta_wanted

    assert RunConfig().sync_delta == "auto"
    assert parse_overrides(GRPOConfig(), ["--run.sync_delta", "on"]).run.sync_delta == "on"
    with pytest.raises(ValueError, match=r"^sync_delta must be one of auto, on, off, not 'yes'$"):
        RunConfig(sync_delta="yes")
    with pytest.raises(ConfigError, match=r"^--run\.sync_delta true: sync_delta must be one of auto, on, off"):
        parse_overrides(GRPOConfig(), ["--run.sync_delta", "true"])
    assert not delta_wanted("auto", 0, [0, 0]) and delta_wanted("auto", 0, [0, 1])  # a sampler on another node
    assert delta_wanted("on", 0, [0]) and not delta_wanted("off", 0, [1])
