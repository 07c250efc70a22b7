"""Fixtures only; what the tests share besides is in helpers.py."""
import pytest


@pytest.fixture
def results_dir(tmp_path):
    return tmp_path / "results"
