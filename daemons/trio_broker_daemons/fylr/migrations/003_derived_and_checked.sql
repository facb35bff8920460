-- 003: originals produced first, manual versions, and what the local actions record.
--
--   pending_produce  an original whose own produce step (a class's conversion,
--                    or a modified original's rotate/crop/format) is queued
--                    or running; it goes on to new (metadata) or sync
--   manual           a version uploaded by hand (PUT /eas/put?original=ID&version=NAME)
--                    or a produce-first original's upload as delivered: done
--                    from the start, no produce hash, never touched by a sync
--   derived_from     a modified original's source original (null once that is deleted)
--   derivation       what was asked of it: {"rotate": …, "crop": [x, y, w, h], "format": …}
--   checked_at       when the checksum action last read the stored bytes
--   damage           why the stored bytes cannot be trusted (a checksum mismatch,
--                    bytes gone), null while they are fine; sync_check makes a
--                    damaged produced version again

ALTER TABLE files DROP CONSTRAINT files_status_check;
ALTER TABLE files ADD CONSTRAINT files_status_check CHECK (
    status IN ('pending_produce', 'new', 'copy', 'metadata', 'sync', 'produce', 'done', 'error'));

ALTER TABLE files ADD COLUMN manual boolean NOT NULL DEFAULT false;
ALTER TABLE files DROP CONSTRAINT files_version_has_a_hash;
ALTER TABLE files ADD CONSTRAINT files_version_has_a_hash
    CHECK (kind = 'original' OR manual OR produce_hash IS NOT NULL);
ALTER TABLE files ADD CONSTRAINT files_manual_is_a_version CHECK (NOT manual OR kind = 'version');

ALTER TABLE files ADD COLUMN derived_from bigint REFERENCES files (id) ON DELETE SET NULL;
ALTER TABLE files ADD COLUMN derivation jsonb;
ALTER TABLE files ADD COLUMN checked_at timestamptz;
ALTER TABLE files ADD COLUMN damage text;

-- the originals made from one (the source's document lists them)
CREATE INDEX files_derived_from ON files (derived_from) WHERE derived_from IS NOT NULL;
