"""The demos: short distributed programs that show one mechanism each, run from the notebooks
(``torchrun --nproc-per-node=2 scripts/demos/<name>.py``). ``runner.py`` holds what they share."""
