"""The compiled forward's position-wise parts as compiled packages, built once per machine, kept on disk.

A decoder layer's position-wise parts (``llama.pre_attention``, ``llama.post_attention``) are
pure functions of a feed's tokens flattened to ``[P, H]`` and the layer's weights. Exported
with P dynamic and compiled ahead of time (AOTInductor), one package per part, layer shape and
product order serves every layer of every model of that shape (a target and its layer draft
share theirs), every row count and every block length. A package is a shared library: a later
process loads it in well under a second, where compiling it takes tens of seconds. They live
under ``cache_root()/graphs``, named by a digest of everything the code they hold depends on.

``CompiledParts`` hands the forward each part compiled where its package is loaded, else the
part as it is: a forward never waits for a compile. ``build`` compiles what is missing, on
the calling thread or in the background (a server answers meanwhile and switches part by part).
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import os
import pathlib
import threading
import time
import warnings
from dataclasses import astuple, dataclass

import torch

from . import llama, products

FORMAT = 1  # bump when what a package computes changes in a way its digest cannot see
PARTS = {"pre": llama.pre_attention, "post": llama.post_attention}
MAX_POSITIONS = 1 << 22  # positions one compiled part takes at most (a long batched prefill)


@dataclass(frozen=True)
class PartKey:
    """One compiled package: a part, for a layer shape, in one product order, on one device type."""

    part: str
    shape: llama.LayerShape
    few: bool
    device: str

    @property
    def digest(self) -> str:
        """A name for the package: changes with torch, the code it compiles and anything it is keyed by."""
        fields = (FORMAT, torch.__version__, self.part, *astuple(self.shape), self.few, self.device, _code())
        return hashlib.sha256(repr(fields).encode()).hexdigest()[:24]

    def examples(self) -> tuple:
        """Inputs to export with: three positions (P is dynamic), weights of the layer's shapes."""
        s, p = self.shape, 3
        z = functools.partial(torch.zeros, dtype=s.dtype, device=self.device)
        attention, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
        if self.part == "pre":
            weights = llama.Before(z(s.hidden), z(attention, s.hidden), z(kv, s.hidden), z(kv, s.hidden))
            return (z(p, s.hidden), z(p, s.head_dim), z(p, s.head_dim), weights)
        mlp = (z(s.intermediate, s.hidden), z(s.intermediate, s.hidden), z(s.hidden, s.intermediate))
        return (z(p, s.hidden), z(p, attention), llama.After(z(s.hidden, attention), z(s.hidden), *mlp))

    @property
    def per_position(self) -> int:
        """How many leading inputs are per position (``[P, ...]``); the last is the weights."""
        return 3 if self.part == "pre" else 2


@functools.cache
def _code() -> str:
    """The source of everything a package computes."""
    parts = (*PARTS.values(), llama.rms_norm, llama.product, llama.rotate, products.left_product)
    return "".join(inspect.getsource(f) for f in parts)


class _Part(torch.nn.Module):
    """A part as a module of flat tensors, for export: the positions' inputs, then each weight."""

    def __init__(self, key: PartKey) -> None:
        super().__init__()
        self.fn = functools.partial(PARTS[key.part], shape=key.shape, few=key.few)
        self.split, self.weights = key.per_position, type(key.examples()[-1])

    def forward(self, *tensors: torch.Tensor):
        return self.fn(*tensors[: self.split], self.weights(*tensors[self.split :]))


def compile_package(key: PartKey, path: pathlib.Path) -> None:
    """Export ``key``'s part with P dynamic and compile it ahead of time into ``path`` (atomically)."""
    from torch.export import Dim

    *tokens, weights = key.examples()
    examples = (*tokens, *weights)
    positions = Dim("P", min=2, max=llama.FEW if key.few else MAX_POSITIONS)
    dynamic = tuple({0: positions} if i < len(tokens) else None for i in range(len(examples)))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's compiler warns of its own deprecations
        program = torch.export.export(_Part(key), examples, dynamic_shapes=(dynamic,))
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.stem}.{os.getpid()}.{threading.get_ident()}.partial.pt2")
        torch._inductor.aoti_compile_and_package(program, package_path=str(partial))
    os.replace(partial, path)  # whole or absent, for a process loading it meanwhile


class CompiledParts:
    """The position-wise parts a forward runs: compiled where a package is loaded, as they are elsewhere.

    Args:
        root: where packages are kept (``cache_root() / "graphs"``).
    """

    def __init__(self, root: pathlib.Path) -> None:
        self.root = root
        self.loaded: dict[PartKey, object] = {}
        self.failed: dict[PartKey, str] = {}
        self.seconds = 0.0  # spent compiling or loading, all threads
        self._lock = threading.Lock()
        self._builder: threading.Thread | None = None

    def keys(self, shape: llama.LayerShape, device: torch.device) -> list[PartKey]:
        """The packages a forward of ``shape`` on ``device`` uses (a CPU's; an accelerator replays graphs)."""
        if device.type != "cpu":
            return []
        orders = (True, False) if products.MKL and shape.dtype == torch.float32 else (False,)
        return [PartKey(part, shape, few, device.type) for part in PARTS for few in orders]

    def path(self, key: PartKey) -> pathlib.Path:
        """Where ``key``'s package is kept."""
        return self.root / f"{key.part}-{key.digest}.pt2"

    def pre(self, shape: llama.LayerShape, few: bool):
        """``llama.pre_attention`` for ``shape``: compiled if loaded."""
        return self._part("pre", shape, few)

    def post(self, shape: llama.LayerShape, few: bool):
        """``llama.post_attention`` for ``shape``: compiled if loaded."""
        return self._part("post", shape, few)

    def _part(self, part: str, shape: llama.LayerShape, few: bool):
        fn = PARTS[part]
        for key, runner in self.loaded.items():
            if key.part == part and key.shape == shape and key.few == few:
                return functools.partial(_run, runner)
        return lambda *t: fn(*t, shape=shape, few=few)

    def ready(self, shape: llama.LayerShape, device: torch.device) -> bool:
        """Every package ``shape`` uses on ``device`` is loaded."""
        return all(k in self.loaded for k in self.keys(shape, device))

    def describe(self, shape: llama.LayerShape, device: torch.device) -> str:
        """What of ``shape``'s parts is compiled, in words."""
        keys = self.keys(shape, device)
        if not keys:
            return f"its parts run as they are on {device.type} (compiled parts are a CPU's)"
        out = f"{sum(k in self.loaded for k in keys)} of {len(keys)} parts compiled"
        if self.seconds >= 1:
            out += f" ({self.seconds:.0f} s spent compiling or loading)"
        failed = [self.failed[k] for k in keys if k in self.failed]
        return out + (f"; compiling failed: {failed[0]}" if failed else "")

    def load(self, shape: llama.LayerShape, device: torch.device) -> list[PartKey]:
        """Load the packages of ``shape`` found on disk; returns those still missing."""
        missing = []
        for key in self.keys(shape, device):
            if key in self.loaded:
                continue
            path = self.path(key)
            if path.exists():
                self._load(key, path)
            if key not in self.loaded:
                missing.append(key)
        return missing

    def build(self, shape: llama.LayerShape, device: torch.device, *, background: bool = False) -> None:
        """Load ``shape``'s packages, compiling those missing; ``background``: in a thread of their own.

        A failed compile is recorded in ``failed`` (that part keeps running as it is).
        """
        missing = [k for k in self.load(shape, device) if k not in self.failed]
        if not missing:
            return
        if not background:
            self._compile(missing)
            return
        with self._lock:
            if self._builder is None or not self._builder.is_alive():
                self._builder = threading.Thread(
                    target=self._compile, args=(missing,), name="smcsd-compile", daemon=True
                )
                self._builder.start()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for a background build; whether none is running now."""
        builder = self._builder
        if builder is not None:
            builder.join(timeout)
        return builder is None or not builder.is_alive()

    def _compile(self, keys: list[PartKey]) -> None:
        for key in keys:
            start = time.perf_counter()
            try:
                compile_package(key, self.path(key))
            except Exception as err:  # noqa: BLE001 - that part runs as it is; the reason is kept
                self.failed[key] = f"{type(err).__name__}: {err}".splitlines()[0]
                continue
            finally:
                self.seconds += time.perf_counter() - start
            self._load(key, self.path(key))

    def _load(self, key: PartKey, path: pathlib.Path) -> None:
        start = time.perf_counter()
        try:
            runner = _load_runner(path)
        except Exception as err:  # noqa: BLE001 - a package of another build: compile it again
            self.failed[key] = f"{type(err).__name__}: {err}".splitlines()[0]
            return
        finally:
            self.seconds += time.perf_counter() - start
        self.loaded = {**self.loaded, key: runner}  # a new dict: the forward reads it without a lock


def _load_runner(path: pathlib.Path):
    """A package as a function of a list of tensors to a list of tensors.

    Torch's C++ loader, called straight: its Python wrapper imports about a thousand modules
    first, which costs a one-shot command more than its parts save it (benchmarks page).
    """
    loader = getattr(getattr(torch._C, "_aoti", None), "AOTIModelPackageLoader", None)
    if loader is not None:
        return loader(str(path), "model", False, 1, -1).boxed_run
    return _flat_call(torch._inductor.aoti_load_package(str(path)))


def _flat_call(model):
    """A loaded package as a function of a list of tensors to a list of tensors.

    Its own ``__call__`` flattens and unflattens Python trees on every call, which costs more
    than a small layer's whole compute; the loader underneath takes the tensors as they are.
    """
    loader = getattr(model, "loader", None)
    if loader is not None and hasattr(loader, "boxed_run"):
        return loader.boxed_run
    return lambda tensors: list(model(*tensors))


def _run(runner, *inputs):
    """Call a compiled part; a single position is run as two (its graph takes P >= 2), the copy dropped."""
    *tokens, weights = inputs
    one = tokens[0].shape[0] == 1
    if one:
        tokens = [t.expand(2, *t.shape[1:]) for t in tokens]
    out = tuple(runner([*(t.contiguous() for t in tokens), *weights]))
    if one:
        out = tuple(o[:1] for o in out)
    return out if len(out) > 1 else out[0]
