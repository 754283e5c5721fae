#!/bin/sh
# Run once by the postgres image when it creates its database (it runs every script in
# /docker-entrypoint-initdb.d): the HTTP gateway's login user, a member of the
# `toolfleet_gateway` role that migrations/0004_api_keys.sql grants SELECT on the API
# keys and nothing else. The password comes from TOOLFLEET_GATEWAY_DB_PASSWORD; the
# gateway never logs in as the superuser.
set -eu
: "${TOOLFLEET_GATEWAY_DB_PASSWORD:?set TOOLFLEET_GATEWAY_DB_PASSWORD}"
psql -v ON_ERROR_STOP=1 --username "${POSTGRES_USER:-postgres}" --dbname "${POSTGRES_DB:-postgres}" \
  -v password="$TOOLFLEET_GATEWAY_DB_PASSWORD" <<'SQL'
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'toolfleet_gateway') THEN
        CREATE ROLE toolfleet_gateway NOLOGIN;
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'toolfleet_gateway_login') THEN
        CREATE ROLE toolfleet_gateway_login LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE;
    END IF;
END
$$;
GRANT toolfleet_gateway TO toolfleet_gateway_login;
ALTER ROLE toolfleet_gateway_login PASSWORD :'password';
SQL
