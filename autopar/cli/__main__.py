"""``python -m autopar.cli``: the same as the ``autopar`` command."""

from autopar.cli.main import main

raise SystemExit(main())
