-- 003: the queue's tables take the library's names (file_queue -> broker_queue,
-- backends -> broker_backends), with their indexes, constraints and identity
-- sequence. A rename keeps every row, every claim and every heartbeat as it was;
-- an application's tables beside them are untouched.

ALTER TABLE file_queue RENAME TO broker_queue;
ALTER SEQUENCE file_queue_id_seq RENAME TO broker_queue_id_seq;
ALTER INDEX file_queue_pkey RENAME TO broker_queue_pkey;
ALTER INDEX file_queue_ready RENAME TO broker_queue_ready;
ALTER INDEX file_queue_ready_odd RENAME TO broker_queue_ready_odd;
ALTER INDEX file_queue_claimed RENAME TO broker_queue_claimed;
ALTER INDEX file_queue_file RENAME TO broker_queue_file;
ALTER TABLE broker_queue RENAME CONSTRAINT file_queue_claim_owner TO broker_queue_claim_owner;
ALTER TABLE broker_queue RENAME CONSTRAINT file_queue_status_check TO broker_queue_status_check;

ALTER TABLE backends RENAME TO broker_backends;
ALTER INDEX backends_pkey RENAME TO broker_backends_pkey;
