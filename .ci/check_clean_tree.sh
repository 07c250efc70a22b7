#!/usr/bin/env bash
# After the tests: running the course's tests must leave the checkout as CI cloned it.
# - No tracked file changed and no untracked file appeared: a participant would meet it as a
#   conflict on their next `git pull`.
# - No ignored file either, besides the virtual environment and pytest's cache: the tests and the
#   notebooks under nbval write only into pytest's temporary folders (COURSE_OUTPUT_DIR, set by
#   conftest.py), never results/ or checkpoints/ here, which a cluster home directory's quota pays for.
#   (`make test` also keeps Python from writing __pycache__/ folders: PYTHONDONTWRITEBYTECODE=1.)
set -euo pipefail
cd "$(dirname "$0")/.."
changed=$(git status --porcelain --untracked-files=all)
if [[ -n $changed ]]; then
    echo "CI: running the course changed the checkout (git status --porcelain):" >&2
    echo "$changed" >&2
    git --no-pager diff --stat >&2
    exit 1
fi
# Ignored paths, a folder shown once as "!! folder/"; the venv may be a folder or a link to one.
left=$(git status --porcelain --ignored | grep -v -x -E '!! (\.venv/?|\.pytest_cache/)' || true)
if [[ -n $left ]]; then
    echo "CI: the tests left files in the checkout that git ignores (git status --porcelain --ignored):" >&2
    echo "$left" >&2
    exit 1
fi
echo "CI: the checkout is as clean after the tests as before them (ignored files included)"
