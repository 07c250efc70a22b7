"""Where runs write: results/ and checkpoints/ in the course directory by default, or under $COURSE_OUTPUT_DIR,
which the test session sets to one of its temporary folders (conftest.py at the top of the course); and the
session's own check that it left the checkout as it found it."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

from helpers import PYTHON, REPO, assert_ok, read_json, run_python, script_env
from kit import output_paths
from machinery import cli, job
from notebook_support import runs


def test_the_default_folders_are_the_course_directorys_unless_course_output_dir_names_another(tmp_path, monkeypatch):
    monkeypatch.delenv("COURSE_OUTPUT_DIR")
    assert cli.default_results_dir() == REPO / "results"
    assert job.checkpoint_folder("step4_ddp") == REPO / "checkpoints" / "step4_ddp"
    assert job.checkpoint_folder("step4_ddp", run_name="mine") == REPO / "checkpoints" / "mine"
    assert cli.build_parser("").parse_args([]).results_dir == REPO / "results"
    monkeypatch.setenv("COURSE_OUTPUT_DIR", str(tmp_path))
    assert cli.default_results_dir() == tmp_path / "results"
    assert job.checkpoint_folder("step4_ddp", run_name="mine") == tmp_path / "checkpoints" / "mine"
    assert cli.build_parser("").parse_args([]).results_dir == tmp_path / "results"
    assert "COURSE_OUTPUT_DIR=FOLDER" in cli.build_parser("").format_help()


def test_paths_are_shown_relative_to_the_output_folder_else_to_the_course(tmp_path, monkeypatch):
    monkeypatch.setenv("COURSE_OUTPUT_DIR", str(tmp_path / "out"))
    assert output_paths.display_path(tmp_path / "out" / "results" / "run.json") == "results/run.json"
    assert output_paths.display_path(REPO / "data" / "mnist5k") == "data/mnist5k"
    assert output_paths.display_path(tmp_path / "elsewhere.pt") == str(tmp_path / "elsewhere.pt")


def session_folder(tmp_path_factory):
    """The session's temporary folder, where conftest.py made its folders: a worker's own lies inside it."""
    folder = tmp_path_factory.getbasetemp()
    return folder.parent if os.environ.get("PYTEST_XDIST_WORKER") else folder


def test_this_session_writes_into_a_temporary_folder_and_the_notebooks_too(tmp_path_factory):
    output = Path(os.environ["COURSE_OUTPUT_DIR"])
    session = session_folder(tmp_path_factory)
    assert output.is_relative_to(session) and not output.is_relative_to(REPO)
    assert runs.OUTPUT == output.resolve() and runs.FIGURES == runs.OUTPUT / "results" / "figs"


def test_what_the_tests_start_keeps_its_temporary_files_in_the_session_folder(tmp_path_factory):
    """torchrun, for one, leaves a torchelastic_* folder in the temporary directory at every launch."""
    done = subprocess.run([PYTHON, "-c", "import tempfile; print(tempfile.gettempdir())"], env=script_env(),
                          capture_output=True, text=True, check=True)
    assert Path(done.stdout.strip()).is_relative_to(session_folder(tmp_path_factory)), done.stdout


def test_a_run_without_output_flags_writes_under_course_output_dir(tmp_path):
    done = run_python("step1_baseline.py", "--epochs", 1, "--max-steps", 1, "--run-name", "plain",
                      env=script_env(COURSE_OUTPUT_DIR=tmp_path))
    assert_ok(done)
    assert read_json(tmp_path / "results" / "plain.json")["script"] == "step1_baseline"
    assert (tmp_path / "checkpoints" / "plain" / "checkpoint-00000001.pt").is_file()
    assert "record written to results/plain.json" in done.stdout


CHECKED_SESSION = '''
import os
from pathlib import Path


def test_writes_into_the_output_folder():
    Path(os.environ["COURSE_OUTPUT_DIR"], "record.json").write_text("{}")


def test_writes_into_the_checkout():
    (Path(__file__).parent / "results").mkdir()
    (Path(__file__).parent / "results" / "record.json").write_text("{}")
'''


def test_a_session_that_writes_into_the_checkout_fails_and_names_what_it_wrote(tmp_path):
    """conftest.py's check, in a copy of it at the top of a made-up checkout with two tests."""
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    shutil.copy(REPO / "conftest.py", checkout / "conftest.py")
    (checkout / "test_session.py").write_text(CHECKED_SESSION)

    # The installed plugins (nbval, xdist, timeout) play no part in the check, which is conftest.py's hooks and
    # pytest's own tmp_path, and loading them is most of a session's start: this session does without them.
    without_plugins = script_env(PYTEST_DISABLE_PLUGIN_AUTOLOAD=1)

    def session(tests, basetemp):
        return subprocess.run([PYTHON, "-m", "pytest", "-p", "no:cacheprovider", "-k", tests,
                               f"--basetemp={tmp_path / basetemp}", "test_session.py"],
                              cwd=checkout, env=without_plugins, capture_output=True, text=True, timeout=300)

    clean = session("output_folder", "clean")
    assert clean.returncode == 0 and "the checkout changed" not in clean.stdout, clean.stdout
    written = session("output_folder or checkout", "written")
    assert written.returncode == 1, written.stdout
    assert "2 passed" in written.stdout and "the checkout changed" in written.stdout
    left = written.stdout.split("New, changed or removed:")[1].split()
    assert left[:2] == ["results", "results/record.json"], written.stdout


def test_make_clean_removes_what_runs_leave_and_keeps_the_workspace(tmp_path):
    """`make clean` in a made-up course directory holding what runs, jobs and Python leave there."""
    course = tmp_path / "course"
    leftovers = ["results/course/step1.json", "checkpoints/step4_ddp/checkpoint-00000001.pt",
                 "ddp04_ddp.o1234", "ddp04_ddp-56.out", ".pbs_job.77/node0", "scripts/__pycache__/x.pyc",
                 "notebooks/.ipynb_checkpoints/00-checkpoint.ipynb", ".pytest_cache/README.md"]
    kept = ["workspace/00_concepts.ipynb", "workspace/.ipynb_checkpoints/00-checkpoint.ipynb", "data/mnist5k/x",
            "scripts/step1_baseline.py", "README.md", ".venv/lib/__pycache__/y.pyc"]
    for name in leftovers + kept:
        (course / name).parent.mkdir(parents=True, exist_ok=True)
        (course / name).write_text("x")
    shutil.copy(REPO / "Makefile", course / "Makefile")
    done = subprocess.run(["make", "--no-print-directory", "clean", f"PY={sys.executable}"], cwd=course,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert not [name for name in leftovers if (course / name).exists()]
    assert [name for name in kept if (course / name).exists()] == kept
