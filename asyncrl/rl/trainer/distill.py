"""On-policy distillation's two terms, as pure functions: the sampled-token reverse KL as an
advantage (`distill_advantages`, ``--teacher.top_k 0``) and the reverse KL over a teacher's top-K
tokens as a loss (`topk_reverse_kl`). `loss.grpo_loss` applies whichever the batch carries."""

from __future__ import annotations

import torch


def distill_advantages(
    advantages: torch.Tensor, behaviour_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor, coef: float
) -> torch.Tensor:
    """On-policy distillation's per-token advantage, ``[B, L]``: the task's advantage ``A_i``
    (``[B]`` per sequence or ``[B, L]``; zero without a task reward) minus ``coef`` times the reverse KL to the
    teacher estimated on the sampled token::

        A_it = A_i - coef * (log mu(y_it) - log p_T(y_it))

    with ``mu`` the sampler (the student that generated ``y``). This is Thinking Machines Lab's
    "On-Policy Distillation" (2025; Tinker's cookbook): the negative reverse KL as a per-token
    advantage with no discounting, trained by the same importance-weighted policy loss as the
    task reward. Minimising it over the student's own
    samples minimises ``KL(student || teacher)`` (Agarwal et al. 2024, GKD, with lambda = 1 and
    the reverse KL; GKD back-propagates the divergence over the whole vocabulary instead, which
    needs the teacher's full distribution at every position). Readings taken: the student's
    log-prob is the sampler's, as Tinker's, so a token costs no second student forward; the
    term enters the advantage, not the loss, so it is clipped and importance-weighted with the
    rest and adds nothing to ``kl_coef``'s reference penalty. Every input is taken detached."""
    adv = advantages.detach()
    adv = adv if adv.dim() == 2 else adv.unsqueeze(1)
    return adv - coef * (behaviour_logprobs.detach() - teacher_logprobs.detach()).to(adv.dtype)


REST_FLOOR = 1e-6
"""The least mass `topk_reverse_kl`'s rest bucket is given: above float32's rounding of a sum of
probabilities, so a K that covers the vocabulary adds nothing but that (both rests floored)."""


def topk_reverse_kl(
    student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor, floor: float = REST_FLOOR
) -> torch.Tensor:
    """Per position (``[..., K]`` in, ``[...]`` out), the reverse KL from the student ``s`` to
    the teacher ``t`` over the teacher's top-K tokens plus one bucket for the rest of the
    vocabulary::

        KL_K = sum_k s_k (log s_k - log t_k) + s_rest (log s_rest - log t_rest)
        s_rest = max(1 - sum_k s_k, floor),  t_rest = max(1 - sum_k t_k, floor)

    the KL between the two distributions coarsened to K + 1 outcomes: at most the full reverse
    KL (coarsening never increases a divergence), equal to it when the K tokens are the whole
    vocabulary. Its gradient flows through the student's log-probs of the K tokens (its rest
    mass is one minus their sum). The rest is ``-expm1(logsumexp(log s_k))``: exact where the K
    tokens hold almost all of the mass. This is GKD's divergence (Agarwal et al. 2024, "On-Policy
    Distillation of Language Models": generalised JSD with beta 1, the reverse KL) on the
    student's own samples; the top-K and the rest bucket are our reading, so that K numbers a
    token travel instead of the teacher's whole distribution."""
    s, t = student_logprobs, teacher_logprobs.detach().to(student_logprobs.dtype)
    top = (s.exp() * (s - t)).sum(-1)
    s_rest = -torch.expm1(torch.logsumexp(s, dim=-1).clamp(max=0.0))
    t_rest = -torch.expm1(torch.logsumexp(t, dim=-1).clamp(max=0.0))
    s_rest, t_rest = s_rest.clamp(min=floor), t_rest.clamp(min=floor)
    return top + s_rest * (s_rest.log() - t_rest.log())
