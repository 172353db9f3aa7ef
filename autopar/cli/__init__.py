"""The ``autopar`` command line: ``plan``, ``solve`` and ``train``."""
