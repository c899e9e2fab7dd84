"""What a run shows of itself: TensorBoard event files, curves.png, the progress display, the
sparklines of `asyncrl status`, `asyncrl plot`, and the driver's HTTP endpoint (Prometheus
/metrics, a deep /healthz) against real actors."""

from __future__ import annotations

import asyncio
import io
import json
import os
import subprocess
import sys
import urllib.error
import urllib.request

import msgspec
import pytest

from actors import Echo
from asyncrl import Supervisor
from asyncrl.rl.driver.step_record import RunTotals, SamplersAfter, StepBatch, StepResults, StepTimes, step_record
from asyncrl.rl.generation import VersionSpan
from asyncrl.rl.observe.endpoint import MetricsEndpoint, metric_name
from asyncrl.rl.observe.lengths import batch_lengths, length_bucket
from asyncrl.rl.observe.progress import Progress, ProgressBar, make_progress
from asyncrl.rl.observe.record import FleetEvents, StepRecord, TrainMetrics
from asyncrl.rl.observe.sync_metrics import SyncPhases
from asyncrl.rl.rollout import RolloutGroup
from asyncrl.rl.trainer.metrics import TrainStepMetrics
from asyncrl.rl.view.sparkline import sparkline
from test_grpo import ROOT, TINY, launch

pytestmark = pytest.mark.usefixtures("actor_zygote")  # tests/conftest.py: its supervisors fork actors from a zygote

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def record(step: int, **fields) -> StepRecord:
    """A step's record with made-up numbers; ``fields`` replace them."""
    made_up = dict(
        step=step,
        version=step,
        reward_mean=0.25,
        train_solve_rate=0.5,
        staleness_mean=1.0,
        staleness_hist={"1": 2},
        dropped_stale=0,
        uniform_skipped=0,
        queue_depth=0,
        completion_tokens=48,
        samples_per_s=3.0,
        tokens_per_s=120.0,
        time_s=1.0,
        wait_s=0.1,
        train_s=0.2,
        sync=SyncPhases(sync_s=0.01),
        generate_s=0.3,
        train=TrainMetrics(
            loss=0.5, grad_norm=1.0, lr=1e-4, tokens=48.0, sequences=4.0, micro_batches=1.0, micro_batch_tokens=1024.0
        ),
        task={},
        fleet=FleetEvents(generation=0, samplers_in_group=1, sampler_losses=0, sampler_rejoins=0, recover_s=0.0),
        group_ids=["s/1/1"],
    )
    return StepRecord(**{**made_up, **fields})


MAIN_LINE = (
    '{"step": 2, "version": 2, "reward_mean": 0.0, "train_solve_rate": 0.0, "staleness_mean": 0.0, "stale'
    'ness_hist": {"0": 2}, "dropped_stale": 0, "uniform_skipped": 0, "queue_depth": 0, "paced_wait_s": 0.'
    '0029999999969732016, "completion_tokens": 48, "samples_per_s": 19.97140225009575, "tokens_per_s": 23'
    '9.656827001149, "time_s": 0.40057277400046587, "wait_s": 0.008313295998959802, "train_s": 0.00409792'
    '5000678515, "sync_s": 0.06917758100098581, "sync_trainer_s": 0.049877460001880536, "sync_trainer_pac'
    'k_s": 0.0001396590014337562, "sync_trainer_transfer_s": 0.00015188800171017647, "sync_trainer_vote_s'
    '": 0.049521999004355166, "sync_sampler_s": 0.05030673999863211, "sync_sampler_pause_s": 0.0004527950'
    '004558079, "sync_sampler_transfer_s": 0.01037214800453512, "sync_sampler_load_s": 5.472200064104982e'
    '-05, "sync_sampler_resume_s": 0.018303493001440074, "sync_rpc_s": 0.0188708410023537, "sync_bytes": '
    '75136.0, "generate_s": 0.006774298999516759, "loss": 0.0, "pg_loss": 0.0, "ratio_mean": 1.0, "clip_f'
    'rac_low": 0.0, "clip_frac_high": 0.0, "entropy": 5.5494513511657715, "grad_norm": 0.0, "lr": 8.68198'
    '0515339464e-05, "tokens": 48.0, "sequences": 4.0, "micro_batches": 1.0, "micro_batch_tokens": 16384.'
    '0, "task/has_answer": 0.0, "task/hits_target": 0.0, "task/uses_numbers": 0.0, "task/well_formed": 0.'
    '0, "generation": 0, "samplers_in_group": 1, "sampler_losses": 0, "sampler_rejoins": 0, "recover_s": '
    '0.0, "group_ids": ["sampler0/1/7", "sampler0/1/8"], "heldout_solve_rate": 0.0, "heldout_sampled_solv'
    'e_rate": 0.0, "heldout/task/has_answer": 0.0, "heldout/task/hits_target": 0.0, "heldout/task/uses_nu'
    'mbers": 0.0, "heldout/task/well_formed": 0.0}'
)
"""An evaluated step's line of metrics.jsonl as main wrote it before the record was typed (a
default run of test_a_tiny_run_writes_event_files_curves_and_plain_progress_and_drops_nothing)."""


def typed(line: dict) -> StepRecord:
    """A line of metrics.jsonl back into its record: each key to the part that has its field."""
    parts = {
        name: {k: line.pop(k) for k in list(line) if k in cls.__struct_fields__}
        for name, cls in (("sync", SyncPhases), ("train", TrainMetrics), ("fleet", FleetEvents))
    }
    heldout = {k: line.pop(k) for k in list(line) if k.startswith("heldout/")}
    task = {k: line.pop(k) for k in list(line) if k.startswith(("task/", "task_errors/"))}
    return StepRecord(
        **line,
        sync=SyncPhases(**parts["sync"]),
        train=TrainMetrics(**parts["train"]),
        fleet=FleetEvents(**parts["fleet"]),
        task=task,
        heldout_task=heldout or None,
    )


# --- pieces ------------------------------------------------------------------------------------


def test_a_step_record_writes_the_very_line_main_wrote():
    assert typed(json.loads(MAIN_LINE)).to_json() == MAIN_LINE  # the keys, their order, every value's digits


def test_a_step_record_leaves_out_what_this_run_does_not_have_and_writes_what_it_has():
    line = record(1).to_dict()
    assert not {
        "paced_wait_s",
        "weights_digests",
        "heldout_solve_rate",
        "heldout_sampled_solve_rate",
        "events",
        "kl",
        "entropy",
        "distill_kl",
        "tis_frac",
        "mfu",
        "peak_mem_gib",
    } & set(line)
    assert line["sync_bytes"] == 0.0 and line["samplers_in_group"] == 1 and line["loss"] == 0.5  # flat, as before
    events = [{"event": "lost", "sampler": "sampler1"}]
    line = record(
        2,
        paced_wait_s=0.5,
        weights_digests={"trainer": "ab"},
        heldout_solve_rate=0.25,
        train=TrainStepMetrics.of(
            {
                "loss": 0.1,
                "grad_norm": 1.0,
                "lr": 1e-4,
                "tokens": 4.0,
                "sequences": 2.0,
                "micro_batches": 1.0,
                "micro_batch_tokens": 64.0,
                "mfu": 0.3,
                "train_s": 9.0,
            }
        ).recorded(),
        fleet=FleetEvents(
            generation=1, samplers_in_group=1, sampler_losses=1, sampler_rejoins=0, recover_s=0.0, events=events
        ),
    ).to_dict()
    assert line["paced_wait_s"] == 0.5 and line["weights_digests"] == {"trainer": "ab"} and line["mfu"] == 0.3
    assert line["events"] == events and line["heldout_solve_rate"] == 0.25 and "heldout_sampled_solve_rate" not in line
    assert line["train_s"] == 0.2  # the driver's wall time of the call, not the trainer's own


def test_a_trainer_metric_without_a_field_is_named_not_dropped():
    with pytest.raises(TypeError, match="TrainMetrics") as err:
        TrainMetrics.of(
            {
                "grad_norm": 1.0,
                "lr": 1e-4,
                "tokens": 4.0,
                "sequences": 2.0,
                "micro_batches": 1.0,
                "micro_batch_tokens": 64.0,
                "new_metric": 1.0,
            }
        )
    assert "new_metric" in str(err.value)


class PeaksOf:
    """A pacer as the step record reads it: its wait so far and the step's peaks."""

    waited_s = 1.25

    def take_peaks(self) -> tuple[int, int]:
        return 3, 7


def sampled(uid: str, rewards: list[float], version: int, generate_s: float, **fields) -> RolloutGroup:
    """A group of completions of 2 and 3 tokens."""
    ids = [[5, 5], [5, 5, 5]]
    return RolloutGroup(
        0, [1], ids, [[0.0] * len(c) for c in ids], rewards, version, generate_s=generate_s, uid=uid, **fields
    )


def test_a_step_record_is_the_one_the_18_parameter_step_record_made():
    # The literals are what step_record() gave for these inputs before it took typed values.
    batch = [
        sampled("s/0/1", [1.0, 0.0], 3, 0.5, metrics={"task/len": 4.0}),
        sampled("s/0/2", [0.9, 0.2], 2, 1.5, correct=[True, False], metrics={"task_errors/x": 1.0}),
    ]
    fleet = dict(generation=1, samplers_in_group=2, sampler_losses=0, sampler_rejoins=1, recover_s=0.5)
    train = dict(lr=1e-3, tokens=10.0, sequences=4.0, micro_batches=1.0, micro_batch_tokens=64.0)
    keys = {"task/old"}
    done = StepBatch(4, 4, batch, skipped=[sampled("s/0/3", [0.0, 0.0], 3, 0.1)])
    rec = step_record(
        done,
        StepTimes(began=10.0, batch_ready=10.5, trained=12.0),
        StepResults(
            train=TrainStepMetrics(**train, loss=0.5, grad_norm=1.5, train_s=9.0),
            sync=SyncPhases(sync_s=0.25),
            digests={"trainer": "ab"},
        ),
        RunTotals(samples=40, tokens=200, elapsed_s=8.0, dropped_stale=2, task_keys=keys),
        SamplersAfter(queue_depth=5, pacer=PeaksOf(), fleet=fleet),
        correct_reward=0.9,
    )
    assert (done.samples, done.completion_tokens) == (4, 10)
    assert msgspec.to_builtins(rec) == {
        "step": 4,
        "version": 4,
        "reward_mean": 0.35000000000000003,
        "train_solve_rate": 0.3333333333333333,
        "staleness_mean": 0.5,
        "staleness_hist": {"0": 1, "1": 1},
        "dropped_stale": 2,
        "uniform_skipped": 1,
        "queue_depth": 5,
        "paced_wait_s": 1.25,
        "paced_streams": 3,
        "paced_in_flight_peak": 7,
        "completion_tokens": 10,
        "samples_per_s": 5.0,
        "tokens_per_s": 25.0,
        "time_s": 8.0,
        "wait_s": 0.5,
        "train_s": 1.5,
        "sync": msgspec.to_builtins(SyncPhases(sync_s=0.25)),
        "generate_s": 1.0,
        "train": {"loss": 0.5, "grad_norm": 1.5, **train},
        "task": {"task/len": 1.0, "task/old": 0.0, "task_errors/x": 1.0},
        "fleet": fleet,
        "group_ids": ["s/0/1", "s/0/2"],
        "weights_digests": {"trainer": "ab"},
        "lengths": {  # trained at version 3: the first group's tokens are of it, the second's one older
            "length_mean": 2.5,
            "length_max": 3,
            "length_hist": {"32": 4},
            "token_lag_mean": 0.5,
            "token_lag_max": 1,
            "token_lag_hist": {"0": 5, "1": 5},
            "spanning_groups": 0,
        },
    }
    assert keys == {"task/old", "task/len", "task_errors/x"}
    # No pacer, no digests, no step with groups left out: those fields stay out of the record.
    rec = step_record(
        StepBatch(4, 4, batch[:1], skipped=[]),
        StepTimes(began=0.0, batch_ready=1.0, trained=3.0),
        StepResults(
            train=TrainStepMetrics(**train, grad_norm=1.0, train_s=0.1), sync=SyncPhases(sync_s=0.0), digests={}
        ),
        RunTotals(samples=2, tokens=5, elapsed_s=0.0, dropped_stale=0, task_keys=set()),
        SamplersAfter(queue_depth=0, pacer=None, fleet={**fleet, "sampler_rejoins": 0}),
        correct_reward=1.0,
    )
    got = msgspec.to_builtins(rec)
    assert not {"paced_wait_s", "paced_streams", "paced_in_flight_peak", "weights_digests"} & set(got)
    assert got["samples_per_s"] == 1999999999.9999998 and got["tokens_per_s"] == 5000000000.0
    assert (got["reward_mean"], got["train_solve_rate"], got["staleness_hist"]) == (0.5, 0.5, {"0": 1})
    assert (got["wait_s"], got["train_s"], got["generate_s"], got["task"]) == (1.0, 2.0, 0.5, {"task/len": 2.0})


def test_batch_lengths_count_each_token_at_its_own_version():
    spanned = sampled("s/0/1", [1.0, 0.0], 2, 0.5, version_spans=[[VersionSpan(0, 2), VersionSpan(1, 4)], []])
    long = RolloutGroup(0, [1], [[5] * 300, [5] * 33], [[0.0] * 300, [0.0] * 33], [1.0, 0.0], 4)
    got = batch_lengths([spanned, long], trained_at=5)
    # spanned: 1 token of version 2 (lag 3), 1 of 4 (lag 1); 3 tokens of version 2; long: 333 of 4
    assert got.token_lag_hist == {"1": 334, "3": 4} and got.token_lag_max == 3 and got.spanning_groups == 1
    assert got.length_hist == {"32": 2, "64": 1, "512": 1} and got.length_max == 300
    assert length_bucket(1) == 32 and length_bucket(256) == 256 and length_bucket(257) == 512


def test_every_number_of_a_record_is_a_scalar_and_nothing_else_is():
    rec = record(
        7,
        staleness_hist={"0": 3, "1": 13},
        group_ids=["s/1/1"],
        weights_digests={"trainer": "ab"},
        train=TrainMetrics(
            loss=float("nan"),
            grad_norm=1.0,
            lr=1e-4,
            tokens=4.0,
            sequences=2.0,
            micro_batches=1.0,
            micro_batch_tokens=64.0,
        ),
        task={"task/solved": 0.5},
    )
    got = rec.scalars()
    assert got["staleness_hist/1"] == 13.0 and got["task/solved"] == 0.5 and got["reward_mean"] == 0.25
    assert not any(k.startswith(("group_ids", "weights_digests", "step", "loss")) for k in got)
    assert metric_name("task/solved") == "asyncrl_task_solved"


def test_curves_draw_the_samplers_in_the_group_only_where_that_number_changed():
    from matplotlib.figure import Figure

    from asyncrl.rl.view.curves import _draw_fleet

    ax = Figure().subplots()
    sizes = [1] * 5 + [3] * 4 + [1] * 6  # scaled 1 -> 3 -> 1
    _draw_fleet(ax, "", [{"step": i + 1, "samplers_in_group": n} for i, n in enumerate(sizes)], "C0")
    (line,) = ax.lines
    assert list(line.get_xdata()) == [1, 6, 10, 15] and list(line.get_ydata()) == [1, 3, 1, 1]
    assert line.get_label() == "samplers in group"
    steady = Figure().subplots()
    _draw_fleet(steady, "", [{"step": i + 1, "samplers_in_group": 2} for i in range(5)], "C0")
    assert not steady.lines  # nothing changed: nothing drawn


def test_sparkline_scales_and_buckets():
    assert sparkline([0.0, 0.5, 1.0], low=0.0, high=1.0) == "▁▅█"
    assert sparkline([2.0, 2.0]) == "▁▁"
    assert len(sparkline(list(range(100)), width=10)) == 10 and sparkline(list(range(100)), width=10)[-1] == "█"


def test_progress_is_plain_lines_when_not_a_terminal(capsys):
    display = make_progress(100, 1, True, stream=io.StringIO())  # a file, not a terminal
    assert type(display) is Progress
    display.update(record(3))  # between the ~50 lines a run prints (every 2nd step of 100): nothing
    display.update(record(4, heldout_solve_rate=0.4, heldout_sampled_solve_rate=0.3))
    out = capsys.readouterr().out
    assert "\r" not in out and out.count("\n") == 1
    assert (
        out.startswith("step    4/100  reward 0.250") and "held-out 0.40 greedy 0.30 sampled" in out and "eta " in out
    )


def test_the_consoles_rates_are_the_last_steps_not_the_whole_runs(capsys):
    """A slow start (an engine compiling: 10 samples in 100 s) is over after the window: the line
    shows the pace of the last steps (10 samples/s), where the whole run's average is still ~1.5."""
    from asyncrl.rl.observe.progress import RATE_WINDOW, RecentRate

    rate, samples, t = RecentRate(), 10.0, 100.0
    assert rate.update(record(1, samples_per_s=samples / t, tokens_per_s=4 * samples / t, time_s=t)) == (0.1, 0.4)
    for step in range(2, RATE_WINDOW + 3):
        samples, t = samples + 20, t + 2  # 10 samples/s, 40 tokens/s from step 2 on
        shown = rate.update(record(step, samples_per_s=samples / t, tokens_per_s=4 * samples / t, time_s=t))
    assert shown == pytest.approx((10.0, 40.0)) and samples / t < 2
    display = Progress(RATE_WINDOW + 2, 1)
    display.rate = rate
    capsys.readouterr()
    samples, t = samples + 20, t + 2
    display.update(record(RATE_WINDOW + 2, samples_per_s=samples / t, tokens_per_s=4 * samples / t, time_s=t))
    assert "samples/s 10.0  tok/s 40" in capsys.readouterr().out


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_progress_line_without_sampled_evaluation_says_greedy_only():
    from asyncrl.rl.observe.progress import progress_line

    evaluated = dict(heldout_solve_rate=0.3)
    assert "held-out 0.30 greedy  5s" in progress_line(
        record(3, **evaluated, heldout_sampled_solve_rate=float("nan")), 9, None, 5.0
    )
    assert "held-out 0.30 greedy 0.25 sampled" in progress_line(
        record(3, **evaluated, heldout_sampled_solve_rate=0.25), 9, None, 5.0
    )


def test_progress_is_a_bar_on_a_terminal_and_lines_go_above_it():
    term = FakeTerminal()
    display = make_progress(10, 1, True, stream=term)
    assert isinstance(display, ProgressBar)
    display.update(record(1))
    display.update(record(2, heldout_solve_rate=0.4))
    display.guard(lambda line: term.write(line + "\n"))("best held-out greedy so far")
    display.close()
    out = term.getvalue()
    assert "\r" in out and "2/10" in out and "reward 0.250" in out and "tok/s 120" in out
    assert "best held-out greedy so far\n" in out and "held-out 0.40" in out
    assert type(make_progress(10, 1, False, stream=FakeTerminal())) is Progress  # --run.progress_bar false


# --- the endpoint, with real actors ----------------------------------------------------------


def get(url: str, method: str = "GET") -> tuple[int, str, str]:
    try:
        with urllib.request.urlopen(
            urllib.request.Request(url, method=method, data=b"" if method == "POST" else None), timeout=20
        ) as r:
            return r.status, r.headers["Content-Type"], r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.headers["Content-Type"], e.read().decode()


async def test_healthz_names_dead_and_silent_actors_and_metrics_are_prometheus():
    async with Supervisor() as sup:
        actors = {
            name: await sup.spawn(Echo, name=name, max_restarts=0) for name in ("trainer", "sampler0", "sampler1")
        }
        probes = {name: (lambda h=h: h.with_timeout(0.5).get_label()) for name, h in actors.items()}
        endpoint = MetricsEndpoint(
            "127.0.0.1",
            0,
            statuses=sup.status,
            probes=lambda: probes,
            snapshot=lambda: {"reward_mean": 0.25, "progress_step": 3.0},
            timeout_s=0.5,
            loop=asyncio.get_running_loop(),
        )
        base = f"http://127.0.0.1:{endpoint.port}"
        try:
            code, _, body = await asyncio.to_thread(get, base + "/healthz")
            assert code == 200 and json.loads(body)["healthy"] is True

            code, content_type, text = await asyncio.to_thread(get, base + "/metrics")
            assert code == 200 and content_type.startswith("text/plain")
            assert "asyncrl_reward_mean 0.25" in text and "# TYPE asyncrl_reward_mean gauge" in text
            assert 'asyncrl_actor_up{actor="sampler1",state="running"} 1.0' in text

            blocked = asyncio.ensure_future(actors["sampler0"].with_timeout(10).block(3.0))  # holds its loop
            actors["sampler1"].kill("test: a dead sampler")
            await actors["sampler1"].wait_for_state({"dead"}, 10.0)
            code, content_type, body = await asyncio.to_thread(get, base + "/healthz")
            report = json.loads(body)
            assert code == 503 and content_type == "application/json"
            assert report["unhealthy"]["sampler0"] == "silent: no answer within 0.5 s"
            assert (
                report["unhealthy"]["sampler1"].startswith("dead: ")
                and "a dead sampler" in report["unhealthy"]["sampler1"]
            )
            assert set(report["unhealthy"]) == {"sampler0", "sampler1"}
            assert report["actors"]["trainer"] == "running"
            assert (await asyncio.to_thread(get, base + "/nothing"))[0] == 404
            # Unauthenticated, so it changes nothing: a scale is refused, naming what to use.
            code, _, text = await asyncio.to_thread(get, base + "/scale?samplers=3", "POST")
            assert code == 403 and "asyncrl scale RUN_DIR --samplers N" in text
            await blocked
        finally:
            endpoint.close()
        with pytest.raises(urllib.error.URLError):  # closed: the port is free again
            urllib.request.urlopen(base + "/healthz", timeout=5)


# --- a tiny real run ---------------------------------------------------------------------------

TASK = {"task/has_answer", "task/hits_target", "task/uses_numbers", "task/well_formed"}  # examples/grpo_countdown.py's
STEP_KEYS = {
    "step",
    "version",
    "length_mean",
    "length_max",
    "length_hist",
    "token_lag_mean",
    "token_lag_max",
    "token_lag_hist",
    "spanning_groups",
    "reward_mean",
    "train_solve_rate",
    "staleness_mean",
    "staleness_hist",
    "dropped_stale",
    "uniform_skipped",
    "queue_depth",
    "paced_wait_s",
    "paced_streams",
    "paced_in_flight_peak",
    "completion_tokens",
    "samples_per_s",
    "tokens_per_s",
    "time_s",
    "wait_s",
    "train_s",
    "sync_s",
    "sync_trainer_s",
    "sync_trainer_pack_s",
    "sync_trainer_transfer_s",
    "sync_trainer_vote_s",
    "sync_sampler_s",
    "sync_sampler_pause_s",
    "sync_sampler_transfer_s",
    "sync_sampler_load_s",
    "sync_sampler_resume_s",
    "sync_rpc_s",
    "sync_bytes",
    "generate_s",
    "loss",
    "pg_loss",
    "ratio_mean",
    "clip_frac_low",
    "clip_frac_high",
    "entropy",
    "grad_norm",
    "lr",
    "tokens",
    "sequences",
    "micro_batches",
    "micro_batch_tokens",
    *TASK,
    "generation",
    "samplers_in_group",
    "sampler_losses",
    "sampler_rejoins",
    "recover_s",
    "group_ids",
}
"""The keys of a default CPU run's step record (async, one sampler, none lost, no weight check), as main wrote them."""
EVAL_KEYS = {"heldout_solve_rate", "heldout_sampled_solve_rate", "eval_s", *(f"heldout/{k}" for k in TASK)}
"""What an evaluated step adds (its seconds, ``eval_s``, since the held-out evaluation can run on the samplers)."""


@pytest.mark.slow
def test_a_tiny_run_writes_event_files_curves_and_plain_progress_and_drops_nothing(tmp_path, model_cache):
    run_dir = tmp_path / "run"
    done = launch(
        tmp_path,
        *TINY,
        "--run.curves",
        "true",  # TINY leaves it out
        "--run.steps",
        "4",
        "--run.max_staleness",
        "0",
        "--run.run_dir",
        str(run_dir),
        cache=model_cache,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    # not a terminal: plain lines, no bar
    assert "\r" not in done.stdout and "step    4/4  reward" in done.stdout
    assert f"TensorBoard: event files in {run_dir}" in done.stdout
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # metrics.jsonl's keys are what users and benchmarks/grpo_gpu.py read: a default run's stay these
    assert [set(r) for r in records] == [STEP_KEYS, STEP_KEYS | EVAL_KEYS] * 2
    summary = json.loads((run_dir / "summary.json").read_text())
    # paced: every group begun was trained, none dropped, and the queue never held more than a step's worth
    assert summary["dropped_stale"] == 0 and all(r["queue_depth"] <= 2 for r in records)

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"reward_mean", "train_solve_rate", "loss", "staleness_hist/0", "heldout_solve_rate"} <= tags
    assert [e.step for e in events.Scalars("reward_mean")] == [1, 2, 3, 4]
    assert [e.value for e in events.Scalars("reward_mean")] == pytest.approx([r["reward_mean"] for r in records])

    assert summary["curves"] == str(run_dir / "curves.png") and "curves.png" in done.stdout
    assert summary["tensorboard"] == str(run_dir)
    assert any(
        line.split()[:2] == ["tensorboard", "tensorboard"] for line in done.stdout.splitlines()
    )  # the summary's row
    assert (run_dir / "curves.png").read_bytes()[:8] == PNG_MAGIC

    # asyncrl plot: two runs (here the same one twice) into one picture
    out = tmp_path / "both.png"
    env = dict(os.environ, PYTHONPATH=ROOT)
    plotted = subprocess.run(
        [sys.executable, "-m", "asyncrl.cli", "plot", str(run_dir), str(run_dir), "-o", str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert plotted.returncode == 0, plotted.stderr
    assert out.read_bytes()[:8] == PNG_MAGIC
    missing = subprocess.run(
        [sys.executable, "-m", "asyncrl.cli", "plot", str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert missing.returncode == 1 and "no metrics.jsonl" in missing.stderr

    # asyncrl status of a finished run: its history, then why no supervisor answers
    status = subprocess.run(
        [sys.executable, "-m", "asyncrl.cli", "status", str(run_dir)],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert status.returncode == 1 and "has finished" in status.stderr
    assert "metrics     step 4" in status.stdout and "  reward            " in status.stdout
    assert "  held-out greedy   " in status.stdout and "(3 evaluations)" in status.stdout  # before, at 2, at 4


def test_wandb_asked_for_but_not_installed_is_a_usage_error(tmp_path, monkeypatch):
    pytest.importorskip("prometheus_client")
    # wandb is in the test extra: the script's Python is made not to find it (find_spec gives None)
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text("import sys\n\nsys.modules['wandb'] = None\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(hide), os.environ.get("PYTHONPATH")])))
    done = launch(tmp_path, *TINY, "--run.wandb", "my-project", "--run.run_dir", str(tmp_path / "run"))
    assert done.returncode == 2
    assert "--run.wandb my-project needs the wandb package, which is not installed: pip install wandb" in done.stderr
    assert not (tmp_path / "run").exists()


def wandb_records(path) -> list:
    """The records of a W&B run file (``run-<id>.wandb``: LevelDB's log format, W&B's header,
    one protobuf `Record` per entry); wandb ships the protobuf types but no reader."""
    import struct

    from wandb.proto import wandb_internal_pb2

    data, pos, part, records = path.read_bytes(), 7, b"", []
    assert data[:4] == b":W&B", path
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768  # blocks of 32 KiB; a tail too short for a header is padding
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if left < 7 or kind == 0:
            pos += left
            continue
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        part = chunk if kind in (1, 2) else part + chunk  # full, first; middle, last
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(part)
            records.append(record)
    return records


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_wandb_offline_gets_the_run_s_metrics_and_config_and_a_resume_continues_the_same_run(
    tmp_path, model_cache, monkeypatch
):
    pytest.importorskip("wandb")
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):  # nothing written outside tmp_path
        monkeypatch.setenv(name, str(tmp_path / "wandb-home"))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = tmp_path / "run"
    args = ["--run.wandb", "asyncrl-test", "--run.checkpoint_every", "2", "--run.run_dir", str(run_dir)]
    done = launch(tmp_path, *TINY, "--run.steps", "2", *args, cache=model_cache)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "Weights & Biases: project asyncrl-test, run run" in done.stdout
    resumed = launch(tmp_path, "--resume", str(run_dir), "--run.steps", "3", cache=model_cache)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]

    run_id = (run_dir / "wandb.id").read_text().strip()
    segments = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert [s.name.rsplit("-", 1)[1] for s in segments] == [run_id, run_id]  # one W&B run, two segments
    metrics = {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}
    config = json.loads((run_dir / "config.json").read_text())
    for segment, steps in zip(segments, ([1, 2], [3])):
        records = wandb_records(segment / f"run-{run_id}.wandb")
        run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
        assert (run.run_id, run.project, run.display_name) == (run_id, "asyncrl-test", "run")
        logged = {u.key or "/".join(u.nested_key): json.loads(u.value_json) for u in run.config.update}
        logged.pop("_wandb", None)
        assert logged["run"]["steps"] == steps[-1] and set(logged) == set(config)  # the run's config, each segment's
        rows = [
            {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            for r in records
            if r.WhichOneof("record_type") == "history"
        ]
        # one row per step, every scalar of metrics.jsonl in it: W&B's curves of the run
        assert [row["_step"] for row in rows] == steps
        for row in rows:
            record = metrics[row["_step"]]
            assert row["reward_mean"] == pytest.approx(record["reward_mean"])
            assert row["loss"] == pytest.approx(record["loss"])
            assert row.get("heldout_solve_rate") == record.get("heldout_solve_rate")
    # the resumed segment's config is the config.json it wrote, with what the run resolved for this
    # host where config.json keeps auto (0, or None for max_staleness) for another host's resume
    resolved = {key: logged["sampler"][key] for key in ("count", "per_gpu", "prompts_per_batch", "streams")}
    assert min(resolved.values()) > 0
    assert config["run"]["max_staleness"] is None and logged["run"]["max_staleness"] == 1  # the CPU's auto
    run = config["run"] | {"max_staleness": 1}
    assert logged == config | {"sampler": config["sampler"] | resolved, "run": run}


@pytest.mark.slow
@pytest.mark.timeout(240)
async def test_a_run_s_endpoint_answers_while_it_trains_and_names_a_killed_sampler(model_path, tmp_path):
    import signal
    import socket

    from asyncrl.rl.driver.run import train
    from test_fault_tolerance import at_step, pid_of, tiny

    with socket.socket() as s:  # a free port (the endpoint binds an explicit one, as a user would)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run_dir = tmp_path / "run"
    config = tiny(
        model_path,
        run_dir,
        "--run.steps",
        "40",
        "--sampler.count",
        "2",
        "--run.metrics_port",
        str(port),
        "--run.sampler_max_restarts",
        "0",
        "--run.health_timeout_s",
        "5",
    )
    base = f"http://127.0.0.1:{port}"
    seen = {}

    async def watch(sup):
        await at_step(run_dir, 2)
        seen["healthy"] = await asyncio.to_thread(get, base + "/healthz")
        seen["metrics"] = await asyncio.to_thread(get, base + "/metrics")
        os.kill(pid_of(sup, "sampler1"), signal.SIGKILL)  # no restarts: it stays dead
        while True:
            code, _, body = await asyncio.to_thread(get, base + "/healthz")
            if code == 503:
                seen["dead"] = json.loads(body)
                return
            await asyncio.sleep(0.1)

    async with Supervisor() as sup:
        watcher = asyncio.ensure_future(watch(sup))
        summary = await train(config, sup, log=lambda *a: None)
        await watcher
    code, _, body = seen["healthy"]
    assert code == 200 and json.loads(body)["actors"] == {
        "trainer": "running",
        "sampler0": "running",
        "sampler1": "running",
    }
    code, _, text = seen["metrics"]
    assert code == 200 and "asyncrl_reward_mean " in text and "asyncrl_progress_step " in text
    assert seen["dead"]["unhealthy"]["sampler1"].startswith("dead: ") and "sampler0" not in seen["dead"]["unhealthy"]
    assert "killed by SIGKILL" in seen["dead"]["unhealthy"]["sampler1"]
    assert summary["faults"]["sampler_losses"] == 1
    with pytest.raises(urllib.error.URLError):  # the run is over: the port is closed
        urllib.request.urlopen(base + "/healthz", timeout=5)


async def test_the_last_curves_drawing_is_awaited_without_blocking_the_loop(tmp_path, monkeypatch):
    """The end of a run waits for its last curves.png (seconds of matplotlib on loaded cores)
    without blocking its event loop. Seen: `CurvesPainter.close` joined the thread on the loop,
    and the loop watch reported the driver blocked 7.8-14.6 s at the end of every run. Here the
    drawing can end only once the loop has run a callback scheduled before the wait."""
    import threading

    from asyncrl.rl.observe.painter import CurvesPainter
    from asyncrl.rl.view import curves

    loop_ran, drawn, lines = threading.Event(), [], []

    def draw(run_dirs, path):
        assert loop_ran.wait(30), "the event loop did not run while the drawing was awaited"
        drawn.append(path)

    monkeypatch.setattr(curves, "draw_curves", draw)
    painter = CurvesPainter(str(tmp_path), log=lines.append)
    asyncio.get_running_loop().call_soon(loop_ran.set)
    path = await painter.close(timeout_s=60)
    assert path == str(tmp_path / "curves.png") and drawn == [path] and lines == []
    assert await painter.close(timeout_s=60) == path and len(drawn) == 2  # a close after the last draws again


async def test_the_driver_s_loop_watch_stays_quiet_while_the_last_curves_drawing_outlasts_its_threshold(
    tmp_path, monkeypatch
):
    """The end of every run said "the event loop of the driver is blocked ... CurvesPainter.close
    ... Thread.join", then "ran again after 7.8-14.6 s blocked": the last curves.png being drawn.
    Here the driver's loop watch (as ``--run.loop_watch_s`` starts it) watches a close whose drawing
    takes four times its threshold: it says nothing, and the close returns the drawn picture."""
    import threading
    import time

    from asyncrl.rl.observe.painter import CurvesPainter
    from asyncrl.rl.view import curves
    from asyncrl.runtime.loop_watch import LoopWatch

    threshold_s, drawing = 0.5, []

    def slow_draw(run_dirs, path):  # matplotlib on loaded cores: seconds of work in the painter's thread
        drawing.append(threading.current_thread().name)
        time.sleep(4 * threshold_s)

    monkeypatch.setattr(curves, "draw_curves", slow_draw)
    watched, painted = [], []
    watch = LoopWatch("the driver", threshold_s, watched.append, interval_s=0.05).start()
    try:
        painter = CurvesPainter(str(tmp_path), log=painted.append)
        started = time.monotonic()
        path = await painter.close(timeout_s=60)
        took = time.monotonic() - started
    finally:
        watch.close()
    assert drawing == ["asyncrl-curves"] and took >= 4 * threshold_s  # the close awaited the whole drawing
    assert path == str(tmp_path / "curves.png") and painted == []
    assert watched == [] and watch.blocked == 0
