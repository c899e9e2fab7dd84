"""A weight sync's phases, measured where they happen (issue 29): the trainer's `SyncStats` and an
HF sampler's `SamplerSyncStats` after real syncs between their actors over gloo, and the step
record's ``sync_*`` metrics the driver makes of them (`sync_record`)."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from asyncrl import Supervisor
from asyncrl.comm.member import form_group
from asyncrl.comm.weights import SyncStats
from asyncrl.rl.config.run import DataConfig
from asyncrl.rl.config.sampler import SamplerConfig
from asyncrl.rl.config.trainer import TrainerConfig
from asyncrl.rl.observe.sync_metrics import DELTA_METRICS, ENGINE_METRICS, SYNC_METRICS, preemption_line, sync_record
from asyncrl.rl.sampler.backend import SamplerSyncStats
from test_packing import random_groups

pytestmark = pytest.mark.usefixtures("actor_zygote")  # tests/conftest.py: its supervisors fork actors from a zygote

HOST = "127.0.0.1"
ONE_THREAD = {"OMP_NUM_THREADS": "1"}
EPS = 1e-6
OLD_STATS_KEYS = (
    "groups tokens completions batches generate_s discarded_batches weight_sync_s pause_s syncs failed_syncs "
    "syncs_waited_for_generate version generating name backend device weight_dtype tokens_per_s"
).split()
"""The keys of an HF sampler's ``stats`` when it answered a dict, in their order: its typed answer's."""


def check_sender(s: SyncStats, version: int) -> None:
    assert s.version == version and s.bytes > 0 and s.buckets > 1, s
    assert min(s.seconds, s.vote_s, s.move_s, s.commit_s, s.copy_s, s.transfer_s) >= 0, s
    assert s.vote_s + s.move_s + s.commit_s <= s.seconds + EPS, s
    assert s.copy_s + s.transfer_s <= s.seconds + EPS, s  # host time on CPU: they cannot overlap
    assert s.copy_s > 0 and s.transfer_s > 0, s


def check_sampler(r: SamplerSyncStats, version: int) -> None:
    check_sender(r.receive, version)
    assert min(r.pause_s, r.reset_s, r.resume_s, r.call_s) >= 0, r
    assert r.pause_s + r.receive.seconds + r.resume_s <= r.seconds + EPS, r
    assert r.load_s == r.receive.copy_s  # HF: no prefix cache; the load is the unpacking into the model


async def test_a_real_sync_between_the_trainer_and_an_hf_sampler_is_split_into_phases(embedded_path):
    from asyncrl.rl.sampler.actor import SamplerActor
    from asyncrl.rl.trainer.actor import TrainerActor

    async with Supervisor(call_timeout_s=120) as sup:
        t, s = await asyncio.gather(
            sup.spawn(TrainerActor, embedded_path, TrainerConfig(lr=1e-2), name="trainer", env=ONE_THREAD),
            sup.spawn(
                SamplerActor,
                embedded_path,
                SamplerConfig(backend="hf", group_size=2, max_new_tokens=8),
                name="sampler",
                env=ONE_THREAD,
                kwargs=dict(data=DataConfig(n_train=20, n_heldout=8)),
            ),
        )
        stats = await s.stats()
        assert stats.weight_dtype == "float32"  # the embedded model's: the wire's dtype
        assert list(msgspec.to_builtins(stats)) == OLD_STATS_KEYS
        await form_group([t, s], HOST, timeout_s=60)
        await asyncio.gather(t.setup_sender(30, 64 << 10), s.setup_receiver(30))
        for version in (1, 2):
            await t.train_step(random_groups(seed=version))
            sent, got = await asyncio.gather(t.send_weights(version), s.receive_weights(version))
            assert isinstance(sent, SyncStats) and isinstance(got, SamplerSyncStats)
            check_sender(sent, version)
            check_sampler(got, version)
            assert got.receive.bytes == sent.bytes and got.receive.buckets == sent.buckets
            record = sync_record(max(sent.seconds, got.seconds) + 0.01, sent, [got])
            assert record.sync_bytes == sent.bytes and abs(record.sync_rpc_s - 0.01) < EPS
        assert await t.weights_digest() == await s.weights_digest()


def test_the_step_record_takes_the_slowest_sampler_per_phase_and_the_rest_as_round_trips():
    sent = SyncStats(3, 1000, 2, 0.5, vote_s=0.3, move_s=0.1, commit_s=0.1, copy_s=0.04, transfer_s=0.05)
    fast = SamplerSyncStats(
        seconds=0.4, pause_s=0.1, receive=SyncStats(3, 1000, 2, 0.25, copy_s=0.2, transfer_s=0.02), resume_s=0.01
    )
    slow = SamplerSyncStats(
        seconds=0.6,
        pause_s=0.3,
        receive=SyncStats(3, 1000, 2, 0.2, copy_s=0.1, transfer_s=0.07),
        reset_s=0.05,
        resume_s=0.02,
        call_s=0.03,
    )
    record = msgspec.structs.asdict(sync_record(0.9, sent, [fast, slow]))
    assert set(record) == {"sync_s", *SYNC_METRICS, *DELTA_METRICS, *ENGINE_METRICS}
    assert record == pytest.approx(
        {
            "sync_s": 0.9,
            "sync_trainer_s": 0.5,
            "sync_trainer_pack_s": 0.04,
            "sync_trainer_transfer_s": 0.05,
            "sync_trainer_vote_s": 0.4,
            "sync_sampler_s": 0.6,
            "sync_sampler_pause_s": 0.3,
            "sync_sampler_transfer_s": 0.07,
            "sync_sampler_load_s": 0.2,
            "sync_sampler_resume_s": 0.02,
            "sync_rpc_s": 0.3,
            "sync_bytes": 1000.0,
            "sync_sent_bytes": None,  # a full sync: the line leaves them out
            "sync_changed": None,
            "engine_preemptions": None,  # samplers that count no engine statistics: left out too
            "engine_kv_cache_peak": None,
        }
    )
    # Samplers that count them (--sampler.engine_stats): preemptions summed, the fullest cache.
    counting = [msgspec.structs.replace(fast, preemptions=3, kv_cache_peak=0.5), slow]
    counting.append(msgspec.structs.replace(slow, preemptions=0, kv_cache_peak=0.75))
    engines = msgspec.structs.asdict(sync_record(0.9, sent, counting))
    assert {k: engines[k] for k in ENGINE_METRICS} == {"engine_preemptions": 3, "engine_kv_cache_peak": 0.75}
    # No sync this step (sync_every > 1, or the trainer alone): every phase is there, at 0.
    assert msgspec.structs.asdict(sync_record(0.0, None, [])) == {
        "sync_s": 0.0,
        **dict.fromkeys(SYNC_METRICS, 0.0),
        **dict.fromkeys(DELTA_METRICS),  # a delta sync's only: left out of the line
        **dict.fromkeys(ENGINE_METRICS),
    }


def test_the_first_step_with_preemptions_says_what_keeps_fewer_sequences_in_flight():
    from asyncrl.rl.observe.sync_metrics import SyncPhases

    assert preemption_line(3, SyncPhases(sync_s=1.0, engine_preemptions=None), 2) == ""  # not counted
    assert preemption_line(3, SyncPhases(sync_s=1.0, engine_preemptions=0, engine_kv_cache_peak=0.4), 2) == ""
    full = SyncPhases(sync_s=1.0, engine_preemptions=12, engine_kv_cache_peak=0.995)
    line = preemption_line(3, full, 2)
    assert line.startswith("step 3: the samplers' engines preempted 12 request(s) since the sync before (KV cache")
    assert "at most 100% full" in line, line
    assert line.endswith("--sampler.streams 1 keeps one step's groups in each engine instead of 2"), line
    assert preemption_line(3, full, 1).endswith(
        "a smaller --sampler.prompts_per_batch, or more of the GPU for it (--sampler.gpu_memory_utilization)"
    )


def test_the_wire_dtype_is_the_samplers_own_when_they_agree():
    from asyncrl.rl.driver.fleet.sync_group import wire_dtype

    assert wire_dtype(["bfloat16", "bfloat16"]) == "bfloat16"  # fp32 master weights go out as bf16
    assert wire_dtype(["float32"]) == "float32"
    assert wire_dtype(["bfloat16", "float32"]) == ""  # they differ: the trainer's own dtypes
    assert wire_dtype(["bfloat16", ""]) == ""  # one cannot say
    assert wire_dtype(["int8"]) == ""  # not a dtype weights are synced in: refused, not sent
    assert wire_dtype([]) == ""
