#!/bin/bash
# The official postgres image's entrypoint, in brief: on an empty data directory, initdb
# with POSTGRES_USER/POSTGRES_PASSWORD, a temporary server on the Unix socket only,
# POSTGRES_DB created, every /docker-entrypoint-initdb.d/*.sh (executed when executable,
# else sourced) and *.sql run against it, the temporary server stopped; then the real
# server in the foreground, listening on every address with password logins.
set -Eeuo pipefail

if [ "${1:-}" != "postgres" ]; then
    exec "$@"
fi
shift

if [ "$(id -u)" = "0" ]; then
    mkdir -p "$PGDATA" /run/postgresql
    chown -R postgres:postgres "$PGDATA" /run/postgresql
    chmod 700 "$PGDATA"
    exec setpriv --reuid=postgres --regid=postgres --init-groups "$0" postgres "$@"
fi

export POSTGRES_USER="${POSTGRES_USER:-postgres}"
export POSTGRES_DB="${POSTGRES_DB:-$POSTGRES_USER}"

if [ ! -s "$PGDATA/PG_VERSION" ]; then
    : "${POSTGRES_PASSWORD:?POSTGRES_PASSWORD is not set}"
    initdb --username="$POSTGRES_USER" --pwfile=<(printf '%s\n' "$POSTGRES_PASSWORD") \
        --auth-local=trust --auth-host=scram-sha-256 -D "$PGDATA" >/dev/null
    printf 'host all all all scram-sha-256\n' >> "$PGDATA/pg_hba.conf"
    printf "listen_addresses = '*'\n" >> "$PGDATA/postgresql.auto.conf"

    pg_ctl -D "$PGDATA" -w -o "-c listen_addresses='' -c unix_socket_directories=/run/postgresql" start >/dev/null
    psql=(psql -v ON_ERROR_STOP=1 --no-psqlrc --username "$POSTGRES_USER" --host /run/postgresql)
    if [ "$POSTGRES_DB" != "postgres" ]; then
        "${psql[@]}" --dbname postgres --set db="$POSTGRES_DB" <<<'CREATE DATABASE :"db";' >/dev/null
    fi
    export PGHOST=/run/postgresql
    for f in /docker-entrypoint-initdb.d/*; do
        case "$f" in
            *.sh)
                if [ -x "$f" ]; then
                    echo "running $f"; "$f"
                else
                    echo "sourcing $f"; . "$f"
                fi
                ;;
            *.sql) echo "running $f"; "${psql[@]}" --dbname "$POSTGRES_DB" -f "$f" ;;
            *) ;;
        esac
    done
    unset PGHOST
    pg_ctl -D "$PGDATA" -m fast -w stop >/dev/null
    echo "PostgreSQL init process complete; ready for start up."
fi

exec postgres -D "$PGDATA" "$@"
