"""``python -m trio_broker_daemons``: the same as the ``trio-broker`` command."""

from trio_broker_daemons.commands.cli import main

raise SystemExit(main())
