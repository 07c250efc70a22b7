"""The course's benchmarks, imported as one package: ``from benchmarks import common, report``.

Each module that is also a command (``python benchmarks/harness.py``) replaces its own folder on ``sys.path`` with
the repository root when it is run as a file, so its neighbours are found only under ``benchmarks.``: a module of
another package named ``common`` or ``report`` can neither shadow them nor be shadowed by them.
"""
