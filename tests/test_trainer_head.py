"""The fused output layer (``scoring/chunked_head.py``, ``scoring/logprobs.py``): the same log-probs,
entropy, loss and gradients as the full-logits path, without ``[tokens, vocab]`` logits; and
``--trainer.micro_batch_tokens 0`` (auto, ``trainer/memory_budget.py``)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from asyncrl.rl.config.trainer import GRPOLossConfig, LoRAConfig, TrainerConfig
from asyncrl.rl.scoring import chunked_head
from asyncrl.rl.scoring.chunked_head import head_logprobs, head_topk
from asyncrl.rl.scoring.logprobs import fused_head_fallback
from asyncrl.rl.scoring.tokens import token_entropy, token_logprobs
from asyncrl.rl.trainer.memory_budget import auto_micro_batch_tokens, resolve_micro_batch_tokens
from tests.test_packing import random_groups

QWEN_05B = dict(hidden_size=896, num_layers=24, intermediate_size=4864, num_heads=14, vocab_size=151936)


def full_path(hidden, weight, bias, targets, temperature):
    """``token_logprobs`` on ``(h @ W.T + b) / T`` laid out as one row: position t predicts t + 1."""
    logits = hidden @ weight.t() + (0 if bias is None else bias)
    logits = torch.cat([logits, logits.new_zeros(1, logits.shape[1])]) / temperature
    ids = torch.cat([targets.new_zeros(1), targets])
    return token_logprobs(logits[None], ids[None])[0], logits[:-1]


@pytest.mark.parametrize("n, chunk", [(13, 5), (3, 8), (16, 4), (7, 1)], ids=["ragged", "one-short", "even", "one"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fused_logprobs_and_gradients_equal_the_full_logits_path(n, chunk, bias, temperature):
    torch.manual_seed(n * 10 + chunk)
    vocab, width = 37, 8
    hidden = torch.randn(n, width, requires_grad=True)
    weight = torch.randn(vocab, width, requires_grad=True)
    b = torch.randn(vocab, requires_grad=True) if bias else None
    targets = torch.randint(0, vocab, (n,))
    upstream = torch.randn(n)  # a gradient that weighs every token differently
    inputs = [t for t in (hidden, weight, b) if t is not None]

    got, _ = head_logprobs(hidden, weight, b, targets, temperature, chunk=chunk)
    got_grads = torch.autograd.grad((got * upstream).sum(), inputs)
    want, _ = full_path(hidden, weight, b, targets, temperature)
    want_grads = torch.autograd.grad((want * upstream).sum(), inputs)

    assert got.dtype == torch.float32 and got.shape == (n,)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for g, w in zip(got_grads, want_grads):
        assert w.abs().max() > 1e-3
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_a_frozen_head_gets_no_gradient_and_the_hidden_states_still_do():
    torch.manual_seed(1)
    hidden = torch.randn(9, 6, requires_grad=True)
    weight = torch.randn(20, 6)  # LoRA: the head is frozen
    targets = torch.randint(0, 20, (9,))
    got, _ = head_logprobs(hidden, weight, None, targets, 1.3, chunk=4)
    got.sum().backward()
    ref = hidden.detach().requires_grad_()
    full, _ = full_path(ref, weight, None, targets, 1.3)
    full.sum().backward()
    torch.testing.assert_close(got, full, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(hidden.grad, ref.grad, rtol=1e-5, atol=1e-5)
    assert weight.grad is None


def test_tied_embeddings_get_the_gradient_of_both_uses():
    """The head's weight is the input embedding: its gradient sums the head's and the lookup's."""
    torch.manual_seed(2)
    vocab, width = 30, 8
    embedding = torch.nn.Embedding(vocab, width)
    mix = torch.randn(width, width)
    ids = torch.randint(0, vocab, (11,))
    targets = torch.randint(0, vocab, (11,))

    def grads(fused: bool) -> torch.Tensor:
        embedding.weight.grad = None
        hidden = torch.tanh(embedding(ids) @ mix)
        if fused:
            lp, _ = head_logprobs(hidden, embedding.weight, None, targets, 0.8, chunk=3)
        else:
            lp, _ = full_path(hidden, embedding.weight, None, targets, 0.8)
        (lp * torch.linspace(-1, 2, 11)).sum().backward()
        return embedding.weight.grad.clone()

    torch.testing.assert_close(grads(True), grads(False), rtol=1e-5, atol=1e-5)


def test_the_entropy_of_the_fused_pass_is_token_entropy_s_and_the_no_grad_pass_gives_the_same_logprobs():
    torch.manual_seed(3)
    hidden, weight, b = torch.randn(10, 8), torch.randn(25, 8), torch.randn(25)
    targets = torch.randint(0, 25, (10,))
    lp, entropy = head_logprobs(hidden.requires_grad_(), weight, b, targets, 0.6, chunk=3, entropy=True)
    want_lp, logits = full_path(hidden, weight, b, targets, 0.6)
    torch.testing.assert_close(entropy, token_entropy(logits[None].detach())[0], rtol=1e-5, atol=1e-5)
    assert not entropy.requires_grad and lp.requires_grad
    with torch.no_grad():
        lp_ng, none = head_logprobs(hidden, weight, b, targets, 0.6, chunk=4)
    assert none is None and not lp_ng.requires_grad
    torch.testing.assert_close(lp_ng, want_lp.detach(), rtol=1e-5, atol=1e-5)


def test_the_fused_head_gives_the_log_probs_of_several_ids_a_position_and_their_gradient():
    """A teacher's top-K beside the sampled token (``targets`` [N, 1 + K], ids repeated across
    columns): value and gradient against log_softmax of the full logits, a ragged chunk."""
    torch.manual_seed(5)
    n, vocab, width = 11, 29, 8
    hidden = torch.randn(n, width, requires_grad=True)
    weight = torch.randn(vocab, width, requires_grad=True)
    b = torch.randn(vocab, requires_grad=True)
    targets = torch.randint(0, vocab, (n, 6))
    targets[:, 1] = targets[:, 0]  # the sampled token among the top-K: both gradients add
    upstream = torch.randn(n, 6)
    got, _ = head_logprobs(hidden, weight, b, targets, 0.7, chunk=4)
    got_grads = torch.autograd.grad((got * upstream).sum(), (hidden, weight, b))
    want = torch.log_softmax((hidden @ weight.t() + b) / 0.7, -1).gather(-1, targets)
    want_grads = torch.autograd.grad((want * upstream).sum(), (hidden, weight, b))
    assert got.shape == (n, 6)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    values, ids = head_topk(hidden.detach(), weight.detach(), b.detach(), 5, 0.7, chunk=4)
    ref = torch.topk(torch.log_softmax((hidden @ weight.t() + b) / 0.7, -1).detach(), 5, -1)
    torch.testing.assert_close(values, ref.values, rtol=1e-5, atol=1e-5)
    assert torch.equal(ids, ref.indices)


# --- the CUDA fast path's pieces, on CPU --------------------------------------------------------


def test_the_fast_path_is_cuda_only_and_follows_asyncrl_head_fast(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")  # a device object needs no GPU
    monkeypatch.delenv("ASYNCRL_HEAD_FAST", raising=False)
    assert chunked_head.fast_path(cuda) and not chunked_head.fast_path(cpu)
    assert chunked_head._chunk_fns(cpu) == (chunked_head.chunk_stats, chunked_head.chunk_grad_logits)
    monkeypatch.setenv("ASYNCRL_HEAD_FAST", "0")
    assert not chunked_head.fast_path(cuda)
    monkeypatch.setattr(chunked_head, "FAST", True)  # the benchmark's per-call switch wins
    assert chunked_head.fast_path(cuda) and not chunked_head.fast_path(cpu)
    monkeypatch.setattr(chunked_head, "FAST", False)
    monkeypatch.setenv("ASYNCRL_HEAD_FAST", "1")
    assert not chunked_head.fast_path(cuda)
    # addmm's float32 out_dtype has no CPU kernel: the accumulation keeps `acc += (a @ b).float()`
    assert chunked_head._fp32_matmul(cpu, torch.bfloat16) == ""
    a, b = torch.randn(6, 5).bfloat16(), torch.randn(5, 4).bfloat16()
    acc = torch.ones(6, 4)
    chunked_head._accumulate(acc, a, b, fast=True)
    assert torch.equal(acc, 1 + (a @ b).float())


def old_chunk_forward(logits, ids, t):
    """The forward's per-chunk formulas before they moved into `chunk_stats`."""
    z = logits.float() / t
    lse = torch.logsumexp(z, dim=-1)
    lp = (z.gather(-1, ids[:, None]).squeeze(-1) if ids.dim() == 1 else z.gather(-1, ids)) - (
        lse if ids.dim() == 1 else lse[:, None]
    )
    logp = z - lse[:, None]
    return lp, lse, -(logp.exp() * logp).sum(-1)


def old_chunk_backward(logits, lse, g, ids, t, dtype):
    """The backward's per-chunk formulas before they moved into `chunk_grad_logits`."""
    z = logits.float() / t
    g = g if g.dim() == 2 else g[:, None]
    dz = torch.exp(z - lse[:, None]).mul_(-g.sum(-1, keepdim=True))
    dz.scatter_add_(-1, ids if ids.dim() == 2 else ids[:, None], g)
    return dz.div_(t).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [0, 5], ids=["sampled", "top-k"])
def test_the_chunk_functions_give_the_old_formulas_values(dtype, m):
    """`chunk_stats` / `chunk_grad_logits` eager (CPU's path, and the code CUDA compiles) against
    the formulas they replaced, bit for bit; and `onehot_rows`, the one-hot add the compiled
    backward takes instead of ``scatter_add_``, against it (repeated ids add)."""
    torch.manual_seed(6)
    c, vocab = 9, 41
    logits = (3 * torch.randn(c, vocab)).to(dtype)
    ids = torch.randint(0, vocab, (c, m) if m else (c,))
    if m:
        ids[:, 2] = ids[:, 0]
    g = torch.randn(ids.shape)
    want = old_chunk_forward(logits, ids, 0.7)
    lp, lse, ent = chunked_head.chunk_stats(logits, ids, 0.7, True)
    for got, w in zip((lp, lse, ent), want):
        assert torch.equal(got, w)
    assert chunked_head.chunk_stats(logits, ids, 0.7, False)[2] is None
    dz = chunked_head.chunk_grad_logits(logits, lse, g, ids, 0.7, dtype)
    assert dz.dtype == dtype and torch.equal(dz, old_chunk_backward(logits, lse, g, ids, 0.7, dtype))
    ids2, g2 = (ids, g) if m else (ids[:, None], g[:, None])
    scattered = torch.zeros(c, vocab).scatter_add_(-1, ids2, g2)
    assert scattered.abs().max() > 0.1
    torch.testing.assert_close(chunked_head.onehot_rows(ids2, g2, vocab), scattered, rtol=1e-6, atol=1e-6)


# --- a whole train step: the fused path against the full-logits one --------------------------------


def step(path: str, config: TrainerConfig, groups, fused: bool):
    from asyncrl.rl.trainer.actor import TrainerActor

    trainer = TrainerActor(path, config)
    assert trainer.fallback_reason() == ""  # the embedded Qwen2 takes the fused path by default
    if not fused:
        trainer.fallback_reason = lambda: "forced by the test"
    metrics = trainer.train_share(groups)
    grads = {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    return metrics, grads


@pytest.mark.parametrize("layout", ["padded", "packed-sdpa", "packed-eager", "packed-flat"])
@pytest.mark.parametrize("lora, kl", [(0, 0.0), (0, 0.05), (4, 0.05)], ids=["full", "full-kl", "lora-kl"])
def test_a_fused_step_gives_the_full_logits_loss_and_gradients(embedded_path, monkeypatch, layout, lora, kl):
    """fp32, multi-turn action masks, temperature 0.8: loss, metrics and every gradient to 1e-5.
    The embedded model ties its embeddings, so the head's gradient meets the lookup's."""
    torch.set_num_threads(1)
    if layout == "packed-flat":  # the layout flash attention gets, taken under sdpa
        monkeypatch.setattr("asyncrl.rl.scoring.forward.MASKED_IMPLEMENTATIONS", ())
    config = TrainerConfig(
        micro_batch_tokens=200,
        pack_tokens=0 if layout == "padded" else 96,
        temperature=0.8,
        attn_implementation="eager" if layout == "packed-eager" else "",
        loss=GRPOLossConfig(kl_coef=kl),
        lora=LoRAConfig(rank=lora),
    )
    groups = random_groups(seed=7)
    fused, grads_fused = step(embedded_path, config, groups, fused=True)
    full, grads_full = step(embedded_path, config, groups, fused=False)
    for key in ("loss", "pg_loss", "ratio_mean", "entropy", "tokens") + (("kl",) if kl else ()):
        assert getattr(fused, key) == pytest.approx(getattr(full, key), rel=1e-5, abs=1e-6), key
    if kl and lora:
        assert full.kl == 0.0  # a fresh adapter is the base: nothing yet to pull back from
    assert grads_fused.keys() == grads_full.keys() and any(g.abs().max() > 1e-4 for g in grads_full.values())
    if not lora:
        assert "lm_head.weight" in grads_full or "model.embed_tokens.weight" in grads_full
    for name, g in grads_full.items():
        torch.testing.assert_close(grads_fused[name], g, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("layout", ["padded", "packed-sdpa"])
def test_a_fused_step_with_a_teacher_s_top_k_gives_the_full_logits_loss_and_gradients(embedded_path, layout):
    """The K+1-bucket KL: the student's log-probs of the teacher's ids gathered in the fused pass
    against the full logits' (temperature 0.8, action masks); and it adds to the step's loss."""
    torch.set_num_threads(1)
    config = TrainerConfig(
        micro_batch_tokens=200,
        pack_tokens=0 if layout == "padded" else 96,
        temperature=0.8,
        loss=GRPOLossConfig(distill_coef=0.7),
    )
    groups = with_teacher_topk(random_groups(seed=7, n_groups=3), k=4)
    fused, grads_fused = step(embedded_path, config, groups, fused=True)
    full, grads_full = step(embedded_path, config, groups, fused=False)
    for key in ("loss", "pg_loss", "distill_kl", "entropy", "tokens"):
        assert getattr(fused, key) == pytest.approx(getattr(full, key), rel=1e-5, abs=1e-6), key
    assert fused.distill_kl > 0.1 and fused.loss == pytest.approx(fused.pg_loss + 0.7 * fused.distill_kl)
    for name, g in grads_full.items():
        torch.testing.assert_close(grads_fused[name], g, rtol=1e-5, atol=1e-6, msg=name)


def with_teacher_topk(groups, k: int):
    """``groups`` with made-up teacher top-K ids (distinct a position) and log-probs (a softmax's)."""
    import msgspec

    gen = torch.Generator().manual_seed(11)
    out = []
    for g in groups:
        ids, lps = [], []
        for c in g.completion_ids:
            n = len(c)
            ids.append(torch.stack([torch.randperm(40, generator=gen)[:k] for _ in range(n)]).flatten().tolist())
            lps.append(torch.log_softmax(torch.randn(n, k + 1, generator=gen), -1)[:, :k].flatten().tolist())
        out.append(msgspec.structs.replace(g, teacher_top_k=k, teacher_topk_ids=ids, teacher_topk_logprobs=lps))
    return out


def test_the_fallback_is_taken_for_a_soft_capped_head(embedded_path, monkeypatch):
    from asyncrl.rl.trainer import actor as actor_module
    from asyncrl.rl.trainer.actor import TrainerActor

    torch.set_num_threads(1)
    trainer = TrainerActor(embedded_path, TrainerConfig(micro_batch_tokens=200))
    assert fused_head_fallback(trainer.model) == ""
    trainer.model.config.final_logit_softcapping = 30.0
    assert "final_logit_softcapping" in trainer.fallback_reason()
    seen = []
    real = actor_module.scored_logprobs_at

    def spy(*args, fused, **kwargs):
        seen.append(fused)
        return real(*args, fused=fused, **kwargs)

    monkeypatch.setattr(actor_module, "scored_logprobs_at", spy)
    trainer.train_share(random_groups(seed=3, n_groups=2))
    assert seen and not any(seen)


# --- micro_batch_tokens 0: auto ------------------------------------------------------------------


def test_auto_micro_batch_tokens_grows_with_free_memory_and_with_checkpointing():
    gib = 1 << 30
    plain = [auto_micro_batch_tokens(f * gib, **QWEN_05B, checkpointing=False) for f in (8, 20, 40, 60)]
    assert plain == sorted(plain) and plain[0] < plain[-1]
    for free in (20, 40):
        assert auto_micro_batch_tokens(free * gib, **QWEN_05B, checkpointing=True) > auto_micro_batch_tokens(
            free * gib, **QWEN_05B, checkpointing=False
        )
    # full logits (the fallback) cost ~6 B a vocabulary entry a token: far fewer tokens
    assert auto_micro_batch_tokens(
        40 * gib, **QWEN_05B, checkpointing=False, full_logits=True
    ) < auto_micro_batch_tokens(40 * gib, **QWEN_05B, checkpointing=False)


def test_auto_micro_batch_tokens_clamps_and_rounds_down_to_1024():
    gib = 1 << 30
    assert auto_micro_batch_tokens(0, **QWEN_05B, checkpointing=False) == 1024
    assert auto_micro_batch_tokens(2 * gib, **QWEN_05B, checkpointing=False) == 1024  # less than fits: the floor
    assert auto_micro_batch_tokens(10_000 * gib, **QWEN_05B, checkpointing=True) == 65536
    for free in (9, 13, 27, 41):
        tokens = auto_micro_batch_tokens(free * gib, **QWEN_05B, checkpointing=False)
        assert tokens % 1024 == 0 and 1024 <= tokens <= 65536
    # 20 GiB for a 0.5B shape: (0.85 x 20 GiB - 2.76 GiB fixed) / 2,043,200 B a token = 7482 -> 7168
    assert auto_micro_batch_tokens(20 * gib, **QWEN_05B, checkpointing=False) == 7168


def test_auto_turns_checkpointing_on_at_the_first_step_that_needs_it_not_only_the_first_step():
    """Completions grow as a run learns: a first step of short ones chose the budget without
    checkpointing, and a later step's longer sequence must turn it on then (it stopped the run
    before, naming a setting auto would have chosen). The estimate is the real one, for the 0.5B
    shape in 20 GiB free: 7,168 tokens without checkpointing, more with it."""
    from asyncrl.rl.trainer.memory_budget import AutoBudget

    gib, measured = 1 << 30, []

    def measure(checkpointing: bool) -> tuple[int, int]:
        measured.append(checkpointing)
        return auto_micro_batch_tokens(20 * gib, **QWEN_05B, checkpointing=checkpointing), 20 * gib

    without = auto_micro_batch_tokens(20 * gib, **QWEN_05B, checkpointing=False)
    budget = AutoBudget(measure, checkpointing=False, may_turn_on=True)
    assert not budget.fit(3000) and budget.tokens == without and measured == [False]
    assert budget.said == [f"micro_batch_tokens auto -> {without} (20.0 GiB free)"]
    assert not budget.fit(without) and budget.said == []  # a step that fits says nothing
    assert budget.fit(without + 1) and budget.checkpointing and budget.tokens > without + 1
    assert budget.said[0].startswith(f"activation checkpointing on (auto): a sequence of {without + 1} tokens")
    assert measured == [False, True]
    assert not budget.fit(without + 1) and budget.said == [] and measured == [False, True]  # once
    # asked for, or not one process on a GPU: never turned on; the caller stops on what cannot fit
    apart = AutoBudget(measure, checkpointing=False, may_turn_on=False)
    assert not apart.fit(without + 1) and (apart.tokens, apart.checkpointing) == (without, False)
    asked = AutoBudget(measure, checkpointing=True, may_turn_on=False)
    assert not asked.fit(70_000) and asked.tokens == 65536 < 70_000  # beyond even checkpointing's cap
    # what the run's start checks the completion limit against: the most, checkpointing where it
    # may go on, measured afresh and choosing nothing
    fresh = AutoBudget(measure, checkpointing=False, may_turn_on=True)
    assert fresh.most() == (budget.tokens, 20 * gib) and fresh.tokens == 0 and not fresh.checkpointing
    assert AutoBudget(measure, checkpointing=False, may_turn_on=False).most()[0] == without
    # the first step's own longest turns it on as before, choosing twice
    first = AutoBudget(measure, checkpointing=False, may_turn_on=True)
    assert first.fit(without + 1) and len(first.said) == 3 and first.tokens > without


def test_auto_on_cpu_is_the_old_default_and_an_explicit_value_is_kept(embedded_path):
    from asyncrl.rl.trainer.actor import TrainerActor

    assert TrainerConfig().micro_batch_tokens == 0
    trainer = TrainerActor(embedded_path, TrainerConfig())
    assert trainer.micro_batch_tokens() == 16384
    metrics = trainer.train_share(random_groups(seed=5, n_groups=2))
    assert metrics.micro_batch_tokens == 16384
    cpu = torch.device("cpu")
    assert resolve_micro_batch_tokens(
        0, trainer.model, trainer.optimizer, cpu, checkpointing=False, full_logits=False, pack_tokens=20000
    ) == (20000, 0)
    assert resolve_micro_batch_tokens(
        512, trainer.model, trainer.optimizer, cpu, checkpointing=False, full_logits=False
    ) == (512, 0)


def test_pack_tokens_is_checked_against_the_explicit_budget_or_auto_s_most():
    TrainerConfig(pack_tokens=65536)  # auto picks at least pack_tokens
    with pytest.raises(ValueError, match="pack_tokens"):
        TrainerConfig(pack_tokens=65537)
    with pytest.raises(ValueError, match="pack_tokens"):
        TrainerConfig(micro_batch_tokens=100, pack_tokens=200)
    with pytest.raises(ValueError, match="micro_batch_tokens"):
        TrainerConfig(micro_batch_tokens=-1)
    assert dataclasses.replace(TrainerConfig(), micro_batch_tokens=4096).micro_batch_tokens == 4096


def test_trainer_compile_false_keeps_the_fused_head_eager_too(embedded_path, monkeypatch):
    from asyncrl.rl.scoring import chunked_head
    from asyncrl.rl.trainer.actor import TrainerActor

    monkeypatch.setattr(chunked_head, "FAST", None)
    TrainerActor(embedded_path, TrainerConfig())
    assert chunked_head.FAST is None  # auto: the head follows ASYNCRL_HEAD_FAST (on, CUDA only)
    TrainerActor(embedded_path, TrainerConfig(compile=False))
    assert chunked_head.FAST is False
    assert not chunked_head.fast_path(torch.device("cuda"))
