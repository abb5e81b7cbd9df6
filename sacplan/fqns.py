"""Module names (fqns, as ``named_modules`` gives them; ``""`` is the root): which module lies inside which."""

from __future__ import annotations


def inside(fqn: str, module: str) -> bool:
    """``fqn`` is ``module`` or lies in its subtree (everything lies in the root ``""``)."""
    return module == "" or fqn == module or fqn.startswith(module + ".")
