"""specgen: speculative decoding for language models, shown round by round."""

import os

__version__ = "0.1.0"

# oneDNN (bf16 matmuls on the CPU) keeps every matmul shape it has compiled in two caches, 1024
# entries each by default: ideep's (LRU_CACHE_CAPACITY) and oneDNN's own. Every prompt length is
# a new shape, so a long chat in bf16 grew by about 1 MB a turn for hundreds of turns. 128 holds
# the decode shapes a run reuses; a miss costs 15-20 us of kernel creation. Set here, before torch
# creates its first primitive; a value in the environment wins. (0 crashes ideep: never use it.)
for _name in ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY"):
    os.environ.setdefault(_name, "128")
del _name


def _hold_standard_descriptors() -> None:
    """A standard descriptor the caller closed (`specgen ... 2>&-`) is held by /dev/null before
    anything opens a file: the next file opened would take its number, and a note meant for
    stderr would be written into it (or fail with EBADF). Python's own sys.stdin/stdout/stderr
    stay None for the command to decide (cli.app.main)."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            null = os.open(os.devnull, os.O_RDWR)
            if null != fd:
                os.dup2(null, fd)
                os.close(null)


_hold_standard_descriptors()
