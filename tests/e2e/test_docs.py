"""README.md and docs/*.md as a reader runs them.

Every ```bash/sh/shell/console and ```python block is either run here as written, or carries an HTML comment
right above it saying why not or which test runs it (``MARKERS``). ``test_every_block_is_run_or_marked``
(no process) holds the docs to that; the other tests run the blocks, grouped so that each server a block
starts is started once and the blocks that talk to it run against it. Two things change on the way:
checkpoint paths under ``/tmp/computron-...`` move into the test's own directory and port 8000 becomes a
free port, so that a run never touches a reader's files or a port in use. A one-line ``python -c "..."``
runs its code in this process (the same code, without a second interpreter importing torch); everything
else runs through ``bash`` with the venv's ``bin`` first on ``PATH``, from a directory whose ``.venv`` and
``examples`` lead to the repository's.
"""
import ast
import contextlib
import io
import os
import queue
import re
import shlex
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import List, Optional

import psutil
import pytest
from helpers import command_env, free_port, stop_command

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VENV_BIN = os.path.dirname(sys.executable)
DOC_ENV = command_env(TOKENIZERS_PARALLELISM="false")
RUNNABLE = {"bash", "sh", "shell", "console", "python", "py"}

# The comments that excuse a block from being run here, each right above its block.
MARKERS = (
    re.compile(r"not run: needs a GPU"),
    re.compile(r"not run: needs several hosts"),
    re.compile(r"not run: takes \d+ minutes; its --quick path is run by (?P<test>tests/\S+\.py::\w+)"),
    re.compile(r"run by (?P<test>tests/\S+\.py::\w+)"),
    re.compile(r"not run: needs root \(network namespaces\)"),
    re.compile(r"output, not a command"),
)

# The blocks this file runs: (file, how the block begins) -> the test here that runs it.
RUN_HERE = {
    ("README.md", "python -m computron serve a="): "test_serving",
    ("README.md", "from openai import OpenAI"): "test_serving",
    ("docs/serving.md", "computron serve /tmp/computron-serve-demo/opt-tiny-alpha"): "test_serving",
    ("docs/serving.md", "curl localhost:8000/v1/completions"): "test_serving",
    ("docs/serving.md", "from openai import OpenAI"): "test_serving",
    ("docs/model-changes.md", "python -c"): "test_model_repository",
    ("docs/model-changes.md", "curl -X POST localhost:8000/v2/repository/index"): "test_model_repository",
    ("docs/model-changes.md", "import json\nimport tritonclient"): "test_model_repository",
    ("docs/lora.md", "python -c"): "test_lora",
    ("docs/lora.md", "curl localhost:8000/v1/completions"): "test_lora",
    ("docs/encoders.md", "python -c"): "test_encoders",
    ("docs/encoders.md", "curl localhost:8000/v2/models/sentiment/infer"): "test_encoders",
    ("docs/cluster.md", "computron serve"): "test_ray_groups",
    ("docs/cluster.md", "import asyncio"): "test_ray_groups",
}


# ---- the blocks --------------------------------------------------------------------------------

@dataclass
class Block:
    path: str            # relative to the repository
    line: int            # of the opening fence, 1-based
    lang: str
    text: str
    comment: Optional[str]  # the HTML comment right above the fence

    @property
    def where(self):
        return f"{self.path}:{self.line}"


def doc_files() -> List[str]:
    docs = os.path.join(ROOT, "docs")
    return ["README.md"] + sorted(f"docs/{f}" for f in os.listdir(docs) if f.endswith(".md"))


def blocks(path: str) -> List[Block]:
    lines = open(os.path.join(ROOT, path)).read().split("\n")
    found, i = [], 0
    while i < len(lines):
        m = re.match(r"^```(\S*)\s*$", lines[i])
        if not m:
            i += 1
            continue
        start, body = i, []
        i += 1
        while i < len(lines) and lines[i].rstrip() != "```":
            body.append(lines[i])
            i += 1
        assert i < len(lines), f"{path}:{start + 1}: a block that never closes"
        above = next((ln.strip() for ln in reversed(lines[:start]) if ln.strip()), "")
        c = re.fullmatch(r"<!--\s*(.*?)\s*-->", above)
        found.append(Block(path, start + 1, m.group(1).lower(), "\n".join(body) + "\n", c.group(1) if c else None))
        i += 1
    return found


def runnable_blocks() -> List[Block]:
    return [b for f in doc_files() for b in blocks(f) if b.lang in RUNNABLE]


def claimed(b: Block) -> List[tuple]:
    return [key for key in RUN_HERE if key[0] == b.path and b.text.startswith(key[1])]


def block(path: str, begins: str) -> Block:
    """The one runnable block of ``path`` that begins with ``begins`` (a key of ``RUN_HERE``)."""
    assert (path, begins) in RUN_HERE, "list the block in RUN_HERE first"
    (b,) = [b for b in blocks(path) if b.lang in RUNNABLE and b.text.startswith(begins)]
    return b


def names_a_test(ref: str) -> bool:
    """Whether ``tests/x.py::name`` names a test function (module level or in a class) of that file."""
    path, name = ref.split("::")
    full = os.path.join(ROOT, path)
    if not os.path.isfile(full):
        return False
    tree = ast.parse(open(full).read())
    return any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name for n in ast.walk(tree))


# ---- no process: every block is run here or says why not ----------------------------------------

def test_every_block_is_run_or_marked():
    problems = []
    for b in runnable_blocks():
        keys = claimed(b)
        if b.comment is None:
            if len(keys) != 1:
                problems.append(f"{b.where}: a {b.lang} block that no test runs and no comment excuses "
                                f"(add it to RUN_HERE with a test, or mark it: {[m.pattern for m in MARKERS]})")
            continue
        if keys:
            problems.append(f"{b.where}: run here ({RUN_HERE[keys[0]]}) but marked <!-- {b.comment} -->")
        m = next((m.fullmatch(b.comment) for m in MARKERS if m.fullmatch(b.comment)), None)
        if m is None:
            problems.append(f"{b.where}: <!-- {b.comment} --> is none of the allowed markers")
        elif "test" in m.groupdict() and not names_a_test(m.group("test")):
            problems.append(f"{b.where}: <!-- {b.comment} --> names a test that does not exist")
    all_blocks = runnable_blocks()
    for key, test in RUN_HERE.items():
        n = sum(1 for b in all_blocks if key in claimed(b))
        if n != 1:
            problems.append(f"RUN_HERE {key}: matches {n} blocks, not one")
        if not callable(globals().get(test)):
            problems.append(f"RUN_HERE {key}: no test {test} here")
    assert not problems, "\n".join(problems)


def test_the_readme_api_block_is_the_one_test_first_hour_runs():
    """tests/e2e/test_first_hour.py reads the first python block under this heading: the one marked as run
    by it, and the heading is still there word for word."""
    text = open(os.path.join(ROOT, "README.md")).read()
    assert "\n## The API in ten lines\n" in text
    section = text[text.index("## The API in ten lines"):]
    first = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    (b,) = [b for b in blocks("README.md") if b.comment and "test_readme_snippet_spawn_and_torchrun" in b.comment]
    assert b.lang == "python" and b.text == first


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    s = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return s.replace(" ", "-")


def test_relative_links_and_anchors_resolve():
    problems = []
    for path in doc_files():
        text = open(os.path.join(ROOT, path)).read()
        text = re.sub(r"```.*?```", "", text, flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            full = os.path.normpath(os.path.join(ROOT, os.path.dirname(path), file)) if file else \
                os.path.join(ROOT, path)
            if not os.path.exists(full):
                problems.append(f"{path}: link to {target}: no such file")
            elif anchor:
                heads = re.findall(r"^#+ (.*)$", re.sub(r"```.*?```", "", open(full).read(), flags=re.S), re.M)
                if anchor not in {_slug(h) for h in heads}:
                    problems.append(f"{path}: link to {target}: no such heading")
    assert not problems, "\n".join(problems)


def test_the_readme_links_each_docs_page_once_under_what_else():
    text = open(os.path.join(ROOT, "README.md")).read()
    section = text[text.index("\n## What else\n"):].split("\n## ")[1]
    links = re.findall(r"\]\((docs/[^)#]+)\)", section)
    assert sorted(links) == [f for f in doc_files() if f.startswith("docs/")], links


def test_the_modules_the_docs_name_exist():
    """Every `computron/...` path in README.md and docs/, and every file of docs/architecture.md's map and of
    its bullets per package (`computron/sched/` — `scheduler.py` ...), is a file of the package today."""
    problems = []
    for path in doc_files():
        for ref in re.findall(r"`(computron/[\w/]*(?:\.py)?)`", open(os.path.join(ROOT, path)).read()):
            if not os.path.exists(os.path.join(ROOT, ref)):
                problems.append(f"{path}: {ref}")
    arch = open(os.path.join(ROOT, "docs", "architecture.md")).read()
    (tree,) = [b.text for b in blocks("docs/architecture.md") if b.text.startswith("computron/\n")]
    for line in tree.splitlines()[1:]:
        package = re.match(r"\s+(\w+)/\s{2,}(.*)$", line)
        if package:
            names = [f"{package.group(1)}/{n}" for n in re.findall(r"\w+\.py", package.group(2))]
        else:
            names = [n for n in line.split() if n.endswith((".py", "/"))]
        problems += [f"architecture.md map: computron/{n}" for n in names
                     if not os.path.exists(os.path.join(ROOT, "computron", n))]
    for package, bullet in re.findall(r"^- `computron/(\w+)/` —(.*?)(?=^- |\Z)", arch, re.M | re.S):
        for name in re.findall(r"`(\w+\.py)`", bullet):
            if not os.path.exists(os.path.join(ROOT, "computron", package, name)):
                problems.append(f"architecture.md, computron/{package}/: {name}")
    assert not problems, "\n".join(problems)


@pytest.mark.timeout(60)
def test_make_demo_runs_what_its_named_test_runs():
    """README's two commands are marked as run by test_first_hour's demo test: `make demo` runs the script
    and flags that test runs, and `make test` is pytest over tests/, this file included."""
    dry = subprocess.run(["make", "-n", "demo", "test"], cwd=ROOT, capture_output=True, text=True, timeout=50)
    assert dry.returncode == 0, dry.stderr
    assert re.search(r"python examples/serve/demo\.py --pp 2 --max-loaded 1$", dry.stdout, re.M), dry.stdout
    assert re.search(r"python -m pytest .* tests$", dry.stdout, re.M), dry.stdout
    src = open(os.path.join(ROOT, "tests", "e2e", "test_first_hour.py")).read()
    assert '"examples/serve/demo.py", "--pp", "2", "--max-loaded", "1"' in src


# ---- running blocks ----------------------------------------------------------------------------

@pytest.fixture
def work(tmp_path):
    """The reader's directory, one per test (so that `--dist loadgroup` spreads these tests over the
    workers): ``.venv`` and ``examples`` lead to the repository's."""
    os.symlink(os.path.dirname(VENV_BIN), tmp_path / ".venv")
    os.symlink(os.path.join(ROOT, "examples"), tmp_path / "examples")
    return str(tmp_path)


def after_make_demo(work: str):
    """What `make demo` leaves in /tmp/computron-serve-demo and the docs start from, written as
    examples/serve/demo.py writes it (the two checkpoints the docs use)."""
    from computron import tokenizer_zoo
    tok = tokenizer_zoo.train_bpe(vocab_size=512)
    for seed, name in enumerate(("alpha", "beta")):
        tokenizer_zoo.save_checkpoint_with_tokenizer(
            "opt-tiny", os.path.join(work, "computron-serve-demo", f"opt-tiny-{name}"), seed=seed, tokenizer=tok)


def as_run(text: str, work: str, port: int) -> str:
    return re.sub(r"\b8000\b", str(port), text).replace("/tmp/computron-", f"{work}/computron-")


def commands(text: str) -> List[str]:
    """A bash block's commands, one per line, with their ``\\`` continuations and here-documents."""
    lines, cmds, i = text.splitlines(), [], 0
    while i < len(lines):
        cmd = lines[i]
        i += 1
        if not cmd.strip() or cmd.lstrip().startswith("#"):
            continue
        while cmd.endswith("\\"):
            cmd += "\n" + lines[i]
            i += 1
        heredoc = re.search(r"<<\s*'?(\w+)'?\s*$", cmd)
        if heredoc:
            while lines[i].strip() != heredoc.group(1):
                cmd += "\n" + lines[i]
                i += 1
            cmd += "\n" + lines[i]
            i += 1
        cmds.append(cmd)
    return cmds


def is_server(cmd: str) -> bool:
    argv = shlex.split(cmd, comments=True)
    return argv[:2] == ["computron", "serve"] or argv[:4] == ["python", "-m", "computron", "serve"]


def run_python(code: str, where: str) -> str:
    """A python block (or a ``python -c`` one-liner) in this process, as ``__main__``; returns its stdout."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, where, "exec"), {"__name__": "__main__"})
    return out.getvalue()


def sh(cmd: str, cwd: str, where: str, timeout: int = 120) -> str:
    """One command of a bash block; must exit 0. Returns its stdout."""
    argv = shlex.split(cmd, comments=True)
    if argv[:2] == ["python", "-c"] and len(argv) == 3:
        return run_python(argv[2], where)
    proc = subprocess.run(["bash", "-c", cmd], cwd=cwd, env=DOC_ENV, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, \
        f"{where}: `{cmd}` exited {proc.returncode}:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
    return proc.stdout


def request(cmd: str, cwd: str, where: str) -> str:
    """A curl line: it must answer, and not with an error."""
    out = sh(cmd, cwd, where)
    assert '"error"' not in out, f"{where}: `{cmd}` answered {out[:2000]}"
    return out


READY = re.compile(r"computron\.server: serving .* on http://")


class Server:
    """A `computron serve` line of a block, started as written; ready once it logs that it serves (its
    output is read line by line on a thread, no polling); stopped with SIGTERM, after which it must exit 0
    and leave no process."""

    def __init__(self, cmd: str, cwd: str):
        self.cmd = cmd
        self.proc = subprocess.Popen(["bash", "-c", "exec " + cmd], cwd=cwd, env=DOC_ENV, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        self.log: List[str] = []
        self._lines: "queue.Queue[Optional[str]]" = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self.proc.stdout:
            self.log.append(line)
            self._lines.put(line)
        self._lines.put(None)

    def wait_ready(self, timeout: float = 300):
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            try:
                line = self._lines.get(timeout=max(left, 0))
            except queue.Empty:
                raise TimeoutError(f"`{self.cmd}` not serving within {timeout}s:\n{''.join(self.log)[-4000:]}") \
                    from None
            if line is None:
                self.proc.wait(30)
                raise RuntimeError(f"`{self.cmd}` exited {self.proc.returncode} before serving:\n"
                                   f"{''.join(self.log)[-4000:]}")
            if READY.search(line):
                return self

    def stop(self, timeout: float = 90):
        try:
            family = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            family = []
        alive = stop_command(self.proc, family, timeout, grace=30)
        self._reader.join(30)
        log = "".join(self.log)[-4000:]
        assert self.proc.returncode == 0, f"`{self.cmd}` exited {self.proc.returncode} on SIGTERM:\n{log}"
        assert not alive, f"`{self.cmd}` left processes behind: {[p.pid for p in alive]}"


@contextlib.contextmanager
def serving(*servers: Server):
    """Every server ready for the body, every one stopped after it (their own failure reported only
    when the body's did not come first)."""
    passed = False
    try:
        for s in servers:
            s.wait_ready()
        yield servers
        passed = True
    finally:
        errors = []
        for s in servers:
            try:
                s.stop()
            except AssertionError as exc:
                errors.append(str(exc))
        if passed:
            assert not errors, "\n".join(errors)


def setup_and_serve(b: Block, work: str, port: int) -> Server:
    """A block of set-up commands ending in a server: the set-up runs, then the server starts."""
    cmds = commands(as_run(b.text, work, port))
    assert is_server(cmds[-1]) and not any(is_server(c) for c in cmds[:-1]), b.where
    for cmd in cmds[:-1]:
        sh(cmd, work, b.where)
    return Server(cmds[-1], work)


# ---- the servers of the docs ---------------------------------------------------------------------

@pytest.mark.timeout(600)
def test_serving(work):
    """README's server and `openai` call, and docs/serving.md's three ways to start the server (the config
    file its yaml block shows included); the curl and python blocks run against the second."""
    after_make_demo(work)
    readme_cmd, = commands(block("README.md", "python -m computron serve a=").text)
    forms = commands(block("docs/serving.md", "computron serve /tmp/computron-serve-demo/opt-tiny-alpha").text)
    assert len(forms) == 3 and forms[1] == readme_cmd  # "With the server of the second line running"
    (yaml_block,) = [b for b in blocks("docs/serving.md") if b.lang == "yaml" and b.text.startswith("# serve.yaml")]
    ports = [free_port() for _ in forms]
    with open(os.path.join(work, "serve.yaml"), "w") as f:
        f.write(as_run(yaml_block.text, work, ports[2]))
    assert "--config serve.yaml" in forms[2]
    servers = [Server(as_run(cmd, work, port), work) for cmd, port in zip(forms, ports)]
    with serving(*servers):
        curl = block("docs/serving.md", "curl localhost:8000/v1/completions")
        for cmd in commands(as_run(curl.text, work, ports[1])):
            out = request(cmd, work, curl.where)
            assert '"text"' in out or "data: [DONE]" in out, out
        for b in (block("docs/serving.md", "from openai import OpenAI"),
                  block("README.md", "from openai import OpenAI")):
            assert run_python(as_run(b.text, work, ports[1]), b.where).strip(), b.where


@pytest.mark.timeout(400)
def test_model_repository(work):
    """docs/model-changes.md: a repository of three checkpoints, its models loaded on first use and through
    Triton's routes with curl and with tritonclient."""
    port = free_port()
    with serving(setup_and_serve(block("docs/model-changes.md", "python -c"), work, port)):
        curl = block("docs/model-changes.md", "curl -X POST localhost:8000/v2/repository/index")
        outs = [request(cmd, work, curl.where) for cmd in commands(as_run(curl.text, work, port))]
        assert '"alpha"' in outs[0] and '"text"' in outs[1], outs
        py = block("docs/model-changes.md", "import json\nimport tritonclient")
        assert run_python(as_run(py.text, work, port), py.where).strip().endswith("True")


@pytest.mark.timeout(400)
def test_lora(work):
    """docs/lora.md: two random adapters on the demo's alpha, one from the config, one added and removed
    with vLLM's routes."""
    after_make_demo(work)
    port = free_port()
    with serving(setup_and_serve(block("docs/lora.md", "python -c"), work, port)):
        curl = block("docs/lora.md", "curl localhost:8000/v1/completions")
        outs = [request(cmd, work, curl.where) for cmd in commands(as_run(curl.text, work, port))]
        assert "added successfully" in outs[1] and "removed successfully" in outs[4], outs
        assert '"parent":"alpha"' in outs[3].replace(" ", ""), outs[3]


@pytest.mark.timeout(400)
def test_encoders(work):
    """docs/encoders.md: a classifier, an embedder and a ViT model over KServe v2 and /v1/embeddings."""
    port = free_port()
    with serving(setup_and_serve(block("docs/encoders.md", "python -c"), work, port)):
        curl = block("docs/encoders.md", "curl localhost:8000/v2/models/sentiment/infer")
        outs = [request(cmd, work, curl.where) for cmd in commands(as_run(curl.text, work, port))]
        assert '"outputs"' in outs[0] and '"embedding"' in outs[1], outs


@pytest.mark.timeout(600)
def test_ray_groups(work):
    """docs/cluster.md: the server over two engine groups on a local Ray cluster, then
    examples/cluster/two_groups.py, whose code is the page's python block word for word."""
    after_make_demo(work)
    b = block("docs/cluster.md", "computron serve")
    server_cmd, script_cmd = commands(b.text)
    example = open(os.path.join(ROOT, "examples", "cluster", "two_groups.py")).read()
    assert example[example.index("import asyncio"):] == block("docs/cluster.md", "import asyncio").text
    with serving(Server(as_run(server_cmd, work, free_port()), work)):
        pass
    out = sh(as_run(script_cmd, work, free_port()), work, b.where, timeout=400)
    assert out.startswith("[") and "'tiny1'" in out, out
