-- 002: each backend's own view of the installation, published with its heartbeat.
-- (003_broker_names.sql renames backends to broker_backends.)
--
-- A backend (a client process draining the queue) writes a JSON document here:
-- what it reaches (execservers, balancers) and what it does, so that any backend
-- can draw every other one without addressing it. view_at is when it was written
-- (the database's clock); null until the first publication.

ALTER TABLE backends ADD COLUMN view jsonb;
ALTER TABLE backends ADD COLUMN view_at timestamptz;
