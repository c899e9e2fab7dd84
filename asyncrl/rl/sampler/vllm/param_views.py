"""Where each sent tensor lives in a vLLM model, so that a sync can receive straight into it.

vLLM fuses some checkpoint tensors into one parameter (q, k and v into ``qkv_proj``, gate and up
into ``gate_up_proj``: the model class's ``packed_modules_mapping``), and its ``load_weights``
works out the place of every tensor by name on every call: the largest part of a 0.5B model's
in-run sync (docs/vllm.md and benchmarks/README.md, issue 29, have the figures). Without tensor
parallelism a fused parameter is its members' tensors stacked along dim 0 in the mapping's
order, so each place is a contiguous slice that can be computed once per layout (`param_views`)
and then received into like any other tensor: the receiver's own copy plan, and the biggest
tensors straight off the wire. A vocabulary vLLM padded to a multiple of 64 rows is held in the
parameter's first rows.

A computed place is trusted only once a sync through ``load_weights`` has put exactly the received
values there (`LoadAndCheck`). A loader that transforms a tensor (a scale, an offset, a different
fusion, a sharded layer), or a name the model does not hold, keeps the loader for every sync.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import torch

Sent = Iterable[tuple[str, tuple[int, ...], torch.dtype]]
"""The sender's layout: each tensor's name, shape and dtype, in the order it is sent."""


def param_views(model: torch.nn.Module, sent: Sent) -> tuple[dict[str, torch.Tensor] | None, str]:
    """A view of ``model``'s parameters for every sent tensor, or None and the first reason why
    not. The views are disjoint, contiguous and of the sent shape and dtype."""
    sent = list(sent)
    params = dict(model.named_parameters())
    packed = getattr(model, "packed_modules_mapping", None) or {}
    shapes = {name: tuple(shape) for name, shape, _ in sent}
    views: dict[str, torch.Tensor] = {}
    for name, shape, dtype in sent:
        view = _place(name, tuple(shape), params, packed, shapes)
        if isinstance(view, str):
            return None, view
        if view.dtype != dtype:
            return None, f"{name}: the model holds {view.dtype}, the sender sends {dtype}"
        if not view.is_contiguous():
            return None, f"{name}: its place in the model is not contiguous"
        views[name] = view
    overlap = _overlap(views)
    return (None, overlap) if overlap else (views, "")


def _place(
    name: str,
    shape: tuple[int, ...],
    params: Mapping[str, torch.Tensor],
    packed: Mapping[str, list[str]],
    shapes: Mapping[str, tuple[int, ...]],
) -> torch.Tensor | str:
    param = params.get(name)
    if param is not None:
        if tuple(param.shape) == shape:
            return param.data
        if len(shape) == 2 == param.dim() and param.shape[0] > shape[0] and param.shape[1] == shape[1]:
            # vLLM pads a vocabulary to a multiple of 64 rows (VocabParallelEmbedding, ParallelLMHead)
            # and its loader writes the checkpoint's rows first: those rows are the place (checked
            # like any other by LoadAndCheck). A byte-level vocabulary of a few hundred is padded.
            return param.data.narrow(0, 0, shape[0])
        return f"{name}: the model's parameter is {list(param.shape)}, the sender's tensor {list(shape)}"
    parts = name.split(".")
    for i, part in enumerate(parts):
        for fused, members in packed.items():
            if part not in members:
                continue
            fused_name = ".".join([*parts[:i], fused, *parts[i + 1 :]])
            param = params.get(fused_name)
            siblings = [".".join([*parts[:i], m, *parts[i + 1 :]]) for m in members]
            if param is None or any(s not in shapes for s in siblings):
                continue
            sizes = [shapes[s][0] if shapes[s] else 0 for s in siblings]
            if tuple(param.shape) != (sum(sizes), *shape[1:]) or any(shapes[s][1:] != shape[1:] for s in siblings):
                return f"{name}: {fused_name} is {list(param.shape)}, not its members' {members} stacked"
            k = members.index(part)
            return param.data.narrow(0, sum(sizes[:k]), sizes[k])
    return f"{name}: no parameter of the model holds it"


def _overlap(views: Mapping[str, torch.Tensor]) -> str:
    """The first two views that share bytes (a tied pair sent twice, say), or ""."""
    spans = sorted(
        (v.untyped_storage().data_ptr(), v.storage_offset() * v.element_size(), v.numel() * v.element_size(), n)
        for n, v in views.items()
    )
    for (s1, o1, b1, n1), (s2, o2, _, n2) in zip(spans, spans[1:]):
        if s1 == s2 and o1 + b1 > o2:
            return f"{n1} and {n2} share the model's memory"
    return ""


class LoadAndCheck:
    """A sync's consumer that loads through ``load`` (the model's ``load_weights``) and checks,
    while the received tensors are valid, that each one's computed view now holds exactly its
    values. ``wrong`` names those that did not (e.g. a loader that scales a norm)."""

    def __init__(self, load: Callable[[list[tuple[str, torch.Tensor]]], object], views: Mapping[str, torch.Tensor]):
        self.load, self.views = load, views
        self.checked = 0
        self.wrong: list[str] = []

    def __call__(self, items: list[tuple[str, torch.Tensor]]) -> None:
        self.load(items)
        for name, tensor in items:
            self.checked += 1
            if not torch.equal(self.views[name], tensor):
                self.wrong.append(name)

    def verdict(self) -> str:
        """ "" when every view was checked and right; else why not."""
        if self.wrong:
            shown = ", ".join(self.wrong[:3]) + (f" and {len(self.wrong) - 3} more" if len(self.wrong) > 3 else "")
            return f"load_weights put other values than were received into {shown}"
        if self.checked != len(self.views):
            return f"{self.checked} of {len(self.views)} tensors were checked"
        return ""
