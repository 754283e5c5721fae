-- API keys of the HTTP gateway: each key belongs to exactly one tenant.
--
-- Only the SHA-256 of a key is stored (keys are 256-bit random strings, so a plain hash
-- is enough); `key_prefix` (the first characters) lets an operator tell keys apart in
-- listings. A key is revoked by setting `revoked_at`; rows are never deleted, so a
-- revoked key's hash can never be reused.
--
-- The gateway only reads this table: give its login user the `toolfleet_gateway` role
-- (SELECT on api_keys, nothing else). `toolfleet admin keys` writes it as the admin user.

CREATE TABLE IF NOT EXISTS api_keys (
    id          uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    tenant_id   text NOT NULL CHECK (tenant_id <> ''),
    name        text NOT NULL DEFAULT '',
    key_hash    text NOT NULL UNIQUE CHECK (length(key_hash) = 64),
    key_prefix  text NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now(),
    revoked_at  timestamptz
);

CREATE INDEX IF NOT EXISTS api_keys_tenant ON api_keys (tenant_id);

DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'toolfleet_gateway') THEN
        CREATE ROLE toolfleet_gateway NOLOGIN;
    END IF;
EXCEPTION
    WHEN duplicate_object OR unique_violation THEN NULL;
END
$$;

DO $$
BEGIN
    EXECUTE format('GRANT CONNECT ON DATABASE %I TO toolfleet_gateway', current_database());
END
$$;

GRANT USAGE ON SCHEMA public TO toolfleet_gateway;
GRANT SELECT (id, tenant_id, name, key_hash, revoked_at) ON api_keys TO toolfleet_gateway;
