"""What went wrong when a model does not trace: the user's own source line, and the error to raise.

``trace`` tries its front ends; when none captures the model, ``untraceable`` runs the step eagerly to
tell a batch the model cannot take (``InputError``) from code a tracer cannot follow (``TraceError``),
and names the innermost frame of the user's code in the traceback (not torch's, not this package's),
with the module running there, so the message can suggest the leaf module that fixes it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
import linecache
import os
import sys
import sysconfig
import traceback

import torch
from torch.fx.experimental.symbolic_shapes import uninteresting_files

from harmony.base.errors import HarmonyError, InputError, TraceError
from harmony.compiler.fake import fake_state_if_empty


def forward_signature(model: torch.nn.Module) -> inspect.Signature | None:
    """``model.forward``'s signature, or None where Python cannot tell it (a builtin, a C extension)."""
    try:
        return inspect.signature(model.forward)
    except (TypeError, ValueError):
        return None


def signature_text(model: torch.nn.Module, limit: int = 6) -> str:
    """``GPT.forward(idx, targets)``: how messages name the model's forward, its first ``limit`` arguments."""
    signature = forward_signature(model)
    params = ([str(p).split(":")[0].split("=")[0].strip() for p in signature.parameters.values()] if signature
              else ["..."])
    shown = ", ".join(params[:limit]) + (", ..." if len(params) > limit else "")
    return f"{type(model).__name__}.forward({shown})"


def eager_error(step: torch.nn.Module, batch) -> Exception | None:
    """Run the step eagerly (no grad, state restored) to tell a bad batch from an untraceable model."""
    saved = [(b, b.detach().clone()) for b in step.buffers()]
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]), \
                fake_state_if_empty(step, batch.tensors) as (mode, tensors), mode or contextlib.nullcontext():
            step(*tensors)
    except HarmonyError:
        raise
    except Exception as error:
        return error
    finally:
        with torch.no_grad():
            for buffer, value in saved:
                buffer.copy_(value)
    return None


def input_error(model: torch.nn.Module, batch, error: Exception) -> InputError:
    where = user_frame(error, model)
    at = f"\n  at {where}" if where else ""
    input_error = InputError(
        f"{signature_text(model)} fails on the example batch: {type(error).__name__}: {first_line(error)}{at}\n"
        f"The batch holds {batch.describe()}."
    )
    input_error.__cause__ = error
    return input_error


def untraceable(model: torch.nn.Module, step: torch.nn.Module, batch, failures: dict[str, Exception]) -> HarmonyError:
    eager = eager_error(step, batch)
    if eager is not None:
        return input_error(model, batch, eager)
    label = {"fx": "torch.fx.symbolic_trace", "export": "torch.export"}
    located = {name: user_frame(error, model) for name, error in failures.items()}
    # The last front end tried is the most capable; report where it stopped.
    name = next((n for n in reversed(failures) if located[n]), list(failures)[-1])
    lines = [f"Cannot trace {type(model).__name__} into a graph: {label[name]} failed"]
    where = located[name]
    if where:
        lines.append(f"  at {where}")
    lines.append(f"  error: {type(failures[name]).__name__}: {first_line(failures[name])}")
    for other, error in failures.items():
        if other != name:
            at = f" at {located[other].location}" if located[other] else ""
            lines.append(f"  ({label[other]} also failed{at}: {first_line(error)})")
    if data_dependent(failures[name]):
        why = "Python control flow that depends on tensor values cannot be captured"
        rewrite = "express the branch with torch.where / torch.cond"
    else:
        why, rewrite = "The tracer cannot follow this Python code", "rewrite it with tensor operations"
    if where and where.module_path:
        fix = (f"pass leaf_modules=[{where.module_class}] to harmony.compile so that '{where.module_path}' runs as "
               f"one opaque node")
    else:
        fix = ("move that code into a submodule and pass leaf_modules=[ThatSubmoduleClass] to harmony.compile so it "
               "runs as one opaque node")
    lines.append(f"{why}. Fix: {fix}, or {rewrite}.")
    error = TraceError("\n".join(lines))
    error.__cause__ = failures[name]
    return error


def data_dependent(error: BaseException) -> bool:
    text = str(error)
    return "control flow" in text or "data-dependent" in text or "DataDependent" in type(error).__name__


def first_line(error: BaseException, limit: int = 300) -> str:
    text = str(error).strip()
    line = text.splitlines()[0] if text else type(error).__name__
    return line if len(line) <= limit else line[: limit - 3] + "..."


@dataclasses.dataclass(frozen=True)
class _Frame:
    filename: str
    lineno: int
    function: str
    module_path: str | None  # innermost user module running at that point
    module_class: str | None

    @property
    def location(self) -> str:
        return f"{self.filename}:{self.lineno}"

    def __str__(self) -> str:
        code = linecache.getline(self.filename, self.lineno).strip()
        text = f"{self.location} in {self.function}" + (f": {code}" if code else "")
        if self.module_path is not None:
            shown = f"module '{self.module_path}'" if self.module_path else "the top-level model"
            text += f"\n  inside {shown} ({self.module_class})"
        return text


_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_OURS = os.path.dirname(os.path.abspath(__file__))   # the tracer's own frames (the train step, in-place proxies)
_STDLIB = sysconfig.get_paths()["stdlib"] + os.sep
_SITE = tuple({sysconfig.get_paths()["purelib"] + os.sep, sysconfig.get_paths()["platlib"] + os.sep})


def is_library(filename: str) -> bool:
    if filename.startswith("<"):
        return True
    path = os.path.abspath(filename)
    return (os.path.dirname(path) == _OURS or path.startswith(_TORCH_DIR)
            or (path.startswith(_STDLIB) and not path.startswith(_SITE)))


def user_frame(error: BaseException, model: torch.nn.Module) -> _Frame | None:
    """The innermost frame of the user's code in the traceback (or its causes), not torch's."""
    paths = {id(m): p for p, m in model.named_modules()}
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        frames = list(traceback.walk_tb(error.__traceback__))
        for i in range(len(frames) - 1, -1, -1):
            frame, lineno = frames[i]
            if is_library(frame.f_code.co_filename):
                continue
            module_path, module_class = None, None
            for outer, _ in reversed(frames[: i + 1]):
                owner = outer.f_locals.get("self")
                if id(owner) in paths and isinstance(owner, torch.nn.Module):
                    module_path, module_class = paths[id(owner)], type(owner).__name__
                    break
            return _Frame(frame.f_code.co_filename, lineno, frame.f_code.co_name, module_path, module_class)
        error = error.__cause__ or error.__context__
    return None


def user_stack() -> str | None:
    """The stack of user frames making a node, formatted as fx's ``record_stack_traces`` formats it (from the first
    ``forward`` frame in, torch's own files left out), for errors that name a node's source line. fx's own recording
    reads the source line of every frame of the stack, the test runner's and torch's included, for every node (the
    first trace of a process loads all those files): here only the frames kept are read."""
    frames, f = [], sys._getframe(2)
    while f is not None:
        frames.append((f.f_code.co_filename, f.f_lineno, f.f_code.co_name))
        f = f.f_back
    frames.reverse()                   # outermost first, as a traceback reads
    first = next((i for i, frame in enumerate(frames) if frame[2] == "forward"), None)
    if first is None:
        return None                    # not made by a forward (fx records none either)
    skip = uninteresting_files()
    out = []
    for file, line, name in frames[first:]:
        if file not in skip:
            code = linecache.getline(file, line).strip()
            out.append(f'  File "{file}", line {line}, in {name}\n' + (f"    {code}\n" if code else ""))
    return "".join(out).strip()
