#!/bin/sh
# The nesa-node image's entrypoint (under tini): runs `nesa-node ARGS`.
#
# NESA_BOOTSTRAP_FILE names a file of the bootstrap peer's multiaddrs, one a line: the `--address-file` of a
# `nesa-node dht`, on a volume both containers mount. `run`, `gateway`, `generate` and `status` then get them as
# --initial-peers, once the file exists (waiting up to NESA_BOOTSTRAP_WAIT_S seconds, default 60). The bootstrap keeps
# its address across restarts (a fixed --identity and --port), so the file stays right while it is down.
set -eu

case "${1:-}" in
run | gateway | generate | status)
    if [ -n "${NESA_BOOTSTRAP_FILE:-}" ]; then
        waited=0
        until [ -s "$NESA_BOOTSTRAP_FILE" ]; do
            if [ "$waited" -ge "${NESA_BOOTSTRAP_WAIT_S:-60}" ]; then
                echo "nesa-entrypoint: no bootstrap address in $NESA_BOOTSTRAP_FILE after $waited s" >&2
                exit 1
            fi
            sleep 1
            waited=$((waited + 1))
        done
        # one multiaddr a line: each becomes an argument of --initial-peers
        # shellcheck disable=SC2046
        set -- "$@" --initial-peers $(cat "$NESA_BOOTSTRAP_FILE")
    fi
    ;;
esac
exec nesa-node "$@"
