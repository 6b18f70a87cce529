"""Tests marked ``regular_ops`` check the regular op library's own routes (its C++ autograd nodes,
the direct eager entry, the CPU half-precision route, opcheck of apex_cpp's ops). They are skipped
only where the package runs on its stable-ABI library (APEX_OPS=stable: test_stable_abi.py runs the
suite that way in a subprocess); the main run has the regular library and runs them all."""
import pytest


def pytest_configure(config):
    config.addinivalue_line("markers", "regular_ops: needs the regular op library (_apex_cpp.so)")


def pytest_collection_modifyitems(config, items):
    from apex import _ops
    if not _ops.STABLE:
        return
    skip = pytest.mark.skip(reason="the stable-ABI op library runs this package (APEX_OPS=stable)")
    for item in items:
        if "regular_ops" in item.keywords:
            item.add_marker(skip)
