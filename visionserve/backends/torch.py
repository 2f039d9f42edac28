"""torch backend: a ``torch.export`` program (``model.pt2``), eager on the CPU, CUDA graphs on a
GPU.

On CUDA the model runs in ``runtime.precision`` (fp16/bf16; fp32 stays fp32) with channels_last
weights, on the runner's own high-priority stream. At warm-up one CUDA graph is captured per
preferred batch size, with static input and output buffers; ``run`` copies the batch into the
static input and replays the graph. A batch size without a graph (larger than the largest
preferred size) runs eagerly. The graphs share one memory pool: they are replayed one at a time
on one stream and each output is copied out before the next replay, so sharing is safe.

Inputs may be numpy arrays (the CPU preprocessing path, and the engine's warm-up) or torch
tensors already on the device (the GPU preprocessing path). Outputs are named: a program that
returns a dict of tensors names them by its keys; other outputs are numbered ``output0``,
``output1``, ... in the order the program returns them. They come back as numpy arrays
(floating point as float32), copied through pinned buffers and waited for with an event, never
a device-wide synchronisation; or, when the task asks (``select_outputs(on_device=True)``), as
the device tensors themselves, valid until the next ``run``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from ..config import ModelConfig
from ..errors import ConfigError, InternalError
from . import checks
from .base import NP_DTYPES, Backend, Outputs, input_shape

log = logging.getLogger(__name__)

_PRECISION = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
WARMUP_ITERS = 3  # eager runs before capture: cuDNN picks its kernels, lazy inits happen


def _declared(program: Any) -> tuple[list[checks.Dim], list[list[checks.Dim]]] | None:
    """The first user input's and every user output's shapes as the exported program records
    them (a dynamic axis with its range); None when the program does not say. Its dtypes are not
    checked: the backend casts the input to the compute precision."""
    try:
        sig = program.graph_signature
        nodes = list(program.graph.nodes)
        inp = next(n for n in nodes if n.op == "placeholder" and n.name == sig.user_inputs[0])
        outs = {getattr(a, "name", None): a
                for a in next(n for n in nodes if n.op == "output").args[0]}
        return (_dims(inp.meta["val"].shape, program.range_constraints),
                [_dims(outs[name].meta["val"].shape, program.range_constraints)
                 for name in sig.user_outputs])
    except (AttributeError, IndexError, KeyError, StopIteration, TypeError):
        return None


def _output_names(program: Any) -> tuple[tuple[str, ...], bool]:
    """(names of the program's outputs in the order it returns them, whether they are its own):
    a dict of tensors' keys, else ``output0``, ``output1``, ..."""
    try:
        spec = program.call_spec.out_spec
        kids = spec.children() if hasattr(spec, "children") else spec.children_specs
        if spec.type is dict and all(k.is_leaf() for k in kids):
            return tuple(str(k) for k in spec.context), True
        return tuple(f"output{i}" for i in range(spec.num_leaves)), False
    except (AttributeError, TypeError):
        return ("output0",), False


def _dims(shape: Any, ranges: dict) -> list[checks.Dim]:
    dims: list[checks.Dim] = []
    for d in shape:
        if isinstance(d, int):
            dims.append(d)
            continue
        vr = ranges.get(getattr(getattr(d, "node", None), "expr", None))
        try:  # only the most: torch records 2 as the least of an axis that still takes 1
            top = int(vr.upper) if vr is not None and vr.upper.is_finite else None
        except (AttributeError, TypeError, ValueError):
            top = None
        dims.append((0, top))
    return dims



def portable(module: Any) -> Any:
    """An exported program's module without the checks torch.export puts before each ``.to()``
    of the traced code (``aten._assert_tensor_metadata``: the dtype and device seen when it was
    exported). A model exported on the CPU in fp32 that casts inside (``x.float()`` to keep a
    sum in fp32) would otherwise fail on a GPU, or in fp16, with "Tensor device mismatch" /
    "Tensor dtype mismatch"; the casts themselves stay."""
    import torch

    check = torch.ops.aten._assert_tensor_metadata.default
    graph = module.graph
    dropped = [n for n in graph.nodes if n.op == "call_function" and n.target is check
               and not n.users]
    for node in dropped:
        graph.erase_node(node)
    if dropped:
        module.recompile()
    return module

Read = tuple[Any, Any, tuple[tuple[str, ...], bool]]  # module, _declared, _output_names


_FORCE_WEIGHTS_ONLY = "TORCH_FORCE_WEIGHTS_ONLY_LOAD"  # torch.load reads it at each call
_env_lock = threading.Lock()


@contextlib.contextmanager
def _weights_only():
    """Every ``torch.load`` inside reads tensors and plain data only. ``torch.export.load``
    unpickles parts of the archive (weights, constants, sample inputs) with ``weights_only=False``:
    a crafted file ran its own code there. Set for the read only: guard jobs inherit the
    environment of this process."""
    with _env_lock:
        before = os.environ.get(_FORCE_WEIGHTS_ONLY)
        os.environ[_FORCE_WEIGHTS_ONLY] = "1"
        try:
            yield
        finally:
            if before is None:
                os.environ.pop(_FORCE_WEIGHTS_ONLY, None)
            else:
                os.environ[_FORCE_WEIGHTS_ONLY] = before


def read_program(path: Path) -> Read:
    """``torch.export.load`` and what the backend takes from the program: its module (made
    :func:`portable`), declared shapes and output names. Pure Python for the most part: for
    ResNet-50, 1.8-5 s that keep the interpreter (see :func:`read_isolated`).

    Pickled parts of the archive are read as tensors and plain data only, and the program's
    guard code (Python source in the archive, which the module would run on every call) is left
    out: the serving path checks the input against model.toml itself. The archive's symbolic
    shapes are still evaluated by sympy, so a program file stays code the server runs
    (docs/security.md, model files)."""
    import torch

    try:
        with _weights_only():
            program = torch.export.load(str(path))
        program._guards_code = []
        module = program.module()
    except Exception as exc:  # noqa: BLE001 - torch raises several types for a bad archive
        why = str(exc).splitlines()[0][:500]
        if "Weights only load failed" in why:  # torch's own words for a refused pickle
            why = ("it holds pickled Python objects other than tensors and plain data, which can "
                   "run code and are not read (docs/security.md#model-files); export the model "
                   "again with torch.export.save")
        raise ConfigError(f"{path}: torch cannot load the exported program: {why}") from None
    return portable(module), _declared(program), _output_names(program)


def _tensors(module: Any) -> dict[str, dict[str, Any]]:
    """The module's tensors by qualified name, by kind: parameters, buffers, and plain tensor
    attributes (lifted constants)."""
    import torch

    out: dict[str, dict[str, Any]] = {"parameters": {}, "buffers": {}, "attributes": {}}
    for prefix, sub in module.named_modules(remove_duplicate=False):
        dot = f"{prefix}." if prefix else ""
        for name, value in vars(sub).items():
            if isinstance(value, torch.Tensor):
                out["attributes"][dot + name] = value.detach()
        for name, p in sub._parameters.items():
            if p is not None:
                out["parameters"][dot + name] = p.detach()
        for name, b in sub._buffers.items():
            if b is not None:
                out["buffers"][dot + name] = b
    return out


def _save_read(path: str, out: str) -> None:
    """The child process of :func:`read_isolated`: :func:`read_program`, saved to ``out`` as
    tensors and plain data (``torch.load(weights_only=True)`` reads it): the module's tensors by
    name, its generated code and imports, its input and output specs as JSON, and the rest as
    they are."""
    import torch
    from torch.utils._pytree import treespec_dumps

    module, declared, names = read_program(Path(path))
    # torch.export puts an input check (guards against the exported shapes) in a submodule whose
    # forward cannot be saved; the serving path checks the input against model.toml itself
    guards = [n for n in module.graph.nodes
              if n.op == "call_module" and n.target == "_guards_fn" and not n.users]
    for node in guards:
        module.graph.erase_node(node)
    if hasattr(module, "_guards_fn"):
        module.delete_submodule("_guards_fn")
    plain = torch.fx.GraphModule(module, module.graph)  # without the program's Python hooks
    _, (body, imports) = plain.__reduce__()
    specs = {k: treespec_dumps(body[k]) for k in ("_in_spec", "_out_spec") if body.get(k)}
    torch.save({"code": body["_code"], "imports": imports, "specs": specs,
                "tensors": _tensors(plain), "declared": declared, "names": names}, out)


def _rebuild(saved: dict[str, Any]) -> Any:
    """The module :func:`_save_read` saved: its code compiled here (not traced again), its
    tensors in place as parameters, buffers or attributes, as the child's module had them."""
    import torch
    from torch.fx.graph_module import _forward_from_src
    from torch.utils._pytree import treespec_loads

    forward = _forward_from_src(saved["imports"] + saved["code"], {})
    module: Any = type("ExportedModule", (torch.nn.Module,), {"forward": forward})()
    for key, spec in saved["specs"].items():
        setattr(module, key, treespec_loads(spec))
    for kind, tensors in saved["tensors"].items():
        for name, t in tensors.items():
            owner = module
            *path, leaf = name.split(".")
            for part in path:
                if not hasattr(owner, part):
                    owner.add_module(part, torch.nn.Module())
                owner = getattr(owner, part)
            if kind == "parameters":
                owner.register_parameter(leaf, torch.nn.Parameter(t, requires_grad=False))
            elif kind == "buffers":
                owner.register_buffer(leaf, t)
            elif leaf not in owner._parameters and leaf not in owner._buffers:
                setattr(owner, leaf, t)
    return module


def read_isolated(path: Path) -> Read:
    """:func:`read_program` in a child process, for a load beside serving versions.

    Deserialising an exported program is pure Python: on the H200 the serving threads got too
    small a share of the interpreter while it ran, and frames waited for up to a second during a
    swap (docs/benchmarks.md, model swaps on the H200). The child reads the program and saves its
    module's code and tensors; this process maps the tensors (``mmap``, tensors and plain data
    only) and compiles the code, without tracing it again. The child runs at the calling
    thread's priority. If the child cannot do it for a reason other than the model file, the
    program is read here after all."""
    import torch

    t0 = time.monotonic()
    try:
        with tempfile.TemporaryDirectory(prefix="visionserve-read-") as tmp:
            out = Path(tmp) / "program.pt"
            root = str(Path(__file__).resolve().parents[2])  # where the visionserve package is
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(
                p for p in (root, os.environ.get("PYTHONPATH", "")) if p)}
            child = subprocess.run([sys.executable, "-m", "visionserve.backends.torch", "--read",
                                    str(path), str(out)], env=env, capture_output=True,
                                   text=True, check=False)
            if child.returncode == READ_FAILED:  # the model file's fault: say so, as in-process
                raise ConfigError(child.stdout.strip() or f"{path}: torch cannot load the program")
            if child.returncode != 0:
                raise RuntimeError(f"exit {child.returncode}: {child.stderr.strip()[-500:]}")
            saved = torch.load(out, mmap=True, weights_only=True)  # mapped: outlives the file
        module = _rebuild(saved)
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - any other failure: read it here after all
        log.warning("reading %s in a child process failed (%s); reading it in the serving "
                    "process", path, exc)
        return read_program(path)
    log.info("read %s in a child process in %.1f s", path, time.monotonic() - t0)
    return module, saved["declared"], saved["names"]


@contextlib.contextmanager
def _cudnn_autotuning(on: bool):
    """cuDNN's benchmark mode for the eager warm-up runs: each convolution's candidate kernels
    are timed on its first run and the fastest is kept in torch's plan cache, which the CUDA
    graphs captured after it reuse (the capture itself runs with the mode as it was, so no
    timing happens inside one). The mode is process-wide; loads run one at a time."""
    import torch

    before = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = before or on
    try:
        yield
    finally:
        torch.backends.cudnn.benchmark = before


READ_FAILED = 3  # the child's exit status when the model file is at fault (message on stdout)


class TorchBackend(Backend):
    model_file = "model.pt2"
    platform = "pytorch_libtorch"
    device_memory = "torch"
    #: time cuDNN's candidate kernels at warm-up instead of taking its heuristic's choice: off,
    #: the tuned kernels were no faster; the GPU benchmark's kernel comparison turns it on
    cudnn_autotune = False

    def __init__(self) -> None:
        self._module: Any = None
        self.stream: Any = None  # the runner's CUDA stream (None on the CPU)
        self.compute_dtype: Any = None
        self.input_dtype: Any = None  # what the model's first layer takes on this device
        self.channels_last = False
        # bs -> (graph, static in, static outputs by name)
        self._graphs: dict[int, tuple[Any, Any, dict[str, Any]]] = {}
        self._static_in: Any = None
        self._pool: Any = None
        self._out_host: dict[str, Any] = {}  # pinned output buffers, by name
        self._done: Any = None  # event after the output copy
        self._names: tuple[str, ...] = ()  # every output, in the order the program returns them
        self._selected: tuple[str, ...] = ()  # what run returns
        self._keep_on_device = False
        self.eager_runs = 0
        self.graph_runs = 0

    # -- load ---------------------------------------------------------------------------------

    def load(self, path: Path, config: ModelConfig, device: str) -> None:
        from ..extras import require

        torch = require("torch", f"{path}: runtime.backend = \"torch\"")
        self.config = config
        self.device = device
        module, declared, (self._names, named) = \
            read_isolated(path) if self.isolated else read_program(path)
        if declared is not None:  # the program's own shapes, before anything moves to the device
            checks.check_input(checks.Subject(Path(path)), config, declared[0])
        dims = declared[1] if declared is not None and len(declared[1]) == len(self._names) \
            else [None] * len(self._names)
        self.outputs = tuple(checks.TensorSpec(n, tuple(d) if d is not None else None, None, named)
                             for n, d in zip(self._names, dims))
        self._selected = self._names
        cuda = device.startswith("cuda")
        if cuda:
            if not torch.cuda.is_available():
                raise ConfigError(f"{path}: device {device} asked for but torch sees no CUDA "
                                  "device")
            from ..gpu.memory import high_priority_stream

            self.stream = high_priority_stream(device)
            self.compute_dtype = getattr(torch, _PRECISION[config.runtime.precision])
            self.channels_last = config.input.layout == "NCHW"
            self.static_shapes = True  # CUDA graphs, one per preferred batch size
            self.device_outputs = True
        else:
            self.compute_dtype = torch.float32  # CPU: half precision is slow and inexact there
            self.channels_last = False
        self.input_dtype = torch.uint8 if config.input.dtype == "uint8" else self.compute_dtype
        # the copies and casts on a stream of their own, not on this thread's default (the legacy
        # stream, which synchronises with every blocking stream): a version may load beside
        # serving ones (docs/benchmarks.md, model swaps on the H200)
        side = torch.cuda.Stream(device=device) if cuda else None
        try:
            with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
                module = module.to(device=torch.device(device))
                if self.compute_dtype != torch.float32:
                    module = module.to(self.compute_dtype)
                if self.channels_last:
                    module = module.to(memory_format=torch.channels_last)
            if side is not None:
                side.synchronize()
        except Exception as exc:  # noqa: BLE001 - any failure here is the model's or the device's
            raise ConfigError(f"{path}: cannot move the model to {device} / "
                              f"{config.runtime.precision}: {exc}") from None
        self._module = module
        log.info("torch loaded %s on %s (%s%s)", path, device, config.runtime.precision
                 if cuda else "fp32", ", channels_last" if self.channels_last else "")

    def select_outputs(self, names, on_device: bool = False) -> None:
        unknown = [n for n in names if n not in self._names]
        if unknown:
            raise ValueError(f"outputs {unknown} are not among the model's {list(self._names)}")
        self._selected = tuple(names) or self._names
        self._keep_on_device = on_device and self.device_outputs

    def _named(self, out: Any) -> dict[str, Any]:
        """The selected outputs of the module's return value, by name; floating point as float32."""
        from torch.utils._pytree import tree_leaves

        leaves = dict(zip(self._names, tree_leaves(out)))
        return {n: (t.float() if t.is_floating_point() else t) for n, t in
                ((n, leaves[n]) for n in self._selected)}

    # -- warm-up: CUDA graphs -----------------------------------------------------------------

    def warmup(self, batch_sizes: tuple[int, ...]) -> None:
        import torch

        assert self.config is not None
        if self.stream is None:
            for bs in batch_sizes:
                dtype = NP_DTYPES[self.config.input.dtype]
                self.run(np.zeros(input_shape(self.config, bs), dtype=dtype))
            return
        top = max(batch_sizes)
        shape = input_shape(self.config, top)
        fmt = torch.channels_last if self.channels_last else torch.contiguous_format
        with torch.cuda.stream(self.stream), torch.inference_mode():
            self._static_in = torch.zeros(shape, dtype=self.input_dtype, device=self.device
                                          ).contiguous(memory_format=fmt)
            # Eager warm-up before any capture (lazy initialisation and cuDNN autotuning must
            # not happen inside one), on this runner's stream: the activations it leaves cached
            # are reused there by the GPU preprocessing.
            with _cudnn_autotuning(self.cudnn_autotune):
                for bs in sorted(batch_sizes):
                    for _ in range(WARMUP_ITERS):
                        outs = self._named(self._module(self._static_in[:bs]))
            # pinned host buffers, one per output, as large as the largest batch's
            self._out_host = {n: torch.empty(tuple(t.shape), dtype=t.dtype, pin_memory=True)
                              for n, t in outs.items()}
            self._capture(batch_sizes)
            self.stream.synchronize()
            # replay each once so a broken capture fails here, not on the first request
            for bs in batch_sizes:
                self._replay(bs, None)
            self.stream.synchronize()
        log.info("torch captured CUDA graphs for batch sizes %s", sorted(self._graphs))

    def _capture(self, batch_sizes: tuple[int, ...]) -> None:
        """One graph per batch size."""
        import torch

        self._done = torch.cuda.Event()  # recorded after the output copies of each batch
        # Captured on a stream of their own, without torch.cuda.graph's context manager: it
        # synchronises the device and empties the allocator's cache before every capture,
        # which, for a version loaded beside serving ones (a swap), stalled their batches
        # and made them allocate their cached blocks again.
        capture = torch.cuda.Stream(device=self.device)
        capture.wait_stream(self.stream)
        with torch.cuda.stream(capture):
            # Largest first: later (smaller) captures reuse the shared pool's blocks.
            for bs in sorted(batch_sizes, reverse=True):
                graph = torch.cuda.CUDAGraph()
                static_in = self._static_in[:bs]
                # thread_local: other runners' threads may touch CUDA while this captures
                graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
                try:
                    # the float32 cast is part of the graph: no temporary at fetch time
                    static_out = self._named(self._module(static_in))
                finally:
                    graph.capture_end()
                if self._pool is None:
                    self._pool = graph.pool()
                self._graphs[bs] = (graph, static_in, static_out)
        self.stream.wait_stream(capture)

    # -- run ----------------------------------------------------------------------------------

    def run(self, batch: Any) -> Outputs:
        import torch

        assert self._module is not None
        n = int(batch.shape[0])
        if self.stream is None:
            with torch.inference_mode():
                x = torch.from_numpy(np.ascontiguousarray(batch)) if isinstance(batch, np.ndarray) \
                    else batch
                self.eager_runs += 1
                outs = self._named(self._module(x.to(self.input_dtype)))
                return {k: t.numpy() for k, t in outs.items()}
        try:
            with torch.cuda.stream(self.stream), torch.inference_mode():
                x = self._to_device(batch)
                if n in self._graphs:
                    return self._replay(n, x)
                return self._eager(x)
        except torch.cuda.OutOfMemoryError as exc:
            raise InternalError(f"GPU out of memory running a batch of {n}: {exc}") from None

    def _to_device(self, batch: Any) -> Any:
        import torch

        if isinstance(batch, np.ndarray):
            # the engine's warm-up and CPU-prepared batches: pageable, rare on the GPU path
            return torch.from_numpy(np.ascontiguousarray(batch)).to(self.device, non_blocking=False)
        return batch

    def _replay(self, bs: int, x: Any) -> Outputs:
        graph, static_in, static_out = self._graphs[bs]
        if x is not None:
            static_in.copy_(x)  # casts dtype and layout on the device
        graph.replay()
        self.graph_runs += 1
        return self._fetch(static_out)

    def _eager(self, x: Any) -> Outputs:
        import torch

        if self.channels_last and x.dim() == 4:
            x = x.contiguous(memory_format=torch.channels_last)
        self.eager_runs += 1
        return self._fetch(self._named(self._module(x.to(self.input_dtype))))

    def _fetch(self, outs: dict[str, Any]) -> Outputs:
        if self._keep_on_device:  # the task reads them on this stream, before the next run
            return outs
        hosts = {}
        for name, out in outs.items():
            host = self._out_host.get(name)
            if host is None or out.shape[0] > host.shape[0] or out.shape[1:] != host.shape[1:]:
                return {k: v.cpu().numpy() for k, v in outs.items()}  # eager: larger than any graph
            host = host[:out.shape[0]]
            host.copy_(out, non_blocking=True)
            hosts[name] = host
        self._done.record(self.stream)
        self._done.synchronize()
        return {k: h.numpy().copy() for k, h in hosts.items()}

    def close(self) -> None:
        self._graphs.clear()
        self._module = None
        self._static_in = None
        self._pool = None

    def describe(self) -> dict[str, str]:
        cfg = self.config
        info = {"device": self.device, "backend": "torch"}
        if cfg is not None:
            info["precision"] = cfg.runtime.precision if self.stream is not None else "fp32"
        if self._graphs:
            info["cuda_graphs"] = ",".join(str(b) for b in sorted(self._graphs))
        if self._graphs and self.cudnn_autotune:
            info["cudnn_autotune"] = "on"
        if self.channels_last:
            info["memory_format"] = "channels_last"
        return info


if __name__ == "__main__":  # python -m visionserve.backends.torch --read PATH OUT (read_isolated)
    if sys.argv[1:2] != ["--read"] or len(sys.argv) != 4:
        sys.exit("usage: python -m visionserve.backends.torch --read MODEL.pt2 OUT")
    try:
        _save_read(sys.argv[2], sys.argv[3])
    except ConfigError as exc:
        print(exc.message)
        sys.exit(READ_FAILED)
