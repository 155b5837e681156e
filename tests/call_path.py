"""The path of one attention call's query tensor: the Python functions it passes through between a host's
entry into this package and the kernel launch, counted with sys.setprofile.

A stop is a Python function call, after the entry, whose arguments (its locals when it is entered, free
variables included; one level into tuples, lists and dicts) hold the query or a tensor sharing its
storage (a view). A generator is a stop when it starts, not again at each resumption. Counting ends at
the launch, the first call into the stand-in's `run_launch`, itself a stop. C functions (torch's own ops) are
not stops; torch's Python wrappers are.

The lab's stand-in GPU (rdna_fa_lab/stand_in.py) makes the CPU play an RDNA GPU whose launches run the
shipped code object on the ISA interpreter (which needs tinygrad), so that the dispatcher routes CPU
tensors to it and the launch really happens.

    with stand_in_gpu("gfx1100") as gpu:
        path = query_path(lambda: host_call(q, k, v), q, entry=override.__code__, library=gpu)
    print(path.summary())
"""

from __future__ import annotations

import inspect
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

REPO = Path(__file__).resolve().parent.parent
DISPATCH_DIR = REPO / "rdna_flash_attn" / "dispatch"


def _storage(t: torch.Tensor) -> int | None:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None


def _holds(value, storage: int) -> bool:
    """Whether `value` is, or directly holds, a tensor whose storage is `storage`."""
    if isinstance(value, torch.Tensor):
        return _storage(value) == storage
    if isinstance(value, (tuple, list)):
        return any(isinstance(item, torch.Tensor) and _storage(item) == storage for item in value)
    if isinstance(value, dict):
        return any(isinstance(item, torch.Tensor) and _storage(item) == storage for item in value.values())
    return False


def _where(code) -> str:
    path = Path(code.co_filename)
    for base in (REPO, *(Path(p) for p in sys.path if p.endswith("site-packages"))):
        if path.is_relative_to(base):
            return path.relative_to(base).as_posix()
    return path.as_posix()


def _in_dispatch(frame) -> bool:
    return frame is not None and Path(frame.f_code.co_filename).parent == DISPATCH_DIR


@dataclass(frozen=True)
class Stop:
    function: str  # qualified name
    file: str  # relative to the repository, or to site-packages


@dataclass
class CallPath:
    """What query_path saw: the stops in order, and how often control crossed into the dispatch layer
    along them (a call into it from outside, or a return into it from a stop outside)."""

    stops: list[Stop] = field(default_factory=list)
    dispatch_entries: int = 0
    launched: bool = False

    @property
    def files(self) -> list[str]:
        return list(dict.fromkeys(stop.file for stop in self.stops))

    def summary(self) -> str:
        per_file = Counter(stop.file for stop in self.stops)
        lines = [f"{len(self.stops)} stops in {len(self.files)} files, {self.dispatch_entries} entries into "
                 f"the dispatch layer{'' if self.launched else ' (no launch reached)'}"]
        lines += [f"  {count:3d} {name}" for name, count in per_file.items()]
        lines += [f"  {i:3d}. {stop.file}: {stop.function}" for i, stop in enumerate(self.stops, 1)]
        return "\n".join(lines)


def query_path(call: Callable[[], object], query: torch.Tensor, entry, library) -> CallPath:
    """Runs call() once and returns the path of `query` from the first call of the code object `entry`
    (the host's entry into this package) to the first call of `library.run_launch`."""
    storage = _storage(query)
    launch_code = type(library).run_launch.__code__
    path = CallPath()
    stops: set[int] = set()  # ids of the frames that are stops, to see their returns
    started: list = []  # generator frames already entered (held, so that their ids stay theirs)
    state = {"counting": False}

    def profile(frame, event, arg):
        if event == "call":
            code = frame.f_code
            if not state["counting"]:
                if code is not entry:
                    return
                state["counting"] = True
            if code.co_flags & inspect.CO_GENERATOR:
                if any(frame is seen for seen in started):
                    return
                started.append(frame)
            if path.launched or not any(_holds(value, storage) for value in frame.f_locals.values()):
                return
            path.stops.append(Stop(code.co_qualname, _where(code)))
            stops.add(id(frame))
            if _in_dispatch(frame) and not _in_dispatch(frame.f_back):
                path.dispatch_entries += 1
            if code is launch_code:
                path.launched = True
        elif event == "return" and id(frame) in stops:
            stops.discard(id(frame))
            if not path.launched and not _in_dispatch(frame) and _in_dispatch(frame.f_back):
                path.dispatch_entries += 1

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return path
