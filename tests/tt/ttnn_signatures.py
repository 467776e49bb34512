"""ttnn call sites found by AST, checked against the installed ttnn's own signatures.

Call sites: every call ``R.name(...)`` in a module where the receiver ``R``
is ``ttnn``, ``tt``, ``self.tt``, ``self.ttnn`` or ``self._tt`` (how the tt
subpackage names the ttnn module, real or emulated).

Signatures, by the kind of binding ttnn has for ``name``:

* ``FastOperation`` (ops, and ``deallocate``, ``to_device``...): the
  ``__call__(self, ...)`` overload lines of ``type(op.function).__call__.__doc__``;
  else ``inspect.signature(op.function)``; else the first lines of
  ``op.function.__doc__`` (a nanobind function).
* nanobind functions (trace calls, ``synchronize_device``,
  ``get_device_tensors``): the ``name(...)`` lines opening ``__doc__``.
* ``ttnn.Tensor``: the ``__init__(self, ...)`` overload lines.
* anything else (mesh mappers): ``inspect.signature``.

A call conforms when one overload accepts it: the positional count fits,
every keyword is declared (or the overload takes ``**kwargs``) and every
required parameter is given.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path
from typing import Any, NamedTuple

RECEIVERS = frozenset({"ttnn", "tt"})
SELF_RECEIVERS = frozenset({"tt", "ttnn", "_tt"})


class CallSite(NamedTuple):
    where: str  # file:line
    name: str
    positional: int | None  # None: a *args call, count unknown
    keywords: tuple[str, ...] | None  # None: a **kwargs call


class Param(NamedTuple):
    name: str
    kind: str  # "pos" (positional or keyword), "kw" (keyword-only), "*", "**"
    required: bool


def _is_receiver(node: ast.expr) -> bool:
    if isinstance(node, ast.Name):
        return node.id in RECEIVERS
    return (
        isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
        and node.attr in SELF_RECEIVERS
    )


NAMESPACES = frozenset({"transformer", "experimental"})
"""ttnn submodules whose ops are called through the receiver (``tt.transformer.op``): named ``transformer.op``."""


def _op_name(func: ast.Attribute) -> str | None:
    """The called op's name below ttnn (``gather``, ``transformer.chunked_...``), or None: not a ttnn call."""
    if _is_receiver(func.value):
        return func.attr
    inner = func.value
    if isinstance(inner, ast.Attribute) and inner.attr in NAMESPACES and _is_receiver(inner.value):
        return f"{inner.attr}.{func.attr}"
    return None


def call_sites(source: str, filename: str) -> list[CallSite]:
    """Every ttnn call in ``source`` (see module doc)."""
    sites = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and _op_name(node.func):
            starred = any(isinstance(a, ast.Starred) for a in node.args)
            double = any(k.arg is None for k in node.keywords)
            sites.append(
                CallSite(
                    f"{filename}:{node.lineno}",
                    _op_name(node.func),
                    None if starred else len(node.args),
                    None if double else tuple(k.arg for k in node.keywords),
                )
            )
    return sites


def package_call_sites(package: Path, root: Path) -> list[CallSite]:
    return [
        site
        for path in sorted(package.rglob("*.py"))
        for site in call_sites(path.read_text(), str(path.relative_to(root)))
    ]


def _split_top(text: str) -> list[str]:
    parts, depth, current = [], 0, []
    for char in text:
        if char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
        if char == "," and depth == 0:
            parts.append("".join(current).strip())
            current = []
        else:
            current.append(char)
    if "".join(current).strip():
        parts.append("".join(current).strip())
    return parts


def _param_list(line: str) -> str:
    """The text between the first ``(`` of ``line`` and its matching ``)``."""
    start = line.index("(")
    depth = 0
    for i in range(start, len(line)):
        depth += {"(": 1, ")": -1}.get(line[i], 0)
        if depth == 0:
            return line[start + 1 : i]
    raise ValueError(f"unbalanced signature line: {line!r}")


def parse_signature(line: str, drop_self: bool) -> list[Param]:
    """``name(a, b: T = 1, *, c=None, **kw) -> R`` -> parameters."""
    params, keyword_only = [], False
    for part in _split_top(_param_list(line.replace("\\*", "*"))):
        if part == "*":
            keyword_only = True
        elif part == "/":
            continue
        elif part.startswith("**"):
            params.append(Param(part[2:].split(":")[0].strip(), "**", False))
        elif part.startswith("*"):
            params.append(Param(part[1:].split(":")[0].strip(), "*", False))
            keyword_only = True
        else:
            name = part.split(":")[0].split("=")[0].strip()
            params.append(Param(name, "kw" if keyword_only else "pos", "=" not in part))
    return params[1:] if drop_self and params and params[0].name == "self" else params


def _from_inspect(function: Any) -> list[Param]:
    kinds = {
        inspect.Parameter.VAR_POSITIONAL: "*",
        inspect.Parameter.VAR_KEYWORD: "**",
        inspect.Parameter.KEYWORD_ONLY: "kw",
    }
    return [
        Param(p.name, kinds.get(p.kind, "pos"), p.default is inspect.Parameter.empty)
        for p in inspect.signature(function).parameters.values()
    ]


def _doc_lines(doc: str | None, prefix: str) -> list[str]:
    return [line.strip() for line in (doc or "").splitlines() if line.strip().startswith(prefix + "(")]


def overloads(ttnn: Any, name: str) -> list[list[Param]]:
    """Every signature ttnn declares for ``ttnn.<name>`` (see module doc); raises AttributeError if it has none."""
    target = ttnn
    for part in name.split("."):  # a namespaced op: ttnn.transformer.<op>
        target = getattr(target, part)
    name = name.rsplit(".", 1)[-1]
    if name == "Tensor":
        return [parse_signature(line, True) for line in _doc_lines(target.__init__.__doc__, "__init__")]
    if type(target).__name__ == "FastOperation":
        lines = _doc_lines(type(target.function).__call__.__doc__, "__call__")
        if lines:
            return [parse_signature(line, True) for line in lines]
        target = target.function
    try:
        return [_from_inspect(target)]
    except (TypeError, ValueError):
        lines = _doc_lines(target.__doc__, name)
        if not lines:
            raise AttributeError(f"ttnn.{name} declares no readable signature") from None
        return [parse_signature(line, False) for line in lines]


def accepts(params: list[Param], positional: int | None, keywords: tuple[str, ...] | None) -> bool:
    """Whether one overload takes a call with ``positional`` arguments and ``keywords``."""
    slots = [p for p in params if p.kind == "pos"]
    var_pos = any(p.kind == "*" for p in params)
    var_kw = any(p.kind == "**" for p in params)
    if positional is not None and positional > len(slots) and not var_pos:
        return False
    filled = {p.name for p in slots[: positional or 0]}
    named = {p.name for p in params if p.kind in ("pos", "kw")}
    for keyword in keywords or ():
        if keyword in filled or (keyword not in named and not var_kw):
            return False
    if positional is None or keywords is None:
        return True  # a starred call: what is given cannot be counted
    given = filled | set(keywords)
    return all(p.name in given for p in params if p.required and p.kind in ("pos", "kw"))


def nonconforming(ttnn: Any, sites: list[CallSite]) -> list[str]:
    """One message per call site no declared signature of ttnn accepts."""
    problems = []
    for site in sites:
        try:
            signatures = overloads(ttnn, site.name)
        except AttributeError as error:
            problems.append(f"{site.where}: ttnn.{site.name} does not exist in the installed ttnn ({error})")
            continue
        if not any(accepts(params, site.positional, site.keywords) for params in signatures):
            shown = [", ".join(p.name for p in params) for params in signatures]
            problems.append(
                f"{site.where}: ttnn.{site.name}({site.positional} positional, keywords "
                f"{list(site.keywords or ())}) fits none of {shown}"
            )
    return problems
