"""Finding and binding libhccl without Ascend hardware: the search order, what each failure says,
the cache, and the optional symbols (against the stub libhccl of `hccl_support`)."""

from __future__ import annotations

import ctypes
import os

import pytest
import torch

from asyncrl.comm import hccl_library
from asyncrl.comm.errors import CommLibraryError
from asyncrl.comm.pyhccl import HcclCommunicator
from hccl_support import Hub, create, on_ranks

pytest_plugins = ["hccl_support"]  # its fixtures: stub_builds, stub, minimal_stub, pair


@pytest.fixture
def clean_env(monkeypatch):
    for var in (hccl_library.ENV_LIBRARY, *hccl_library.TOOLKIT_ENV_VARS):
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def test_search_order_is_override_then_toolkit_then_loader(clean_env):
    default = os.path.join(hccl_library.DEFAULT_TOOLKIT, "lib64", "libhccl.so")
    assert [p for _, p in hccl_library.library_candidates()] == [default, "libhccl.so"]
    clean_env.setenv("ASCEND_HOME_PATH", "/opt/a")
    clean_env.setenv("ASCEND_TOOLKIT_HOME", "/opt/b")
    assert [p for _, p in hccl_library.library_candidates()] == [
        "/opt/a/lib64/libhccl.so",
        "/opt/b/lib64/libhccl.so",
        default,
        "libhccl.so",
    ]
    clean_env.setenv("ASCEND_TOOLKIT_HOME", hccl_library.DEFAULT_TOOLKIT)  # the same place is tried once
    assert [p for _, p in hccl_library.library_candidates()] == ["/opt/a/lib64/libhccl.so", default, "libhccl.so"]
    clean_env.setenv(hccl_library.ENV_LIBRARY, "/x/libhccl.so")  # an explicit choice is the only one
    assert hccl_library.library_candidates() == [(f"${hccl_library.ENV_LIBRARY}", "/x/libhccl.so")]


def test_no_library_anywhere_lists_every_place_tried(clean_env, tmp_path):
    if os.path.exists(os.path.join(hccl_library.DEFAULT_TOOLKIT, "lib64", "libhccl.so")):
        pytest.skip("this machine has CANN installed")
    clean_env.setenv("ASCEND_HOME_PATH", str(tmp_path / "a"))
    clean_env.setenv("ASCEND_TOOLKIT_HOME", str(tmp_path / "b"))
    try:
        ctypes.CDLL("libhccl.so")
        pytest.skip("the dynamic loader finds a libhccl.so on this machine")
    except OSError:
        pass
    with pytest.raises(CommLibraryError) as info:
        hccl_library.load_library()
    text = str(info.value)
    for where in (
        f"{tmp_path}/a/lib64/libhccl.so (no such file)",
        f"{tmp_path}/b/lib64/libhccl.so (no such file)",
        f"{hccl_library.DEFAULT_TOOLKIT}/lib64/libhccl.so (no such file)",
        "system loader path (LD_LIBRARY_PATH, ld.so.cache): libhccl.so (dlopen failed",
    ):
        assert where in text
    assert hccl_library.ENV_LIBRARY in text  # says how to point at it


def test_override_to_a_missing_file_names_it(clean_env, tmp_path):
    clean_env.setenv(hccl_library.ENV_LIBRARY, str(tmp_path / "nope.so"))
    with pytest.raises(CommLibraryError, match=r"\$ASYNCRL_HCCL_LIBRARY: .*nope\.so \(no such file\)") as info:
        hccl_library.load_library()
    assert "ascend-toolkit" not in str(info.value)  # nothing else was tried


def _loaded_path(fragment: str) -> str | None:
    with open("/proc/self/maps") as f:
        for line in f:
            path = line.split()[-1]
            if fragment in os.path.basename(path) and path.startswith("/"):
                return path
    return None


def test_override_to_a_library_that_is_not_hccl_names_the_missing_symbol(clean_env):
    libc = _loaded_path("libc.so")
    assert libc, "libc is always mapped into this process"
    clean_env.setenv(hccl_library.ENV_LIBRARY, libc)
    with pytest.raises(CommLibraryError, match=f"{libc} lacks the required symbol HcclGetRootInfo"):
        hccl_library.load_library()


def test_a_library_missing_a_later_required_symbol_is_refused(clean_env, stub_builds):
    clean_env.setenv(hccl_library.ENV_LIBRARY, stub_builds["nobcast"])
    with pytest.raises(CommLibraryError, match="lacks the required symbol HcclBroadcast"):
        hccl_library.load_library()


def test_override_loads_and_caches_the_stub(clean_env, stub_builds):
    clean_env.setenv(hccl_library.ENV_LIBRARY, stub_builds["full"])
    lib = hccl_library.load_library()
    assert lib.path == stub_builds["full"] and hccl_library.load_library() is lib
    assert all(lib.has(s.name) for s in hccl_library.HCCL_FUNCTIONS)
    assert lib.describe(21) == "HCCL_E_REMOTE (21): stub: error cqe"


def test_optional_symbols_may_be_absent(minimal_stub):
    lib = minimal_stub.lib
    for name in ("HcclSend", "HcclRecv", "HcclGetErrorString", "HcclGetCommAsyncError"):
        assert getattr(lib, name) is None and not lib.has(name)
    assert lib.describe(4) == "HCCL_E_INTERNAL (4)"
    hub = Hub(2)
    comms = on_ranks(2, lambda r: create(minimal_stub, hub.group(r)))
    data = [torch.arange(4.0), torch.zeros(4)]
    on_ranks(2, lambda r: comms[r].broadcast(data[r], 0).wait(5))
    assert torch.equal(data[1], data[0]) and comms[0].async_error() == 0
    before = len(minimal_stub.calls())
    with pytest.raises(CommLibraryError, match="has no HcclSend"):
        comms[0].send(data[0], 1)
    with pytest.raises(CommLibraryError, match="has no HcclRecv"):
        comms[1].recv(data[1], 0)
    assert len(minimal_stub.calls()) == before and not comms[0].closed
    for comm in comms:
        comm.close()


def test_create_without_torch_npu_says_so(stub):
    try:
        import torch_npu  # noqa: F401

        pytest.skip("torch_npu is installed here")
    except ImportError:
        pass
    with pytest.raises(CommLibraryError, match="needs torch_npu"):
        HcclCommunicator.create(Hub(1).group(0), "npu:0", 5, library=stub.lib)
