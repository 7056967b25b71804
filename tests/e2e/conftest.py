"""Fixtures shared by the end-to-end server tests."""
import subprocess

import pytest


@pytest.fixture(scope="module")
def demo_dir(lily_bin, tmp_path_factory):
    """The built-in demo model, written once per test module (read-only for the tests)."""
    d = tmp_path_factory.mktemp("e2e") / "demo"
    subprocess.run([lily_bin, "make-demo", "--out", str(d)], check=True, capture_output=True)
    return d
