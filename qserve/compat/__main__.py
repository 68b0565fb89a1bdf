"""`python -m qserve.compat`: the patch table as markdown (docs/patches.md)."""

from qserve.compat import markdown

print(markdown(), end="")
