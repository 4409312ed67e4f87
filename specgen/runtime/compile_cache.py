"""torch's compile caches kept with specgen's own cache, so a compiled run starts fast the second time.

`--compile inductor` (the default on CUDA) compiles each decoder layer with inductor at the
first forward of every new process: tens of seconds on a GPU (43-62 s before the first token
measured on an H100). inductor can keep what it compiled on disk (its FX graph cache and
AOTAutograd's cache) and load it in a later process instead of compiling again; by default it
keeps them under /tmp, which machines clear. Here they live in `$SPECGEN_CACHE/compile/`, one
directory per torch version (a newer torch would not read an older one's), unless
TORCHINDUCTOR_CACHE_DIR is set. The state (cold or warm) is said once per process, so a slow
first start explains itself.
"""

from __future__ import annotations

import enum
import os
from pathlib import Path

import torch

from specgen.files import cache_root
from specgen.status import note


class CompileCache(enum.Enum):
    COLD = "cold"  # nothing compiled on this machine yet: this run compiles and stores
    WARM = "warm"  # an earlier run stored compiled graphs: this run loads them


_said = False


def directory() -> Path:
    """TORCHINDUCTOR_CACHE_DIR when the user set it, else ours. inductor writes its /tmp
    default into the environment once it has looked it up, so that value counts as unset."""
    # only when compiling (dynamo, inductor)
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    chosen = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if chosen and os.path.abspath(chosen) != os.path.abspath(default_cache_dir()):
        return Path(chosen)
    return cache_root() / "compile" / f"torch-{torch.__version__}"


def use_persistent_cache(quiet: bool = False) -> CompileCache:
    """Point inductor's caches at `directory()` and turn them on; say once whether they are warm."""
    global _said
    import torch._functorch.config as functorch_config  # only when compiling (as compiled.py's dynamo)
    import torch._inductor.config as inductor_config

    where = directory()
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(where)
    inductor_config.fx_graph_cache = True
    functorch_config.enable_autograd_cache = True
    state = CompileCache.WARM if any((where / "fxgraph").glob("*")) else CompileCache.COLD
    if not quiet and not _said:
        _said = True
        if state is CompileCache.COLD:
            note(
                f"specgen: compiling the model's layers; no compile cache yet in {where} "
                "(this first compiled start is slow; later ones load what it stores)"
            )
        else:
            note(f"specgen: compiling the model's layers from the compile cache in {where}")
    return state
