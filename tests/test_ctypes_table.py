"""The declarative ctypes table shared by the NCCL and HCCL bindings, resolved against the C library
this process already has mapped (libc), so it needs neither collective library."""

from __future__ import annotations

import ctypes
import ctypes.util

import pytest

from asyncrl.comm.ctypes_table import CLibrary, Function, bind_functions
from asyncrl.comm.errors import CommLibraryError

LIBC_PATH = ctypes.util.find_library("c") or "libc.so.6"


@pytest.fixture
def libc():
    return ctypes.CDLL(LIBC_PATH)


def test_a_bound_function_carries_its_prototype(libc):
    bound = bind_functions(libc, LIBC_PATH, [Function("strlen", ctypes.c_size_t, (ctypes.c_char_p,))], hint="?")
    strlen = bound["strlen"]
    assert strlen(b"hello") == 5
    assert strlen.restype is ctypes.c_size_t and strlen.argtypes == [ctypes.c_char_p]
    with pytest.raises(ctypes.ArgumentError):
        strlen(12345)  # the prototype refuses an int where C wants a char *


def test_binding_leaves_the_libraries_own_function_objects_alone(libc):
    bind_functions(libc, LIBC_PATH, [Function("strlen", ctypes.c_size_t, (ctypes.c_char_p,))], hint="?")
    assert libc.strlen.argtypes is None  # another binding of the same library sees no prototype of ours


def test_a_missing_required_symbol_names_itself_the_library_and_the_hint(libc):
    table = [
        Function("strlen", ctypes.c_size_t, (ctypes.c_char_p,)),
        Function("asyncrlNoSuchFunction", ctypes.c_int, ()),
    ]
    with pytest.raises(
        CommLibraryError, match=f"{LIBC_PATH} lacks the required symbol asyncrlNoSuchFunction: wanted libfoo >= 2"
    ):
        bind_functions(libc, LIBC_PATH, table, hint="wanted libfoo >= 2")


def test_a_missing_optional_symbol_is_none(libc):
    table = [Function("asyncrlNoSuchFunction", ctypes.c_int, (), required=False)]
    assert bind_functions(libc, LIBC_PATH, table, hint="?") == {"asyncrlNoSuchFunction": None}


def test_a_library_class_gets_its_table_as_attributes(libc):
    class Libc(CLibrary):
        functions = (
            Function("strlen", ctypes.c_size_t, (ctypes.c_char_p,)),
            Function("asyncrlNoSuchFunction", ctypes.c_int, (), required=False),
        )

    lib = Libc(libc, LIBC_PATH)
    assert lib.path == LIBC_PATH and lib.strlen(b"abc") == 3
    assert lib.has("strlen") and not lib.has("asyncrlNoSuchFunction") and lib.asyncrlNoSuchFunction is None
    assert not lib.has("strcpy")  # not in the table: never bound


def test_both_bindings_declare_their_tables_in_this_shape():
    from asyncrl.comm.hccl_library import HCCL_FUNCTIONS, HcclLibrary
    from asyncrl.comm.nccl_library import NCCL_FUNCTIONS, NcclLibrary

    assert HcclLibrary.functions is HCCL_FUNCTIONS and NcclLibrary.functions is NCCL_FUNCTIONS
    for table in (HCCL_FUNCTIONS, NCCL_FUNCTIONS):
        assert table and all(isinstance(f, Function) for f in table)
        assert len({f.name for f in table}) == len(table)
