"""The configuration both daemons share: YAML in, frozen values out.

Each daemon's configuration class (:mod:`trio_broker_daemons.execserver.config`,
:mod:`trio_broker_daemons.fylr.config`) is built from the parts here:

- :mod:`~trio_broker_daemons.config.values`: the one error type
  (:class:`~trio_broker_daemons.config.values.ConfigError`), durations, sizes and
  thread counts;
- :mod:`~trio_broker_daemons.config.sources`: where a document comes from (the
  YAML file, ``TRIO_BROKER_…`` variables, ``<key>_file`` secret files);
- :mod:`~trio_broker_daemons.config.rules`: the field rules the classes share
  (strings, paths relative to the file, integers, listen addresses);
- :mod:`~trio_broker_daemons.config.structure`: the one cattrs converter (strict
  primitives, unknown keys refused), the error paths with their "did you mean"
  hints, and :func:`~trio_broker_daemons.config.structure.load_config`, which ties
  the steps together.

Every problem raises a ``ConfigError``, whose text is one line that starts with
the dotted key path, then says what was expected and what came::

    services.ffmpeg.max_slots: expected an integer, got 'two'

Only the first problem is reported. An unknown key is reported before any other
problem of the same mapping (a typo usually explains the rest).

Where values come from (:func:`~trio_broker_daemons.config.structure.load_config`):

* **The file.** Relative paths in it (the execserver's ``temp_dir``, ``tls.cert``,
  ``tls.key``, a ``broker_token_file``) are relative to the folder of the file,
  not to the working directory, so an example configuration works from any folder.
* **The environment** (when the caller passes it; the daemons do): every key can
  be set by ``TRIO_BROKER_<KEY>``, nested keys joined by ``__``
  (``TRIO_BROKER_BROKER_TOKEN``, ``TRIO_BROKER_TLS__CERT``,
  ``TRIO_BROKER_SERVICES__VIDEO__MAX_SLOTS=4``). A variable wins over the file.
  Keys that hold text take the variable as it is; other values are read as YAML.
* **Secret files.** ``broker_token_file: PATH`` reads the token from a file (its
  text without the final line ending), e.g. a mounted Kubernetes or Docker
  secret. Giving ``broker_token`` too is an error.

Value conventions:

* **Durations** are strings of one or more ``<number><unit>`` parts, units ``ms``,
  ``s``, ``m``, ``h``, ``d`` (``"10s"``, ``"30m"``, ``"1h30m"``, ``"1.5s"``,
  ``"500ms"``), the string ``"0"``, or a plain YAML number of seconds (not a
  boolean). They are stored as ``float`` seconds; where a key allows "none", a zero
  duration is stored as ``None``.
* **Sizes** are a YAML integer of bytes or a string ``<number>[unit]``: ``K``,
  ``M``, ``G``, ``T``, ``P`` and ``KiB`` … ``PiB`` are powers of 1024 (``"512M"``,
  ``"1.5GiB"``); ``KB`` … ``PB`` are powers of 1000; ``B`` or no unit is bytes.
  Units are case-insensitive. Stored as ``int`` bytes, always > 0.
* ``null`` is accepted only where the documented default is null, and means that
  default.
* Integers are YAML integers: ``"2"``, ``true`` and ``2.5`` are refused. Strings
  are YAML strings: a number or ``yes`` is refused (quote it).
"""
