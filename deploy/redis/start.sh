#!/bin/sh
# Starts redis-server with the ACL file's development passwords replaced by the
# TOOLFLEET_REDIS_*_PASSWORD variables, so no committed password is ever live.
#
#   start.sh CONF ACL [redis-server options...]
#
# Every user of ACL whose development password (`>toolfleet-dev-redis-<role>password`) is
# in the file needs its variable: toolfleet TOOLFLEET_REDIS_PASSWORD, worker
# TOOLFLEET_REDIS_WORKER_PASSWORD, exporter TOOLFLEET_REDIS_EXPORTER_PASSWORD,
# replication TOOLFLEET_REDIS_REPLICATION_PASSWORD (also the replicas' masterauth), admin
# TOOLFLEET_REDIS_ADMIN_PASSWORD. A missing or unusable one stops the start. The
# rewritten file goes to $TMPDIR (default /tmp), never over ACL.
set -eu
conf="$1"
acl="$2"
shift 2
out="${TMPDIR:-/tmp}/toolfleet-users.acl"
umask 077
awk '
function swap(line, from, to,   out, i) {
    out = ""
    while ((i = index(line, from)) > 0) {
        out = out substr(line, 1, i - 1) to
        line = substr(line, i + length(from))
    }
    return out line
}
function password(role, variable,   from, value) {
    from = ">toolfleet-dev-redis-" role "password"
    if (index($0, from) == 0) return
    value = ENVIRON[variable]
    if (value == "" || value ~ /[[:space:]>]/) {
        printf "start.sh: set %s (no spaces, no >) for the ACL user of %s\n", variable, FILENAME > "/dev/stderr"
        exit 1
    }
    $0 = swap($0, from, ">" value)
}
{
    password("", "TOOLFLEET_REDIS_PASSWORD")
    password("worker-", "TOOLFLEET_REDIS_WORKER_PASSWORD")
    password("exporter-", "TOOLFLEET_REDIS_EXPORTER_PASSWORD")
    password("replication-", "TOOLFLEET_REDIS_REPLICATION_PASSWORD")
    password("admin-", "TOOLFLEET_REDIS_ADMIN_PASSWORD")
    print
}
' "$acl" > "$out"
if [ -n "${TOOLFLEET_REDIS_REPLICATION_PASSWORD:-}" ]; then
    set -- --masterauth "$TOOLFLEET_REDIS_REPLICATION_PASSWORD" "$@"
fi
exec redis-server "$conf" --aclfile "$out" "$@"
