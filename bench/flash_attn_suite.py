"""Dao-AILab flash-attention's own tests (tests/test_flash_attn.py) against rdna_flash_attn's flash_attn stand-in:

    python3 -m bench.flash_attn_suite PATH/test_flash_attn.py --out DIR [--max-cases-per-function N] [--timeout-s S]

The test file is flash-attn's, not ours, and is not kept in this repository: pass the path of a copy (its
repository and commit go in --source, recorded in the JSON). `import flash_attn` gets the stand-in
(rdna_flash_attn/integrations/flash_attn_shim first on sys.path, as `launch --flash-attn` puts it). The few names
the test file imports that the stand-in leaves out on purpose (docs/flash_attn.md: "Not provided") are served by
the harness for this run only, each listed in the output with what serves it (see _harness_names).

Every test case ends as one of
  passed, skipped, failed,
  refused  it raised the stand-in's NotImplementedError for a feature it does not support (the message starts
           "rdna_flash_attn's"), as the test's error or as the cause of it (a pytest.raises whose match that error
           does not fit), or a harness stand-in's refusal for a name the stand-in does not provide,
  not_run  the --timeout-s budget ran out before its turn.
The requirement: each function passes or is refused, never a silently different result, so "failed" is either a
result that differs or an error that is not a clear refusal. Cases run one of each function in turn, so a budget
cut leaves every function some. Per function the JSON also counts the dispatcher's calls (kernels, fallback)
made by its cases, which says whether a pass ran on the kernels.

On the NVIDIA test machine with the emulation build (build/emu): RDNA_FA_FORCE=1 RDNA_FA_EMULATE=gfx11 or gfx12.
Writes flash_attn_tests-<label>.json (after every case, so a run stopped from outside keeps what it did) and
flash_attn_tests-<label>.png; <label> is emulated-gfx11, emulated-gfx12, rocm or cpu. Exit status 1 when a case
failed or the file did not collect.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import importlib
import itertools
import json
import os
import random
import re
import sys
import time
import types
from pathlib import Path

import pytest
import torch

from rdna_flash_attn.dispatch import router
from rdna_flash_attn.integrations import autoload
from rdna_flash_attn.runtime import loader

REPO = Path(__file__).resolve().parent.parent
SCHEMA_VERSION = 1
OUTCOMES = ("passed", "refused", "skipped", "failed", "not_run")
# How every NotImplementedError of the stand-in for an unsupported feature begins (flash_attn_interface's
# _refuse_unsupported and _refuse_private); the harness's own refusals begin so too.
REFUSAL_PREFIX = "rdna_flash_attn's "
MESSAGES_KEPT = 3
MESSAGE_CHARS = 200


# --- what the test file imports, and the names the harness serves -----------------------------------------------


def _refusing(name: str, what: str):
    """A callable standing for a flash-attn name the stand-in does not provide: it refuses as the stand-in does."""
    def refuse(*args, **kwargs):
        raise NotImplementedError(f"{REFUSAL_PREFIX}flash_attn stand-in does not provide {name} ({what}); "
                                  "refused by the test harness's stand-in for it")

    refuse.__name__ = name.rsplit(".", 1)[-1]
    return refuse


class _MissingExtension(types.ModuleType):
    """flash-attn's compiled CUDA extension (`flash_attn_gpu`): every entry point refuses."""

    def __getattr__(self, entry: str):
        if entry.startswith("__"):
            raise AttributeError(entry)
        return _refusing(f"flash_attn_gpu.{entry}", "an entry point of flash-attn's CUDA extension")


def _needs_attn_probs(*args, **kwargs):
    raise RuntimeError("test harness: _get_block_size_n only decodes the S_dmask of return_attn_probs=True with "
                       "dropout, which the stand-in refuses; reaching it means the stand-in returned one")


def apply_rotary_emb(x, cos, sin, interleaved=False, inplace=False, seqlen_offsets=0, cu_seqlens=None,
                     max_seqlen=None):
    """flash_attn.layers.rotary.apply_rotary_emb in plain torch, for the test's reference rotation of q and k:
    x (batch, seqlen, heads, head dim), cos and sin (seqlen_ro, rotary_dim / 2). Token t of entry b takes row
    t + seqlen_offsets (an int or a (batch,) tensor); rows past seqlen_ro rotate by nothing, as flash-attn's kernel
    does. The first rotary_dim channels rotate in pairs (2i, 2i + 1) when interleaved, else (i, i + rotary_dim / 2)."""
    if cu_seqlens is not None:
        raise NotImplementedError("test harness: apply_rotary_emb with cu_seqlens (test_flash_attn.py never asks)")
    half = cos.shape[-1]
    offsets = torch.as_tensor(seqlen_offsets, device=x.device).long().reshape(-1, 1)  # (batch or 1, 1)
    rows = offsets + torch.arange(x.shape[1], device=x.device)
    inside = (rows < cos.shape[0])[..., None, None]
    rows = rows.clamp(max=cos.shape[0] - 1)
    cos_rows = torch.where(inside, cos.float()[rows][:, :, None], 1.0)  # (batch or 1, seqlen, 1, half)
    sin_rows = torch.where(inside, sin.float()[rows][:, :, None], 0.0)
    rotary = x[..., :2 * half].float()
    first, second = (rotary[..., 0::2], rotary[..., 1::2]) if interleaved else (rotary[..., :half], rotary[..., half:])
    pair = (first * cos_rows - second * sin_rows, first * sin_rows + second * cos_rows)
    rotated = torch.stack(pair, dim=-1).flatten(-2) if interleaved else torch.cat(pair, dim=-1)
    out = x if inplace else x.clone()
    out[..., :2 * half] = rotated.to(x.dtype)
    return out


def _harness_names() -> dict[tuple[str, str], tuple[object, str]]:
    """{(module, name): (value, what it is)} for the names test_flash_attn.py imports that the stand-in does not
    provide. Public ones the stand-in leaves out on purpose refuse as the stand-in does; the private ones only
    let the test file run."""
    kvcache = _refusing("flash_attn_with_kvcache", "KV-cache decoding, not provided: README")
    return {
        ("flash_attn", "flash_attn_with_kvcache"): (kvcache, "refuses (public; the stand-in does not provide it)"),
        ("flash_attn.flash_attn_interface", "flash_attn_with_kvcache"): (
            kvcache, "refuses (public; the stand-in does not provide it)"),
        ("flash_attn.flash_attn_interface", "flash_attn_gpu"): (
            _MissingExtension("flash_attn_gpu"), "every entry point refuses (flash-attn's CUDA extension)"),
        ("flash_attn.flash_attn_interface", "USE_TRITON_ROCM"): (
            False, "False (private flag: the stand-in is not flash-attn's Triton ROCm backend)"),
        ("flash_attn.flash_attn_interface", "_get_block_size_n"): (
            _needs_attn_probs, "raises if reached (private; only decodes S_dmask, which the stand-in never returns)"),
        ("flash_attn.layers.rotary", "apply_rotary_emb"): (
            apply_rotary_emb, "the harness's torch version (used only for the KV-cache test's reference)"),
    }


def flash_attn_imports(test_file: Path) -> list[tuple[str, str]]:
    """(module, name) of every `from flash_attn... import name` in the test file, at any depth, in file order."""
    imports = []
    for node in ast.walk(ast.parse(Path(test_file).read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "flash_attn":
            imports += [(node.module, alias.name) for alias in node.names if (node.module, alias.name) not in imports]
    return imports


def _existing_module(name: str) -> types.ModuleType | None:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError:
        return None


def _module(name: str) -> types.ModuleType:
    """The module `name` of flash_attn: the stand-in's, or an empty one created for the harness's names."""
    module = _existing_module(name)
    if module is None:
        parent, _, child = name.rpartition(".")
        module = types.ModuleType(name, "created by the flash-attn test harness for this run")
        sys.modules[name] = module
        setattr(_module(parent), child, module)
    return module


def provide_flash_attn(test_file: Path) -> dict[str, str]:
    """Makes `import flash_attn` give the stand-in, with the harness's names added for this process only.
    Returns {"module.name": what serves it} for each flash_attn import of the test file."""
    autoload.provide_flash_attn({autoload.FLASH_ATTN_ENV_VAR: "1"})  # as `launch --flash-attn` does
    flash_attn = importlib.import_module("flash_attn")
    if Path(flash_attn.__file__).resolve().parent.parent != Path(autoload.FLASH_ATTN_SHIM_DIR).resolve():
        raise SystemExit(f"`import flash_attn` found {flash_attn.__file__}, not rdna_flash_attn's stand-in in "
                         f"{autoload.FLASH_ATTN_SHIM_DIR}: run without that flash_attn in the process")
    harness = _harness_names()
    served = {}
    for module_name, name in flash_attn_imports(test_file):
        if (module_name, name) in harness:
            value, what = harness[(module_name, name)]
            setattr(_module(module_name), name, value)
            served[f"{module_name}.{name}"] = f"test harness: {what}"
        else:
            found = hasattr(_existing_module(module_name), name)
            served[f"{module_name}.{name}"] = "rdna_flash_attn stand-in" if found else "MISSING: the import fails"
    return served


# --- running the file and classifying each case ---------------------------------------------------------------


def _refusal_in_chain(error: BaseException | None) -> BaseException | None:
    """The stand-in's refusal: `error` itself or an error that led to it (its cause or context), else None."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, NotImplementedError) and str(error).startswith(REFUSAL_PREFIX):
            return error
        error = error.__cause__ or error.__context__
    return None


def is_refusal(error: BaseException | None) -> bool:
    return _refusal_in_chain(error) is not None


def _shorten(text: str, limit: int = MESSAGE_CHARS) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _error_message(error: BaseException) -> str:
    """The refusal's message when one is in the chain, else the error's own."""
    shown = _refusal_in_chain(error) or error
    return _shorten(f"{type(shown).__name__}: {shown}")


def sample_cases(function: str, cases: list, limit: int, seed: int) -> list:
    """Up to `limit` of one function's cases (all where limit <= 0), kept in collection order: the same ones on
    every run for the same file, function and seed, whatever the other functions."""
    if limit <= 0 or len(cases) <= limit:
        return list(cases)
    chosen = random.Random(f"{seed}:{function}").sample(range(len(cases)), limit)
    return [cases[index] for index in sorted(chosen)]


def interleave(groups: list[list]) -> list:
    """One case of each group in turn, so that a time budget cut leaves every function some cases."""
    return [case for turn in itertools.zip_longest(*groups) for case in turn if case is not None]


def case_outcome(phases: list[tuple[str, str, bool, str | None]]) -> tuple[str, str | None]:
    """(outcome, message) of one case from its (phase, pytest outcome, refused, message) reports."""
    for when, outcome, refused, message in phases:
        if outcome == "failed":
            return ("refused" if refused and when == "call" else "failed"), message
    for when, outcome, refused, message in phases:
        if outcome == "skipped":
            return "skipped", message
    return "passed", None


def _function_name(item) -> str:
    return getattr(item, "originalname", None) or item.name.split("[")[0]


def _new_record() -> dict:
    return dict({outcome: 0 for outcome in OUTCOMES}, parametrizations=0, selected=0, seconds=0.0, kernel_calls=0,
                fallback_calls=0, fallback_reasons={}, failures=[], refusals=[], skip_reasons=[])


class OutcomeRecorder:
    """pytest plugin: samples each function's cases, runs them in turns until the deadline, and counts outcomes
    per function; calls on_update(self) after every case."""

    def __init__(self, max_cases_per_function: int = 0, seed: int = 0, deadline: float | None = None,
                 on_update=None, progress=print):
        self.max_cases_per_function = max_cases_per_function
        self.seed = seed
        self.deadline = deadline  # time.monotonic() value
        self.on_update = on_update or (lambda recorder: None)
        self.progress = progress
        self.functions: dict[str, dict] = {}
        self.collection_errors: list[str] = []
        self.started = time.monotonic()
        self._total = 0
        self._done = 0
        self._running: dict[str, dict] = {}

    def pytest_collectreport(self, report):
        if report.failed:
            lines = [line[1:].strip() for line in report.longreprtext.splitlines() if line.startswith("E ")]
            self.collection_errors.append(_shorten(" ".join(lines) or report.longreprtext, 2 * MESSAGE_CHARS))
            self.progress(f"collection error in {report.nodeid}: {self.collection_errors[-1]}")

    @pytest.hookimpl(trylast=True)  # after -k has deselected
    def pytest_collection_modifyitems(self, config, items):
        by_function: dict[str, list] = {}
        for item in items:
            by_function.setdefault(_function_name(item), []).append(item)
        groups = []
        for function, cases in by_function.items():
            chosen = sample_cases(function, cases, self.max_cases_per_function, self.seed)
            record = self.functions.setdefault(function, _new_record())
            record.update(parametrizations=len(cases), selected=len(chosen))
            groups.append(chosen)
        selected = interleave(groups)
        kept = set(map(id, selected))
        deselected = [item for item in items if id(item) not in kept]
        if deselected:
            config.hook.pytest_deselected(items=deselected)
        items[:] = selected
        self._total = len(selected)
        self.progress(f"{len(by_function)} test functions, {sum(len(c) for c in by_function.values())} cases "
                      f"collected, {len(selected)} selected")

    @pytest.hookimpl(tryfirst=True)
    def pytest_report_teststatus(self, report, config):
        return report.outcome, "", ""  # no letter per case from pytest: the recorder prints each case itself

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_protocol(self, item, nextitem):
        if self.deadline is not None and time.monotonic() > self.deadline:
            self._finish(item.nodeid, _function_name(item), "not_run", None)
            return True  # skip the run itself
        self._running[item.nodeid] = dict(function=_function_name(item), start=time.monotonic(),
                                          stats=router.stats(), phases=[])
        return None

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item, call):
        report = yield
        running = self._running.get(item.nodeid)
        if running is not None:
            error = call.excinfo.value if call.excinfo is not None else None
            if report.skipped:
                reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
                message = _shorten(reason)
            else:
                message = _error_message(error) if report.failed and error is not None else None
            running["phases"].append((report.when, report.outcome, is_refusal(error), message))
        return report

    def pytest_runtest_logfinish(self, nodeid, location):
        running = self._running.pop(nodeid, None)
        if running is None:
            return
        outcome, message = case_outcome(running["phases"])
        record = self.functions[running["function"]]
        record["seconds"] += time.monotonic() - running["start"]
        before, after = running["stats"], router.stats()
        record["kernel_calls"] += after["kernel"] - before["kernel"]
        record["fallback_calls"] += after["fallback"] - before["fallback"]
        for reason, count in after["fallback_reasons"].items():
            added = count - before["fallback_reasons"].get(reason, 0)
            if added:
                record["fallback_reasons"][reason] = record["fallback_reasons"].get(reason, 0) + added
        self._finish(nodeid, running["function"], outcome, message)

    def _finish(self, nodeid: str, function: str, outcome: str, message: str | None) -> None:
        record = self.functions.setdefault(function, _new_record())
        record[outcome] += 1
        kept = {"failed": "failures", "refused": "refusals", "skipped": "skip_reasons"}.get(outcome)
        if kept and message and message not in record[kept] and len(record[kept]) < MESSAGES_KEPT:
            record[kept].append(message)
        self._done += 1
        case = nodeid.split("::")[-1]
        self.progress(f"[{self._done}/{self._total} {time.monotonic() - self.started:4.0f}s] {outcome:8} "
                      f"{_shorten(case, 110)}" + (f"  {_shorten(message, 120)}" if outcome == "failed" else ""))
        self.on_update(self)

    def totals(self) -> dict:
        return {outcome: sum(record[outcome] for record in self.functions.values()) for outcome in OUTCOMES}


def run_tests(test_file: Path, recorder: OutcomeRecorder, keyword: str | None = None) -> int:
    """pytest on the file, in this process, with the recorder; pytest's own terminal output quiet (not off:
    without pytest's terminal plugin its assertion rewriting loses the compared values). Returns pytest's exit code."""
    test_file = Path(test_file).resolve()
    args = [str(test_file), "--rootdir", str(test_file.parent), "-c", os.devnull, "-p", "no:cacheprovider",
            "--import-mode=importlib", "-qq", "--no-header", "--no-summary", "--tb=no", "-o",
            "console_output_style=classic"]
    if keyword:
        args += ["-k", keyword]
    return int(pytest.main(args, plugins=[recorder]))


# --- results -----------------------------------------------------------------------------------------------------


def run_label() -> str:
    """emulated-gfx11 / emulated-gfx12 (NVIDIA, through the emulation), rocm, or cpu."""
    if not torch.cuda.is_available():
        return "cpu"
    if torch.version.hip:
        return "rocm"
    return f"emulated-{loader.emulated_layer()}"


def document(recorder: OutcomeRecorder, meta: dict, imports: dict[str, str]) -> dict:
    stats = router.stats()
    return {"schema": SCHEMA_VERSION,
            "meta": dict(meta, seconds=round(time.monotonic() - recorder.started, 1), kernel_calls=stats["kernel"],
                         fallback_calls=stats["fallback"]),
            "imports": imports, "collection_errors": recorder.collection_errors, "totals": recorder.totals(),
            "functions": recorder.functions}


def write_json(path: Path, doc: dict) -> None:
    partial = path.with_suffix(".json.partial")
    partial.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    partial.replace(path)  # a reader, or a run killed mid-write, never sees half a file


def write_chart(path: Path, doc: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {"passed": "#2e7d32", "refused": "#1565c0", "skipped": "#9e9e9e", "failed": "#c62828",
               "not_run": "#e0e0e0"}
    functions = doc["functions"]
    names = list(functions)
    fig, ax = plt.subplots(figsize=(11, 1.8 + 0.42 * max(1, len(names))))
    left = [0] * len(names)
    for outcome in OUTCOMES:
        counts = [functions[name][outcome] for name in names]
        ax.barh(names, counts, left=left, color=colours[outcome], label=outcome)
        left = [start + count for start, count in zip(left, counts)]
    for row, name in enumerate(names):
        record = functions[name]
        ax.text(left[row], row, "  " + " / ".join(str(record[outcome]) for outcome in OUTCOMES[:4])
                + f"  of {record['parametrizations']}", va="center", fontsize=8)
    if not names:
        ax.text(0.5, 0.5, "nothing collected: " + "; ".join(doc["collection_errors"])[:150], ha="center",
                transform=ax.transAxes, wrap=True)
    meta = doc["meta"]
    ax.set_title(f"flash-attn's tests/test_flash_attn.py on rdna_flash_attn's stand-in: {meta['label']}, "
                 f"{meta['device']}\n(bar labels: passed / refused / skipped / failed of all parametrizations; "
                 f"at most {meta['max_cases_per_function'] or 'all'} sampled per function)", fontsize=9)
    ax.invert_yaxis()
    ax.set_xlabel("sampled test cases")
    ax.margins(x=0.25)
    fig.legend(*ax.get_legend_handles_labels(), loc="lower center", ncol=len(OUTCOMES), fontsize=8)
    fig.tight_layout(rect=(0, 0.04, 1, 1))  # room for the legend below the axis
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _summary(doc: dict) -> str:
    width = max([len(name) for name in doc["functions"]] + [8])
    lines = [f"{'function':{width}}  " + " ".join(f"{outcome:>7}" for outcome in OUTCOMES) + "  kernel fallback"]
    for name, record in doc["functions"].items():
        lines.append(f"{name:{width}}  " + " ".join(f"{record[outcome]:7d}" for outcome in OUTCOMES)
                     + f"  {record['kernel_calls']:6d} {record['fallback_calls']:8d}")
    lines.append(f"{'total':{width}}  " + " ".join(f"{doc['totals'][outcome]:7d}" for outcome in OUTCOMES))
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 2)[2],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("test_file", type=Path, help="a copy of flash-attention's tests/test_flash_attn.py")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results", help="folder for the JSON and PNG")
    parser.add_argument("--max-cases-per-function", type=int, default=0, metavar="N",
                        help="run at most N parametrizations of each test function, sampled deterministically "
                             "(default 0: all)")
    parser.add_argument("--seed", type=int, default=0, help="which parametrizations the sampling picks")
    parser.add_argument("--timeout-s", type=float, metavar="S",
                        help="start no case after S seconds from the start (the rest count as not_run)")
    parser.add_argument("-k", dest="keyword", help="pytest's -k expression, to pick functions or cases")
    parser.add_argument("--source", default="", help="where the test file came from (repository@commit), for the JSON")
    return parser


def main(argv=None) -> int:
    options = _parser().parse_args(argv)
    started = time.monotonic()
    imports = provide_flash_attn(options.test_file)
    for name, served in imports.items():
        print(f"import {name}: {served}")
    label = run_label()
    meta = {"label": label, "test_file": str(options.test_file), "source": options.source,
            "test_file_sha256": hashlib.sha256(options.test_file.read_bytes()).hexdigest(),
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "torch": torch.__version__, "rdna_fa_force": os.environ.get("RDNA_FA_FORCE", ""),
            "max_cases_per_function": options.max_cases_per_function, "seed": options.seed,
            "timeout_s": options.timeout_s, "keyword": options.keyword,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    options.out.mkdir(parents=True, exist_ok=True)
    stem = options.out / f"flash_attn_tests-{label}"
    deadline = None if options.timeout_s is None else started + options.timeout_s
    recorder = OutcomeRecorder(options.max_cases_per_function, options.seed, deadline,
                               on_update=lambda rec: write_json(stem.with_suffix(".json"),
                                                                document(rec, meta, imports)),
                               progress=lambda line: print(line, flush=True))
    exit_code = run_tests(options.test_file, recorder, options.keyword)
    doc = document(recorder, meta, imports)
    write_json(stem.with_suffix(".json"), doc)
    write_chart(stem.with_suffix(".png"), doc)
    print(_summary(doc))
    print(f"pytest exit code {exit_code}; wrote {stem}.json and {stem}.png")
    return 1 if doc["totals"]["failed"] or doc["collection_errors"] else 0


if __name__ == "__main__":
    exit_status = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Everything is written: skip the interpreter's teardown of the half-million collected test items (20 s or
    # more, which a time-limited GPU run would rather spend on tests).
    os._exit(exit_status)
