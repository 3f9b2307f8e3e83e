"""The wire schema version, and the rule for changing it.

Every message on a sluice topic carries ``schema_version``. This module says which version this
code speaks and when the number moves.

The rule:

* ``SCHEMA_VERSION`` is a single integer, bumped only for a *breaking* change: removing or renaming
  a field, changing a field's type or meaning, or narrowing what a field accepts.
* *Additive* changes keep the number: a new optional request field, a new event field, a new
  error code, a new event ``type``. They are safe because of the unknown-field policy:

  - requests are validated strictly (unknown fields are rejected), so an old client never sends
    a field a new server misreads; a new client using a new field against an old server gets a
    clear ``invalid_request`` error naming the field instead of having it silently ignored;
  - event consumers ignore unknown fields (and skip unknown event types), so events can grow
    without breaking readers.

* A request whose ``schema_version`` is not supported is rejected with the error code
  ``unsupported_schema_version``. A request without ``schema_version`` is read as version 1.
"""

SCHEMA_VERSION: int = 1
"""The version this code writes on every message and accepts in requests."""

SUPPORTED_VERSIONS: frozenset[int] = frozenset({SCHEMA_VERSION})
"""Versions accepted in requests (today only the current one)."""
