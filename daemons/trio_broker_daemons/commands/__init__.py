"""The ``trio-broker`` command line: its parser and the commands that are no daemon.

:mod:`~trio_broker_daemons.commands.cli` parses the command line and starts a
daemon (:mod:`trio_broker_daemons.execserver`, :mod:`trio_broker_daemons.fylr`) or
one of the client commands here: ``upload``
(:mod:`~trio_broker_daemons.commands.upload`), ``position``
(:mod:`~trio_broker_daemons.commands.position`), ``top``
(:mod:`~trio_broker_daemons.commands.top`), ``storage``
(:mod:`~trio_broker_daemons.commands.storage`) and ``fylr requeue``
(:mod:`~trio_broker_daemons.commands.requeue`).
"""
