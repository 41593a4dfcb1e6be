"""Repository tools run from the root as ``python -m tools.NAME``; none of them is part of the wheel."""
