"""``python -m trio_broker``: the same as the ``trio-broker`` command."""

from trio_broker.cli import main

raise SystemExit(main())
