"""The evaluation tools people point at a server, unchanged, against `specgen serve` (`pip install
'specgen[eval]'`; its own CI step; skipped where they are not installed):

* lm-eval 0.4.13: its default `local-completions` model (a remote tokenizer found through
  /tokenizer_info, token-id prompts, batches of 4, echoed prompt log-probabilities for multiple
  choice, more than 4 stop strings) and `local-chat-completions`, on two small tasks whose data
  the test writes;
* guidellm 0.8.1: a synchronous benchmark of synthetic prompts (it sends vLLM's `ignore_eos`),
  whose report must count every request and token."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.eval
needs_lm_eval = pytest.mark.skipif(
    importlib.util.find_spec("lm_eval") is None, reason="lm-eval is not installed"
)
needs_guidellm = pytest.mark.skipif(
    importlib.util.find_spec("guidellm") is None, reason="guidellm is not installed"
)

MC = [
    {"question": f"Question {i}: is {i} even?", "choices": ["yes", "no"], "answer": i % 2} for i in range(6)
]
GEN = [{"prompt": f"Say the number {i}.", "target": str(i)} for i in range(6)]
TASKS = {
    "specgen_mc": """task: specgen_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
""",
    "specgen_gen": """task: specgen_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{target}}}}"
generation_kwargs:
  until: ["\\n\\n", "###", "END", "Q:", "stop5", "stop6"]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
""",
}


@pytest.fixture(scope="module")
def server(tiny_dirs):
    from test_server import settings_for, start, stop

    from specgen.config import Method
    from specgen.runtime.pair import load

    settings = settings_for(tiny_dirs)
    running, thread = start(
        settings, load(settings, Method.CHAIN, quiet=True), max_batch_size=8, max_queue=64, api_key="evalkey"
    )
    yield running
    stop(running, thread)


def lm_eval(server, tmp_path, model: str, tasks: str, *extra: str) -> dict:
    tasks_dir = tmp_path / "tasks"
    tasks_dir.mkdir(exist_ok=True)
    for name, rows in (("specgen_mc", MC), ("specgen_gen", GEN)):
        data = tmp_path / f"{name}.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        (tasks_dir / f"{name}.yaml").write_text(TASKS[name].format(data=data))
    url = server.state.info["url"] + (
        "/v1/completions" if model == "local-completions" else "/v1/chat/completions"
    )
    out = tmp_path / f"out-{model}"
    args = [
        sys.executable,
        "-m",
        "lm_eval",
        "run",
        "--model",
        model,
        "--model_args",
        f"model={server.state.model_id},base_url={url},auth_token=evalkey,max_retries=1",
        "--tasks",
        tasks,
        "--include_path",
        str(tasks_dir),
        "--output_path",
        str(out),
        *extra,
    ]
    env = {**os.environ, "OPENAI_API_KEY": "evalkey", "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(args, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = next(out.rglob("results*.json"))
    return json.loads(results.read_text())["results"]


@needs_lm_eval
def test_local_completions_runs_unchanged(server, tmp_path):
    results = lm_eval(server, tmp_path, "local-completions", "specgen_mc,specgen_gen", "--batch_size", "4")
    assert "acc,none" in results["specgen_mc"] and "exact_match,none" in results["specgen_gen"]


@needs_lm_eval
def test_local_chat_completions_runs_unchanged(server, tmp_path):
    results = lm_eval(server, tmp_path, "local-chat-completions", "specgen_gen", "--apply_chat_template")
    assert "exact_match,none" in results["specgen_gen"]


@needs_guidellm
def test_guidellm_counts_every_request_and_token(server, tmp_path, tiny_dirs):
    report = tmp_path / "guidellm.json"
    target = server.state.info["url"]
    args = [
        sys.executable,
        "-m",
        "guidellm",
        "run",
        "--backend",
        f"kind=openai_http,target={target},model={server.state.model_id},api_key=evalkey",
        "--profile",
        "kind=synchronous",
        "--constraint",
        "kind=max_requests,count=4",
        "--data",
        "kind=synthetic_text,prompt_tokens=16,output_tokens=8",
        "--tokenizer",
        f"kind=huggingface_auto,model={tiny_dirs['target']}",
        "--output",
        f"kind=json,path={report}",
        "--disable-progress",
    ]
    done = subprocess.run(
        args,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"},
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    metrics = json.loads(report.read_text())["benchmarks"][0]["metrics"]
    assert metrics["request_totals"] == {"successful": 4, "errored": 0, "incomplete": 0, "total": 4}
    assert metrics["output_token_count"]["successful"]["total_sum"] == 32  # ignore_eos: 8 tokens each
