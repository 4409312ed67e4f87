"""A model's forwards over a SlotCache: eager, or at fixed shapes replayed as CUDA graphs.

`Steps` is the one way the engine and the drafters call a model. Eagerly, attention reads only
the used prefix of the cache. With a fixed-shape mode, forwards whose width is in `WIDTHS`
read the cache's whole capacity, so their shapes never change while the capacity holds, and:

* `graphs`: each (rows, width, offset) shape is run
  once eagerly on a side stream (that run's result is used) and captured as a
  `torch.cuda.CUDAGraph`; later calls copy their inputs into the graph's static buffers and
  replay it with one launch. Capture costs about one forward, not a compilation.
* `inductor` (the default on CUDA): as `graphs`, with each decoder layer compiled first by inductor
  (`nn.Module.compile`: "regional" compilation, one compiled layer reused by every layer), so
  a captured step launches a few fused kernels per layer instead of dozens of small ones.
  One compiled layer serves every layer (the layer index is not specialised, and the cache
  write is kept out of the compiled region), so compilation happens once per process and
  shape family rather than once per layer and shape. Every forward then reads the whole
  capacity (also eagerly), so the compiled layers see stable shapes.
* `fixed`: the fixed-shape path run eagerly (the CPU tests use it to prove the full-capacity
  view and the tree padding exact without a GPU).

Prefills (any length) are never captured. Tree forwards are padded to the next width in `WIDTHS` with
nodes that see only the cache and themselves, and cut off again.
"""

from __future__ import annotations

import time
import weakref

import torch

from specgen.errors import ConfigError
from specgen.runtime import compile_cache, kvcache
from specgen.runtime.lean import call_for

WIDTHS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16, 24, 32)
MODES = ("off", "graphs", "inductor", "fixed")
_COMPILED = weakref.WeakSet()  # models whose decoder layers are compiled (once per model)


def decoder_layers(model):
    """The repeated decoder layers of a causal LM (Qwen2, Llama, ... : model.model.layers)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", None)
    layers = getattr(decoder, "layers", None)
    return list(layers) if layers is not None else []


def compile_layers(model) -> None:
    if model in _COMPILED:
        return
    import torch._dynamo  # only when compiling: importing it costs every eager start a second or more

    kvcache.keep_update_out_of_compiled_regions()
    compile_cache.use_persistent_cache()
    # widths, prefill lengths and both models share the layer's code: allow the recompiles;
    # the layer index (an int attribute) must not specialise one compiled layer per layer
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    torch._dynamo.config.allow_unspec_int_on_nn_module = True
    for layer in decoder_layers(model):
        layer.compile()
    _COMPILED.add(model)


def resolve_compile(value: str | bool | None, device) -> str:
    """--compile auto|on|off|graphs|inductor -> a mode. auto and on: inductor on CUDA (the fastest
    measured: benchmarks/gpu.md); auto is off on the CPU, where graphs do not exist and no
    compiled mode was measured faster than eager; on is inductor there."""
    value = {True: "on", False: "off", None: "auto"}.get(value, value).strip().lower()
    cuda = torch.device(device).type == "cuda"
    if value == "auto":
        return "inductor" if cuda else "off"
    if value == "on":
        value = "inductor"
    if value not in MODES:
        raise ConfigError(f"--compile must be auto, on, off, graphs or inductor, got {value!r}")
    if value == "graphs" and not cuda:
        raise ConfigError("--compile graphs needs a CUDA device; use auto, off or inductor on the CPU")
    return value


def can_capture(model) -> str | None:
    """Why the model's forward cannot be captured whole (None if it can)."""
    device_map = getattr(model, "hf_device_map", None) or {}
    if len({str(d) for d in device_map.values()}) > 1:
        return "the model is split over several devices"
    return None


class GraphStep:
    """One forward shape captured as a CUDA graph, with static input buffers."""

    def __init__(self, model, cache, input_ids, bases, offset, depth, tree, keep, pool):
        self.model, self.cache, self.offset, self.keep = model, cache, offset, keep
        self.ids, self.bases, self.depth, self.tree = (t.clone() for t in (input_ids, bases, depth, tree))
        stream = torch.cuda.Stream(device=input_ids.device)
        stream.wait_stream(torch.cuda.current_stream(input_ids.device))
        with torch.cuda.stream(stream):
            # warm-up: lazy library inits and any compilation happen here, never during capture; the
            # second run rewrites the same slots with the same K/V, and its result is this call's
            for _ in range(2):
                self.first = self._run().clone()
        torch.cuda.current_stream(input_ids.device).wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.logits = self._run()

    def _run(self) -> torch.Tensor:
        return kvcache.run(
            self.model,
            self.cache,
            self.ids,
            self.bases,
            self.offset,
            self.depth,
            self.tree,
            self.cache.capacity,
            self.keep,
        )

    def __call__(self, input_ids, bases, depth, tree) -> torch.Tensor:
        if self.first is not None:
            first, self.first = self.first, None
            return first
        self.ids.copy_(input_ids)
        self.bases.copy_(bases)
        self.depth.copy_(depth)
        self.tree.copy_(tree)
        self.graph.replay()
        return self.logits.clone()  # the output buffer is overwritten by the next replay


class Steps:
    """The forwards of one model; fixed widths go through the chosen fixed-shape mode."""

    def __init__(self, model, compile: str | bool = "off", exact: bool = True):
        self.model = model
        self.mode = {True: "graphs", False: "off"}.get(compile, compile) or "off"
        self.notice = None
        self.graphs: dict = {}
        self.pool = None
        self.cuda = next(model.parameters()).device.type == "cuda"
        self.setup_seconds = 0.0  # spent capturing graphs (and compiling the shapes they hold)
        if self.mode in ("graphs", "inductor"):
            self.notice = can_capture(model)
            if self.notice is not None:
                self.mode = "off"
        if self.mode == "inductor":
            compile_layers(model)
        # what the forwards call: compiled layers are the model's own modules; else, on the CPU,
        # the lean forward (the same ops with less Python: lean.py; exact=False for a draft)
        self.call = model if self.mode in ("graphs", "inductor") else call_for(model, exact)

    @property
    def fixed(self) -> bool:
        return self.mode != "off"

    def _runner(self, width: int):
        if self.mode == "off" or width not in WIDTHS:
            return None
        return self._graph if self.cuda and self.mode != "fixed" else self._fixed

    def _fixed(self, cache, input_ids, bases, offset, depth, tree, keep):
        return kvcache.run(self.call, cache, input_ids, bases, offset, depth, tree, cache.capacity, keep)

    def _graph(self, cache, input_ids, bases, offset, depth, tree, keep):
        key = (cache.serial, cache.generation, cache.rows, input_ids.shape[1], offset, keep)
        step = self.graphs.get(key)
        if step is None:
            stale = [k for k in self.graphs if k[0] == cache.serial and k[1] != cache.generation]
            for k in stale:  # the cache's buffers were reallocated (grown, rows joined or left)
                del self.graphs[k]
            if stale:  # a pool whose graphs are all gone is released: capturing into it again
                self.pool = None  # fails an allocator assert (seen on an H100), so take a fresh one
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            started = time.perf_counter()
            step = self.graphs[key] = GraphStep(
                self.model, cache, input_ids, bases, offset, depth, tree, keep, self.pool
            )
            self.setup_seconds += time.perf_counter() - started
        return step(input_ids, bases, depth, tree)

    def forward(self, cache, input_ids: torch.Tensor, keep: int = 0, **kwargs) -> torch.Tensor:
        runner = self._runner(input_ids.shape[1])
        return kvcache.forward(
            self.call, cache, input_ids, keep=keep, runner=runner, full_view=self.mode == "inductor", **kwargs
        )

    def tree(
        self, cache, tokens: torch.Tensor, tree, offset: int = 0, nodes: slice | None = None
    ) -> torch.Tensor:
        """Logits [1, n, V] for tree nodes (all, or `nodes`) fed at once with the ancestor mask."""
        ancestors = tree.ancestor_mask.to(tokens.device)
        depth = torch.tensor(tree.depth, device=tokens.device)
        if nodes is not None:  # the nodes fed before them are in flight: their depths stay
            ancestors, depth, tokens = ancestors[nodes, : nodes.stop], depth[: nodes.stop], tokens[nodes]
        n = tokens.shape[0]
        width = next((w for w in WIDTHS if w >= n), n) if self.fixed else n
        if width > n:  # pad to a fixed width: pads see the cache and themselves only
            pad = width - n
            tokens = torch.cat([tokens, tokens.new_zeros(pad)])
            depth = torch.cat([depth, depth.new_zeros(pad)])
            grown = torch.zeros(width, ancestors.shape[1] + pad, dtype=torch.bool, device=tokens.device)
            grown[:n, : ancestors.shape[1]] = ancestors
            grown[n:, ancestors.shape[1] :] = torch.eye(pad, dtype=torch.bool, device=tokens.device)
            ancestors = grown
        logits = self.forward(cache, tokens.unsqueeze(0), offset=offset, depth=depth, tree=ancestors)
        if width > n:
            kvcache.crop(cache, kvcache.cache_length(cache) - (width - n))
        return logits[:, :n]
