"""The reference fylr daemon: a file server whose work runs on the execservers.

Uploads come in over HTTP; their metadata and versions are made on the
execservers through the broker, the PostgreSQL queue and one-time pipes. The
application is :mod:`~trio_broker_daemons.fylr.app`; its configuration,
decisions, files table and storage are the other modules of this package.
"""
