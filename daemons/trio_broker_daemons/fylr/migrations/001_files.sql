-- 002: the files of the reference fylr daemon, beside the work queue.
--
-- A row is an original (an upload) or a version (a rendition of an original,
-- made from the original or from another version of it). Its status is the
-- file worker's internal state (trio_broker_daemons.fylr.produce):
--   new       original: stored, first step queued; version: created by sync
--   metadata  original: its metadata step was claimed
--   sync      original: metadata known, sync queued or running
--   produce   original: versions being produced; version: its produce was claimed
--   done      finished: content and metadata stored
--   error     failed for good; error says why
-- The work itself lives in the library's broker_queue (file_ref = the row's id
-- as text).

CREATE TABLE files (
    id           bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    kind         text        NOT NULL CHECK (kind IN ('original', 'version')),
    -- the original a version belongs to (deleting an original deletes its versions)
    parent_id    bigint      REFERENCES files (id) ON DELETE CASCADE,
    -- the version's name; null for an original
    version      text,
    -- the version it is made from; null = made from the original (and for originals)
    source       text,
    filename     text        NOT NULL,
    class        text,
    status       text        NOT NULL DEFAULT 'new'
                             CHECK (status IN ('new', 'metadata', 'sync', 'produce', 'done', 'error')),
    priority     integer     NOT NULL DEFAULT 0,
    -- where the content is stored (trio_broker_daemons.fylr.storage keys); null until stored
    storage_key  text,
    size         bigint,
    sha256       text,
    mimetype     text,
    metadata     jsonb       NOT NULL DEFAULT '{}'::jsonb,
    -- the recipe and input a version was made for (trio_broker_daemons.fylr.produce.produce_hash)
    produce_hash text,
    error        text,
    created_at   timestamptz NOT NULL DEFAULT now(),
    updated_at   timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT files_original_has_no_parent CHECK ((kind = 'original') = (parent_id IS NULL)),
    CONSTRAINT files_version_has_a_name CHECK ((kind = 'version') = (version IS NOT NULL)),
    CONSTRAINT files_version_has_a_hash CHECK (kind = 'original' OR produce_hash IS NOT NULL),
    CONSTRAINT files_one_version_per_name UNIQUE (parent_id, version)
);

-- an original's versions (sync, the API, the "all versions finished" check)
CREATE INDEX files_parent ON files (parent_id) WHERE parent_id IS NOT NULL;
-- counts by kind and status (inspection, metrics)
CREATE INDEX files_status ON files (kind, status);
