"""Grade one problem at a time: the submission's functions for that problem, the reference for the rest.

A graded test of problem P runs with the student's version of every function that holds one of P's
solution blocks and the reference version of everything else, so a bug costs the points of the
problem it is in and no other. The swap is done in place: the reference function object keeps its
identity (every `from x import f` elsewhere sees the change) and its module globals (so the student's
code calls the reference helpers), and only its code object and defaults are replaced:

    with Submission("path/to/student/repo").use(["cs336_inference/layers.py::RMSNorm.forward"]):
        ...  # RMSNorm.forward now runs the student's code; restored on exit

Names the student added to a module (helper functions, constants, imports) or to a patched class (helper
methods) are added to the reference module or class for the duration, the functions among them rebound
to the reference globals as well. Anything else the student changed outside the problem's functions is
not used. A module that does not import (a syntax error, say) fails only the problems whose functions it
holds, with the error as their output.
"""

from __future__ import annotations

import builtins
import importlib
import inspect
import traceback
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

MISSING = object()


class SubmissionError(Exception):
    """The submission's code for a problem cannot be used (it does not import, or a function is missing)."""


def module_name(rel: str) -> str:
    """'cs336_inference/layers.py' -> 'cs336_inference.layers' (a package's __init__.py -> the package)."""
    parts = rel.removesuffix(".py").split("/")
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def split_spec(spec: str) -> tuple[str, str]:
    """'cs336_inference/layers.py::RMSNorm.forward' -> ('cs336_inference/layers.py', 'RMSNorm.forward')."""
    rel, sep, qualname = spec.partition("::")
    if not sep or not rel.endswith(".py") or not qualname:
        raise ValueError(f"a problem function is written 'path/to/module.py::Qualified.name', got {spec!r}")
    return rel, qualname


def _resolve(root, qualname: str):
    """(owner, attribute name, raw attribute) for a dotted name inside a module namespace or object."""
    *path, name = qualname.split(".")
    owner = root
    for part in path:
        owner = owner.get(part, MISSING) if isinstance(owner, dict) else owner.__dict__.get(part, MISSING)
        if owner is MISSING:
            return None, name, MISSING
    raw = owner.get(name, MISSING) if isinstance(owner, dict) else owner.__dict__.get(name, MISSING)
    return owner, name, raw


def _function(raw) -> types.FunctionType | None:
    """The plain function behind a module attribute or class attribute (methods, static/class methods,
    a property's getter, decorators that set __wrapped__)."""
    if isinstance(raw, staticmethod | classmethod):
        raw = raw.__func__
    elif isinstance(raw, property):
        raw = raw.fget
    raw = inspect.unwrap(raw) if callable(raw) else raw
    return raw if isinstance(raw, types.FunctionType) else None


def _rebind(fn: types.FunctionType, globals_: dict, cls: type | None) -> types.FunctionType:
    """fn's code as a function of another module's globals (its `super()` cell pointing at cls)."""
    cells = []
    for name in fn.__code__.co_freevars:
        if name == "__class__" and cls is not None:
            cells.append(types.CellType(cls))
        else:
            raise SubmissionError(
                f"{fn.__qualname__} uses a closure variable {name!r}; define it at module level"
            )
    new = types.FunctionType(fn.__code__, globals_, fn.__name__, fn.__defaults__, tuple(cells) or None)
    new.__kwdefaults__ = fn.__kwdefaults__
    new.__qualname__, new.__doc__, new.__dict__ = fn.__qualname__, fn.__doc__, dict(fn.__dict__)
    return new


def reference_function(spec: str) -> types.FunctionType:
    """The reference's function object for 'path.py::Qual.name'."""
    rel, qualname = split_spec(spec)
    fn = _function(_resolve(vars(importlib.import_module(module_name(rel))), qualname)[2])
    if fn is None:
        raise RuntimeError(f"{spec} is not a function of the reference")
    return fn


class Submission:
    """A student's checkout (or any tree with the same layout) whose functions can be swapped in."""

    def __init__(self, root: str | Path):
        self.root = Path(root).resolve()
        self._namespaces: dict[str, dict | SubmissionError] = {}

    def namespace(self, rel: str) -> dict:
        """The submission's module `rel`, executed as if it were the reference module of that name
        (relative and absolute imports of the package resolve to the reference)."""
        if rel not in self._namespaces:
            self._namespaces[rel] = self._load(rel)
        found = self._namespaces[rel]
        if isinstance(found, SubmissionError):
            raise found
        return found

    def _load(self, rel: str) -> dict | SubmissionError:
        path = self.root / rel
        name = module_name(rel)
        namespace = {"__name__": name, "__file__": str(path), "__builtins__": builtins}
        namespace["__package__"] = name if rel.endswith("__init__.py") else name.rpartition(".")[0]
        try:
            source = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            return SubmissionError(f"your {rel} cannot be read: {e}")
        try:
            exec(compile(source, str(path), "exec"), namespace)
        except BaseException as e:  # noqa: BLE001 - anything the student's module does at import
            if isinstance(e, KeyboardInterrupt):
                raise
            where = "".join(traceback.format_exception_only(type(e), e)).strip().splitlines()
            return SubmissionError(f"your {rel} failed to import, so its problems score 0: {' '.join(where)}")
        return namespace

    @contextmanager
    def use(self, functions: list[str]) -> Iterator[None]:
        """Run the body with the submission's versions of these functions ('path.py::Qual.name')."""
        undo: list[Callable[[], None]] = []
        try:
            for rel in dict.fromkeys(split_spec(spec)[0] for spec in functions):
                self._add_new_names(
                    self.namespace(rel), vars(importlib.import_module(module_name(rel))), undo
                )
            for spec in functions:
                self._swap(spec, undo)
            yield
        finally:
            for restore in reversed(undo):
                restore()

    def _swap(self, spec: str, undo: list) -> None:
        rel, qualname = split_spec(spec)
        ref_globals = vars(importlib.import_module(module_name(rel)))
        ref_owner, name, ref_raw = _resolve(ref_globals, qualname)
        ref_fn = _function(ref_raw)
        if ref_fn is None:
            raise RuntimeError(f"rubric names {spec}, which is not a function of the reference")
        sub_owner, _, sub_raw = _resolve(self.namespace(rel), qualname)
        sub_fn = _function(sub_raw)
        if sub_fn is None:
            raise SubmissionError(f"your {rel} has no function {qualname} (it is graded; do not rename it)")
        cls = ref_owner if isinstance(ref_owner, type) else None
        if cls is not None and isinstance(sub_owner, type):
            self._add_new_names(vars(sub_owner), cls, undo, cls)
        if sub_fn.__code__.co_freevars == ref_fn.__code__.co_freevars:
            saved = (ref_fn.__code__, ref_fn.__defaults__, ref_fn.__kwdefaults__)
            ref_fn.__code__, ref_fn.__defaults__ = sub_fn.__code__, sub_fn.__defaults__
            ref_fn.__kwdefaults__ = sub_fn.__kwdefaults__

            def restore(fn=ref_fn, saved=saved):
                fn.__code__, fn.__defaults__, fn.__kwdefaults__ = saved

            undo.append(restore)
            return
        # Different closure variables (say, the student calls super() and the reference does not):
        # a new function object replaces the attribute; imports of it elsewhere keep the reference.
        new = _rebind(sub_fn, ref_globals, cls)
        if isinstance(ref_raw, staticmethod | classmethod | property):
            new = type(ref_raw)(new)
        self._set(ref_owner, name, new, undo)

    def _add_new_names(self, sub_names: dict, ref, undo: list, cls: type | None = None) -> None:
        """Names the submission defines that the reference (module dict or class) lacks."""
        ref_names = ref if isinstance(ref, dict) else vars(ref)
        globals_ = ref if isinstance(ref, dict) else vars(importlib.import_module(ref.__module__))
        for name, value in list(sub_names.items()):
            if name.startswith("__") or name in ref_names:
                continue
            fn = _function(value)
            if fn is not None and not isinstance(value, property):
                rebound = _rebind(fn, globals_, cls)
                value = type(value)(rebound) if isinstance(value, staticmethod | classmethod) else rebound
            self._set(ref, name, value, undo)

    @staticmethod
    def _set(owner, name: str, value, undo: list) -> None:
        if isinstance(owner, dict):
            old = owner.get(name, MISSING)
            owner[name] = value

            def restore():
                owner.pop(name, None) if old is MISSING else owner.__setitem__(name, old)
        else:
            old = owner.__dict__.get(name, MISSING)
            setattr(owner, name, value)

            def restore():
                delattr(owner, name) if old is MISSING else setattr(owner, name, old)

        undo.append(restore)
