"""The code's layout: a lesson path a learner can read in one sitting, a kit and machinery that say they may be
skipped, imports that run one way (steps -> machinery -> lesson -> kit), and no import that runs from the library up
to an entry script."""
import ast
import re
import subprocess
import sys

from helpers import PYTHON, REPO, SCRIPTS, assert_ok, script_env

STEPS = ["step1_baseline.py", "step2_allreduce.py", "step3_data_parallel.py", "step4_ddp.py"]
LIBRARY = ["kit", "lesson", "machinery", "notebook_support"]
# What each library layer may import of the course, besides itself: imports run one way, from the steps down.
# The kit never imports the lesson (lesson/loop.py imports the kit at its top: that would be an import cycle),
# and the lesson never imports the machinery that a job adds around it.
# notebook_support serves the notebooks, which show the lesson: it may import the lesson too.
MAY_IMPORT = {"kit": set(), "lesson": {"kit"}, "machinery": {"lesson", "kit"}, "notebook_support": {"lesson", "kit"}}
SKIP_MARK = "a learner may skip this module"
LESSON_PATH_MAX_LINES = 700


def module_file(name):
    """The file of module ``name`` under scripts/, or None for a module outside the course."""
    path = SCRIPTS.joinpath(*name.split("."))
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def imported_names(path):
    """Every module name ``path`` imports, with each ``from X import y`` also as X.y (y may be a module)."""
    package = path.parent.relative_to(SCRIPTS).parts
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1] + ((base,) if base else ()))
            yield base
            yield from (f"{base}.{alias.name}" for alias in node.names)


def imported_files(path):
    for name in imported_names(path):
        parts = name.split(".")
        for end in range(1, len(parts) + 1):  # a package's __init__ runs before its modules
            found = module_file(".".join(parts[:end]))
            if found is not None:
                yield found


def import_closure(files):
    seen, todo = set(), list(files)
    while todo:
        path = todo.pop()
        if path not in seen:
            seen.add(path)
            todo.extend(imported_files(path))
    return seen


def opening(path):
    """The first paragraph of a module's docstring, on one line."""
    docstring = ast.get_docstring(ast.parse(path.read_text())) or ""
    return " ".join(docstring.split("\n\n")[0].split())


def lines(path):
    return len(path.read_text().splitlines())


def test_the_lesson_path_of_the_four_steps_reads_in_one_sitting():
    """The four steps and what they import that does not say it may be skipped: the lesson package. The kit
    they stand on (scripts/kit/, a data set, a checkpoint file, autocast: one line each in the lesson) is skipped
    like torch itself, so it is not counted."""
    closure = import_closure([SCRIPTS / step for step in STEPS])
    lesson = sorted(path for path in closure if SKIP_MARK not in opening(path))
    total = sum(lines(path) for path in lesson)
    listing = ", ".join(f"{path.relative_to(SCRIPTS)} {lines(path)}" for path in lesson)
    assert total <= LESSON_PATH_MAX_LINES, f"the lesson path has {total} lines: {listing}"
    # The lesson path is the steps and the lesson package: everything else they import says it may be skipped.
    assert {path.relative_to(SCRIPTS).parts[0] for path in lesson} <= {"lesson", *STEPS}, listing


def test_the_kit_machinery_and_notebook_support_say_a_learner_may_skip_them_and_the_lesson_does_not():
    for folder in LIBRARY:
        for path in sorted((SCRIPTS / folder).rglob("*.py")):
            says_skip = SKIP_MARK in opening(path)
            assert says_skip == (folder != "lesson"), f"{path.relative_to(REPO)}: {opening(path)}"


def layer_violations(folder):
    """'file imports file' for each import of a module in ``folder`` that its layer may not make."""
    allowed = MAY_IMPORT[folder] | {folder}
    for path in sorted((SCRIPTS / folder).rglob("*.py")):
        for imported in imported_files(path):
            layer = imported.relative_to(SCRIPTS).parts[0]
            if layer in LIBRARY and layer not in allowed:
                yield f"{path.relative_to(REPO)} imports {imported.relative_to(REPO)}"


def test_imports_run_one_way_from_the_steps_down_to_the_kit():
    for folder in LIBRARY:
        assert list(layer_violations(folder)) == [], f"{folder}/ may import only {sorted(MAY_IMPORT[folder])}"


def test_the_layer_check_finds_an_import_against_the_rule(tmp_path, monkeypatch):
    """A kit module that imports the lesson is found: the check above can fail."""
    planted = tmp_path / "scripts"
    for folder in LIBRARY:
        (planted / folder).mkdir(parents=True)
    (planted / "lesson" / "loop.py").write_text("from kit import checkpoints\n")
    (planted / "kit" / "checkpoints.py").write_text("from lesson.loop import Trainer\n")
    monkeypatch.setattr(sys.modules[__name__], "SCRIPTS", planted)
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    assert "scripts/kit/checkpoints.py imports scripts/lesson/loop.py" in list(layer_violations("kit"))
    assert list(layer_violations("lesson")) == []


def test_no_library_module_imports_an_entry_script():
    """Entry scripts (the steps, the demos, the tools) import the library, never the other way."""
    for folder in LIBRARY:
        for path in sorted((SCRIPTS / folder).rglob("*.py")):
            for imported in imported_files(path):
                top = imported.relative_to(SCRIPTS).parts[0]
                assert top in LIBRARY, f"{path.relative_to(REPO)} imports {imported.relative_to(REPO)}"


def test_no_script_imports_torchvision_before_it_reads_a_data_set():
    """torchvision, and the thousand modules it imports (torch._dynamo among them), come in where a data set is read
    or a ResNet-18 built (kit/datasets.py, more_models.py): the doctor and the demos that read none start
    without them. Every step, demo and tool imported in one process: none of them has imported either."""
    entries = [path.stem for path in sorted(SCRIPTS.glob("step*.py"))] + [
        f"{folder}.{path.stem}" for folder in ("demos", "tools")
        for path in sorted((SCRIPTS / folder).glob("[!_]*.py"))]
    code = "import sys\n" + "".join(f"import {name}\n" for name in entries) + (
        "print(*(name for name in ('torchvision', 'torch._dynamo') if name in sys.modules))")
    done = subprocess.run([PYTHON, "-c", code], cwd=REPO, env=script_env(PYTHONPATH=SCRIPTS), capture_output=True,
                          text=True, timeout=300)
    assert_ok(done)
    assert done.stdout.strip() == "", f"imported: {done.stdout.strip()}"


def test_nothing_is_called_by_a_name_built_at_run_time():
    """Demos and callbacks are called from tables and by their names, never through globals()."""
    for path in sorted(SCRIPTS.rglob("*.py")):
        assert "globals()" not in path.read_text(), path.relative_to(REPO)


def test_the_step_scripts_list_in_course_order():
    steps = sorted(path.name for path in SCRIPTS.glob("step*.py"))
    numbers = [re.match(r"step(\d+)([a-z]?)_", name).groups() for name in steps]
    assert numbers == sorted(numbers, key=lambda n: (int(n[0]), n[1])), steps
    assert set(STEPS) <= set(steps)


def test_the_readme_describes_the_layout_that_is_there():
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("## How the code is organised"):]
    section = section[:section.index("\n## ", 1)]
    folders = sorted(path.name for path in SCRIPTS.iterdir() if path.is_dir() and not path.name.startswith("__"))
    assert folders == ["demos", "kit", "lesson", "machinery", "notebook_support", "tools"]
    for folder in folders:
        assert f"  {folder}/" in section, folder
    for path in SCRIPTS.glob("step*.py"):
        assert path.name in section or path.name.split("_")[0] in section, path.name


def test_ruff_finds_nothing_to_fix():
    """The rules pyproject.toml configures (pyflakes, pycodestyle at 120 columns, sorted imports) hold everywhere:
    scripts, tests, benchmarks and the notebooks' code cells. --no-cache: the check writes nothing."""
    done = subprocess.run([PYTHON, "-m", "ruff", "check", "--no-cache", "."], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
