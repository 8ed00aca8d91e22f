"""``python -m mbert.runtime.cli``: the ``mbert-run`` command line."""
from mbert.runtime.cli import main

main()
