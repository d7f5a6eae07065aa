-- The data plane waits for the schema before its stages start (`ibex wait-schema`, the chart's init container):
-- it reads which migrations are applied, with its own role. Until this grant is applied that read is refused,
-- which the wait takes as "not yet".
GRANT SELECT ON schema_migrations TO ibex_app;
