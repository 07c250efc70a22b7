"""Where a run writes, and how the course shows a path. Kit: a learner may skip this module.

A run must never train for an hour and then lose its result because a folder was a file or could
not be written: the folders are checked before training.
"""
import os
from pathlib import Path

from .errors import CourseError

REPO = Path(__file__).resolve().parents[2]
# Where runs write by default (results/, checkpoints/, the notebooks' figures): this folder if set, else the
# course directory. The test suite points it at a temporary folder, so that no test writes into the checkout.
OUTPUT_DIR_VARIABLE = "COURSE_OUTPUT_DIR"


def output_dir():
    """The folder that holds results/ and checkpoints/ by default: $COURSE_OUTPUT_DIR, else the course directory."""
    value = os.environ.get(OUTPUT_DIR_VARIABLE)
    return Path(value).expanduser().resolve() if value else REPO


def display_path(path):
    """A path as the course shows it: relative to the output folder (by default the course directory) when
    inside it, else relative to the course directory when inside that, else in full."""
    path = Path(path).resolve()
    for base in (output_dir(), REPO):
        if path.is_relative_to(base):
            return str(path.relative_to(base))
    return str(path)


def check_folder(path, flag):
    """``path`` is (or can be made) a folder this process can write into."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise CourseError(f"{flag} {path} is a file, not a folder; pass a folder (it is created if missing)")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise CourseError(f"{flag} {path} cannot be created ({error.strerror}); "
                          "pass a folder you can write to") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise CourseError(f"{flag} {path} is not writable; pass a folder you can write to")


def check_file(path, flag):
    """``path`` can be written as a file: not a folder, and its folder exists or can be made, writable."""
    path = Path(path)
    if path.is_dir():
        raise CourseError(f"{flag} {path} is a folder; pass a file name such as {path / 'weights.pt'}")
    check_folder(path.parent, f"{flag}'s folder")
    if path.exists() and not os.access(path, os.W_OK):
        raise CourseError(f"{flag} {path} exists and is not writable; pass another file name")
