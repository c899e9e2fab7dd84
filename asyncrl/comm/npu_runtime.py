"""torch_npu's side of the HCCL communicator: device binding, streams and events.

Kept apart from `asyncrl.comm.pyhccl` so the communicator's logic can be driven without an NPU
(tests pass an object with the same methods), and so torch_npu is imported only when an
`NpuRuntime` is made.
"""

from __future__ import annotations

from typing import Any

import torch

from asyncrl.comm.errors import CommLibraryError


def _npu() -> Any:
    """``torch.npu``, which torch_npu adds to torch at import: torch's own types do not know it."""
    return torch.npu  # type: ignore[attr-defined]


class NpuRuntime:
    """The few torch_npu calls `HcclCommunicator` makes. Making one imports torch_npu
    (CommLibraryError where it is missing)."""

    # aclFormat values torch_npu treats as plain layouts, whose numel() is the element count HCCL
    # must be given (ACL_FORMAT_NCHW = 0, ACL_FORMAT_ND = 2).
    PLAIN_FORMATS = (0, 2)

    def __init__(self) -> None:
        try:
            import torch_npu  # registers torch.npu
        except ImportError as exc:
            raise CommLibraryError(f"the HCCL backend needs torch_npu, which is not importable: {exc}") from exc
        self._torch_npu = torch_npu

    def normalize_device(self, device: torch.device | str | int) -> torch.device:
        # A device without an index must be pinned now: the comm is tied to one NPU for life.
        device = torch.device(device)
        if device.type != "npu":
            raise ValueError(f"the HCCL backend needs an npu device, got {device}")
        if device.index is None:
            device = torch.device("npu", _npu().current_device())
        return device

    def bind_device(self, device: torch.device) -> None:
        # ACL device contexts are per thread: every thread that calls HCCL must set the device.
        _npu().set_device(device)

    def resolve_stream(self, stream: Any, device: torch.device) -> Any:
        return stream if stream is not None else _npu().current_stream(device)

    def stream_handle(self, stream: Any) -> int:
        # Read right before each HCCL call, never cached: torch_npu's npu_stream getter first
        # drains its host task queue, so the ops that produced the tensor are already on the stream.
        return int(stream.npu_stream)

    def record_event(self, stream: Any) -> Any:
        event = _npu().Event()
        event.record(stream)
        return event

    def check_format(self, tensor: torch.Tensor, what: str) -> None:
        # A private layout (e.g. FRACTAL_NZ) has more storage elements than numel(); HCCL would
        # move a truncated buffer.
        get_format = getattr(self._torch_npu, "get_npu_format", None)
        if get_format is not None and get_format(tensor) not in self.PLAIN_FORMATS:
            raise ValueError(
                f"hccl {what}: tensor has NPU format {get_format(tensor)}; cast it to ND first "
                f"(torch_npu.npu_format_cast(t, 2))"
            )
