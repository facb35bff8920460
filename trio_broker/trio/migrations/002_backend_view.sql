-- 002: each backend's own view of the installation, published with its heartbeat.
--
-- A backend (a client process draining file_queue) writes a JSON document here:
-- what it reaches (execservers, balancers) and what it does, so that any backend
-- can draw every other one without addressing it. view_at is when it was written
-- (the database's clock); null until the first publication.

ALTER TABLE backends ADD COLUMN view jsonb;
ALTER TABLE backends ADD COLUMN view_at timestamptz;
