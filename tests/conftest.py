"""Fixtures only; what the tests share besides is in helpers.py."""
import pytest


@pytest.fixture
def results_dir(tmp_path):
    return tmp_path / "results"


@pytest.fixture(scope="session", autouse=True)
def short_test_split():
    """The files of helpers.SHORT_TEST_SPLIT, written before this process's first test."""
    from data_makers import write_mnist5k_with_a_short_test_split
    from helpers import SHORT_TEST_IMAGES, SHORT_TEST_SPLIT_DIR  # once conftest.py at the top set COURSE_OUTPUT_DIR

    write_mnist5k_with_a_short_test_split(SHORT_TEST_SPLIT_DIR, SHORT_TEST_IMAGES)
