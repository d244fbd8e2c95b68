"""Compile for a GPU, without one, every Triton kernel launch that the interpreter tests made.

Triton's interpreter runs a kernel's Python, not its compiled form, so it accepts kernels the compiler refuses: a
variable whose type changes across a loop, a non-constexpr value where a constexpr is needed, an operation without a
lowering. Triton's compiler needs no GPU. So :func:`recording` notes each launch's kernel, argument types and
compile-time constants while the interpreter tests run, :func:`covering` keeps enough of them to show each kernel with
every constant and type it was given (each value at least once, not each combination of values), and :func:`compile_for`
runs the compiler's front end on those (the kernel's Python to Triton's IR, for a Hopper GPU: sm_90, the H100 and H200)
in subprocesses without ``TRITON_INTERPRET``, where ``@triton.jit`` makes compilable kernels. The front end is where
those errors show. A kernel with a scan goes on to the GPU IR, where its layouts are assigned: a scan whose elements are
held by several threads off its axis is refused (:func:`replicated_scans`: the interpreter runs it right, a GPU did
not). The later stages (LLVM, ``ptxas``, which run without a GPU too) are left to the GPU runs: for ORQ's widest level
search they take minutes on a CI core, the front end seconds.

A launch's signature is typed by Triton's own ``mangle_type``, as its launcher types it (an int of 1 and None are
constants, unless the kernel names the argument in ``do_not_specialize``), the ``tl.constexpr`` arguments constants.
"""

from __future__ import annotations

import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

#: a launch's options, not the kernel's arguments
_OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg", "enable_fp_fusion")


def _describe(value: Any, annotation: str, specialize: bool) -> list[Any]:
    """An argument as [its type in the kernel's signature, its value where that type is a constant], as Triton's
    launcher types it: the parameter's annotation where it names a type (``tl.float64``: a Python float as a double,
    where it would be a float), else Triton's own ``mangle_type`` of the value (``specialize``: unless named in
    ``do_not_specialize``)."""
    from triton.runtime.jit import _normalize_ty, mangle_type

    if "constexpr" in annotation:
        kind = "constexpr"
    elif annotation.startswith("tl."):
        kind = _normalize_ty(annotation)
    else:
        kind = mangle_type(value, specialize)
    return [kind, getattr(value, "value", value) if kind == "constexpr" else None]


@contextmanager
def recording(launches: set[str]) -> Iterator[None]:
    """Within, every launch of an interpreted kernel is noted in ``launches`` (as a JSON string)."""
    from triton.runtime.interpreter import InterpretedFunction

    run = InterpretedFunction.run

    def noted(self: InterpretedFunction, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
        options = {name: kwargs[name] for name in _OPTIONS if name in kwargs}
        arguments = dict(zip(self.arg_names, args, strict=False))
        arguments.update({k: v for k, v in kwargs.items() if k not in _OPTIONS})
        parameters = inspect.signature(self.fn).parameters
        fixed = self.kwargs.get("do_not_specialize") or ()
        described = {name: _describe(value, str(parameters[name].annotation), name not in fixed)
                     for name, value in arguments.items()}
        launches.add(json.dumps({"module": self.fn.__module__, "kernel": self.fn.__name__, "options": options,
                                 "arguments": described},
                                sort_keys=True))
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = noted  # type: ignore[method-assign]
    try:
        yield
    finally:
        InterpretedFunction.run = run  # type: ignore[method-assign]


def replicated_scans(module: str) -> list[str]:
    """The scans in ``module`` (Triton's GPU IR as text, its layouts assigned) whose operand's layout holds an element
    in more than one thread along a dimension other than the scan's, each as its operand's type and layout. Compiled
    so, a scan of the sketch's rows ([ROWS, 1], each row in 4 threads) gave each of those threads its own slot on an
    H100, where the interpreter, which has no layouts, ran it right. A 1-D scan (``tl.cumsum`` of a [ROWS] tensor) gets
    a layout of one thread an element."""
    layouts = dict(re.findall(r"^(#\w+) = #ttg\.blocked<\{(.*)\}>", module, re.MULTILINE))
    lines = module.splitlines()
    found = []
    for i, line in enumerate(lines):
        if '"tt.scan"(' not in line:
            continue
        axis = int(re.search(r"axis = (\d+)", line).group(1))
        indent = len(line) - len(line.lstrip())
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith(" " * indent + "})"))
        for shape, name in re.findall(r"tensor<([\dx]+)x\w+, (#\w+)>", re.search(r"\}\) : \(([^)]*)\)",
                                                                            lines[end]).group(1)):
            if name not in layouts:  # not a blocked layout: reported, as it was not checked
                found.append(f"tensor<{shape}> in {name}, a layout this check does not read")
                continue
            per = {key: [int(v) for v in values.split(",")] for key, values in
                   re.findall(r"(sizePerThread|threadsPerWarp|warpsPerCTA) = \[([\d, ]+)\]", layouts[name])}
            dims = [int(d) for d in shape.split("x")]
            if any(d != axis and per["sizePerThread"][d] * per["threadsPerWarp"][d] * per["warpsPerCTA"][d] > size
                   for d, size in enumerate(dims)):
                found.append(f"tensor<{shape}> in {layouts[name]}")
    return found


def _compile_all(launches: list[dict[str, Any]], capability: int) -> list[str]:
    """In the subprocess: each launch through the front end for ``capability`` (90: sm_90), and those with a scan on
    to the GPU IR, their scans' layouts checked (:func:`replicated_scans`); one line per failure."""
    import importlib

    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget, Language
    from triton.compiler import ASTSource
    from triton.compiler.compiler import make_backend

    target = GPUTarget("cuda", capability, 32)
    backend = make_backend(target)
    failures = []
    for launch in launches:
        kernel = getattr(importlib.import_module(launch["module"]), launch["kernel"])
        signature: dict[str, str] = {}
        constants: dict[str, Any] = {}
        for parameter in kernel.params:
            if parameter.name in launch["arguments"]:  # else not passed: the kernel's default applies
                kind, value = launch["arguments"][parameter.name]
                signature[parameter.name] = kind
                if kind == "constexpr":
                    constants[parameter.name] = value
        try:
            options = backend.parse_options(launch["options"])
            context = ir.context()
            ir.load_dialects(context)
            backend.load_dialects(context)
            codegen = backend.get_codegen_implementation(options)
            module = ASTSource(kernel, signature, constants).make_ir(target, options, codegen,
                                                                     backend.get_module_map(), context)
            if '"tt.scan"(' in str(module):  # its layouts: the GPU IR, a few more passes
                stages: dict[str, Any] = {}
                backend.add_stages(stages, options, Language.TRITON)
                metadata: dict[str, Any] = {}
                gpu_ir = stages["ttgir"](stages["ttir"](module, metadata), metadata)
                failures += [f"{launch['module']}.{launch['kernel']} {constants}: a scan over {operand}, held by "
                             "several threads off the scan's axis (scan a 1-D tensor instead)"
                             for operand in replicated_scans(str(gpu_ir))]
        except Exception as error:  # every failure is reported, with its kernel and constants
            message = " ".join(str(error).split())
            failures.append(f"{launch['module']}.{launch['kernel']} {constants}: {message[-600:]}")
    return failures


def covering(launches: set[str]) -> list[str]:
    """Fewer launches that still show every kernel with each value of each of its arguments' descriptions (each
    constant, pointer type, int width) and each set of options at least once: a greedy set cover, in a fixed order.
    The tests make hundreds of launches that differ in one constant."""
    def features(launch: str) -> set[tuple[str, str, str]]:
        noted = json.loads(launch)
        return ({(noted["kernel"], "", json.dumps(noted["options"], sort_keys=True))}
                | {(noted["kernel"], name, json.dumps(value)) for name, value in noted["arguments"].items()})

    every = {launch: features(launch) for launch in sorted(launches)}
    left = set().union(*every.values()) if every else set()
    chosen = []
    while left:
        best = max(every, key=lambda launch: len(every[launch] & left))
        chosen.append(best)
        left -= every[best]
    return chosen


def compile_for(launches: list[str], capability: int = 90, timeout: float = 600) -> list[str]:
    """The noted launches through the compiler's front end for ``sm_<capability>``, each core taking its share in a
    subprocess without the interpreter; the failures."""
    environment = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); from triton_compile import _compile_all; "
            "print(json.dumps(_compile_all([json.loads(line) for line in sys.stdin.read().splitlines()], "
            "int(sys.argv[2]))))")
    workers = max(1, min(len(launches), len(os.sched_getaffinity(0))))
    processes = []
    for worker in range(workers):
        with tempfile.TemporaryFile("w+") as shares:  # each worker's launches, one JSON line each, as its stdin
            shares.write("\n".join(launches[worker::workers]))
            shares.seek(0)
            processes.append(subprocess.Popen([sys.executable, "-c", code, os.path.dirname(__file__), str(capability)],
                                              stdin=shares, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                              env=environment))
    failures = []
    for process in processes:
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.communicate()
            failures.append(f"the compiling subprocess took more than {timeout} s")
            continue
        if process.returncode != 0:
            failures.append(f"the compiling subprocess failed (exit status {process.returncode}): {stderr[-2000:]}")
        else:
            failures += json.loads(stdout.splitlines()[-1])
    return failures
