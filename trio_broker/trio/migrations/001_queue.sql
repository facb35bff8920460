-- 001: the work queue and the backends (client processes) that drain it.
-- (003_broker_names.sql renames file_queue to broker_queue and backends to
-- broker_backends: the names below are the tables' first ones.)
--
-- A row of file_queue is one unit of work on one file. Its life:
--   new      waiting; claimable once start_after has passed
--   claimed  a backend (claimed_by) runs it; attempts counts the claims and
--            fences late outcomes of an earlier claim
--   failed   a hard failure; last_error says why
-- A finished item's row is deleted.

CREATE TABLE file_queue (
    id          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    file_ref    text        NOT NULL,
    action      text        NOT NULL,
    priority    integer     NOT NULL DEFAULT 0,
    status      text        NOT NULL DEFAULT 'new'
                            CHECK (status IN ('new', 'claimed', 'failed')),
    start_after timestamptz NOT NULL DEFAULT now(),
    claimed_by  text,
    claimed_at  timestamptz,
    attempts    integer     NOT NULL DEFAULT 0,
    last_error  text,
    payload     jsonb       NOT NULL DEFAULT '{}'::jsonb,
    created_at  timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT file_queue_claim_owner CHECK ((status = 'claimed') = (claimed_by IS NOT NULL))
);

-- the claim order: priority DESC, id ASC among the rows that are new
CREATE INDEX file_queue_ready ON file_queue (priority DESC, id) WHERE status = 'new';
-- the same for the odd ("high") priorities, so a claim for the reserved slots
-- does not walk past every even row
CREATE INDEX file_queue_ready_odd ON file_queue (priority DESC, id)
    WHERE status = 'new' AND priority % 2 <> 0;
-- returning a backend's rows (shutdown, stale heartbeat)
CREATE INDEX file_queue_claimed ON file_queue (claimed_by) WHERE status = 'claimed';
-- the work queued for one file
CREATE INDEX file_queue_file ON file_queue (file_ref);

CREATE TABLE backends (
    backend_id text        PRIMARY KEY,
    name       text        NOT NULL,
    started    timestamptz NOT NULL DEFAULT now(),
    heartbeat  timestamptz NOT NULL DEFAULT now()
);
