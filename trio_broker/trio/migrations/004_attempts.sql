-- 004: each claim's end, kept for operators, and why a waiting row waits.
--
-- broker_attempts has one row per claim of a queue row that ended: requeued,
-- failed, cancelled by an operator, or taken back from a backend that stopped
-- heartbeating. It names the backend that held the claim, the execserver
-- instance that ran the job (when its receipt came back), when the claim began
-- and ended, the outcome (the dispatch core's name: no_slot, failed, ...), the
-- reason, and the receipt's decisive line. A row that completes takes its
-- attempts with it (the table holds what is still to do or to look at, like
-- broker_queue); deleting the queue rows of a file deletes their attempts.
--
-- broker_queue.waits_because is why a new row waits now: the reason of its
-- last requeue (no slot in time, a service nobody offers, an execserver that
-- drained), null once it is claimed again, fails, or was never requeued.

CREATE TABLE broker_attempts (
    item_id       bigint      NOT NULL,
    attempt       integer     NOT NULL,
    file_ref      text        NOT NULL,
    action        text        NOT NULL,
    backend_id    text        NOT NULL,
    instance_id   text,
    started_at    timestamptz NOT NULL,
    ended_at      timestamptz NOT NULL DEFAULT now(),
    outcome       text        NOT NULL,
    reason        text,
    decisive_line text,
    PRIMARY KEY (item_id, attempt)
);
-- the attempts of one file's rows (deleting a file)
CREATE INDEX broker_attempts_file ON broker_attempts (file_ref);

ALTER TABLE broker_queue ADD COLUMN waits_because text;
