#!/bin/bash
# toolfleet-probe PORT PATH: exits 0 when http://127.0.0.1:PORT/PATH answers 200.
# Used by container health checks; needs only bash, so the image carries no HTTP client.
set -u
port="${1:?usage: toolfleet-probe PORT PATH}"
path="${2:-/healthz}"
exec 3<>"/dev/tcp/127.0.0.1/${port}" || exit 1
printf 'GET %s HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n' "${path}" >&3
read -r -t 3 _ status _ <&3 || exit 1
[ "${status}" = "200" ]
