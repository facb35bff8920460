"""The reference execserver daemon: run jobs in the configured services' slots.

Its YAML configuration is :mod:`~trio_broker_daemons.execserver.config`; the
translation into the library's values and the service that serves them is
:mod:`~trio_broker_daemons.execserver.app`
(:func:`~trio_broker_daemons.execserver.app.serve_from_config`); the process
(configuration problems, warnings, signals and draining) is
:mod:`~trio_broker_daemons.execserver.daemon`.
"""
