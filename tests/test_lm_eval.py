"""lm-eval (0.4.13, `pip install 'specgen[eval]'`) against `specgen serve`, unchanged: its default
`local-completions` model (a remote tokenizer found through /tokenizer_info, token-id prompts,
batches of 4, echoed prompt log-probabilities for multiple choice, more than 4 stop strings) and
`local-chat-completions`, on two small tasks whose data the test writes. Skipped where lm-eval is
not installed (its own CI step installs it)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.eval,
              pytest.mark.skipif(importlib.util.find_spec("lm_eval") is None, reason="lm-eval is not installed")]

MC = [{"question": f"Question {i}: is {i} even?", "choices": ["yes", "no"], "answer": i % 2} for i in range(6)]
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
    from specgen.config import Method
    from specgen.runtime.pair import load
    from test_server import settings_for, start, stop

    settings = settings_for(tiny_dirs)
    running, thread = start(settings, load(settings, Method.CHAIN, quiet=True), max_batch_size=8, max_queue=64,
                            api_key="evalkey")
    yield running
    stop(running, thread)


def lm_eval(server, tmp_path, model: str, tasks: str, *extra: str) -> dict:
    tasks_dir = tmp_path / "tasks"
    tasks_dir.mkdir(exist_ok=True)
    for name, rows in (("specgen_mc", MC), ("specgen_gen", GEN)):
        data = tmp_path / f"{name}.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        (tasks_dir / f"{name}.yaml").write_text(TASKS[name].format(data=data))
    url = server.state.info["url"] + ("/v1/completions" if model == "local-completions" else "/v1/chat/completions")
    out = tmp_path / f"out-{model}"
    args = [sys.executable, "-m", "lm_eval", "run", "--model", model, "--model_args",
            f"model={server.state.model_id},base_url={url},auth_token=evalkey,max_retries=1",
            "--tasks", tasks, "--include_path", str(tasks_dir), "--output_path", str(out), *extra]
    env = {**os.environ, "OPENAI_API_KEY": "evalkey", "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(args, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = next(out.rglob("results*.json"))
    return json.loads(results.read_text())["results"]


def test_local_completions_runs_unchanged(server, tmp_path):
    results = lm_eval(server, tmp_path, "local-completions", "specgen_mc,specgen_gen", "--batch_size", "4")
    assert "acc,none" in results["specgen_mc"] and "exact_match,none" in results["specgen_gen"]


def test_local_chat_completions_runs_unchanged(server, tmp_path):
    results = lm_eval(server, tmp_path, "local-chat-completions", "specgen_gen", "--apply_chat_template")
    assert "exact_match,none" in results["specgen_gen"]
