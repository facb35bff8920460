"""What every daemon's process shares: the log format, start-up failures, signals.

:mod:`~trio_broker_daemons.runtime.logfmt` writes the log lines (logfmt or JSON);
:mod:`~trio_broker_daemons.runtime.process` runs a daemon under ``trio.run``,
turns a start-up failure into one printed line and an exit status, and watches
SIGTERM and SIGINT.
"""
