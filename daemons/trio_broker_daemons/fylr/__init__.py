"""The reference fylr daemon: a file server whose work runs on the execservers.

Uploads come in over HTTP; their metadata and versions are made on the
execservers through the broker, the PostgreSQL queue and one-time pipes. The
application is wired in :mod:`~trio_broker_daemons.fylr.app` from its HTTP API
(:mod:`~trio_broker_daemons.fylr.api`), its queue worker
(:mod:`~trio_broker_daemons.fylr.worker`) and its inspection pages
(:mod:`~trio_broker_daemons.fylr.metrics`), which share one
:mod:`~trio_broker_daemons.fylr.state`; its configuration, decisions, files
table, storage and private PostgreSQL cluster
(:mod:`~trio_broker_daemons.fylr.pgcluster`) are the other modules of this
package. The process (configuration problems, signals) is
:mod:`~trio_broker_daemons.fylr.daemon`.
"""
