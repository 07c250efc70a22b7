"""How a problem the user can fix reaches them. Kit: a learner may skip this module.

A ``CourseError`` is printed as one line that names the fix, with exit status 1 (``cli.run``),
never as a traceback.
"""


class CourseError(Exception):
    """A problem the user can fix: printed as one line, exit status 1."""


def first_line(error):
    """The first line of an exception's message (C++ errors carry a stack trace after it)."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
