"""Durations and the job's clock, for --stop-after: no torch, so that the flags parse before torch loads.
Machinery: a learner may skip this module.
"""
import os
import time
from pathlib import Path

LOADED = time.time()


def duration(text):
    """'90', '1:30' or '1:30:00' (PBS's and Slurm's walltime formats) -> seconds."""
    parts = text.split(":")
    if len(parts) > 3 or not all(part.strip().isdigit() for part in parts):
        raise ValueError(f"{text!r} is not a duration: give seconds, or [[H:]M:]S as in a walltime")
    seconds = 0
    for part in parts:
        seconds = seconds * 60 + int(part)
    if seconds <= 0:
        raise ValueError(f"{text!r}: the duration must be positive")
    return seconds


def clock(seconds):
    """3725 -> '1:02:05'."""
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def job_start():
    """(when the clock of --stop-after started, in words): the job's start if the job scripts said when
    (COURSE_JOB_START, seconds since 1970), else this process's start."""
    text = os.environ.get("COURSE_JOB_START", "")
    try:
        return float(text), "the job started (COURSE_JOB_START)"
    except ValueError:
        return process_start(), "this run started"


def process_start():
    """When this process started, in seconds since 1970 (Linux: /proc; elsewhere: when this module loaded)."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])  # field 22: starttime
        boot = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return LOADED
