"""`specgen run` through Typer's CliRunner: every format, and one clean line for every error."""

from __future__ import annotations

import json

import pytest
import typer
from tiny import stop_after_rows
from typer.testing import CliRunner

from specgen.cli import app
from specgen.cli.options import model_args, with_options
from specgen.config import GenerationConfig, ModelSettings

runner = CliRunner()


def invoke(*args, input=None):
    return runner.invoke(app, list(args), input=input)


@pytest.fixture(scope="module")
def models(tiny_dirs):
    return [
        "--target",
        str(tiny_dirs["target"]),
        "--draft",
        str(tiny_dirs["draft"]),
        "--dtype",
        "float32",
        "--device",
        "cpu",
    ]


def assert_one_line_error(result, *fragments):
    assert result.exit_code != 0
    assert "Traceback" not in result.output
    # "loading target X ..." status lines (stderr, plain format) may come before the error
    lines = [
        line
        for line in result.output.strip().splitlines()
        if line.strip() and not line.startswith("loading ")
    ]
    assert len(lines) == 1, result.output
    assert lines[0].startswith("error:"), lines[0]
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def test_help_lists_commands():
    result = invoke("--help")
    assert result.exit_code == 0
    assert "run" in result.output


@pytest.mark.parametrize(
    "command",
    [
        [],
        ["run"],
        ["chat"],
        ["bench"],
        ["bench", "batch"],
        ["bench", "serve"],
        ["serve"],
        ["check"],
        ["train-head"],
        ["models", "list"],
    ],
)
def test_flags_show_no_value_in_help(command):
    """--version, --help and every other flag take no value, so help shows none (`<bool>`)."""
    result = invoke(*command, "--help")
    assert result.exit_code == 0, result.output
    assert "<bool>" not in result.output
    if not command:
        assert "--version" in result.output


def test_each_command_has_a_one_line_summary():
    """`specgen --help` lists a command by its docstring's first paragraph, line breaks kept:
    that paragraph is one line."""
    group = typer.main.get_command(app)
    commands = dict(group.commands)
    for parent in ("models", "bench"):
        commands.update(
            {f"{parent} {name}": command for name, command in group.commands[parent].commands.items()}
        )
    for name, command in commands.items():
        summary = (command.short_help or command.help or "").split("\n\n")[0].strip()
        assert summary and "\n" not in summary, (name, summary)


def test_a_help_text_s_later_paragraphs_wrap_to_the_terminal():
    """A command's docstring is wrapped at the code's 110 columns; its help joins each paragraph's
    lines and wraps them to the terminal, so neither a wide nor a narrow one shows the source's
    line breaks (typer 0.29 kept them past the first paragraph: cli/app.py)."""
    wide = runner.invoke(app, ["check", "--help"], env={"COLUMNS": "400"}).output
    assert "a chat turn, deterministic mode and a batch of every method at once" in wide
    narrow = runner.invoke(app, ["bench", "batch", "--help"], env={"COLUMNS": "80"}).output
    body = narrow.split("Usage:", 1)[1].split("╭", 1)[0].splitlines()[1:]  # after the usage line
    paragraphs = [p.splitlines() for p in "\n".join(line.rstrip() for line in body).split("\n\n")]
    # every line but a paragraph's last fills the 80 columns, less a word
    assert all(len(line) > 60 for lines in paragraphs for line in lines[:-1] if line), body


def test_models_list_shows_whole_names_in_80_columns(monkeypatch):
    """A model's name is what `pull`, `path` and `--target` take: the table never shortens it,
    nor a size, with every kind of file on disk and an 80-column terminal."""
    from specgen.models import catalog

    held = {"gguf": 1_100_000_000, "converted bfloat16": 272_600_000, "converted float32": 541_600_000}
    monkeypatch.setattr(catalog, "holdings", lambda model: {**held, "int8": 779_700_000})
    result = runner.invoke(app, ["models", "list"], env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    assert "…" not in result.output
    for model in catalog.CATALOG.values():
        assert model.name in result.output
    assert "bf16 272.6 MB" in result.output and "fp32 541.6 MB" in result.output


def test_json_has_the_documented_keys(models):
    result = invoke("run", "Write a haiku about caches", *models, "-n", "12", "--format", "json")
    assert result.exit_code == 0, result.output
    record = json.loads(result.stdout.strip().splitlines()[-1])
    assert {"text", "token_ids", "method", "stats"} <= set(record)
    assert record["method"] == "lookup-chain"  # the default
    stats = record["stats"]
    for key in (
        "new_tokens",
        "rounds",
        "drafted",
        "accepted",
        "target_forwards",
        "acceptance_rate",
        "tokens_per_target_forward",
        "seconds",
        "tokens_per_second",
    ):
        assert key in stats
    assert stats["new_tokens"] == len(record["token_ids"]) == 12


def test_plain_and_chain_print_the_same_text(models):
    outputs = {}
    for method in ("plain", "chain"):
        result = invoke(
            "run", "Write a haiku about caches", *models, "-n", "20", "--method", method, "--format", "json"
        )
        assert result.exit_code == 0, result.output
        outputs[method] = json.loads(result.stdout.strip().splitlines()[-1])
    assert outputs["plain"]["token_ids"] == outputs["chain"]["token_ids"]
    assert outputs["plain"]["text"] == outputs["chain"]["text"]
    assert outputs["plain"]["stats"]["tokens_per_target_forward"] == 1.0


def test_plain_format_streams_text_to_stdout_and_stats_to_stderr(models):
    result = invoke("run", "hello", *models, "-n", "8", "--format", "plain")
    assert result.exit_code == 0, result.output
    assert "tokens/target forward" in result.stderr
    assert "tokens/target forward" not in result.stdout


def test_rich_format_shows_footer_and_summary(models):
    result = runner.invoke(
        app, ["run", "hello", *models, "-n", "8", "--format", "rich"], env={"COLUMNS": "120"}
    )
    assert result.exit_code == 0, result.output
    assert "tokens/target forward" in result.output
    assert "summary" in result.output
    # narrower than the table: its cells were blank; the summary is one line there
    narrow = runner.invoke(
        app, ["run", "hello", *models, "-n", "8", "--format", "rich"], env={"COLUMNS": "60"}
    )
    assert (
        narrow.exit_code == 0
        and "summary" not in narrow.output
        and "[lookup-chain] 8 tokens" in narrow.output
    )


def test_prompt_from_stdin_and_file(models, tmp_path):
    from_stdin = invoke("run", "-", *models, "-n", "6", "--format", "json", input="hello there")
    prompt_file = tmp_path / "p.txt"
    prompt_file.write_text("hello there")
    from_file = invoke("run", "--file", str(prompt_file), *models, "-n", "6", "--format", "json")
    direct = invoke("run", "hello there", *models, "-n", "6", "--format", "json")
    ids = [
        json.loads(r.stdout.strip().splitlines()[-1])["token_ids"] for r in (from_stdin, from_file, direct)
    ]
    assert ids[0] == ids[1] == ids[2]


def test_raw_skips_the_chat_template(models):
    templated = invoke("run", "hi", *models, "-n", "4", "--format", "json")
    raw = invoke("run", "hi", *models, "-n", "4", "--format", "json", "--raw")
    t, r = (json.loads(x.stdout.strip().splitlines()[-1])["stats"]["prompt_tokens"] for x in (templated, raw))
    assert r == 2 and t > r


def test_missing_model_path(models, tmp_path):
    result = invoke("run", "hi", "--target", str(tmp_path / "nope"), "--method", "plain")
    assert_one_line_error(result, "the target model: model path")
    result = invoke("run", "hi", *models[:3], str(tmp_path / "nope"), *models[4:])  # the draft's: says so
    assert_one_line_error(result, "the draft model: model path")
    result = invoke("run", "hi", "--raw", "--system", "Be brief.", "--target", str(tmp_path / "nope"))
    assert_one_line_error(result, "--system goes through the chat template, which --raw leaves out")
    result = invoke("run", "hi", "--target", "", "--method", "plain")  # not the current directory
    assert_one_line_error(result, "the target model: the name is empty")


def test_non_gguf_file(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"this is not a gguf file at all")
    result = invoke("run", "hi", "--target", str(bad), "--method", "plain")
    assert_one_line_error(result, "not a GGUF file")


def test_directory_without_config(tmp_path):
    result = invoke("run", "hi", "--target", str(tmp_path), "--method", "plain")
    assert_one_line_error(result, "no config.json")


def test_unknown_model_name_suggests_catalog_names():
    result = invoke("run", "hi", "--target", "qwen2.5-coder-1.5b", "--method", "plain")
    assert_one_line_error(result, "unknown model", "qwen2.5-coder-1.5b-instruct")


def test_a_draft_of_another_tokenizer_drafts_through_text(tiny_dirs):
    result = invoke(
        "run",
        "hi",
        "--target",
        str(tiny_dirs["target"]),
        "--draft",
        str(tiny_dirs["odd_draft"]),
        "--dtype",
        "float32",
        "-n",
        "8",
        "--format",
        "json",
    )
    assert result.exit_code == 0, result.output
    assert result.stderr.count("draft tokenizer differs: text-level drafting") == 1


def test_empty_prompt(models):
    assert_one_line_error(invoke("run", "   ", *models), "prompt is empty")
    assert_one_line_error(invoke("run", "-", *models, input=""), "prompt is empty")


def test_prompt_longer_than_context(models):
    result = invoke("run", "x" * 400, *models, "--raw")
    assert_one_line_error(result, "400 tokens", "context holds 256")


@pytest.mark.parametrize("value", ["0", "-3"])
def test_draft_tokens_must_be_positive(models, value):
    assert_one_line_error(
        invoke("run", "hi", *models, "--draft-tokens", value), "--draft-tokens must be >= 1"
    )


def test_unknown_device(models):
    args = [a for a in models if a not in ("--device", "cpu")]
    assert_one_line_error(invoke("run", "hi", *args, "--device", "tpu"), "unknown device 'tpu'")


def test_cuda_without_gpu(models, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    args = [a for a in models if a not in ("--device", "cpu")]
    assert_one_line_error(invoke("run", "hi", *args, "--device", "cuda"), "no CUDA device")


def test_unknown_method(models):
    assert_one_line_error(invoke("run", "hi", *models, "--method", "magic"), "unknown method 'magic'")


def test_impossible_sampling_settings(models):
    assert_one_line_error(invoke("run", "hi", *models, "--top-p", "0"), "--top-p")
    assert_one_line_error(invoke("run", "hi", *models, "--temperature", "-1"), "--temperature")
    assert_one_line_error(
        invoke("run", "hi", *models, "--temperature", "inf"), "--temperature must be a finite"
    )


def test_a_prompts_file_with_a_prompt_too_long_fails_before_the_first_is_decoded(models, tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text("short one\n" + "x" * 400 + "\nanother\n")
    result = invoke("run", "--prompts-file", str(prompts), *models, "-n", "2", "--raw")
    assert_one_line_error(result, "prompt 2 of", "context holds 256")
    assert result.stdout == ""  # nothing decoded, so nothing half-done


def test_debug_variable_shows_the_traceback(models, monkeypatch):
    monkeypatch.setenv("SPECGEN_DEBUG", "1")
    result = invoke("run", "   ", *models)
    assert result.exit_code != 0
    assert result.exception is not None and type(result.exception).__name__ == "PromptError"


def test_same_seed_same_sampled_text(models):
    args = [
        "run",
        "Write a haiku about caches",
        *models,
        "-n",
        "16",
        "--format",
        "json",
        "--temperature",
        "0.8",
        "--top-p",
        "0.95",
        "--seed",
        "7",
    ]
    first, second = invoke(*args), invoke(*args)
    other = invoke(*args[:-1], "8")
    ids = [json.loads(r.stdout.strip().splitlines()[-1])["token_ids"] for r in (first, second, other)]
    assert ids[0] == ids[1]
    assert ids[0] != ids[2]


@pytest.mark.parametrize(
    "method, extra",
    [
        ("rsd-c", ["--branching", "2,1", "--draft-confidence", "0.5"]),
        ("rsd-s", ["--beam-width", "2", "--depth", "3"]),
        ("multi-draft", ["--branching", "2,2"]),
    ],
)
def test_tree_methods_match_plain_under_greedy(models, method, extra):
    plain = invoke("run", "hello tree", *models, "-n", "14", "--method", "plain", "--format", "json")
    tree = invoke("run", "hello tree", *models, "-n", "14", "--method", method, *extra, "--format", "json")
    assert tree.exit_code == 0, tree.output
    p, t = (json.loads(r.stdout.strip().splitlines()[-1]) for r in (plain, tree))
    assert p["token_ids"] == t["token_ids"]
    assert t["stats"]["tree_size_per_round"] and "tokens_per_target_forward" in t["stats"]


def test_show_tree_prints_each_round(models):
    result = invoke(
        "run",
        "hello",
        *models,
        "-n",
        "6",
        "--method",
        "rsd-c",
        "--branching",
        "2,1",
        "--show-tree",
        "--format",
        "plain",
    )
    assert result.exit_code == 0, result.output
    # round 1 drafts nothing (the first token does not wait for the draft to read the prompt)
    assert "round 2" in result.stderr and "├──" in result.stderr


def test_bad_branching(models):
    assert_one_line_error(
        invoke("run", "hi", *models, "--method", "rsd-c", "--branching", "2,x"), "--branching"
    )
    assert_one_line_error(
        invoke("run", "hi", *models, "--method", "rsd-c", "--branching", "2,0"), "--branching"
    )


def test_deterministic_json_stats_and_same_text_across_methods(models):
    records = []
    for method in ("plain", "chain", "rsd-c"):
        result = invoke(
            "run",
            "hello",
            *models,
            "-n",
            "18",
            "--method",
            method,
            "--deterministic",
            "--verify-window",
            "8",
            "--format",
            "json",
        )
        assert result.exit_code == 0, result.output
        records.append(json.loads(result.stdout.strip().splitlines()[-1]))
    assert len({tuple(r["token_ids"]) for r in records}) == 1
    for key in ("verified_windows", "rollbacks", "rolled_back_tokens"):
        assert key in records[0]["stats"]
    assert records[0]["stats"]["verified_windows"] == 3


def test_bad_verify_window(models):
    assert_one_line_error(
        invoke("run", "hi", *models, "--deterministic", "--verify-window", "1"), "--verify-window"
    )
    # a tree as deep as the window could never be drafted: the run would be plain decoding under rsd-s's name
    assert_one_line_error(
        invoke(
            "run",
            "hi",
            *models,
            "--method",
            "rsd-s",
            "--depth",
            "4",
            "--deterministic",
            "--verify-window",
            "4",
        ),
        "leaves no room for a tree 4 deep",
    )


def test_prompts_file_batched_outputs_in_input_order(models, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text('hello there\n{"prompt": "second one"}\n\nthird\nand a fourth, longer prompt\n')
    runs = {}
    for size, method in (
        ("1", "plain"),
        ("3", "plain"),
        ("3", "chain"),
        ("2", "lookup"),
        ("3", "rsd-s"),
        ("2", "lookup-chain"),
    ):
        result = invoke(
            "run",
            "--prompts-file",
            str(prompts),
            "--batch-size",
            size,
            "--method",
            method,
            *models,
            "-n",
            "6",
            "--format",
            "json",
            "--dtype",
            "float32",
        )
        assert result.exit_code == 0, result.output
        runs[size, method] = [json.loads(line) for line in result.stdout.strip().splitlines()]
        assert [r["token_ids"] for r in runs[size, method]] == [r["token_ids"] for r in runs["1", "plain"]]
    assert runs["3", "chain"][0]["stats"]["drafted"] > 0
    assert runs["3", "rsd-s"][0]["stats"]["mean_tree_size"] > 0  # trees batch too
    runs["3"] = runs["3", "plain"]
    assert len(runs["3"]) == 4
    single = invoke("run", "second one", *models, "-n", "6", "--method", "plain", "--format", "json")
    record = json.loads(single.stdout.strip().splitlines()[-1])
    assert runs["3"][1]["token_ids"] == record["token_ids"]
    assert set(runs["3"][1]) == set(record) and set(runs["3"][1]["stats"]) == set(record["stats"])


def test_prompts_file_errors(models, tmp_path):
    assert_one_line_error(invoke("run", "--prompts-file", str(tmp_path / "none.txt"), *models), "cannot read")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "no prompt field"}\n')
    assert_one_line_error(invoke("run", "--prompts-file", str(bad), *models), "bad.jsonl:1")
    bad.write_text('{"prompt": "a\\ud800b"}\n')  # JSON's escape of a lone surrogate
    assert_one_line_error(
        invoke("run", "--prompts-file", str(bad), *models), "bad.jsonl:1: the prompt holds a lone"
    )
    good = tmp_path / "good.txt"
    good.write_text("a\nb\n")
    assert_one_line_error(
        invoke("run", "--prompts-file", str(good), "--batch-size", "0", *models), "--batch-size"
    )


@pytest.mark.parametrize(
    "extra",
    [
        ["--method", "lookup"],
        ["--method", "lookup", "--draft-tokens", "auto"],
        ["--method", "chain", "--draft-tokens", "auto"],
        ["--method", "chain", "--draft-schedule", "expected-gain", "--draft-tokens", "6"],
        ["--method", "lookup-chain"],
        ["--method", "lookup-chain", "--temperature", "0"],
    ],
)
def test_lookup_and_adaptive_draft_length_match_plain(models, extra):
    prompt = "abcabcabcabc abcabc abc"
    plain = invoke("run", prompt, *models, "-n", "16", "--method", "plain", "--format", "json", "--raw")
    other = invoke("run", prompt, *models, "-n", "16", *extra, "--format", "json", "--raw")
    assert other.exit_code == 0, other.output
    p, o = (json.loads(r.stdout.strip().splitlines()[-1]) for r in (plain, other))
    assert p["token_ids"] == o["token_ids"]


def test_bad_draft_tokens_and_schedule(models):
    assert_one_line_error(invoke("run", "hi", *models, "--draft-tokens", "many"), "--draft-tokens")
    assert_one_line_error(invoke("run", "hi", *models, "--draft-schedule", "magic"), "--draft-schedule")


def test_hub_id_from_the_local_hf_cache(tiny_dirs, tmp_path, monkeypatch):
    """An org/name id resolves from the Hugging Face cache layout, offline."""
    import shutil

    snapshot = tmp_path / "hub" / "models--specgen--tiny-target" / "snapshots" / "0123abc"
    shutil.copytree(tiny_dirs["target"], snapshot)
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text("0123abc")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    import huggingface_hub.constants as hub_constants

    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    local = invoke(
        "run",
        "hi",
        "--target",
        str(tiny_dirs["target"]),
        "--method",
        "plain",
        "--dtype",
        "float32",
        "-n",
        "5",
        "--format",
        "json",
    )
    hub = invoke(
        "run",
        "hi",
        "--target",
        "specgen/tiny-target",
        "--method",
        "plain",
        "--dtype",
        "float32",
        "-n",
        "5",
        "--format",
        "json",
    )
    assert hub.exit_code == 0, hub.output
    assert (
        json.loads(hub.stdout.splitlines()[-1])["token_ids"]
        == json.loads(local.stdout.splitlines()[-1])["token_ids"]
    )
    missing = invoke("run", "hi", "--target", "specgen/not-there", "--method", "plain")
    assert_one_line_error(missing, "specgen/not-there")


def test_a_gguf_file_as_the_target(tmp_path, monkeypatch):
    from gguf_factory import write_tiny_gguf

    monkeypatch.setenv("SPECGEN_CACHE", str(tmp_path / "cache"))
    path = write_tiny_gguf(tmp_path / "tiny.gguf", arch="qwen2", seed=1)
    first = invoke(
        "run",
        "hello",
        "--target",
        str(path),
        "--method",
        "plain",
        "--dtype",
        "float32",
        "-n",
        "6",
        "--format",
        "json",
    )
    assert first.exit_code == 0, first.output
    again = invoke(
        "run",
        "hello",
        "--target",
        str(path),
        "--draft",
        str(path),
        "--method",
        "chain",
        "--dtype",
        "float32",
        "-n",
        "6",
        "--format",
        "json",
    )  # reloaded from the converted cache, and as its own draft
    assert again.exit_code == 0, again.output
    a, b = (json.loads(r.stdout.splitlines()[-1]) for r in (first, again))
    assert a["token_ids"] == b["token_ids"] and b["stats"]["acceptance_rate"] == 1.0


def test_draft_confidence_stops_drafts_early_and_keeps_the_output(models):
    plain = invoke("run", "hello", *models, "-n", "16", "--method", "plain", "--format", "json")
    stopped = invoke(
        "run", "hello", *models, "-n", "16", "-k", "4", "--draft-confidence", "0.99", "--format", "json"
    )
    full = invoke("run", "hello", *models, "-n", "16", "-k", "4", "--format", "json")
    p, s, f = (json.loads(r.stdout.strip().splitlines()[-1]) for r in (plain, stopped, full))
    assert p["token_ids"] == s["token_ids"] == f["token_ids"]
    assert s["stats"]["drafted"] < f["stats"]["drafted"]
    assert_one_line_error(invoke("run", "hi", *models, "--draft-confidence", "1.5"), "--draft-confidence")


def test_brackets_in_paths_survive_the_error_line(tmp_path):
    """Rich markup must not eat `[b]` from a user's path (it would read it as a bold tag)."""
    missing = tmp_path / "x[b]" / "no[plot]pe"
    result = invoke("run", "hi", "--target", str(missing), "--method", "plain")
    assert_one_line_error(result, "x[b]/no[plot]pe")


def test_invalid_utf8_in_a_file_or_on_stdin_is_one_line(models, tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"hello \xff there")
    assert_one_line_error(invoke("run", "--file", str(bad), *models), "bad.txt is not valid UTF-8", "0xff")
    assert_one_line_error(invoke("run", "-", *models, input=b"hi \xfe x"), "stdin is not valid UTF-8", "0xfe")
    # an undecodable byte in argv arrives as a lone surrogate (surrogateescape)
    assert_one_line_error(invoke("run", "hi \udcff", *models), "not valid UTF-8")


@pytest.mark.parametrize(
    "content, fragment",
    [
        ('hello\n{"prompt": null}\n', "p.jsonl:2: 'prompt' must be a string, got null"),
        ('{"prompt": 3}\n', "p.jsonl:1: 'prompt' must be a string, got 3"),
        ('\n{"prompt": ["a", "b"]}\n', "p.jsonl:2: 'prompt' must be a string"),
        ('first\n\n{"prompt": "  "}\n', "p.jsonl:3: the prompt is empty"),
        ('first\n{"prompt": "x"\n', "p.jsonl:2: not valid JSON"),
    ],
)
def test_prompts_file_bad_records_name_their_line(tmp_path, content, fragment):
    from specgen.decoding.prompts import read_prompts_file
    from specgen.errors import PromptError

    path = tmp_path / "p.jsonl"
    path.write_text(content)
    with pytest.raises(PromptError) as info:
        read_prompts_file(path)
    assert fragment in str(info.value)


def test_prompts_file_errors_come_before_loading(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_bytes(b'ok\n{"prompt": "caf\xe9"}\n')
    result = invoke("run", "--prompts-file", str(path), "--target", str(tmp_path / "no-model"))
    assert_one_line_error(result, "p.jsonl:2: not valid UTF-8")


@pytest.mark.parametrize("seed", ["-1", str(2**64)])
def test_seed_out_of_range_fails_before_loading(tmp_path, seed):
    result = invoke("run", "hi", "--target", str(tmp_path / "no-model"), "--method", "plain", "--seed", seed)
    assert_one_line_error(result, "--seed must be in 0..")


@pytest.mark.parametrize("size", ["0", "4"])
def test_batch_size_without_a_prompts_file_is_refused(tmp_path, size):
    result = invoke(
        "run", "hi", "--target", str(tmp_path / "no-model"), "--method", "plain", "--batch-size", size
    )
    assert_one_line_error(result, "--batch-size")


def test_a_closed_pipe_exits_quietly(models, monkeypatch):
    """`specgen run ... | head -c 20`: stdout closes early; no error line, no traceback."""
    import errno

    from specgen.cli.render import PlainRenderer

    def closed(self, text):
        raise BrokenPipeError(errno.EPIPE, "Broken pipe")

    monkeypatch.setattr(PlainRenderer, "_write", closed)
    result = invoke("run", "hello", *models, "-n", "8", "--format", "plain")
    assert result.exit_code == 1
    assert "error" not in result.output and "Traceback" not in result.output


@pytest.mark.parametrize("prompt, n", [("hello", 1), ("abc", 3)])
def test_plain_and_json_agree_on_a_cut_utf8_character(models, prompt, n):
    """The tiny model's last byte starts a multi-byte character: JSON's text ends in U+FFFD."""
    json_run = invoke("run", prompt, *models, "-n", str(n), "--method", "plain", "--format", "json")
    plain_run = invoke("run", prompt, *models, "-n", str(n), "--method", "plain", "--format", "plain")
    text = json.loads(json_run.stdout.strip().splitlines()[-1])["text"]
    assert text.endswith("\ufffd")
    assert plain_run.stdout == text + "\n"


@pytest.mark.parametrize("fmt", ["json", "plain"])
def test_ctrl_c_in_a_batched_run_keeps_the_finished_rows(models, tmp_path, monkeypatch, fmt):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello there\nsecond one\nthird\nand a fourth, longer prompt\nfifth\n")
    args = [
        "run",
        "--prompts-file",
        str(prompts),
        "--batch-size",
        "2",
        "--method",
        "plain",
        *models,
        "-n",
        "6",
    ]
    full = [json.loads(line) for line in invoke(*args, "--format", "json").stdout.strip().splitlines()]
    stop_after_rows(monkeypatch, 3)
    result = invoke(*args, "--format", fmt)
    assert result.exit_code == 130, result.output
    assert "interrupted: 3 of 5 prompts finished" in result.stderr
    if fmt == "plain":
        lines = result.stdout.split("\n")[:-1]
        assert len(lines) == 5
        kept = [i for i, line in enumerate(lines) if line]
        assert len(kept) == 3 and all(lines[i] == full[i]["text"] for i in kept)
        return
    records = [json.loads(line) for line in result.stdout.strip().splitlines()]
    assert len(records) == 5
    finished = [i for i, r in enumerate(records) if not r["interrupted"]]
    assert len(finished) == 3
    assert all(records[i]["token_ids"] == full[i]["token_ids"] for i in finished)
    assert all(r["token_ids"] == [] for r in records if r["interrupted"])


def test_ctrl_c_while_a_row_is_written_still_accounts_for_every_prompt(models, tmp_path, monkeypatch):
    import importlib

    cli = importlib.import_module("specgen.cli.run")  # the module (the package's `run` is the command)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("one\ntwo\nthree\nfour\n")
    real, calls = cli._write_row, []

    def write_row(outcome, fmt):
        calls.append(outcome)
        if len(calls) == 2:
            raise KeyboardInterrupt
        real(outcome, fmt)

    monkeypatch.setattr(cli, "_write_row", write_row)
    result = invoke(
        "run",
        "--prompts-file",
        str(prompts),
        "--batch-size",
        "2",
        "--method",
        "plain",
        *models,
        "-n",
        "4",
        "--format",
        "json",
    )
    assert result.exit_code == 130, result.output
    records = [json.loads(line) for line in result.stdout.strip().splitlines()]
    assert len(records) == 4 and not records[0]["interrupted"]
    assert records[1]["interrupted"] and records[1]["token_ids"] == []  # cut while it was written


def test_ctrl_c_one_prompt_at_a_time_marks_the_rest(models, tmp_path, monkeypatch):
    from specgen.cli.render import JsonRenderer

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("one\ntwo\nthree\n")
    calls = []

    def on_round(self, view, stats):
        calls.append(stats.rounds)
        if len(calls) == 6:  # inside the second prompt
            raise KeyboardInterrupt

    monkeypatch.setattr(JsonRenderer, "on_round", on_round)
    result = invoke(
        "run", "--prompts-file", str(prompts), "--method", "plain", *models, "-n", "4", "--format", "json"
    )
    assert result.exit_code == 130, result.output
    records = [json.loads(line) for line in result.stdout.strip().splitlines()]
    assert [r["interrupted"] for r in records] == [False, True, True]
    assert (
        len(records[0]["token_ids"]) == 4
        and len(records[1]["token_ids"]) == 2
        and records[2]["token_ids"] == []
    )
    assert "interrupted: 1 of 3 prompts finished; not finished: 2-3" in result.stderr


@pytest.mark.parametrize("cache", ["a-file", "a-file/cache"])
def test_a_gguf_with_an_unusable_cache_is_one_line(tmp_path, monkeypatch, cache):
    from gguf_factory import write_tiny_gguf

    (tmp_path / "a-file").write_text("not a directory")
    monkeypatch.setenv("SPECGEN_CACHE", str(tmp_path / cache))
    path = write_tiny_gguf(tmp_path / "tiny.gguf", arch="qwen2", seed=1)
    result = invoke("run", "hello", "--target", str(path), "--method", "plain", "--dtype", "float32")
    assert_one_line_error(result, "cannot write to the cache directory", "SPECGEN_CACHE")


def test_loading_status_lines_on_stderr_unless_json(models):
    plain = invoke("run", "hello", *models, "-n", "2", "--format", "plain")
    assert plain.exit_code == 0, plain.output
    status = [line for line in plain.stderr.splitlines() if line.startswith("loading ")]
    assert status == ["loading target target ...", "loading draft draft ..."]
    quiet = invoke("run", "hello", *models, "-n", "2", "--format", "json")
    assert "loading" not in quiet.stderr


def test_a_draft_with_fewer_embedding_rows_than_tokens_is_named(tiny_dirs, tmp_path):
    from tiny import build_tokenizer
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=200,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    small = tmp_path / "small-draft"
    Qwen2ForCausalLM(config).save_pretrained(small)
    build_tokenizer().save_pretrained(small)
    result = invoke(
        "run",
        "hello",
        "--target",
        str(tiny_dirs["target"]),
        "--draft",
        str(small),
        "--dtype",
        "float32",
        "-n",
        "4",
    )
    assert_one_line_error(result, "the draft model", "small-draft", "200 embedding rows", "259 tokens")


def test_a_truncated_safetensors_file_names_the_model_and_its_role(tiny_dirs, tmp_path):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(tiny_dirs["draft"], broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    result = invoke(
        "run",
        "hello",
        "--target",
        str(tiny_dirs["target"]),
        "--draft",
        str(broken),
        "--dtype",
        "float32",
        "-n",
        "4",
    )
    assert_one_line_error(result, "cannot load the draft model", "broken")


def test_a_broken_json_file_of_a_model_directory_is_named(tiny_dirs, tmp_path):
    """A JSONDecodeError does not say which file it read: the line names the one that does not parse."""
    import shutil

    broken = tmp_path / "broken-tokenizer"
    shutil.copytree(tiny_dirs["target"], broken)
    (broken / "tokenizer.json").write_text("{half a file")
    result = invoke(
        "run", "hello", "--target", str(broken), "--method", "plain", "--dtype", "float32", "-n", "2"
    )
    assert_one_line_error(result, "cannot load the target model", "tokenizer.json is not valid JSON")


@pytest.mark.parametrize(
    "change, fragments",
    [
        (
            lambda d: (d / "tokenizer_config.json").write_text("[1, 2]"),
            ["cannot load the draft model", "tokenizer_config.json holds a list, not a JSON object"],
        ),
        (lambda d: (d / "config.json").write_text("null"), ["config.json holds null, not a JSON object"]),
        (
            lambda d: [(d / name).unlink() for name in ("tokenizer.json", "tokenizer_config.json")],
            ["the draft model", "has no usable tokenizer"],
        ),
        (
            lambda d: (d / "config.json").write_text(
                (d / "config.json")
                .read_text()
                .replace('"max_position_embeddings": 256', '"max_position_embeddings": -1')
            ),
            ["the draft model", "config.json: max_position_embeddings is -1"],
        ),
    ],
)
def test_a_broken_model_directory_is_one_line_naming_what_is_wrong(tiny_dirs, tmp_path, change, fragments):
    import shutil

    broken = tmp_path / "broken-draft"
    shutil.copytree(tiny_dirs["draft"], broken)
    change(broken)
    result = invoke(
        "run",
        "hello",
        "--target",
        str(tiny_dirs["target"]),
        "--draft",
        str(broken),
        "--dtype",
        "float32",
        "-n",
        "2",
        "--no-server",
    )
    assert_one_line_error(result, *fragments)


@pytest.mark.parametrize(
    "template, fragment",
    [
        ("{% for %}", "the model's chat template refused the messages"),
        ("{{ raise_exception('no system role here') }}", "no system role here"),
    ],
)
def test_a_chat_template_that_fails_is_one_line(tiny_dirs, tmp_path, template, fragment):
    import shutil

    broken = tmp_path / "broken-template"
    shutil.copytree(tiny_dirs["target"], broken)
    (broken / "chat_template.jinja").write_text(template)
    result = invoke(
        "run",
        "hello",
        "--target",
        str(broken),
        "--method",
        "plain",
        "--dtype",
        "float32",
        "-n",
        "2",
        "--no-server",
    )
    assert_one_line_error(result, fragment)
    assert "--raw" in result.output
    raw = invoke(
        "run",
        "hello",
        "--target",
        str(broken),
        "--method",
        "plain",
        "--dtype",
        "float32",
        "-n",
        "2",
        "--no-server",
        "--raw",
    )
    assert raw.exit_code == 0, raw.output


def test_a_gguf_without_an_architecture_is_one_line(tmp_path):
    from gguf import GGUFWriter

    fake = tmp_path / "fake.gguf"
    writer = GGUFWriter(str(fake), arch="llama")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    fake.write_bytes(fake.read_bytes().replace(b"general.architecture", b"general.architecturX"))
    result = invoke("run", "hello", "--target", str(fake), "--method", "plain", "-n", "2", "--no-server")
    assert result.exit_code == 1 and "Traceback" not in result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "cannot read the GGUF file fake.gguf" in errors[0], result.output


def test_a_local_directory_loads_safetensors_only(tmp_path):
    """A pickled pytorch_model.bin is never unpickled from a local directory."""
    import torch
    from tiny import build_model, build_tokenizer

    pickled = tmp_path / "pickled"
    model = build_model(1)
    model.config.save_pretrained(pickled)
    torch.save(model.state_dict(), pickled / "pytorch_model.bin")
    build_tokenizer().save_pretrained(pickled)
    assert (pickled / "pytorch_model.bin").is_file() and not (pickled / "model.safetensors").exists()
    result = invoke(
        "run", "hello", "--target", str(pickled), "--method", "plain", "--dtype", "float32", "-n", "2"
    )
    assert_one_line_error(result, "cannot load the target model", "pickled")


def test_the_command_exits_with_its_status_without_python_teardown():
    """`specgen` ends with os._exit once its output is flushed (teardown cost 1.2 s per run);
    the status and the one-line error are unchanged."""
    import subprocess
    import sys

    from specgen.cli import exit_status

    assert [exit_status(c) for c in (None, 0, 1, 2, 130, 256 + 3)] == [0, 0, 1, 2, 130, 3]
    done = subprocess.run(
        [sys.executable, "-m", "specgen", "run", ""], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.strip() == "error: the prompt is empty"
    done = subprocess.run(
        [sys.executable, "-m", "specgen", "--help"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and "Usage" in done.stdout


@pytest.mark.parametrize(
    "redirect, code, stdout, fragment",
    [
        ("2>&-", 0, True, None),  # no stderr: the notes go nowhere, the answer and the status are whole
        (">&-", 1, False, "stdout is closed"),  # refused before loading: the answer would be lost
        ("<&-", 1, False, "the prompt is empty"),  # '-' reads a closed stdin as empty
        (">/dev/full", 1, False, "no space left on the device"),
    ],
)
def test_closed_or_full_standard_streams_are_one_line(models, redirect, code, stdout, fragment):
    import shlex
    import subprocess
    import sys

    command = " ".join(
        shlex.quote(a)
        for a in [
            sys.executable,
            "-m",
            "specgen",
            "run",
            "-",
            *models,
            "-n",
            "4",
            "--no-server",
            "--format",
            "plain",
        ]
    )
    done = subprocess.run(
        ["bash", "-c", f"echo hi | {command} {redirect}"], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == code, done.stderr
    assert bool(done.stdout) == stdout and "Traceback" not in done.stderr and "unexpected" not in done.stderr
    if fragment:
        assert fragment in done.stderr.strip().splitlines()[-1], done.stderr


def test_user_text_is_never_read_as_emoji_codes(tmp_path):
    """Rich turns ':smile:' into an emoji unless told not to: a path must come back as typed."""
    result = invoke("run", "hi", "--target", str(tmp_path / "no:thumbsup:dir"))
    assert_one_line_error(result, "no:thumbsup:dir")


def test_ctrl_c_inside_an_import_is_an_interrupt_not_an_error():
    """Python wraps a KeyboardInterrupt raised while a module initialises in an ImportError."""
    import typer

    from specgen.cli.options import user_errors

    with pytest.raises(typer.Exit) as exited:
        with user_errors():
            try:
                raise KeyboardInterrupt
            except KeyboardInterrupt:
                raise ImportError("initialization failed")  # noqa: B904 - as an import wraps it: the context only
    assert exited.value.exit_code == 130


def test_every_help_text_shows_its_brackets():
    """Rich reads `[word]` in a help text as a markup tag and drops it: `pip install
    'specgen[ray]'` showed as `pip install 'specgen'`. Every bracket a help text holds must show."""
    import re

    import click
    from typer.main import get_command

    def commands(group, path=()):
        for name, command in group.commands.items():
            if isinstance(command, click.Group):
                yield from commands(command, (*path, name))
            else:
                yield (*path, name), command

    checked = 0
    for path, command in commands(get_command(app)):
        shown = runner.invoke(app, [*path, "--help"], env={"COLUMNS": "400"}).output
        for param in command.params:
            for word in re.findall(r"\[[^\]\s]+\]", (getattr(param, "help", None) or "").replace("\\[", "[")):
                checked += 1
                assert word in shown, f"{' '.join(path)} {param.name}: {word} is not shown"
    assert checked >= 2  # run's and serve's --ray at least


def test_ctrl_c_before_the_answer_says_so(capsys):
    """Ctrl-C while the models load (or a prompt is read) ended the command with no word at all."""
    import typer

    from specgen.cli.options import user_errors

    with pytest.raises(typer.Exit) as ended:
        with user_errors():
            raise KeyboardInterrupt
    assert ended.value.exit_code == 130 and capsys.readouterr().err == "interrupted\n"


def test_a_prompt_read_from_a_terminal_says_how_to_end_it(models):
    import os
    import sys

    pexpect = pytest.importorskip("pexpect")
    args = ["-m", "specgen", "run", "-", *models, "-n", "2", "--no-server", "--format", "plain"]
    child = pexpect.spawn(
        sys.executable, args, env=dict(os.environ, TERM="xterm"), encoding="utf-8", timeout=240
    )
    try:
        child.expect("end it with Ctrl-D")
        child.sendintr()
        child.expect("interrupted")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 130


@pytest.mark.parametrize(
    "method,options,named",
    [
        ("plain", ["-k", "3"], "--draft-tokens is unused by plain"),
        (
            "chain",
            ["--branching", "3,1"],
            "--branching is unused by chain (it applies to rsd-c, multi-draft)",
        ),
        ("lookup", ["--draft-confidence", "0.3"], "--draft-confidence is unused by lookup"),
        ("rsd-c", ["--beam-width", "2"], "--beam-width is unused by rsd-c (it applies to rsd-s)"),
        ("chain", ["--verify-window", "8"], "--verify-window sets deterministic mode's window"),
    ],
)
def test_a_drafting_option_the_method_does_not_read_is_named(models, method, options, named):
    """An option the run's method never reads is not silently dropped: a note names it and the
    methods that read it (not an error: the run is still what was asked)."""
    result = invoke(
        "run", "hello", *models, "-n", "2", "--method", method, *options, "--format", "plain", "--no-server"
    )
    assert result.exit_code == 0, result.output
    assert named in result.stderr


def test_drafting_options_the_method_reads_bring_no_note(models):
    for method, options in [
        ("rsd-s", ["--beam-width", "2", "--depth", "2"]),
        ("rsd-c", ["--branching", "2,1"]),
        ("chain", ["-k", "3", "--draft-confidence", "0.2", "--draft-schedule", "additive"]),
        ("chain", ["--deterministic", "--verify-window", "8"]),
    ]:
        result = invoke(
            "run",
            "hello",
            *models,
            "-n",
            "2",
            "--method",
            method,
            *options,
            "--format",
            "plain",
            "--no-server",
        )
        assert result.exit_code == 0 and "unused" not in result.stderr, (method, result.stderr)


def test_show_tree_without_trees_to_show_says_so(models):
    result = invoke(
        "run", "hello", *models, "-n", "2", "--method", "chain", "--show-tree", "--format", "plain"
    )
    assert result.exit_code == 0 and "--show-tree draws the trees" in result.stderr
    tree = invoke("run", "hello", *models, "-n", "2", "--method", "rsd-c", "--show-tree", "--format", "plain")
    assert tree.exit_code == 0 and "--show-tree draws" not in tree.stderr


def test_show_tree_with_a_prompts_file_draws_each_prompts_trees_or_says_why_not(models, tmp_path):
    """It was ignored without a word with --prompts-file."""
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello\nagain\n")
    tree = ["--method", "rsd-c", "--branching", "2,1", "--show-tree", "--format", "plain", "-n", "6"]
    one = invoke("run", "--prompts-file", str(prompts), *models, *tree)
    assert one.exit_code == 0 and one.stderr.count("round 2") == 2 and "├──" in one.stderr, one.stderr
    batched = invoke("run", "--prompts-file", str(prompts), *models, *tree, "--batch-size", "2")
    assert batched.exit_code == 0 and "not --batch-size above 1" in batched.stderr, batched.stderr


def test_the_option_groups_map_by_keyword_and_a_detached_servers_options_read_back_the_same():
    """with_options: the model and generation groups become ModelSettings and a GenerationConfig
    (per command defaults and fixed keywords); model_args (a detached server's command line)
    gives back the same settings."""
    seen = []

    @with_options(defaults={"max_new_tokens": 7}, fixed={"method": "plain"})
    def probe(*, models: ModelSettings, generation: GenerationConfig, extra: int = 1) -> None:
        seen.append((models, generation, extra))

    probe_app = typer.Typer()
    probe_app.command()(probe)
    probe_app.command("other")(lambda: None)
    settings = ModelSettings(
        target="t",
        draft="d",
        device="cpu",
        draft_device="cuda:1",
        dtype="float32",
        draft_quant="none",
        compile="off",
        target_quant="int8",
        threads=1,
    )
    result = runner.invoke(probe_app, ["probe", *model_args(settings), "--top-k", "3", "--extra", "2"])
    assert result.exit_code == 0, result.output
    [(models, generation, extra)] = seen
    assert models == settings and extra == 2
    assert (
        generation.method.value == "plain"
        and generation.max_new_tokens == 7
        and generation.sampling.top_k == 3
    )
    assert "--method" not in runner.invoke(probe_app, ["probe", "--help"]).output
    result = runner.invoke(
        probe_app, ["probe", "--top-p", "7"]
    )  # a bad value: one line, as in a command's body
    assert result.exit_code == 1 and "Traceback" not in result.output


def test_sigterm_as_ctrl_c_leaves_an_ignored_hangup_alone():
    """Under nohup a logout must not stop `serve --ray` (and delete its deployment)."""
    import signal

    from specgen.cli.options import _interrupt, sigterm_as_ctrl_c

    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        sigterm_as_ctrl_c(hangup=True)
        assert (
            signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
            and signal.getsignal(signal.SIGTERM) is _interrupt
        )
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
        sigterm_as_ctrl_c(hangup=True)
        assert signal.getsignal(signal.SIGHUP) is _interrupt
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)


def test_serve_ray_clean_up_notes_a_second_ctrl_c_and_leaves_on_a_third(capsys):
    """Ctrl-C pressed again out of habit must not cut the deployment's deletion short, but a
    cluster that does not answer must not hold the command for ever either."""
    import os
    import signal

    from specgen.cli.serve_ray import signals_held

    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):
        with signals_held():
            os.kill(os.getpid(), signal.SIGINT)
            assert "once more to leave" in capsys.readouterr().err
            os.kill(os.getpid(), signal.SIGINT)
            pytest.fail("the third Ctrl-C did not leave")
    assert (
        "serve --ray ADDRESS --stop" in capsys.readouterr().err and signal.getsignal(signal.SIGINT) is before
    )


@pytest.mark.parametrize("tokens,short", [("8", True), ("2000", False)])
def test_a_single_short_answer_loads_its_int8_weights_for_fbgemm_only(models, monkeypatch, tokens, short):
    """oneDNN's packing costs more at start than its verifies give back in a short answer
    (runtime/onednn.py): `run` of one prompt loads within `fbgemm_only` up to SHORT_TOKENS."""
    from specgen.runtime import onednn, pair

    seen = []
    load = pair.load
    monkeypatch.setattr(pair, "load", lambda *a, **k: seen.append(onednn._fbgemm_only) or load(*a, **k))
    result = invoke("run", "hello", "-n", tokens, "--method", "plain", "--format", "json", *models)
    assert result.exit_code == 0, result.output
    assert seen == [short] and not onednn._fbgemm_only
