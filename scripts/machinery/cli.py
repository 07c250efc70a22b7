"""The command line shared by every training script, and how errors reach the user. Machinery: a learner may skip this
module (``--help`` lists every flag).
"""
import argparse
import os
import sys
from pathlib import Path

from kit.errors import CourseError, first_line
from kit.output_paths import OUTPUT_DIR_VARIABLE, REPO, output_dir

from . import signals
from .walltime import duration

DEFAULT_DATA_DIR = REPO / "data"
OUTPUT_HELP = f"""environment:
  {OUTPUT_DIR_VARIABLE}=FOLDER  the default results/ and checkpoints/ go under FOLDER instead of the course
                            directory, and paths under it are printed relative to it (the test suite
                            sets it to a temporary folder, so that no test writes into the checkout)"""


def default_results_dir():
    """Where a run's JSON record goes without --results-dir: results/ in the output folder."""
    return output_dir() / "results"


def positive_int(text):
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def positive_float(text):
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


def time_budget(text):
    try:
        return duration(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def build_parser(description):
    parser = argparse.ArgumentParser(
        description=description, epilog=OUTPUT_HELP, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    data = parser.add_argument_group("data and model")
    data.add_argument("--dataset", default="mnist5k",
                      help="mnist5k (bundled, offline; default), mnist or cifar10 (download first), synthetic-cifar10 "
                           "(CIFAR-shaped, made up in memory), imagefolder (--data-dir with train/ and val/)")
    data.add_argument("--data-dir", type=Path, default=DEFAULT_DATA_DIR,
                      help="where the data sets live (default: data/)")
    data.add_argument("--model", default="net",
                      help="net: the two-conv MNIST network (default); net-bn: the same with BatchNorm; "
                           "resnet18: torchvision's; resnet18-cifar: with the CIFAR stem")
    data.add_argument("--no-dropout", dest="dropout", action="store_false",
                      help="turn the Net's dropout off (exact comparisons need it off)")
    data.add_argument("--sync-bn", action="store_true",
                      help="SyncBatchNorm: BatchNorm layers normalise with the statistics of the global batch, "
                           "not this rank's")
    data.add_argument("--loader", choices=["auto", "tensor", "dataloader"], default="auto",
                      help="tensor: whole data set in memory, batches by indexing; dataloader: per-sample transforms; "
                           "auto (default): tensor, but dataloader for an ImageFolder")
    data.add_argument("--workers", type=int, default=0, help="DataLoader worker processes (dataloader route only)")
    data.add_argument("--pin-memory", action="store_true",
                      help="pin host memory for faster copies to the GPU (dataloader route)")

    train = parser.add_argument_group("training")
    train.add_argument("--epochs", type=positive_int, default=3)
    train.add_argument("--batch-size", type=positive_int, default=64,
                       help="per process (the global batch is this times the world size)")
    train.add_argument("--eval-batch-size", type=positive_int, default=500)
    train.add_argument("--optimizer", choices=["adadelta", "adam", "sgd"], default="adam")
    train.add_argument("--lr", type=positive_float, default=None,
                       help="learning rate (default: 1.0 for adadelta, 2e-3 for adam, 0.05 for sgd)")
    train.add_argument("--gamma", type=positive_float, default=0.7, help="learning-rate decay per epoch (StepLR)")
    train.add_argument("--lr-scaling", choices=["none", "linear"], default="none",
                       help="linear: multiply --lr by the global batch / --batch-size, the linear scaling rule of "
                            "Goyal et al. 2017 (arXiv:1706.02677), so every world size gets its rate from one command "
                            "line; none (default): --lr as given")
    train.add_argument("--warmup-steps", type=int, default=0, metavar="N",
                       help="with --lr-scaling linear: start at the unscaled rate and rise linearly to the scaled one "
                            "over the first N optimizer steps (default 0: no warm-up)")
    train.add_argument("--max-steps", type=positive_int, default=None,
                       help="stop each epoch after this many steps (for short runs)")
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--train-through-nan", action="store_true",
                       help="train on when the loss becomes NaN or infinite, to watch a divergence (by default every "
                            "rank stops one step later, or at a checkpoint due sooner, with one line); checkpoints of "
                            "non-finite values are never written")

    where = parser.add_argument_group("device and processes")
    where.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                       help="auto: cuda:LOCAL_RANK when a GPU is present, else cpu")
    where.add_argument("--backend", choices=["auto", "gloo", "nccl"], default="auto",
                       help="auto: nccl with CUDA, gloo on CPU")
    where.add_argument("--threads", type=positive_int, default=None,
                       help="CPU threads per process (default: the cores this job may use / processes on this node)")
    where.add_argument("--timeout", type=positive_int, default=300,
                       help="seconds a collective may wait before the run fails")

    train.add_argument("--accumulate", type=positive_int, default=1,
                       help="batches per optimizer step (gradient accumulation; "
                            "DDP skips the all_reduce on all but the last)")
    train.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default="fp32",
                       help="fp32 (default); bf16 autocast (CPU or GPU); "
                            "fp16 autocast with a gradient scaler (GPU only)")

    out = parser.add_argument_group("output")
    out.add_argument("--results-dir", type=Path, default=default_results_dir(),
                     help=f"where the JSON record goes (default: results/, in ${OUTPUT_DIR_VARIABLE} if set)")
    out.add_argument("--run-name", default=None,
                     help="file name of the JSON record (default: <script>-w<world size>-<time>)")
    out.add_argument("--save", type=Path, default=None,
                     help="write the final weights here (rank 0; the plain model, no 'module.' prefix)")
    out.add_argument("--peak-tflops", type=positive_float, default=None,
                     help="the device's peak TFLOP/s, for MFU where it is not in the built-in table")

    ckpt = parser.add_argument_group("checkpoints and restarts")
    ckpt.add_argument("--checkpoint-dir", type=Path, default=None,
                      help=f"where checkpoints go (default: checkpoints/<run name, else script name>/, in "
                           f"${OUTPUT_DIR_VARIABLE} if set)")
    ckpt.add_argument("--checkpoint-every", type=positive_int, default=None, metavar="N",
                      help="also checkpoint every N optimizer steps (always: at the end of each epoch)")
    ckpt.add_argument("--keep-checkpoints", type=positive_int, default=3, metavar="K",
                      help="keep the newest K (default 3)")
    ckpt.add_argument("--resume", nargs="?", const="latest", default=None, metavar="FILE",
                      help="continue from the newest checkpoint in --checkpoint-dir if there is one, else start fresh "
                           "(or from FILE); a run restarted by torchrun always resumes")
    ckpt.add_argument("--start-over", action="store_true",
                      help="start a fresh run even where --checkpoint-dir holds an unfinished one: its checkpoints are "
                           "moved aside into a folder of their own there, never deleted")

    stop = parser.add_argument_group(
        "stopping early with nothing lost (SIGTERM, SIGINT, SIGUSR1, a STOP file in --checkpoint-dir, or --stop-after: "
        "every rank stops after the same step, with a checkpoint of it)")
    stop.add_argument("--stop-after", type=time_budget, default=None, metavar="DURATION",
                      help="stop with a checkpoint before this much time has passed since the job started "
                           "(COURSE_JOB_START, which the job scripts set) or, without it, since this run started: "
                           "seconds or [[H:]M:]S, e.g. the job's walltime")
    stop.add_argument("--stop-margin", type=positive_float, default=30.0, metavar="SECONDS",
                      help="with --stop-after: seconds kept free at the end for the processes to exit and the job "
                           "to submit its follow-up (default 30)")
    stop.add_argument("--grace-period", type=positive_float, default=None, metavar="SECONDS",
                      help="the seconds a scheduler waits between its stop signal and SIGKILL (PBS: kill_delay; "
                           "Slurm: KillWait); checked before training against the time a checkpoint takes")

    drill = parser.add_argument_group("fault drills (to see restarts, timeouts and resumes happen)")
    drill.add_argument("--fault",
                       choices=["kill", "exit", "stall", "crash-in-save", "disk-full", "sigterm", "sigint",
                                "sigterm-rank"],
                       default=None,
                       help="kill: SIGKILL this rank; exit: exit with status 3; stall: sleep --fault-seconds; "
                            "crash-in-save: SIGKILL rank 0 halfway through writing a checkpoint; disk-full: rank 0 "
                            "fills the checkpoint folder's file system just before writing one; sigterm, sigint: "
                            "send SIGTERM (as a scheduler does) or SIGINT (Ctrl-C) to torchrun, or without it to "
                            "this process, so that the run stops after the next step with a checkpoint; "
                            "sigterm-rank: SIGTERM to this rank alone. "
                            "Only in a run's first attempt: a group torchrun restarts does not repeat it "
                            "(but see --fault-every-attempt)")
    drill.add_argument("--fault-rank", type=int, default=0, help="the rank the fault hits (default 0)")
    drill.add_argument("--fault-step", type=positive_int, default=1,
                       help="the optimizer step after which it hits (default 1)")
    drill.add_argument("--fault-seconds", type=positive_float, default=3600.0, help="how long a stall lasts")
    drill.add_argument("--fault-every-attempt", action="store_true",
                       help="strike in every attempt but the last that torchrun's --max-restarts allows, each one "
                            "step later than the attempt before (--fault-step + the restart count)")
    return parser


def parse_args(argv=None, description=None, add_arguments=None):
    """Parse the shared flags, plus any a script adds through ``add_arguments(parser)``."""
    parser = build_parser(description)
    if add_arguments is not None:
        add_arguments(parser)
    args = parser.parse_args(argv)
    from kit.datasets import LOADER_ONLY  # imported here: --help needs no torch

    if args.loader == "auto":
        args.loader = "dataloader" if args.dataset in LOADER_ONLY else "tensor"
    elif args.loader == "tensor" and args.dataset in LOADER_ONLY:
        parser.error(f"--dataset {args.dataset} needs --loader dataloader: its images differ in size, and every "
                     f"epoch crops them afresh from the originals")
    if args.workers < 0:
        parser.error("--workers must be 0 or more")
    if args.fault_rank < 0:
        parser.error("--fault-rank must be 0 or more")
    if args.warmup_steps < 0:
        parser.error("--warmup-steps must be 0 or more")
    if args.warmup_steps and args.lr_scaling == "none":
        parser.error("--warmup-steps ramps the learning rate up to the rate --lr-scaling gives: add --lr-scaling "
                     "linear, or drop --warmup-steps")
    if args.start_over and args.resume:
        parser.error("--start-over and --resume exclude each other: --resume continues the run in --checkpoint-dir, "
                     "--start-over starts a fresh one there (moving its checkpoints aside)")
    return args


def run(main, argv=None, *, description=None, add_arguments=None, parse=None):
    """Parse the flags once, then run ``main(args)`` so that a CourseError, or a collective that failed, is one
    line on stderr and exit status 1, never a traceback. ``parse(argv)`` is the script's own parser, if it has
    one; else the shared flags (``parse_args``) with ``description`` and ``add_arguments``. Before ``main``: a
    printed line leaves in one write (write_whole_lines), signals only ask for a graceful stop (signals.py),
    the ranks meet before init_process_group (kit/launch_checks.py)."""
    import torch.distributed as dist

    from kit import launch_checks

    from . import folder_lock, stragglers

    write_whole_lines()
    signals.install_handlers()
    args = parse(argv) if parse else parse_args(argv, description=description, add_arguments=add_arguments)
    signals.set_grace(getattr(args, "grace_period", None))  # a script's own parser may not have the flag
    try:
        launch_checks.meet_before_init(args.timeout, signals.stop_signal)
        main(args)
    except signals.Stopped as stopped:
        signals.finish(stopped)
    except CourseError as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        sys.exit(1)
    except RuntimeError as error:
        if launch_checks.is_stale_restart_store(error):
            print(f"error: {launch_checks.STALE_STORE_HINT}", file=sys.stderr, flush=True)
            sys.exit(1)
        if not is_collective_failure(error):
            raise
        explained = stragglers.explain(error) if int(os.environ.get("WORLD_SIZE", "1")) > 1 else None
        rank = os.environ.get("RANK", "0")
        reason = explained or (f"rank {rank}: a collective failed ({first_line(error)}); "
                               f"if another rank stalled or died, its log says why")
        print(f"error: {reason}", file=sys.stderr, flush=True)
        sys.exit(1)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    finally:
        folder_lock.release_all()  # the checkpoint folder, whatever ended the run
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        # main's frame can outlive main in a reference cycle (torch.fx.wrap keeps its caller's frames when torchvision
        # or torch._dynamo is imported inside main), and with it the model and its process group: free them now, so
        # that the group's gloo threads end before the interpreter's shutdown (tests/test_teardown.py says why).
        import gc  # here, below main: notebook 09's stored stacks show main's line in this file

        gc.collect()


def write_whole_lines(*streams):
    """Each line printed to ``streams`` (this process's own stdout and stderr by default) leaves in one write.
    Under PYTHONUNBUFFERED=1, which many containers and job environments set, print() writes a line's text and
    its newline in two calls, and a line of another rank, writing to the same log, can land between them: two
    ranks' errors then read as one line. Line buffering keeps output as prompt (a line is written when it ends)
    and keeps a line whole (up to 8 KiB; a pipe keeps writes of up to 4 KiB whole, far above an error line).
    sys.__stdout__ and sys.__stderr__, not sys.stdout: a test's or a notebook's stand-in is left as it is."""
    for stream in streams or (sys.__stdout__, sys.__stderr__):
        if stream is not None:  # None: a process started without that stream
            stream.reconfigure(line_buffering=True, write_through=False)


def is_collective_failure(error):
    """A collective that failed because a peer stalled or died (stragglers.py), or one that gloo failed because an
    earlier collective on the same connection timed out: the graceful stop's agreement at a step boundary
    (graceful_stop.py) is often the first to wait for a stalled rank, and the step's own collective then fails
    with "Application timeout caused pair closure"."""
    from . import stragglers

    return stragglers.is_collective_failure(error) or "Application timeout caused pair closure" in str(error)
