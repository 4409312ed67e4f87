"""`specgen chat`: scripted sessions, save files, cache reuse, context overflow, a real terminal.

Scripted sessions go through Typer's CliRunner (stdin is not a terminal there, so chat reads
one message per line); cache reuse and Ctrl-C are checked on ChatSession directly, on the
tiny fp32 models under greedy decoding; one test drives the real command in a pseudo-terminal.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import warnings

import pytest
import typer
from typer.testing import CliRunner

from specgen.chat.session import ChatSession
from specgen.cli.chat import chat
from specgen.cli.render import PlainRenderer
from specgen.cli.run import run
from specgen.config import GenerationConfig, Method, ModelSettings
from specgen.runtime.pair import Pair

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
app.command()(run)
app.command()(chat)
runner = CliRunner()


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


def session_run(models, lines, *args):
    result = runner.invoke(app, ["chat", *models, *args], input="".join(line + "\n" for line in lines))
    assert "Traceback" not in result.output, result.output
    return result


def json_lines(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


def reply_lines(stdout: str) -> list[dict]:
    """The replies' JSON objects (not the commands': /set, /method, /save ... print one too)."""
    return [line for line in json_lines(stdout) if "command" not in line]


def error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("error:")]


# -- scripted sessions through the CLI -----------------------------------------------------


def test_plain_session_prints_replies_to_stdout_and_stats_to_stderr(models):
    result = session_run(models, ["hello there", "and again"], "-n", "6")
    assert result.exit_code == 0, result.output
    assert "tokens/target forward" not in result.stdout
    assert result.stderr.count("tokens/target forward") == 2
    assert "turn 2: conversation" in result.stderr


def test_a_new_draft_length_or_method_applies_from_the_next_turn(models):
    """The row keeps its draft-length policy across turns (what an adaptive schedule learned),
    but not past a change of what it was made for: /set draft_tokens and /method take effect
    at the next turn (they were ignored after the first)."""

    def turns(k: str, *commands: str) -> list[dict]:
        lines = ["hello there", *commands, "and again"]
        result = session_run(
            models, lines, "-n", "24", "-k", k, "--draft-confidence", "0", "--format", "json"
        )
        assert result.exit_code == 0, result.output
        return [line["stats"] for line in json_lines(result.stdout) if "stats" in line]

    first, second = turns("8", "/set draft_tokens 2")
    assert first["drafted"] > 2 * first["rounds"] and 0 < second["drafted"] <= 2 * second["rounds"]
    first, second = turns("1", "/set draft_tokens 6")
    assert first["drafted"] <= first["rounds"] and second["drafted"] > second["rounds"]
    first, second = turns("1", "/method lookup-chain")  # lookup-chain counts copies from the text
    assert "text" not in first["accepted_by_origin"] and "text" in second["accepted_by_origin"]


def test_a_save_keeps_its_draft_length_and_confidence_stop(models, tmp_path):
    """--load takes the save's draft length and confidence stop (the device's choice replaced
    the length, and the stop was not saved); a save of a length left to the device says so."""
    save = tmp_path / "k7.json"
    result = session_run(models, ["hi", f"/save {save}"], "-n", "4", "-k", "7", "--draft-confidence", "0")
    assert result.exit_code == 0, result.output
    settings = json.loads(save.read_text())["settings"]
    assert settings["draft_tokens"] == 7 and settings["draft_confidence"] == 0.0
    shown = session_run(models, ["/set"], "--load", str(save), "--format", "json")
    loaded = json_lines(shown.stdout)[-1]["settings"]
    assert (loaded["draft_tokens"], loaded["draft_confidence"]) == (7, 0.0)
    again = session_run(
        models, ["/set"], "--load", str(save), "-k", "3", "--format", "json"
    )  # the command line wins
    assert json_lines(again.stdout)[-1]["settings"]["draft_tokens"] == 3
    words = session_run(
        models,
        ["/set draft_tokens auto", "/set draft_tokens device", "/set draft_tokens 2.5"],
        "-k",
        "2",
        "--format",
        "json",
    )
    assert (
        len(error_lines(words.output)) == 1
        and "draft_tokens takes an integer" in error_lines(words.output)[0]
    )
    shown = [line["settings"] for line in json_lines(words.stdout) if "settings" in line]
    # auto: the adaptive schedule up to 8; device: left to the device (chosen where the chat decodes)
    assert (shown[0]["draft_tokens"], shown[0]["draft_schedule"]) == (8, "expected-gain")
    assert shown[1]["draft_tokens"] == "device" and shown[1]["draft_confidence"] == "device"


def test_a_chat_on_a_server_sends_the_draft_length_it_sets():
    """A chat on a server leaves the draft length to the server until /set names one; then
    every request carries it (it was left out while the placeholder's flag stayed set)."""
    from specgen.chat.saves import config_from, settings_dict
    from specgen.cli.remote import request_body

    device = GenerationConfig(device_draft_tokens=True, device_confidence=True)
    assert settings_dict(device)["draft_tokens"] == "device"
    assert "draft_tokens" not in request_body(device, "m", [{"role": "user", "content": "x"}])["speculative"]
    body = request_body(config_from({"draft_tokens": 1}, device), "m", [{"role": "user", "content": "x"}])
    assert body["speculative"]["draft_tokens"] == 1
    assert config_from(settings_dict(device)) == device  # a save of it loads as it was


@pytest.mark.parametrize("fmt", ["plain", "json"])
def test_a_closed_pipe_ends_the_chat_quietly(models, monkeypatch, fmt):
    """`specgen chat ... | head -c 10`: stdout closes; the session ends as `run` does, without
    an 'unexpected BrokenPipeError' per later turn (which said, falsely in JSON, that the
    message was not kept)."""
    import errno

    from specgen.cli.render import JsonRenderer

    def closed(*args, **kwargs):
        raise BrokenPipeError(errno.EPIPE, "Broken pipe")

    monkeypatch.setattr(PlainRenderer, "_write", closed)
    monkeypatch.setattr(JsonRenderer, "finish", closed)
    result = session_run(models, ["one", "two", "three"], "-n", "4", "--format", fmt)
    assert result.exit_code == 1 and "error" not in result.output


def test_a_save_name_with_a_nul_byte_is_one_line(models):
    result = session_run(models, ["/save a\x00b.json", "/load a\x00b.json"])
    errors = error_lines(result.output)
    assert result.exit_code == 1 and len(errors) == 2 and all("holds a NUL byte" in e for e in errors)


def test_a_save_from_another_target_is_noted_by_load_and_by_the_command_line(models, tmp_path, monkeypatch):
    save = tmp_path / "other.json"
    save.write_text(
        json.dumps(
            {"format": "specgen-chat", "version": 1, "messages": [], "models": {"target": "some-other-model"}}
        )
    )
    at_start = session_run(models, [], "--load", str(save))
    later = session_run(models, [f"/load {save}"])
    assert all("the save was made with target some-other-model" in r.stderr for r in (at_start, later))
    ours = tmp_path / "ours.json"  # the same target, named by a relative path: no note
    target = models[models.index("--target") + 1]
    monkeypatch.chdir(tmp_path)
    ours.write_text(
        json.dumps(
            {
                "format": "specgen-chat",
                "version": 1,
                "messages": [],
                "models": {"target": os.path.relpath(target, tmp_path)},
            }
        )
    )
    assert "the save was made with" not in session_run(models, [f"/load {ours}"], "--load", str(ours)).stderr


def test_chat_names_a_drafting_option_its_method_does_not_read(models):
    result = session_run(models, ["hello"], "-n", "2", "--method", "chain", "--depth", "3")
    assert result.exit_code == 0, result.output
    assert "--depth is unused by chain (it applies to rsd-s)" in result.stderr


def test_chat_takes_the_draft_schedule_and_confidence_that_run_takes(models):
    """--draft-confidence and --draft-schedule reach the chat's engine as they reach run's: a
    confidence of 0.99 stops the tiny draft's chains early (each draft token is kept, then the
    draft ends), 0 drafts all k; a bad schedule is one line and a non-zero exit."""

    def drafted(*options) -> int:
        result = session_run(models, ["hello there"], "-n", "6", "-k", "4", "--format", "json", *options)
        assert result.exit_code == 0, result.output
        return json_lines(result.stdout)[0]["stats"]["drafted"]

    assert drafted("--draft-confidence", "0") == drafted(
        "--draft-confidence", "0", "--draft-schedule", "fixed"
    )
    assert drafted("--draft-confidence", "0.99") < drafted("--draft-confidence", "0")
    assert drafted("--draft-confidence", "0", "--draft-schedule", "additive") >= 1
    result = session_run(models, ["hello"], "--draft-schedule", "sometimes")
    assert result.exit_code != 0 and len(error_lines(result.output)) == 1
    assert "--draft-schedule" in error_lines(result.output)[0]


def test_slash_commands_change_the_session(models):
    lines = [
        "hello there",
        "/set temperature 0.7",
        "/set top-k 5",
        "/set seed 3",
        "/set max_new_tokens 5",
        "/set draft_tokens 2",
        "second message",
        "/method plain",
        "/system Be brief.",
        "/system",
        "third message",
        "/stats",
        "/set temperature -1",
        "/set top_p 2",
        "/set temperature warm",
        "/set colour blue",
        "/method magic",
        "/bogus",
        "/set",
        "/reset",
        "/help",
        "after the reset",
        "/exit",
        "never sent",
    ]
    result = session_run(models, lines, "-n", "6", "--format", "json")
    assert result.exit_code == 1, result.output  # the session ran to /exit, but lines failed
    records = json_lines(result.stdout)
    replies = [r for r in records if "text" in r]
    commands = {r["command"]: r for r in records if "command" in r}
    assert [r["turn"] for r in replies] == [1, 2, 3, 4]
    assert [r["method"] for r in replies] == ["lookup-chain", "lookup-chain", "plain", "plain"]
    assert replies[0]["stats"]["new_tokens"] == 6
    assert all(r["stats"]["new_tokens"] <= 5 for r in replies[1:])
    assert replies[1]["reused_tokens"] > 0  # the first turn's tokens stayed in the caches
    settings = commands["set"]["settings"]  # the bare /set after the failed ones: unchanged
    assert (
        settings["temperature"],
        settings["top_k"],
        settings["seed"],
        settings["max_new_tokens"],
        settings["draft_tokens"],
        settings["method"],
    ) == (0.7, 5, 3, 5, 2, "plain")
    assert commands["stats"]["totals"]["turns"] == 3
    assert commands["method"] == {"command": "method", "method": "plain"}  # /method prints an object too
    assert commands["stats"]["totals"]["turns_by_method"] == {"lookup-chain": 2, "plain": 1}
    errors = error_lines(result.stderr)
    assert len(errors) == 6, result.stderr
    for fragment, line in zip(
        [
            "error: temperature must be a finite number >= 0",
            "top_p",
            "temperature takes a number",
            "unknown setting 'colour'",
            "unknown method 'magic'",
            "unknown command /bogus",
        ],
        errors,
    ):
        assert fragment in line
    assert "system prompt: Be brief." in result.stderr
    assert "conversation cleared (the system prompt stays)" in result.stderr
    assert "/save FILE" in result.stderr  # /help
    # after /reset the fourth turn's conversation is the system prompt and one message
    assert replies[3]["conversation_tokens"] < replies[2]["conversation_tokens"]


def test_method_loads_the_draft_when_the_session_started_without_one(models, tiny_dirs):
    result = session_run(
        models, ["hi", "/method chain", "hi again"], "-n", "4", "--method", "plain", "--format", "json"
    )
    assert result.exit_code == 0, result.output
    assert [r["method"] for r in reply_lines(result.stdout)] == ["plain", "chain"]
    assert "loading the draft model" in result.stderr

    no_draft = [a if a != str(tiny_dirs["draft"]) else str(tiny_dirs["target"] / "missing") for a in models]
    result = session_run(
        no_draft, ["/method chain", "hi"], "-n", "4", "--method", "plain", "--format", "json"
    )
    assert result.exit_code == 1, result.output
    errors = error_lines(result.stderr)
    assert len(errors) == 1 and "does not exist" in errors[0]
    assert [r["method"] for r in json_lines(result.stdout)] == ["plain"]  # the session went on unchanged


def test_save_and_load_round_trip(models, tmp_path):
    saved = tmp_path / "chat.json"
    result = session_run(
        models,
        [
            "first message",
            "/system Be terse.",
            "/set temperature 0.5",
            "/set seed 11",
            "second message",
            f"/save {saved}",
        ],
        "-n",
        "5",
        "--format",
        "json",
    )
    assert result.exit_code == 0, result.output
    data = json.loads(saved.read_text())
    assert (data["format"], data["version"]) == ("specgen-chat", 1)
    assert data["system"] == "Be terse."
    assert [m["role"] for m in data["messages"]] == ["user", "assistant", "user", "assistant"]
    assert [m["content"] for m in data["messages"][::2]] == ["first message", "second message"]
    assert data["settings"]["temperature"] == 0.5 and data["settings"]["seed"] == 11
    assert data["models"]["target"] == models[1] and data["models"]["draft"] == models[3]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chat.json"]  # no temporary file left

    again = tmp_path / "again.json"
    result = session_run(
        models, [f"/save {again}", "third message"], "--load", str(saved), "--format", "json"
    )
    assert result.exit_code == 0, result.output
    assert "resumed 4 messages" in result.stderr
    copy = json.loads(again.read_text())
    assert copy["messages"] == data["messages"] and copy["system"] == data["system"]
    assert copy["settings"] == data["settings"]  # -n and the sampling options came from the file

    overridden = tmp_path / "overridden.json"
    result = session_run(
        models, [f"/save {overridden}"], "--load", str(saved), "--temperature", "0", "--system", "Other."
    )
    assert result.exit_code == 0, result.output
    other = json.loads(overridden.read_text())
    assert other["settings"]["temperature"] == 0.0 and other["settings"]["seed"] == 11
    assert other["system"] == "Other." and other["messages"] == data["messages"]

    loaded = tmp_path / "loaded.json"
    result = session_run(models, ["something else", f"/load {saved}", f"/save {loaded}"], "-n", "3")
    assert result.exit_code == 0, result.output
    assert json.loads(loaded.read_text())["messages"] == data["messages"]


@pytest.mark.parametrize(
    "content, fragment",
    [
        ("{not json", "invalid JSON at line 1"),
        ('{"format": "specgen-chat", "version": 99, "messages": []}', "version 99"),
        ('{"format": "something-else", "version": 1}', "not a specgen chat save"),
        (
            '{"format": "specgen-chat", "version": 1, "messages": [{"role": "robot", "content": "x"}]}',
            "messages[0]",
        ),
        (
            '{"format": "specgen-chat", "version": 1, "messages": [], "settings": {"top_p": 7}}',
            "top_p must be",
        ),
        (
            '{"format": "specgen-chat", "version": 1, "messages": [], "settings": {"branching": "22"}}',
            "list of integers",
        ),
        (
            '{"format": "specgen-chat", "version": 1, "messages": [], "settings": {"temperature": true}}',
            "a number",
        ),
        ('{"format": "specgen-chat", "version": true, "messages": []}', "save format version True"),
        ('{"format": "specgen-chat", "version": 1.0, "messages": []}', "save format version 1.0"),
        (
            '{"format": "specgen-chat", "version": 1, "messages": [], "settings": {"seed": '
            + "7" * 5000
            + "}}",
            "a number of more than 4300 digits",
        ),
        (
            '{"format": "specgen-chat", "version": 1, "messages": [], "settings": {"draft_tokens": "often"}}',
            "invalid setting draft_tokens: expected an integer, got 'often'",
        ),
        (
            '{"format": "specgen-chat", "version": 1, "messages": [{"role": "user", "content": "a\\ud800"}]}',
            "messages[0] holds a lone surrogate",
        ),
        (
            '{"format": "specgen-chat", "version": 1, "system": "\\udfff", "messages": []}',
            "system holds a lone surrogate",
        ),
    ],
)
def test_a_malformed_save_file_is_one_clear_error(models, tmp_path, content, fragment):
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    at_start = session_run(models, [], "--load", str(bad))
    assert at_start.exit_code == 1
    lines = [line for line in at_start.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and fragment in lines[0], at_start.output

    after = tmp_path / "after.json"
    mid = session_run(models, ["hello", f"/load {bad}", f"/save {after}"], "-n", "3", "--temperature", "0.3")
    assert mid.exit_code == 1, mid.output
    errors = error_lines(mid.stderr)
    assert len(errors) == 1 and fragment in errors[0]
    kept = json.loads(after.read_text())
    assert [m["content"] for m in kept["messages"]][:1] == ["hello"] and len(kept["messages"]) == 2
    assert kept["settings"]["temperature"] == 0.3


def test_save_never_replaces_a_file_that_is_not_a_chat_save(models, tmp_path):
    empty = tmp_path / "empty.json"
    empty.write_text("")  # touch, mktemp: nothing to lose
    assert session_run(models, ["hello", f"/save {empty}"], "-n", "2").exit_code == 0
    assert json.loads(empty.read_text())["format"] == "specgen-chat"
    notes = tmp_path / "notes.txt"
    notes.write_text("my prompts\n")
    earlier = tmp_path / "earlier.json"
    result = session_run(
        models, ["hello", f"/save {earlier}", f"/save {earlier}", f"/save {notes}"], "-n", "2"
    )
    assert result.exit_code == 1, result.output  # a save over a save is fine; over the notes, refused
    errors = error_lines(result.stderr)
    assert len(errors) == 1 and "is not a specgen chat save; give another file name" in errors[0]
    assert notes.read_text() == "my prompts\n" and json.loads(earlier.read_text())["format"] == "specgen-chat"


def test_a_save_or_prompts_file_past_its_bound_is_one_line(models, tmp_path, monkeypatch):
    """`--load /dev/zero` or `--prompts-file /dev/zero` would read until memory runs out."""
    from specgen.chat import saves
    from specgen.decoding import prompts

    monkeypatch.setattr(saves, "MAX_SAVE_BYTES", 1 << 10)
    monkeypatch.setattr(prompts, "MAX_PROMPTS_FILE_BYTES", 1 << 10)
    result = session_run(models, [], "--load", "/dev/zero")
    assert result.exit_code == 1 and "holds more than" in result.output, result.output
    with pytest.raises(prompts.PromptError, match="holds more than"):
        prompts.read_prompt_records("/dev/zero")


def test_missing_save_file_and_unwritable_target(models, tmp_path):
    result = session_run(models, [f"/load {tmp_path / 'nope.json'}", f"/save {tmp_path / 'no' / 'dir.json'}"])
    assert result.exit_code == 1, result.output
    errors = error_lines(result.stderr)
    assert len(errors) == 2 and "cannot read" in errors[0] and "cannot write" in errors[1]


def test_context_overflow_drops_the_oldest_turns_and_keeps_going(models, tmp_path):
    """Context 256 tokens (one per byte): ~75-token messages and 60-token replies overflow by turn 3."""
    saved = tmp_path / "long.json"
    messages = [f"message {i}: " + "tell me about caches and speculative decoding please " for i in range(6)]
    result = session_run(
        models, [*messages, f"/save {saved}"], "-n", "60", "--system", "You are terse.", "--format", "json"
    )
    assert result.exit_code == 0, result.output
    replies = reply_lines(result.stdout)
    assert len(replies) == 6
    assert sum(r["dropped_turns"] for r in replies) >= 3
    assert "dropped the oldest" in result.stderr
    assert all(r["conversation_tokens"] + 60 <= 256 for r in replies)
    data = json.loads(saved.read_text())
    assert data["system"] == "You are terse."  # never dropped
    # the save keeps every turn, those dropped from the context too (a load drops them again to fit)
    assert [m["content"] for m in data["messages"] if m["role"] == "user"] == messages
    assert [m["role"] for m in data["messages"]] == ["user", "assistant"] * 6


def test_a_reply_budget_past_the_context_keeps_the_earlier_turns():
    """`/set max_new_tokens 100000` (as long as it takes) reserves at most half the context for
    the reply: short turns keep their history instead of each dropping every earlier one."""
    from specgen.chat.conversation import Conversation
    from specgen.decoding.stats import Stats
    from specgen.decoding.views import Outcome

    class Short:  # a backend of 256 tokens, a token per character, whose replies are "ok"
        target_name, draft_name, context_length = "t", None, 256

        def count(self, messages):
            return sum(len(m["content"]) for m in messages)

        def reply(self, messages, config, renderer):
            return Outcome("ok", [1, 2], Stats("plain", new_tokens=2)), 0

        def configure(self, config):
            return config

    chat = Conversation(Short(), ModelSettings("t", None), GenerationConfig(max_new_tokens=100_000))
    turns = [chat.send("x" * 40, None) for _ in range(3)]
    assert [t.dropped for t in turns] == [0, 0, 0] and len(chat.messages) == 6
    chat.config = GenerationConfig(max_new_tokens=200)  # a budget within the context is reserved whole
    assert chat.send("x" * 40, None).dropped > 0


def test_a_loaded_save_far_past_the_context_is_fitted_and_kept_whole(models, tmp_path):
    """A save keeps every turn, so it may hold many contexts' worth: the next turn drops what
    does not fit (found by bisection, not a re-count per dropped turn) and a save keeps it all."""
    history = [
        {"role": role, "content": f"turn {i}: caches and drafts"}
        for i in range(300)
        for role in ("user", "assistant")
    ]
    long = tmp_path / "long.json"
    long.write_text(json.dumps({"format": "specgen-chat", "version": 1, "messages": history}))
    again = tmp_path / "again.json"
    result = session_run(
        models, ["and now?", f"/save {again}"], "--load", str(long), "-n", "8", "--format", "json"
    )
    assert result.exit_code == 0, result.output
    reply = json_lines(result.stdout)[0]
    assert reply["dropped_turns"] > 280 and reply["conversation_tokens"] + 8 <= 256
    saved = json.loads(again.read_text())["messages"]
    assert saved[:600] == history and saved[600]["content"] == "and now?" and len(saved) == 602


def test_a_message_too_long_for_the_context_leaves_the_session_unchanged(models):
    result = session_run(models, ["hi", "x" * 300, "/stats"], "-n", "4", "--format", "json")
    assert result.exit_code == 1, result.output
    errors = error_lines(result.stderr)
    assert len(errors) == 1 and "context holds 256" in errors[0]
    assert json_lines(result.stdout)[-1]["totals"]["turns"] == 1


# -- ChatSession: cache reuse and Ctrl-C -------------------------------------------------------


class Quiet(PlainRenderer):
    def __init__(self, interrupt_at: int | None = None):
        import io

        super().__init__(out=io.StringIO(), err=io.StringIO())
        self.interrupt_at = interrupt_at

    def on_round(self, view, stats):
        super().on_round(view, stats)
        if stats.rounds == self.interrupt_at:
            raise KeyboardInterrupt


def make_session(tiny_dirs, tiny_pair, method=Method.CHAIN, messages=None, **kwargs):
    target, draft = tiny_pair
    settings = ModelSettings(str(tiny_dirs["target"]), str(tiny_dirs["draft"]), "cpu", None, "float32")
    config = GenerationConfig(method=method, max_new_tokens=16, draft_tokens=3)
    return ChatSession(Pair(target, draft), settings, config, "Be kind.", messages, **kwargs)


def test_a_draft_length_left_to_the_device_stays_so_and_follows_the_method(tiny_dirs, tiny_pair, tmp_path):
    """The conversation keeps "device" as given (its save does too: another machine chooses
    its own); the pair decodes with the device's choice, made again when /method turns to a
    method that drafts chains; "auto" keeps its adaptive schedule through a save."""
    from specgen.chat.saves import read_save
    from specgen.decoding.build import resolve_draft_length

    session = make_session(tiny_dirs, tiny_pair, method=Method.PLAIN)  # -k 3 --draft-confidence 0
    session.set_option("draft_tokens", "device")
    session.set_option("draft_confidence", "device")
    session.set_method("chain")
    assert session.config.device_draft_tokens and session.config.device_confidence
    chosen, _ = resolve_draft_length(session.pair, session.config)
    used = session.backend.config
    assert not used.device_draft_tokens and (used.draft_tokens, used.draft_confidence) == (
        chosen.draft_tokens,
        chosen.draft_confidence,
    )
    assert read_save(session.save(tmp_path / "device.json")).settings["draft_tokens"] == "device"
    session.set_option("draft_tokens", "auto")
    session.load(session.save(tmp_path / "auto.json"))
    assert (session.config.draft_tokens, session.config.schedule.value) == (8, "expected-gain")
    session.set_option("draft_schedule", "fixed")
    assert session.backend.config.schedule.value == "fixed"


def test_cache_reuse_gives_the_reply_of_a_fresh_prefill(tiny_dirs, tiny_pair):
    reusing = make_session(tiny_dirs, tiny_pair)
    reusing.send("hello there", Quiet())
    second = reusing.send("tell me more", Quiet())
    assert second.reused_tokens > 0
    assert second.outcome.stats.prefill_seconds >= 0

    fresh = make_session(tiny_dirs, tiny_pair, messages=reusing.messages[:2])
    expected = fresh.send("tell me more", Quiet())
    assert expected.reused_tokens == 0
    assert second.outcome.token_ids == expected.outcome.token_ids
    assert second.prompt_tokens == expected.prompt_tokens

    # a new drafter (method switch) keeps the target's cache, and greedy plain == greedy chain
    switching = make_session(tiny_dirs, tiny_pair)
    switching.send("hello there", Quiet())
    switching.command("/method plain")
    switched = switching.send("tell me more", Quiet())
    assert switched.reused_tokens > 0 and switched.outcome.stats.method == "plain"
    assert switched.outcome.token_ids == expected.outcome.token_ids


def test_ctrl_c_keeps_the_partial_reply_and_the_next_turn_is_right(tiny_dirs, tiny_pair):
    cut = make_session(tiny_dirs, tiny_pair)
    turn = cut.send("hello there", Quiet(interrupt_at=3))
    assert turn.outcome.interrupted and turn.outcome.token_ids
    assert cut.messages[-1] == {"role": "assistant", "content": turn.outcome.text, "interrupted": True}
    after = cut.send("go on", Quiet())
    assert after.reused_tokens > 0

    fresh = make_session(tiny_dirs, tiny_pair, messages=cut.messages[:2])
    assert fresh.send("go on", Quiet()).outcome.token_ids == after.outcome.token_ids


def test_ctrl_c_during_the_prefill_falls_back_to_a_fresh_prefill(tiny_dirs, tiny_pair):
    cut = make_session(tiny_dirs, tiny_pair)
    cut.send("hello there", Quiet())
    engine, forward = cut.engine, cut.engine._forward

    def interrupted_forward(input_ids, keep=0, row=0):
        engine._forward = forward
        forward(input_ids[:, :2], keep, row)  # part of the prefill happened
        raise KeyboardInterrupt

    engine._forward = interrupted_forward
    turn = cut.send("tell me more", Quiet())
    assert turn.outcome.interrupted and turn.outcome.token_ids == [] and cut.state is None
    after = cut.send("go on", Quiet())
    fresh = make_session(tiny_dirs, tiny_pair, messages=cut.messages[:4])
    assert fresh.send("go on", Quiet()).outcome.token_ids == after.outcome.token_ids


# -- a real terminal ------------------------------------------------------------------------

STARTUP_TIMEOUT = 240  # importing torch and loading models can take minutes on a loaded 2-core machine


def chat_command() -> list[str]:
    return ["-m", "specgen", "chat"]


def spawn_chat(pexpect, models, *args: str, size: tuple[int, int] = (40, 200), **env: str):
    """`specgen chat` on the tiny pair in a real terminal of `size` (rows, columns), TERM=xterm."""
    return pexpect.spawn(
        sys.executable,
        [*chat_command(), *models, *args],
        env=dict(os.environ, TERM="xterm", **env),
        encoding="utf-8",
        timeout=60,
        dimensions=size,
    )


def test_a_real_terminal_session_survives_ctrl_c(models):
    pexpect = pytest.importorskip("pexpect")
    child = spawn_chat(
        pexpect, models, "--max-new-tokens", "200", SPECGEN_CHAT_TEST_DELAY="0.05", COLUMNS="200"
    )
    try:
        child.expect("you>", timeout=STARTUP_TIMEOUT)
        child.sendline("hello")
        child.expect(r"round \d+")  # the reply has started
        child.sendintr()
        child.expect("interrupted")
        child.expect("you>")
        os.kill(child.pid, signal.SIGSTOP)  # a machine too loaded to schedule the chat for a while
        child.send("half a line")
        os.kill(child.pid, signal.SIGCONT)
        # readline echoes what it has read: only then is the text in its buffer. A Ctrl-C sent
        # earlier would find an empty line (the terminal flushes queued input with it) and only
        # ask how to leave: wait for the echo, never for a time.
        child.expect("half a line")
        child.sendintr()  # Ctrl-C over typed text drops the line and stays
        child.expect("you>")
        child.sendline("/set max_new_tokens 4")
        child.expect("max_new_tokens 4")
        child.sendline("again")
        child.expect(r"turn 2 · lookup-chain · \d+ tokens")
        child.expect(r"\((\d+) reused")
        assert int(child.match.group(1)) > 0
        child.expect("you>")
        child.send("\x1b[A\r")  # up arrow: readline history brings back "again"
        child.expect(r"turn 3 · lookup-chain")
        child.expect("you>")
        child.sendeof()
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0, child.before


def test_ctrl_c_twice_at_an_empty_prompt_exits_cleanly(models):
    """One Ctrl-C at an empty prompt says how to leave (the Ctrl-C that stops a reply is often
    pressed twice, and left the chat with the conversation unsaved); a second one leaves."""
    pexpect = pytest.importorskip("pexpect")
    child = spawn_chat(pexpect, models)
    try:
        child.expect("you>", timeout=STARTUP_TIMEOUT)
        child.sendintr()
        child.expect("Ctrl-C again, Ctrl-D or /exit to leave")
        child.expect("you>")
        child.sendline("/set max_new_tokens 2")  # a line in between: the next Ctrl-C asks again
        child.expect("max_new_tokens 2")
        child.expect("you>")
        child.sendintr()
        child.expect("to leave")
        child.expect("you>")
        child.sendintr()
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0


@pytest.mark.parametrize("signum", [signal.SIGHUP, signal.SIGTERM])
def test_a_closed_terminal_or_a_kill_keeps_the_conversation(models, tmp_path, signum):
    """A terminal closed under a chat (SIGHUP) or a kill (SIGTERM) ended it with every turn lost:
    now the conversation is saved as a scripted chat's Ctrl-C saves it, and the exit is 128 + N."""
    pexpect = pytest.importorskip("pexpect")
    child = spawn_chat(pexpect, models, "--max-new-tokens", "3", SPECGEN_CACHE=str(tmp_path / "cache"))
    try:
        child.expect("you>", timeout=STARTUP_TIMEOUT)
        child.sendline("hello")
        child.expect(r"turn 1")
        child.expect("you>")
        os.kill(child.pid, signum)
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 128 + signum
    kept = next((tmp_path / "cache" / "chats").glob("interrupted-*.json"))
    assert json.loads(kept.read_text())["messages"][0]["content"] == "hello"


def test_session_totals_are_the_turns_stats_merged():
    """Chat's totals are Stats.merge of its turns: replay forwards count as in one turn's Stats."""
    from collections import Counter

    from specgen.decoding.stats import Stats

    first = Stats(
        method="chain",
        new_tokens=12,
        rounds=4,
        verified_windows=2,
        drafted=9,
        accepted=6,
        accepted_lengths=Counter({1: 2, 2: 2}),
        prompt_tokens=20,
        reused_tokens=0,
    )
    second = Stats(method="plain", new_tokens=6, rounds=6, prompt_tokens=30, reused_tokens=19, interrupted=1)
    total = first.merge(second)
    assert total.target_forwards == first.target_forwards + second.target_forwards == 12
    assert total.tokens_per_target_forward == 18 / 12 and total.acceptance_rate == 6 / 9
    assert (total.generations, total.interrupted, total.reused_tokens) == (2, 1, 19)
    assert total.accepted_lengths == Counter({1: 2, 2: 2}) and total.method == "mixed"


def test_an_undecodable_line_is_an_error_and_the_session_goes_on(models, tmp_path):
    saved = tmp_path / "after.json"
    script = b"hello\n\xff\xfe bad bytes\nstill here\n/save " + str(saved).encode() + b"\n"
    result = runner.invoke(app, ["chat", *models, "-n", "3", "--format", "json"], input=script)
    assert "Traceback" not in result.output, result.output
    assert result.exit_code == 1
    errors = error_lines(result.stderr)
    assert len(errors) == 1 and "input line 2 is not valid UTF-8" in errors[0], result.stderr
    assert [r["turn"] for r in reply_lines(result.stdout)] == [1, 2]
    assert [m["content"] for m in json.loads(saved.read_text())["messages"][::2]] == ["hello", "still here"]


def test_a_reply_that_fails_is_an_error_and_the_session_goes_on(models, tmp_path, monkeypatch):
    """An engine failure in one turn (once a top_p that fp32 rounds to 0 did it) is one error
    line: the message is not kept, later turns and /save still run, and the caches start afresh."""
    from specgen.decoding import run as driver

    real, calls = driver.generate, []

    def once_broken(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("probability tensor contains either inf, nan or element < 0")
        return real(*args, **kwargs)

    monkeypatch.setattr(driver, "generate", once_broken)
    saved = tmp_path / "after.json"
    result = session_run(
        models, ["first", "second", "third", f"/save {saved}"], "-n", "3", "--format", "json"
    )
    assert result.exit_code == 1  # a scripted session with a failed line does not pass
    errors = error_lines(result.stderr)
    assert len(errors) == 1 and "unexpected RuntimeError: probability tensor" in errors[0], result.stderr
    assert "the conversation goes on" in result.stderr
    assert [m["content"] for m in json.loads(saved.read_text())["messages"][::2]] == ["first", "third"]


def test_ctrl_c_in_a_script_keeps_the_conversation_its_lost_save_would_have(models, tmp_path, monkeypatch):
    """Ctrl-C stops a script and the lines after it, often its /save: the conversation so far
    (the cut reply marked interrupted) is saved on its own, and `--load` continues it."""
    from specgen.cli import chat as chat_cli

    monkeypatch.setenv("SPECGEN_CACHE", str(tmp_path / "cache"))
    real = chat_cli._TurnView.on_round
    calls = []

    def cut(self, view, stats):
        calls.append(1)
        if len(calls) == 5:  # within the second reply (each is at least 4 rounds)
            raise KeyboardInterrupt
        real(self, view, stats)

    monkeypatch.setattr(chat_cli._TurnView, "on_round", cut)
    lost = tmp_path / "never.json"
    result = session_run(models, ["first", "second", f"/save {lost}"], "-n", "4", "-m", "plain")
    assert result.exit_code == 130 and not lost.exists(), result.output
    kept = next((tmp_path / "cache" / "chats").glob("interrupted-*.json"))
    assert f"saved in {kept}" in result.stderr.replace("\n", "")
    messages = json.loads(kept.read_text())["messages"]
    assert [m["content"] for m in messages[::2]] == ["first", "second"] and messages[-1]["interrupted"]
    again = session_run(models, ["/exit"], "--load", str(kept))
    assert again.exit_code == 0, again.output


def test_ctrl_c_while_a_script_waits_for_its_next_line_keeps_the_conversation(models, tmp_path, monkeypatch):
    """A slow producer piping into chat: Ctrl-C (or SIGTERM) comes while the chat waits for a
    line, not in a reply; the conversation was lost then."""
    from specgen.cli import chat as chat_cli

    monkeypatch.setenv("SPECGEN_CACHE", str(tmp_path / "cache"))
    real = chat_cli.decode_text

    def waiting(raw, what):
        if what == "input line 2":
            raise KeyboardInterrupt  # pressed while the chat waited for this line
        return real(raw, what)

    monkeypatch.setattr(chat_cli, "decode_text", waiting)
    result = runner.invoke(app, ["chat", *models, "-n", "3"], input="first\nsecond\n")
    assert result.exit_code == 130, result.output
    kept = next((tmp_path / "cache" / "chats").glob("interrupted-*.json"))
    assert [m["content"] for m in json.loads(kept.read_text())["messages"]][:1] == ["first"]


def test_a_failed_save_makes_a_scripted_session_exit_non_zero(models, tmp_path):
    blocked = tmp_path / "a-file"
    blocked.write_text("not a directory")
    failed = session_run(models, ["hello", f"/save {blocked / 'chat.json'}", "/exit"], "-n", "3")
    assert failed.exit_code == 1, failed.output
    assert len(error_lines(failed.stderr)) == 1 and "cannot write" in failed.stderr
    fine = session_run(models, ["hello", f"/save {tmp_path / 'chat.json'}"], "-n", "3")
    assert fine.exit_code == 0, fine.output


def test_set_seed_out_of_range_is_refused(tiny_dirs, tiny_pair):
    from specgen.errors import ConfigError

    chat_session = make_session(tiny_dirs, tiny_pair)
    with pytest.raises(ConfigError, match="^seed must be in 0.."):
        chat_session.command(f"/set seed {2**64}")
    assert chat_session.config.sampling.seed is None


# -- memory over many turns (issue: chat RSS grew with every turn in bf16) -------------------


def test_a_long_chat_keeps_no_state_per_prompt_length(tiny_dirs, tiny_pair):
    """Every turn prefills a prompt of a new length; nothing may be kept per length (the
    causal masks of prefills were, 75 MB after 150 turns). benchmarks/chat_memory.py measures
    the RSS itself over 300 turns in each dtype."""
    import gc

    import torch

    from specgen.runtime import kvcache

    def live_tensors() -> int:
        gc.collect()
        with warnings.catch_warnings():  # isinstance on every object touches torch's deprecated aliases
            warnings.simplefilter("ignore", FutureWarning)
            return sum(isinstance(o, torch.Tensor) for o in gc.get_objects())

    session = make_session(tiny_dirs, tiny_pair)
    counts = []
    for turn in range(24):
        session.send(f"turn {turn}: tell me about {turn * 7919 % 1000}", Quiet())
        if turn in (8, 23):
            counts.append(live_tensors())
    assert counts[1] <= counts[0], counts  # 15 more prompt lengths, not one tensor more
    cached = kvcache._cached_tree.cache_info().currsize
    mask = kvcache.chain_tree(kvcache.CACHED_WIDTH + 1)  # a prefill's mask: built, not kept
    assert bool(mask[-1].all()) and not bool(mask[0, 1])
    assert kvcache._cached_tree.cache_info().currsize == cached


def test_onednn_kernel_caches_are_bounded_unless_the_user_says_otherwise():
    import subprocess

    code = (
        "import os, specgen; print(os.environ['LRU_CACHE_CAPACITY'], "
        "os.environ['ONEDNN_PRIMITIVE_CACHE_CAPACITY'])"
    )
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY")
    }
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout
    assert out.split() == ["128", "128"]
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=dict(env, LRU_CACHE_CAPACITY="7"),
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out.split() == ["7", "128"]


def test_a_reply_wider_than_the_terminal_is_shown_whole(models, tmp_path):
    """The live view wraps a long reply line: a soft-wrapping console had Rich's Live crop every
    line at the terminal's width, on screen and in the scrollback."""
    import json
    import re

    from specgen.cli.render import visible

    pexpect = pytest.importorskip("pexpect")
    child = spawn_chat(pexpect, models, "--max-new-tokens", "80", size=(50, 30))
    save = tmp_path / "chat.json"
    try:
        child.expect("you>", timeout=STARTUP_TIMEOUT)
        child.sendline("hello")
        child.expect(r"turn 1 ·")
        shown = child.before
        child.expect("you>")
        child.sendline(f"/save {save}")
        child.expect("you>")
        child.sendeof()
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    reply = visible(json.loads(save.read_text())["messages"][-1]["content"])  # as the terminal shows it

    def letters(text: str) -> str:
        return "".join(re.findall(r"[A-Za-z0-9]", re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", text)))

    assert len(letters(reply)) > 10 and letters(reply) in letters(shown)


def test_a_pasted_text_of_several_lines_is_one_message(models):
    """Bracketed paste: the chat asks the terminal to mark a paste (ESC [?2004h; CPython turns it
    off, and each pasted line was sent as a message of its own), and a marked paste's lines stay
    one message."""
    pexpect = pytest.importorskip("pexpect")
    readline = pytest.importorskip("readline")
    if "libedit" in (readline.__doc__ or ""):
        pytest.skip("bracketed paste is GNU readline's; this Python has libedit")
    child = spawn_chat(pexpect, models, "--max-new-tokens", "2")
    try:
        child.expect_exact("\x1b[?2004h", timeout=STARTUP_TIMEOUT)  # readline turns bracketed paste on
        child.expect("you>")
        child.send("\x1b[200~first line\nsecond line\nthird\x1b[201~")
        child.expect("third")
        child.send("\r")
        child.expect(r"turn 1 ·")
        child.expect("you>")
        child.sendline("/stats")
        child.expect(r"turns (\d+)")
        assert child.match.group(1) == "1"
        child.sendeof()
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)


def test_slash_commands_name_what_they_take(tiny_dirs, tiny_pair):
    """/set names the setting, not the command-line flag; a stray argument to /exit is refused, not
    ignored; an unset seed reads `none`; one dropped turn is one turn."""
    from specgen.errors import ConfigError

    session = make_session(tiny_dirs, tiny_pair)
    with pytest.raises(ConfigError, match=r"^temperature must") as bad:
        session.command("/set temperature -1")
    assert "--" not in str(bad.value)
    with pytest.raises(ConfigError, match="takes nothing after it"):
        session.command("/exit now")
    assert session.command("/exit").exit
    assert "seed none" in session.command("/set").message
    session.dropped_turns = 1
    assert "1 old turn dropped" in session.totals_lines()[-1]


@pytest.mark.slow  # over 10 s: the default run stays under 15 minutes
def test_keys_typed_during_a_reply_wait_for_the_next_prompt(models):
    """Keys typed while a reply streams are not echoed into the live view (its lines were
    printed twice); the next prompt's line holds them."""
    pexpect = pytest.importorskip("pexpect")
    child = spawn_chat(pexpect, models, "--max-new-tokens", "60", SPECGEN_CHAT_TEST_DELAY="0.05")
    try:
        child.expect("you>", timeout=STARTUP_TIMEOUT)
        child.sendline("hello")
        child.expect(r"round \d+")
        child.send("typed ahead")
        child.expect(r"turn 1 ·")
        assert "typed ahead" not in child.before
        child.expect("you>")
        child.expect("typed ahead")  # readline shows the keys in the new line
        child.send("\r")
        child.expect(r"turn 2 ·")
        child.sendeof()
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
