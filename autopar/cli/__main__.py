"""``python -m autopar.cli``: the same as the ``autopar`` command."""

from autopar.cli import main

raise SystemExit(main())
