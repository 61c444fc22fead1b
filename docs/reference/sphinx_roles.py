"""A griffe extension for the API reference (mkdocs.yml loads it): the docstrings' Sphinx roles as links.

kvsieve's docstrings are free prose with Sphinx roles (``:class:`~kvsieve.engine.cache.SieveCache```,
``:func:`make_cache```, ``:meth:`settle```); Markdown would show them as ``:class:`` followed by code. Each role
becomes an *optional* cross-reference of mkdocs-autorefs, its target resolved the way Python would from the
docstring's scope (its object, then the enclosing ones, then the module's imports): a link where the target is
rendered in the reference, the name in code (with the full path as tooltip) where it is not, and no warning either
way (``mkdocs build --strict`` fails only on the reference's own links). ``~`` shows the last component, as in
Sphinx; ``!`` (no link) shows the text as code.
"""

from __future__ import annotations

import ast
import html
import re
from typing import Any

from griffe import Alias, Extension, GriffeLoader, Module, Object

ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|data|attr|exc|obj|const):`(?P<text>[^`]+)`")


def _members(obj: Object | Alias) -> list[Object | Alias]:
    out = []
    for member in obj.members.values():
        if member.is_alias:
            continue
        out.append(member)
        out.extend(_members(member))
    return out


def _lazy_names(loader: GriffeLoader, module: str) -> dict[str, str]:
    """A lazy module's ``_PUBLIC`` (name → ``module`` or ``module:attribute``, imported on first use: PEP 562), or
    nothing."""
    try:
        value = loader.modules_collection.get_member(f"{module}._PUBLIC").value
        names = ast.literal_eval(str(value))
    except Exception:
        return {}
    return names if isinstance(names, dict) else {}


def _lookup(loader: GriffeLoader, path: str) -> str | None:
    """The path of the object that defines ``path``, aliases followed (``kvsieve.policies.Policy`` →
    ``kvsieve.policies.base.Policy``, ``kvsieve.make_cache`` → ``kvsieve.api.make_cache``), or None if it names
    nothing loaded."""
    try:
        obj = loader.modules_collection.get_member(path)
    except Exception:
        obj = None
    if obj is not None:
        try:
            return obj.final_target.path if obj.is_alias else obj.path
        except Exception:
            return obj.path
    parts = path.split(".")
    for i in range(len(parts) - 1, 0, -1):
        lazy = _lazy_names(loader, ".".join(parts[:i]))
        if parts[i] in lazy:
            module, _, attribute = lazy[parts[i]].partition(":")
            return _lookup(loader, ".".join([module, attribute or parts[i], *parts[i + 1 :]]))
    return None


def _resolve(loader: GriffeLoader, scope: Object | Alias, target: str) -> str:
    """The full path ``target`` names in ``scope``, as Python would resolve it there (``target`` if nothing)."""
    head, dot, rest = target.partition(".")
    if head in loader.modules_collection.members:  # a full path
        return _lookup(loader, target) or target
    try:
        path = scope.resolve(head) + dot + rest
    except Exception:
        path = None
    if path is not None and (found := _lookup(loader, path)):
        return found
    module = scope if scope.is_module else scope.module
    while module is not None:  # a name of a lazy module
        if found := _lookup(loader, f"{module.path}.{target}"):
            return found
        module = module.parent
    return path or target


def _replace(loader: GriffeLoader, scope: Object | Alias, match: re.Match[str]) -> str:
    text = match["text"].strip()
    if text.startswith("!"):
        return f"`{text[1:]}`"
    short = text.startswith("~")
    target = text.lstrip("~.")
    title = target.rsplit(".", 1)[-1] if short else target
    identifier = _resolve(loader, scope, target)
    return f'<autoref identifier="{html.escape(identifier)}" optional><code>{html.escape(title)}</code></autoref>'


class SphinxRoles(Extension):
    """Rewrite the Sphinx roles of every docstring in the package as optional cross-references."""

    def on_package(self, *, pkg: Module, loader: GriffeLoader, **kwargs: Any) -> None:
        for obj in [pkg, *_members(pkg)]:
            if obj.docstring is None or ":" not in obj.docstring.value:
                continue
            # a function's names resolve in its parent's scope (its own members are its locals)
            scope = obj.parent if obj.is_function and obj.parent is not None else obj
            obj.docstring.value = ROLE.sub(lambda m, s=scope: _replace(loader, s, m), obj.docstring.value)
