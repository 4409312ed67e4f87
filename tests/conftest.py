from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# one torch thread for the engines' forwards (runtime/threads.py would fit them to the free cores:
# tiny models run faster on one, and tests sharing the machine's two cores then do not fight)
os.environ.setdefault("SPECGEN_THREADS", "1")

# A test run started in the background of a script (`pytest &` in a non-interactive shell)
# inherits SIGINT ignored, and an ignored signal stays ignored across exec: every chat, run and
# bench child would then ignore the Ctrl-C the tests press, and those tests would wait out their
# timeouts and fail. A handler, unlike an ignore, is reset to the default by exec.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
# Likewise a run under `nohup` inherits SIGHUP ignored, and specgen leaves an ignored SIGHUP alone
# (under nohup a logout must stop nothing): the tests of a closed terminal would find their
# children deaf to it. A handler that does nothing keeps this process immune to a hang-up, as
# nohup meant, and is reset to the default in every child by exec.
if signal.getsignal(signal.SIGHUP) is signal.SIG_IGN:
    signal.signal(signal.SIGHUP, lambda signum, frame: None)

# Tiny models run faster on one thread (two threads only add synchronisation per op), and
# tests sharing the machine's two cores then do not fight each other.
import torch  # noqa: E402
from tiny import build_tokenizer, save_tiny  # noqa: E402

torch.set_num_threads(1)

# The user's cache, as it was before the session-wide isolation below.
USER_CACHE = os.environ.get("SPECGEN_CACHE")


@pytest.fixture(autouse=True, scope="session")
def isolated_cache(tmp_path_factory):
    """Tests write their caches (int8 weights of tiny models, draft-length choices, CPU format
    measurements) to a temporary directory, never to the user's ~/.cache/specgen."""
    os.environ["SPECGEN_CACHE"] = str(tmp_path_factory.mktemp("specgen-cache"))
    # `specgen serve` sockets too: a user's running server is never found by a test run. A short
    # path: a Unix socket's path holds about 100 bytes.
    runtime = tempfile.mkdtemp(prefix="sg-")
    previous_runtime = os.environ.get("SPECGEN_RUNTIME_DIR")
    os.environ["SPECGEN_RUNTIME_DIR"] = runtime
    yield
    shutil.rmtree(runtime, ignore_errors=True)
    if previous_runtime is None:
        os.environ.pop("SPECGEN_RUNTIME_DIR", None)
    else:
        os.environ["SPECGEN_RUNTIME_DIR"] = previous_runtime
    if USER_CACHE is None:
        os.environ.pop("SPECGEN_CACHE", None)
    else:
        os.environ["SPECGEN_CACHE"] = USER_CACHE


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models on a shared 2-core machine: one thread is ~40x faster than two (contention)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def user_cache(monkeypatch):
    """The user's cache: real-model tests share downloads and conversions with `specgen run`."""
    if USER_CACHE is None:
        monkeypatch.delenv("SPECGEN_CACHE", raising=False)
    else:
        monkeypatch.setenv("SPECGEN_CACHE", USER_CACHE)


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory) -> dict[str, Path]:
    """Saved tiny models: a target, a different draft, and a draft whose tokenizer differs."""
    root = tmp_path_factory.mktemp("tiny")
    return {
        "target": save_tiny(root / "target", seed=1),
        "draft": save_tiny(root / "draft", seed=2, layers=1),
        "odd_draft": save_tiny(root / "odd", seed=3, tokenizer=build_tokenizer("<|odd|>"), vocab=260),
    }


@pytest.fixture(scope="session")
def tiny_pair(tiny_dirs):
    """(target, draft) LoadedModels in fp32 on the CPU, loaded through specgen.models."""
    from specgen.models.load import load_pair

    return load_pair(
        str(tiny_dirs["target"]), str(tiny_dirs["draft"]), device="cpu", dtype="float32", quiet=True
    )
