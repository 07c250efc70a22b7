"""The JupyterLab jobs (job_scripts/jupyter.pbs and .sbatch), run as their scheduler would run them.

As in test_job_scripts.py, each job runs under bash with the environment its scheduler sets,
here with a node file (or SLURMD_NODENAME) naming `localhost`: the server then listens on
loopback. The tests use the job the way a participant does: read the log for the address and
the token, ask the server's REST API for the course directory, start the notebooks' kernel
and run cells of notebook 00 through it, and load a notebook page in a real browser (Debian's
chromium, headless, driven over the DevTools protocol).
"""
import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
import uuid

import pytest
from tornado.websocket import websocket_connect

from cluster_helpers import JOB_SCRIPTS, REPO, clean_environment

# JupyterLab started as a job and driven from a browser: make test runs it, make test-fast leaves it out.
pytestmark = pytest.mark.slow

ADDRESS = re.compile(r"http://localhost:(\d+)/lab\?token=([0-9a-f]+)")
# No wait below has a deadline of its own: a loaded 2-core machine takes its time to import JupyterLab or to
# render a page, and how long says nothing about the job. A wait ends when what it waits for happens or the
# process it waits on has ended; a job that hangs is ended by the suite's timeout (pyproject.toml).
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--remote-debugging-port=0", "--remote-allow-origins=*"]


def jupyter_environment(tmp_path):
    """What a job gets, without this machine's Jupyter settings: config, data and runtime in tmp_path."""
    env = clean_environment()
    env.update(HOME=str(tmp_path), TMPDIR=str(tmp_path), USER="alice", JUPYTER_CONFIG_DIR=str(tmp_path / "config"),
               JUPYTER_DATA_DIR=str(tmp_path / "data"), JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"),
               IPYTHONDIR=str(tmp_path / "ipython"))
    env.pop("JUPYTER_PATH", None)
    # The server keeps a checkpoint of every notebook the browser opens, by default in .ipynb_checkpoints/ beside
    # it: here, in this test's folder instead of the checkout's notebooks/ (tests write only in their folders).
    (tmp_path / "config").mkdir(exist_ok=True)
    (tmp_path / "config" / "jupyter_server_config.json").write_text(
        json.dumps({"FileCheckpoints": {"checkpoint_dir": str(tmp_path / "notebook-checkpoints")}}))
    return env


class Job:
    """A JupyterLab job running under bash, and the server it started."""

    def __init__(self, script, env, tmp_path):
        self.log_path = tmp_path / "job.log"
        self.tmp_path = tmp_path
        self.log = open(self.log_path, "w")
        self.process = subprocess.Popen(["bash", str(script)], env=env, cwd=tmp_path, stdout=self.log,
                                        stderr=subprocess.STDOUT, start_new_session=True)
        self.port, self.token = self.wait_for_the_server()

    def text(self):
        return self.log_path.read_text()

    def wait_for_the_server(self):
        while True:
            if self.process.poll() is not None:
                pytest.fail(f"the job ended with status {self.process.returncode}:\n{self.text()}")
            found = ADDRESS.search(self.text())
            if found:
                port, token = int(found[1]), found[2]
                try:
                    if self.request("GET", "/api/status", token=token, port=port)[0] == 200:
                        return port, token
                except OSError:
                    pass  # not listening yet
            time.sleep(1)

    def url(self, path, port=None):
        return f"http://127.0.0.1:{port or self.port}{path}"

    def request(self, method, path, token=None, body=None, port=None):
        headers = {"Authorization": f"token {token}"} if token else {}
        data = None if body is None else json.dumps(body).encode()
        if data is not None:
            headers["Content-Type"] = "application/json"
        request = urllib.request.Request(self.url(path, port), data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                payload = response.read()
                return response.status, (json.loads(payload) if payload else None)
        except urllib.error.HTTPError as error:
            return error.code, None

    def get(self, path, token=None, port=None):
        return self.request("GET", path, token=token, port=port)

    def api(self, method, path, body=None):
        status, payload = self.request(method, path, token=self.token, body=body)
        assert 200 <= status < 300, f"{method} {path}: HTTP {status}\n{self.text()[-3000:]}"
        return payload

    def stop(self):
        """Cancel the job as a scheduler does: SIGTERM to the job's processes, then wait for the job to clean up
        and end (a scheduler would SIGKILL it after a grace period; how long the cleanup takes on a loaded
        machine must not decide whether it happened)."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait()
        self.log.close()
        return self.process.returncode


def pbs_job(tmp_path):
    nodefile = tmp_path / "nodefile"
    nodefile.write_text("localhost\n")
    env = jupyter_environment(tmp_path)
    env.update(PBS_ENVIRONMENT="PBS_BATCH", PBS_O_WORKDIR=str(REPO), PBS_NODEFILE=str(nodefile),
               PBS_JOBID="4242.pbs-test", PBS_O_HOST="login.example.org", NCPUS="2")
    return Job(JOB_SCRIPTS / "jupyter.pbs", env, tmp_path)


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    running = pbs_job(tmp_path_factory.mktemp("jupyter_pbs"))
    yield running
    running.stop()


def test_the_log_says_how_to_reach_the_server(job):
    text = job.text()
    assert f"ssh -N -L {job.port}:localhost:{job.port} alice@login.example.org" in text
    assert f"http://localhost:{job.port}/lab?token={job.token}" in text
    assert len(job.token) >= 32
    assert f"--ServerApp.root_dir={REPO}" in text and "--ip=localhost" in text  # bound to the node
    assert job.token not in text.split("== running:")[1].splitlines()[0]  # not on the command line (ps shows it)


def test_the_server_answers_only_with_the_token(job):
    assert job.get("/api/status", token=job.token)[0] == 200
    assert job.get("/api/status")[0] == 403
    assert job.get("/api/status", token="0" * 48)[0] == 403


def test_it_serves_the_course_directory_with_the_notebooks_one_click_away(job):
    top = {item["name"] for item in job.api("GET", "/api/contents")["content"]}
    assert {"notebooks", "scripts", "job_scripts", "README.md"} <= top
    notebooks = {item["name"] for item in job.api("GET", "/api/contents/notebooks")["content"]}
    assert {"00_concepts.ipynb", "01_baseline.ipynb", "02_allreduce_by_hand.ipynb", "03_data_parallel.ipynb",
            "04_ddp.ipynb"} <= notebooks


def test_the_kernel_the_notebooks_ask_for_is_this_jobs_python(job):
    specs = job.api("GET", "/api/kernelspecs")["kernelspecs"]
    assert "ddp-course" in specs, sorted(specs)
    spec = specs["ddp-course"]["spec"]
    assert spec["display_name"] == "Python (ddp-course)"
    python = re.search(r"^== python: (\S+) ", job.text(), re.M)[1]  # what the job set up (site.sh)
    assert spec["argv"][0] == python and "ipykernel_launcher" in spec["argv"]
    notebook = json.loads((REPO / "notebooks" / "00_concepts.ipynb").read_text())
    assert notebook["metadata"]["kernelspec"]["name"] == "ddp-course"


async def execute(url, code, timeout=300):
    """Run ``code`` in the kernel behind the websocket ``url``; return (status, text output)."""
    connection = await websocket_connect(url)
    msg_id = uuid.uuid4().hex
    await connection.write_message(json.dumps({
        "header": {"msg_id": msg_id, "msg_type": "execute_request", "username": "test", "session": uuid.uuid4().hex,
                   "version": "5.3", "date": ""},
        "parent_header": {}, "metadata": {}, "channel": "shell", "buffers": [],
        "content": {"code": code, "silent": False, "store_history": True, "user_expressions": {},
                    "allow_stdin": False, "stop_on_error": True},
    }))
    status, output, idle = None, [], False
    while status is None or not idle:
        message = json.loads(await asyncio.wait_for(connection.read_message(), timeout))
        if message.get("parent_header", {}).get("msg_id") != msg_id:
            continue
        kind, content = message["msg_type"], message["content"]
        if kind == "stream":
            output.append(content["text"])
        elif kind == "error":
            output.append("\n".join(content["traceback"]))
        elif kind == "execute_reply":
            status = content["status"]
        elif kind == "status":
            idle = content["execution_state"] == "idle"
    connection.close()
    return status, "".join(output)


def cell_source(notebook, containing):
    cells = json.loads((REPO / "notebooks" / notebook).read_text())["cells"]
    return next("".join(cell["source"]) for cell in cells if containing in "".join(cell["source"]))


def stored_output(notebook, containing):
    cells = json.loads((REPO / "notebooks" / notebook).read_text())["cells"]
    cell = next(cell for cell in cells if containing in "".join(cell["source"]))
    return "".join("".join(output.get("text", "")) for output in cell["outputs"])


def test_cells_of_notebook_00_run_through_the_kernel(job):
    session = job.api("POST", "/api/sessions", {"path": "notebooks/00_concepts.ipynb", "type": "notebook",
                                                "name": "00_concepts.ipynb", "kernel": {"name": "ddp-course"}})
    try:
        kernel = session["kernel"]["id"]
        url = f"ws://127.0.0.1:{job.port}/api/kernels/{kernel}/channels?token={job.token}"
        # The notebook's first cell finds scripts/ from the kernel's folder: the notebook's own.
        first = cell_source("00_concepts.ipynb", "sys.path.insert(0")
        assert asyncio.run(execute(url, first)) == ("ok", "")
        layout = cell_source("00_concepts.ipynb", "NODES, GPUS_PER_NODE = 2, 4")
        status, output = asyncio.run(execute(url, layout))
        assert status == "ok", output
        assert output == stored_output("00_concepts.ipynb", "NODES, GPUS_PER_NODE = 2, 4")
        status, output = asyncio.run(execute(url, "from lesson import process\nprint(process.process_layout())"))
        assert (status, output) == ("ok", "(0, 0, 1, 1)\n")  # the course's core, imported by the kernel
    finally:
        job.api("DELETE", f"/api/sessions/{session['id']}")


class DevTools:
    """Headless chromium, and one page of it driven over the DevTools protocol."""

    def __init__(self, profile, url):
        self.process = subprocess.Popen([CHROMIUM, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", url],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                        start_new_session=True)
        self.port = self.devtools_port()
        self.next_id = 0

    def devtools_port(self):
        while True:  # until chromium names its port, or ends
            line = self.process.stderr.readline()
            found = re.search(r"DevTools listening on ws://127\.0\.0\.1:(\d+)/", line)
            if found:
                return int(found[1])
            if not line and self.process.poll() is not None:
                break
        self.close()
        pytest.fail("chromium did not start its DevTools server")

    def page(self):
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/json/list", timeout=30) as response:
            targets = json.loads(response.read())
        return next(target for target in targets if target["type"] == "page")["webSocketDebuggerUrl"]

    async def call(self, connection, method, **params):
        self.next_id += 1
        await connection.write_message(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:
            reply = json.loads(await asyncio.wait_for(connection.read_message(), 60))
            if reply.get("id") == self.next_id:
                return reply.get("result", {})

    async def wait_for(self, expression):
        """Until ``expression`` is true in the page (or chromium ends): its value, and a screenshot then."""
        connection = await websocket_connect(self.page())
        try:
            while self.process.poll() is None:
                result = await self.call(connection, "Runtime.evaluate", expression=expression, returnByValue=True)
                value = result.get("result", {}).get("value")
                if value:
                    shot = await self.call(connection, "Page.captureScreenshot", format="png")
                    return value, shot["data"]
                await asyncio.sleep(1)
            return None, None
        finally:
            connection.close()

    def close(self):
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(timeout=30)


RENDERED = """(() => {
  const cells = document.querySelectorAll('.jp-Notebook .jp-Cell');
  const text = document.body.innerText;
  return cells.length >= 20 && text.includes('Concepts: processes, ranks and collectives')
    ? {cells: cells.length, title: document.title} : null;
})()"""


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install chromium); CI installs it")
def test_a_browser_renders_a_notebook_page(job, tmp_path):
    import base64

    browser = DevTools(tmp_path / "profile", job.url(f"/lab/tree/notebooks/00_concepts.ipynb?token={job.token}"))
    try:
        rendered, screenshot = asyncio.run(browser.wait_for(RENDERED))
    finally:
        browser.close()
    assert rendered, "chromium ended before JupyterLab rendered notebook 00"
    assert rendered["cells"] >= 20 and "00_concepts" in rendered["title"]
    png = base64.b64decode(screenshot)
    (tmp_path / "notebook_00.png").write_bytes(png)
    import io

    import matplotlib.image

    pixels = matplotlib.image.imread(io.BytesIO(png), format="png")
    assert len({tuple(pixel) for pixel in pixels.reshape(-1, pixels.shape[-1])[::97]}) > 10  # not a blank page


def test_cancelling_the_job_stops_the_server_and_cleans_up(job):
    port = job.port
    status = job.stop()
    assert status != 0  # cancelled, not finished
    with pytest.raises(OSError):
        job.get("/api/status", token=job.token, port=port)
    assert not list(job.tmp_path.glob("ddp-course-kernel.*")), "the job's kernel folder should go with it"


def test_the_slurm_job_starts_the_same_server(tmp_path):
    env = jupyter_environment(tmp_path)
    env.update(SLURM_SUBMIT_DIR=str(REPO), SLURM_JOB_ID="4243", SLURMD_NODENAME="localhost",
               SLURM_SUBMIT_HOST="login.example.org", SLURM_CPUS_ON_NODE="2")
    running = Job(JOB_SCRIPTS / "jupyter.sbatch", env, tmp_path)
    try:
        assert f"ssh -N -L {running.port}:localhost:{running.port} alice@login.example.org" in running.text()
        assert running.get("/api/status", token=running.token)[0] == 200
        assert "ddp-course" in running.api("GET", "/api/kernelspecs")["kernelspecs"]
    finally:
        running.stop()


def test_gpus_granted_that_torch_cannot_see_stop_the_job_before_the_server(tmp_path):
    env = jupyter_environment(tmp_path)
    env.update(SLURM_SUBMIT_DIR=str(REPO), SLURM_JOB_ID="4244", SLURMD_NODENAME="localhost", SLURM_GPUS_ON_NODE="2",
               SLURM_JOB_NODELIST="localhost")
    result = subprocess.run(["bash", str(JOB_SCRIPTS / "jupyter.sbatch")], env=env, cwd=tmp_path,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stdout + result.stderr
    assert re.search(r"^launch.py: error: the job was granted 2 GPU\(s\) on localhost \(SLURM_GPUS_ON_NODE=2\) but "
                     r"torch sees none: ", result.stderr, re.M), result.stderr
    assert "JupyterLab on" not in result.stdout


def test_outside_a_job_the_script_says_so(tmp_path):
    result = subprocess.run(["bash", str(JOB_SCRIPTS / "jupyter.pbs")], env=jupyter_environment(tmp_path),
                            cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert "PBS_O_WORKDIR: is not set: submit this with qsub" in result.stderr + result.stdout
