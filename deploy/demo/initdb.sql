-- Run once by the postgres image when its volume is new: the demo's least-privilege drain role.
-- Its privileges are granted by the migrate service (deploy/database/drain-role.sql) after the tables exist.
CREATE ROLE drain LOGIN PASSWORD 'drain-demo';
