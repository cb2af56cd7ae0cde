"""lm-evaluation-harness's ``local-completions`` model (in-process: ``lm_eval.simple_evaluate``) against
``computron serve``: a generate_until, a multiple-choice loglikelihood and a loglikelihood_rolling task, each
on a small local jsonl dataset (tests/clients/lm_eval_data), with one prompt and with 4 prompts per request.

What lm-eval sends (to ``/v1/completions``, prompts as lists of token ids from the local tokenizer):
- loglikelihood (multiple choice) and loglikelihood_rolling: ``{"prompt": [[ids], ...], "max_tokens": 1,
  "temperature": 0, "logprobs": 1, "echo": true, "seed": 1234}``, reading ``choices[i].logprobs
  .token_logprobs`` and ``.top_logprobs`` of the echoed prompt;
- generate_until: ``{"prompt": [[ids], ...], "max_tokens": N, "temperature": 0, "stop": [the task's until
  strings + the EOS string], "seed": 1234}``.
Run offline: the tokenizer is the converted checkpoint's directory, the datasets are jsonl files read by
``datasets``' json builder, HF_HUB_OFFLINE / HF_DATASETS_OFFLINE are set.

The same tasks from the command line (with the YAML files that ``task_configs`` writes in ``DIR``)::

    lm_eval --model local-completions --include_path DIR --tasks computron_gen,computron_mc,computron_ppl \
        --model_args base_url=http://127.0.0.1:8000/v1/completions,model=smol,tokenizer=TOKENIZER_DIR,\
tokenizer_backend=huggingface --batch_size 4
"""
import math
import os

import pytest
import yaml
from client_helpers import MODEL, run_client
from hf_reference import ReferenceScorer

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lm_eval_data")
TASKS = ("computron_gen", "computron_mc", "computron_ppl")
TOL = 5e-3
"""Nats, on a sum of up to 20 token logprobs of fp32 models (one token more or less is several nats)."""


def task_configs(out_dir) -> str:
    """The three tasks' YAML files in ``out_dir`` (the datasets' absolute paths filled in); returns the dir."""
    def data(name):
        return {"dataset_path": "json", "dataset_kwargs": {"data_files": {"test": os.path.join(DATA, name)}},
                "test_split": "test", "metadata": {"version": 1.0}}
    configs = {
        "computron_gen": {
            **data("gen.jsonl"), "output_type": "generate_until",
            "doc_to_text": "Question: {{question}}\nAnswer:", "doc_to_target": "{{answer}}",
            # four stop strings: with the EOS string lm-eval adds, five reach the server
            "generation_kwargs": {"until": ["\n", "Question:", ".", "</s>"], "max_gen_toks": 8,
                                  "do_sample": False, "temperature": 0},
            "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True,
                             "ignore_case": True, "ignore_punctuation": True}]},
        "computron_mc": {
            **data("mc.jsonl"), "output_type": "multiple_choice",
            "doc_to_text": "Question: {{question}}\nAnswer:", "doc_to_choice": "{{choices}}",
            "doc_to_target": "{{label}}",
            "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}]},
        "computron_ppl": {
            **data("ppl.jsonl"), "output_type": "loglikelihood_rolling",
            "doc_to_text": "", "doc_to_target": "{{text}}",
            "metric_list": [{"metric": m} for m in ("word_perplexity", "byte_perplexity", "bits_per_byte")]},
    }
    for name, cfg in configs.items():
        with open(os.path.join(out_dir, f"{name}.yaml"), "w") as f:
            yaml.safe_dump({"task": name, **cfg}, f, sort_keys=False)
    return str(out_dir)


N_PROMPTS = {"computron_gen": 4, "computron_mc": 16, "computron_ppl": 3}
"""Prompts each task sends: one per question; one per choice; one per text (each fits one rolling window)."""
METRICS = {"computron_gen": {"exact_match": (0, 1)}, "computron_mc": {"acc": (0, 1)},
           "computron_ppl": {"word_perplexity": (1, math.inf), "byte_perplexity": (1, math.inf),
                             "bits_per_byte": (0, math.inf)}}


@pytest.mark.timeout(900)  # the first test of a run also waits for the GGUF conversion
@pytest.mark.parametrize("batch_size", [1, 4])
@pytest.mark.parametrize("task", TASKS)
def test_lm_eval_local_completions(smol, proxy, tmp_path, task, batch_size):
    """Each task alone (so that each fails for its own missing feature), to completion: numeric metrics, every
    prompt sent, ``batch_size`` prompts per request where the task batches (rolling windows go one text at a
    time), and nothing refused."""
    import lm_eval
    from lm_eval.tasks import TaskManager
    _, tokenizer_dir = smol
    manager = TaskManager(include_path=task_configs(tmp_path), include_defaults=False)
    model_args = {"base_url": f"{proxy.url}/v1/completions", "model": MODEL, "tokenizer": tokenizer_dir,
                  "tokenizer_backend": "huggingface", "max_retries": 1, "num_concurrent": 1, "timeout": 300,
                  "max_length": 512}
    out = run_client(proxy, f"lm-eval local-completions {task} --batch_size {batch_size}",
                     lambda: lm_eval.simple_evaluate(model="local-completions", model_args=model_args, tasks=[task],
                                                     task_manager=manager, batch_size=batch_size, bootstrap_iters=0,
                                                     log_samples=True, cache_requests=False))
    results = out["results"][task]
    for name, (lo, hi) in METRICS[task].items():
        value = results[f"{name},none"]
        assert isinstance(value, float) and math.isfinite(value) and lo <= value <= hi, (name, results)

    bodies = [x.body for x in proxy.requests("/v1/completions")]
    assert sum(len(b["prompt"]) for b in bodies) == N_PROMPTS[task], bodies
    if task != "computron_ppl":
        assert max(len(b["prompt"]) for b in bodies) == batch_size, bodies
    if task == "computron_gen":
        assert all(len(b["stop"]) == 5 and b["max_tokens"] == 8 for b in bodies), bodies
        return
    assert all(b["echo"] is True and b["logprobs"] == 1 and b["max_tokens"] == 1 for b in bodies), bodies
    # the loglikelihoods lm-eval summed from the echoed prompt logprobs are transformers' own
    ref = ReferenceScorer(tokenizer_dir)
    for sample in out["samples"][task]:
        if task == "computron_mc":
            for (context, continuation), ((ll, _greedy),) in zip(sample["arguments"], sample["resps"]):
                want = ref.continuation(context, continuation)
                assert abs(ll - want) <= TOL, (context, continuation, ll, want)
        else:
            ((text,),), ((ll,),) = sample["arguments"], sample["resps"]
            sent = [p for b in bodies for p in b["prompt"] if p[1:] == ref.encode(text)]
            assert len(sent) == 1, (text, bodies)  # one window: the prefix token, then the text's tokens
            want = ref.logprob(sent[0], 1)
            assert abs(ll - want) <= TOL, (text, ll, want)
