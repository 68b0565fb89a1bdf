"""`python -m qserve.cli`."""

from qserve.cli import main

main()
