"""The usual wrong answers to the exercises whose checks run the participant's code in real processes: one module
per notebook (nb02.py for 02_allreduce_by_hand.ipynb). Each module names its EXERCISE ("02.3") and lists its MISTAKES:
(the answers, as the participant's cell would define them; a phrase the check's one-line hint must contain).
test_exercises_in_processes.py runs the solution and every mistake in one torchrun per exercise.
"""
