-- 002: remote sources (PUT /eas/rput): where an original came from, or lives.
--
-- An original registered by URL has one row here. Copied in, its bytes are
-- fetched by a copy step into storage (files.status 'copy' until then) and the
-- row only remembers where they came from; left on its remote, the original
-- has no stored bytes (files.storage_key stays null) and every step that
-- reads it reads the URL.
--
-- retry_since starts the give-up clock of rput.give_up_after: for a copy, when
-- it was queued; for a file left on its remote, at its first failure since the
-- remote last answered (null while it answers).

ALTER TABLE files DROP CONSTRAINT files_status_check;
ALTER TABLE files ADD CONSTRAINT files_status_check
    CHECK (status IN ('new', 'copy', 'metadata', 'sync', 'produce', 'done', 'error'));

CREATE TABLE remote_sources (
    file_id         bigint      PRIMARY KEY REFERENCES files (id) ON DELETE CASCADE,
    url             text        NOT NULL,
    leave_on_remote boolean     NOT NULL,
    retry_since     timestamptz,
    checked_at      timestamptz
);
