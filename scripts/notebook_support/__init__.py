"""What the notebooks use: running scripts from a cell (``runs``), the stacks of hung ranks (``rank_stacks``, and
``usr2_stacks`` for the SIGUSR2 dump), the launcher's plan for a made-up job (``launch_plans``), the drawings of
notebooks 00 and 01 (``concept_figures``, ``pin_memory_figure``) and the checks of the exercises (``exercises``, one
module per notebook). Notebook support: a learner may skip this module."""
