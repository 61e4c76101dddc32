"""``python -m chunkmem.plan``: see :mod:`chunkmem.plan.cli`."""
from .cli import main

main()
