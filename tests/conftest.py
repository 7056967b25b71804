"""Shared pytest options: where the lily binary and the reference data live."""
import os
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
SHARED = ROOT.parent / "shared"


def pytest_addoption(parser):
    parser.addoption("--lily-bin", default=os.environ.get("LILY_BIN", str(ROOT / "build" / "lily")),
                     help="path of the lily executable under test")


@pytest.fixture(scope="session")
def lily_bin(request):
    path = pathlib.Path(request.config.getoption("--lily-bin"))
    if not path.exists():
        pytest.fail(f"lily binary not found at {path}; build first (see README)")
    return str(path)


@pytest.fixture(scope="session")
def shared_dir():
    return SHARED
