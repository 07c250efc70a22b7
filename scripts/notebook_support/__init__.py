"""What the notebooks use: running scripts from a cell (``runs``), the stacks of hung ranks (``rank_stacks``) and
the checks of the exercises (``exercises``, one module per notebook). Notebook support: a learner may skip this
module."""
