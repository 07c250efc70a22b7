"""The checkpoint file: what it holds, written atomically, read back exactly. Kit: a learner may skip
this module (notebook 05 teaches it).

A checkpoint is one file, ``checkpoint-<global step>.pt`` in the run's checkpoint
folder, holding everything the next step depends on:

- the plain model's weights (never the DDP wrapper's: no ``module.`` prefix), the
  optimizer, the learning-rate schedule and the gradient scaler;
- where the run is: the epoch, the batches of it already trained, the global step;
- every rank's random state (dropout masks differ per rank, so each rank's stream is
  saved and given back to the same rank), and the state of a baseline's shuffling
  generator at the start of the epoch (a DistributedSampler needs none: its order is a
  function of seed and epoch);
- what the run has logged so far, so the final record covers every epoch.

Rank 0 writes it atomically: into a temporary file in the same folder, flushed and
fsync'ed, then renamed over the final name with ``os.replace`` (a rename within one
file system either happens whole or not at all). A crash at any moment leaves the
previous checkpoint as it was, and a write that fails (a full disk, a quota) removes its
temporary file before the error goes on. The newest few are kept.

Every rank reads it with ``map_location`` set to its own device (a checkpoint written
on cuda:0 would otherwise load onto cuda:0 in every process) and ``weights_only=True``
(unpickling arbitrary objects can run arbitrary code).
"""
import errno
import io
import os
import re
import shutil
import zipfile
from pathlib import Path

import torch

from .errors import CourseError, first_line
from .output_paths import display_path

FORMAT = "ddp-course checkpoint 1"
NAME = re.compile(r"checkpoint-(\d{8})\.pt")

# What must match between a checkpoint and the run that resumes it: with any of these
# changed, the continued run is not the run that was interrupted.
MUST_MATCH = ("model", "dataset", "world_size", "batch_size", "accumulate", "optimizer", "seed", "precision",
              "trainable_parameters")


def file_name(global_step):
    return f"checkpoint-{global_step:08d}.pt"


def checkpoints_in(folder):
    """The checkpoint files of ``folder``, oldest first (by global step)."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    found = [(int(match.group(1)), path) for path in folder.iterdir() if (match := NAME.fullmatch(path.name))]
    return [path for _, path in sorted(found)]


def write_atomically(state, path):
    """Write ``state`` to ``path`` so that ``path`` is either the old file or the whole new one."""
    path = Path(path)
    data = serialize(state)
    temporary = temporary_path(path)
    try:
        with open(temporary, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())  # the bytes are on disk before the name points at them
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)  # a half-written file would keep a full disk full
        raise
    sync_folder(path.parent)  # and the rename itself survives a power cut


def serialize(state):
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getbuffer()


def temporary_path(path):
    """Where ``write_atomically`` writes before the rename: in the same folder (a rename across file
    systems is a copy), named after this process so that two writers never share one."""
    return path.with_name(f".{path.name}.partial-{os.getpid()}")


def sync_folder(folder):
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    except OSError:
        pass  # some file systems cannot fsync a directory; the rename is still atomic
    finally:
        os.close(descriptor)


def prune(folder, keep):
    """Delete all but the newest ``keep`` checkpoints."""
    for path in checkpoints_in(folder)[:-keep]:
        path.unlink(missing_ok=True)


def remove_partials(folder):
    """Delete the temporary files that writers killed mid-write left (``--fault crash-in-save``, a node lost).
    Called by the run that holds the folder (machinery/folder_lock.py): no other writer can be at work there."""
    for partial in Path(folder).glob(".checkpoint-*.partial-*"):
        partial.unlink(missing_ok=True)


# Copies of the weights a checkpoint holds: the weights, and the optimizer's state per parameter (Adam and
# Adadelta keep two tensors per parameter, SGD with momentum one).
COPIES = {"adam": 3, "adadelta": 3, "sgd": 2}


def estimated_bytes(model, optimizer):
    """About the size of a checkpoint of ``model`` trained with ``optimizer`` (its name)."""
    weights = sum(tensor.numel() * tensor.element_size() for tensor in model.state_dict().values())
    return COPIES.get(optimizer, 3) * weights


def megabytes(count):
    return f"{count / 2**20:,.1f} MiB"


def check_room(folder, size, at_once, keep, replaced=()):
    """Stop before training unless ``folder`` has room for ``at_once`` checkpoints of ``size`` bytes at once, counting
    those it holds but not the ``replaced`` ones (prune removes the oldest only after the newest is written; the
    first write needs a whole one). Free space as the file system reports it (statvfs): a user's or project's quota
    shows only when a write fails."""
    existing = sum(path.stat().st_size for path in checkpoints_in(folder) if path not in replaced)
    freed = sum(path.stat().st_size for path in replaced)
    free = shutil.disk_usage(folder).free + freed
    needed = max(size, at_once * size - existing) if at_once else 0
    if free < needed:
        fewer = f", keep fewer (--keep-checkpoints, now {keep})" if 1 < keep < at_once else ""
        which = f"the {keep} it keeps and the next" if at_once > keep else "every one it writes"
        raise CourseError(f"--checkpoint-dir {display_path(folder)} has {megabytes(free)} free, and this run needs "
                          f"about {megabytes(needed)} more there: {at_once} checkpoint(s) of {megabytes(size)} at "
                          f"once ({which}): put --checkpoint-dir on a file system with room (a scratch folder)"
                          f"{fewer}, or free space there")


def write_failed(error, path, size, keep):
    """The one line for a checkpoint that could not be written (no space, a quota, any OS error)."""
    folder = Path(path).parent
    try:
        free = megabytes(shutil.disk_usage(folder).free)
    except OSError:
        free = "unknown space"
    newest = checkpoints_in(folder)
    resume = f"the newest, {newest[-1].name}, is the one to resume from" if newest else "no earlier one is there"
    fewer = f" or keep fewer (--keep-checkpoints, now {keep})" if keep > 1 and len(newest) > 1 else ""
    space = f"it needs about {megabytes(size)} and {free} is free there"
    if error.errno == errno.EDQUOT:  # statvfs's free space does not show a user's or project's quota
        space = f"it needs about {megabytes(size)} more than your quota there allows (quota -s, lfs quota)"
    return CourseError(f"could not write checkpoint {path.name} into {display_path(folder)} "
                       f"({error.strerror or error}): {space}; put --checkpoint-dir on a file system with room (a "
                       f"scratch folder){fewer}. Nothing of it was left; {resume}")


def read(path, device):
    """Load a checkpoint onto this process's device, or fail with one line that says why."""
    path = Path(path)
    if not path.is_file():
        raise CourseError(f"checkpoint {path} does not exist; check --resume, and keep --checkpoint-dir on a file "
                          f"system that every node sees") from None
    damaged = (f"checkpoint {path} cannot be read: it is truncated or corrupt. It was kept; move it out of the "
               f"folder to resume from the one before it, or start again with another --checkpoint-dir")
    if not zipfile.is_zipfile(path):  # torch.save writes a zip archive; a cut-off one has no central directory
        raise CourseError(damaged)
    try:
        state = torch.load(path, map_location=device, weights_only=True)
    except (RuntimeError, EOFError, zipfile.BadZipFile, OSError) as error:
        raise CourseError(f"{damaged} ({first_line(error)})") from None
    except Exception:  # weights_only refuses to unpickle arbitrary objects
        state = None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CourseError(f"{path} is not a checkpoint of this course (a --save weights file, or another program's?); "
                          f"--resume needs a file that a course script wrote into its --checkpoint-dir")
    return state


def differences(saved, current):
    """'world_size 2 -> 4, model net -> resnet18' for each setting that must match but does not."""
    return ", ".join(f"{key} {saved.get(key)} -> {current.get(key)}" for key in MUST_MATCH
                     if saved.get(key) != current.get(key))


def rng_state(device):
    """This process's random streams: the CPU's, and its GPU's when it has one."""
    return {"cpu": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None}


def restore_rng_state(state, device):
    torch.set_rng_state(state["cpu"].cpu())  # map_location moved it to the device; RNG states live on the CPU
    if device.type == "cuda" and state.get("cuda") is not None:
        torch.cuda.set_rng_state(state["cuda"].cpu(), device)


def save_weights(model, path):
    """The final weights alone, as a plain state_dict: what `torch.load` + `load_state_dict` expects."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(model.state_dict(), path)


def load_weights(model, path, device):
    """Load weights saved by ``save_weights`` onto this process's own device."""
    model.load_state_dict(torch.load(path, map_location=device, weights_only=True))
