"""``computron``'s console entry (``server.cli.console``) ends its process cleanly: ``main``'s exit status, all
its output flushed, and none of the ``nanobind: leaked ...`` lines triton's module prints when the interpreter's
teardown finds its objects alive (it did after the ``gc.freeze()`` the entry used to skip that teardown's
collections: every process whose ``main`` imported a transformers model class, which imports triton through
``torch._dynamo``)."""
import subprocess
import sys

import pytest
from helpers import command_env

SCRIPT = """
import sys
import torch._dynamo  # imports triton where it is installed, as transformers' model classes do
from computron.server import cli

def main():
    print("served", flush=False)  # flushed by the exit, not here
    sys.stderr.write("log line\\n")
    return 3

cli.main = main
cli.console()
print("never here")
"""


@pytest.mark.timeout(300)
def test_the_console_exits_with_mains_status_flushed_and_without_leak_lines():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=command_env(), capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert proc.stdout == "served\n"
    assert proc.stderr == "log line\n", proc.stderr[-3000:]
