"""Tests do not depend on the working directory pytest starts in (tests/conftest.py): the
README's main job leaves `outputs/<algo>/` in the checkout, and a test that builds an embedded
job (default output_dir `outputs/<algo>`) there would be refused by the run-directory check."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_each_test_starts_in_a_new_empty_directory_outside_the_checkout():
    cwd = Path.cwd()
    assert cwd != ROOT and ROOT not in cwd.parents
    assert list(cwd.iterdir()) == []
    (cwd / "outputs").mkdir()  # the next test's directory will not have it


def test_a_previous_tests_files_are_not_seen():
    assert not Path("outputs").exists()
