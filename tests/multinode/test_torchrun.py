"""(a) The README's API block under ``torchrun --nnodes 2`` (one process per node, TP=2 across the two
namespaced nodes, gloo over their bridge) gives the tokens the unsharded transformers model gives."""
import ast
import os
import re
import subprocess

import pytest
from conftest import VENV_BIN, node_env
from helpers import greedy_reference

from computron import zoo

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def readme_block() -> str:
    text = open(os.path.join(ROOT, "README.md")).read()
    section = text[text.index("## The API in ten lines"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.mark.timeout(300)
def test_readme_api_block_under_torchrun_on_two_nodes(two_nodes, tmp_path):
    script = tmp_path / "demo.py"
    script.write_text(readme_block())
    # the block's checkpoints, made once here (the block keeps them): both nodes share this file system
    paths = [zoo.save_random_causal_lm("opt-small", str(tmp_path / "ckpt" / f"opt{i}"), seed=i) for i in range(3)]
    n1, n2 = two_nodes.nodes
    procs = [two_nodes.popen(n, [os.path.join(VENV_BIN, "torchrun"), "--nnodes", "2", "--node_rank", str(i),
                                 "--nproc_per_node", "1", "--master_addr", n1.hostname, "--master_port", "29500",
                                 str(script)],
                             cwd=tmp_path, env=node_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i, n in enumerate((n1, n2))]
    outs = [p.communicate(timeout=240) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, out[-3000:] + err[-5000:]
    answers = [ln for ln in outs[0][0].splitlines() if ln.startswith("[")]
    streamed = [ln for ln in outs[0][0].splitlines() if ln.startswith("streamed ")]
    assert len(answers) == 1 and len(streamed) == 1, outs[0]
    assert not any(ln.startswith("[") for ln in outs[1][0].splitlines())  # node 2's rank is a worker
    got = ast.literal_eval(answers[0][:answers[0].index("]") + 1])
    assert got == greedy_reference(paths[1], [2, 100, 200], 16).tolist()
    assert ast.literal_eval(streamed[0][len("streamed "):]) == greedy_reference(paths[2], [2, 7], 8).tolist()
    # rank 1 ran on node 2, rank 0 on node 1
    assert "rank1 computron.worker INFO: rank 1 built all 3 models" in outs[1][1], outs[1][1][-3000:]
    assert "rank0 computron.worker INFO: rank 0 built all 3 models" in outs[0][1], outs[0][1][-3000:]
