"""Preloaded by a zygote in test_zygote.py: finds the temporary directory at import, as a library
may (tempfile then keeps it for the process, and a forked child inherits what it kept)."""

import tempfile

AT_IMPORT = tempfile.gettempdir()
