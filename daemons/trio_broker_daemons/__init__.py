"""The reference daemons: ``trio-broker execserver``, ``trio-broker fylr`` and the CLI.

Applications built on the library's public API, shipped in the same wheel: the
library (:mod:`trio_broker`) never imports this package. One folder per part:

- :mod:`~trio_broker_daemons.commands`: the ``trio-broker`` command line and its
  client commands (``upload``, ``position``, ``top``, ``fylr requeue``);
- :mod:`~trio_broker_daemons.config`: the configuration both daemons share (YAML,
  ``TRIO_BROKER_…`` variables, secret files, durations and sizes, the converter);
- :mod:`~trio_broker_daemons.execserver`: the execserver daemon (its configuration,
  its translation into library values, its process);
- :mod:`~trio_broker_daemons.fylr`: the fylr file server (its API, queue worker,
  storage, configuration, private PostgreSQL cluster, process);
- :mod:`~trio_broker_daemons.runtime`: what every daemon's process shares (the log
  format, start-up failures, signals).
"""
