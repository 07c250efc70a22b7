"""A participant's route: `make workspace`, work in the copies, `git pull` the course's updates.

The test plays both sides with real git: a course repository (the Makefile, .gitignore and a
notebook of this checkout, committed), and a participant's clone of it. The participant makes
the workspace and edits a notebook there; the course changes that notebook and adds another;
the participant pulls. The pull must not conflict, the edit must survive, and `git status`
must stay empty; `make workspace` then adds the new notebook and keeps the edited one.
"""
import json
import shutil
import subprocess

import pytest

from helpers import REPO

GIT_IDENTITY = ["-c", "user.name=Course", "-c", "user.email=course@example.org"]


def git(folder, *args):
    done = subprocess.run(["git", *GIT_IDENTITY, *args], cwd=folder, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"git {' '.join(args)}: {done.stdout}{done.stderr}"
    return done.stdout


def make(folder, target):
    done = subprocess.run(["make", "--no-print-directory", target], cwd=folder, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def add_cell(path, source):
    notebook = json.loads(path.read_text())
    notebook["cells"].append({"cell_type": "code", "execution_count": None, "id": f"cell{len(notebook['cells'])}",
                              "metadata": {}, "outputs": [], "source": source})
    path.write_text(json.dumps(notebook, indent=1) + "\n")


@pytest.fixture
def course(tmp_path):
    """The course's repository: this checkout's Makefile and .gitignore, and notebook 00."""
    if shutil.which("git") is None or shutil.which("make") is None:
        pytest.skip("needs git and make")
    upstream = tmp_path / "course"
    (upstream / "notebooks").mkdir(parents=True)
    for name in ("Makefile", ".gitignore"):
        shutil.copy(REPO / name, upstream / name)
    shutil.copy(REPO / "notebooks" / "00_concepts.ipynb", upstream / "notebooks")
    git(upstream, "init", "-q", "-b", "main")
    git(upstream, "add", "-A")
    git(upstream, "commit", "-q", "-m", "the course")
    return upstream


def test_a_pull_never_conflicts_with_work_in_the_workspace(course, tmp_path):
    mine = tmp_path / "participant"
    git(tmp_path, "clone", "-q", str(course), str(mine))

    said = make(mine, "workspace")
    assert "copied   workspace/00_concepts.ipynb" in said
    my_copy = mine / "workspace" / "00_concepts.ipynb"
    add_cell(my_copy, "answer = 42  # my own work")
    assert git(mine, "status", "--porcelain") == ""  # git does not see the workspace at all

    # The course changes the same notebook, and adds one.
    add_cell(course / "notebooks" / "00_concepts.ipynb", "print('a fix from the course')")
    shutil.copy(REPO / "notebooks" / "01_baseline.ipynb", course / "notebooks")
    git(course, "add", "-A")
    git(course, "commit", "-q", "-m", "a course update")

    git(mine, "pull", "-q", "--ff-only")
    assert "a fix from the course" in (mine / "notebooks" / "00_concepts.ipynb").read_text()
    assert "my own work" in my_copy.read_text()
    assert git(mine, "status", "--porcelain") == ""

    said = make(mine, "workspace")
    assert "copied   workspace/01_baseline.ipynb" in said  # the new notebook arrives
    assert "kept     workspace/00_concepts.ipynb" in said and "my own work" in my_copy.read_text()


def test_the_workspace_sits_beside_the_notebooks_so_their_imports_work():
    # Every notebook finds the course's scripts from its own folder: ../scripts.
    for path in sorted((REPO / "notebooks").glob("0[0-4]*.ipynb")):
        first_code = next("".join(cell["source"]) for cell in json.loads(path.read_text())["cells"]
                          if cell["cell_type"] == "code")
        assert 'pathlib.Path.cwd().parent / "scripts"' in first_code, path.name
    assert subprocess.run(["git", "check-ignore", "-q", "workspace/00_concepts.ipynb"], cwd=REPO).returncode == 0
