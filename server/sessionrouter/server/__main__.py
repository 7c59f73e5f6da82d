"""``python -m sessionrouter.server``: the same as the ``sessionrouter`` command."""

from sessionrouter.server.cli import main

raise SystemExit(main())
