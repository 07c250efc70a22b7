"""What the notebooks use: running scripts from a cell (``runner``) and the checks of the exercises
(``exercises``). Notebook support: a learner may skip this module."""
