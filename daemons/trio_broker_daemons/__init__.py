"""The reference daemons: ``trio-broker execserver``, ``trio-broker fylr`` and the CLI.

Applications built on the library's public API, shipped in the same wheel: the
library (:mod:`trio_broker`) never imports this package. Here live the command
line and signals (:mod:`~trio_broker_daemons.cli`, :mod:`~trio_broker_daemons.daemon`),
the log format, the execserver's YAML configuration and its translation into
library values (:mod:`~trio_broker_daemons.config`,
:mod:`~trio_broker_daemons.execserver`), the fylr file server
(:mod:`trio_broker_daemons.fylr`), the upload command and the private PostgreSQL
cluster manager.
"""
