"""Delta syncs (issue 50): the encoding of a bucket's changes (``comm/delta.py``) on its own, then
syncs between threads over a real store and gloo: bit-identical to full syncs after 100 small
updates (NaN and -0.0 included), a bucket that changed too much going whole, a member without the
base getting a full sync, a receiver whose copy diverged caught by the digest."""

from __future__ import annotations

import threading

import pytest
import torch

from asyncrl.comm.delta import (
    BITMAP,
    INDEX,
    WHOLE,
    apply,
    encode,
    padding_index,
    payload_bytes,
    smallest_form,
    told,
    told_bytes,
    word_dtype,
)
from asyncrl.comm.layout import TensorSpec, build_layout
from sync_actors import digest, run_gloo_members

pytestmark = pytest.mark.usefixtures("actor_zygote")  # tests/conftest.py: its supervisors fork actors from a zygote

HOST = "127.0.0.1"


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def test_a_few_changed_words_travel_as_values_and_indices_and_patch_the_base_bit_exactly():
    g = torch.Generator().manual_seed(0)
    old = torch.randn(4096, generator=g).bfloat16()
    new = old.clone()
    new[[3, 100, 4000]] = torch.tensor([float("nan"), -0.0, 1e-40]).bfloat16()  # NaN, -0.0, a subnormal
    old[7] = 0.0
    new[7] = -0.0  # equal as floats, not as bits: a change
    current, kept = bits(new).clone(), bits(old).clone()
    base = kept.clone()
    out = torch.empty_like(current)
    encoded = encode(current, kept, out, torch.int16)
    assert encoded == (4, told(INDEX, 4))
    assert torch.equal(kept, current)  # the sender's base is now what it sent
    apply(out[: payload_bytes(4, 4096, torch.int16)], encoded.told, base, torch.int16)
    assert torch.equal(base, current)


@pytest.mark.parametrize("fraction", [0.05, 0.15, 0.5])
def test_many_changed_words_travel_as_a_bitmap_and_values_and_patch_the_base_bit_exactly(fraction):
    g = torch.Generator().manual_seed(1)
    old = torch.randn(1 << 14, generator=g).bfloat16()
    new = old.clone()
    where = torch.randperm(old.numel(), generator=g)[: int(old.numel() * fraction)]
    new[where] = torch.randn(where.numel(), generator=g).bfloat16()
    new[where[:3]] = torch.tensor([float("nan"), -0.0, 1e-40]).bfloat16()
    current, kept = bits(new).clone(), bits(old).clone()
    base = kept.clone()
    changed = int((current.view(torch.int16) != kept.view(torch.int16)).sum())
    out = current  # as the sender does: the changes overwrite the packed bucket's front
    expected = current.clone()
    encoded = encode(current, kept, out, torch.int16)
    assert encoded == (changed, told(BITMAP, changed))
    assert torch.equal(kept, expected)
    size = told_bytes(encoded.told, old.numel(), torch.int16)
    assert size == old.numel() // 8 + changed * 2 < payload_bytes(changed, old.numel(), torch.int16, INDEX)
    apply(out[:size].clone(), encoded.told, base, torch.int16)
    assert torch.equal(base, expected)


def test_the_smaller_form_wins_index_below_one_word_in_32_changed_bitmap_above_and_whole_beyond():
    words, word = 1 << 20, torch.int16  # a 2 MiB bf16 bucket: its bitmap is 128 KiB
    assert smallest_form(0, words, word) == INDEX
    assert smallest_form(words // 40, words, word) == INDEX
    assert smallest_form(words // 25, words, word) == BITMAP
    assert smallest_form(words // 2, words, word) == BITMAP
    assert smallest_form(words * 15 // 16, words, word) == WHOLE  # bits + values no smaller than the bucket
    assert smallest_form(3, 1001, word) == INDEX  # words not a multiple of 8: no bitmap


def test_a_bitmap_whose_bits_do_not_number_its_count_is_a_value_error():
    base = torch.zeros(512, dtype=torch.uint8)  # 256 bf16 words: 32 bytes of bits
    payload = torch.zeros(64, dtype=torch.uint8)
    payload[0] = 0b101  # two words marked
    with pytest.raises(ValueError, match="marks 2 changed words, its count says 3"):
        apply(payload, told(BITMAP, 3), base, torch.int16)


def test_a_bucket_that_changed_too_much_goes_whole_and_nothing_changed_sends_nothing():
    old = bits(torch.arange(1024, dtype=torch.float32)).clone()
    new = bits(torch.arange(1024, dtype=torch.float32) + 1).clone()
    kept, out = old.clone(), torch.zeros_like(old)
    encoded = encode(new, kept, out, torch.int32)
    assert encoded == (1024, WHOLE) and torch.equal(kept, new) and not out.any()
    assert encode(new, kept, out, torch.int32) == (0, told(INDEX, 0)) == (0, 0)
    assert payload_bytes(0, 1024, torch.int32) == 0


def test_words_are_the_dtype_that_holds_most_bytes_and_indices_fit_the_bucket():
    layout = build_layout(
        [TensorSpec("w", (300,), "bfloat16"), TensorSpec("b", (10,), "float32"), TensorSpec("s", (3,), "int64")],
        4096,
    )
    assert word_dtype(layout) == torch.int16
    assert payload_bytes(3, 1000, torch.int16) == 8 + 3 * 4  # values, aligned to 8, then int32 indices
    assert payload_bytes(3, 2**31, torch.int16) == 8 + 3 * 8  # a bucket of 2**31 words: int64 indices
    pad = padding_index(layout, 0, torch.device("cpu"))
    covered = set()
    for seg in layout.buckets[0]:
        covered |= set(range(seg.offset, seg.offset + seg.length))
    assert set(pad.tolist()) == set(range(layout.bucket_sizes[0])) - covered


def test_a_payload_that_does_not_fit_its_bucket_is_a_value_error():
    with pytest.raises(ValueError, match="does not fit a bucket of 256 bytes"):
        apply(torch.zeros(1024, dtype=torch.uint8), told(INDEX, 100), torch.zeros(256, dtype=torch.uint8), torch.int16)


def make_master(seed: int) -> dict[str, torch.Tensor]:
    """fp32 master weights (sent as bf16): one larger than a 4 KiB bucket, and an int tensor."""
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(300, 7, generator=g),
        "big": torch.randn(5000, generator=g),
        "b": torch.randn(5, generator=g),
        "steps": torch.arange(9),
    }


def replica(master: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {
        k: torch.zeros(v.shape, dtype=torch.bfloat16 if v.is_floating_point() else v.dtype) for k, v in master.items()
    }


def wire(master: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.bfloat16() if v.is_floating_point() else v.clone() for k, v in master.items()}


def small_update(master: dict[str, torch.Tensor], g: torch.Generator, step: int) -> None:
    """An optimiser step's worth: most bf16 values unchanged, a few moved (every fourth step a
    larger one, that moves a fifth of them), now and then a NaN or a -0.0."""
    with torch.no_grad():
        for name in ("w", "big", "b"):
            t = master[name]
            t.add_(torch.randn(t.shape, generator=g) * (1e-3 if step % 4 == 3 else 1e-4))
        master["w"].view(-1)[step % 2100] = float("nan") if step % 7 == 0 else -0.0
        master["steps"] += 1


def test_a_hundred_delta_syncs_are_bit_identical_to_full_ones_in_place_and_through_a_consumer():
    master, versions = make_master(0), 101
    in_place, consumed = replica(master), replica(master)
    stats: dict[int, list] = {0: [], 1: [], 2: []}
    digests: list[tuple[str, str, str]] = []
    barrier = threading.Barrier(3)

    def consume(name: str, tensor: torch.Tensor) -> None:
        consumed[name].copy_(tensor)

    def member(rank, group, comm):
        from asyncrl.comm.weights import WeightReceiver, WeightSender

        g = torch.Generator().manual_seed(1)
        if rank == 0:
            sender = WeightSender.create(comm, group, master, bucket_bytes=4096, wire_dtype=torch.bfloat16, delta=True)
        else:
            receiver = WeightReceiver.create(comm, group)
        for version in range(versions):
            if rank == 0:
                small_update(master, g, version)
                stats[0].append(sender.send(version))
            else:
                stats[rank].append(receiver.receive(version, in_place if rank == 1 else consume))
            barrier.wait(30)
            if rank == 0:
                digests.append((digest(wire(master)), digest(in_place), digest(consumed)))
            barrier.wait(30)

    run_gloo_members(3, member, timeout_s=120)
    assert all(a == b == c for a, b, c in digests), "a receiver differs from the sender"
    sent = stats[0]
    assert not sent[0].delta and all(s.delta for s in sent[1:])  # the first sync has no base: full
    full = sent[0].sent_bytes
    assert sent[0].bytes <= full < sent[0].bytes + 256 * 4  # the buckets' padding: 4 tensors
    for s in sent[1:]:
        assert 0 < s.changed < 0.5 and s.sent_bytes < full, s
    large = [s for s in sent[1:] if s.changed > 0.1]
    assert len(large) >= 20
    for s in large:  # their buckets went as bitmaps: less than the index form's 6 bytes a changed weight
        assert s.sent_bytes < 6 * s.changed * (full // 2), s
    for rank in (1, 2):
        assert [s.sent_bytes for s in stats[rank]] == [s.sent_bytes for s in sent]  # what one sent, each took


def test_a_member_without_the_base_gets_a_full_sync_and_a_diverged_copy_shows_in_the_digest():
    """v1 full (no base), v2 delta; rank 2's tensors replaced by new ones: v3 full for everyone;
    v4 delta; then rank 1's weights are changed behind the sync's back: v5's delta patches a copy
    that was not the base, and the digest the run checks (``--run.check_weights``) says so."""
    master = make_master(3)
    into = {1: replica(master), 2: replica(master)}
    modes: dict[int, list[bool]] = {0: [], 1: [], 2: []}
    barrier = threading.Barrier(3)

    def member(rank, group, comm):
        from asyncrl.comm.weights import WeightReceiver, WeightSender

        g = torch.Generator().manual_seed(2)
        if rank == 0:
            sender = WeightSender.create(comm, group, master, bucket_bytes=4096, wire_dtype=torch.bfloat16, delta=True)
        else:
            receiver = WeightReceiver.create(comm, group)
        for version in (1, 2, 3, 4, 5):
            if rank == 2 and version == 3:
                into[2] = replica(master)  # a restarted engine's fresh tensors
            if rank == 1 and version == 5:
                into[1]["w"][0, 0] += 1  # behind the sync's back
            if rank == 0:
                small_update(master, g, version)
                modes[0].append(sender.send(version).delta)
            else:
                modes[rank].append(receiver.receive(version, into[rank]).delta)
            barrier.wait(30)

    run_gloo_members(3, member)
    assert modes[0] == modes[1] == modes[2] == [False, True, False, True, True]
    assert digest(into[2]) == digest(wire(master))
    assert digest(into[1]) != digest(wire(master))


async def test_the_trainer_sends_an_hf_sampler_deltas_that_leave_the_same_digest(embedded_path):
    """The trainer actor and an HF sampler (the embedded model, fp32 on the wire, the default
    learning rate): after the first sync every one is a delta, and the digests agree."""
    import asyncio

    from asyncrl import Supervisor
    from asyncrl.comm.member import form_group
    from asyncrl.rl.config.run import DataConfig
    from asyncrl.rl.config.sampler import SamplerConfig
    from asyncrl.rl.config.trainer import TrainerConfig
    from asyncrl.rl.sampler.actor import SamplerActor
    from asyncrl.rl.trainer.actor import TrainerActor
    from test_packing import random_groups

    one_thread = {"OMP_NUM_THREADS": "1"}
    async with Supervisor(call_timeout_s=120) as sup:
        t, s = await asyncio.gather(
            sup.spawn(TrainerActor, embedded_path, TrainerConfig(), name="trainer", env=one_thread),
            sup.spawn(
                SamplerActor,
                embedded_path,
                SamplerConfig(backend="hf", group_size=2, max_new_tokens=8),
                name="sampler",
                env=one_thread,
                kwargs=dict(data=DataConfig(n_train=20, n_heldout=8)),
            ),
        )
        await form_group([t, s], HOST, timeout_s=60)
        await asyncio.gather(t.setup_sender(30, 64 << 10, delta=True), s.setup_receiver(30))
        for version in (1, 2, 3):
            if version > 1:
                await t.train_step(random_groups(seed=version))
            sent, got = await asyncio.gather(t.send_weights(version), s.receive_weights(version))
            assert sent.delta == got.receive.delta == (version > 1), (version, sent)
            assert sent.sent_bytes == got.receive.sent_bytes
            if version > 1:
                assert 0 < sent.changed <= 1, sent
            assert await t.weights_digest() == await s.weights_digest()


async def test_the_trainers_digest_is_of_the_weights_as_a_bf16_sampler_holds_them(embedded_path):
    """The trainer's fp32 weights go out as bf16 to a sampler that holds bf16 (as a GPU vLLM engine
    does): after a full sync and a delta, the trainer's digest is of the bf16 values it sent, the
    sampler's equal to it (it was the fp32 master copy's, which no bf16 sampler can match)."""
    import asyncio

    from asyncrl import Supervisor
    from asyncrl.comm.member import form_group
    from asyncrl.rl.config.trainer import TrainerConfig
    from asyncrl.rl.trainer.actor import TrainerActor
    from sync_actors import Receiver
    from test_packing import random_groups

    one_thread = {"OMP_NUM_THREADS": "1"}
    async with Supervisor(call_timeout_s=120) as sup:
        t, s = await asyncio.gather(
            sup.spawn(TrainerActor, embedded_path, TrainerConfig(), name="trainer", env=one_thread),
            sup.spawn(Receiver, kwargs={"bf16_checkpoint": embedded_path}, name="bf16", env=one_thread),
        )
        fp32 = await t.weights_digest()  # before a layout: the weights as the trainer holds them
        await form_group([t, s], HOST, timeout_s=60)
        await asyncio.gather(t.setup_sender(30, 64 << 10, "bfloat16", delta=True), s.setup(30))
        for version in (1, 2):
            if version > 1:
                await t.train_step(random_groups(seed=version))
            sent, _ = await asyncio.gather(t.send_weights(version), s.receive(version))
            assert sent.delta == (version > 1) and await s.deltas() == version - 1
            assert await t.weights_digest() == await s.weights_digest() != fp32
