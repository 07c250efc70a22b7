# The course's two commands, `make run` and `make test`, plus what maintainers need.
# Both create the virtual environment first when it is missing (pip, pinned versions).
# With a conda environment already active (environment.yml), pass PY=python to use it.

VENV   := .venv
PY     ?= $(VENV)/bin/python
# The venv is a prerequisite only when PY is the venv's own python.
ENV    := $(if $(filter $(VENV)/bin/python,$(PY)),$(VENV)/.installed)
NBVAL  := --nbval --nbval-current-env --nbval-sanitize-with notebooks/sanitize.cfg --nbval-cell-timeout=600
# Three test files at a time (pytest-xdist), each file whole in one worker so that its module fixtures run once.
# Many tests wait (on a scheduler, a --timeout drill, a stalled rank); on 2 cores a third worker keeps both cores
# busy meanwhile. The longest files go first (conftest.py, LONGEST_FIRST). PARALLEL= runs them one after the other.
PARALLEL ?= -n 3 --dist loadfile --no-loadscope-reorder
# The Jupyter kernel the notebooks ask for (their kernelspec), registered by `make kernel`.
KERNEL := ddp-course
# Executing a notebook (nbconvert runs it in its own folder): this environment's kernel, and no per-run
# timestamps stored in the cells.
EXECUTE := -m jupyter nbconvert --to notebook --execute --ExecutePreprocessor.kernel_name=python3 \
	--ExecutePreprocessor.record_timing=False

.PHONY: run test test-fast notebooks workspace kernel figures benchmark gpu-check clean

$(VENV)/.installed: requirements.txt
	python3 -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet -r requirements.txt
	touch $@

## run: the whole course path (one process, all_reduce by hand, DataParallel, DDP) and a table
run: $(ENV)
	$(PY) scripts/tools/run_course.py

## test: the test suite and every notebook under strict nbval. Everything they write goes to pytest's
## temporary folders (COURSE_OUTPUT_DIR, set by conftest.py); the session fails if it wrote into the checkout.
## PYTEST_ARGS passes options on (e.g. PYTEST_ARGS="-x --durations=20").
test: $(ENV)
	PYTHONDONTWRITEBYTECODE=1 $(PY) -m pytest $(NBVAL) $(PARALLEL) $(PYTEST_ARGS) tests notebooks

## test-fast: the in-process tests and the lesson's short runs, under 3 minutes on 2 cores: no notebook and no
## test marked slow (the drills, hangs, jobs and ResNet-18 runs; see pyproject.toml)
test-fast: $(ENV)
	PYTHONDONTWRITEBYTECODE=1 $(PY) -m pytest -m "not slow" $(PARALLEL) $(PYTEST_ARGS) tests

## notebooks: re-execute every notebook in place and store its outputs (run before committing one)
notebooks: $(ENV)
	for nb in notebooks/[0-9]*.ipynb; do $(PY) $(EXECUTE) --inplace "$$nb" || exit 1; done

## workspace: your own copies of the notebooks in workspace/, which git ignores; a copy you have is never replaced
workspace:
	@mkdir -p workspace
	@for nb in notebooks/[0-9]*.ipynb; do name=$${nb#notebooks/}; \
		if [ -e "workspace/$$name" ]; then echo "kept     workspace/$$name (yours; delete it to get the course's again)"; \
		else cp "$$nb" "workspace/$$name" && echo "copied   workspace/$$name"; fi; done

## kernel: register this environment as the Jupyter kernel "Python (ddp-course)" that the notebooks ask for
kernel: $(ENV)
	$(PY) -m ipykernel install --user --name $(KERNEL) --display-name "Python ($(KERNEL))"

## figures: redraw the reference figures in figs/ on this machine (the notebooks draw into results/figs/)
figures: $(ENV)
	rm -rf results/figs results/executed
	for nb in notebooks/[0-9]*.ipynb; do $(PY) $(EXECUTE) --output-dir results/executed "$$nb" || exit 1; done
	$(PY) notebooks/reference_figures.py

## benchmark: every method and model over the world sizes this machine allows, all_reduce bandwidth, time
## to 95 %, the CPU step by operator: tables, targets, figures. Records go to $(RECORDS);
## RECORDS=benchmarks/results keeps them (and draws figs/ from them).
## HARNESS_ARGS and TTA_ARGS pass options on (e.g. HARNESS_ARGS="--repeats 2 --epochs 2").
RECORDS ?= results/benchmarks
benchmark: $(ENV)
	$(PY) benchmarks/harness.py --records $(RECORDS) $(HARNESS_ARGS)
	$(PY) benchmarks/allreduce_bandwidth.py --records $(RECORDS)
	$(PY) benchmarks/time_to_accuracy.py --records $(RECORDS) $(TTA_ARGS)
	$(PY) benchmarks/cpu_step_profile.py --records $(RECORDS)
	$(PY) benchmarks/plots.py --records $(RECORDS)

## gpu-check: every step of the course on the GPUs present, each record checked, one record of it all
## (without a GPU: the same steps, short, on the CPU). Needs only python3 with torch: PY=python3 works.
gpu-check: $(ENV)
	$(PY) scripts/tools/gpu_check.py --records $(RECORDS)

## clean: remove what runs leave in the course directory: results/ (records, figures, `make run`), checkpoints/,
## job logs (ddp*.o<id> from PBS, ddp*-<id>.out from Slurm), caches. Your notebooks in workspace/ and downloaded
## data in data/ stay.
clean:
	rm -rf results checkpoints .pytest_cache .ruff_cache .pbs_job.*
	rm -f ddp*.o[0-9]* ddp*-[0-9]*.out
	find . \( -path ./.venv -o -path ./.git -o -path ./workspace \) -prune -o \
		\( -name __pycache__ -o -name .ipynb_checkpoints \) -type d -prune -exec rm -rf {} +
